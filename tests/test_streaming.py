"""Streaming a running cell's output: local and over `/ws`, in order and complete before the
observation, and a consumer that is slow or never reads does not stall the kernel."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from serverkit import small_settings, thread_server
from websockets.asyncio.client import connect

from kernel_env import KernelEnv
from kernel_env.kernel.factory import local_source
from kernel_env.remote import ws_url

pytestmark = pytest.mark.integration  # kernels, servers or other processes

TICKS = "import time\nfor i in range(4):\n    print(i, flush=True)\n    time.sleep(0.3)\n"
# 20 MB in 20,000 writes, timed inside the kernel: the step must not wait for the consumer.
FLOOD = (
    "import sys, time\nt0 = time.monotonic()\n"
    "for _ in range(20_000):\n    sys.stdout.write('x' * 1000 + '\\n')\n"
    "took = time.monotonic() - t0\n"
)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with thread_server(small_settings(sandbox="none")) as url:
        yield url


def _clients(url: str) -> dict[str, KernelEnv]:
    return {"local": KernelEnv(kernel_source=local_source("none")), "remote": KernelEnv(url)}


@pytest.mark.parametrize("where", ["local", "remote"])
def test_output_arrives_while_the_cell_runs_in_order_and_complete(
    where: str, server_url: str
) -> None:
    events: list[tuple[float, dict[str, Any]]] = []
    with _clients(server_url)[where] as env:
        env.reset()
        start = time.monotonic()
        result = env.run(
            TICKS + "from IPython.display import HTML\ndisplay(HTML('<b>hi</b>'))\n1 / 0",
            on_output=lambda event: events.append((time.monotonic(), event)),
        )
        returned = time.monotonic()
    kinds = [e["output_type"] for _, e in events]
    assert kinds[-2:] == ["display_data", "error"] and set(kinds[:-2]) == {"stream"}
    text = "".join(str(e["text"]) for _, e in events if e["output_type"] == "stream")
    assert text == "0\n1\n2\n3\n" == result.stdout.split("<IPython")[0]
    first = events[0][0]
    assert first - start < returned - start - 0.5  # the first line came long before the end
    assert all(t <= returned for t, _ in events)  # every event before the result


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_slow_consumer_does_not_slow_the_kernel(where: str, server_url: str) -> None:
    """A callback that takes 0.2 s an event: the kernel's 20 MB (1 MB once capped in the
    kernel) take their own time, text is merged, and what won't fit in the buffer is dropped
    with a marker."""
    events: list[dict[str, Any]] = []

    def slow(event: dict[str, Any]) -> None:
        time.sleep(0.2)
        events.append(event)

    with _clients(server_url)[where] as env:
        env.reset()
        result = env.run(FLOOD, on_output=slow)
        took = float(env.run("print(took)").stdout)
    assert result.success and took < 10, took
    delivered = sum(len(str(e.get("text") or "")) for e in events if e["output_type"] == "stream")
    dropped = sum(int(e["bytes"]) for e in events if e["output_type"] == "dropped")
    assert dropped > 0 and 0 < delivered <= 2 << 20
    assert len(events) < 200  # merged, not thousands of calls


def test_a_ws_client_that_never_reads_does_not_stall_the_kernel(server_url: str) -> None:
    async def main() -> tuple[float, list[str]]:
        async with connect(ws_url(server_url), max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "step", "data": {"code": FLOOD}, "stream": True}))
            await asyncio.sleep(4)  # reads nothing while the cell runs
            kinds = []
            while True:
                frame = json.loads(await ws.recv())
                kinds.append(frame["type"])
                if frame["type"] != "output":
                    break
            await ws.send(json.dumps({"type": "step", "data": {"code": "print(took)"}}))
            took = json.loads(await ws.recv())["data"]["observation"]["result"]["stdout"]
            return float(took), kinds

    took, kinds = asyncio.run(main())
    assert took < 4, took  # the kernel did not wait for the reader
    assert kinds[-1] == "observation" and set(kinds[:-1]) == {"output"}


def test_clients_that_do_not_ask_get_todays_frames(server_url: str) -> None:
    async def main() -> list[str]:
        async with connect(ws_url(server_url)) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "step", "data": {"code": TICKS}}))
            return [json.loads(await ws.recv())["type"]]

    assert asyncio.run(main()) == ["observation"]


def test_a_reset_can_ask_for_every_steps_output(server_url: str) -> None:
    async def main() -> list[str]:
        async with connect(ws_url(server_url)) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}, "stream": True}))
            await ws.recv()
            await ws.send(json.dumps({"type": "step", "data": {"code": "print('a')"}}))
            kinds = [json.loads(await ws.recv())["type"]]
            while kinds[-1] == "output":
                kinds.append(json.loads(await ws.recv())["type"])
            return kinds

    assert asyncio.run(main()) == ["output", "observation"]


def test_an_async_callback_is_awaited(server_url: str) -> None:
    from kernel_env import AsyncKernelEnv

    seen: list[str] = []
    loop_thread: list[int] = []

    async def on_output(event: dict[str, Any]) -> None:
        loop_thread.append(threading.get_ident())
        seen.append(str(event.get("text")))

    async def main() -> None:
        async with AsyncKernelEnv(server_url) as env:
            await env.reset()
            await env.run("print('a'); print('b')", on_output=on_output)

    asyncio.run(main())
    assert "".join(seen) == "a\nb\n" and len(set(loop_thread)) == 1
