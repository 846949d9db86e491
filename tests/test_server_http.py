"""The server's HTTP routes, in-process (Starlette's TestClient), with real kernels."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import serverkit
from fastapi.testclient import TestClient

TOKEN = "s3cret-token-for-tests"


def make_client(**settings: Any) -> TestClient:
    return serverkit.make_client(**{"max_sessions": 64, **settings})


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with make_client() as c:
        yield c


@pytest.fixture
def session(client: TestClient) -> Iterator[str]:
    response = client.post("/reset", json={"context": "Hello World", "task_prompt": "count"})
    assert response.status_code == 200
    sid = response.headers["X-Session-Id"]
    yield sid
    client.delete(f"/sessions/{sid}")


def h(sid: str) -> dict[str, str]:
    return {"X-Session-Id": sid}


# -- info routes ----------------------------------------------------------------------------


def test_health_is_healthy(client: TestClient) -> None:
    """GET /health answers {"status": "healthy"}, and says where kernels run and how."""
    health = client.get("/health").json()
    assert health["status"] == "healthy" and set(health) == {"status", "kernels"}


def test_metadata_has_name_and_description(client: TestClient) -> None:
    """GET /metadata carries OpenEnv's metadata fields."""
    data = client.get("/metadata").json()
    assert set(data) == {
        "name",
        "description",
        "readme_content",
        "version",
        "author",
        "documentation_url",
        "kernels",  # where kernels run, and which limits hold
        "kernel_names",  # the kernels a reset may name (--kernels): python3 by default
    }
    assert data["name"] == "kernel_env"
    assert list(data["kernel_names"]["available"]) == ["python3"]


def test_schema_has_action_observation_state(client: TestClient) -> None:
    """GET /schema returns the three JSON schemas."""
    data = client.get("/schema").json()
    assert "code" in data["action"]["properties"]
    assert "result" in data["observation"]["properties"]
    assert "namespace_keys" in data["state"]["properties"]


def test_openapi_declares_version_1x_and_documents_sessions(client: TestClient) -> None:
    """/openapi.json has info.version 1.x and /step documents the X-Session-Id header."""
    spec = client.get("/openapi.json").json()
    assert spec["info"]["version"].startswith("1.")
    step = spec["paths"]["/step"]["post"]
    assert "X-Session-Id" in step["description"]
    assert any(p["name"] == "X-Session-Id" for p in step["parameters"])
    assert {"/reset", "/step", "/state", "/metrics"} <= set(spec["paths"])


@pytest.mark.parametrize(
    ("body", "code", "status"),
    [
        ({}, -32600, 200),
        ({"jsonrpc": "2.0", "method": "tools/list", "id": 1}, -32600, 400),
        (
            {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "x"}, "id": "a"},
            -32600,
            400,
        ),
        ([{"jsonrpc": "2.0", "method": "ping", "id": 2}], -32600, 400),
    ],
)
def test_mcp_answers_json_rpc_errors(client: TestClient, body: Any, code: int, status: int) -> None:
    """POST /mcp answers JSON-RPC 2.0 errors: a call before initialize (no Mcp-Session-Id) is
    400, a batch too; the empty probe `openenv validate` sends is HTTP 200."""
    response = client.post("/mcp", json=body)
    assert response.status_code == status
    data = response.json()
    assert data["jsonrpc"] == "2.0" and data["error"]["code"] == code


def test_mcp_parse_error_is_json_rpc(client: TestClient) -> None:
    """POST /mcp with invalid JSON answers a JSON-RPC parse error (HTTP 400)."""
    response = client.post("/mcp", content=b"{nope")
    assert response.status_code == 400 and response.json()["error"]["code"] == -32700


# -- sessions -------------------------------------------------------------------------------


@pytest.mark.integration
def test_reset_returns_session_id_in_header_and_metadata(client: TestClient) -> None:
    """POST /reset opens a session named in X-Session-Id and observation.metadata."""
    response = client.post("/reset", json={"context": "abc"})
    sid = response.headers["X-Session-Id"]
    body = response.json()
    try:
        assert set(body) == {"observation", "reward", "done"}
        assert body["observation"]["metadata"]["session_id"] == sid
        assert body["reward"] is None and body["done"] is False
        assert body["observation"]["context_length"] == 3
    finally:
        client.delete(f"/sessions/{sid}")


@pytest.mark.integration
def test_step_and_state_round_trip(client: TestClient, session: str) -> None:
    """/step runs code in the session's kernel and /state reports it."""
    step = client.post(
        "/step", json={"action": {"code": "n = len(context); print(n)"}}, headers=h(session)
    )
    assert step.status_code == 200
    obs = step.json()["observation"]
    assert obs["result"]["stdout"] == "11\n" and obs["iteration"] == 1
    assert step.headers["X-Session-Id"] == session
    state = client.get("/state", headers=h(session)).json()
    assert state["step_count"] == 1 and "n" in state["namespace_keys"]
    assert state["context"] == "Hello World"


@pytest.mark.integration
def test_final_answer_ends_the_episode(client: TestClient, session: str) -> None:
    """A FINAL(...) step is done with the answer in metadata; a later step is 409."""
    client.post("/step", json={"action": {"code": "n = len(context)"}}, headers=h(session))
    done = client.post("/step", json={"action": {"code": "FINAL(n)"}}, headers=h(session)).json()
    assert done["done"] is True
    assert done["observation"]["metadata"]["final_answer"] == "11"
    after = client.post("/step", json={"action": {"code": "1"}}, headers=h(session))
    assert after.status_code == 409


@pytest.mark.integration
def test_reset_with_session_id_starts_a_new_episode_in_the_same_session(
    client: TestClient, session: str
) -> None:
    """POST /reset with X-Session-Id keeps the session and starts a fresh episode."""
    client.post("/step", json={"action": {"code": "x = 1"}}, headers=h(session))
    again = client.post("/reset", json={"context": "zz"}, headers=h(session))
    assert again.headers["X-Session-Id"] == session
    state = client.get("/state", headers=h(session)).json()
    assert state["step_count"] == 0 and state["context"] == "zz"
    missing = client.post("/step", json={"action": {"code": "print(x)"}}, headers=h(session))
    assert missing.json()["observation"]["result"]["success"] is False  # a fresh kernel


def test_step_without_session_header_is_400(client: TestClient) -> None:
    """/step without X-Session-Id is a clear 400, not a 500."""
    response = client.post("/step", json={"action": {"code": "1"}})
    assert response.status_code == 400
    assert "X-Session-Id" in response.json()["detail"]
    assert client.get("/state").status_code == 400


def test_unknown_session_is_404(client: TestClient) -> None:
    """A session id the server never issued is 404 and reveals nothing."""
    response = client.post("/step", json={"action": {"code": "1"}}, headers=h("not-a-session"))
    assert response.status_code == 404
    assert client.get("/state", headers=h("nope")).status_code == 404


@pytest.mark.integration
def test_invalid_action_is_422(client: TestClient, session: str) -> None:
    """An invalid action (unknown field, wrong type) is 422 with a detail list."""
    for action in ({"code": 1}, {"code": "1", "bogus": True}, "x"):
        response = client.post("/step", json={"action": action}, headers=h(session))
        assert response.status_code == 422
        assert isinstance(response.json()["detail"], list)


def test_unknown_reset_keyword_is_422(client: TestClient) -> None:
    """/reset rejects keywords it does not know, and opens no session."""
    before = client.get("/metrics").json()["sessions_active"]
    response = client.post("/reset", json={"context": "a", "contxt": "typo"})
    assert response.status_code == 422
    assert client.get("/metrics").json()["sessions_active"] == before


@pytest.mark.integration
def test_closed_session_answers_410(client: TestClient) -> None:
    """After DELETE /sessions/{id}, the session answers 410 Gone; DELETE is idempotent."""
    sid = client.post("/reset", json={}).headers["X-Session-Id"]
    assert client.delete(f"/sessions/{sid}").status_code == 204
    response = client.post("/step", json={"action": {"code": "1"}}, headers=h(sid))
    assert response.status_code == 410
    assert client.delete(f"/sessions/{sid}").status_code == 204
    assert client.delete("/sessions/never-existed").status_code == 404


@pytest.mark.integration
def test_metrics_count_sessions_and_steps(client: TestClient, session: str) -> None:
    """GET /metrics reports sessions, kernels, pool and step counters."""
    client.post("/step", json={"action": {"code": "print('x' * 20000)"}}, headers=h(session))
    data = client.get("/metrics").json()
    assert data["sessions_active"] >= 1 and data["sessions_http"] >= 1
    assert data["kernels_in_sessions"] >= 1 and data["steps"] >= 1
    assert data["truncations"] >= 1
    assert data["lost_outputs"] == 0
    for key in (
        "pool_warm",
        "pool_starting",
        "timeouts",
        "restarts",
        "late_outputs",
        "sessions_reaped",
        "rss_bytes",
    ):
        assert key in data


@pytest.mark.integration
def test_late_output_is_counted_not_shown_in_the_next_step(
    client: TestClient, session: str
) -> None:
    """Output a thread prints after its cell ended is counted as late, never lost or misrouted."""
    before = client.get("/metrics").json()["late_outputs"]
    code = (
        "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), "
        "print('late'))).start()"
    )
    client.post("/step", json={"action": {"code": code}}, headers=h(session))
    time.sleep(0.6)
    step = client.post("/step", json={"action": {"code": "print('next')"}}, headers=h(session))
    assert step.json()["observation"]["result"]["stdout"] == "next\n"
    data = client.get("/metrics").json()
    assert data["late_outputs"] > before and data["lost_outputs"] == 0


# -- capacity, reaping, auth, limits --------------------------------------------------------


@pytest.mark.integration
def test_capacity_reached_is_503_with_counts() -> None:
    """A new session beyond max_sessions (all claimed) is refused with CAPACITY_REACHED and
    the counts."""
    with make_client(pool_size=0, max_sessions=1) as c:
        first = c.post("/reset", json={})
        assert first.status_code == 200
        c.get("/state", headers=h(first.headers["X-Session-Id"]))  # claims it
        refused = c.post("/reset", json={})
        assert refused.status_code == 503
        detail = refused.json()["detail"]
        assert detail["code"] == "CAPACITY_REACHED"
        assert (detail["active_sessions"], detail["max_sessions"]) == (1, 1)
        c.delete(f"/sessions/{first.headers['X-Session-Id']}")
        assert c.post("/reset", json={}).status_code == 200


@pytest.mark.integration
def test_idle_http_session_is_reaped_and_answers_expired() -> None:
    """F13 over HTTP: an idle session is reaped; a later step gets 410 "session expired"."""
    with make_client(pool_size=0, idle_ttl=0.5) as c:
        sid = c.post("/reset", json={}).headers["X-Session-Id"]
        for _ in range(100):
            if c.get("/metrics").json()["sessions_reaped"] == 1:
                break
            time.sleep(0.05)
        response = c.post("/step", json={"action": {"code": "1"}}, headers=h(sid))
        assert response.status_code == 410
        assert "session expired" in response.json()["detail"]
        assert c.get("/metrics").json()["kernels_in_sessions"] == 0


@pytest.mark.integration
def test_auth_token_is_required_and_never_echoed() -> None:
    """B5 over HTTP: no or wrong token is 401 on episode routes; the token is never echoed."""
    with make_client(pool_size=0, token=TOKEN) as c:
        assert c.get("/health").status_code == 200  # providers poll it without credentials
        assert c.post("/mcp", json={}).status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            for method, path in (
                ("POST", "/reset"),
                ("POST", "/step"),
                ("GET", "/state"),
                ("GET", "/metrics"),
            ):
                response = c.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
                assert TOKEN not in response.text
        ok = c.post("/reset", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and TOKEN not in ok.text
        other = c.post(
            "/step",
            json={"action": {"code": "1"}},
            headers={"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "guess"},
        )
        assert other.status_code == 404


def test_oversize_body_is_413() -> None:
    """B4: a body over max_message_bytes is 413, declared or streamed."""
    with make_client(pool_size=0, max_message_bytes=4096) as c:
        big = json.dumps({"context": "x" * 10_000})
        assert c.post("/reset", content=big).status_code == 413

        def chunks() -> Iterator[bytes]:
            for _ in range(10):
                yield b"x" * 1000

        assert c.post("/step", content=chunks()).status_code == 413


@pytest.mark.integration
def test_oversize_code_and_context_are_clear_4xx(client: TestClient, session: str) -> None:
    """B4: code over max_code_chars and context over max_context_chars are 4xx, not 500."""
    with make_client(pool_size=0, max_context_chars=1000, max_code_chars=100) as c:
        response = c.post("/reset", json={"context": "x" * 2000})
        assert response.status_code == 422 and "exceeds" in response.text
        sid = c.post("/reset", json={}).headers["X-Session-Id"]
        response = c.post("/step", json={"action": {"code": "#" * 200}}, headers=h(sid))
        assert response.status_code == 422 and "exceeds" in response.text
    one_mib = client.post(
        "/step", json={"action": {"code": "#" * (1 << 20) + "#"}}, headers=h(session)
    )
    assert one_mib.status_code == 422


# -- B2: fuzzed bodies ---------------------------------------------------------------------


def _fuzz_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 2**63, -(2**70), rng.randint(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e308, 3.14])
    if kind == "str":
        return "".join(
            rng.choice("ab\u00e9\u4e2d\U0001f600\x00\"'{}[]") for _ in range(rng.randint(0, 12))
        )
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = [
        "action",
        "code",
        "is_final",
        "final_answer",
        "metadata",
        "context",
        "seed",
        "episode_id",
        "max_iterations",
        "timeout_s",
        "request_id",
        "x",
        "",
    ]
    return {rng.choice(keys): _fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _fuzz_body(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))  # invalid UTF-8
    if roll < 0.15:
        return b"[" * 100_000  # nesting far past the JSON parser's recursion limit
    if roll < 0.2:
        return json.dumps(_fuzz_value(rng)).encode()[: rng.randint(0, 20)]  # truncated
    if roll < 0.6:
        return json.dumps({"action": _fuzz_value(rng)}).encode()
    return json.dumps(_fuzz_value(rng)).encode()


@pytest.mark.integration
def test_fuzzed_bodies_never_get_5xx(client: TestClient, session: str) -> None:
    """B2: 900 fuzzed bodies on /reset, /step and /state never get a 5xx."""
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    for i in range(300):
        body = _fuzz_body(rng)
        headers = {"content-type": rng.choice(["application/json", "text/plain", ""])}
        # /reset names an unknown session, so a body that happens to be valid opens no kernel.
        calls = [
            ("POST", "/reset", {**headers, "X-Session-Id": "unknown"}),
            ("POST", "/step", {**headers, "X-Session-Id": session}),
            ("GET", "/state", {**headers, "X-Session-Id": session if i % 2 else "x"}),
        ]
        for method, path, hdrs in calls:
            response = client.request(method, path, content=body, headers=hdrs)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (path, body[:200], response.text[:300])
    assert client.get("/health").status_code == 200
    assert statuses.get(422, 0) > 100  # most fuzz is invalid, and said so


def test_module_level_app_for_asgi_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`uvicorn kernel_env.server.app:app` (and openenv.yaml) get an app configured from the
    KERNEL_ENV_* variables."""
    import kernel_env.server.app as module

    monkeypatch.setattr(module, "_APP", [])
    monkeypatch.setenv("KERNEL_ENV_POOL_SIZE", "0")
    monkeypatch.setenv("KERNEL_ENV_MAX_SESSIONS", "3")
    with serverkit.LoopbackClient(module.app) as c:
        assert c.get("/health").json()["status"] == "healthy"
        assert c.get("/metrics").json()["max_sessions"] == 3
