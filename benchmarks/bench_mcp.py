"""An MCP tool call beside a ``/ws`` step, for the same small cell, on one server.

    python benchmarks/bench_mcp.py            # ~1.5 minutes on 2 cores
    python benchmarks/bench_mcp.py --quick    # fewer samples, for a smoke run

ws step       ``{"type": "step", "data": {"code": CELL}}`` on an open ``/ws`` (bench_server's P2;
              the ``websockets`` client, about 0.3 ms a round trip of its own here)
mcp POST      ``tools/call`` of ``add_and_execute_code_cell`` as a ``POST /mcp`` written by hand
              on one keep-alive connection (:class:`Bare`, the session's ``Mcp-Session-Id``):
              the door's cost, with as little of a client's as a WebSocket frame has
mcp httpx     the same request through httpx (keep-alive): what that client library adds
mcp SDK       the same call through the official ``mcp`` SDK's streamable-HTTP client
              (``ClientSession.call_tool``): what an MCP client pays in all
POST /step    OpenEnv's HTTP step of the same cell (httpx, keep-alive)
ping          MCP's ``ping`` as ``mcp POST`` sends it: an HTTP request's own cost, no kernel
mcp POST h11, ping h11
              where httptools is installed (uvicorn's ``http="auto"`` then parses with it),
              the same two on a second server whose uvicorn cannot import it, so parses
              with h11 (pure Python)

Each path has an episode of its own on a ``kernel-env serve`` subprocess (loopback, sandboxed
kernels); samples alternate in blocks of 50, so drift on a shared machine hits every path
alike. Which parser each server runs is read from its memory map (httptools' extension
loaded or not). The ratio printed is each path's p50 over the ``/ws`` step's (goal: the
door's POST within 1.2x).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
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


Post = Callable[[bytes, dict[str, str]], Awaitable[tuple[dict[str, str], bytes]]]


class Bare:
    """HTTP/1.1 on one keep-alive connection, written by hand: a status line, headers and
    ``Content-Length`` read, nothing else, so what a request costs beyond this is the
    server's (an HTTP client library adds its own: httpx about 1 ms a request here)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        lines = ["POST /mcp HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await self.writer.drain()
        status = await self.reader.readline()
        found: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            found[name.strip().lower()] = value.strip()
        answer = await self.reader.readexactly(int(found.get("content-length", "0")))
        if status.split()[1] != b"200":
            raise RuntimeError(f"{status!r}: {answer[:200]!r}")
        return found, answer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def httpx_post(client: httpx.AsyncClient) -> Post:
    async def post(body: bytes, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
        response = await client.post("/mcp", content=body, headers=headers)
        response.raise_for_status()
        return {k.lower(): v for k, v in response.headers.items()}, response.content

    return post


class RawMcp:
    """An MCP session spoken to with plain POSTs: one JSON body, one JSON answer."""

    def __init__(self, post: Post) -> None:
        self.send, self.next_id = post, 0
        self.headers = {"Accept": "application/json"}

    async def post(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        headers, content = await self.send(json.dumps(body).encode(), self.headers)
        if "mcp-session-id" in headers:
            self.headers["Mcp-Session-Id"] = headers["mcp-session-id"]
        answer: dict[str, Any] = json.loads(content)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["result"]  # type: ignore[no-any-return]

    async def initialize(self) -> None:
        capabilities = {"extensions": {EPISODE: {"max_iterations": ITERATIONS}}}
        client = {"name": "bench", "version": "0"}
        params = {"protocolVersion": "2025-06-18", "capabilities": capabilities}
        await self.post("initialize", {**params, "clientInfo": client})
        await self.cell("x = 0")

    async def cell(self, code: str = CELL) -> None:
        arguments = {"name": "add_and_execute_code_cell", "arguments": {"code": code}}
        result = await self.post("tools/call", arguments)
        if result["isError"]:
            raise RuntimeError(result)

    async def ping(self) -> None:
        await self.post("ping", {})


H11_ONLY = (
    "-c",
    "import sys; sys.modules['httptools'] = None\n"  # uvicorn's "auto" then takes h11
    "from kernel_env.cli import main; raise SystemExit(main())",
)


def http_parser(server: Server) -> str:
    """The HTTP parser ``server``'s uvicorn runs: httptools' extension is mapped, or not."""
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    return "httptools" if "httptools" in maps else "h11"


async def http_step(http: httpx.AsyncClient) -> Callable[[], Awaitable[None]]:
    """OpenEnv's ``POST /step`` of the cell, on an episode of its own."""
    reset = await http.post("/reset", json={"max_iterations": ITERATIONS})
    reset.raise_for_status()
    headers = {"X-Session-Id": reset.headers["X-Session-Id"]}

    async def step(code: str = CELL) -> None:
        body = {"action": {"code": code}}
        (await http.post("/step", json=body, headers=headers)).raise_for_status()

    await step("x = 0")
    return step


async def measure(server: Server, h11: Server | None, n: int) -> dict[str, list[float]]:
    bare, bare_h11 = Bare(server.url), Bare(h11.url) if h11 is not None else None
    async with (
        connect(server.ws) as ws,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
        httpx2.AsyncClient(timeout=60) as sdk_http,
        streamable_http_client(f"{server.url}/mcp", http_client=sdk_http) as (read, write),
        ClientSession(read, write, extensions={EPISODE: {"max_iterations": ITERATIONS}}) as sdk,
    ):
        await ws_request(ws, {"type": "reset", "data": {"max_iterations": ITERATIONS}})
        await ws_request(ws, {"type": "step", "data": {"code": "x = 0"}})
        mcp, mcp_httpx = RawMcp(bare.post), RawMcp(httpx_post(http))
        await mcp.initialize()
        await mcp_httpx.initialize()
        await sdk.initialize()
        await sdk.call_tool("add_and_execute_code_cell", {"code": "x = 0"})
        frame = {"type": "step", "data": {"code": CELL}}

        async def sdk_cell() -> None:
            result = await sdk.call_tool("add_and_execute_code_cell", {"code": CELL})
            if result.is_error:
                raise RuntimeError(result)

        paths: dict[str, Callable[[], Awaitable[Any]]] = {
            "ws step": lambda: ws_request(ws, frame),
            "mcp POST": mcp.cell,
            "mcp httpx": mcp_httpx.cell,
            "mcp SDK": sdk_cell,
            "POST /step": await http_step(http),
            "ping": mcp.ping,
        }
        if bare_h11 is not None:
            mcp_h11 = RawMcp(bare_h11.post)
            await mcp_h11.initialize()
            paths |= {"mcp POST h11": mcp_h11.cell, "ping h11": mcp_h11.ping}
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            await timed(fn, 20)  # warm up every path
        while len(samples["ws step"]) < n:
            for name, fn in paths.items():
                samples[name] += await timed(fn, BLOCK)
        for client in (bare, bare_h11):
            if client is not None:
                await client.close()
        return {name: found[:n] for name, found in samples.items()}


async def main(args: argparse.Namespace) -> None:
    n = 100 if args.quick else 500
    servers = [Server("--pool-size", "3")]
    if importlib.util.find_spec("httptools") is not None:  # else both would parse with h11
        servers.append(Server("--pool-size", "1", launcher=H11_ONLY))
    try:
        for server, size in zip(servers, (3, 1), strict=False):
            await server.wait_pool_full(size)
        parsers = [http_parser(server) for server in servers]
        samples = await measure(servers[0], servers[1] if len(servers) > 1 else None, n)
    finally:
        for server in servers:
            server.stop()
    base = statistics.median(samples["ws step"])
    print(f"cell {CELL!r}, {n} samples a path; HTTP parsed by {parsers[0]}", end="")
    if len(parsers) > 1:
        print(f", and by {parsers[1]} on a second server (the rows marked h11)\n")
    else:
        print(" (httptools is not installed: no h11 rows to compare)\n")
    print(f"{'path':<13} {'p50':>9} {'p95':>9} {'p50 / ws step':>14}")
    for name, found in samples.items():
        p50 = statistics.median(found)
        print(f"{name:<13} {ms(p50):>9} {ms(pct(found, 0.95)):>9} {p50 / base:>13.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 samples a path (smoke run)")
    asyncio.run(main(parser.parse_args()))
