"""MCP over stdio (``kernel-env mcp``): newline-delimited JSON-RPC on stdin and stdout, as
the spec's stdio transport, for a client that spawns its server (a desktop app).

One answer for both ways to run it: a bridge to the streamable-HTTP door (:mod:`.routes`),
so there is one implementation of the protocol. Each line read is ``POST``ed to ``/mcp``
(the session's ``Mcp-Session-Id`` kept from ``initialize`` on), and each JSON-RPC answer is
written back as one line. The door is a remote server's (``--url``), or the app's own, run in
this process with its lifespan and reached through ``httpx.ASGITransport`` (no socket, local
kernels from the ``serve`` settings): one episode, whose kernel this process owns.

Nothing but JSON-RPC reaches stdout: the streams are moved to private descriptors first, and
descriptor 1 then writes to stderr, descriptor 0 reads ``/dev/null``, so neither a stray
``print`` nor a child that inherits them (the forkserver's zygote; kernels start with
``/dev/null``) can corrupt the stream or read a message. EOF on
stdin ends it once the calls in flight are answered (input piped from a file gets every
answer); SIGINT and SIGTERM cancel them. Then the session is deleted (its kernel freed) and a
local app's lifespan closes (every kernel of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import logging.config
import os
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

import httpx

from kernel_env.server.logs import log_config
from kernel_env.server.mcp import protocol
from kernel_env.server.mcp.routes import PATH
from kernel_env.server.settings import ServerSettings

__all__ = ["Bridge", "claim_stdio", "connect", "run"]

log = logging.getLogger(__name__)

_LOCAL_BASE = "http://127.0.0.1"  # the in-process app's address: a name, no socket
_CALL_TIMEOUT = None  # a cell may run for as long as the server's step timeout allows
_CLOSE_TIMEOUT = 10.0  # s for the session's DELETE at the end
_ACCEPT = "application/json, text/event-stream"


def claim_stdio() -> tuple[BinaryIO, BinaryIO]:
    """The JSON-RPC streams: stdin and stdout moved to private (close-on-exec) descriptors;
    descriptor 0 then reads ``/dev/null`` and descriptor 1 writes to stderr."""
    sys.stdout.flush()
    into, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return os.fdopen(into, "rb"), os.fdopen(out, "wb")


@contextlib.asynccontextmanager
async def connect(
    url: str | None, token: str | None, settings: ServerSettings | None
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the door: ``url``'s, or (``url`` None) an app of ``settings`` run
    here, for as long as the block, guarded by a token of its own."""
    if url is not None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=_CALL_TIMEOUT, trust_env=False
        ) as client:
            yield client
        return
    from kernel_env.server.app import create_app  # the app only where it runs here

    own = secrets.token_urlsafe(32)
    app = create_app(dataclasses.replace(settings or ServerSettings(), token=own, tokens_file=None))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url=_LOCAL_BASE,
            headers={"Authorization": f"Bearer {own}"},
            timeout=_CALL_TIMEOUT,
        ) as client,
    ):
        yield client


def _ident(line: bytes) -> str | int | None:
    """The id of a line's request, if it has one worth answering with."""
    with contextlib.suppress(ValueError, RecursionError):
        payload = json.loads(line)
        if isinstance(payload, dict):
            ident = payload.get("id")
            if isinstance(ident, (str, int)) and not isinstance(ident, bool):
                return ident
    return None


class Bridge:
    """One MCP session, forwarded: a line in, its answer (if any) out."""

    def __init__(self, client: httpx.AsyncClient, out: BinaryIO) -> None:
        self.client, self.out = client, out
        self.session_id: str | None = None
        self.version: str | None = None

    def write(self, message: dict[str, Any]) -> None:
        try:
            self.out.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            self.out.flush()
        except OSError as exc:  # the client stopped reading; its stdin's EOF ends this
            log.warning("MCP: an answer could not be written to stdout: %s", exc)

    async def forward(self, line: bytes) -> None:
        ident = _ident(line)
        headers = {"Accept": _ACCEPT, "Content-Type": "application/json"}
        if self.session_id is not None:
            headers[protocol.SESSION_HEADER] = self.session_id
        if self.version is not None:
            headers[protocol.VERSION_HEADER] = self.version
        try:
            response = await self.client.post(PATH, content=line, headers=headers)
        except httpx.HTTPError as exc:
            self._fail(ident, f"the server is unreachable: {type(exc).__name__}: {exc}")
            return
        if response.status_code == 202:
            return  # a notification, or a client's response: nothing to answer
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not (isinstance(answer, dict) and answer.get("jsonrpc") == "2.0"):
            detail = answer.get("detail") if isinstance(answer, dict) else None
            self._fail(ident, f"HTTP {response.status_code}" + (f": {detail}" if detail else ""))
            return
        self._learn(response, answer)
        self.write(answer)

    def _learn(self, response: httpx.Response, answer: dict[str, Any]) -> None:
        """The session's id and revision, from ``initialize``'s answer."""
        sid = response.headers.get(protocol.SESSION_HEADER)
        if sid and self.session_id is None:
            self.session_id = sid
            value = answer.get("result") or {}
            self.version = value.get("protocolVersion") if isinstance(value, dict) else None

    def _fail(self, ident: str | int | None, said: str) -> None:
        if ident is None:  # a notification's failure: no one to tell but the log
            log.warning("MCP: a message without an id was refused: %s", said)
            return
        self.write(protocol.error(ident, protocol.INTERNAL_ERROR, said))

    async def close(self) -> None:
        """End the session on the server (its kernel freed)."""
        if self.session_id is None:
            return
        headers = {protocol.SESSION_HEADER: self.session_id}
        with contextlib.suppress(httpx.HTTPError, asyncio.TimeoutError):
            await asyncio.wait_for(self.client.delete(PATH, headers=headers), _CLOSE_TIMEOUT)
        self.session_id = None


def _lines(stream: BinaryIO, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[bytes | None]:
    """stdin's lines, read by a thread of their own (stdin may be a pipe, a file or a
    terminal); None at EOF."""
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()

    def read() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first: no one waits
            with contextlib.suppress(OSError, ValueError):
                for line in stream:
                    loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, name="mcp-stdin", daemon=True).start()
    return lines


async def _serve(bridge: Bridge, lines: asyncio.Queue[bytes | None], stop: asyncio.Event) -> None:
    """Forward every line until the input ends, each as a task of its own (a ping is not
    held behind a running cell). At EOF the calls in flight are answered; a signal cancels
    them. Then the session is closed."""
    calls: set[asyncio.Task[None]] = set()
    stopped = asyncio.create_task(stop.wait())
    try:
        while (line := await lines.get()) is not None:
            if line.strip():
                call = asyncio.create_task(bridge.forward(line))
                calls.add(call)
                call.add_done_callback(calls.discard)
        while calls and not stop.is_set():
            await asyncio.wait({*calls, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (*calls, stopped):
            task.cancel()
        await asyncio.gather(*calls, stopped, return_exceptions=True)
        await bridge.close()


async def _main(url: str | None, token: str | None, settings: ServerSettings) -> None:
    into, out = claim_stdio()
    loop = asyncio.get_running_loop()
    lines, stop = _lines(into, loop), asyncio.Event()

    def on_signal() -> None:
        stop.set()
        lines.put_nowait(None)

    # A signal that arrives while the app starts takes effect once it has: nothing it
    # started is left behind.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    async with connect(url, token, None if url else settings) as client:
        await _serve(Bridge(client, out), lines, stop)


def run(url: str | None, token: str | None, settings: ServerSettings) -> int:
    """Serve MCP on stdin and stdout until EOF, SIGINT or SIGTERM; 0 then. ``settings``:
    the local app's (``url`` None), and the log's (stderr) either way."""
    logging.config.dictConfig(log_config(settings.log_level, settings.log_format))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line a message: the door's own
    asyncio.run(_main(url, token, settings))
    return 0
