"""Forking an episode: a live fork against a replay, and against fresh episodes, in one run.

    python benchmarks/bench_fork.py            # ~2 minutes on 2 cores

fork-100MB   a kernel holding ~100 MB of Python objects: a 1-way fork, fork() call -> the copy
             ready for its first step (fork() returned), and -> its first step answered (p50
             of N), live (a copy of the kernel's process) and replay (a fresh kernel re-runs
             the steps), of the same episode
8-way        an episode whose setup step takes 2 s of CPU: 8 forks (live, then replay),
             against 8 fresh episodes that each redo the setup (2 at a time, as a 2-core
             machine runs them)

Live forks need an unsandboxed local kernel (see docs/concepts.md#forking-an-episode), so the
episodes here run with sandbox="none".
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import time

from kernel_env import AsyncKernelEnv
from kernel_env.kernel.factory import local_source

BIG = "blob = [str(i) * 10 for i in range(1_500_000)]  # ~100 MB of str objects"
SOURCE = local_source("none")


def slow_setup(seconds: float = 2.0) -> str:
    """A setup step of ``seconds`` of CPU on this machine: as many hashes as this process
    computes in that time (a fixed amount of work, so a replay redoes all of it)."""
    rounds, h, t0 = 200_000, b"", time.perf_counter()
    for _ in range(rounds):
        h = hashlib.sha256(h).digest()
    count = int(rounds * seconds / (time.perf_counter() - t0))
    return f"import hashlib\nh = b''\nfor i in range({count}):\n    h = hashlib.sha256(h).digest()"


async def fork_once(code: str, samples: int) -> dict[str, list[float]]:
    """fork() -> the copy ready, and -> its first step answered; live and replay
    interleaved."""
    times: dict[str, list[float]] = {}
    async with AsyncKernelEnv(kernel_source=SOURCE, step_timeout=120) as parent:
        await parent.reset()
        await parent.execute(code)
        rss = (await parent.run("import resource; print(resource.getrusage(0).ru_maxrss)")).stdout
        print(f"the parent kernel's peak RSS: {int(rss) / 1024:.0f} MiB", flush=True)
        for _ in range(samples):
            for method in ("live", "replay"):
                t0 = time.perf_counter()
                (child,) = await parent.fork(method=method)  # type: ignore[arg-type]
                times.setdefault(f"{method} ready", []).append(time.perf_counter() - t0)
                first = await child.run("print(len(blob))")
                times.setdefault(f"{method} first step", []).append(time.perf_counter() - t0)
                assert first.success, first.stderr
                await child.close()
    return times


async def eight_way(code: str) -> dict[str, float]:
    out = {}
    async with AsyncKernelEnv(kernel_source=SOURCE, step_timeout=120) as parent:
        await parent.reset()
        t0 = time.perf_counter()
        await parent.execute(code)
        out["setup"] = time.perf_counter() - t0
        for method in ("live", "replay"):
            t0 = time.perf_counter()
            children = await parent.fork(8, method=method)  # type: ignore[arg-type]
            out[method] = time.perf_counter() - t0
            await asyncio.gather(*(c.close() for c in children))

    async def fresh() -> None:
        async with AsyncKernelEnv(kernel_source=SOURCE, step_timeout=120) as env:
            await env.reset()
            await env.execute(code)

    t0 = time.perf_counter()
    for _ in range(4):  # two lanes
        await asyncio.gather(fresh(), fresh())
    out["fresh"] = time.perf_counter() - t0
    return out


async def main(args: argparse.Namespace) -> None:
    times = await fork_once(BIG, args.samples)
    p50 = {name: statistics.median(samples) * 1000 for name, samples in times.items()}
    print(
        f"fork-100MB, p50 over {args.samples}: fork() -> ready: live {p50['live ready']:.0f} ms, "
        f"replay {p50['replay ready']:.0f} ms; -> first step answered: live "
        f"{p50['live first step']:.0f} ms, replay {p50['replay first step']:.0f} ms   "
        f"[target: live ready p50 <= 50 ms]",
        flush=True,
    )
    eight = await eight_way(slow_setup())
    print(
        f"8-way, a {eight['setup']:.1f} s setup: 8 live forks {eight['live']:.2f} s; 8 replays "
        f"{eight['replay']:.1f} s; 8 fresh episodes, 2 lanes {eight['fresh']:.1f} s "
        f"(live {eight['fresh'] / eight['live']:.0f}x faster than fresh)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
