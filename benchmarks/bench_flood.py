"""Load test S8 (issue 14): 8 sessions flood rich outputs and huge refused prompts while a 9th
steps normally. Reports the 9th session's step latency (quiet vs under flood), the server's
peak RSS, and the largest reply a flooding session got.

    python benchmarks/bench_flood.py             # ~2 minutes on 2 cores
    python benchmarks/bench_flood.py --quick     # ~40 s

The server runs as a real `python -m kernel_env serve` subprocess on a free loopback port,
with the LLM budget at 0 calls (so every llm_query that reaches the host is refused by the
budget, the case that used to keep each 15 MB prompt). With `--max-prompt-chars 16000000` the
15 MB prompts reach the host; by default the kernel refuses them itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx
from bench_server import MiB, Server, cpu_seconds, ms, pct, settle, ws_request
from websockets.asyncio.client import connect

FLOOD = (
    "from IPython.display import HTML, display\n"
    "for _ in range(300):\n"
    "    display(HTML('x' * 999_000))\n"
)
PROMPTS = (
    "for _ in range(3):\n"
    "    try:\n"
    "        llm_query('p' * 15_000_000)\n"
    "    except Exception as exc:\n"
    "        err = str(exc)[:80]\n"
)
# The control: the same 8 sessions busy with plain CPU work and no output, to tell what the
# flood costs the 9th session from what 8 busy kernels on 2 cores cost it anyway.
BUSY = "sum(range(3_000_000))\n"
FLOODERS = 8


async def step_latencies(url: str, stop: asyncio.Event, limit: int) -> list[float]:
    """The 9th session: `x = 1` steps back to back until ``stop`` (or ``limit`` steps)."""
    samples: list[float] = []
    async with connect(url, max_size=None) as ws:
        await ws_request(ws, {"type": "reset", "data": {"max_iterations": 100_000}})
        while not stop.is_set() and len(samples) < limit:
            t0 = time.perf_counter()
            await ws_request(ws, {"type": "step", "data": {"code": "x = 1"}})
            samples.append(time.perf_counter() - t0)
    return samples


async def flooder(url: str, stop: asyncio.Event, sizes: list[int], control: bool) -> None:
    """One greedy session: flood cells and refused 15 MB prompts, alternately (or, for the
    control, plain CPU work)."""
    async with connect(url, max_size=None) as ws:
        await ws_request(ws, {"type": "reset", "data": {"max_iterations": 100_000}})
        n = 0
        while not stop.is_set():
            code = BUSY if control else FLOOD if n % 2 == 0 else PROMPTS
            await ws.send(json.dumps({"type": "step", "data": {"code": code}}))
            reply = await ws.recv()
            sizes.append(len(reply))
            n += 1


async def sample_rss(server: Server, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], server.rss())
        await asyncio.sleep(0.05)


async def health_latencies(server: Server, stop: asyncio.Event) -> list[float]:
    """GET /health every 50 ms: the server's own responsiveness (no kernel involved), to tell
    event-loop stalls from the 9th kernel waiting for a CPU."""
    samples: list[float] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            await client.get("/health")
            samples.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
    return samples


async def run(
    seconds: float, quiet_steps: int, prompt_limit: int | None, control: bool
) -> dict[str, Any]:
    limit = ["--max-prompt-chars", str(prompt_limit)] if prompt_limit else []
    server = Server(
        "--pool-size",
        str(FLOODERS + 2),
        "--max-sessions",
        "16",
        "--llm-base-url",
        "http://127.0.0.1:9/v1",
        "--llm-model",
        "m",
        "--llm-max-calls",
        "0",
        "--step-timeout",
        "60",
        *limit,
    )
    try:
        await server.wait_pool_full(FLOODERS + 2)
        rss_start = server.rss()
        never = asyncio.Event()
        quiet = await step_latencies(server.ws, never, quiet_steps)
        stop, peak, sizes = asyncio.Event(), [rss_start], []
        sampler = asyncio.create_task(sample_rss(server, stop, peak))
        floods = [
            asyncio.create_task(flooder(server.ws, stop, sizes, control)) for _ in range(FLOODERS)
        ]
        await asyncio.sleep(3)  # let the flood start before timing the 9th session
        timer = asyncio.create_task(step_latencies(server.ws, stop, 1 << 30))
        health = asyncio.create_task(health_latencies(server, stop))
        cpu0 = cpu_seconds(server.process.pid)
        await asyncio.sleep(seconds)
        stop.set()
        server_cpu = cpu_seconds(server.process.pid) - cpu0
        loaded = await timer
        await settle(asyncio.gather(*floods, return_exceptions=True), "flooders", 90)
        await settle(sampler, "the RSS sampler")
        metrics = await server.metrics()
        return {
            "quiet": quiet,
            "loaded": loaded,
            "health": await health,
            "seconds": seconds,
            "server_cpu": server_cpu,
            "rss_start": rss_start,
            "rss_peak": peak[0],
            "rss_end": server.rss(),
            "sizes": sizes,
            "metrics": metrics,
        }
    finally:
        server.stop()


def report(r: dict[str, Any]) -> str:
    quiet95, loaded95 = pct(r["quiet"], 0.95), pct(r["loaded"], 0.95)
    sizes = r["sizes"] or [0]
    return "\n".join(
        [
            f"S8 9th session `x = 1`: quiet p50 {ms(pct(r['quiet'], 0.5))}, p95 {ms(quiet95)} "
            f"(n={len(r['quiet'])}); under flood p50 {ms(pct(r['loaded'], 0.5))}, "
            f"p95 {ms(loaded95)} (n={len(r['loaded'])}) = {loaded95 / quiet95:.1f}x quiet p95",
            f"   /health under flood: p50 {ms(pct(r['health'], 0.5))}, p95 "
            f"{ms(pct(r['health'], 0.95))} (n={len(r['health'])}); server CPU "
            f"{r['server_cpu'] / r['seconds'] * 100:.0f}% of one core",
            f"   server RSS {r['rss_start'] / MiB:.0f} MiB at start, "
            f"peak {r['rss_peak'] / MiB:.0f} MiB, {r['rss_end'] / MiB:.0f} MiB at the end   "
            "[bound: peak <= 1024 MiB]",
            f"   {len(r['sizes'])} flood steps; largest reply {max(sizes) / MiB:.1f} MiB; "
            f"server steps {r['metrics']['steps']}, lost_outputs {r['metrics']['lost_outputs']}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter flood, fewer samples")
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="the server's prompt limit (default: its own, 1 M chars, which "
        "refuses the 15 MB prompts in the kernel; 16000000 lets them reach "
        "the host, to be refused there by the budget)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="the 8 sessions do plain CPU work instead of flooding",
    )
    args = parser.parse_args()
    seconds, quiet_steps = (20.0, 100) if args.quick else (60.0, 300)
    result = asyncio.run(run(seconds, quiet_steps, args.max_prompt_chars, args.control))
    print(
        ("control (8 sessions of plain CPU work)\n" if args.control else "") + report(result),
        flush=True,
    )


if __name__ == "__main__":
    main()
