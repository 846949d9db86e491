"""Issue 14, items 1 and 2: browsers (foreign Origin, DNS rebinding) and unauthenticated bodies
against a real server on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from serverkit import small_settings, thread_server
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from kernel_env.server.settings import ServerSettings

TOKEN = "guard-test-token"
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def open_server() -> Iterator[str]:
    """A server with no token, as `make serve` runs it."""
    with thread_server(small_settings(pool_size=1)) as url:
        yield url


@pytest.fixture(scope="module")
def token_server() -> Iterator[str]:
    with thread_server(small_settings(pool_size=0, token=TOKEN)) as url:
        yield url


def _ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


@pytest.mark.integration  # its server starts a kernel
def test_foreign_origin_is_refused_at_the_websocket_handshake(open_server: str) -> None:
    """A page on evil.example cannot open /ws: the handshake gets 403, no session opens."""
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws(open_server), origin=EVIL, open_timeout=10)  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    metrics = httpx.get(f"{open_server}/metrics", timeout=10).json()
    assert metrics["sessions_total"] == 0


@pytest.mark.integration  # its server starts a kernel
def test_rebinding_host_is_refused_and_nothing_runs(open_server: str) -> None:
    """DNS rebinding: POST /reset under Host rebind.evil.example gets 403 and opens no
    session; a WebSocket under that Host is refused too."""
    response = httpx.post(
        f"{open_server}/reset",
        json={"context": "x"},
        headers={"Host": "rebind.evil.example"},
        timeout=10,
    )
    assert response.status_code == 403
    assert "X-Session-Id" not in response.headers
    port = int(open_server.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        pytest.raises(InvalidStatus) as refused,
    ):
        # The page's name in the URL (so in Host), its rebound address underneath.
        connect(f"ws://rebind.evil.example:{port}/ws", sock=sock, open_timeout=10)
    assert refused.value.response.status_code == 403
    assert httpx.get(f"{open_server}/metrics", timeout=10).json()["sessions_total"] == 0


@pytest.mark.integration  # its server starts a kernel
def test_cross_site_post_is_refused(open_server: str) -> None:
    """A fetch() from a foreign page (Origin set, right Host) is refused, and CORS is closed."""
    response = httpx.post(f"{open_server}/reset", json={}, headers={"Origin": EVIL}, timeout=10)
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.integration  # its server starts a kernel
def test_clients_without_origin_and_same_origin_pages_work(open_server: str) -> None:
    """Non-browser clients (no Origin) and the server's own pages (/docs) are served."""
    with connect(_ws(open_server), open_timeout=10) as ws:
        ws.send(json.dumps({"type": "reset", "data": {"context": "abc"}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "observation"
        ws.send(json.dumps({"type": "step", "data": {"code": "print(6 * 7)"}}))
        reply = json.loads(ws.recv(timeout=30))
        assert reply["data"]["observation"]["result"]["stdout"] == "42\n"
    # The server's own origin is exactly the URL the request was sent to (Host and scheme).
    assert httpx.get(
        f"{open_server}/health", headers={"Origin": open_server}, timeout=10
    ).is_success
    with connect(_ws(open_server), origin=open_server, open_timeout=10) as ws:  # type: ignore[arg-type]
        ws.send(json.dumps({"type": "reset", "data": {"context": "abc"}}))
        assert json.loads(ws.recv(timeout=30))["type"] == "observation"


def _local_origins(url: str) -> list[str]:
    """Pages on this machine that are not the server's: other ports, another scheme, the
    server's port under another name (which another process may serve on [::1])."""
    port = url.rsplit(":", 1)[1]
    return [
        "http://localhost:3000",
        "http://127.0.0.1:9999",
        "https://localhost",
        "http://[::1]:1234",
        f"http://localhost:{port}",
        f"https://127.0.0.1:{port}",
    ]


def _reset_status(url: str, origin: str) -> int:
    """The status of a POST /reset sent with ``origin``; a session it opened is closed."""
    response = httpx.post(
        f"{url}/reset", json={"context": "x"}, headers={"Origin": origin}, timeout=60
    )
    if "X-Session-Id" in response.headers:
        httpx.delete(f"{url}/sessions/{response.headers['X-Session-Id']}", timeout=30)
    return response.status_code


def _handshake_status(url: str, origin: str) -> int:
    """The HTTP status of a /ws handshake sent with ``origin`` (101: the socket opened)."""
    try:
        with connect(_ws(url), origin=origin, open_timeout=10):  # type: ignore[arg-type]
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


@pytest.mark.integration  # its server starts a kernel
def test_another_local_origin_cannot_reset(open_server: str) -> None:
    """A page served from another local port, scheme or name is another origin: its POST
    /reset gets 403 (and so opens no session)."""
    origins = _local_origins(open_server)
    assert {o: _reset_status(open_server, o) for o in origins} == dict.fromkeys(origins, 403)


@pytest.mark.integration  # its server starts a kernel
def test_another_local_origin_cannot_open_the_websocket(open_server: str) -> None:
    """The same pages cannot open /ws: the handshake is refused with 403."""
    origins = _local_origins(open_server)
    assert {o: _handshake_status(open_server, o) for o in origins} == dict.fromkeys(origins, 403)


@pytest.mark.integration  # its accepted reset starts a kernel
def test_bound_to_all_interfaces_only_the_requests_own_origin_passes() -> None:
    """Bound to 0.0.0.0, any IP address is a Host the server answers to, but an IP-literal
    Origin passes only when it is the very address and port the request went to."""
    with thread_server(small_settings(host="0.0.0.0", pool_size=0)) as bound:
        url = bound.replace("0.0.0.0", "127.0.0.1")
        port = url.rsplit(":", 1)[1]
        others = ["http://10.1.2.3:8000", f"http://127.0.0.2:{port}", f"http://10.1.2.3:{port}"]
        assert {o: _reset_status(url, o) for o in others} == dict.fromkeys(others, 403)
        assert {o: _handshake_status(url, o) for o in others} == dict.fromkeys(others, 403)
        assert (_reset_status(url, url), _handshake_status(url, url)) == (200, 101)


def test_own_origin_follows_the_scheme_served_and_default_ports(open_server: str) -> None:
    """Behind a TLS proxy on loopback (X-Forwarded-Proto: https, which uvicorn trusts from
    there) the own origin is https://<Host>, and http://<Host> is another; a Host without a
    port is the scheme's default port, written or not."""
    host = open_server.removeprefix("http://")

    def status(origin: str, **headers: str) -> int:
        headers["Origin"] = origin
        return httpx.get(f"{open_server}/health", headers=headers, timeout=10).status_code

    assert status(f"https://{host}", **{"X-Forwarded-Proto": "https"}) == 200
    assert status(f"http://{host}", **{"X-Forwarded-Proto": "https"}) == 403
    assert status("http://localhost:80", Host="localhost") == 200
    assert status("HTTP://LOCALHOST/", Host="localhost") == 200
    assert status("https://localhost", Host="localhost") == 403


def test_configured_origins_get_cors_and_hosts_can_be_widened() -> None:
    """--allowed-origins opens CORS for those origins only; --allowed-hosts adds names."""
    settings = small_settings(
        pool_size=0,
        allowed_origins=("https://app.example",),
        allowed_hosts=("kernels.internal", "127.0.0.1"),
    )
    with thread_server(settings) as url:
        ok = httpx.get(f"{url}/health", headers={"Origin": "https://app.example"}, timeout=10)
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        named = httpx.get(f"{url}/health", headers={"Host": "kernels.internal"}, timeout=10)
        assert named.status_code == 200
        assert httpx.get(f"{url}/health", headers={"Origin": EVIL}, timeout=10).status_code == 403


# -- item 2: auth before anything is read ------------------------------------------------


def _raw_request(url: str, head: str, body_part: bytes = b"") -> tuple[int, bytes]:
    """Send request headers (and a first piece of body), never the rest; the status line the
    server answers with, read with a bounded wait."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(head.encode() + b"\r\n" + body_part)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1]) if reply else 0
    return status, reply


def test_unauthenticated_huge_body_gets_401_before_it_is_sent(token_server: str) -> None:
    """A 150 MiB POST /reset without a token is answered 401 from its headers alone: the
    server never waits for (or buffers) the body."""
    host = token_server.removeprefix("http://")
    head = (
        f"POST /reset HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {150 << 20}\r\n"
    )
    status, reply = _raw_request(token_server, head, b'{"context": "' + b"x" * 65536)
    assert status == 401, reply[:200]
    chunked = (
        f"POST /step HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
        "Content-Type: application/json\r\n"
    )
    status, reply = _raw_request(token_server, chunked, b"10000\r\n" + b"x" * 65536 + b"\r\n")
    assert status == 401, reply[:200]


def test_oversized_step_body_is_refused_from_its_length(token_server: str) -> None:
    """With the token, a /step body over the step's own limit (code, not context) gets 413
    before it is sent; /reset keeps the larger context limit."""
    host = token_server.removeprefix("http://")
    head = (
        f"POST /step HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {100 << 20}\r\n"
    )
    status, reply = _raw_request(token_server, head)
    assert status == 413, reply[:200]


@pytest.mark.integration
def test_blank_token_is_a_startup_error() -> None:
    """KERNEL_ENV_TOKEN="" or " " is an error at start-up, never a silent "no auth"."""
    for blank in ("", " "):
        with pytest.raises(ValueError, match="blank"):
            ServerSettings.from_env({"KERNEL_ENV_TOKEN": blank})
    result = subprocess.run(
        [sys.executable, "-m", "kernel_env", "serve", "--port", "0"],
        env={"KERNEL_ENV_TOKEN": " ", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "KERNEL_ENV_TOKEN is set but blank" in result.stderr


def test_with_a_token_any_name_is_served_but_foreign_origins_are_not(token_server: str) -> None:
    """A server with a token is reachable under any name (a Space, a Service): the token
    admits. A foreign Origin is refused all the same."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    named = httpx.get(f"{token_server}/metrics", headers={**auth, "Host": "x.hf.space"}, timeout=10)
    assert named.status_code == 200
    evil = httpx.get(f"{token_server}/metrics", headers={**auth, "Origin": EVIL}, timeout=10)
    assert evil.status_code == 403
