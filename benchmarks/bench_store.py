"""The episode store's cost (``kernel-env serve --episodes DIR``), store on against store off,
side by side in one run, and its listing of 10,000 stored episodes.

    python benchmarks/bench_store.py            # ~1-2 minutes on 2 cores
    python benchmarks/bench_store.py --quick    # fewer samples, for a smoke run

P2   one session's trivial step (`x = 1`) over /ws, p50: a server with the store on against
     one with it off, alternating in blocks of 50 steps (both servers run throughout)
P6L  several sessions at once (8 by default), each stepping `x = i; print(i)` back to back:
     the step's p50 and the steps/s of all, store on against off, in alternating rounds
LIST GET /episodes of a store holding 10,000 episodes (rows written through the store's own
     index API before its server starts): the first page, and pages filtered by task text,
     reward, done and kernel, p50 of 20 requests each (client-side, HTTP included)

The store-on server keeps its episodes in a temporary directory that already holds the
10,000 rows, as a training run's store would; the store-off server runs `--episodes none`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_server import Server, interleaved, ms, pct, ws_request
from websockets.asyncio.client import ClientConnection, connect

from kernel_env.server.index import Index
from kernel_env.server.store import INDEX_NAME

STEP = {"type": "step", "data": {"code": "x = 1"}}
LISTINGS = {
    "first page (100)": {},
    "task text": {"task": "task 4242"},
    "reward >= 0.5, done": {"reward_min": 0.5, "done": "true"},
    "kernel, 1000 a page": {"kernel": "python3", "limit": 1000},
}


def fill(directory: Path, n: int) -> float:
    """``n`` ended episodes' rows in the store's index; the seconds it took."""
    index = Index(directory / INDEX_NAME)
    now = time.time()
    t0 = time.perf_counter()
    try:
        for i in range(n):
            index.insert(
                {
                    "episode_id": f"bench-{i:05d}",
                    "session_id": f"s{i}",
                    "tenant": "default",
                    "kernel": "python3",
                    "task": f"task {i}: add the numbers in the context",
                    "steps": 3,
                    "reward": (i % 4) / 4,
                    "final_answer": str(i),
                    "done": 1,
                    "state": "done",
                    "started": now - (n - i),
                    "ended": now - (n - i) + 1,
                    "path": f"episodes/{i}-bench/bench-{i:05d}.ipynb",
                    "size": 4000,
                    "server": "bench",
                }
            )
    finally:
        index.close()
    return time.perf_counter() - t0


async def p2(on: Server, off: Server, n: int) -> dict[str, Any]:
    async with connect(on.ws) as ws_on, connect(off.ws) as ws_off:
        for ws in (ws_on, ws_off):
            await ws_request(ws, {"type": "reset", "data": {"max_iterations": 100_000}})
        with_store, without = await interleaved(
            lambda: ws_request(ws_on, STEP), lambda: ws_request(ws_off, STEP), n
        )
    return {
        "on": statistics.median(with_store),
        "off": statistics.median(without),
        "on_p95": pct(with_store, 0.95),
        "off_p95": pct(without, 0.95),
        "n": n,
    }


async def _round(sockets: list[ClientConnection], steps: int) -> tuple[list[float], float]:
    samples: list[float] = []

    async def run(ws: ClientConnection) -> None:
        for i in range(steps):
            t0 = time.perf_counter()
            await ws_request(ws, {"type": "step", "data": {"code": f"x = {i}\nprint(x)"}})
            samples.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(ws) for ws in sockets))
    return samples, len(sockets) * steps / (time.perf_counter() - t0)


async def p6l(on: Server, off: Server, sessions: int, steps: int, rounds: int) -> dict[str, Any]:
    found: dict[str, dict[str, list[float]]] = {
        "on": {"samples": [], "rates": []},
        "off": {"samples": [], "rates": []},
    }
    opened = {
        name: [await connect(server.ws) for _ in range(sessions)]
        for name, server in (("on", on), ("off", off))
    }
    try:
        for sockets in opened.values():
            reset = {"type": "reset", "data": {"max_iterations": steps * rounds + 20}}
            await asyncio.gather(*(ws_request(ws, reset) for ws in sockets))
            await _round(sockets, 10)  # warm up
        for _ in range(rounds):
            for name in ("off", "on"):
                samples, rate = await _round(opened[name], steps)
                found[name]["samples"] += samples
                found[name]["rates"].append(rate)
    finally:
        for sockets in opened.values():
            for ws in sockets:
                await ws.close()
    return {
        name: {
            "p50": statistics.median(f["samples"]),
            "p95": pct(f["samples"], 0.95),
            "rate": statistics.median(f["rates"]),
        }
        for name, f in found.items()
    } | {"n": sessions * steps * rounds}


async def listings(server: Server, times: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        # The first read waits in the store's worker for the episodes that just ended (P2's
        # and P6L's sessions, closed): their notebooks written, retention run.
        t0 = time.perf_counter()
        (await client.get("/episodes")).raise_for_status()
        found["first"] = [time.perf_counter() - t0]
        for label, params in LISTINGS.items():
            samples = []
            for _ in range(times):
                t0 = time.perf_counter()
                reply = await client.get("/episodes", params=params)
                samples.append(time.perf_counter() - t0)
                reply.raise_for_status()
            found[label] = samples
            found[label + " rows"] = [float(len(reply.json()["episodes"]))]
    return found


async def main(args: argparse.Namespace) -> None:
    print(f"kernel_env episode store benchmarks ({'quick' if args.quick else 'full'} run)\n")
    directory = Path(tempfile.mkdtemp(prefix="bench-store-"))
    took = fill(directory, args.stored)
    print(f"{args.stored} rows written through Index.insert in {took:.1f} s", flush=True)
    pool = str(args.sessions + 2)
    on = Server("--pool-size", pool, "--episodes", str(directory))
    off = Server("--pool-size", pool, "--episodes", "none")
    try:
        for server in (on, off):
            await server.wait_pool_full(int(pool))
        r = await p2(on, off, args.steps)
        print(
            f"P2 step via /ws (n={r['n']} each): store on p50 {ms(r['on'])} (p95 "
            f"{ms(r['on_p95'])}), off {ms(r['off'])} (p95 {ms(r['off_p95'])}); "
            f"on/off = {r['on'] / r['off']:.3f}   [goal <= 1.05]",
            flush=True,
        )
        r = await p6l(on, off, args.sessions, args.p6_steps, args.rounds)
        print(
            f"P6L {args.sessions} sessions at once ({r['n']} steps each way, {args.rounds} "
            f"alternating rounds): step p50 on {ms(r['on']['p50'])}, off {ms(r['off']['p50'])} "
            f"= {r['on']['p50'] / r['off']['p50']:.3f}; p95 on {ms(r['on']['p95'])}, off "
            f"{ms(r['off']['p95'])}; steps/s on {r['on']['rate']:.0f}, off "
            f"{r['off']['rate']:.0f} = {r['on']['rate'] / r['off']['rate']:.3f}   "
            "[goal p50 <= 1.05]",
            flush=True,
        )
        found = await listings(on, args.list_times)
        print(
            f"LIST the first read, after {args.sessions + 1} episodes ended: "
            f"{ms(found['first'][0])}"
        )
        for label in LISTINGS:
            rows = int(found[label + " rows"][0])
            print(
                f"LIST {label}: {rows} rows, p50 {ms(statistics.median(found[label]))}, "
                f"max {ms(max(found[label]))}   [goal <= 100 ms]"
            )
    finally:
        on.stop()
        off.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    parser.add_argument("--steps", type=int, default=400, help="P2 samples per server")
    parser.add_argument("--sessions", type=int, default=8, help="P6L sessions per server")
    parser.add_argument("--p6-steps", type=int, default=50, help="P6L steps a session a round")
    parser.add_argument("--rounds", type=int, default=4, help="P6L rounds per server")
    parser.add_argument("--stored", type=int, default=10_000, help="rows in the listed store")
    parser.add_argument("--list-times", type=int, default=20, help="requests per listing")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.sessions, args.p6_steps, args.rounds = 100, 4, 20, 2
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
