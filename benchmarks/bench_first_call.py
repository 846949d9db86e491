"""A fresh episode's first cell calling llm_query: its latency, lost calls, and the kernel's
start to ready (readiness includes the stdin probe, sent with the kernel_info request).

    .venv/bin/python benchmarks/bench_first_call.py [--episodes 50] [--sandbox none|bwrap]

Each episode: a new local kernel (timed start -> ready), reset,
then one cell ``x = llm_query('hi')`` answered by an instant callable. A lost stdin request
shows as a step that timed out (step timeout 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from kernel_env import AsyncKernelEnv
from kernel_env.kernel import Kernel
from kernel_env.kernel.factory import local_source

start_times: list[float] = []


def _ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f} ms"


async def main(episodes: int, sandbox: str) -> None:
    source = local_source(sandbox)

    async def timed_source() -> Kernel:
        t0 = time.perf_counter()
        kernel = await source()
        start_times.append(time.perf_counter() - t0)
        return kernel

    steps, lost = [], 0
    for _ in range(episodes):
        async with AsyncKernelEnv(
            kernel_source=timed_source, llm_query_fn=lambda p: "ok", step_timeout=10
        ) as env:
            await env.reset()
            t0 = time.perf_counter()
            result = (await env.execute("x = llm_query('hi')")).observation.result
            steps.append(time.perf_counter() - t0)
            lost += not result.success
    print(f"episodes {episodes}, sandbox {sandbox}: lost first calls {lost}")
    print(f"kernel start -> ready: p50 {_ms(start_times, 0.5)}, p95 {_ms(start_times, 0.95)}")
    print(
        f"first cell with llm_query: p50 {_ms(steps, 0.5)}, p95 {_ms(steps, 0.95)}, "
        f"max {_ms(steps, 1.0)}, mean {1000 * statistics.mean(steps):.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--sandbox", default="none", choices=["none", "bwrap"])
    args = parser.parse_args()
    asyncio.run(main(args.episodes, args.sandbox))
