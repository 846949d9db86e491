"""The host's end of a provisioned kernel's helper calls: a UNIX socket in its runtime dir.

A kernel that a plain Jupyter frontend drives (JupyterLab, ``jupyter execute``) has no
kernel_env host on its stdin channel: the frontend owns it. Its ``llm_query`` & co. connect to
this socket instead (the contract's ``CALL_SOCKET_ENV``), one connection a request: the request
line in, the reply line out. :class:`~kernel_env.hostcalls.HostCalls` answers it, as it answers
an episode's stdin requests, with the backend of the process that started the kernel: the
model's key stays in that process.

The socket serves from a thread of its own, with its own event loop, so it answers whatever
the frontend's process is doing: a blocking ``KernelManager`` runs its loop only inside its
calls. What a kernel can make it hold is bounded: :data:`MAX_CONNECTIONS` connections at once
(more are closed unanswered); one request read at a time, each at most ``MAX_REQUEST_CHARS``
(a request is ASCII: its JSON escapes the rest) and sent within :data:`READ_TIMEOUT` seconds;
and the requests being answered at once at most :data:`MAX_HELD_CHARS` together (the next
waits its turn, unread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from typing import Any

from kernel_env.hostcalls import MAX_REQUEST_CHARS, HostCalls
from kernel_env.inkernel.contract import REQUEST_TAG

__all__ = ["MAX_CONNECTIONS", "MAX_HELD_CHARS", "READ_TIMEOUT", "CallSocket"]

MAX_CONNECTIONS = 64  # open at once (each a request read, or being answered)
MAX_HELD_CHARS = 4 * MAX_REQUEST_CHARS  # of the requests being answered at once
READ_TIMEOUT = 10.0  # seconds for a request line to arrive
_CHUNK = 1 << 16
_START_TIMEOUT = 10.0


class CallSocket:
    """Serves ``calls`` on a UNIX socket at ``path`` (created here, removed by :meth:`close`)."""

    def __init__(self, path: str, calls: HostCalls) -> None:
        self.path = path
        self.calls = calls
        self.refused = 0  # connections closed unanswered: over MAX_CONNECTIONS at once
        self._active = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kernel-env-calls", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._reading = asyncio.Lock()
        self._room = asyncio.Condition()
        self._held = 0  # chars of the requests being answered

    def open(self) -> None:
        """Bind the socket and start answering."""
        self._thread.start()
        try:
            self._on_loop(self._bind(), _START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop answering, release the backend's connections, remove the socket; idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._on_loop(self._shut(), _START_TIMEOUT)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_START_TIMEOUT)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def _on_loop(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _bind(self) -> None:
        # A connection's reader holds at most twice its limit before it stops reading.
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=_CHUNK)
        # The kernel may run as a uid of its own; the directory keeps everyone else out.
        os.chmod(self.path, 0o666)

    async def _shut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self.calls.backend is not None:
            with contextlib.suppress(Exception):
                await self.calls.backend.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._active >= MAX_CONNECTIONS:
            self.refused += 1
            writer.close()
            return
        self._active += 1
        try:
            reply = await self._answer(reader)
            writer.write(reply.encode() + b"\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the kernel went away mid-call
        finally:
            self._active -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> str:
        # One request is read at a time, and admitted while the requests being answered
        # leave room: what waits stays in the kernel's socket buffers, not here.
        async with self._reading:
            try:
                text = await _read_request(reader)
            except _Refused as refused:
                return _refusal(str(refused))
            await self._admit(len(text))
        try:
            reply = await self.calls.handle(text)
            self.calls.take_calls()  # nothing records them here: keep none
            return reply
        finally:
            await self._release(len(text))

    async def _admit(self, size: int) -> None:
        async with self._room:
            await self._room.wait_for(lambda: self._held + size <= MAX_HELD_CHARS or not self._held)
            self._held += size

    async def _release(self, size: int) -> None:
        async with self._room:
            self._held -= size
            self._room.notify_all()


class _Refused(Exception):
    """A request this socket does not answer, and why."""


async def _read_request(reader: asyncio.StreamReader) -> str:
    """The request line's text, without its newline; :class:`_Refused` if it is none."""
    too_long = f"a request is at most {MAX_REQUEST_CHARS} characters"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READ_TIMEOUT
    data = bytearray()
    while b"\n" not in data:
        if len(data) > MAX_REQUEST_CHARS:
            raise _Refused(too_long)
        try:
            chunk = await asyncio.wait_for(reader.read(_CHUNK), deadline - loop.time())
        except TimeoutError:
            chunk = b""
        if not chunk:
            raise _Refused("a request is one line, sent at once")
        data += chunk
    line, _, _ = data.partition(b"\n")
    if len(line) > MAX_REQUEST_CHARS:
        raise _Refused(too_long)
    text = line.decode("utf-8", "replace")
    if not text.startswith(REQUEST_TAG):
        raise _Refused("not a helper's request")
    return text


def _refusal(problem: str) -> str:
    return json.dumps({"ok": False, "error": f"bad request: {problem}"})
