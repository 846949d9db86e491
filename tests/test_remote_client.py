"""KernelEnv / AsyncKernelEnv with a base_url: the same results as local mode, over /ws."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverkit import small_settings, thread_server, wait_until

from kernel_env import (
    AsyncKernelEnv,
    EpisodeFinished,
    InvalidInput,
    KernelEnv,
    RemoteError,
    REPLAction,
    ResetNeeded,
)
from kernel_env.client import KernelEnv as KernelEnvClass
from kernel_env.errors import CapacityReached
from kernel_env.remote import RemoteSession, ws_url

TOKEN = "remote-test-token"

STEPS = [
    REPLAction(code="words = context.split()\nprint(len(words))"),
    REPLAction(code="1 / 0"),
    REPLAction(code="total = sum(len(w) for w in words)\ntotal"),
    REPLAction(code="import sys; print('err', file=sys.stderr)"),
    REPLAction(code="print(SHOW_VARS())"),
    REPLAction(code="FINAL(total)"),
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with thread_server(small_settings(pool_size=2)) as base:
        yield base


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://h:1", "ws://h:1/ws"),
        ("https://h:1/", "wss://h:1/ws"),
        ("http://h:1/prefix/", "ws://h:1/prefix/ws"),
        ("ws://h:1/ws", "ws://h:1/ws"),
        ("h:8000", "ws://h:8000/ws"),
    ],
)
def test_ws_url_rule(base: str, expected: str) -> None:
    """http(s)://host:port[/prefix] maps to ws(s)://host:port[/prefix]/ws."""
    assert ws_url(base) == expected


def test_ws_url_rejects_other_schemes() -> None:
    """A URL that is not http(s) or ws(s) is a ValueError."""
    with pytest.raises(ValueError):
        ws_url("ftp://h:1")


def _comparable(result: Any) -> dict[str, Any]:
    obs = result.observation
    r = obs.result
    return {
        "stdout": r.stdout,
        "stderr_tail": r.stderr.strip().splitlines()[-1:] if r.stderr else [],
        "success": r.success,
        "exception": r.exception,
        "locals": r.locals_snapshot,
        "outputs": [o.get("output_type") for o in r.outputs],
        "vars": obs.available_variables,
        "iteration": obs.iteration,
        "context_length": obs.context_length,
        "preview": obs.context_preview,
        "done": result.done,
        "reward": result.reward,
        "final": obs.metadata.get("final_answer"),
    }


async def _episode(env: AsyncKernelEnv) -> tuple[list[dict[str, Any]], Any]:
    results = [
        await env.reset(
            context="the quick brown fox", task_prompt="count letters", expected_answer="16"
        )
    ]
    results += [await env.step(action) for action in STEPS]
    return [_comparable(r) for r in results], await env.state()


@pytest.mark.integration
async def test_remote_gives_the_same_results_as_local(url: str) -> None:
    """The same steps give the same observations and state locally and through the server."""
    async with AsyncKernelEnv() as local:
        local_obs, local_state = await _episode(local)
    async with AsyncKernelEnv(url) as remote:
        remote_obs, remote_state = await _episode(remote)
    assert remote_obs == local_obs
    assert remote_obs[-1]["done"] is True and remote_obs[-1]["final"] == "16"
    assert remote_obs[-1]["reward"] == 1.0
    fields = (
        "step_count",
        "context",
        "task_prompt",
        "iteration",
        "max_iterations",
        "namespace_keys",
        "final_answer",
        "done",
        "reward",
    )
    assert {f: getattr(remote_state, f) for f in fields} == {
        f: getattr(local_state, f) for f in fields
    }


@pytest.mark.integration
def test_sync_client_round_trip(url: str) -> None:
    """The synchronous KernelEnv works against a server: reset, execute, state, final answer."""
    with KernelEnv(url) as env:
        env.reset(context="Hello World", task_prompt="count chars")
        assert env.execute("n = len(context); print(n)").observation.result.stdout == "11\n"
        assert "n" in env.list_variables()
        assert env.get_variable("n").observation.result.stdout == "11\n"
        done = env.submit_final_answer("11")
        assert done.done is True and done.observation.metadata["final_answer"] == "11"
        assert env.state().final_answer == "11"


@pytest.mark.integration
async def test_error_frames_raise_the_local_class_and_remote_error(url: str) -> None:
    """An error frame raises the class a local client raises (ResetNeeded, InvalidInput,
    EpisodeFinished), which is also a RemoteError carrying the frame's code and data, so code
    that catches RemoteError keeps working; the session goes on."""
    async with AsyncKernelEnv(url) as env:
        with pytest.raises(ResetNeeded) as raised:
            await env.execute("1")
        assert isinstance(raised.value, RemoteError) and isinstance(raised.value, RuntimeError)
        assert raised.value.code == "EXECUTION_ERROR"
        assert raised.value.data["message"] == "Environment not initialized. Call reset() first."
        with pytest.raises(InvalidInput) as invalid:
            await env.reset(max_iterations=0)
        assert isinstance(invalid.value, RemoteError) and isinstance(invalid.value, ValueError)
        assert invalid.value.code == "VALIDATION_ERROR"
        assert "max_iterations" in str(invalid.value)
        await env.reset()
        assert (await env.execute("print(2)")).observation.result.stdout == "2\n"
        await env.submit_final_answer("2")
        with pytest.raises(EpisodeFinished) as over:
            await env.execute("3")
        assert isinstance(over.value, RemoteError) and "call reset()" in str(over.value)


@pytest.mark.integration
async def test_capacity_refusal_raises_capacity_reached() -> None:
    """A full server's refusal surfaces as CapacityReached (a RemoteError with the code
    CAPACITY_REACHED, as before) on the first call, with the counts."""
    with thread_server(small_settings(pool_size=0, max_sessions=1)) as base:
        async with AsyncKernelEnv(base) as first, AsyncKernelEnv(base) as second:
            await first.state()
            with pytest.raises(CapacityReached) as refused:
                await second.state()
            assert isinstance(refused.value, RemoteError)
            assert refused.value.code == "CAPACITY_REACHED"
            assert refused.value.data["max_sessions"] == 1
            assert (refused.value.active_sessions, refused.value.max_sessions) == (1, 1)


@pytest.mark.integration
async def test_token_is_sent_and_required() -> None:
    """With a server token, no token is refused as UNAUTHORIZED; the right one works."""
    with thread_server(small_settings(pool_size=0, token=TOKEN)) as base:
        with pytest.raises(RemoteError) as refused:
            await RemoteSession.connect(base)
        assert refused.value.code == "UNAUTHORIZED"
        assert TOKEN not in str(refused.value)
        async with AsyncKernelEnv(base, token=TOKEN) as env:
            assert (await env.state()).step_count == 0


@pytest.mark.integration
async def test_a_late_reply_closes_the_connection_instead_of_shifting_replies(url: str) -> None:
    """A reply later than message_timeout_s raises TIMEOUT and drops the (now shifted) socket."""
    session = await RemoteSession.connect(url)
    try:
        await session.reset()  # a cold kernel start may take longer than the timeout below
        session.message_timeout_s = 0.5
        with pytest.raises(RemoteError) as late:
            await session.step(REPLAction(code="import time; time.sleep(2)"))
        assert late.value.code == "TIMEOUT"
        with pytest.raises(RemoteError) as closed:
            await session.state()
        assert closed.value.code == "CONNECTION_CLOSED"
    finally:
        await session.close()


async def test_unreachable_server_is_connection_error() -> None:
    """Connecting to a port nobody listens on raises ConnectionError."""
    with pytest.raises(ConnectionError):
        await RemoteSession.connect("http://127.0.0.1:9", connect_timeout_s=2)


@pytest.mark.integration
async def test_many_remote_clients_at_once_get_their_own_outputs(url: str) -> None:
    """Concurrent remote clients each see exactly their own outputs."""

    async def run(tag: int) -> list[str]:
        async with AsyncKernelEnv(url) as env:
            await env.reset()
            return [
                (await env.execute(f"print('{tag}:{i}')")).observation.result.stdout
                for i in range(10)
            ]

    results = await asyncio.gather(*(run(t) for t in range(6)))
    assert results == [[f"{t}:{i}\n" for i in range(10)] for t in range(6)]


def _sessions(url: str) -> set[str]:
    listed = httpx.get(f"{url}/sessions", timeout=10).json()["sessions"]
    return {s["session_id"] for s in listed}


@pytest.mark.integration
def test_fork_on_a_server_gives_connected_copies(url: str) -> None:
    """KernelEnv(base_url).fork(n): n clients, each attached to a new session on the server
    whose episode holds the parent's variables; they diverge on their own, the parent is
    unaffected, and closing a copy ends its session."""
    with KernelEnv(url) as parent:
        parent.reset(context="shared")
        parent.execute("x = 1\nitems = [context]")
        before = _sessions(url)
        copies = parent.fork(2)
        assert len(copies) == 2 and all(isinstance(c, KernelEnv) for c in copies)
        new = _sessions(url) - before
        assert len(new) == 2
        for n, copy in enumerate(copies, start=2):
            assert copy.run("print(x, items)").stdout == "1 ['shared']\n"
            copy.execute(f"x = {n * 10}\nitems.append({n})")
        assert [c.run("print(x, items)").stdout for c in copies] == [
            "20 ['shared', 2]\n",
            "30 ['shared', 3]\n",
        ]
        assert parent.run("print(x, items)").stdout == "1 ['shared']\n"
        assert copies[0].state().step_count == 4  # the parent's two steps, then its own
        copies[0].close()
        assert wait_until(lambda: len(_sessions(url) & new) == 1, timeout=10)
        assert copies[1].run("x").stdout == "30\n"  # a sibling's close ends only its own
        copies[1].close()
        assert wait_until(lambda: not _sessions(url) & new, timeout=10)
        assert parent.run("x").stdout == "1\n"


@pytest.mark.integration
async def test_async_fork_on_a_server(url: str) -> None:
    """AsyncKernelEnv(base_url).fork: the same, with async clients."""
    async with AsyncKernelEnv(url) as parent:
        await parent.reset()
        await parent.execute("x = 'parent'")
        (copy,) = await parent.fork()
        async with copy:
            assert isinstance(copy, AsyncKernelEnv) and copy.base_url == url
            assert (await copy.run("x")).stdout == "'parent'\n"
            await copy.execute("x = 'copy'")
            assert (await copy.run("x")).stdout == "'copy'\n"
        assert (await parent.run("x")).stdout == "'parent'\n"


def test_from_docker_image_is_a_lazy_classmethod() -> None:
    """KernelEnv.from_docker_image exists and imports openenv only when called."""
    assert isinstance(KernelEnvClass.__dict__["from_docker_image"], classmethod)
