"""``WS /ws``: one socket = one session; one reply frame per request, in order.

A request-level error (bad frame, step before reset, a limit) is answered with an error frame
and the socket stays open. A session-level one (capacity at connect, auth) closes it. Frame
parsing and building live in ``protocol``; this module only moves frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from kernel_env.errors import KernelEnvError
from kernel_env.models import REPLAction
from kernel_env.outputs import output_size
from kernel_env.server.auth import tenant_of
from kernel_env.server.openenv.failures import connect_refusal, error_for
from kernel_env.server.openenv.protocol import (
    CLOSE_NORMAL,
    CLOSE_TOO_BIG,
    CallToolAction,
    Frame,
    ListToolsAction,
    Request,
    fork_payload,
    mcp_response,
    observation_frame,
    output_frame,
    parse_frame,
    state_frame,
)
from kernel_env.server.openenv.tool_steps import ToolSteps
from kernel_env.server.sessions import CapacityReached, Session, SessionError, UnknownSession
from kernel_env.streaming import OutputStream

if TYPE_CHECKING:
    from kernel_env.server.runtime import Runtime

__all__ = ["websocket_endpoint"]

log = logging.getLogger(__name__)

# Frames bigger than this are parsed / encoded in a thread: a 100 MB context must not stall
# every other session's pings and steps while json works through it.
_OFF_LOOP_BYTES = 1 << 20


async def websocket_endpoint(websocket: WebSocket) -> None:
    # Host, Origin and the token were checked before the handshake (guard, auth).
    runtime: Runtime = websocket.app.state.runtime
    await websocket.accept()
    session, owned = await _session_for(websocket, runtime)
    if session is None:
        return
    try:
        await _serve(websocket, session, runtime)
    finally:
        if owned:
            # Shielded: if this handler is being cancelled, the kernel must still be shut down.
            await asyncio.shield(runtime.sessions.close_soon(session))
        else:
            runtime.sessions.unshare(session)


async def _session_for(websocket: WebSocket, runtime: Runtime) -> tuple[Session | None, bool]:
    """The socket's session and whether the socket owns it: a new one; with
    ``?session=<id>`` an existing one (a fork's, an HTTP one) that it then owns; with
    ``?session_id=<id>`` (OpenEnv's ``MCPToolClient``) one that it shares with the
    ``/mcp`` requests naming it, which outlives the socket. None when refused (the socket
    was told why and closed). A client tenant attaches only to its own sessions: another's
    id is refused as an unknown one."""
    attach = websocket.query_params.get("session")
    shared = websocket.query_params.get("session_id")
    tenant = tenant_of(websocket)
    try:
        if attach is not None:
            return runtime.sessions.take(attach, tenant), True
        if shared is not None:
            return runtime.sessions.share(shared, tenant), False
        return runtime.sessions.open("ws", tenant), True
    except (CapacityReached, SessionError, UnknownSession) as exc:
        # Full; shutting down; or no such session to take.
        attaching = attach is not None or shared is not None
        frame, code = connect_refusal(exc, attaching=attaching)
        await _refuse(websocket, frame, code)
    return None, False


async def _serve(websocket: WebSocket, session: Session, runtime: Runtime) -> None:
    limit = runtime.settings.max_message_bytes
    streaming = False  # a reset with "stream": true turns output frames on for its steps
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        raw: str | bytes = message.get("text") or message.get("bytes") or ""
        if len(raw) > limit:  # uvicorn enforces this first (ws_max_size); other servers may not
            await _close(websocket, CLOSE_TOO_BIG, f"frame exceeds {limit} bytes")
            return
        parsed = await _off_loop_if_big(len(raw), parse_frame, raw)
        if isinstance(parsed, dict):  # an error frame answering a bad frame
            if not await _send(websocket, parsed):
                return
            continue
        if parsed.kind == "close":
            await _close(websocket, CLOSE_NORMAL)
            return
        if parsed.kind == "reset" and parsed.stream is not None:
            streaming = parsed.stream
        stream = parsed.stream if parsed.stream is not None else streaming
        steps = _Steps(websocket.app.state.openenv_tools, runtime.settings.step_timeout)
        async with runtime.sessions.request(session):
            if parsed.kind == "fork":
                reply = await _fork(parsed, session, runtime)
            elif parsed.kind == "step" and stream:
                reply = await _streamed_step(websocket, parsed, session, steps)
            else:
                reply = await _answer(parsed, session, steps)
            if not await _send(websocket, reply):
                return


async def _fork(request: Request, session: Session, runtime: Runtime) -> Frame:
    """A ``fork`` frame: the copies' sessions (attach with ``/ws?session=<id>``)."""
    options = request.fork
    assert options is not None  # parse_frame sets it for a fork frame
    try:
        children = await runtime.sessions.fork(session, options.n, own_budget=options.own_budget)
    except (KernelEnvError, ValidationError) as exc:
        return error_for(exc)
    return {"type": "fork", "data": fork_payload(children)}


class _Steps:
    """What a tool step or a reset's commands need: the door's tool steps, the timeout."""

    def __init__(self, tools: ToolSteps, timeout: float) -> None:
        self.tools, self.timeout = tools, timeout


async def _streamed_step(
    websocket: WebSocket, request: Request, session: Session, steps: _Steps
) -> Frame:
    """A step whose output goes out as "output" frames while it runs, then its observation.
    A client that does not read holds up only its own frames: the kernel writes into a bounded
    buffer (:class:`OutputStream`) that merges text and drops, with a marker, what won't fit."""
    stream = OutputStream()
    sender = asyncio.create_task(_send_outputs(websocket, stream))
    try:
        reply = await _answer(request, session, steps, on_output=stream.push)
    except BaseException:  # cancelled (a drain): don't wait on a client that may not read
        stream.close()
        sender.cancel()
        raise
    stream.close()
    await sender  # every output frame before the observation
    return reply


async def _send_outputs(websocket: WebSocket, stream: OutputStream) -> None:
    async for event in stream:
        if not await _send(websocket, output_frame(event)):
            return


async def _answer(
    request: Request,
    session: Session,
    steps: _Steps,
    on_output: Callable[[dict[str, Any]], None] | None = None,
) -> Frame:
    """The reply frame for one request; errors become error frames, never exceptions."""
    try:
        if request.kind == "reset":
            obs = await session.reset(request.reset or {})
            await steps.tools.reset(session, request.setup, request.verify, steps.timeout)
            return observation_frame(obs, session_id=session.id)
        if request.kind == "step" and isinstance(request.action, REPLAction):
            obs = await session.step(request.action, on_output)
            return observation_frame(obs, session_id=session.id)
        if request.kind == "step" and isinstance(request.action, (ListToolsAction, CallToolAction)):
            data = await steps.tools.step(
                session, request.action, steps.timeout, session_id=session.id
            )
            return {"type": "observation", "data": data}
        if request.kind == "state":
            return state_frame(session.state())
        return {"type": "mcp", "data": mcp_response(request.rpc)}
    except (KernelEnvError, ValidationError) as exc:
        return error_for(exc)
    except Exception as exc:
        log.exception("unexpected error answering a %s request", request.kind)
        return error_for(exc)


async def _send(websocket: WebSocket, frame: Frame) -> bool:
    """Send one frame; False when the client is gone."""
    text = await _off_loop_if_big(_frame_size(frame), json.dumps, frame)
    try:
        await websocket.send_text(text)
    except (WebSocketDisconnect, RuntimeError, OSError):
        return False
    return True


def _frame_size(frame: Frame) -> int:
    """About how many chars ``frame`` encodes to, counting only what can be big: a state's
    context, an observation's outputs (up to the step's output budget, several MB)."""
    data = frame.get("data") or {}
    if frame["type"] == "state":
        return len(data.get("context") or "")
    if frame["type"] != "observation":
        return 0
    result = (data.get("observation") or {}).get("result") or {}
    return sum(output_size(o) for o in result.get("outputs") or [])


async def _refuse(websocket: WebSocket, frame: Frame, code: int) -> None:
    if await _send(websocket, frame):
        await _close(websocket, code, frame["data"]["code"])


async def _close(websocket: WebSocket, code: int, reason: str = "") -> None:
    # Already closed by the client: nothing left to tell it.
    with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
        await websocket.close(code=code, reason=reason[:120])


async def _off_loop_if_big(size: int, fn: Any, arg: Any) -> Any:
    if size > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)
