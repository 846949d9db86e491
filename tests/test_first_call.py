"""A fresh episode's first cell can call ``llm_query`` at once: the kernel's first stdin
request is never lost (issue 15, item 1).

The stdin channel connects on its own, after the shell and iopub channels that readiness used
to check; an ``input_request`` sent before it connected was dropped by the kernel's ROUTER and
the cell waited out the step timeout. Each mode runs a loop of fresh episodes; the soak test
(``pytest -m soak tests/test_first_call.py``) runs 200 per mode.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from fake_openai import FakeOpenAI
from serverkit import small_settings, thread_server

from kernel_env import AsyncKernelEnv, KernelEnv
from kernel_env.kernel import GatewayConfig, Kernel, LocalKernel
from kernel_env.kernel.factory import gateway_source, local_source
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.isolation.sandbox import sandbox_problem

pytestmark = pytest.mark.integration  # kernels, servers or other processes

MODES = ["local", "sandboxed", "ws", "gateway"]
QUICK_EPISODES = 12
SOAK_EPISODES = 200
STEP_TIMEOUT = 10.0  # a lost request shows as a timed-out step, well inside the test timeout
FIRST_CELL = "x = llm_query('hi')\nprint(x)"

EnvFactory = Callable[[], KernelEnv]


@contextlib.contextmanager
def _episodes(mode: str, request: pytest.FixtureRequest) -> Iterator[EnvFactory]:
    """Yields a factory of fresh clients whose kernels come from ``mode``."""
    options: dict[str, Any] = {"llm_query_fn": lambda p: "ok", "step_timeout": STEP_TIMEOUT}
    if mode == "local":
        yield lambda: KernelEnv(kernel_source=local_source("none"), **options)
    elif mode == "sandboxed":
        if sandbox_problem() is not None:
            pytest.skip(f"no sandbox here: {sandbox_problem()}")
        yield lambda: KernelEnv(kernel_source=local_source("bwrap"), **options)
    elif mode == "gateway":
        gw = request.getfixturevalue("gateway")
        source = gateway_source(GatewayConfig(url=gw.url, token=gw.token))
        yield lambda: KernelEnv(kernel_source=source, **options)
    else:  # a served episode over /ws, its model an OpenAI-compatible endpoint
        with FakeOpenAI(lambda body: "ok") as fake:
            settings = small_settings(
                llm_base_url=fake.url, llm_model="m", step_timeout=STEP_TIMEOUT, pool_size=1
            )
            with thread_server(settings) as url:
                yield lambda: KernelEnv(url)


def _run_loop(make_env: EnvFactory, episodes: int) -> list[str]:
    """Runs ``episodes`` fresh episodes; returns a line for each whose first cell failed."""
    failures = []
    for i in range(episodes):
        with make_env() as env:
            env.reset(context="c")
            result = env.execute(FIRST_CELL).observation.result
            if not (result.success and result.stdout == "ok\n"):
                failures.append(f"episode {i}: {result.stdout!r} {result.exception!r}")
    return failures


@pytest.mark.parametrize("mode", MODES)
def test_first_cell_llm_query_answers(mode: str, request: pytest.FixtureRequest) -> None:
    """A loop of fresh episodes: every first-cell llm_query gets its answer."""
    with _episodes(mode, request) as make_env:
        assert _run_loop(make_env, QUICK_EPISODES) == []


@pytest.mark.soak
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", MODES)
def test_first_cell_llm_query_soak(mode: str, request: pytest.FixtureRequest) -> None:
    """200 fresh episodes per mode, 0 lost first calls."""
    with _episodes(mode, request) as make_env:
        assert _run_loop(make_env, SOAK_EPISODES) == []


class _LateStdin(LocalKernel):
    """A kernel whose host connects its stdin socket only half a second after it is ready."""

    def _start_client(self) -> None:
        super()._start_client()
        assert self._client is not None
        stdin = self._client._sockets["stdin"]
        endpoint = stdin.getsockopt(zmq.LAST_ENDPOINT).decode()
        stdin.disconnect(endpoint)
        asyncio.get_running_loop().call_later(0.5, stdin.connect, endpoint)


@pytest.mark.parametrize("forked", [False, True], ids=["cold", "forked"])
async def test_a_first_call_before_stdin_connects_waits_for_it(forked: bool) -> None:
    """The kernel's first input request goes out before the host's stdin socket is there:
    it is refused and asked again, not dropped, and llm_query gets its answer."""
    forkserver = ForkServer() if forked else None

    async def start() -> Kernel:
        kernel = _LateStdin(forkserver=forkserver)
        await kernel.start()
        return kernel

    try:
        async with AsyncKernelEnv(
            kernel_source=start, llm_query_fn=lambda p: "ok", step_timeout=STEP_TIMEOUT
        ) as env:
            await env.reset(context="c")
            assert env.environment is not None and env.environment.kernel is not None
            assert getattr(env.environment.kernel, "forked", False) == forked
            result = (await env.execute(FIRST_CELL)).observation.result
            assert result.success and result.stdout == "ok\n", result
    finally:
        if forkserver is not None:
            await forkserver.close()
