"""Forking an episode (replay), against starting fresh episodes, in one run.

    python benchmarks/bench_fork.py            # ~1-2 minutes on 2 cores

fork-100MB   a kernel holding ~100 MB of Python objects: a 1-way fork, fork() call -> the copy
             ready for its first step (p50 of N); the replay re-builds the objects
8-way        an episode whose setup step takes ~2 s of CPU: 8 forks, against 8 fresh episodes
             that each redo the setup (2 at a time, as a 2-core machine runs them)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from kernel_env import AsyncKernelEnv
from kernel_env.kernel.factory import local_source

BIG = "blob = [str(i) * 10 for i in range(1_500_000)]  # ~100 MB of str objects"
SLOW_SETUP = (
    "import hashlib\nh = b''\nfor i in range(1_200_000):\n    h = hashlib.sha256(h).digest()"
)


async def fork_once(code: str, samples: int) -> list[float]:
    times = []
    async with AsyncKernelEnv(kernel_source=local_source("auto"), step_timeout=120) as parent:
        await parent.reset()
        await parent.execute(code)
        for _ in range(samples):
            t0 = time.perf_counter()
            (child,) = await parent.fork()
            times.append(time.perf_counter() - t0)
            await child.close()
    return times


async def eight_way(code: str) -> tuple[float, float]:
    async with AsyncKernelEnv(kernel_source=local_source("auto"), step_timeout=120) as parent:
        await parent.reset()
        await parent.execute(code)
        t0 = time.perf_counter()
        children = await parent.fork(8)
        forked = time.perf_counter() - t0
        await asyncio.gather(*(c.close() for c in children))

    async def fresh() -> None:
        async with AsyncKernelEnv(kernel_source=local_source("auto"), step_timeout=120) as env:
            await env.reset()
            await env.execute(code)

    t0 = time.perf_counter()
    for _ in range(4):  # two lanes
        await asyncio.gather(fresh(), fresh())
    return forked, time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    times = await fork_once(BIG, args.samples)
    print(
        f"fork-100MB (replay): fork() -> ready p50 {statistics.median(times) * 1000:.0f} ms "
        f"over {len(times)}   [live-fork target: p50 <= 50 ms; no live fork yet]"
    )
    forked, fresh = await eight_way(SLOW_SETUP)
    print(
        f"8-way, a ~2 s setup: 8 forks (replay) {forked:.1f} s; 8 fresh episodes, 2 lanes "
        f"{fresh:.1f} s ({forked / fresh:.2f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
