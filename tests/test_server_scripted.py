"""Every door of the server, in-process, on scripted kernels: OpenEnv's HTTP routes and its
`/ws`, and E2B's control plane and code interpreter. The app is the one `kernel-env serve`
runs (`create_app`), its kernels :class:`~kernel_env.kernel.scripted.ScriptedKernel`\\ s, so
these run in the quick tier (`make check`) with no process started; the same doors on real
kernels and a real server are tested in test_server_http.py, test_server_ws.py and
test_e2b.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serverkit import LoopbackClient, small_settings

from kernel_env.kernel.scripted import Cell, ScriptedSource
from kernel_env.server import create_app
from kernel_env.server.e2b import available

TOKEN = "scripted-doors-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CELLS = {
    "n = len(context)": Cell(variables={"n": "11"}),
    "n": Cell(result="11"),
    "print('hello')": Cell(stdout="hello\n"),
    "1 / 0": Cell(error=("ZeroDivisionError", "division by zero")),
    "FINAL(n)": Cell(final="11"),
}


@pytest.fixture
def source() -> ScriptedSource:
    return ScriptedSource(CELLS)


@pytest.fixture
def client(source: ScriptedSource) -> Iterator[TestClient]:
    app = create_app(small_settings(token=TOKEN), kernel_factory=source)
    with LoopbackClient(app) as running:  # the lifespan: the runtime and its warm pool
        yield running


def _steps(source: ScriptedSource) -> list[str]:
    """The code strings the scripted kernels ran as cells (not the host's silent ones)."""
    return [code for kernel in source.kernels for code in kernel.executed if code in CELLS]


# -- OpenEnv's door: HTTP -----------------------------------------------------------------------


def test_http_reset_step_state_run_an_episode_to_its_reward(
    client: TestClient, source: ScriptedSource
) -> None:
    reset = client.post(
        "/reset", json={"context": "Hello World", "expected_answer": "11"}, headers=AUTH
    )
    assert reset.status_code == 200, reset.text
    session = {**AUTH, "X-Session-Id": reset.headers["X-Session-Id"]}
    assert reset.json()["done"] is False

    def step(code: str) -> dict[str, Any]:
        done = client.post("/step", json={"action": {"code": code}}, headers=session)
        assert done.status_code == 200, done.text
        answer: dict[str, Any] = done.json()
        return answer

    assert step("n = len(context)")["reward"] == 0.0
    shown = step("n")["observation"]["result"]
    assert (shown["stdout"], shown["success"]) == ("11\n", True)  # a shown value is a line
    failed = step("1 / 0")
    assert failed["observation"]["result"]["exception"].startswith("ZeroDivisionError")
    assert failed["reward"] < 0  # a failed step's penalty
    final = step("FINAL(n)")
    assert (final["done"], final["reward"]) == (True, 1.0)

    state = client.get("/state", headers=session).json()
    assert state["step_count"] == 4 and state["final_answer"] == "11"
    assert _steps(source) == ["n = len(context)", "n", "1 / 0", "FINAL(n)"]


def test_http_refuses_a_step_without_its_session_or_the_token(client: TestClient) -> None:
    assert client.post("/reset", json={}).status_code == 401
    missing = client.post("/step", json={"action": {"code": "n"}}, headers=AUTH)
    assert missing.status_code == 400 and "X-Session-Id" in missing.text
    assert client.get("/health").json()["status"] == "healthy"


# -- OpenEnv's door: /ws ------------------------------------------------------------------------


def test_websocket_session_runs_an_episode(client: TestClient, source: ScriptedSource) -> None:
    with client.websocket_connect("/ws", headers=AUTH) as ws:
        ws.send_json({"type": "reset", "data": {"context": "Hello", "expected_answer": "5"}})
        reset = ws.receive_json()
        assert reset["type"] == "observation" and reset["data"]["done"] is False, reset

        ws.send_json({"type": "step", "data": {"code": "print('hello')"}})
        printed = ws.receive_json()["data"]
        assert printed["observation"]["result"]["stdout"] == "hello\n", printed

        ws.send_json({"type": "step", "data": {"code": "FINAL(n)"}})
        final = ws.receive_json()["data"]
        assert (final["done"], final["reward"]) == (True, 0.0)  # 11, not the 5 expected

        ws.send_json({"type": "state"})
        state = ws.receive_json()
        assert state["type"] == "state" and state["data"]["step_count"] == 2, state

        ws.send_json({"type": "step", "data": {"code": "n"}})
        over = ws.receive_json()
        assert over["data"]["exception"] == "EpisodeFinished", over  # a step after the end
    assert _steps(source) == ["print('hello')", "FINAL(n)"]


# -- E2B's door ---------------------------------------------------------------------------------


def test_the_quick_tier_has_e2bs_door() -> None:
    """The test extra brings the e2b extra's server side, so its door is served here."""
    assert available(), "pip install -e '.[test]': the e2b extra is missing"


def _create(client: TestClient, **body: Any) -> dict[str, Any]:
    made = client.post("/sandboxes", json=body, headers={"X-API-Key": TOKEN})
    assert made.status_code == 201, made.text
    created: dict[str, Any] = made.json()
    return created


def _sandbox(created: dict[str, Any], port: str = "49999") -> dict[str, str]:
    """The headers E2B's SDK sends to a sandbox's port, through E2B_SANDBOX_URL."""
    return {
        "E2b-Sandbox-Id": created["sandboxID"],
        "E2b-Sandbox-Port": port,
        "X-Access-Token": created["envdAccessToken"],
    }


def _execute(client: TestClient, headers: dict[str, str], code: str) -> list[dict[str, Any]]:
    ran = client.post("/execute", json={"code": code}, headers=headers)
    assert ran.status_code == 200, ran.text
    assert ran.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in ran.text.splitlines()]


def test_e2b_sandbox_runs_code_streams_lines_and_is_killed(
    client: TestClient, source: ScriptedSource
) -> None:
    created = _create(client, templateID="code-interpreter-v1", metadata={"run": "quick"})
    headers = _sandbox(created)
    assert client.get("/health", headers=_sandbox(created, "49983")).status_code == 204  # envd

    printed = _execute(client, headers, "print('hello')")
    assert [line["type"] for line in printed] == [
        "stdout",
        "number_of_executions",
        "end_of_execution",
    ]
    assert printed[0]["text"] == "hello\n" and isinstance(printed[0]["timestamp"], int)
    assert _execute(client, headers, "n = len(context)")[0]["type"] == "number_of_executions"
    shown = _execute(client, headers, "n")
    assert shown[0] == {"type": "result", "is_main_result": True, "text": "11"}
    error = _execute(client, headers, "1 / 0")[0]
    assert (error["type"], error["name"], error["value"]) == (
        "error",
        "ZeroDivisionError",
        "division by zero",
    )
    assert _steps(source) == ["print('hello')", "n = len(context)", "n", "1 / 0"]

    listed = client.get("/sandboxes", headers={"X-API-Key": TOKEN}).json()
    assert [(s["sandboxID"], s["metadata"]) for s in listed] == [
        (created["sandboxID"], {"run": "quick"})
    ]
    killed = client.delete(f"/sandboxes/{created['sandboxID']}", headers={"X-API-Key": TOKEN})
    assert killed.status_code == 204
    gone = client.post("/execute", json={"code": "n"}, headers=headers)
    assert gone.status_code == 502  # E2B's proxy: the sandbox is not running


def test_e2b_refuses_a_wrong_key_and_another_sandboxs_token(client: TestClient) -> None:
    refused = client.post("/sandboxes", json={}, headers={"X-API-Key": "not-the-token"})
    assert refused.status_code == 401
    first, second = _create(client), _create(client)
    borrowed = {**_sandbox(first), "X-Access-Token": second["envdAccessToken"]}
    stranger = {**borrowed, "E2b-Sandbox-Id": "0" * 32}
    answer = client.post("/execute", json={"code": "n"}, headers=borrowed)
    unknown_id = client.post("/execute", json={"code": "n"}, headers=stranger)
    # another sandbox's token gets exactly the answer of an id that never existed
    assert answer.status_code == unknown_id.status_code == 502
    assert answer.content == unknown_id.content
    unknown = client.post("/sandboxes", json={"templateID": "my-dockerfile"}, headers=AUTH)
    assert unknown.status_code == 400 and "not served here" in unknown.json()["message"]
