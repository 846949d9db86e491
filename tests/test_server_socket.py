"""The server's listening socket: what the connections it accepts are set to."""

from __future__ import annotations

import asyncio
import socket

from kernel_env.server.runner import bind


async def test_accepted_connections_send_without_nagle() -> None:
    """A connection accepted on ``bind``'s socket has TCP_NODELAY: asyncio sets it only on
    sockets whose protocol says TCP, and without it a response written in two parts (headers,
    then body) waits for the client's delayed ACK on every request after a connection's
    first."""
    sock = bind("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("socket")
        accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 5) == 1
        writer.close()
