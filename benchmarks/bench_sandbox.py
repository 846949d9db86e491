"""The sandbox's cost, and P7 (memory of idle pooled kernels), measured in one run.

Run: .venv/bin/python benchmarks/bench_sandbox.py [--kernels 64]
     .venv/bin/python benchmarks/bench_sandbox.py --baseline ../other-checkout [--rounds 5]

``--baseline`` compares the sandbox's cost with another checkout's (an earlier version of the
sandbox), in alternating rounds, each in a fresh process of one checkout: P12 (a forked
sandboxed kernel's start, request -> first reply) and a sandboxed kernel's step, forked and
cold, trivial and busy with system calls (what a seccomp filter costs shows there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_server import descendants

from kernel_env.kernel import Kernel, LocalKernel
from kernel_env.kernel.isolation.sandbox import sandbox_problem
from kernel_env.kernel.sandboxed import SandboxedKernel


def _rss_kib(pid: int) -> int:
    """RSS of a process and all its descendants (the sandbox's bwrap processes included)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


async def _start(cls: type[LocalKernel]) -> tuple[Kernel, float]:
    kernel = cls()
    t0 = time.perf_counter()
    await kernel.start()
    return kernel, time.perf_counter() - t0


async def cost(cls: type[LocalKernel], starts: int = 5, steps: int = 200) -> tuple[float, float]:
    start_times, step_times = [], []
    for _ in range(starts):
        kernel, elapsed = await _start(cls)
        start_times.append(elapsed)
        for _ in range(steps // starts):
            t0 = time.perf_counter()
            await kernel.execute("x = 1")
            step_times.append(time.perf_counter() - t0)
        await kernel.shutdown()
    return statistics.median(start_times), statistics.median(step_times)


async def pool_memory(cls: type[LocalKernel], count: int) -> tuple[float, float]:
    kernels = []
    sem = asyncio.Semaphore(8)

    async def one() -> None:
        async with sem:
            kernels.append((await _start(cls))[0])

    await asyncio.gather(*(one() for _ in range(count)))
    await asyncio.sleep(1)
    rss = [_rss_kib(k.pid) / 1024 for k in kernels if k.pid]
    await asyncio.gather(*(k.shutdown() for k in kernels))
    return statistics.median(rss), sum(rss)


async def main(count: int) -> None:
    kinds: list[type[LocalKernel]] = [LocalKernel]
    if sandbox_problem() is None:
        kinds.append(SandboxedKernel)
    else:
        print(f"sandbox unavailable ({sandbox_problem()}); measuring the plain backend only")
    print(
        f"{'backend':<16}{'cold start p50':>16}{'step p50':>12}"
        f"{f'RSS/kernel ({count} idle)':>26}{'total':>12}"
    )
    for cls in kinds:
        start, step = await cost(cls)
        per, total = await pool_memory(cls, count)
        print(
            f"{cls.__name__:<16}{start * 1000:>13.0f} ms{step * 1000:>9.2f} ms"
            f"{per:>22.1f} MiB{total / 1024:>9.2f} GiB"
        )
    print("targets: P7 <= 60 MiB RSS per idle kernel; 64 kernels <= 5 GB")


# One round of the comparison, in a fresh process of one checkout (its kernel_env first on
# sys.path; its zygote runs under PYTHON, a wrapper that puts it there too): P12 (a forked
# sandboxed kernel, request -> its first cell's reply) and the p50 of a step on a sandboxed
# kernel, forked and cold, trivial (x = 1) and busy with system calls (2,000 os.stat).
ROUND = """\
import asyncio, json, statistics, sys, time
try:  # the kernel layer by role and process (kernel/fork/, kernel/sandboxed.py)
    from kernel_env.kernel.fork.server import ForkServer
    from kernel_env.kernel.sandboxed import SandboxedKernel
except ImportError:  # a checkout from before it
    from kernel_env.kernel.forkserver import ForkServer
    from kernel_env.kernel.sandbox import SandboxedKernel
STEPS = {"trivial": "x = 1", "syscalls": "import os\\nfor _ in range(2000): os.stat('.')"}

async def steps(kernel, out, kind):
    for code in STEPS.values():
        await kernel.execute(code)
    for name, code in STEPS.items():
        times = []
        for _ in range(int(sys.argv[2])):
            t0 = time.perf_counter()
            await kernel.execute(code)
            times.append(time.perf_counter() - t0)
        out[f"{kind} step {name}"] = statistics.median(times)

async def main():
    out, starts = {}, []
    async with ForkServer(python=sys.argv[1]) as server:
        assert server.ready, server.status
        for i in range(int(sys.argv[3]) + 2):
            kernel = SandboxedKernel(forkserver=server)
            t0 = time.perf_counter()
            await kernel.start()
            await kernel.execute("pass")
            if i >= 2:  # the first ones warm caches
                starts.append(time.perf_counter() - t0)
            if i == 2:
                await steps(kernel, out, "forked")
            await kernel.shutdown()
    out["P12 forked start"] = statistics.median(starts)
    kernel = SandboxedKernel()
    await kernel.start()
    await steps(kernel, out, "cold")
    await kernel.shutdown()
    print(json.dumps(out))

asyncio.run(main())
"""


def one_round(checkout: str, steps: int, starts: int) -> dict[str, float]:
    """One round of ROUND in a fresh process of ``checkout``."""
    with tempfile.TemporaryDirectory() as scratch:
        python = Path(scratch) / "python"  # for the zygote: this checkout's kernel_env first
        python.write_text(f'#!/bin/sh\nPYTHONPATH={checkout} exec {sys.executable} "$@"\n')
        python.chmod(0o755)
        out = subprocess.run(
            [sys.executable, "-c", ROUND, str(python), str(steps), str(starts)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": checkout},
            check=True,
            cwd="/",
        )
    result: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return result


def compare(baseline: str, rounds: int, steps: int, starts: int) -> None:
    """Alternating rounds of the baseline checkout and this one; each figure's median over
    the rounds, side by side."""
    checkouts = {
        "baseline": str(Path(baseline).resolve()),
        "this checkout": str(Path(__file__).resolve().parent.parent),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    for i in range(rounds):
        for name, checkout in checkouts.items():
            runs[name].append(one_round(checkout, steps, starts))
        print(f"round {i + 1}/{rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'figure (p50, ms)':<24}{'baseline':>10}{'this':>10}{'this/base':>11}   rounds")
    for figure in runs["baseline"][0]:
        base = statistics.median(r[figure] for r in runs["baseline"])
        this = statistics.median(r[figure] for r in runs["this checkout"])
        detail = " | ".join(
            ", ".join(f"{r[figure] * 1000:.2f}" for r in runs[name]) for name in checkouts
        )
        ratio = this / base
        print(f"{figure:<24}{base * 1000:>10.2f}{this * 1000:>10.2f}{ratio:>11.2f}   {detail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", type=int, default=64)
    parser.add_argument("--baseline", help="another checkout to compare the sandbox's cost with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps of each kind a round")
    parser.add_argument("--starts", type=int, default=20, help="forked starts a round (P12)")
    args = parser.parse_args()
    if args.baseline:
        compare(args.baseline, args.rounds, args.steps, args.starts)
    else:
        asyncio.run(main(args.kernels))
