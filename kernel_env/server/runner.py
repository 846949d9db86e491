"""Running the app under uvicorn, with a shutdown that drains before connections are cut.

uvicorn's own shutdown closes every WebSocket at once (close 1012) and only then runs the
app's lifespan shutdown, so a step in flight would never be answered. ``DrainingServer``
stops listening, lets in-flight steps answer (``drain_timeout``), shuts every kernel down,
and only then lets uvicorn close the connections.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import socket
import sys
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from kernel_env.server.app import create_app
from kernel_env.server.logs import log_config
from kernel_env.server.settings import ServerSettings

__all__ = ["KEEP_ALIVE", "DrainingServer", "bind", "build_server", "return_freed_memory"]

# How long an idle HTTP connection is kept open (uvicorn's default: 5 s). Longer than the
# clients' pools keep one: E2B's SDK keeps idle connections 300 s, and a server that closes
# first races the client's next request on that connection, which then gets a reset
# (ECONNRESET) where the client took the connection as the server's FIN was on its way.
KEEP_ALIVE = 330


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connection may arrive during the drain
            server.close()
        runtime = getattr(self._app.state, "runtime", None)
        if runtime is not None:
            await runtime.drain()
        await super().shutdown(sockets)


def return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the system (``mallopt(M_MMAP_THRESHOLD,
    1 MiB)``). By default its mmap threshold grows to the largest block freed so far (up to
    32 MiB), after which multi-MB buffers (a 15 MB prompt, an 8 MB reply) come from the heap
    and stay resident once freed: measured 773 MiB RSS left after a flood, 246 MiB with this.
    A no-op where glibc is not the allocator."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


_M_MMAP_THRESHOLD = -3


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ``port=0`` picks a free port (read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it an HTTP response written in two parts waits for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {port} on {host} is already in use (another kernel-env serve?); "
                "choose another with --port"
            ) from None
        raise
    sock.set_inheritable(True)
    return sock


def build_server(
    settings: ServerSettings, app: FastAPI | None = None, *, own_logs: bool = False
) -> tuple[DrainingServer, socket.socket, ServerSettings]:
    """The server, its bound socket, and the settings with the real port filled in.
    ``own_logs``: configure all logging (``kernel-env serve``'s one format)."""
    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    settings = replace(settings, port=port)
    app = app or create_app(settings)
    config = uvicorn.Config(
        app,
        loop="asyncio",  # the same loop kind the tests and the local client use
        lifespan="on",
        log_level=settings.log_level,
        # The CLI's one format for every logger; a library caller's logging is left alone.
        log_config=log_config(settings.log_level, settings.log_format)
        if own_logs
        else uvicorn.config.LOGGING_CONFIG,
        ws_max_size=settings.max_message_bytes,  # bigger frames: close 1009, never buffered
        timeout_graceful_shutdown=2,  # after our own drain, only stragglers are left
        timeout_keep_alive=KEEP_ALIVE,
        # No permessage-deflate: it costs server CPU on every step (P6 is CPU-bound; see
        # benchmarks/README.md), and it would deflate a 100 MB state frame on the event loop.
        ws_per_message_deflate=False,
    )
    return DrainingServer(config, app), sock, settings
