"""One server, more live episodes than select(2) could ever watch: no descriptor-number
ceiling (FD_SETSIZE, 1024) anywhere on the path of a reset or a step, and a server started
with the usual soft limit of 1024 open files raises it to the hard limit itself."""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from pathlib import Path

import httpx
import pytest
from serverkit import alive, kernel_pids, serve_args, serving, wait_until

from kernel_env.server.runner import DESCRIPTORS_PER_KERNEL, RESERVED_DESCRIPTORS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

EPISODES = 300  # past 1024 / 8: the descriptors of the 128th kernel are beyond select's reach
AT_ONCE = 8  # requests in flight: the 2-core machine starts kernels, it does not queue them
SOFT = 1024  # the soft limit the server starts with (a login shell's usual one)


def _hard_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open files limit in /proc/{pid}/limits")


async def _open_and_set(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int) -> str:
    async with gate:
        reset = await client.post("/reset", json={})
        assert reset.status_code == 200, (i, reset.text[:500])
        sid = reset.headers["X-Session-Id"]
        step = await client.post(
            "/step", json={"action": {"code": f"mine = {i}"}}, headers={"X-Session-Id": sid}
        )
        assert step.status_code == 200 and step.json()["observation"]["result"]["success"], (
            i,
            step.text[:500],
        )
        return sid


async def _read_back(client: httpx.AsyncClient, gate: asyncio.Semaphore, sid: str) -> str:
    async with gate:
        step = await client.post(
            "/step", json={"action": {"code": "print(mine)"}}, headers={"X-Session-Id": sid}
        )
        assert step.status_code == 200, step.text[:500]
        return str(step.json()["observation"]["result"]["stdout"]).strip()


async def _close(client: httpx.AsyncClient, gate: asyncio.Semaphore, sid: str) -> int:
    async with gate:
        return (await client.delete(f"/sessions/{sid}")).status_code


async def _drive(url: str) -> tuple[list[str], list[str], list[int], float]:
    gate = asyncio.Semaphore(AT_ONCE)
    limits = httpx.Limits(max_connections=AT_ONCE, max_keepalive_connections=AT_ONCE)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        started = time.monotonic()
        sids = await asyncio.gather(*(_open_and_set(client, gate, i) for i in range(EPISODES)))
        opened = time.monotonic() - started
        answers = await asyncio.gather(*(_read_back(client, gate, sid) for sid in sids))
        closed = await asyncio.gather(*(_close(client, gate, sid) for sid in sids))
    return sids, answers, closed, opened


def test_three_hundred_live_episodes_each_keep_their_own_state() -> None:
    """300 HTTP episodes open at once on one server started with a soft limit of 1024 open
    files: each is set, then every one steps and answers its own value; all close, and no
    kernel is left. (select(2) refused the pidfd of the 113th kernel: "filedescriptor out of
    range in select()"; a soft limit of 1024 ran out at the 125th.)"""
    hard = _hard_limit()
    needed = (EPISODES + 30) * DESCRIPTORS_PER_KERNEL + EPISODES + 64 + RESERVED_DESCRIPTORS
    if hard < needed:
        pytest.skip(f"the hard open files limit ({hard}) is below the {needed} this needs")
    command = [
        "prlimit",
        f"--nofile={SOFT}:{hard}",
        sys.executable,
        *serve_args(
            "--max-sessions", str(EPISODES + 20), "--max-kernels", str(EPISODES + 30),
            "--pool-size", "8", "--claim-ttl", "0", "--idle-ttl", "0",
        ),
    ]  # fmt: skip
    log = Path(f"/tmp/kernel-env-density-{time.monotonic_ns()}.log")
    try:
        with serving(command, log) as server:
            sids, answers, closed, opened = asyncio.run(_drive(server.url))
            assert _soft_limit_of(server.pid) == hard  # raised by the server itself
            assert len(set(sids)) == EPISODES
            assert answers == [str(i) for i in range(EPISODES)]
            assert closed == [204] * EPISODES
            print(f"{EPISODES} episodes opened and set in {opened:.1f} s")
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).json()
            assert metrics["sessions_active"] == 0 and metrics["sessions_total"] == EPISODES
            # The warm pool's kernels remain; every session's is gone.
            assert wait_until(lambda: len(kernel_pids(server.pid)) <= 8, timeout=60)
            warm = kernel_pids(server.pid)
            text = log.read_text(errors="replace")
            assert "out of range" not in text and "Too many open files" not in text
        assert wait_until(lambda: not any(alive(pid) for pid in warm), timeout=30)
    finally:
        log.unlink(missing_ok=True)
