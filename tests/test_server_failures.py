"""Issue 14, items 5 and 6: requests that fail half-way leave nothing open and count what
happened; bad export names are a clear 4xx."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from serverkit import kernel_pids, make_client, wait_until

CONTEXT_PATH = (
    "import sys\n"
    "print(sys.modules['kernel_env.inkernel.extension']._episode.setup_params['context_path'])"
)


@pytest.mark.integration
def test_refused_resets_leave_no_session_or_kernel() -> None:
    """Eight POST /reset {"context": "\\ud800"} on a server of 8 sessions: each is refused
    with no session id, none stays open, and a ninth normal reset still gets a session."""
    body = b'{"context": "\\ud800"}'  # JSON's escape for a lone surrogate
    with make_client(max_sessions=8, pool_size=1) as c:
        for _ in range(8):
            response = c.post("/reset", content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 422
            assert "X-Session-Id" not in response.headers
            assert "surrogate" in str(response.json()["detail"])
        metrics = c.get("/metrics").json()
        assert metrics["sessions_active"] == 0
        assert metrics["kernels_in_sessions"] == 0
        ok = c.post("/reset", json={"context": "fine"})
        assert ok.status_code == 200
        assert c.get("/metrics").json()["sessions_active"] == 1


@pytest.mark.integration
def test_a_reset_that_fails_after_opening_closes_its_session() -> None:
    """A reset that fails inside the episode (context over the server's limit) closes the
    session it opened, and its kernel: nothing waits for the idle TTL."""
    import os

    with make_client(max_sessions=2, pool_size=0, max_context_chars=10) as c:
        for _ in range(3):
            response = c.post("/reset", json={"context": "x" * 11})
            assert response.status_code == 422
            assert "X-Session-Id" not in response.headers
        assert c.get("/metrics").json()["sessions_active"] == 0
        assert wait_until(lambda: not kernel_pids(os.getpid()), 10)


@pytest.mark.integration
def test_restarts_are_counted_when_setup_fails_after_a_restart() -> None:
    """The kernel dies, and the setup after its restart fails (the staged context's place is
    taken by a directory, from the host: a sandboxed cell cannot do it): the step fails, and
    the `restarts` metric still counts the restart."""
    with make_client(pool_size=0) as c:
        reset = c.post("/reset", json={"context": "y" * 100_000})
        sid = reset.headers["X-Session-Id"]
        headers = {"X-Session-Id": sid}
        path = c.post("/step", json={"action": {"code": CONTEXT_PATH}}, headers=headers)
        staged = Path(path.json()["observation"]["result"]["stdout"].strip())
        staged.unlink()
        staged.mkdir()
        step = c.post("/step", json={"action": {"code": "import os; os._exit(1)"}}, headers=headers)
        assert step.status_code == 503, step.text
        assert "setup failed" in step.json()["detail"]
        assert c.get("/metrics").json()["restarts"] == 1


@pytest.mark.integration
@pytest.mark.parametrize("length", [201, 300, 5000])
def test_long_export_names_are_refused_not_a_500(length: int) -> None:
    """A 300-character export name is a 422 naming the limit, not a server error."""
    with make_client(pool_size=0) as c:
        sid = c.post("/reset", json={"context": "z"}).headers["X-Session-Id"]
        response = c.get(f"/sessions/{sid}/export.zip", params={"name": "n" * length})
        assert response.status_code == 422
        assert "at most 200 bytes" in str(response.json()["detail"])
        started = time.monotonic()
        fine = c.get(f"/sessions/{sid}/export.zip", params={"name": "n" * 190 + ".ipynb"})
        assert fine.status_code == 200, time.monotonic() - started


def test_an_internal_value_error_is_the_servers_fault_not_the_clients() -> None:
    """A ValueError from the server's own code (here its kernel source) is a 500 over HTTP and
    an EXECUTION_ERROR frame on /ws, never the 422 / VALIDATION_ERROR that blames the client."""
    from serverkit import LoopbackClient

    from kernel_env.server import create_app
    from kernel_env.server.settings import ServerSettings

    async def broken_source() -> Any:
        raise ValueError("an internal bug")

    app = create_app(ServerSettings(pool_size=0), kernel_factory=broken_source)
    with LoopbackClient(app, raise_server_exceptions=False) as c:
        assert c.post("/reset", json={}).status_code == 500
        with c.websocket_connect("/ws") as ws:
            ws.send_json({"type": "reset"})
            reply = ws.receive_json()
            assert reply["type"] == "error"
            assert reply["data"]["code"] == "EXECUTION_ERROR"
            ws.send_json({"type": "state"})  # the socket stays open
            assert ws.receive_json()["type"] == "state"
