"""The Jupyter door's execute against the server's /ws step and raw jupyter_client, one run.

    python benchmarks/bench_jupyter.py            # ~1 minute on 2 cores
    python benchmarks/bench_jupyter.py --quick    # fewer samples, for a smoke run

The same trivial cell (`x = 1`) three ways, in alternating blocks so drift on a shared box hits
each alike: an `execute_request` over `WS /api/kernels/{id}/channels` until its reply and its
idle came (what JupyterLab waits for), a `step` frame over `/ws` until its observation, and a
plain ipykernel driven by jupyter_client (reply and idle). Goal: the door's p50 within 1.3x
/ws's. The server is a real `python -m kernel_env serve` subprocess on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from bench_server import RawKernel, Server, ms, pct, timed, ws_request
from websockets.asyncio.client import ClientConnection, connect

CODE = "x = 1"


async def door_execute(ws: ClientConnection, code: str) -> None:
    """One execute_request over the door's channels: until its execute_reply and its idle."""
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "session": "bench",
              "username": "bench", "date": "", "version": "5.3"}  # fmt: skip
    content = {"code": code, "silent": False, "store_history": True}
    await ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {},
                              "content": content, "channel": "shell"}))  # fmt: skip
    replied = idle = False
    while not (replied and idle):
        msg = json.loads(await ws.recv())
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["channel"] == "shell" and msg["msg_type"] == "execute_reply":
            replied = True
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = True


async def rotated(paths: dict[str, Callable[[], Awaitable[Any]]], n: int, block: int = 50):
    """n samples of each path, taken in turn in blocks of ``block`` after a warm-up."""
    for path in paths.values():
        await timed(path, 20)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    while min(len(s) for s in samples.values()) < n:
        for name, path in paths.items():
            samples[name] += await timed(path, block)
    return {name: s[:n] for name, s in samples.items()}


async def measure(server: Server, n: int) -> dict[str, list[float]]:
    raw = RawKernel()
    await raw.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=90) as http:
        started = await http.post("/api/kernels", json={"name": "python3"})
        started.raise_for_status()
        kernel_id = started.json()["id"]
        channels = server.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
        try:
            async with connect(server.ws) as episode, connect(channels) as door:
                await ws_request(episode, {"type": "reset", "data": {"max_iterations": 100_000}})
                step = {"type": "step", "data": {"code": CODE}}
                return await rotated(
                    {
                        "jupyter door": lambda: door_execute(door, CODE),
                        "/ws step": lambda: ws_request(episode, step),
                        "raw jupyter_client": lambda: raw.execute(CODE),
                    },
                    n,
                )
        finally:
            await http.delete(f"/api/kernels/{kernel_id}")
            await raw.stop()


def report(samples: dict[str, list[float]]) -> str:
    ws_p50 = statistics.median(samples["/ws step"])
    lines = [f"{'path':<20} {'p50':>9} {'p95':>9}  vs /ws"]
    for name, s in samples.items():
        p50 = statistics.median(s)
        lines.append(f"{name:<20} {ms(p50):>9} {ms(pct(s, 0.95)):>9}  {p50 / ws_p50:.2f}x")
    door = statistics.median(samples["jupyter door"]) / ws_p50
    lines.append(f"goal: the door within 1.3x /ws: {'met' if door <= 1.3 else 'NOT met'}")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    server = Server("--pool-size", "2", "--episodes", "none")
    try:
        samples = await measure(server, args.n)
    finally:
        server.stop()
    print(f"{CODE!r}, {args.n} samples per path, interleaved in blocks of 50")
    print(report(samples))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 samples per path, not 500")
    args = parser.parse_args(argv)
    args.n = 100 if args.quick else 500
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
