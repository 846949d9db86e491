"""The sandbox's cost, and P7 (memory of idle pooled kernels), measured in one run.

Run: .venv/bin/python benchmarks/bench_sandbox.py [--kernels 64]
     .venv/bin/python benchmarks/bench_sandbox.py --baseline ../other-checkout [--rounds 3]

``--baseline`` compares a sandboxed kernel's trivial step with another checkout's (an earlier
version of the sandbox), in alternating rounds of 400 steps, each in a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_server import descendants

from kernel_env.kernel import Kernel, LocalKernel
from kernel_env.kernel.sandbox import SandboxedKernel, sandbox_problem


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


STEP_P50 = """\
import asyncio, statistics, time
from kernel_env.kernel.sandbox import SandboxedKernel
async def main():
    kernel = SandboxedKernel()
    await kernel.start()
    for _ in range(20):
        await kernel.execute("x = 1")
    times = []
    for _ in range(400):
        t0 = time.perf_counter()
        await kernel.execute("x = 1")
        times.append(time.perf_counter() - t0)
    await kernel.shutdown()
    print(statistics.median(times))
asyncio.run(main())
"""


def step_p50(pythonpath: str | None) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", STEP_P50],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd="/",
    )
    return float(out.stdout.split()[-1])


def compare(baseline: str, rounds: int) -> None:
    this = str(Path(__file__).resolve().parent.parent)
    runs: dict[str, list[float]] = {"baseline": [], "this checkout": []}
    for _ in range(rounds):
        runs["baseline"].append(step_p50(str(Path(baseline).resolve())))
        runs["this checkout"].append(step_p50(this))
    base = statistics.median(runs["baseline"])
    for name, values in runs.items():
        p50 = statistics.median(values)
        print(
            f"{name:<16} sandboxed step p50 {p50 * 1000:6.2f} ms "
            f"(rounds: {', '.join(f'{v * 1000:.2f}' for v in values)}) x{p50 / base:.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", type=int, default=64)
    parser.add_argument("--baseline", help="another checkout to compare the step cost with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.baseline:
        compare(args.baseline, args.rounds)
    else:
        asyncio.run(main(args.kernels))
