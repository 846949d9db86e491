"""``/api/kernels``: Jupyter Server's kernel REST API over sessions.

Every session that holds a kernel is one, whichever door opened it: an agent's episode over
``/ws``, HTTP or E2B is listed for its owner (and operators) and reachable by its channels,
so a person attaches to it (:mod:`.channels`). A kernel started here is a session of kind
``"jupyter"`` whose episode runs in a kernel of the name asked for: started from the
server's pool, sandboxed, with the helpers, counted toward ``--max-sessions`` (and the
tenant's share), reaped after ``--idle-ttl`` without a request. A kernel's id is its
session's written as a UUID (:attr:`Session.kernel_id`; Jupyter Server's routes take only
that form): the reset observation's ``kernel_id``, ``/sessions`` and ``/web`` give it, and
the notebook routes take the same 32 hex digits without the dashes. A restart is a reset (a
new episode in a fresh kernel, the same id); a shutdown closes the session.

The body of ``POST /api/kernels`` is Jupyter Server's (``name``, ``path``, ``env`` of
``KERNEL_*`` values, ``kernel_id``): read, checked for shape, and otherwise unused, since
nothing a client sends decides where or how the kernel runs.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from kernel_env import __version__
from kernel_env.errors import InvalidInput
from kernel_env.models import MAX_ITERATIONS
from kernel_env.server.auth import tenant_of
from kernel_env.server.jupyter.failures import no_such_kernel
from kernel_env.server.jupyter.kernelspecs import DEFAULT_KERNEL, available
from kernel_env.server.sessions import Session, SessionManager

__all__ = [
    "api",
    "connections",
    "find",
    "get_kernel",
    "id_of",
    "interrupt",
    "list_kernels",
    "reset_options",
    "restart",
    "shut_down",
    "start",
]

_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # as Jupyter Server writes it, and its gateway client parses


def _sessions(connection: HTTPConnection) -> SessionManager:
    found: SessionManager = connection.app.state.runtime.sessions
    return found


def connections(connection: HTTPConnection) -> Counter[str]:
    """The open channels sockets of each kernel (by id), one counter per app."""
    state = connection.app.state
    if not hasattr(state, "jupyter_connections"):
        state.jupyter_connections = Counter()
    found: Counter[str] = state.jupyter_connections
    return found


def id_of(session: Session) -> str:
    """The session's id as Jupyter writes a kernel's: a UUID."""
    return session.kernel_id


def _session_id(kernel_id: str) -> str:
    try:
        return uuid.UUID(kernel_id).hex
    except ValueError:
        return kernel_id


def _is_kernel(session: Session) -> bool:
    """Whether the session is a kernel here: one started here (a restart's new kernel
    included), or any episode that holds one (an agent's, to attach to)."""
    return session.kind == "jupyter" or session.holds_kernel


def find(connection: HTTPConnection, kernel_id: str) -> Session:
    """The kernel ``kernel_id`` if the caller may see it, else the one unknown-id error."""
    session = _sessions(connection).peek(_session_id(kernel_id), tenant_of(connection))
    if session is None or session.closed is not None or not _is_kernel(session):
        raise no_such_kernel(kernel_id)
    return session


def reset_options(name: str) -> dict[str, Any]:
    """A kernel's episode: no task, no context, and no end but its own."""
    return {"kernel_name": name, "max_iterations": MAX_ITERATIONS}


def model(connection: HTTPConnection, session: Session) -> dict[str, Any]:
    """Jupyter Server's kernel model of ``session``."""
    idle = asyncio.get_running_loop().time() - session.last_active
    last = datetime.now(UTC) - timedelta(seconds=max(0.0, idle))
    return {
        "id": id_of(session),
        "name": session.kernel_name or DEFAULT_KERNEL,
        "last_activity": last.strftime(_TIME),
        "execution_state": "busy" if session.busy else "idle",
        "connections": connections(connection)[session.id],
    }


async def api(request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__})


async def list_kernels(request: Request) -> JSONResponse:
    visible = _sessions(request).visible_to(tenant_of(request))
    return JSONResponse([model(request, s) for s in visible if _is_kernel(s)])


async def get_kernel(request: Request) -> JSONResponse:
    return JSONResponse(model(request, find(request, request.path_params["kernel_id"])))


async def _start_body(request: Request) -> str:
    """The kernel name a start asks for (its default if none), after the body's shape."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise InvalidInput("the body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body is a JSON object: name, path, env")
    env = body.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise InvalidInput("env is an object of strings")
    name = body.get("name") or DEFAULT_KERNEL
    if not isinstance(name, str) or name not in available(request):
        raise InvalidInput(f"No such kernel: {name!r}; GET /api/kernelspecs lists them")
    return name


async def start(request: Request) -> JSONResponse:
    name = await _start_body(request)
    manager = _sessions(request)
    session = manager.open("jupyter", tenant_of(request), claimed=True)
    try:
        async with manager.request(session):
            await session.reset(reset_options(name))
    except BaseException:
        await asyncio.shield(manager.close_soon(session))
        raise
    headers = {"Location": f"/api/kernels/{id_of(session)}"}
    return JSONResponse(model(request, session), status_code=201, headers=headers)


async def shut_down(request: Request) -> Response:
    session = find(request, request.path_params["kernel_id"])
    await _sessions(request).close_session(session)
    return Response(status_code=204)


async def interrupt(request: Request) -> Response:
    session = find(request, request.path_params["kernel_id"])
    await session.interrupt()
    return Response(status_code=204)


async def restart(request: Request) -> JSONResponse:
    """A new episode in a fresh kernel, under the same id: the running cell is interrupted
    first, as a restart ends it, and the reset waits for its step to return."""
    session = find(request, request.path_params["kernel_id"])
    if session.kind != "jupyter":
        raise InvalidInput(
            "this kernel is an agent's episode: its agent resets it, a restart here would end "
            "the episode; interrupt it, or shut it down"
        )
    await session.interrupt()
    async with _sessions(request).request(session):
        await session.reset(reset_options(session.kernel_name or DEFAULT_KERNEL))
    return JSONResponse(model(request, session))
