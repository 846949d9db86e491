"""The server's listening socket: what the connections it accepts are set to, and how long an
idle one is kept."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from serverkit import small_settings, thread_server

from kernel_env.server.runner import KEEP_ALIVE, bind


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


def _get_health(conn: socket.socket) -> bytes:
    """One ``GET /health`` on a kept-alive connection; the response's status line ("" once
    the server has closed the connection)."""
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        head += chunk
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    body = head.split(b"\r\n\r\n", 1)[1]
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b"\r\n", 1)[0]


@pytest.mark.integration  # a real server on loopback (a kernel of its pool, too)
@pytest.mark.slow
def test_an_idle_connection_outlives_an_e2b_clients_idle_pool_timeout() -> None:
    """A client's pooled connection, idle for seconds, is still served: E2B's SDK keeps idle
    connections for 300 s, and a server that closed them after uvicorn's default 5 s raced
    each reuse after such a pause (a reset on loaded machines: `Connection reset by peer`
    on /v2/sandboxes). The server keeps an idle connection longer than that pool does."""
    assert KEEP_ALIVE > 300
    with thread_server(small_settings(pool_size=0)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            assert _get_health(conn) == b"HTTP/1.1 200 OK"
            time.sleep(6)  # past uvicorn's default keep-alive of 5 s
            assert _get_health(conn) == b"HTTP/1.1 200 OK"
