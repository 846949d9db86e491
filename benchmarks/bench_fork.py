"""Forking an episode: a live fork against a replay, and against fresh episodes, in one run.

    python benchmarks/bench_fork.py            # ~3 minutes on 2 cores

fork-100MB   a kernel holding ~100 MB of Python objects: a 1-way fork, fork() call -> the copy
             ready for its first step (fork() returned), and -> its first step answered (p50
             of N): unsandboxed, live (a copy of the kernel's process) and replay (a fresh
             kernel re-runs the steps); sandboxed, replay (a sandboxed kernel is not forked
             live: docs/security.md#why-a-sandboxed-episode-is-forked-by-replay). Every
             kernel is forked from a forkserver, as a server's are, so a replay starts in
             milliseconds and then re-runs the steps.
8-way        an episode whose setup step takes 2 s of CPU: 8 forks (live, then replay),
             against 8 fresh episodes that each redo the setup (2 at a time, as a 2-core
             machine runs them)

The machine's load average is printed at the start and the end: figures taken beside other
work say so.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import time

from kernel_env import AsyncKernelEnv
from kernel_env.kernel import KernelSource
from kernel_env.kernel.factory import local_source
from kernel_env.kernel.fork.server import ForkServer

BIG = "blob = [str(i) * 10 for i in range(1_500_000)]  # ~100 MB of str objects"


def slow_setup(seconds: float = 2.0) -> str:
    """A setup step of ``seconds`` of CPU on this machine: as many hashes as this process
    computes in that time (a fixed amount of work, so a replay redoes all of it)."""
    rounds, h, t0 = 200_000, b"", time.perf_counter()
    for _ in range(rounds):
        h = hashlib.sha256(h).digest()
    count = int(rounds * seconds / (time.perf_counter() - t0))
    return f"import hashlib\nh = b''\nfor i in range({count}):\n    h = hashlib.sha256(h).digest()"


async def fork_once(
    source: KernelSource, code: str, samples: int, methods: tuple[str, ...]
) -> dict[str, list[float]]:
    """fork() -> the copy ready, and -> its first step answered, by each of ``methods``
    (interleaved); also the time of the step that built the state, in the parent."""
    times: dict[str, list[float]] = {}
    async with AsyncKernelEnv(kernel_source=source, step_timeout=120) as parent:
        await parent.reset()
        t0 = time.perf_counter()
        await parent.execute(code)
        times["step"] = [time.perf_counter() - t0]
        rss = (await parent.run("import resource; print(resource.getrusage(0).ru_maxrss)")).stdout
        print(f"the parent kernel's peak RSS: {int(rss) / 1024:.0f} MiB", flush=True)
        for _ in range(samples):
            for method in methods:
                t0 = time.perf_counter()
                (child,) = await parent.fork(method=method)  # type: ignore[arg-type]
                times.setdefault(f"{method} ready", []).append(time.perf_counter() - t0)
                first = await child.run("print(len(blob))")
                times.setdefault(f"{method} first step", []).append(time.perf_counter() - t0)
                assert first.success, first.stderr
                await child.close()
        # What a replay from a checkpoint of the namespace would pay at least instead of
        # re-running the step: the state pickled in the parent and unpickled in the copy
        # (last: the forks' replays would re-run this step too).
        pickled = await parent.run(
            "import pickle, time\nt0 = time.perf_counter()\ndata = pickle.dumps(blob, 5)\n"
            "t1 = time.perf_counter()\npickle.loads(data)\n"
            "print(t1 - t0, time.perf_counter() - t1, len(data))\ndel data"
        )
        dumps, loads, size = (float(x) for x in pickled.stdout.split())
        times["pickle"] = [dumps + loads]
        print(
            f"its state pickled: {size / 2**20:.0f} MiB, dumps {dumps * 1000:.0f} ms, loads "
            f"{loads * 1000:.0f} ms",
            flush=True,
        )
    return times


async def eight_way(source: KernelSource, code: str) -> dict[str, float]:
    out = {}
    async with AsyncKernelEnv(kernel_source=source, step_timeout=120) as parent:
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
        async with AsyncKernelEnv(kernel_source=source, step_timeout=120) as env:
            await env.reset()
            await env.execute(code)

    t0 = time.perf_counter()
    for _ in range(4):  # two lanes
        await asyncio.gather(fresh(), fresh())
    out["fresh"] = time.perf_counter() - t0
    return out


def _p50(times: dict[str, list[float]], name: str) -> str:
    return f"{statistics.median(times[name]) * 1000:.0f} ms"


async def main(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    async with ForkServer() as forkserver:
        plain = local_source("none", forkserver=forkserver)
        sandboxed = local_source("bwrap", forkserver=forkserver)
        times = await fork_once(plain, BIG, args.samples, ("live", "replay"))
        boxed = await fork_once(sandboxed, BIG, args.samples, ("replay",))
        print(
            f"fork-100MB, p50 over {args.samples} (the step that built it: unsandboxed "
            f"{_p50(times, 'step')}, sandboxed {_p50(boxed, 'step')}):\n"
            f"  fork() -> ready:               unsandboxed live {_p50(times, 'live ready')}, "
            f"replay {_p50(times, 'replay ready')}; sandboxed replay "
            f"{_p50(boxed, 'replay ready')}\n"
            f"  fork() -> first step answered: unsandboxed live "
            f"{_p50(times, 'live first step')}, replay {_p50(times, 'replay first step')}; "
            f"sandboxed replay {_p50(boxed, 'replay first step')}   [target: a sandboxed "
            f"kernel's fork -> first step p50 <= 50 ms]\n"
            f"  a replay from a pickled namespace would pay at least {_p50(boxed, 'pickle')} "
            f"(dumps + loads, sandboxed) instead of the step",
            flush=True,
        )
        eight = await eight_way(plain, slow_setup())
    print(
        f"8-way, a {eight['setup']:.1f} s setup: 8 live forks {eight['live']:.2f} s; 8 replays "
        f"{eight['replay']:.1f} s; 8 fresh episodes, 2 lanes {eight['fresh']:.1f} s "
        f"(live {eight['fresh'] / eight['live']:.0f}x faster than fresh)"
    )
    print(f"load at the end: {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
