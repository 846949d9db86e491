"""A kernel with no process: it answers each ``execute_request`` from a table of cells.

It speaks to the driver (:mod:`.base`) in the messages an episode kernel sends its host: the
iopub welcome, each cell's outputs and ``idle`` status, its ``execute_reply`` with the
``user_expressions`` kernel_env's extension evaluates (the episode's state, a variable
looked up), and ``input_request``\\ s on stdin, ``llm_query``'s among them. So the driver and
the episode (:class:`kernel_env.environment.KernelEnvironment`, its host calls, final
answers, the timeout ladder, a kernel that dies) run in-process, in milliseconds, with no
kernel to start. Like httpx's ``MockTransport``, it ships with the package for users' tests::

    source = ScriptedSource({"1 + 1": Cell(result="2"), "FINAL('4')": Cell(final="4")})
    env = KernelEnvironment(kernel_source=source)  # source.kernels: those it started

A code string missing from the table raises ``NameError`` in the kernel, as undefined code
would. It runs nothing else: what a cell does is what its :class:`Cell` says.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kernel_env.errors import KernelError
from kernel_env.inkernel.contract import REQUEST_TAG, SETUP_METADATA, STATE_EXPRESSION
from kernel_env.kernel.base import Kernel

__all__ = ["Cell", "ScriptedKernel", "ScriptedSource"]

_EOF = "\x04"  # the host's answer to an input() it does not serve
_LOOKUP = re.compile(r"\.lookup\((?P<name>.+)\)$")


@dataclass(frozen=True)
class Cell:
    """What the kernel does for one code string, in this order: ask the host (``asks`` as
    plain ``input()`` prompts, raising ``EOFError`` on an end-of-file answer, then
    ``llm_query`` for each of ``queries``, printing each answer), run ``seconds``, print
    ``stdout`` and ``stderr``, show ``result`` (a bare last expression's text), then raise
    ``error`` (``(ename, evalue)``) or not. After it the namespace holds ``variables`` (name
    -> ``str()`` of the value, for ``FINAL_VAR``), ``answer`` if given, and ``final`` if
    ``FINAL(...)`` was called.

    ``ignores_interrupt``: the cell runs on through an interrupt (C code holding the GIL);
    ``dies``: the kernel's process exits once the cell has printed."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: tuple[str, str] | None = None
    asks: Sequence[str] = ()
    queries: Sequence[str] = ()
    seconds: float = 0.0
    ignores_interrupt: bool = False
    dies: bool = False
    final: str | None = None
    answer: Mapping[str, Any] | None = None
    variables: Mapping[str, str] = field(default_factory=dict)


class ScriptedKernel(Kernel):
    """A :class:`Kernel` that plays :class:`Cell`\\ s, in-process (see the module)."""

    def __init__(
        self,
        cells: Mapping[str, Cell] | None = None,
        *,
        liveness_interval: float = 0.05,
        **kwargs: Any,
    ) -> None:
        super().__init__(liveness_interval=liveness_interval, **kwargs)
        self.kernel_id = f"scripted-{uuid.uuid4().hex[:8]}"
        self.cells = dict(cells or {})
        self.executed: list[str] = []  # every code string run (silent ones included)
        self.replies: list[str] = []  # every input_reply value the host sent
        self.staged: dict[str, bytes] = {}
        self.interrupts = 0
        self.launches = 0
        self._alive = False
        self._closed = True  # no channels: not started, or shut down
        self._running: asyncio.Task[None] | None = None
        self._ignoring = False  # the running cell ignores interrupts
        self._stdin: asyncio.Queue[str] = asyncio.Queue()
        self._namespace: dict[str, str] = {}
        self._answer: dict[str, Any] = {}
        self._final: str | None = None
        self._setup: str | None = None
        self._count = 0
        # What an episode kernel does: welcome its iopub subscriber, ask again on stdin.
        self._stdin_waits_for_the_host = True
        self._welcomes_subscribers = True
        self.quiet_iopub = True

    # -- transport hooks ------------------------------------------------------------------

    async def _launch(self) -> None:
        self.launches += 1
        self._alive, self._closed = True, False
        self._stdin = asyncio.Queue()
        self._namespace, self._answer, self._final, self._setup = {}, {}, None, None
        self._count = 0
        self._publish("iopub", "iopub_welcome", {"subscription": ""}, None)

    async def _relaunch(self) -> None:
        self._alive = False  # the old process's cell says nothing more
        await self._stop_running()
        await self._launch()

    async def _terminate(self) -> None:
        self._alive, self._closed = False, True
        await self._stop_running()

    async def is_alive(self) -> bool:
        return self._alive

    async def interrupt(self) -> None:
        self.interrupts += 1
        running = self._running
        if running is not None and not running.done() and not self._ignoring:
            running.cancel()

    async def stage_file(self, name: str, data: bytes) -> str:
        self.staged[name] = data
        return f"scripted://{name}"

    def _send(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        parent: dict | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        if self._closed:
            raise KernelError(f"the kernel's {channel} channel is closed", kernel_id=self.kernel_id)
        msg = _message(msg_type, content, None, metadata)
        if not self._alive:
            return str(msg["header"]["msg_id"])  # lost, as on a dead kernel's socket
        if channel == "stdin" and msg_type == "input_reply":
            self._stdin.put_nowait(str(content.get("value", "")))
        elif msg_type == "kernel_info_request":
            self._publish("shell", "kernel_info_reply", {"status": "ok"}, msg)
        elif msg_type == "execute_request":
            self._running = asyncio.ensure_future(self._execute(msg))
        return str(msg["header"]["msg_id"])

    # -- the cell -------------------------------------------------------------------------

    async def _execute(self, request: dict[str, Any]) -> None:
        content = request["content"]
        code = str(content.get("code", ""))
        self.executed.append(code)
        self._take_setup(request.get("metadata") or {})
        cell = Cell() if not code.strip() else self.cells.get(code)
        silent = bool(content.get("silent"))
        if not silent:
            self._count += 1
        status, error = "ok", None
        try:
            if cell is None:
                error = ("NameError", f"the scripted kernel has no cell for {code[:80]!r}")
            else:
                error = await self._play(cell, request)
        except asyncio.CancelledError:
            if not self._alive:
                raise
            error = ("KeyboardInterrupt", "")
        if error is not None:
            status = "error"
            ename, evalue = error
            shown = {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}
            self._publish("iopub", "error", shown, request)
        expressions = {
            name: self._evaluate(expression)
            for name, expression in (content.get("user_expressions") or {}).items()
        }
        reply = {
            "status": status,
            "execution_count": self._count,
            "user_expressions": expressions,
        }
        if error is not None:
            reply.update(ename=error[0], evalue=error[1], traceback=[])
        self._publish("shell", "execute_reply", reply, request)
        self._publish("iopub", "status", {"execution_state": "idle"}, request)

    async def _play(self, cell: Cell, request: dict[str, Any]) -> tuple[str, str] | None:
        """Run ``cell``'s steps; the error it raises, if any."""
        for prompt in cell.asks:
            if await self._ask(prompt, request) == _EOF:
                return ("EOFError", "EOF when reading a line")
        for prompt in cell.queries:
            request_text = REQUEST_TAG + json.dumps({"op": "llm_query", "args": {"prompt": prompt}})
            reply = json.loads(await self._ask(request_text, request))
            if not reply.get("ok"):
                return ("HostCallError", str(reply.get("error")))
            self._stream("stdout", f"{reply.get('result')}\n", request)
        if cell.seconds:
            self._ignoring = cell.ignores_interrupt
            try:
                await asyncio.sleep(cell.seconds)
            finally:
                self._ignoring = False
        if cell.stdout:
            self._stream("stdout", cell.stdout, request)
        if cell.stderr:
            self._stream("stderr", cell.stderr, request)
        if cell.dies:
            self._alive = False
            await asyncio.Event().wait()  # a dead process sends nothing more
        if cell.result is not None:
            content = {
                "execution_count": self._count,
                "data": {"text/plain": cell.result},
                "metadata": {},
            }
            self._publish("iopub", "execute_result", content, request)
        self._namespace.update(cell.variables)
        if cell.answer is not None:
            self._answer = dict(cell.answer)
        if cell.final is not None:
            self._final = cell.final
        return cell.error

    async def _ask(self, prompt: str, request: dict[str, Any]) -> str:
        self._publish("stdin", "input_request", {"prompt": prompt, "password": False}, request)
        reply = await self._stdin.get()
        self.replies.append(reply)
        return reply

    def _stream(self, name: str, text: str, request: dict[str, Any]) -> None:
        self._publish("iopub", "stream", {"name": name, "text": text}, request)

    def _take_setup(self, metadata: Mapping[str, Any]) -> None:
        carried = metadata.get(SETUP_METADATA)
        if not isinstance(carried, str):
            return
        params = json.loads(carried)
        if params.get("token") == self._setup:
            return
        self._setup = params.get("token")
        context = params.get("context")
        if "context_path" in params:
            staged = self.staged.get(str(params["context_path"]).removeprefix("scripted://"))
            context = staged.decode("utf-8") if staged is not None else None
        self._namespace["context"] = context or ""
        self._answer, self._final = {"content": "", "ready": False}, None

    def _evaluate(self, expression: str) -> dict[str, Any]:
        """A user expression's result, for the expressions kernel_env's host sends."""
        if expression == STATE_EXPRESSION:
            return _text(self._state())
        lookup = _LOOKUP.search(expression)
        if lookup is not None:
            name = ast.literal_eval(lookup.group("name"))
            found = name in self._namespace
            return _text({"found": found, "value": self._namespace.get(name)})
        return {"status": "error", "ename": "NameError", "evalue": expression, "traceback": []}

    def _state(self) -> dict[str, Any]:
        names = sorted({"answer", *self._namespace})
        state = {
            "final": self._final,
            "answer": {
                "content": str(self._answer.get("content", "")),
                "ready": bool(self._answer.get("ready")),
            },
            "names": names,
            "snapshot": {k: v for k, v in self._namespace.items() if k != "context"},
            "restored": [],
            "setup": self._setup,
        }
        self._final = None
        return state

    # -- plumbing -------------------------------------------------------------------------

    def _publish(
        self, channel: str, msg_type: str, content: dict[str, Any], parent: dict[str, Any] | None
    ) -> None:
        """Hand a message from the kernel to the driver, as a channel reader would: on a
        later turn of the event loop."""
        msg = _message(msg_type, content, parent)
        asyncio.get_running_loop().call_soon(self._deliver, channel, msg)

    async def _stop_running(self) -> None:
        running, self._running = self._running, None
        if running is not None and not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


def _message(
    msg_type: str,
    content: dict[str, Any],
    parent: dict[str, Any] | None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "date": datetime.now(UTC).isoformat(),
            "version": "5.3",
        },
        "parent_header": dict(parent["header"]) if parent is not None else {},
        "metadata": dict(metadata or {}),
        "content": content,
        "buffers": [],
    }


def _text(payload: dict[str, Any]) -> dict[str, Any]:
    """A user expression's result as kernel_env's extension gives it: JSON as text/plain."""
    return {"status": "ok", "data": {"text/plain": json.dumps(payload)}, "metadata": {}}


class ScriptedSource:
    """A kernel source (:data:`kernel_env.kernel.KernelSource`) of scripted kernels: a new,
    started :class:`ScriptedKernel` playing ``cells`` for each call, each kept in
    ``kernels``."""

    def __init__(self, cells: Mapping[str, Cell] | None = None, **options: Any) -> None:
        self.cells = dict(cells or {})
        self.options = options
        self.kernels: list[ScriptedKernel] = []

    async def __call__(self) -> Kernel:
        kernel = ScriptedKernel(self.cells, **self.options)
        await kernel.start()
        self.kernels.append(kernel)
        return kernel
