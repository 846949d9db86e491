"""The E2B door under a hostile client, against a real ``kernel-env serve``: a body too large
for its route is refused before it is read (the server's memory stays flat and other sandboxes
keep running), a 150 MiB file goes up and comes down in bounded chunks (flat memory again),
a sandbox's concurrent transfers are bounded, and a sandbox id answers the same whether it
exists with another token or never existed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from attacks import MiB, chunked, code_body, send_huge, status_of
from procs import peak_growth
from serverkit import ServeProcess, serve_process

pytestmark = pytest.mark.integration  # a server and its kernels

TOKEN = "e2b_" + secrets.token_hex(20)
INTERPRETER, ENVD = "49999", "49983"


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
        size = 150 * MiB
        statuses: list[int] = []

        def attack() -> None:
            statuses.append(send_huge(url, head + f"Content-Length: {size}\r\n", code_body(size)))
            te = head + "Transfer-Encoding: chunked\r\n"
            statuses.append(send_huge(url, te, chunked(code_body(size))))

        with peak_growth(server.pid) as grown:
            attacker = threading.Thread(target=attack)
            attacker.start()
            for n in range(5):
                assert _run(url, other, f"{n} * 3")[0]["text"] == str(n * 3)
            attacker.join(timeout=300)
        grown_mib = grown[0]
        assert statuses == [413, 413], f"{statuses}; peak RSS grew by {grown_mib:.0f} MiB"
        assert grown_mib <= 64, f"the server's peak RSS grew by {grown_mib:.0f} MiB"
        assert _run(url, big, "2 + 2")[0]["text"] == "4"


_BIG = 150  # MiB
_BOUNDARY = "kernel-env-upload-boundary"
# The file's MiB number n is the SHA-256 of n, repeated: every MiB differs, so a chunk lost,
# doubled or out of place changes the hash. The same lines make it in a cell.
_MAKE_BIG = """
import hashlib, os
digest = hashlib.sha256()
with open(os.path.expanduser({path!r}), 'wb') as f:
    for n in range({mib}):
        piece = hashlib.sha256(n.to_bytes(8, 'big')).digest() * 32768
        f.write(piece)
        digest.update(piece)
digest.hexdigest()
"""
_HASH_FILE = """
import hashlib, os
digest = hashlib.sha256()
with open(os.path.expanduser({path!r}), 'rb') as f:
    while piece := f.read(1 << 20):
        digest.update(piece)
digest.hexdigest()
"""


def _big_file(mib: int = _BIG) -> Iterator[bytes]:
    for n in range(mib):
        yield hashlib.sha256(n.to_bytes(8, "big")).digest() * 32768


def _big_digest(mib: int = _BIG) -> str:
    digest = hashlib.sha256()
    for piece in _big_file(mib):
        digest.update(piece)
    return digest.hexdigest()


def _multipart(*files: tuple[str, Iterator[bytes]]) -> Iterator[bytes]:
    """The SDK's upload of files as ``multipart/form-data``: a part named ``file`` for each,
    whose file name is its path."""
    for path, pieces in files:
        yield (
            f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{path}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        yield from pieces
        yield b"\r\n"
    yield f"--{_BOUNDARY}--\r\n".encode()


def _kernel_text(url: str, sandbox: dict[str, Any], code: str) -> str:
    events = _run(url, sandbox, code)
    results = [e["text"] for e in events if e["type"] == "result"]
    assert len(results) == 1, events
    return str(results[0]).strip("'")


def _while_stepping(
    server: ServeProcess, other: dict[str, Any], transfer: Callable[[], Any]
) -> tuple[Any, float, list[float]]:
    """``transfer()``'s result, the server's peak RSS growth (MiB) while it ran, and how long
    each of the other sandbox's steps took meanwhile (at least three, one or more of them
    while the transfer was under way)."""
    outcome: list[Any] = []
    with peak_growth(server.pid) as grown:
        mover = threading.Thread(target=lambda: outcome.append(transfer()))
        mover.start()
        steps: list[float] = []
        during = 0
        while mover.is_alive() or len(steps) < 3:
            n = len(steps)
            began = time.monotonic()
            assert _run(server.url, other, f"{n} * 3")[0]["text"] == str(n * 3)
            steps.append(time.monotonic() - began)
            during += mover.is_alive()
        mover.join(timeout=300)
    assert outcome, "the transfer raised (see the thread's traceback above)"
    assert during >= 1, f"no step ran during the transfer ({steps})"
    return outcome[0], grown[0], steps


@pytest.mark.parametrize("kind", ["octet-stream", "multipart"])
def test_a_150_mib_upload_streams_with_flat_memory(server: ServeProcess, kind: str) -> None:
    """150 MiB sent to envd's ``POST /files`` (chunked, as the SDK streams a file, in either
    of its two encodings) lands byte for byte in the sandbox while the server's peak RSS
    grows by at most 64 MiB and another sandbox steps normally."""
    url = server.url
    with _sandbox(url) as big, _sandbox(url) as other:
        assert _run(url, other, "1 + 1")[0]["text"] == "2"
        headers = _headers(big["sandboxID"], big["envdAccessToken"], ENVD)
        path = "/home/user/up/big.bin"
        if kind == "multipart":
            headers["Content-Type"] = f"multipart/form-data; boundary={_BOUNDARY}"
            target, body = f"{url}/files", _multipart((path, _big_file()))
        else:
            headers["Content-Type"] = "application/octet-stream"
            target, body = f"{url}/files?path={path}", _big_file()

        def upload() -> httpx.Response:
            return httpx.post(target, content=body, headers=headers, timeout=600)

        reply, grown_mib, steps = _while_stepping(server, other, upload)
        assert reply.status_code == 200, f"{reply.status_code} {reply.text[:300]}"
        assert grown_mib <= 64, f"the server's peak RSS grew by {grown_mib:.0f} MiB"
        assert reply.json() == [{"name": "big.bin", "type": "file", "path": path}]
        assert _kernel_text(url, big, _HASH_FILE.format(path="~/up/big.bin")) == _big_digest()
        assert max(steps) < 10, f"the other sandbox's steps took {steps} s"


def test_a_150_mib_download_streams_with_flat_memory(server: ServeProcess) -> None:
    """A 150 MiB file a cell wrote comes down from envd's ``GET /files`` byte for byte, in
    bounded chunks: the server's peak RSS grows by at most 64 MiB while another sandbox steps
    normally."""
    url = server.url
    with _sandbox(url) as big, _sandbox(url) as other:
        made = _kernel_text(url, big, _MAKE_BIG.format(path="~/down.bin", mib=_BIG))
        assert made == _big_digest()
        headers = _headers(big["sandboxID"], big["envdAccessToken"], ENVD)

        def download() -> tuple[int, int, str, str]:
            digest, size = hashlib.sha256(), 0
            target = f"{url}/files?path=/home/user/down.bin"
            with httpx.stream("GET", target, headers=headers, timeout=600) as reply:
                if reply.status_code != 200:
                    return reply.status_code, 0, "", reply.read().decode()[:300]
                for piece in reply.iter_bytes():
                    digest.update(piece)
                    size += len(piece)
            return reply.status_code, size, digest.hexdigest(), ""

        (status, size, digest, text), grown_mib, steps = _while_stepping(server, other, download)
        assert status == 200, f"{status} {text}"
        assert (size, digest) == (_BIG * MiB, made)
        assert grown_mib <= 64, f"the server's peak RSS grew by {grown_mib:.0f} MiB"
        assert max(steps) < 10, f"the other sandbox's steps took {steps} s"
        missing = httpx.get(f"{url}/files?path=/home/user/none.bin", headers=headers, timeout=30)
        assert missing.status_code == 404, missing.text
        assert missing.json()["code"] == 404


def test_a_sandboxs_concurrent_transfers_are_bounded(server: ServeProcess) -> None:
    """Of five uploads to a sandbox under way at once, one gets E2B's 429 (which the SDK
    raises as a rate limit) at once, unread, and so does a download meanwhile; another
    sandbox's transfers are not counted; once the four end, they all landed."""
    url = server.url
    host, port = url.removeprefix("http://").split(":")
    with _sandbox(url) as busy, _sandbox(url) as other:
        headers = _headers(busy["sandboxID"], busy["envdAccessToken"], ENVD)
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        uploads: list[socket.socket] = []
        try:
            for n in range(5):  # each sends its head and 1 KiB, and waits
                sock = socket.create_connection((host, int(port)), timeout=60)
                uploads.append(sock)
                sock.sendall(
                    f"POST /files?path=held{n}.bin HTTP/1.1\r\nHost: {host}\r\n{fields}"
                    "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    .encode() + next(chunked(iter([b"x" * 1024])))
                )  # fmt: skip
            answered, _, _ = select.select(uploads, [], [], 60)
            time.sleep(1)  # any other answer would have come by now
            answered, _, _ = select.select(uploads, [], [], 0)
            assert len(answered) == 1, f"{len(answered)} of 5 uploads answered early"
            refused = answered[0]
            assert status_of(refused) == 429
            fetched = httpx.get(f"{url}/files?path=held0.bin", headers=headers, timeout=30)
            assert fetched.status_code == 429, fetched.text
            assert fetched.json()["code"] == 429
            assert "transfers under way" in fetched.json()["message"]
            other_headers = _headers(other["sandboxID"], other["envdAccessToken"], ENVD)
            put = httpx.post(
                f"{url}/files?path=o.bin", content=b"o",
                headers={**other_headers, "Content-Type": "application/octet-stream"}, timeout=30,
            )  # fmt: skip
            assert put.status_code == 200, put.text
            landed = [n for n, sock in enumerate(uploads) if sock is not refused]
            for n in landed:
                uploads[n].sendall(b"".join(chunked(iter([b"y" * 1024]))))
                assert status_of(uploads[n]) == 200
        finally:
            for sock in uploads:
                sock.close()
        for n in landed:
            again = httpx.get(f"{url}/files?path=held{n}.bin", headers=headers, timeout=30)
            assert (again.status_code, again.content) == (200, b"x" * 1024 + b"y" * 1024)


def test_an_upload_is_bounded_as_it_streams() -> None:
    """With ``--max-message-bytes`` 4 MiB, a 3 MiB two-file multipart upload lands whole (both
    files, several chunks each); 8 MiB declared gets 413 at once, and 8 MiB chunked gets 413
    once it passes 4 MiB, in E2B's shape."""
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    with (
        serve_process("--pool-size", "1", "--max-message-bytes", str(4 * MiB), env=env) as small,
        _sandbox(small.url) as sandbox,
    ):
        url = small.url
        headers = _headers(sandbox["sandboxID"], sandbox["envdAccessToken"], ENVD)
        one, two = os.urandom(3 * MiB // 2), os.urandom(3 * MiB // 2 + 7)
        body = b"".join(
            _multipart(("/home/user/m/one.bin", iter([one])), ("/home/user/m/two.bin", iter([two])))
        )
        form = {**headers, "Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"}
        put = httpx.post(f"{url}/files", content=body, headers=form, timeout=60)
        assert put.status_code == 200, put.text
        assert [e["path"] for e in put.json()] == ["/home/user/m/one.bin", "/home/user/m/two.bin"]
        for path, data in [("m/one.bin", one), ("m/two.bin", two)]:
            got = httpx.get(f"{url}/files?path={path}", headers=headers, timeout=60)
            assert (got.status_code, got.content == data) == (200, True), got.status_code
        stream = {**headers, "Content-Type": "application/octet-stream"}
        declared = httpx.post(
            f"{url}/files?path=big.bin", content=b"x" * (8 * MiB), headers=stream, timeout=60
        )
        chunked = httpx.post(
            f"{url}/files?path=big.bin", content=iter([b"x" * MiB] * 8), headers=stream,
            timeout=60,
        )  # fmt: skip
        for refused in (declared, chunked):
            assert refused.status_code == 413, refused.text[:200]
            assert refused.json()["code"] == 413
            assert f"limit of {4 * MiB} bytes for /files" in refused.json()["message"]


def test_execute_and_contexts_bodies_have_their_own_bounds(server: ServeProcess) -> None:
    """A 16 MiB /execute (past 6 x max-code-chars + 64 KiB) and a 2 MiB /contexts get 413 in
    E2B's error shape; a step's largest code still runs."""
    url = server.url
    with _sandbox(url) as sandbox:
        headers = _headers(sandbox["sandboxID"], sandbox["envdAccessToken"])
        code = json.dumps({"code": "x" * (16 * MiB)})
        too_big = httpx.post(f"{url}/execute", content=code, headers=headers, timeout=60)
        assert too_big.status_code == 413, too_big.text[:200]
        assert too_big.json()["code"] == 413
        assert "exceeds" in too_big.json()["message"]
        context = json.dumps({"language": "python", "cwd": "x" * (2 * MiB)})
        refused = httpx.post(f"{url}/contexts", content=context, headers=headers, timeout=60)
        assert refused.status_code == 413, refused.text[:200]
        # The largest code a step takes (1 Mi chars, JSON-escaped at 6 bytes a char) passes.
        largest = json.dumps({"code": "len('" + "\x01" * (MiB - 7) + "')"})
        assert len(largest) > 6 * MiB - 64
        ran = httpx.post(f"{url}/execute", content=largest, headers=headers, timeout=120)
        assert ran.status_code == 200, ran.text[:200]
        lines = [json.loads(line) for line in ran.text.splitlines() if line.strip()]
        assert [e["text"] for e in lines if e["type"] == "result"] == [str(MiB - 7)]


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
