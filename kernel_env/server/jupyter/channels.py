"""``WS /api/kernels/{id}/channels``: Jupyter's kernel messages, over the session core.

Each ``execute_request`` is a cell of the kernel's episode (``Session.step``, its author
``"jupyter"``): it runs in the sandboxed kernel with the helpers, ``llm_query`` is answered
by the server's model, the cell enters the episode's record and notebook and shows in
``/web``, and its output comes back as iopub messages while it runs (``stream``,
``display_data``, ``execute_result``, ``error``, ``clear_output``), between ``busy`` and
``idle``, with its ``execute_reply`` on shell. The episode may be an agent's (opened over
``/ws``, HTTP or E2B): the cells of the person attached are recorded beside the agent's
steps but are not its iterations. Executes run one at a time, in order, as a kernel runs
them; a step of the agent (or of another socket) waits its turn behind the session's lock,
and so does an execute sent while the agent's cell runs. ``interrupt_request`` on
control interrupts the running cell. The other shell requests need no kernel and are
answered at once (``kernel_info``, and empty ``complete``, ``inspect``, ``history``,
``comm_info``); stdin is not served: a kernel_env kernel's own ``input()`` fails at once.

Bounds: a frame over the step's body limit closes the socket (1009); at most
:data:`MAX_QUEUED` executes wait (and :data:`MAX_QUEUED_BYTES` of them), past which one is
answered at once with an error; a cell's output reaches a slow reader through a bounded
buffer that drops, with a marker, what will not fit (:class:`OutputStream`). A client that
does not read holds up only itself. The socket ends when the session does (a shutdown,
the idle reaper, a drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from kernel_env import __version__
from kernel_env.errors import KernelEnvError
from kernel_env.models import REPLAction, REPLObservation
from kernel_env.record import JUPYTER
from kernel_env.server.jupyter import messages
from kernel_env.server.jupyter.failures import refuse_channels
from kernel_env.server.jupyter.kernels import connections, find
from kernel_env.server.jupyter.kernelspecs import language_of
from kernel_env.server.jupyter.messages import ClientMessage
from kernel_env.server.sessions import Session, SessionError, UnknownSession
from kernel_env.streaming import OutputStream

if TYPE_CHECKING:
    from kernel_env.server.runtime import Runtime

__all__ = ["MAX_QUEUED", "MAX_QUEUED_BYTES", "channels_endpoint"]

log = logging.getLogger(__name__)

MAX_QUEUED = 32  # executes waiting behind the running one, per socket
MAX_QUEUED_BYTES = 16 << 20  # and their frames' bytes
CLOSE_TOO_BIG = 1009
CLOSE_UNSUPPORTED = 1003
# Shell requests answered without the kernel: their reply's content.
_EMPTY_REPLIES: dict[str, dict[str, Any]] = {
    "complete_request": {"matches": [], "cursor_start": 0, "cursor_end": 0, "metadata": {}},
    "inspect_request": {"found": False, "data": {}, "metadata": {}},
    "is_complete_request": {"status": "unknown"},
    "history_request": {"history": []},
    "comm_info_request": {"comms": {}},
}


async def channels_endpoint(websocket: WebSocket) -> None:
    # Host, Origin and the token were checked before the handshake (guard, auth).
    kernel_id = websocket.path_params["kernel_id"]
    try:
        session = find(websocket, kernel_id)
    except UnknownSession:
        await refuse_channels(websocket, kernel_id)
        return
    await websocket.accept()  # no subprotocol: Jupyter's JSON messages
    counts = connections(websocket)
    counts[session.id] += 1
    try:
        await _Connection(websocket, session, websocket.app.state.runtime).serve()
    finally:
        counts[session.id] -= 1
        if counts[session.id] <= 0:
            del counts[session.id]


class _Connection:
    """One channels socket to one kernel: its reader, its queue of executes, its writer."""

    def __init__(self, websocket: WebSocket, session: Session, runtime: Runtime) -> None:
        self.websocket = websocket
        self.session = session
        self.runtime = runtime
        self.id = uuid.uuid4().hex  # the kernel's session, in the headers of its messages
        self.limit = runtime.settings.step_body_bytes
        self.language = language_of(websocket, session.kernel_name or "python3")
        self._queue: deque[tuple[ClientMessage, int]] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._reading = True
        self._send_lock = asyncio.Lock()
        self._open = True
        self._error_shown = False  # the running cell's error went out as an iopub message

    async def serve(self) -> None:
        worker = asyncio.create_task(self._run_executes())
        ended = asyncio.create_task(self.session.wait_closed())
        reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait({reader, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._reading = False
            self._queue.clear()
            self._wake.set()
            for task in (reader, ended):
                task.cancel()
            await asyncio.gather(reader, ended, return_exceptions=True)
            # The running cell finishes (a kernel's cell outlives its frontend); then it ends.
            await asyncio.gather(worker, return_exceptions=True)
            await self._close(1000)

    # -- reading --------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            frame = await self.websocket.receive()
            if frame["type"] == "websocket.disconnect":
                return
            if frame.get("bytes") is not None:
                await self._close(CLOSE_UNSUPPORTED, "binary frames are not served: use JSON")
                return
            raw = frame.get("text") or ""
            if len(raw) > self.limit:
                await self._close(CLOSE_TOO_BIG, f"frame exceeds {self.limit} bytes")
                return
            await self._dispatch(raw)

    async def _dispatch(self, raw: str) -> None:
        try:
            parsed = messages.parse(json.loads(raw))
        except ValueError:
            parsed = "not JSON"
        if isinstance(parsed, str):
            log.debug("jupyter channels: a frame dropped: %s", parsed)
            return
        if parsed.channel == "control":
            await self._control(parsed)
        elif parsed.channel == "shell" and parsed.msg_type == "execute_request":
            await self._enqueue(parsed, len(raw))
        elif parsed.channel == "shell":
            await self._answer_now(parsed)
        # stdin (input replies to requests never made) and iopub carry nothing to serve.

    async def _control(self, request: ClientMessage) -> None:
        if request.msg_type == "interrupt_request":
            await self.session.interrupt()
            await self._reply(request, "interrupt_reply", {"status": "ok"})
        elif request.msg_type == "kernel_info_request":
            await self._reply(request, "kernel_info_reply", self._kernel_info())
        elif request.msg_type == "shutdown_request":
            restart = bool(request.content.get("restart"))
            await self._reply(request, "shutdown_reply", {"status": "ok", "restart": restart})
            if not restart:  # a restart goes through POST /api/kernels/{id}/restart
                await self.runtime.sessions.close_session(self.session)

    async def _answer_now(self, request: ClientMessage) -> None:
        reply_type = request.msg_type.removesuffix("_request") + "_reply"
        if request.msg_type == "kernel_info_request":
            content = self._kernel_info()
        elif request.msg_type in _EMPTY_REPLIES:
            content = {"status": "ok", **_EMPTY_REPLIES[request.msg_type]}
        else:
            return  # as a kernel does with a type it does not know (comm_open included)
        await self._send(messages.status("busy", parent=request.header, session=self.id))
        await self._reply(request, reply_type, content)
        await self._send(messages.status("idle", parent=request.header, session=self.id))

    def _kernel_info(self) -> dict[str, Any]:
        return messages.kernel_info(self.language, __version__)

    async def _enqueue(self, request: ClientMessage, size: int) -> None:
        if len(self._queue) >= MAX_QUEUED or self._queued_bytes + size > MAX_QUEUED_BYTES:
            why = f"{MAX_QUEUED} requests (or {MAX_QUEUED_BYTES >> 20} MiB) wait already"
            await self._refuse_execute(request, "QueueFull", why)
            return
        self._queue.append((request, size))
        self._queued_bytes += size
        self._wake.set()

    # -- executing ------------------------------------------------------------------------

    async def _run_executes(self) -> None:
        while self._reading or self._queue:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            request, size = self._queue.popleft()
            self._queued_bytes -= size
            await self._execute(request)

    async def _execute(self, request: ClientMessage) -> None:
        parent = request.header
        code = request.content.get("code")
        if not isinstance(code, str):
            await self._refuse_execute(request, "ValueError", "an execute_request needs code")
            return
        await self._send(messages.status("busy", parent=parent, session=self.id))
        self._error_shown = False
        stream = OutputStream()
        forward = asyncio.create_task(self._forward(stream, parent))
        try:
            content = await self._step(code, stream)
        finally:
            stream.close()
            await forward  # every output before the reply
        if content.get("status") == "error" and not self._error_shown:
            await self._send_error(parent, content)
        await self._reply(request, "execute_reply", content)
        await self._send(messages.status("idle", parent=parent, session=self.id))
        if self.session.closed is not None:
            self._reading = False  # the session is gone: nothing more can run

    async def _step(self, code: str, stream: OutputStream) -> dict[str, Any]:
        """The ``execute_reply`` content of one step."""
        try:
            async with self.runtime.sessions.request(self.session):
                observation = await self.session.step(
                    REPLAction(code=code), stream.push, author=JUPYTER
                )
        except (KernelEnvError, SessionError) as exc:
            return _error_reply(type(exc).__name__, str(exc), [], None)
        return _reply_for(observation)

    async def _forward(self, stream: OutputStream, parent: dict[str, Any]) -> None:
        async for event in stream:
            self._error_shown |= event.get("output_type") == "error"
            msg = messages.iopub_for_event(event, parent=parent, session=self.id)
            if msg is not None:
                await self._send(msg)

    async def _send_error(self, parent: dict[str, Any], content: dict[str, Any]) -> None:
        error = {k: content[k] for k in ("ename", "evalue", "traceback")}
        await self._send(messages.message("iopub", "error", error, parent=parent, session=self.id))

    async def _refuse_execute(self, request: ClientMessage, ename: str, evalue: str) -> None:
        content = _error_reply(ename, evalue, [], None)
        await self._send(messages.status("busy", parent=request.header, session=self.id))
        await self._send_error(request.header, content)
        await self._reply(request, "execute_reply", content)
        await self._send(messages.status("idle", parent=request.header, session=self.id))

    # -- writing --------------------------------------------------------------------------

    async def _reply(self, request: ClientMessage, msg_type: str, content: dict[str, Any]) -> None:
        channel = "control" if request.channel == "control" else "shell"
        await self._send(
            messages.message(channel, msg_type, content, parent=request.header, session=self.id)
        )

    async def _send(self, msg: dict[str, Any]) -> None:
        """Send one message; a client gone is not an error (its cell still finishes)."""
        if not self._open:
            return
        text = json.dumps(msg, default=str)
        async with self._send_lock:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self._open = False

    async def _close(self, code: int, reason: str = "") -> None:
        if not self._open:
            return
        self._open = False
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await self.websocket.close(code=code, reason=reason[:120])


def _error_reply(
    ename: str, evalue: str, traceback: list[str], count: int | None
) -> dict[str, Any]:
    return {
        "status": "error",
        "ename": ename,
        "evalue": evalue,
        "traceback": traceback or [f"{ename}: {evalue}"],
        "execution_count": count,
    }


def _reply_for(observation: REPLObservation) -> dict[str, Any]:
    """The ``execute_reply`` content of a step's observation."""
    result = observation.result
    if result.success:
        return {
            "status": "ok",
            "execution_count": result.execution_count,
            "user_expressions": {},
            "payload": [],
        }
    errors = [o for o in result.outputs if o.get("output_type") == "error"]
    error: dict[str, Any] = errors[-1] if errors else {}
    return _error_reply(
        str(error.get("ename") or ("TimeoutError" if result.timed_out else "Error")),
        str(error.get("evalue", result.exception or "")),
        list(error.get("traceback") or []),
        result.execution_count,
    )
