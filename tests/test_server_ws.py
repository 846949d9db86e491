"""The ``/ws`` protocol: every frame type and error code, capacity, reaping, auth, bad frames.

In-process (Starlette's TestClient) for the protocol; a real uvicorn server on a free loopback
port where the transport matters (frame size limits, invalid UTF-8, concurrent sessions).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import serverkit
from fastapi.testclient import TestClient
from procs import alive
from serverkit import LoopbackClient, small_settings, thread_server, wait_until
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from kernel_env.kernel import Kernel, LocalKernel
from kernel_env.server import ServerSettings, create_app

TOKEN = "ws-test-token"


def make_client(**settings: Any) -> TestClient:
    return serverkit.make_client(**{"max_sessions": 16, **settings})


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with make_client() as c:
        yield c


def ask(ws: Any, frame: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(frame, str):
        ws.send_text(frame)
    else:
        ws.send_json(frame)
    reply: dict[str, Any] = ws.receive_json()
    return reply


def error_code(reply: dict[str, Any]) -> str:
    assert reply["type"] == "error", reply
    return str(reply["data"]["code"])


# -- every frame type -----------------------------------------------------------------------


@pytest.mark.integration
def test_reset_step_state_frames(client: TestClient) -> None:
    """reset and step answer observation frames (metadata in both places); state a state frame."""
    with client.websocket_connect("/ws") as ws:
        reset = ask(ws, {"type": "reset", "data": {"context": "Hello World", "task_prompt": "t"}})
        assert reset["type"] == "observation"
        data = reset["data"]
        assert data["reward"] is None and data["done"] is False
        assert data["observation"]["metadata"] == data["metadata"]
        assert data["metadata"]["task_prompt"] == "t" and "session_id" in data["metadata"]
        assert "reward" not in data["observation"] and "done" not in data["observation"]

        step = ask(ws, {"type": "step", "data": {"code": "n = len(context); print(n)"}})
        assert step["type"] == "observation"
        assert step["data"]["observation"]["result"]["stdout"] == "11\n"
        assert step["data"]["reward"] == 0.0 and step["data"]["done"] is False
        assert step["data"]["metadata"]["execution_time"] >= 0

        state = ask(ws, {"type": "state"})
        assert state["type"] == "state"
        assert state["data"]["step_count"] == 1 and "n" in state["data"]["namespace_keys"]

        final = ask(
            ws, {"type": "step", "data": {"code": "", "is_final": True, "final_answer": "11"}}
        )
        assert final["data"]["done"] is True
        assert final["data"]["metadata"]["final_answer"] == "11"
        assert final["data"]["observation"]["metadata"]["total_iterations"] == 2


@pytest.mark.integration
def test_reset_frame_without_data_is_accepted(client: TestClient) -> None:
    """{"type": "reset"} (no data) starts an episode with defaults."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(ws, {"type": "reset"})
        assert reply["type"] == "observation"
        assert reply["data"]["observation"]["max_iterations"] == 30


def test_mcp_frame_answers_json_rpc(client: TestClient) -> None:
    """{"type": "mcp"} answers an mcp frame carrying a JSON-RPC error (no tools)."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(
            ws, {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 7}}
        )
        assert reply["type"] == "mcp"
        assert reply["data"]["jsonrpc"] == "2.0" and reply["data"]["id"] == 7
        assert reply["data"]["error"]["code"] == -32603


def test_close_frame_closes_with_1000_and_frees_the_session(client: TestClient) -> None:
    """{"type": "close"} gets no reply; the socket closes with 1000 and the kernel goes."""
    with client.websocket_connect("/ws") as ws:
        ask(ws, {"type": "reset"})
        ws.send_json({"type": "close"})
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1000
    metrics = client.get("/metrics").json()
    assert metrics["sessions_ws"] == 0 and metrics["kernels_in_sessions"] == 0


@pytest.mark.integration
def test_replies_come_one_per_request_in_order(client: TestClient) -> None:
    """Pipelined requests are answered in order, one frame each."""
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset"})
        for i in range(5):
            ws.send_json({"type": "step", "data": {"code": f"print({i})"}})
        ws.send_json({"type": "state"})
        assert ws.receive_json()["type"] == "observation"
        outs = [ws.receive_json()["data"]["observation"]["result"]["stdout"] for _ in range(5)]
        assert outs == [f"{i}\n" for i in range(5)]
        assert ws.receive_json()["data"]["step_count"] == 5


# -- every error code ---------------------------------------------------------------------


def test_invalid_json_then_the_socket_stays_open(client: TestClient) -> None:
    """INVALID_JSON for non-JSON text, binary frames and deep nesting; the socket stays open."""
    with client.websocket_connect("/ws") as ws:
        assert error_code(ask(ws, "{not json")) == "INVALID_JSON"
        assert error_code(ask(ws, "[" * 100_000)) == "INVALID_JSON"
        ws.send_bytes(b'{"type": "state"}')
        assert error_code(ws.receive_json()) == "INVALID_JSON"
        assert ask(ws, {"type": "state"})["type"] == "state"


@pytest.mark.parametrize("frame", [{"type": "nope"}, {"data": {}}, {"type": 3}, {"type": None}])
def test_unknown_type(client: TestClient, frame: dict[str, Any]) -> None:
    """UNKNOWN_TYPE for a missing or unknown "type"."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(ws, frame)
        assert error_code(reply) == "UNKNOWN_TYPE"
        assert reply["data"]["message"].startswith("Unknown message type")


@pytest.mark.parametrize(
    "frame",
    [
        [1, 2],
        "a string",
        {"type": "state", "extra": 1},
        {"type": "state", "data": {}},
        {"type": "step"},
        {"type": "step", "data": "print(1)"},
        {"type": "step", "data": {"code": 1}},
        {"type": "step", "data": {"code": "1", "unknown": True}},
        {"type": "reset", "data": {"contxt": "typo"}},
        {"type": "reset", "data": {"seed": -1}},
        {"type": "reset", "data": {"self": 1}},
        {"type": "mcp"},
    ],
)
def test_validation_error(client: TestClient, frame: Any) -> None:
    """VALIDATION_ERROR ("Invalid message" + errors) for frames of the wrong shape."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(ws, json.dumps(frame))
        assert error_code(reply) == "VALIDATION_ERROR"
        assert reply["data"]["message"] == "Invalid message"
        assert isinstance(reply["data"]["errors"], list) and reply["data"]["errors"]


def test_validation_error_never_echoes_the_hf_token(client: TestClient) -> None:
    """A rejected reset does not send the hf_token back in its errors."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(ws, {"type": "reset", "data": {"hf_token": "hf_SECRET", "seed": "x"}})
        assert error_code(reply) == "VALIDATION_ERROR"
        assert "hf_SECRET" not in json.dumps(reply)


def test_execution_error_before_reset_and_after_done(client: TestClient) -> None:
    """EXECUTION_ERROR with OpenEnv's text for a step before reset, and after the episode."""
    with client.websocket_connect("/ws") as ws:
        reply = ask(ws, {"type": "step", "data": {"code": "1"}})
        assert error_code(reply) == "EXECUTION_ERROR"
        assert reply["data"]["message"] == "Environment not initialized. Call reset() first."
        ask(ws, {"type": "reset"})
        ask(ws, {"type": "step", "data": {"is_final": True, "final_answer": "x"}})
        reply = ask(ws, {"type": "step", "data": {"code": "1"}})
        assert error_code(reply) == "EXECUTION_ERROR" and "reset" in reply["data"]["message"]


@pytest.mark.integration
def test_limits_are_validation_errors(client: TestClient) -> None:
    """B4: code over the limit and a context over the limit answer VALIDATION_ERROR."""
    with (
        make_client(pool_size=0, max_code_chars=100, max_context_chars=1000) as c,
        c.websocket_connect("/ws") as ws,
    ):
        reply = ask(ws, {"type": "reset", "data": {"context": "x" * 1001}})
        assert error_code(reply) == "VALIDATION_ERROR" and "exceeds" in reply["data"]["message"]
        ask(ws, {"type": "reset"})
        reply = ask(ws, {"type": "step", "data": {"code": "#" * 101}})
        assert error_code(reply) == "VALIDATION_ERROR" and "exceeds" in reply["data"]["message"]


def test_capacity_reached_at_connect_then_close() -> None:
    """CAPACITY_REACHED (with the counts) is sent at connect when full, then the socket closes."""
    with make_client(pool_size=0, max_sessions=1) as c, c.websocket_connect("/ws") as first:
        with c.websocket_connect("/ws") as second:
            reply = second.receive_json()
            assert error_code(reply) == "CAPACITY_REACHED"
            assert reply["data"]["active_sessions"] == 1 and reply["data"]["max_sessions"] == 1
            with pytest.raises(WebSocketDisconnect) as closed:
                second.receive_json()
            assert closed.value.code == 1013
        assert ask(first, {"type": "state"})["type"] == "state"


def test_factory_error_when_no_kernel_can_start() -> None:
    """FACTORY_ERROR when the kernel for a reset cannot be started; the socket stays open."""

    async def broken() -> Kernel:
        kernel = LocalKernel(python="/nonexistent/python")
        await kernel.start()
        return kernel

    app = create_app(ServerSettings(pool_size=0), kernel_factory=broken)
    with LoopbackClient(app) as c, c.websocket_connect("/ws") as ws:
        reply = ask(ws, {"type": "reset"})
        assert error_code(reply) == "FACTORY_ERROR"
        assert ask(ws, {"type": "state"})["type"] == "state"


@pytest.mark.integration
def test_idle_session_is_reaped_and_answers_session_expired() -> None:
    """F13: an idle session is reaped, its kernel killed; later calls get "session expired"."""
    # Unsandboxed: the test watches the kernel's own pid (a sandboxed kernel sees its own pid
    # namespace); the sandbox's teardown has its own tests.
    with (
        make_client(pool_size=0, idle_ttl=0.5, sandbox="none") as c,
        c.websocket_connect("/ws") as ws,
    ):
        ask(ws, {"type": "reset"})
        pid = int(
            ask(ws, {"type": "step", "data": {"code": "import os; print(os.getpid())"}})["data"][
                "observation"
            ]["result"]["stdout"]
        )
        deadline = time.monotonic() + 10
        while c.get("/metrics").json()["sessions_reaped"] < 1:
            assert time.monotonic() < deadline, "the session was never reaped"
            time.sleep(0.05)
        reply = ask(ws, {"type": "step", "data": {"code": "1"}})
        assert error_code(reply) == "SESSION_ERROR"
        assert "session expired" in reply["data"]["message"]
        assert error_code(ask(ws, {"type": "state"})) == "SESSION_ERROR"
        # Reaped is counted as the close begins; the kernel's kill follows in its thread.
        assert wait_until(lambda: not alive(pid), 10)


@pytest.mark.integration
def test_busy_session_is_not_reaped() -> None:
    """A step running longer than the idle TTL does not get its session reaped."""
    with make_client(pool_size=0, idle_ttl=0.3) as c, c.websocket_connect("/ws") as ws:
        ask(ws, {"type": "reset"})
        reply = ask(ws, {"type": "step", "data": {"code": "import time; time.sleep(1); print(1)"}})
        assert reply["data"]["observation"]["result"]["stdout"] == "1\n"


def test_auth_rejects_missing_or_wrong_token_with_1008() -> None:
    """B5 over WS: no or wrong token closes the handshake with 1008; the right one works."""
    with make_client(pool_size=0, token=TOKEN) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            with (
                pytest.raises(WebSocketDisconnect) as refused,
                c.websocket_connect("/ws", headers=headers),
            ):
                pass
            assert refused.value.code == 1008
        with c.websocket_connect("/ws", headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            assert ask(ws, {"type": "state"})["type"] == "state"


def test_oversize_frame_closes_with_1009_in_process() -> None:
    """B4: a frame over max_message_bytes closes the socket with 1009."""
    with make_client(pool_size=0, max_message_bytes=10_000) as c, c.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"context": "x" * 20_000}}))
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1009


# -- a real server: transport limits, fuzz, concurrency -------------------------------------


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    with thread_server(
        small_settings(pool_size=2, max_sessions=8, max_message_bytes=64 * 1024)
    ) as url:
        yield url


async def test_real_server_closes_oversize_frames_with_1009(live_url: str) -> None:
    """B4 on uvicorn: an oversize frame is refused with close 1009; the server lives on."""
    async with connect(live_url.replace("http", "ws") + "/ws", max_size=None) as ws:
        await ws.send("x" * (65 * 1024))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    async with connect(live_url.replace("http", "ws") + "/ws") as ws:
        await ws.send(json.dumps({"type": "state"}))
        assert json.loads(await ws.recv())["type"] == "state"


async def test_real_server_closes_invalid_utf8_with_1007(live_url: str) -> None:
    """B1: a text frame with invalid UTF-8 is closed with 1007; the server lives on."""
    async with connect(live_url.replace("http", "ws") + "/ws") as ws:
        await ws.send(b"\xff\xfe{", text=True)
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007


@pytest.mark.integration
async def test_event_loop_stays_free_while_a_cell_runs(live_url: str) -> None:
    """While one session's cell sleeps, another session steps and /health answers."""
    url = live_url.replace("http", "ws") + "/ws"
    async with connect(url) as slow, connect(url) as fast:
        for ws in (slow, fast):
            await ws.send(json.dumps({"type": "reset"}))
            await ws.recv()
        await slow.send(
            json.dumps(
                {"type": "step", "data": {"code": "import time; time.sleep(3); print('slow')"}}
            )
        )
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await fast.send(json.dumps({"type": "step", "data": {"code": "print('fast')"}}))
        reply = json.loads(await fast.recv())
        assert reply["data"]["observation"]["result"]["stdout"] == "fast\n"
        await fast.ping()
        assert time.monotonic() - started < 2.5  # answered while the slow cell still ran
        slow_reply = json.loads(await slow.recv())
        assert slow_reply["data"]["observation"]["result"]["stdout"] == "slow\n"


@pytest.mark.integration
async def test_concurrent_sessions_never_mix_outputs(live_url: str) -> None:
    """8 sessions stepping at once each see exactly their own output, once."""
    url = live_url.replace("http", "ws") + "/ws"

    async def run(tag: int) -> list[str]:
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "reset"}))
            await ws.recv()
            outs = []
            for i in range(25):
                await ws.send(json.dumps({"type": "step", "data": {"code": f"print('{tag}-{i}')"}}))
                outs.append(json.loads(await ws.recv())["data"]["observation"]["result"]["stdout"])
            return outs

    results = await asyncio.gather(*(run(t) for t in range(8)))
    for tag, outs in enumerate(results):
        assert outs == [f"{tag}-{i}\n" for i in range(25)]


def _fuzz_frame(rng: random.Random) -> str | bytes:
    """A frame that is wrong somehow (never a close, never a valid reset)."""
    roll = rng.random()
    if roll < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 30)))  # binary
    if roll < 0.08:
        return "[" * rng.randint(1000, 50_000)
    if roll < 0.15:
        return "".join(rng.choice('{}[]":,ab1 \\') for _ in range(rng.randint(0, 30)))
    frame: Any = {
        "type": rng.choice(
            ["reset", "step", "state", "mcp", "bogus", "", None, 7, "STEP", ["step"]]
        )
    }
    if rng.random() < 0.7:
        frame["data"] = rng.choice(
            [
                None,
                1,
                "s",
                [],
                {"code": rng.choice([1, None, [], "x = 1"])},
                {"code": "pass", "is_final": "maybe"},
                {"metadata": {"a": [[[[{}]]]]}},
                {"context": 5},
                {"seed": -3},
                {"nested": json.loads("[" * 200 + "]" * 200)},
            ]
        )
    if rng.random() < 0.2:
        frame[rng.choice(["extra", "id", "request_id"])] = rng.random()
    if frame.get("type") == "reset":  # never a valid reset: no kernel start per fuzz frame
        frame["data"] = {"not_a_reset_option": True}
    if rng.random() < 0.05:
        frame = [frame]
    return json.dumps(frame)


@pytest.mark.integration
async def test_fuzzed_frames_get_error_frames_while_a_healthy_session_works(
    live_url: str,
) -> None:
    """B1: 2,000 fuzzed frames each get one reply while a healthy session finishes its steps."""
    url = live_url.replace("http", "ws") + "/ws"
    rng = random.Random(7)
    healthy_outputs: list[str] = []

    async def healthy() -> None:
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"max_iterations": 100}}))
            await ws.recv()
            for i in range(40):
                await ws.send(json.dumps({"type": "step", "data": {"code": f"print({i})"}}))
                reply = json.loads(await ws.recv())
                assert reply["type"] == "observation", reply
                healthy_outputs.append(reply["data"]["observation"]["result"]["stdout"])

    async def fuzz() -> dict[str, int]:
        replies: dict[str, int] = {}
        ws: ClientConnection = await connect(url)
        try:
            for _ in range(2000):
                await ws.send(_fuzz_frame(rng))
                reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
                kind = reply["type"] if reply["type"] != "error" else reply["data"]["code"]
                replies[kind] = replies.get(kind, 0) + 1
        finally:
            await ws.close()
        return replies

    replies, _ = await asyncio.gather(fuzz(), healthy())
    assert sum(replies.values()) == 2000
    assert set(replies) <= {
        "INVALID_JSON",
        "UNKNOWN_TYPE",
        "VALIDATION_ERROR",
        "EXECUTION_ERROR",
        "state",
        "mcp",
    }
    assert replies["INVALID_JSON"] and replies["UNKNOWN_TYPE"] and replies["VALIDATION_ERROR"]
    assert healthy_outputs == [f"{i}\n" for i in range(40)]
