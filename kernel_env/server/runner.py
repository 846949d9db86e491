"""Running the app under uvicorn, with a shutdown that drains before connections are cut.

uvicorn's own shutdown closes every WebSocket at once (close 1012) and only then runs the
app's lifespan shutdown, so a step in flight would never be answered. ``DrainingServer``
stops listening, lets in-flight steps answer (``drain_timeout``), shuts every kernel down,
and only then lets uvicorn close the connections.
"""

from __future__ import annotations

import socket
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from kernel_env.server.app import create_app
from kernel_env.server.settings import ServerSettings

__all__ = ["DrainingServer", "bind", "build_server"]


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


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; ``port=0`` picks a free port (read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def build_server(
    settings: ServerSettings, app: FastAPI | None = None
) -> tuple[DrainingServer, socket.socket, ServerSettings]:
    """The server, its bound socket, and the settings with the real port filled in."""
    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    settings = replace(settings, port=port)
    app = app or create_app(settings)
    config = uvicorn.Config(
        app,
        loop="asyncio",  # the same loop kind the tests and the local client use
        lifespan="on",
        log_level=settings.log_level,
        ws_max_size=settings.max_message_bytes,  # bigger frames: close 1009, never buffered
        timeout_graceful_shutdown=2,  # after our own drain, only stragglers are left
        # No permessage-deflate: it cost ~0.3 ms of server CPU per step (measured, P6 is
        # CPU-bound), and it would deflate a 100 MB state frame on the event loop.
        ws_per_message_deflate=False,
    )
    return DrainingServer(config, app), sock, settings
