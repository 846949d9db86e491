"""Wiring: the E2B apps, their registry of sandboxes, and the door that leads to them."""

from __future__ import annotations

from fastapi import FastAPI

from kernel_env.server.e2b.control import CONTROL_PREFIXES, control_app
from kernel_env.server.e2b.door import E2BDoor
from kernel_env.server.e2b.envd import ENVD_PORT, envd_app
from kernel_env.server.e2b.failures import too_large
from kernel_env.server.e2b.interpreter import JUPYTER_PORT, interpreter_app
from kernel_env.server.e2b.sandboxes import Sandboxes
from kernel_env.server.limits import BodyLimit
from kernel_env.server.sessions import SessionManager

__all__ = ["mount"]

_CONTROL_BODY = 1 << 20  # the control plane's requests are small JSON documents
_CONTEXT_BODY = 64 << 10  # the code interpreter's other routes: a language and a directory


def mount(app: FastAPI) -> None:
    settings = app.state.settings

    def sessions() -> SessionManager:
        found: SessionManager = app.state.runtime.sessions
        return found

    def sandboxes() -> Sandboxes:
        # One registry per runtime: an app whose lifespan runs again has new sessions.
        registry = getattr(app.state, "e2b_sandboxes", None)
        if registry is None or registry.sessions is not sessions():
            registry = Sandboxes(sessions(), paused_ttl=settings.paused_ttl)
            app.state.e2b_sandboxes = registry
        return registry

    control = control_app(lambda: app.state.tenants, sandboxes)
    step = settings.step_body_bytes  # a cell's code, bounded as OpenEnv's /step is
    interpreter = BodyLimit(
        interpreter_app(sandboxes),
        step,
        per_path={"/execute": step},
        default_bytes=min(step, _CONTEXT_BODY),
        refusal=too_large,
    )
    app.add_middleware(
        E2BDoor,
        control=BodyLimit(control, _CONTROL_BODY, refusal=too_large),
        control_prefixes=CONTROL_PREFIXES,
        ports={
            JUPYTER_PORT: interpreter,
            ENVD_PORT: BodyLimit(
                envd_app(sessions),
                settings.max_message_bytes,
                refusal=too_large,
                streamed=frozenset({"/files"}),  # uploads stream to the kernel in chunks
            ),
        },
        files_port=ENVD_PORT,
        sandboxes=sandboxes,
    )
