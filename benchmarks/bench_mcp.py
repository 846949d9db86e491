"""An MCP tool call beside a ``/ws`` step, for the same small cell, on one server.

    python benchmarks/bench_mcp.py            # ~1 minute on 2 cores
    python benchmarks/bench_mcp.py --quick    # fewer samples, for a smoke run

ws step       ``{"type": "step", "data": {"code": CELL}}`` on an open ``/ws`` (bench_server's P2)
mcp POST      ``tools/call`` of ``add_and_execute_code_cell`` as a raw ``POST /mcp`` (httpx,
              one keep-alive connection, the session's ``Mcp-Session-Id``): the door's cost
mcp SDK       the same call through the official ``mcp`` SDK's streamable-HTTP client
              (``ClientSession.call_tool``): what an MCP client pays in all
POST /step    OpenEnv's HTTP step of the same cell (httpx, keep-alive): HTTP's own cost,
              beside which the MCP door's is its own

Each path has an episode of its own on one ``kernel-env serve`` subprocess (loopback, pool
of 4, sandboxed kernels); samples alternate in blocks of 50, so drift on a shared machine
hits every path alike. The ratio printed is each path's p50 over the ``/ws`` step's (goal: the
door's POST within 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import httpx2
from bench_server import Server, ms, pct, timed, ws_request
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from websockets.asyncio.client import connect

CELL = "x = x + 1"
EPISODE = "io.github.kernel-env/episode"
ITERATIONS = 100_000  # no path runs out of steps
BLOCK = 50


class RawMcp:
    """An MCP session spoken to with plain POSTs: one JSON body, one JSON answer."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.headers, self.next_id = client, {"Accept": "application/json"}, 0

    async def post(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        response = await self.client.post("/mcp", content=json.dumps(body), headers=self.headers)
        response.raise_for_status()
        sid = response.headers.get("Mcp-Session-Id")
        if sid:
            self.headers["Mcp-Session-Id"] = sid
        answer: dict[str, Any] = response.json()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["result"]  # type: ignore[no-any-return]

    async def initialize(self) -> None:
        capabilities = {"extensions": {EPISODE: {"max_iterations": ITERATIONS}}}
        client = {"name": "bench", "version": "0"}
        params = {"protocolVersion": "2025-06-18", "capabilities": capabilities}
        await self.post("initialize", {**params, "clientInfo": client})

    async def cell(self, code: str) -> None:
        arguments = {"name": "add_and_execute_code_cell", "arguments": {"code": code}}
        result = await self.post("tools/call", arguments)
        if result["isError"]:
            raise RuntimeError(result)


async def measure(server: Server, n: int) -> dict[str, list[float]]:
    async with (
        connect(server.ws) as ws,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
        httpx2.AsyncClient(timeout=60) as sdk_http,
        streamable_http_client(f"{server.url}/mcp", http_client=sdk_http) as (read, write),
        ClientSession(read, write, extensions={EPISODE: {"max_iterations": ITERATIONS}}) as sdk,
    ):
        await ws_request(ws, {"type": "reset", "data": {"max_iterations": ITERATIONS}})
        reset = await http.post("/reset", json={"max_iterations": ITERATIONS})
        reset.raise_for_status()
        step_headers = {"X-Session-Id": reset.headers["X-Session-Id"]}
        step_body = {"action": {"code": CELL}}

        async def http_step() -> None:
            (await http.post("/step", json=step_body, headers=step_headers)).raise_for_status()

        raw = RawMcp(http)
        await raw.initialize()
        await sdk.initialize()
        frame = {"type": "step", "data": {"code": CELL}}

        async def sdk_cell() -> None:
            result = await sdk.call_tool("add_and_execute_code_cell", {"code": CELL})
            if result.is_error:
                raise RuntimeError(result)

        paths: dict[str, Callable[[], Awaitable[Any]]] = {
            "ws step": lambda: ws_request(ws, frame),
            "mcp POST": lambda: raw.cell(CELL),
            "mcp SDK": sdk_cell,
            "POST /step": http_step,
        }
        await ws_request(ws, {"type": "step", "data": {"code": "x = 0"}})
        await raw.cell("x = 0")
        await sdk.call_tool("add_and_execute_code_cell", {"code": "x = 0"})
        await http.post("/step", json={"action": {"code": "x = 0"}}, headers=step_headers)
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            await timed(fn, 20)  # warm up every path
        while len(samples["ws step"]) < n:
            for name, fn in paths.items():
                samples[name] += await timed(fn, BLOCK)
        return {name: found[:n] for name, found in samples.items()}


async def main(args: argparse.Namespace) -> None:
    n = 100 if args.quick else 500
    server = Server("--pool-size", "4")
    try:
        await server.wait_pool_full(4)
        samples = await measure(server, n)
    finally:
        server.stop()
    base = statistics.median(samples["ws step"])
    print(f"cell {CELL!r}, {n} samples a path\n")
    print(f"{'path':<10} {'p50':>9} {'p95':>9} {'p50 / ws step':>14}")
    for name, found in samples.items():
        p50 = statistics.median(found)
        print(f"{name:<10} {ms(p50):>9} {ms(pct(found, 0.95)):>9} {p50 / base:>13.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 samples a path (smoke run)")
    asyncio.run(main(parser.parse_args()))
