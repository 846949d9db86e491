"""close() racing a call on another thread or task: the call ends promptly with a clear
``ClientClosed`` (a ``RuntimeError``), in either order, and no kernel or thread is left behind
(issue 15, item 2)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kernel_env import AsyncKernelEnv, ClientClosed, KernelEnv

pytestmark = pytest.mark.integration  # kernels, servers or other processes

BOUND = 20.0  # seconds: "promptly" with room for a loaded 2-core machine
LONG_CELL = "import time\nfor _ in range(600): time.sleep(0.1)"


def _in_thread(fn: object) -> tuple[threading.Thread, list[BaseException | object]]:
    """Runs ``fn`` on a non-daemon thread (as a user's would be); collects its outcome."""
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(fn())  # type: ignore[operator]
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_close_while_execute_runs_ends_the_execute() -> None:
    """execute() in flight on another thread, then close(): the execute raises ClientClosed,
    close() returns, the kernel is gone."""
    env = KernelEnv(step_timeout=60)
    env.reset()
    kernel = env.environment.kernel if env.environment else None
    thread, outcome = _in_thread(lambda: env.execute(LONG_CELL))
    time.sleep(1.0)  # let the cell start (a later close is the other order's test)
    env.close()
    thread.join(BOUND)
    assert not thread.is_alive(), "the in-flight execute never returned"
    assert len(outcome) == 1 and isinstance(outcome[0], ClientClosed), outcome
    assert isinstance(outcome[0], RuntimeError)
    assert kernel is not None and not kernel.started


def test_close_before_execute_is_a_clear_error() -> None:
    """close() first, then execute() on another thread: ClientClosed at once, no hang."""
    env = KernelEnv()
    env.reset()
    env.close()
    thread, outcome = _in_thread(lambda: env.execute("1"))
    thread.join(BOUND)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ClientClosed), outcome


def test_close_racing_many_calls_never_hangs() -> None:
    """Calls started around a close() all return or raise ClientClosed; none hangs."""
    env = KernelEnv(step_timeout=60)
    env.reset()
    threads = [_in_thread(lambda: env.execute("import time; time.sleep(0.2)")) for _ in range(4)]
    env.close()
    late = [_in_thread(lambda: env.execute("1")) for _ in range(2)]
    for thread, outcome in threads + late:
        thread.join(BOUND)
        assert not thread.is_alive()
        assert len(outcome) == 1
        assert isinstance(outcome[0], ClientClosed) or hasattr(outcome[0], "observation")


async def test_async_close_while_step_runs() -> None:
    """AsyncKernelEnv: close() from another task ends the in-flight step with ClientClosed;
    the task that awaited the step is not itself cancelled."""
    env = AsyncKernelEnv(step_timeout=60)
    await env.reset()
    step = asyncio.ensure_future(env.execute(LONG_CELL))
    await asyncio.sleep(1.0)
    await asyncio.wait_for(env.close(), BOUND)
    with pytest.raises(ClientClosed):
        await asyncio.wait_for(step, BOUND)
    with pytest.raises(ClientClosed):
        await env.execute("1")
