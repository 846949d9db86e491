"""OpenEnv's own dialect of ``POST /mcp``: what OpenEnv 0.10's ``MCPToolClient`` sends (its
one mode, "production"), beside MCP's streamable HTTP on the same path.

The client opens a session with ``openenv/session/create`` (answered ``{"session_id": id}``;
no kernel work yet), attaches ``/ws?session_id=<id>`` for reset, step and state
(:mod:`kernel_env.server.openenv.websocket`), and sends ``tools/list`` and ``tools/call``
here with the id in the params, so the socket and the HTTP calls share one episode: the
tools run through OpenEnv's tool steps (:class:`~kernel_env.server.openenv.tool_steps.ToolSteps`),
whose notebook the socket's reset made, with its verify commands. ``openenv/session/close``
ends the session. A message is in this dialect when it carries no ``Mcp-Session-Id`` header
and its method is ``openenv/...`` or its params name a ``session_id``.

Every answer is one JSON-RPC object with HTTP 200, errors included, as OpenEnv's server
answers; a ``tools/call`` result is FastMCP's ``CallToolResult`` as OpenEnv serializes it
(``content``, ``structured_content``, ``data``, ``is_error``), whose ``data`` the client
returns. The token (401) and the body limit (413) are checked before this is reached, as on
every route; an id that is not the caller's is answered exactly as one that never existed.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kernel_env.errors import SessionError, UnknownSession
from kernel_env.server import tools
from kernel_env.server.auth import tenant_of
from kernel_env.server.mcp import protocol
from kernel_env.server.mcp.failures import rpc_error_for
from kernel_env.server.mcp.protocol import RpcError
from kernel_env.server.openenv.tool_steps import ToolSteps
from kernel_env.server.runtime import Runtime
from kernel_env.server.sessions import Session

__all__ = ["answer", "speaks_openenv"]

CREATE, CLOSE = "openenv/session/create", "openenv/session/close"
UNKNOWN = f"Unknown session_id: no open session of yours has this id; create one with {CREATE}"
_KINDS = {"tool_not_found": protocol.INVALID_PARAMS, "invalid_args": protocol.INVALID_PARAMS}


def speaks_openenv(request: Request, message: protocol.Message) -> bool:
    """Whether ``message`` is in OpenEnv's dialect (else MCP's streamable HTTP)."""
    if protocol.SESSION_HEADER in request.headers:
        return False
    return str(message.method).startswith("openenv/") or "session_id" in message.params


async def answer(request: Request, message: protocol.Message) -> Response:
    """The reply to one message of OpenEnv's dialect: always HTTP 200."""
    try:
        value = await _answer(request, message)
    except Exception as exc:
        error = _error_for(exc)
        return JSONResponse(protocol.error(message.id, error.code, error.message))
    return JSONResponse(protocol.result(message.id, value))


async def _answer(request: Request, message: protocol.Message) -> dict[str, Any]:
    runtime: Runtime = request.app.state.runtime
    if message.method == CREATE:
        session = runtime.sessions.open("http", tenant_of(request), claimed=True)
        return {"session_id": session.id}
    session = _session(request, message.params.get("session_id"))
    if message.method == CLOSE:
        await runtime.sessions.close_session(session)
        return {"session_id": session.id, "closed": True}
    if message.method == "tools/list":
        return {"tools": tools.TOOLS}
    name, arguments = protocol.tool_call(message)
    steps: ToolSteps = request.app.state.openenv_tools
    async with runtime.sessions.request(session):
        called = await steps.call(session, name, arguments, runtime.settings.step_timeout)
    if called["error"] is not None:
        code = _KINDS.get(called["error"]["error_type"], protocol.INTERNAL_ERROR)
        raise RpcError(code, called["error"]["message"])
    result: dict[str, Any] = called["result"]
    return result


def _session(request: Request, sid: Any) -> Session:
    if not isinstance(sid, str) or not sid:
        raise RpcError(protocol.INVALID_PARAMS, "Invalid params: 'session_id' is required")
    runtime: Runtime = request.app.state.runtime
    return runtime.sessions.get(sid, tenant_of(request))


def _error_for(exc: BaseException) -> RpcError:
    if isinstance(exc, UnknownSession):
        return RpcError(protocol.INVALID_PARAMS, UNKNOWN)
    if isinstance(exc, SessionError):  # the caller's own session, closed or expired
        return RpcError(protocol.INVALID_PARAMS, f"Session ended: {exc}")
    return rpc_error_for(exc)
