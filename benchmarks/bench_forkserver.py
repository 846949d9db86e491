"""The kernel forkserver: P11, P1 under load and P12 of docs/acceptance.md, and memory, in one run.

    python benchmarks/bench_forkserver.py            # ~4-5 minutes on 2 cores
    python benchmarks/bench_forkserver.py --quick    # fewer samples, for a smoke run
    python benchmarks/bench_forkserver.py --only p11 # one part (p12, memory, p1, p11; repeatable)

P12     a fresh sandboxed kernel, request -> ready (its first cell's reply): forked vs cold
        (p50), and the CPU the kernel's own process used until then (from /proc)
memory  N idle sandboxed kernels, forked vs cold: the sum of their processes' PSS
P1      20 back-to-back resets in one /ws session, forkserver server vs cold-start server,
        each p50 as a share of a cold kernel start
P11     8 /ws sessions of back-to-back episodes (reset + 3 trivial steps) for 20 s, episodes/s,
        forkserver server vs cold server vs a kernel per episode started by hand with raw
        jupyter_client, two lanes (20 s just before the forkserver server's 20 s and 20 s just
        after, averaged)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_server import RawKernel, Server, descendants, ms, pct, ws_request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from procs import pss_bytes
from websockets.asyncio.client import connect

from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.sandboxed import SandboxedKernel

PARTS = ("p12", "memory", "p1", "p11")


def task_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads, from their schedstat (nanoseconds; /proc/<pid>/stat
    counts in 10 ms ticks, too coarse for a forked start)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy so far (every process and the kernel)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait


def _kernel_pid(kernel: SandboxedKernel) -> int:
    """The host pid of the process that runs the kernel's cells."""
    if kernel.forked and kernel.forked_pid is not None:
        return kernel.forked_pid
    init = kernel._km.sandbox_init  # type: ignore[union-attr]
    return int(Path(f"/proc/{init}/task/{init}/children").read_text().split()[0])


def _processes(kernel: SandboxedKernel) -> list[int]:
    """Every host process a kernel costs: the launch (bubblewrap, its init, the kernel or
    placeholder) and, when forked, the kernel (the zygote's child)."""
    launched = kernel._km.provisioner.pid  # type: ignore[union-attr]
    return sorted({launched, *descendants(launched), _kernel_pid(kernel)})


async def p12(server: ForkServer, n: int) -> dict[str, Any]:
    """Start latency, the kernel's own CPU and the whole machine's, forked and cold,
    interleaved."""
    out: dict[str, list[float]] = {}
    for i in range(2 * n + 2):
        kind = "fork" if i % 2 else "cold"
        kernel = SandboxedKernel(forkserver=server if kind == "fork" else None)
        busy, t0 = machine_busy_seconds(), time.perf_counter()
        await kernel.start()
        await kernel.execute("pass")  # ready means it answers: a kernel counts as ready
        elapsed = time.perf_counter() - t0  # once its iopub speaks, before its shell does
        machine = machine_busy_seconds() - busy
        cpu = task_cpu_seconds(_kernel_pid(kernel))
        await kernel.shutdown()
        if i >= 2:  # the first of each warms caches
            out.setdefault(kind, []).append(elapsed)
            out.setdefault(f"{kind}_cpu", []).append(cpu)
            out.setdefault(f"{kind}_machine", []).append(machine)
    return out


async def memory(server: ForkServer, n: int) -> dict[str, float]:
    """The PSS sum of ``n`` idle kernels' processes, forked, then cold."""
    sums = {}
    for kind in ("fork", "cold"):
        kernels = []
        for _ in range(n):
            kernel = SandboxedKernel(forkserver=server if kind == "fork" else None)
            await kernel.start()
            kernels.append(kernel)
        await asyncio.sleep(1)
        sums[kind] = float(sum(pss_bytes(pid) for k in kernels for pid in _processes(k)))
        await asyncio.gather(*(k.shutdown() for k in kernels))
    return sums


async def resets(server: Server, n: int) -> list[float]:
    samples = []
    async with connect(server.ws, max_size=None) as ws:
        await ws_request(ws, {"type": "reset"})
        for _ in range(n):
            t0 = time.perf_counter()
            await ws_request(ws, {"type": "reset"})
            samples.append(time.perf_counter() - t0)
    return samples


async def episodes(server: Server, sessions: int, seconds: float) -> float:
    """Episodes per second: ``sessions`` /ws sessions, each running back-to-back episodes."""
    deadline = time.monotonic() + seconds
    counts = [0] * sessions

    async def lane(i: int) -> None:
        async with connect(server.ws, max_size=None) as ws:
            while time.monotonic() < deadline:
                await ws_request(ws, {"type": "reset"})
                for code in ("x = 1", "y = x + 1", "print(y)"):
                    await ws_request(ws, {"type": "step", "data": {"code": code}})
                counts[i] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - t0)


async def raw_episodes(lanes: int, seconds: float) -> float:
    """A kernel per episode, started by hand with raw jupyter_client, ``lanes`` at a time."""
    deadline = time.monotonic() + seconds
    counts = [0] * lanes

    async def lane(i: int) -> None:
        while time.monotonic() < deadline:
            kernel = RawKernel()
            await kernel.start()
            for code in ("x = 1", "y = x + 1", "print(y)"):
                await kernel.execute(code)
            await kernel.stop()
            counts[i] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(lanes)))
    return sum(counts) / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    parts = set(args.only or PARTS)
    cold_start = None
    if parts & {"p12", "memory", "p1"}:
        cold_start = await starts_and_memory(args, parts)
    if parts & {"p1", "p11"}:
        await under_load(args, parts, cold_start)


async def starts_and_memory(args: argparse.Namespace, parts: set[str]) -> float:
    """P12 and memory; the cold start's p50 (P1's yardstick)."""
    async with ForkServer() as forkserver:
        print(f"forkserver: {forkserver.status}", flush=True)
        start = await p12(forkserver, args.starts if "p12" in parts else 3)
        mem = await memory(forkserver, args.kernels) if "memory" in parts else None
    cold_start = statistics.median(start["cold"])
    fork_start = statistics.median(start["fork"])
    if "p12" in parts:
        print(
            f"P12 start, sandboxed, request -> first reply: forked p50 {ms(fork_start)} "
            f"(p95 {ms(pct(start['fork'], 0.95))}), cold p50 {ms(cold_start)}: "
            f"{cold_start / fork_start:.1f}x   [target: forked p50 <= 40 ms]"
        )
        print(
            f"    the kernel process's CPU until then: forked p50 "
            f"{ms(statistics.median(start['fork_cpu']))}, cold p50 "
            f"{ms(statistics.median(start['cold_cpu']))}   [target: forked <= 40 ms]",
            flush=True,
        )
        print(
            f"    the whole machine's CPU during a start (server, sandbox launch, kernel): "
            f"forked mean {ms(statistics.mean(start['fork_machine']))}, cold mean "
            f"{ms(statistics.mean(start['cold_machine']))}",
            flush=True,
        )
    if mem is not None:
        mib = 1024 * 1024
        print(
            f"memory, {args.kernels} idle sandboxed kernels (PSS of all their processes): "
            f"forked {mem['fork'] / mib:.0f} MiB, cold {mem['cold'] / mib:.0f} MiB "
            f"({mem['fork'] / mem['cold']:.2f}x)",
            flush=True,
        )
    return cold_start


async def under_load(args: argparse.Namespace, parts: set[str], cold_start: float | None) -> None:
    """P1 under load and P11: a forkserver server and a cold-start server; raw kernels just
    before the forkserver server's episodes and just after, averaged (the machine's speed
    drifts within a minute: P11's ratio compares like with like)."""
    results: dict[str, Any] = {}
    raw: list[float] = []
    for label, flags in (("forkserver", []), ("cold", ["--forkserver", "false"])):
        server = Server("--pool-size", "4", "--max-sessions", "16", *flags)
        try:
            if "p1" in parts:
                await server.wait_pool_full(4)
                results[f"{label}_resets"] = await resets(server, 20)
            if "p11" in parts:
                if label == "forkserver":
                    raw.append(await raw_episodes(2, args.seconds))
                await server.wait_pool_full(4)
                results[f"{label}_eps"] = await episodes(server, 8, args.seconds)
                if label == "forkserver":
                    raw.append(await raw_episodes(2, args.seconds))
        finally:
            server.stop()
    for label in ("forkserver", "cold") if "p1" in parts else ():
        assert cold_start is not None
        r = results[f"{label}_resets"]
        p50 = statistics.median(r)
        print(
            f"P1 under load, {label} server, 20 back-to-back resets: p50 {ms(p50)} "
            f"= {100 * p50 / cold_start:.1f}% of a cold start, "
            f"p95 {ms(pct(r, 0.95))}   [target: p50 <= 5%]"
        )
    if "p11" not in parts:
        return
    rate = statistics.mean(raw)
    lanes = f"{rate:.1f}/s, 2 lanes: {raw[0]:.1f} before, {raw[1]:.1f} after"
    for label in ("forkserver", "cold"):
        eps = results[f"{label}_eps"]
        print(
            f"P11 {label} server, 8 sessions x {args.seconds:g} s: {eps:.1f} episodes/s = "
            f"{eps / rate:.1f}x raw jupyter_client ({lanes})   [target: >= 15x]"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run this part only (repeatable)"
    )
    args = parser.parse_args(argv)
    args.starts, args.kernels, args.seconds = (5, 8, 5.0) if args.quick else (20, 64, 20.0)
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
