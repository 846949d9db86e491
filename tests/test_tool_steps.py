"""OpenEnv's tool-calling step actions (``list_tools``, ``call_tool``) on ``/ws`` and
``POST /step``, against a real ``kernel-env serve``: jupyter_env's five tools, state kept
between calls, a reset's setup and verify commands and the reward ``final_answer`` ends the
episode with, bad input answered (never a 500), and code actions beside them unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverkit import ServeProcess, serve_process
from websockets.asyncio.client import ClientConnection, connect

from kernel_env.remote import ws_url

pytestmark = pytest.mark.integration  # a server and its kernels

FIVE = {
    "add_and_execute_code_cell",
    "edit_and_execute_current_cell",
    "execute_shell_command",
    "get_notebook_state",
    "final_answer",
}
EPISODE = {
    "setup": ["mkdir -p work && printf seed > work/input.txt"],
    "verify": ["grep -q seed work/input.txt", "test -f work/answer.txt", "false"],
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serve_process("--pool-size", "1") as process:
        yield process


async def _ask(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await ws.recv())
    return reply


async def _tool(ws: ClientConnection, name: str, **arguments: Any) -> dict[str, Any]:
    action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
    reply = await _ask(ws, {"type": "step", "data": action})
    assert reply["type"] == "observation", reply
    return reply["data"]


def _text(data: dict[str, Any]) -> str:
    result = data["observation"]["result"]
    assert data["observation"]["error"] is None, data
    return "\n".join(c["text"] for c in result["content"])


async def test_ws_lists_calls_keeps_state_and_scores_final_answer(server: ServeProcess) -> None:
    async with connect(ws_url(server.url)) as ws:
        listed = await _ask(ws, {"type": "step", "data": {"type": "list_tools"}})
        tools = listed["data"]["observation"]["tools"]
        assert {t["name"] for t in tools} == FIVE
        code = next(t for t in tools if t["name"] == "add_and_execute_code_cell")
        assert code["input_schema"]["required"] == ["code"] and code["description"]
        reset = await _ask(ws, {"type": "reset", "data": EPISODE})
        assert reset["type"] == "observation", reset
        first = await _tool(ws, "add_and_execute_code_cell", code="x = 21 * 2\nx")
        assert _text(first) == "42"
        assert first["observation"]["tool_name"] == "add_and_execute_code_cell"
        assert first["observation"]["result"]["is_error"] is False
        assert (first["done"], first["reward"]) == (False, None)
        again = await _tool(ws, "add_and_execute_code_cell", code="x + 1")
        assert _text(again) == "43"
        shell = await _tool(ws, "execute_shell_command", command="cat work/input.txt")
        assert _text(shell) == "seed"
        summary = _text(await _tool(ws, "get_notebook_state"))
        assert "[Cell 1] x = 21 * 2" in summary and "→ 42" in summary
        code_step = await _ask(
            ws, {"type": "step", "data": {"code": "open('work/answer.txt', 'w')"}}
        )
        assert code_step["data"]["observation"]["result"]["success"] is True
        final = await _tool(ws, "final_answer", answer="42")
        assert (
            _text(final)
            == "Answer submitted: 42\nVerification: 2/3 passed; reward=0.6666666666666666"
        )
        assert final["done"] is True and final["reward"] == pytest.approx(2 / 3)
        over = await _tool(ws, "add_and_execute_code_cell", code="1")
        assert over["observation"]["error"]["error_type"] == "execution_error"
        assert "episode is over" in over["observation"]["error"]["message"]
        state = await _ask(ws, {"type": "state"})
        assert state["data"]["final_answer"] == "42" and state["data"]["done"] is True


async def test_ws_bad_tool_input_is_an_error_observation_or_frame(server: ServeProcess) -> None:
    async with connect(ws_url(server.url)) as ws:
        assert (await _ask(ws, {"type": "reset"}))["type"] == "observation"
        unknown = await _tool(ws, "no_such_tool")
        assert unknown["observation"]["error"]["error_type"] == "tool_not_found"
        assert unknown["observation"]["result"] is None
        wrong = await _tool(ws, "add_and_execute_code_cell", code=5)
        assert wrong["observation"]["error"]["error_type"] == "invalid_args"
        assert "'code' must be a string" in wrong["observation"]["error"]["message"]
        missing = await _tool(ws, "execute_shell_command")
        assert missing["observation"]["error"]["error_type"] == "invalid_args"
        bad = {"type": "call_tool", "tool_name": "final_answer", "arguments": "42"}
        frame = await _ask(ws, {"type": "step", "data": bad})
        assert frame["type"] == "error" and frame["data"]["code"] == "VALIDATION_ERROR"
        commands = await _ask(ws, {"type": "reset", "data": {"verify": 3}})
        assert commands["type"] == "error" and commands["data"]["code"] == "VALIDATION_ERROR"
        failing = await _ask(ws, {"type": "reset", "data": {"setup": ["exit 3"]}})
        assert failing["type"] == "error" and "setup command failed" in failing["data"]["message"]
        assert (await _ask(ws, {"type": "reset"}))["type"] == "observation"
        assert _text(await _tool(ws, "add_and_execute_code_cell", code="6 * 7")) == "42"


def test_http_step_takes_the_tool_actions(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reset = http.post("/reset", json={"verify": ["true", "test -f marker"]})
        assert reset.status_code == 200, reset.text
        sid = {"X-Session-Id": reset.headers["X-Session-Id"]}

        def step(action: dict[str, Any]) -> httpx.Response:
            return http.post("/step", json={"action": action}, headers=sid)

        listed = step({"type": "list_tools"}).json()
        assert {t["name"] for t in listed["observation"]["tools"]} == FIVE
        assert set(listed) == {"observation", "reward", "done"}

        def tool(name: str, **arguments: Any) -> dict[str, Any]:
            answer = step({"type": "call_tool", "tool_name": name, "arguments": arguments})
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = answer.json()
            return body

        assert _text(tool("add_and_execute_code_cell", code="x = 21 * 2\nx")) == "42"
        assert _text(tool("edit_and_execute_current_cell", code="x = 20 * 2\nx")) == "40"
        assert step({"code": "x + 2"}).json()["observation"]["result"]["stdout"].strip() == "42"
        assert _text(tool("execute_shell_command", command="touch marker")) == "(no output)"
        unknown = tool("nope")
        assert unknown["observation"]["error"]["error_type"] == "tool_not_found"
        bad = step({"type": "call_tool", "tool_name": 3})
        assert bad.status_code == 422
        final = tool("final_answer", answer="40")
        assert _text(final).endswith("Verification: 2/2 passed; reward=1.0")
        assert final["done"] is True and final["reward"] == 1.0
