"""The kernel driver (kernel_env/kernel/base.py), against a scripted in-process kernel: the
quick tier's reach into readiness, completion, stdin, the timeout ladder and a dead kernel.
The same behaviours against real ipykernel processes are in tests/test_kernel.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernel_env.errors import KernelError
from kernel_env.kernel import Cell, ScriptedKernel


async def test_a_cell_completes_with_its_outputs_and_reply() -> None:
    """stdout, stderr, a bare last expression and the execution count come back, in order."""
    cells = {"x": Cell(stdout="out\n", stderr="err\n", result="42")}
    async with ScriptedKernel(cells) as kernel:
        result = await kernel.execute("x")
        assert result.status == "ok" and result.success
        assert (result.stdout, result.stderr, result.execution_count) == ("out\n42\n", "err\n", 1)
        assert [o["output_type"] for o in result.outputs] == ["stream", "stream", "execute_result"]
        assert result.outputs[-1]["data"] == {"text/plain": "42"}


async def test_an_error_in_the_code_is_data_not_an_exception() -> None:
    """A cell that raises gives status "error" and the error's name and value."""
    async with ScriptedKernel({"1/0": Cell(error=("ZeroDivisionError", "division by zero"))}) as k:
        result = await k.execute("1/0")
        assert result.status == "error" and not result.success
        assert result.error is not None and result.error["ename"] == "ZeroDivisionError"
        unknown = await k.execute("never scripted")
        assert unknown.error is not None and unknown.error["ename"] == "NameError"


async def test_stdin_requests_go_to_the_handler_and_eof_without_one() -> None:
    """Each input_request of the running cell is answered by the handler; with no handler
    the kernel gets end-of-file (its input() raises EOFError) instead of waiting forever."""
    prompts: list[str] = []

    async def handler(prompt: str) -> str:
        prompts.append(prompt)
        return f"answer to {prompt}"

    async with ScriptedKernel({"ask": Cell(asks=["a?", "b?"], stdout="done\n")}) as kernel:
        result = await kernel.execute("ask", stdin=handler)
        assert (result.status, result.stdout, prompts) == ("ok", "done\n", ["a?", "b?"])
        assert kernel.replies == ["answer to a?", "answer to b?"]
        unanswered = await kernel.execute("ask")
        assert unanswered.error is not None and unanswered.error["ename"] == "EOFError"


async def test_a_failing_stdin_handler_answers_eof() -> None:
    """A handler that raises is logged and the kernel gets end-of-file: the step ends."""

    async def broken(prompt: str) -> str:
        raise RuntimeError("boom")

    async with ScriptedKernel({"ask": Cell(asks=["?"])}) as kernel:
        result = await kernel.execute("ask", stdin=broken, timeout=5)
        assert result.error is not None and result.error["ename"] == "EOFError"


async def test_a_timeout_interrupts_and_the_kernel_keeps_its_state() -> None:
    """A cell past its timeout is interrupted; it ends with KeyboardInterrupt, the kernel is
    not restarted, and the next cell runs in the same kernel."""
    cells = {"sleep": Cell(seconds=30), "x": Cell(result="1")}
    async with ScriptedKernel(cells) as kernel:
        result = await kernel.execute("sleep", timeout=0.1)
        assert (result.status, result.interrupted, result.restarted) == ("timeout", True, False)
        assert result.error is not None and result.error["ename"] == "KeyboardInterrupt"
        assert (kernel.interrupts, kernel.restarts, kernel.launches) == (1, 0, 1)
        assert (await kernel.execute("x")).success


async def test_a_cell_that_ignores_the_interrupt_is_ended_by_a_restart() -> None:
    """Past the interrupt's grace, the kernel is restarted and the result says so."""
    cells = {"spin": Cell(seconds=30, ignores_interrupt=True), "x": Cell(result="1")}
    async with ScriptedKernel(cells, interrupt_grace=0.1) as kernel:
        result = await kernel.execute("spin", timeout=0.1)
        assert (result.status, result.interrupted, result.restarted) == ("timeout", False, True)
        assert (kernel.restarts, kernel.launches) == (1, 2)
        assert (await kernel.execute("x")).success


async def test_a_dead_kernel_is_seen_at_once_and_restarted() -> None:
    """A kernel whose process exits mid-cell is seen by the liveness watcher, long before
    the step's timeout; the output it printed is kept, and the kernel is restarted."""
    cells = {"crash": Cell(stdout="last words\n", dies=True), "x": Cell(result="1")}
    async with ScriptedKernel(cells) as kernel:
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await kernel.execute("crash", timeout=30)
        assert loop.time() - started < 5
        assert (result.status, result.restarted, result.stdout) == ("died", True, "last words\n")
        assert (await kernel.execute("x")).success


async def test_late_output_of_another_cell_never_lands_in_this_one() -> None:
    """An output whose parent is not the running cell is kept aside (late_outputs)."""
    async with ScriptedKernel({"x": Cell(stdout="mine\n")}) as kernel:
        stray = {
            "header": {"msg_type": "stream", "msg_id": "m"},
            "parent_header": {"msg_id": "an earlier cell"},
            "content": {"name": "stdout", "text": "late\n"},
        }
        asyncio.get_running_loop().call_soon(kernel._deliver, "iopub", stray)
        result = await kernel.execute("x")
        assert result.stdout == "mine\n"
        assert kernel.late_output_count == 1


async def test_outputs_stream_to_a_listener_as_they_arrive() -> None:
    """on_output gets each output event; a listener that raises stops getting them, and the
    step's outputs are collected anyway."""
    events: list[dict] = []
    async with ScriptedKernel({"x": Cell(stdout="a\n", stderr="b\n")}) as kernel:
        await kernel.execute("x", on_output=events.append)
        assert [e.get("name") for e in events] == ["stdout", "stderr"]

        def broken(event: dict) -> None:
            raise RuntimeError("listener")

        assert (await kernel.execute("x", on_output=broken)).stdout == "a\n"


async def test_a_closed_kernel_refuses_to_send() -> None:
    """Shutdown is idempotent; executing on a shut-down kernel raises KernelError at once."""
    kernel = ScriptedKernel({"x": Cell()})
    await kernel.start()
    await kernel.shutdown()
    await kernel.shutdown()
    assert not await kernel.is_alive()
    with pytest.raises(KernelError):
        await kernel.execute("x", timeout=1)


class _LateSubscriber(ScriptedKernel):
    """A kernel ready by its kernel_info reply alone (R's, Deno's), whose iopub our
    subscription reaches only after its first ``late`` kernel_info requests: what it
    published for those is lost, as a publisher drops what it sends before a subscriber
    joins (a Deno kernel slow to come up, on a cold disk)."""

    def __init__(self, late: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stdin_waits_for_the_host = self._welcomes_subscribers = False
        self._stdin_probe = None
        self.late, self.asked = late, 0

    def _publish(self, channel: str, msg_type: str, *args: Any) -> None:
        if msg_type != "iopub_welcome":  # this kernel sends none
            super()._publish(channel, msg_type, *args)

    def _send(
        self, channel: str, msg_type: str, content: dict[str, Any], *args: Any, **kw: Any
    ) -> str:
        msg_id = super()._send(channel, msg_type, content, *args, **kw)
        if msg_type == "kernel_info_request":
            self.asked += 1
            if self.asked > self.late:  # the subscription has arrived
                self._publish("iopub", "status", {"execution_state": "idle"}, None)
        return msg_id


async def test_a_kernel_whose_iopub_subscription_came_late_is_asked_until_it_shows() -> None:
    """Readiness by kernel_info (no welcome, no probe) waits for a message on iopub too; a
    kernel that answered on shell before our subscription reached its iopub is asked again
    until iopub shows one, instead of waiting out the ready timeout for a message that only
    a request would bring."""
    kernel = _LateSubscriber(late=3, ready_timeout=3)
    await kernel.start()
    try:
        assert kernel.asked > 3
        assert (await kernel.execute("x")).status == "error"  # unscripted: a NameError
    finally:
        await kernel.shutdown()
