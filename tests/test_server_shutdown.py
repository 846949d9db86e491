"""F10 and F11: a ``kernel-env serve`` process stopped with steps in flight, or killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from procs import child_pids, comm, descendants, running
from serverkit import alive, kernel_pids, metrics, serve_process, terminate, wait_until
from uids import OWN_UIDS_REASON, unsandboxed_kernels_get_own_uids
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

pytestmark = pytest.mark.integration  # kernels, servers or other processes


async def _start_step(url: str, code: str) -> ClientConnection:
    ws = await connect(url.replace("http", "ws") + "/ws")
    await ws.send(json.dumps({"type": "reset"}))
    assert json.loads(await ws.recv())["type"] == "observation"
    await ws.send(json.dumps({"type": "step", "data": {"code": code}}))
    return ws


async def test_sigterm_lets_an_in_flight_step_answer_then_kills_every_kernel() -> None:
    """F10: on SIGTERM a running step still gets its observation, then no kernel is left."""
    with serve_process("--pool-size", "2") as server:
        ws = await _start_step(server.url, "import time; time.sleep(2); print('finished')")
        await asyncio.sleep(0.5)
        kernels = kernel_pids(server.pid)
        assert len(kernels) >= 2
        terminate(server.process, signal.SIGTERM)
        sent = time.monotonic()
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply["type"] == "observation"
        assert reply["data"]["observation"]["result"]["stdout"] == "finished\n"
        assert time.monotonic() - sent < 10
        with contextlib.suppress(ConnectionClosed):  # closed once the drain is over
            await asyncio.wait_for(ws.recv(), 10)
        assert await asyncio.to_thread(server.process.wait, 10) is not None
        assert time.monotonic() - sent < 10
        assert not [pid for pid in kernels if alive(pid)]


async def test_sigterm_errors_a_step_that_outlives_the_drain() -> None:
    """F10: a step outliving the drain gets SESSION_ERROR in time, then every kernel is gone."""
    with serve_process("--pool-size", "1", "--drain-timeout", "2") as server:
        ws = await _start_step(server.url, "import time; time.sleep(60)")
        await asyncio.sleep(0.5)
        kernels = kernel_pids(server.pid)
        terminate(server.process, signal.SIGTERM)
        sent = time.monotonic()
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply["type"] == "error" and reply["data"]["code"] == "SESSION_ERROR"
        assert "shutting down" in reply["data"]["message"]
        assert await asyncio.to_thread(server.process.wait, 10) is not None
        assert time.monotonic() - sent < 10
        assert not [pid for pid in kernels if alive(pid)]
        await ws.close()


def test_sigkill_leaves_no_orphan_kernel_after_10_s() -> None:
    """F11: after SIGKILL of the server, every kernel it started exits within 10 s."""
    # ipykernel polls its parent (JPY_PARENT_PID, set by jupyter_client) and exits without it.
    with serve_process("--pool-size", "2") as server:
        sid = httpx.post(f"{server.url}/reset", json={}, timeout=30).headers["X-Session-Id"]
        assert sid
        # Wait for a full pool: a kernel killed half-way through its own start is another case.
        assert wait_until(
            lambda: (
                metrics(server.url)["pool_warm"] == 2 and metrics(server.url)["pool_starting"] == 0
            ),
            30,
        )
        kernels = kernel_pids(server.pid)
        assert len(kernels) == 3
        # The forkserver's zygote and spawner too, and every launch the spawner started.
        helpers = {p for p in descendants(server.pid) if comm(p) == "ke-spawner"}
        assert len(helpers) == 1
        helpers |= descendants(next(iter(helpers))) | set(child_pids(server.pid))
        terminate(server.process, signal.SIGKILL)
        server.process.wait(10)
        left = kernels | helpers
        assert wait_until(lambda: not any(alive(pid) for pid in left), 10, interval=0.2), [
            pid for pid in left if alive(pid)
        ]


@pytest.mark.skipif(unsandboxed_kernels_get_own_uids(), reason=OWN_UIDS_REASON)
def test_sigkill_leaves_no_live_fork_copy_running() -> None:
    """F11 for a live fork's copies: a copy's parent is a kernel, not the server, so it
    watches the server itself; after SIGKILL of the server the copy exits within 10 s."""
    with serve_process("--pool-size", "0", "--sandbox", "none") as server:
        parent = httpx.post(f"{server.url}/reset", json={}, timeout=30).headers["X-Session-Id"]
        forked = httpx.post(f"{server.url}/sessions/{parent}/fork", json={}, timeout=60).json()
        (copy,) = forked["sessions"]
        assert copy["method"] == "live", copy
        reply = httpx.post(
            f"{server.url}/step",
            json={"action": {"code": "import os; print(os.getpid())"}},
            headers={"X-Session-Id": copy["session_id"]},
            timeout=30,
        )
        pid = int(reply.json()["observation"]["result"]["stdout"])
        assert alive(pid)
        terminate(server.process, signal.SIGKILL)
        server.process.wait(10)
        assert wait_until(lambda: not alive(pid), 10, interval=0.2)


async def test_sigterm_does_not_wait_for_a_kernel_still_starting(tmp_path: Path) -> None:
    """F10: a kernel start in flight (a pool's refill of a kernel that is slow to come up)
    does not hold the shutdown up past what ``docker stop`` grants (10 s, and OpenEnv's
    ``LocalDockerProvider`` gives up then): the server exits within a few seconds, and the
    starting kernel's processes are gone."""
    spec = tmp_path / "kernels" / "slowstart"
    spec.mkdir(parents=True)
    # A kernel that never comes up: its pool's start waits for it (60 s before it fails).
    argv = ["sh", "-c", "exec sleep 120.271", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "slow", "language": "python"})
    )
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path)}
    with serve_process("--pool-size", "1", "--kernels", "python3,slowstart", env=env) as server:
        assert wait_until(lambda: _sleepers(), 30), "the slow kernel's start never began"
        starting = _sleepers()
        terminate(server.process, signal.SIGTERM)
        sent = time.monotonic()
        assert await asyncio.to_thread(server.process.wait, 30) is not None
        assert time.monotonic() - sent < 6, "the shutdown waited for a kernel still starting"
        assert wait_until(lambda: not any(alive(pid) for pid in starting), 5), starting


def _sleepers() -> set[int]:
    """The processes of the slow kernel (``sleep 120.271``), this test's alone."""
    return running(b"sleep\x00120.271\x00")
