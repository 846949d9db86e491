"""DSPy's ``CodeInterpreter`` on a kernel_env kernel: ``dspy.RLM`` and ``dspy.CodeAct`` run their
code in a real, persistent IPython kernel (CPython, any package, sandboxed where bubblewrap
works) instead of Deno + Pyodide. ::

    import dspy
    from kernel_env.integrations.dspy import KernelInterpreter

    rlm = dspy.RLM("context -> answer", interpreter_factory=KernelInterpreter)
    # or for every module: dspy.configure(interpreter_factory=KernelInterpreter)

Tools (DSPy's ``llm_query``, ``llm_query_batched``, and the user's) stay on the host: the kernel
gets stubs that ask over the Jupyter stdin channel (see :mod:`kernel_env.inkernel.dspy`), so
no credential or host callable enters the kernel. DSPy's interpreter callbacks (``callbacks=`` and
``dspy.settings.callbacks``) see each start, execute, tool call and shutdown. Needs
``pip install 'kernel-env[dspy]'``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import keyword
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput
from dspy.utils.callback import BaseCallback, with_callbacks

from kernel_env.environment import KernelSource
from kernel_env.inkernel.contract import (
    DSPY_MODULE,
    DSPY_MODULE_EXPRESSION,
    DSPY_OUTCOME_EXPRESSION,
    DSPY_TOOL_TAG,
)
from kernel_env.kernel import ExecutionResult, Kernel
from kernel_env.kernel.base import StdinHandler
from kernel_env.observation import json_expression

__all__ = ["KernelInterpreter"]

T = TypeVar("T")

_EOF = "\x04"  # the kernel's input() raises EOFError
_LOAD = f"import {DSPY_MODULE}"
_RESERVED = frozenset({"SUBMIT", "__builtins__"})
# Variables up to this size (their JSON) are pasted into the preparing cell; larger ones are
# staged in a file the kernel reads (a long literal costs IPython's cell transforms seconds a
# MiB).
_INLINE_BYTES = 64 * 1024
# How long preparing a run may take: a base, and time to read and parse the staged JSON.
_PREPARE_SECONDS = 30.0
_PREPARE_BYTES_PER_SECOND = 8 * 2**20
_STAGED = ".kernel_env_dspy_variables.json"
_RECURSIVE = (
    "KernelInterpreter cannot execute recursively from one of its tools (nor run two "
    "executions at once)"
)
_SYNTAX = {"SyntaxError", "IndentationError", "TabError"}
_ASK_OUTCOME: dict[str, Any] = {
    "silent": True,
    "timeout": 30.0,
    "user_expressions": {"outcome": DSPY_OUTCOME_EXPRESSION},
}


class KernelInterpreter:
    """A persistent kernel_env kernel behind DSPy's interpreter protocol.

    ``kernel_source``: where the kernel comes from (default: a local kernel, sandboxed where
    bubblewrap works; any kernel source whose kernels can import kernel_env, a gateway's with
    the ``kernel_env`` kernel spec included). ``execution_timeout``: seconds a cell may run
    before it is interrupted (the kernel keeps its state) or, if it ignores that, restarted
    (then the session ends with :class:`CodeInterpreterError`). ``max_variables_bytes``: the
    largest JSON of one call's ``variables`` (larger ones are refused before anything is sent;
    ``None``: no bound). ``callbacks``: DSPy callbacks of this instance, besides those of
    ``dspy.settings``.
    """

    execution_instructions = (
        "Code runs in a persistent IPython kernel (real CPython). State, imports and functions "
        "persist for this session; a bare last expression is shown. Host tools and SUBMIT are "
        "global functions; tool arguments and results must be JSON-compatible."
    )

    def __init__(
        self,
        tools: dict[str, Callable[..., Any]] | None = None,
        output_fields: list[dict[str, Any]] | None = None,
        *,
        kernel_source: KernelSource | None = None,
        execution_timeout: float | None = 120.0,
        max_variables_bytes: int | None = 512 * 2**20,
        callbacks: list[BaseCallback] | None = None,
    ) -> None:
        _check_tool_names(tools or {})
        _check_output_fields(output_fields)
        self.tools: dict[str, Callable[..., Any]] = dict(tools or {})
        self.output_fields = output_fields
        self.execution_timeout = execution_timeout
        self.max_variables_bytes = max_variables_bytes
        self.callbacks: list[BaseCallback] = list(callbacks or [])
        self._kernel_source = kernel_source
        self._kernel: Kernel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ended: str | None = None  # why the session ended
        self._active = threading.Lock()  # held by the execute in flight

    # -- the protocol ---------------------------------------------------------------------

    @with_callbacks
    def start(self) -> None:
        """Start the kernel (idempotent)."""
        if self._ended is not None:
            raise CodeInterpreterError(f"this interpreter's session has ended ({self._ended})")
        if self._kernel is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kernel-env-dspy", daemon=True
        )
        self._thread.start()
        try:
            self._kernel = self._run(self._start_kernel())
        except BaseException:
            self._stop_loop()
            raise

    @with_callbacks
    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        """Run ``code``: a :class:`FinalOutput` if it called SUBMIT; else the value of a bare
        last expression (itself if it is JSON, else its ``repr``), else the output text (or
        None). Errors in the code raise :class:`CodeExecutionError` (``SyntaxError`` for
        syntax); a call from one of this interpreter's own tools fails at once."""
        if not self._active.acquire(blocking=False):
            raise CodeInterpreterError(_RECURSIVE)
        try:
            if not isinstance(code, str):
                raise CodeInterpreterError("code must be a string")
            _check_tool_names(self.tools)
            _check_output_fields(self.output_fields)
            payload = _payload(self.tools, self.output_fields, variables or {})
            if self.max_variables_bytes is not None and len(payload) > self.max_variables_bytes:
                raise CodeInterpreterError(
                    f"the variables' JSON is {len(payload)} bytes, more than this interpreter's "
                    f"max_variables_bytes ({self.max_variables_bytes}); nothing was sent"
                )
            if self._ended is not None or self._kernel is None:
                self.start()  # raises once the session has ended
            return self._run(self._execute(code, payload))
        finally:
            self._active.release()

    @with_callbacks
    def invoke_tool(self, tool_name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Call one of the host tools (in a worker thread; an async tool is run to its end)."""
        if tool_name not in self.tools:
            raise CodeInterpreterError(f"Unknown tool: {tool_name}")
        result = self.tools[tool_name](*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.run(_awaited(result))
        return result

    @with_callbacks
    def shutdown(self) -> None:
        """Shut the kernel down; the interpreter cannot be used again."""
        self._ended = self._ended or "it was shut down"
        kernel, self._kernel = self._kernel, None
        if kernel is not None and self._loop is not None:
            self._run(kernel.shutdown())
        self._stop_loop()

    def __call__(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        return self.execute(code, variables)

    def __enter__(self) -> KernelInterpreter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- on the loop thread ---------------------------------------------------------------

    async def _start_kernel(self) -> Kernel:
        if self._kernel_source is None:
            from kernel_env.kernel.factory import local_source

            self._kernel_source = local_source()
        kernel = await self._kernel_source()
        loaded = await kernel.execute(_LOAD, silent=True, timeout=30.0)
        if not loaded.success:
            await kernel.shutdown()
            raise CodeInterpreterError(f"the kernel cannot load {DSPY_MODULE}: {_error(loaded)}")
        return kernel

    async def _execute(self, code: str, payload: bytes) -> Any:
        kernel = self._kernel
        if kernel is None:
            raise CodeInterpreterError("the interpreter is not started")
        prepared = await self._prepare(kernel, payload)
        if not prepared.success:
            self._check_kept(prepared, "while the run was prepared")
            raise CodeInterpreterError(f"preparing the kernel failed: {_error(prepared)}")
        ran = await kernel.execute(
            code,
            timeout=self.execution_timeout,
            stdin=self._tool_handler(),
            user_expressions={"outcome": DSPY_OUTCOME_EXPRESSION},
        )
        self._check_kept(ran, "")
        # ipykernel evaluates user_expressions only after a cell that succeeded; SUBMIT ends
        # its cell with an exception, so the outcome is then asked for separately.
        outcome = _outcome(ran)
        if outcome is None and not ran.success:
            outcome = _outcome(await kernel.execute("", **_ASK_OUTCOME))
        if outcome and outcome.get("submitted"):
            return FinalOutput(outcome.get("value"))
        return self._result(ran, outcome or {})

    async def _prepare(self, kernel: Kernel, payload: bytes) -> ExecutionResult:
        """Bind the tools and SUBMIT and inject the variables: small ones pasted, large ones
        staged in a file the kernel reads (as kernel_env stages a long context)."""
        timeout = _PREPARE_SECONDS + len(payload) / _PREPARE_BYTES_PER_SECOND
        if len(payload) <= _INLINE_BYTES:
            call = f"prepare({json.dumps(payload.decode('utf-8'))})"
        else:
            try:
                path = await kernel.stage_file(_STAGED, payload)
            except OSError as exc:
                raise CodeInterpreterError(
                    f"the variables could not be staged for the kernel: {exc.strerror}"
                ) from None
            call = f"prepare_file({json.dumps(path)})"
        return await kernel.execute(
            f"{DSPY_MODULE_EXPRESSION}.{call}", silent=True, timeout=timeout
        )

    def _check_kept(self, ran: ExecutionResult, when: str) -> None:
        """A restarted kernel lost the session: it ends here (DSPy's protocol: a lost session
        is terminal, never silently replaced)."""
        if ran.restarted:
            self._ended = f"the kernel was restarted ({ran.status}) {when}".rstrip()
            raise CodeInterpreterError(f"{self._ended}; the session's state is lost")

    def _result(self, ran: ExecutionResult, outcome: dict[str, Any]) -> Any:
        if ran.status == "timeout":
            raise CodeExecutionError(
                f"TimeoutError: the code ran longer than {self.execution_timeout:g} s and was "
                "interrupted (variables from earlier runs are kept)"
            )
        if ran.error is not None:
            name, value = str(ran.error.get("ename")), str(ran.error.get("evalue"))
            if name in _SYNTAX:
                raise SyntaxError(value)
            raise CodeExecutionError(f"{name}: {value}")
        if outcome.get("value") is not None:
            return outcome["value"]
        return ran.stdout.rstrip("\n") or None

    def _tool_handler(self) -> StdinHandler:
        tools = set(self.tools)

        async def answer(prompt: str) -> str:
            if not prompt.startswith(DSPY_TOOL_TAG):
                return _EOF  # input() and friends: nobody is there to type
            try:
                request = json.loads(prompt[len(DSPY_TOOL_TAG) :])
                name = request["name"]
                if name not in tools:
                    raise CodeInterpreterError(f"Unknown tool: {name}")
                value = await asyncio.to_thread(
                    self.invoke_tool, name, request.get("args") or [], request.get("kwargs") or {}
                )
                return json.dumps({"ok": True, "value": value}, allow_nan=False)
            except Exception as exc:
                return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        return answer

    # -- plumbing -------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise CodeInterpreterError("the interpreter is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not loop.is_running():
            loop.close()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _check_tool_names(tools: dict[str, Any]) -> None:
    invalid = [name for name in tools if not _identifier(name) or name in _RESERVED]
    if invalid:
        raise ValueError(
            f"tool names must be non-reserved Python identifiers; invalid names: {invalid!r}"
        )


def _check_output_fields(output_fields: list[dict[str, Any]] | None) -> None:
    if output_fields is None:
        return
    names = [field.get("name") if isinstance(field, dict) else None for field in output_fields]
    if not all(_identifier(name) for name in names):
        raise ValueError("output field names must be non-keyword Python identifiers")
    if len(names) != len(set(names)):
        raise ValueError("output field names must be unique")
    try:
        json.dumps(output_fields, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"output fields must be JSON-compatible: {exc}") from exc


def _identifier(name: object) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def _payload(
    tools: dict[str, Callable[..., Any]],
    output_fields: list[dict[str, Any]] | None,
    variables: dict[str, Any],
) -> bytes:
    """The JSON for the kernel's ``prepare`` (:mod:`kernel_env.inkernel.dspy`), encoded."""
    if not isinstance(variables, dict):
        raise CodeInterpreterError("variables must map Python identifiers to JSON values")
    invalid = [
        name for name in variables if not _identifier(name) or name in _RESERVED or name in tools
    ]
    if invalid:
        raise CodeInterpreterError(
            "variable names must be non-reserved Python identifiers distinct from tool names; "
            f"invalid names: {invalid!r}"
        )
    payload = {"tools": list(tools), "output_fields": output_fields, "variables": variables}
    try:
        return json.dumps(payload, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodeInterpreterError(f"variables must be JSON-compatible: {exc}") from exc


def _outcome(ran: ExecutionResult) -> dict[str, Any] | None:
    return json_expression(ran.user_expressions.get("outcome"))


def _error(ran: ExecutionResult) -> str:
    if ran.error:
        return f"{ran.error.get('ename')}: {ran.error.get('evalue')}"
    return ran.stderr.strip()[-500:] or ran.status
