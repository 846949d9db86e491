"""Other languages' kernels: start and step times through kernel_env against raw jupyter_client
on the same kernelspec.

Run: .venv/bin/python benchmarks/bench_languages.py [--starts 5] [--steps 100]

For each installed kernel of ``ir``, ``bash`` and ``deno`` (``make kernels``):

- raw: jupyter_client's ``AsyncKernelManager`` starts the kernelspec as it is (TCP, the
  host's environment) and its client's ``wait_for_ready``; a step is ``execute_interactive``;
- kernel_env: ``LocalKernel`` (IPC, minimal environment) and ``SandboxedKernel`` started as an
  episode's kernel is (``kernel_env.languages.catalog.local_kernel_source``); a step is
  ``Kernel.execute``.

Start: from the call to a kernel ready for its first cell (p50). Step: a trivial cell's round
trip (p50).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from jupyter_client.manager import AsyncKernelManager

from kernel_env.kernel.isolation.sandbox import sandbox_problem
from kernel_env.languages.catalog import installed_kernels, local_kernel_source

TRIVIAL = {"ir": "x <- 1", "bash": "x=1", "deno": "const x = 1"}


async def raw(name: str, starts: int, steps: int) -> tuple[list[float], list[float]]:
    start_times, step_times = [], []
    for _ in range(starts):
        manager = AsyncKernelManager(kernel_name=name)
        t0 = time.perf_counter()
        await manager.start_kernel()
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        start_times.append(time.perf_counter() - t0)
        for _ in range(steps // starts):
            t0 = time.perf_counter()
            await client.execute_interactive(TRIVIAL[name], output_hook=lambda msg: None)
            step_times.append(time.perf_counter() - t0)
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
    return start_times, step_times


async def ours(name: str, sandbox: str, starts: int, steps: int) -> tuple[list[float], list[float]]:
    source = local_kernel_source(name, installed_kernels()[name], sandbox=sandbox)
    start_times, step_times = [], []
    for _ in range(starts):
        t0 = time.perf_counter()
        kernel = await source()
        start_times.append(time.perf_counter() - t0)
        for _ in range(steps // starts):
            t0 = time.perf_counter()
            await kernel.execute(TRIVIAL[name])
            step_times.append(time.perf_counter() - t0)
        await kernel.shutdown()
    return start_times, step_times


def _row(name: str, how: str, times: tuple[list[float], list[float]]) -> str:
    start, step = (statistics.median(t) * 1000 for t in times)
    return f"{name:6} {how:24} {start:10.0f} ms {step:10.2f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    installed = installed_kernels()
    print(f"{'kernel':6} {'how':24} {'start p50':>13} {'step p50':>13}")
    for name in ("ir", "bash", "deno"):
        if name not in installed:
            print(f"{name:6} not installed (make kernels)")
            continue
        print(_row(name, "raw jupyter_client", await raw(name, args.starts, args.steps)))
        print(
            _row(name, "kernel_env LocalKernel", await ours(name, "none", args.starts, args.steps))
        )
        if sandbox_problem() is None:
            sandboxed = await ours(name, "bwrap", args.starts, args.steps)
            print(_row(name, "kernel_env sandboxed", sandboxed))


if __name__ == "__main__":
    asyncio.run(main())
