"""Server benchmarks P1, P2, P3 and P6 of docs/acceptance.md, measured side by side in one run.

    python benchmarks/bench_server.py            # ~1-2 minutes on 2 cores
    python benchmarks/bench_server.py --quick    # fewer samples, for a smoke run

P1  reset with a warm pool, 8 sessions resetting in turn (p50/p95) vs a cold kernel start
P2  trivial step (`x = 1`) through the server's /ws vs raw jupyter_client execute (reply + idle)
P3  trivial step through the local client (no server) vs the same raw execute
P6  32 concurrent sessions x 200 trivial steps: lost/duplicated outputs, steps/s, server RSS

The server runs as a real `python -m kernel_env serve` subprocess on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from jupyter_client import AsyncKernelManager
from websockets.asyncio.client import ClientConnection, connect

from kernel_env import AsyncKernelEnv
from kernel_env.kernel import LocalKernel
from kernel_env.server.metrics import process_rss

MiB = 1024 * 1024


# -- helpers --------------------------------------------------------------------------------


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a sandboxed kernel runs under two bwrap processes)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _die_with_parent() -> None:
    """In the server child: get SIGTERM if this benchmark dies (killed by a timeout, say), so
    no server is left behind. Linux only; elsewhere the server must be stopped by hand."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """`python -m kernel_env serve` on a free port, with stderr in a temporary file.
    ``launcher``: what runs the CLI instead of ``-m kernel_env`` (``-c CODE``, say)."""

    def __init__(self, *args: str, launcher: tuple[str, ...] = ("-m", "kernel_env")) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
        cmd = [
            sys.executable,
            *launcher,
            "serve",
            "--port",
            "0",
            "--log-level",
            "warning",
            *args,
        ]
        with open(self.log, "wb") as sink:
            self.process = subprocess.Popen(
                cmd, stdout=sink, stderr=sink, preexec_fn=_die_with_parent
            )
        self.url = self._wait_url()
        self.ws = self.url.replace("http", "ws", 1) + "/ws"

    def _wait_url(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = re.search(r"serving (http://[\d.]+:\d+)", self.log.read_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(self.log.read_text())

    async def metrics(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:
            data: dict[str, Any] = (await client.get(f"{self.url}/metrics", timeout=10)).json()
            return data

    async def wait_pool_full(self, size: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = await self.metrics()
            if m["pool_warm"] >= size and m["pool_starting"] == 0:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the pool never filled")

    def rss(self) -> int:
        return process_rss(self.process.pid) or 0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.unlink(missing_ok=True)


async def settle(coro: Awaitable[Any], what: str, seconds: float = 10) -> None:
    """Await a cleanup, but never hang the benchmark on it (a stuck kernel shutdown is
    reported; its process exits with this one: ipykernel polls its parent)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        print(f"   warning: {what} did not finish within {seconds:.0f} s", flush=True)


async def ws_request(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await ws.recv())
    if reply["type"] == "error":
        raise RuntimeError(reply["data"])
    return reply


class RawKernel:
    """A plain ipykernel (IPC, like ours) driven through jupyter_client, nothing else."""

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="bench-raw-")
        self.km = AsyncKernelManager(transport="ipc", connection_file=f"{self._dir}/k.json")
        await self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)

    async def execute(self, code: str) -> None:
        """Execute and wait for both the execute_reply and the iopub idle of this request."""
        msg_id = self.kc.execute(code)
        while True:
            msg = await self.kc.get_shell_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id:
                break
        while True:
            msg = await self.kc.get_iopub_msg(timeout=30)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                return

    async def stop(self) -> None:
        self.kc.stop_channels()
        await self.km.shutdown_kernel(now=True)


async def timed(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return samples


async def interleaved(
    a: Callable[[], Awaitable[Any]], b: Callable[[], Awaitable[Any]], n: int, block: int = 50
) -> tuple[list[float], list[float]]:
    """n samples of each, alternating in blocks, so drift on a shared box hits both alike."""
    await timed(a, 20)  # warm up both paths
    await timed(b, 20)
    sa: list[float] = []
    sb: list[float] = []
    while len(sa) < n:
        sa += await timed(a, block)
        sb += await timed(b, block)
    return sa[:n], sb[:n]


# -- the measurements ----------------------------------------------------------------------


async def p1(server: Server, rounds: int, pool: int) -> dict[str, Any]:
    cold = []
    for _ in range(5):
        kernel = LocalKernel()
        t0 = time.perf_counter()
        await kernel.start()
        cold.append(time.perf_counter() - t0)
        await settle(kernel.shutdown(), "a cold kernel's shutdown")
    resets: list[float] = []
    for _ in range(rounds):
        await server.wait_pool_full(pool)
        sockets = [await connect(server.ws) for _ in range(8)]
        for ws in sockets:  # in turn, one after the other
            t0 = time.perf_counter()
            await ws_request(ws, {"type": "reset", "data": {"context": "hello " * 100}})
            resets.append(time.perf_counter() - t0)
        for ws in sockets:
            await ws.close()
    cold_p50 = statistics.median(cold)
    return {
        "reset_p50": statistics.median(resets),
        "reset_p95": pct(resets, 0.95),
        "cold_p50": cold_p50,
        "ratio": statistics.median(resets) / cold_p50,
        "n": len(resets),
    }


async def p2(server: Server, n: int) -> dict[str, Any]:
    raw = RawKernel()
    await raw.start()
    async with connect(server.ws) as ws:
        await ws_request(ws, {"type": "reset", "data": {"max_iterations": 100_000}})
        frame = {"type": "step", "data": {"code": "x = 1"}}
        via_ws, via_raw = await interleaved(
            lambda: ws_request(ws, frame), lambda: raw.execute("x = 1"), n
        )
    await raw.stop()
    return {
        "ws_p50": statistics.median(via_ws),
        "raw_p50": statistics.median(via_raw),
        "ratio": statistics.median(via_ws) / statistics.median(via_raw),
        "n": n,
    }


async def p3(n: int) -> dict[str, Any]:
    raw = RawKernel()
    await raw.start()
    env = AsyncKernelEnv()
    try:
        await env.reset(max_iterations=100_000)
        local, via_raw = await interleaved(
            lambda: env.execute("x = 1"), lambda: raw.execute("x = 1"), n
        )
    finally:
        await settle(env.close(), "the local client's close")
    await raw.stop()
    return {
        "local_p50": statistics.median(local),
        "raw_p50": statistics.median(via_raw),
        "ratio": statistics.median(local) / statistics.median(via_raw),
        "n": n,
    }


async def p6(server: Server, sessions: int, steps: int) -> dict[str, Any]:
    rss_before = server.rss()
    sockets = await asyncio.gather(*(connect(server.ws) for _ in range(sessions)))
    await asyncio.gather(
        *(
            ws_request(ws, {"type": "reset", "data": {"max_iterations": steps + 10}})
            for ws in sockets
        )
    )
    lost = duplicated = misrouted = 0

    async def run(tag: int, ws: ClientConnection) -> None:
        nonlocal lost, duplicated, misrouted
        for i in range(steps):
            reply = await ws_request(
                ws, {"type": "step", "data": {"code": f"x = {i}\nprint('{tag}:{i}')"}}
            )
            out = reply["data"]["observation"]["result"]["stdout"]
            expected = f"{tag}:{i}\n"
            if out == expected:
                continue
            if out == "":
                lost += 1
            elif out.count(expected) > 1:
                duplicated += 1
            else:
                misrouted += 1

    kernels = descendants(server.process.pid)
    cpu0 = (cpu_seconds(server.process.pid), sum(map(cpu_seconds, kernels)), time.process_time())
    t0 = time.perf_counter()
    await asyncio.gather(*(run(tag, ws) for tag, ws in enumerate(sockets)))
    elapsed = time.perf_counter() - t0
    cpu1 = (cpu_seconds(server.process.pid), sum(map(cpu_seconds, kernels)), time.process_time())
    rss_peak = server.rss()
    for ws in sockets:
        await ws.close()
    m = await server.metrics()
    return {
        "steps": sessions * steps,
        "elapsed": elapsed,
        "rate": sessions * steps / elapsed,
        "lost": lost,
        "duplicated": duplicated,
        "misrouted": misrouted,
        "rss_before": rss_before,
        "rss_after": rss_peak,
        "server_lost_outputs": m["lost_outputs"],
        "late_outputs": m["late_outputs"],
        # CPU per step: where a CPU-bound run spends its two cores
        "cpu_server": (cpu1[0] - cpu0[0]) / (sessions * steps),
        "cpu_kernels": (cpu1[1] - cpu0[1]) / (sessions * steps),
        "cpu_client": (cpu1[2] - cpu0[2]) / (sessions * steps),
    }


# -- main -----------------------------------------------------------------------------------


async def bounded(coro: Awaitable[Any], seconds: float, label: str) -> Any:
    """Run one phase; if it hangs, say so and go on (asyncio.wait: no wait on cancellation)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        print(f"{label}: did not finish within {seconds:.0f} s", flush=True)
        return None
    return task.result()


def report_p1(r: dict[str, Any]) -> str:
    return (
        f"P1 pooled reset, 8 sessions in turn (n={r['n']}): p50 {ms(r['reset_p50'])}, "
        f"p95 {ms(r['reset_p95'])}; cold kernel start p50 {ms(r['cold_p50'])}; "
        f"reset/cold = {r['ratio']:.1%}   [target p50<=25 ms, p95<=100 ms, <=5%]"
    )


def report_p2(r: dict[str, Any]) -> str:
    return (
        f"P2 step via /ws (n={r['n']}): p50 {ms(r['ws_p50'])} vs raw jupyter_client "
        f"{ms(r['raw_p50'])} = {r['ratio']:.2f}x   [target <=1.3x]"
    )


def report_p3(r: dict[str, Any]) -> str:
    return (
        f"P3 step via local client (n={r['n']}): p50 {ms(r['local_p50'])} vs raw "
        f"{ms(r['raw_p50'])} = {r['ratio']:.2f}x   [target <=1.15x]"
    )


def report_p6(r: dict[str, Any], sessions: int, steps: int) -> str:
    return (
        f"P6 {sessions} sessions x {steps} steps: {r['steps']} steps in {r['elapsed']:.1f} s "
        f"= {r['rate']:.0f} steps/s; lost {r['lost']}, duplicated {r['duplicated']}, "
        f"misrouted {r['misrouted']} (server lost_outputs {r['server_lost_outputs']}); "
        f"server RSS {r['rss_before'] / MiB:.0f} -> {r['rss_after'] / MiB:.0f} MiB "
        f"(+{(r['rss_after'] - r['rss_before']) / MiB:.0f})   "
        f"[target 0 lost, >=250 steps/s, <=+150 MB]\n"
        f"   CPU per step: server {ms(r['cpu_server'])}, kernels {ms(r['cpu_kernels'])}, "
        f"this client {ms(r['cpu_client'])}, on {os.cpu_count()} cores"
    )


async def main(args: argparse.Namespace) -> None:
    print(f"kernel_env server benchmarks ({'quick' if args.quick else 'full'} run)\n", flush=True)
    server = Server("--pool-size", str(args.pool), "--max-sessions", str(args.sessions + 8))
    try:
        phases: list[tuple[str, Awaitable[Any], Callable[[Any], str]]] = [
            ("P1", p1(server, args.rounds, args.pool), report_p1),
            ("P2", p2(server, args.steps), report_p2),
            ("P3", p3(args.steps), report_p3),
            (
                "P6",
                p6_after_refill(server, args),
                lambda r: report_p6(r, args.sessions, args.p6_steps),
            ),
        ]
        for label, phase, report in phases:
            result = await bounded(phase, 300, label)
            if result is not None:
                print(report(result), flush=True)
    finally:
        server.stop()


async def p6_after_refill(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    await server.wait_pool_full(args.pool)
    return await p6(server, args.sessions, args.p6_steps)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    parser.add_argument("--pool", type=int, default=8, help="server pool size (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="P1 rounds of 8 resets")
    parser.add_argument("--steps", type=int, default=400, help="P2/P3 samples per path")
    parser.add_argument("--sessions", type=int, default=32, help="P6 sessions")
    parser.add_argument("--p6-steps", type=int, default=200, help="P6 steps per session")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sessions, args.p6_steps = 2, 100, 8, 50
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
