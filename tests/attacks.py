"""What hostile clients send: request bodies too large to hold, sent over a raw socket so the
test sees the server's answer even when the server stops reading early."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

MiB = 1 << 20


def send_huge(url: str, head: str, body: Iterator[bytes]) -> int:
    """Send ``head`` (the request line and headers, without the blank line) then ``body``'s
    pieces, stopping when the server stops reading or has answered; the status the server
    answers with (0: none)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        answered = threading.Event()

        def send() -> None:
            with contextlib.suppress(OSError):
                sock.sendall(head.encode() + b"\r\n")
                for piece in body:
                    if answered.is_set():
                        return
                    sock.sendall(piece)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        status = 0
        with contextlib.suppress(OSError):
            status = status_of(sock)
        answered.set()
        with contextlib.suppress(OSError):  # the server may have closed it already
            sock.shutdown(socket.SHUT_RDWR)
        sender.join(timeout=120)
    return status


def status_of(sock: socket.socket) -> int:
    """The status of the response ``sock`` receives, from its status line (0: none came)."""
    reply = b""
    while b"\r\n" not in reply:
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    return int(reply.split(b" ", 2)[1]) if reply else 0


def code_body(size: int, piece: int = MiB) -> Iterator[bytes]:
    """A JSON document ``{"code": "xxx..."}`` of ``size`` bytes, in pieces."""
    yield b'{"code": "'
    left = size - len(b'{"code": "') - len(b'"}')
    while left > 0:
        n = min(piece, left)
        yield b"x" * n
        left -= n
    yield b'"}'


def chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """``pieces`` in HTTP/1.1 chunked transfer coding."""
    for piece in pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


# Cells. Each ends; what it did to its own kernel is its own (restarted, refused, cut).

# One 400 MB message to the host on iopub, for the cell's own request.
HUGE_MESSAGE = """
k = get_ipython().kernel
k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'huge'},
               parent=k.get_parent('shell'), buffers=[bytearray(400 * 2**20)])
import time; time.sleep(1)
print('sent')
"""

# As many sleeping children as the kernel may have, up to 600.
FORK_BOMB = """
import os, time
made = 0
for _ in range(600):
    try:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        made += 1
    except OSError:
        break
print('children', made)
"""

# Memory until the kernel's bound stops it (MemoryError, or the kernel is killed).
MEMORY_BOMB = """
blocks = []
try:
    while True:
        blocks.append(bytearray(64 * 2**20))
except MemoryError:
    blocks.clear()
    print('bounded')
"""

# 100 MB of stdout as fast as the kernel prints.
OUTPUT_FLOOD = """
line = 'x' * 999
for _ in range(100_000):
    print(line)
"""
