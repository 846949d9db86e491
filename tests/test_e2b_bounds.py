"""The E2B door under a hostile client, against a real ``kernel-env serve``: a body too large
for its route is refused before it is read (the server's memory stays flat and other sandboxes
keep running), and a sandbox id answers the same whether it exists with another token or never
existed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverkit import ServeProcess, serve_process

pytestmark = pytest.mark.integration  # a server and its kernels

TOKEN = "e2b_" + secrets.token_hex(20)
INTERPRETER, ENVD = "49999", "49983"
_MiB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    with serve_process("--pool-size", "2", env=env) as process:
        yield process


@contextlib.contextmanager
def _sandbox(url: str) -> Iterator[dict[str, Any]]:
    created = httpx.post(f"{url}/sandboxes", json={}, headers={"X-API-KEY": TOKEN}, timeout=60)
    assert created.status_code == 201, created.text
    sandbox: dict[str, Any] = created.json()
    try:
        yield sandbox
    finally:
        httpx.delete(
            f"{url}/sandboxes/{sandbox['sandboxID']}", headers={"X-API-KEY": TOKEN}, timeout=30
        )


def _headers(sandbox_id: str, token: str | None, port: str = INTERPRETER) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": port}
    if token is not None:
        headers["X-Access-Token"] = token
    return headers


def _run(url: str, sandbox: dict[str, Any], code: str) -> list[dict[str, Any]]:
    reply = httpx.post(
        f"{url}/execute",
        json={"code": code},
        headers=_headers(sandbox["sandboxID"], sandbox["envdAccessToken"]),
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return [json.loads(line) for line in reply.text.splitlines() if line.strip()]


def _peak_kib(pid: int) -> int:
    match = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    assert match is not None
    return int(match.group(1))


def _rss_kib(pid: int) -> int:
    match = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    assert match is not None
    return int(match.group(1))


def _reset_peak(pid: int) -> bool:
    """Start VmHWM again from the current RSS; False where this user may not (an
    unprivileged server is not dumpable, so its ``clear_refs`` is root's)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except PermissionError:
        return False
    return True


@contextlib.contextmanager
def _rss_sampled(pid: int) -> Iterator[list[int]]:
    """The server's RSS (KiB) every 5 ms while the block runs, its largest last: the peak
    where VmHWM cannot be reset (a 150 MiB body takes far longer than 5 ms to arrive)."""
    samples = [_rss_kib(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            samples.append(_rss_kib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        done.set()
        sampler.join(timeout=5)
        samples.append(max(samples))


def _send_huge(url: str, head: str, body: Iterator[bytes]) -> int:
    """Send ``head`` then ``body``'s pieces (stopping when the server stops reading or has
    answered); the status the server answers with (0: none)."""
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
        reply = b""
        with contextlib.suppress(OSError):
            while b"\r\n" not in reply:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        answered.set()
        with contextlib.suppress(OSError):  # the server may have closed it already
            sock.shutdown(socket.SHUT_RDWR)
        sender.join(timeout=120)
    return int(reply.split(b" ", 2)[1]) if reply else 0


def _code_body(size: int, piece: int = _MiB) -> Iterator[bytes]:
    """A JSON document ``{"code": "xxx..."}`` of ``size`` bytes, in pieces."""
    yield b'{"code": "'
    left = size - len(b'{"code": "') - len(b'"}')
    while left > 0:
        n = min(piece, left)
        yield b"x" * n
        left -= n
    yield b'"}'


def _chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def test_a_150_mib_execute_is_refused_unread_with_flat_memory(server: ServeProcess) -> None:
    """150 MiB of code sent to /execute (declared, then chunked) gets 413 before the server
    holds it: its peak RSS grows by at most 64 MiB while another sandbox steps normally."""
    url = server.url
    with _sandbox(url) as big, _sandbox(url) as other:
        assert _run(url, other, "1 + 1")[0]["text"] == "2"
        host = url.removeprefix("http://")
        head = (
            f"POST /execute HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"E2b-Sandbox-Id: {big['sandboxID']}\r\nE2b-Sandbox-Port: {INTERPRETER}\r\n"
            f"X-Access-Token: {big['envdAccessToken']}\r\n"
        )
        size = 150 * _MiB
        hwm = _reset_peak(server.pid)
        before = _peak_kib(server.pid) if hwm else _rss_kib(server.pid)
        statuses: list[int] = []

        def attack() -> None:
            statuses.append(_send_huge(url, head + f"Content-Length: {size}\r\n", _code_body(size)))
            chunked = head + "Transfer-Encoding: chunked\r\n"
            statuses.append(_send_huge(url, chunked, _chunked(_code_body(size))))

        with _rss_sampled(server.pid) as rss:
            attacker = threading.Thread(target=attack)
            attacker.start()
            for n in range(5):
                assert _run(url, other, f"{n} * 3")[0]["text"] == str(n * 3)
            attacker.join(timeout=300)
        peak = _peak_kib(server.pid) if hwm else rss[-1]
        grown_mib = (peak - before) / 1024
        assert statuses == [413, 413], f"{statuses}; peak RSS grew by {grown_mib:.0f} MiB"
        assert grown_mib <= 64, f"the server's peak RSS grew by {grown_mib:.0f} MiB"
        assert _run(url, big, "2 + 2")[0]["text"] == "4"


def test_execute_and_contexts_bodies_have_their_own_bounds(server: ServeProcess) -> None:
    """A 16 MiB /execute (past 6 x max-code-chars + 64 KiB) and a 2 MiB /contexts get 413 in
    E2B's error shape; a step's largest code still runs."""
    url = server.url
    with _sandbox(url) as sandbox:
        headers = _headers(sandbox["sandboxID"], sandbox["envdAccessToken"])
        code = json.dumps({"code": "x" * (16 * _MiB)})
        too_big = httpx.post(f"{url}/execute", content=code, headers=headers, timeout=60)
        assert too_big.status_code == 413, too_big.text[:200]
        assert too_big.json()["code"] == 413
        assert "exceeds" in too_big.json()["message"]
        context = json.dumps({"language": "python", "cwd": "x" * (2 * _MiB)})
        refused = httpx.post(f"{url}/contexts", content=context, headers=headers, timeout=60)
        assert refused.status_code == 413, refused.text[:200]
        # The largest code a step takes (1 Mi chars, JSON-escaped at 6 bytes a char) passes.
        largest = json.dumps({"code": "len('" + "\x01" * (_MiB - 7) + "')"})
        assert len(largest) > 6 * _MiB - 64
        ran = httpx.post(f"{url}/execute", content=largest, headers=headers, timeout=120)
        assert ran.status_code == 200, ran.text[:200]
        lines = [json.loads(line) for line in ran.text.splitlines() if line.strip()]
        assert [e["text"] for e in lines if e["type"] == "result"] == [str(_MiB - 7)]


# Every route of a sandbox's ports (and one port no sandbox serves), with a small body.
SANDBOX_ROUTES = [
    (INTERPRETER, "POST", "/execute", b'{"code": "1"}'),
    (INTERPRETER, "POST", "/contexts", b'{"language": "python"}'),
    (INTERPRETER, "GET", "/contexts", b""),
    (INTERPRETER, "DELETE", "/contexts/abc", b""),
    (INTERPRETER, "GET", "/health", b""),
    (ENVD, "GET", "/health", b""),
    (ENVD, "GET", "/files?path=a.txt", b""),
    (ENVD, "POST", "/files?path=a.txt", b"hi"),
    (ENVD, "POST", "/process.Process/List", b"{}"),
    (ENVD, "POST", "/filesystem.Filesystem/Stat", b'{"path": "/home/user"}'),
    ("8080", "GET", "/", b""),
]


def test_a_sandbox_id_tells_nothing_without_its_token(server: ServeProcess) -> None:
    """On every route of a sandbox's ports, a live sandbox's id with a wrong token or none
    gets byte for byte the answer an id that never existed gets: nothing tells which ids
    exist."""
    url = server.url
    with _sandbox(url) as live:
        sandbox_id = live["sandboxID"]
        never = "i" + secrets.token_hex(len(sandbox_id) // 2)[: len(sandbox_id) - 1]
        wrong = secrets.token_hex(16)
        for port, method, path, body in SANDBOX_ROUTES:
            answers = {
                who: httpx.request(
                    method, f"{url}{path}", content=body, headers=_headers(sid, token, port),
                    timeout=30,
                )
                for who, sid, token in [
                    ("unknown id", never, wrong),
                    ("wrong token", sandbox_id, wrong),
                    ("no token", sandbox_id, None),
                    ("the other's token", never, live["envdAccessToken"]),
                ]
            }  # fmt: skip
            seen = {who: (a.status_code, a.content) for who, a in answers.items()}
            assert len(set(seen.values())) == 1, (method, path, seen)
            assert answers["unknown id"].status_code == 502, (method, path, seen)
        assert _run(url, live, "1 + 1")[0]["text"] == "2"  # its own token still opens it
