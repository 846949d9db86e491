"""Wiring: the E2B apps, their registry of sandboxes, and the door that leads to them."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request

from kernel_env.server.e2b.control import CONTROL_PREFIXES, control_app
from kernel_env.server.e2b.door import E2BDoor, sandbox_in
from kernel_env.server.e2b.envd import ENVD_PORT, envd_app
from kernel_env.server.e2b.interpreter import JUPYTER_PORT, interpreter_app
from kernel_env.server.e2b.kernelcalls import in_kernel
from kernel_env.server.e2b.sandboxes import Sandbox, Sandboxes
from kernel_env.server.limits import BodyLimit
from kernel_env.server.runtime import Runtime
from kernel_env.server.sessions import SessionManager

__all__ = ["mount"]

_CONTROL_BODY = 1 << 20  # the control plane's requests are small JSON documents


def mount(app: FastAPI) -> None:
    settings = app.state.settings

    def runtime() -> Runtime:
        found: Runtime = app.state.runtime
        return found

    def sessions() -> SessionManager:
        return runtime().sessions

    def sandboxes() -> Sandboxes:
        registry = getattr(app.state, "e2b_sandboxes", None)
        if registry is None or registry.sessions is not sessions():
            registry = Sandboxes(sessions())
            app.state.e2b_sandboxes = registry
        return registry

    def sandbox_of(request: Request) -> Sandbox:
        return sandbox_in(request.scope)

    async def prepare(sandbox: Sandbox) -> None:
        if sandbox.envs:  # E2B's envs: the kernel's variables, and so its commands'
            await in_kernel(sandbox.session, "set_envs", envs=sandbox.envs)

    limit = settings.max_message_bytes
    app.add_middleware(
        E2BDoor,
        control=BodyLimit(
            control_app(lambda: app.state.tenants, sandboxes, prepare), _CONTROL_BODY
        ),
        control_prefixes=CONTROL_PREFIXES,
        ports={
            JUPYTER_PORT: BodyLimit(interpreter_app(sandbox_of, sessions), limit),
            ENVD_PORT: BodyLimit(envd_app(sessions), limit),
        },
        sandboxes=sandboxes,
    )
