"""Running the app under uvicorn, with a shutdown that drains before connections are cut,
and descriptors enough for every kernel it may run.

uvicorn's own shutdown closes every WebSocket at once (close 1012) and only then runs the
app's lifespan shutdown, so a step in flight would never be answered. ``DrainingServer``
stops listening, lets in-flight steps answer (``drain_timeout``), shuts every kernel down,
and only then lets uvicorn close the connections.

Each live kernel holds descriptors in the server (``capacity.DESCRIPTORS_PER_KERNEL``), so the
server raises its soft ``RLIMIT_NOFILE`` to the hard limit (often 1024 soft: 110 kernels),
and caps its connections at what the limit leaves once every kernel it may run has its
share: a flood of connections is answered 503, never with a kernel that cannot start.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import resource
import socket
import sys
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from kernel_env.server.app import create_app
from kernel_env.server.capacity import (
    DESCRIPTORS_PER_KERNEL,
    MIN_CONNECTIONS,
    RESERVED_DESCRIPTORS,
)
from kernel_env.server.logs import log_config
from kernel_env.server.settings import ServerSettings

__all__ = [
    "KEEP_ALIVE",
    "DrainingServer",
    "bind",
    "build_server",
    "connection_cap",
    "descriptor_shortfall",
    "open_files_limit",
    "raise_descriptor_limit",
    "return_freed_memory",
]

log = logging.getLogger(__name__)

# How long an idle HTTP connection is kept open (uvicorn's default: 5 s). Longer than the
# clients' pools keep one: E2B's SDK keeps idle connections 300 s, and a server that closes
# first races the client's next request on that connection, which then gets a reset
# (ECONNRESET) where the client took the connection as the server's FIN was on its way.
KEEP_ALIVE = 330


def raise_descriptor_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (no privilege needed);
    the soft limit now. Nothing in the server has a descriptor-number ceiling (no select(2):
    poll and epoll), so every descriptor the limit allows is usable."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:  # a hard limit above the kernel's nr_open
            log.warning("could not raise the open files limit from %d to %d: %s", soft, hard, exc)
    return open_files_limit()


def open_files_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (an unlimited one as 2**20)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(settings: ServerSettings, open_files: int) -> int:
    """Connections the server accepts at once (``max_connections``, or what ``open_files``
    descriptors leave after every kernel's share and the server's own). Never below one a
    session (each may hold a WebSocket) and ``MIN_CONNECTIONS`` more: uvicorn answers 503 to
    every HTTP request, ``/health`` too, while its connections are at the cap."""
    if settings.max_connections is not None:
        return settings.max_connections
    spare = open_files - settings.kernel_limit * DESCRIPTORS_PER_KERNEL - RESERVED_DESCRIPTORS
    return max(settings.max_sessions + MIN_CONNECTIONS, spare)


def descriptor_shortfall(settings: ServerSettings, open_files: int) -> str | None:
    """The warning for a descriptor limit too low for the kernels and sessions asked for
    (each WebSocket session a connection), or None."""
    connections = connection_cap(settings, open_files)
    kernels = settings.kernel_limit * DESCRIPTORS_PER_KERNEL
    needed = kernels + connections + RESERVED_DESCRIPTORS
    if open_files >= needed:
        return None
    fits = max(0, open_files - RESERVED_DESCRIPTORS - connections) // DESCRIPTORS_PER_KERNEL
    return (
        f"the open files limit ({open_files}) is too low for {settings.kernel_limit} kernels "
        f"at {DESCRIPTORS_PER_KERNEL} descriptors each and {connections} connections: "
        f'{needed} are needed, and kernels past about {fits} may fail to start ("Too many '
        "open files\"). Raise the hard limit (ulimit -Hn; systemd's LimitNOFILE=; docker run "
        "--ulimit nofile=N:N), or lower --max-sessions / --max-kernels / --max-connections"
    )


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
    open_files = raise_descriptor_limit()
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
        # Past it, a request on a new connection gets 503 and the connection is closed, so
        # idle keep-alive connections (held KEEP_ALIVE s) cannot take the kernels'
        # descriptors. A WebSocket counts, but its handshake is not refused: a session
        # past --max-sessions is (CAPACITY_REACHED). uvicorn counts the connection asking
        # among those open: at a limit of N, N - 1 are served.
        limit_concurrency=connection_cap(settings, open_files) + 1,
        # No permessage-deflate: it costs server CPU on every step (P6 is CPU-bound; see
        # benchmarks/README.md), and it would deflate a 100 MB state frame on the event loop.
        ws_per_message_deflate=False,
    )
    if (shortfall := descriptor_shortfall(settings, open_files)) is not None:
        log.warning("%s", shortfall)
    return DrainingServer(config, app), sock, settings
