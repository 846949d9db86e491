"""MCP over streamable HTTP at ``/mcp``, as a route table: one MCP session, one episode.

``POST /mcp`` with ``initialize`` opens a session (its kernel starts, the reset's setup
commands run) and answers its id in the ``Mcp-Session-Id`` header; every later message names
it. Each request is answered with one JSON object (``application/json``; no SSE stream is
opened, so ``GET /mcp`` is 405); notifications get ``202``. ``DELETE /mcp`` ends the
session and frees its kernel; an idle one is reaped after ``--idle-ttl`` like any session.
The reset's options are the settings of the client's ``io.github.kernel-env/episode``
extension capability (:data:`~.protocol.RESET_EXTENSION`).

OpenEnv's own dialect (``openenv/session/create``, then ``tools/list`` and ``tools/call``
with the ``session_id`` in the params, shared with ``/ws?session_id=``) is served on the same
path by :mod:`.openenv_dialect`.

The token is checked as on every route (``Authorization: Bearer``). A request without one is
answered by :func:`probe`: 401, except a body that asks for nothing (``openenv validate``
posts ``{}``), which gets JSON-RPC's "invalid request", as before there were tools.
"""

from __future__ import annotations

import weakref
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kernel_env.models import ResetOptions
from kernel_env.server import tools
from kernel_env.server.auth import tenant_of
from kernel_env.server.mcp import openenv_dialect, protocol
from kernel_env.server.mcp.failures import GONE, rpc_error_for
from kernel_env.server.mcp.protocol import RpcError
from kernel_env.server.runtime import Runtime
from kernel_env.server.sessions import Session

__all__ = ["PATH", "ROUTES", "add_mcp", "probe"]

PATH = "/mcp"
_MAX_ITERATIONS = 1000  # an MCP episode's cells, unless its reset says otherwise
_PROBE_BYTES = 1024
_INSTRUCTIONS = (
    "A stateful notebook in a sandbox: run code with add_and_execute_code_cell, fix the last "
    "cell with edit_and_execute_current_cell, run shell commands with execute_shell_command "
    "(the workspace is /home/user), review with get_notebook_state, and submit with "
    "final_answer."
)
Notebooks = weakref.WeakKeyDictionary[Session, tools.Notebook]


def _notebooks(request: Request) -> Notebooks:
    found: Notebooks = request.app.state.mcp_notebooks
    return found


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _answer(ident: Any, exc: BaseException, headers: dict[str, str] | None = None) -> Response:
    error = rpc_error_for(exc)
    if error.status == 503:
        headers = {**(headers or {}), "Retry-After": "5"}
    body = protocol.error(ident, error.code, error.message)
    return JSONResponse(body, status_code=error.status, headers=headers)


async def post(request: Request) -> Response:
    try:
        message = protocol.parse(await request.body())
        _check_version(request)
    except RpcError as exc:
        return _answer(None, exc)
    if not message.is_request:
        return Response(status_code=202)  # a notification, or a response: nothing to answer
    if openenv_dialect.speaks_openenv(request, message):
        return await openenv_dialect.answer(request, message)
    sid = request.headers.get(protocol.SESSION_HEADER)
    try:
        if message.method == "initialize":
            if sid:
                raise RpcError(protocol.INVALID_REQUEST, "initialize opens a session: send it "
                               f"without {protocol.SESSION_HEADER}", 400)  # fmt: skip
            return await _initialize(request, message)
        session, notebook = _session(request, sid)
        async with _runtime(request).sessions.request(session):
            value = await _answer_in(request, session, notebook, message)
    except Exception as exc:
        return _answer(message.id, exc)
    return JSONResponse(protocol.result(message.id, value))


def _check_version(request: Request) -> None:
    version = request.headers.get(protocol.VERSION_HEADER)
    if version is not None and version not in protocol.PROTOCOL_VERSIONS:
        raise RpcError(protocol.INVALID_REQUEST, f"unsupported {protocol.VERSION_HEADER}", 400)


def _session(request: Request, sid: str | None) -> tuple[Session, tools.Notebook]:
    """The MCP session the header names, the caller's own (another tenant's: unknown)."""
    if not sid:
        raise RpcError(protocol.INVALID_REQUEST, f"Bad Request: no {protocol.SESSION_HEADER} "
                       "header; initialize first", 400)  # fmt: skip
    session = _runtime(request).sessions.get(sid, tenant_of(request))
    notebook = _notebooks(request).get(session)
    if notebook is None:  # a session of another door: not an MCP session
        raise RpcError(protocol.INTERNAL_ERROR, GONE, 404)
    return session, notebook


async def _answer_in(
    request: Request, session: Session, notebook: tools.Notebook, message: protocol.Message
) -> dict[str, Any]:
    if message.method == "ping":
        return {}
    if message.method == "tools/list":
        return {"tools": tools.TOOLS}
    name, arguments = protocol.tool_call(message)
    problem = tools.check_arguments(name, arguments)
    if problem is not None:
        raise RpcError(protocol.INVALID_PARAMS, problem)
    timeout = request.app.state.settings.step_timeout
    try:
        text, failed = await tools.call_tool(session, notebook, name, arguments, timeout)
    except Exception as exc:
        said = tools.failure_text(exc)
        if said is None:
            raise
        text, failed = said, True
    return {"content": [{"type": "text", "text": text}], "isError": failed}


async def _initialize(request: Request, message: protocol.Message) -> Response:
    """A new session and its episode: the kernel, the reset, the setup commands."""
    capabilities = message.params.get("capabilities") or {}
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    settings = (extensions or {}).get(protocol.RESET_EXTENSION) or {}
    if not isinstance(settings, dict):
        raise RpcError(protocol.INVALID_PARAMS, f"{protocol.RESET_EXTENSION} must be an object")
    options, setup, verify = tools.split_reset(settings)
    options.setdefault("max_iterations", _MAX_ITERATIONS)
    checked = ResetOptions.model_validate(options)
    kwargs = {name: getattr(checked, name) for name in checked.model_fields_set}
    sessions = _runtime(request).sessions
    session = sessions.open("http", tenant_of(request), claimed=True)
    try:
        async with sessions.request(session):
            await session.reset(kwargs)
            failure = await tools.prepare(session, setup, request.app.state.settings.step_timeout)
        if failure is not None:
            raise RpcError(protocol.SETUP_FAILED, failure)
    except BaseException:
        await sessions.close_session(session)
        raise
    _notebooks(request)[session] = tools.Notebook(verify=verify)
    version = protocol.negotiate(message.params.get("protocolVersion"))
    body = protocol.result(message.id, protocol.initialize_result(version, _INSTRUCTIONS))
    return JSONResponse(body, headers={protocol.SESSION_HEADER: session.id})


async def delete(request: Request) -> Response:
    try:
        session, _ = _session(request, request.headers.get(protocol.SESSION_HEADER))
    except Exception as exc:
        return _answer(None, exc)
    await _runtime(request).sessions.close_session(session)
    return Response(status_code=204)


async def get(_: Request) -> Response:
    # No stream of the server's own messages: it sends none (the spec's answer is 405).
    return Response(status_code=405, headers={"Allow": "POST, DELETE"})


async def probe(scope: Scope, receive: Receive, send: Send) -> None:
    """A request to ``/mcp`` without a valid token: 401, unless its small body asks for
    nothing (no ``method``), which is answered as JSON-RPC's invalid request."""
    body = bytearray()
    while len(body) <= _PROBE_BYTES:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    answer: Response = JSONResponse(
        {"detail": "missing or invalid bearer token"},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
    )
    if scope.get("method") == "POST" and len(body) <= _PROBE_BYTES:
        try:
            protocol.parse(bytes(body))
        except RpcError as exc:
            if exc.code == protocol.INVALID_REQUEST and exc.status == 200:
                answer = JSONResponse(protocol.error(None, exc.code, exc.message))
    await answer(scope, receive, send)


ROUTES = [
    Route(PATH, post, methods=["POST"]),
    Route(PATH, get, methods=["GET"]),
    Route(PATH, delete, methods=["DELETE"]),
]


def add_mcp(app: FastAPI) -> None:
    """MCP's routes on ``app``, and the registry of its sessions' notebooks (each dies with
    its session)."""
    app.state.mcp_notebooks = weakref.WeakKeyDictionary()
    app.router.routes.extend(ROUTES)
