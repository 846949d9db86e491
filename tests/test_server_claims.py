"""Sessions nobody claimed: a bare ``POST /reset`` (OpenEnv's stateless HTTP clients never send
``X-Session-Id``) must not hold a kernel for long (issue 15, item 2).

A session is *claimed* once a request carries its id (or at once, for a WebSocket session).
Unclaimed sessions are evicted first when the server is full, and reaped after ``claim_ttl``.
"""

from __future__ import annotations

import time

import pytest
import serverkit
from fastapi.testclient import TestClient

pytestmark = pytest.mark.integration  # kernels, servers or other processes

STEP = {"action": {"code": "print(1)"}}


def _reset(c: TestClient) -> str:
    response = c.post("/reset", json={})
    assert response.status_code == 200, response.text
    return response.headers["X-Session-Id"]


def _step(c: TestClient, sid: str) -> int:
    return c.post("/step", json=STEP, headers={"X-Session-Id": sid}).status_code


def test_bare_resets_never_exhaust_capacity() -> None:
    """Twice max_sessions bare resets all succeed: the oldest unclaimed session makes room,
    and its id then answers 410 saying it was never claimed."""
    with serverkit.make_client(pool_size=0, max_sessions=3) as c:
        ids = [_reset(c) for _ in range(6)]
        assert c.get("/metrics").json()["sessions_active"] == 3
        gone = c.post("/step", json=STEP, headers={"X-Session-Id": ids[0]})
        assert gone.status_code == 410 and "never claimed" in gone.json()["detail"]
        assert _step(c, ids[-1]) == 200


def test_claimed_sessions_are_never_evicted_for_a_bare_reset() -> None:
    """Sessions whose id came back are kept; with every slot claimed, a reset gets 503."""
    with serverkit.make_client(pool_size=0, max_sessions=2) as c:
        kept = [_reset(c) for _ in range(2)]
        assert [_step(c, sid) for sid in kept] == [200, 200]
        full = c.post("/reset", json={})
        assert full.status_code == 503 and "CAPACITY_REACHED" in full.text
        assert [_step(c, sid) for sid in kept] == [200, 200]


def test_websocket_sessions_count_as_claimed() -> None:
    """A WebSocket session is claimed by its socket: a bare reset does not evict it."""
    with serverkit.make_client(pool_size=0, max_sessions=1) as c, c.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {}})
        assert ws.receive_json()["type"] == "observation"
        assert c.post("/reset", json={}).status_code == 503
        ws.send_json({"type": "step", "data": {"code": "print(2)"}})
        assert ws.receive_json()["data"]["observation"]["result"]["stdout"] == "2\n"


def test_unclaimed_session_is_reaped_after_the_claim_ttl() -> None:
    """An unclaimed session goes after claim_ttl; a claimed one lives on to the idle TTL."""
    with serverkit.make_client(pool_size=0, idle_ttl=600, claim_ttl=2.0) as c:
        claimed = _reset(c)
        assert _step(c, claimed) == 200  # at once: a loaded machine's reset can outlast a TTL
        unclaimed = _reset(c)
        for _ in range(400):
            if c.get("/metrics").json()["sessions_reaped"] >= 1:
                break
            time.sleep(0.05)
        assert c.post("/step", json=STEP, headers={"X-Session-Id": unclaimed}).status_code == 410
        assert _step(c, claimed) == 200
        assert c.get("/metrics").json()["sessions_active"] == 1
