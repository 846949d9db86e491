"""DSPy's ``CodeInterpreter`` on a kernel_env kernel: ``dspy.RLM`` and ``dspy.CodeAct`` run their
code in a real, persistent IPython kernel (CPython, any package, sandboxed where bubblewrap
works) instead of Deno + Pyodide. ::

    import dspy
    from kernel_env.integrations.dspy import KernelInterpreter

    rlm = dspy.RLM("context -> answer", interpreter_factory=KernelInterpreter)
    # or for every module: dspy.configure(interpreter_factory=KernelInterpreter)

Tools (DSPy's ``llm_query``, ``llm_query_batched``, and the user's) stay on the host: the kernel
gets stubs that ask over the Jupyter stdin channel (see :mod:`.dspy_kernel`), so no credential or
host callable enters the kernel. Needs ``pip install 'kernel-env[dspy]'``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dspy.primitives.code_interpreter import CodeExecutionError, CodeInterpreterError, FinalOutput

from kernel_env.environment import KernelSource, _json_expression
from kernel_env.integrations.dspy_kernel import MODULE_NAME, OUTCOME_EXPRESSION, TOOL_TAG
from kernel_env.kernel import ExecutionResult, Kernel
from kernel_env.kernel.base import StdinHandler

__all__ = ["KernelInterpreter"]

T = TypeVar("T")

_EOF = "\x04"  # the kernel's input() raises EOFError
_SIDE = f"__import__('sys').modules[{MODULE_NAME!r}]"
_LOAD = f"import {MODULE_NAME}"
_SYNTAX = {"SyntaxError", "IndentationError", "TabError"}
_ASK_OUTCOME: dict[str, Any] = {
    "silent": True,
    "timeout": 30.0,
    "user_expressions": {"outcome": OUTCOME_EXPRESSION},
}


class KernelInterpreter:
    """A persistent kernel_env kernel behind DSPy's interpreter protocol.

    ``kernel_source``: where the kernel comes from (default: a local kernel, sandboxed where
    bubblewrap works; any kernel source whose kernels can import kernel_env, a gateway's with
    the ``kernel_env`` kernel spec included). ``execution_timeout``: seconds a cell may run
    before it is interrupted (the kernel keeps its state) or, if it ignores that, restarted
    (then the session ends with :class:`CodeInterpreterError`).
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
    ) -> None:
        self.tools: dict[str, Callable[..., Any]] = dict(tools or {})
        self.output_fields = output_fields
        self.execution_timeout = execution_timeout
        self._kernel_source = kernel_source
        self._kernel: Kernel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ended = False

    # -- the protocol ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the kernel (idempotent)."""
        if self._ended:
            raise CodeInterpreterError("this interpreter was shut down; create a new one")
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

    def execute(self, code: str, variables: dict[str, Any] | None = None) -> Any:
        """Run ``code``: a :class:`FinalOutput` if it called SUBMIT, else its output text (or
        None). Errors in the code raise :class:`CodeExecutionError` (``SyntaxError`` for
        syntax)."""
        if not isinstance(code, str):
            raise CodeInterpreterError("code must be a string")
        payload = _payload(self.tools, self.output_fields, variables or {})
        self.start()
        return self._run(self._execute(code, payload))

    def shutdown(self) -> None:
        """Shut the kernel down; the interpreter cannot be used again."""
        self._ended = True
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
            raise CodeInterpreterError(f"the kernel cannot load {MODULE_NAME}: {_error(loaded)}")
        return kernel

    async def _execute(self, code: str, payload: str) -> Any:
        kernel = self._kernel
        if kernel is None:
            raise CodeInterpreterError("the interpreter is not started")
        prepared = await kernel.execute(f"{_SIDE}.prepare({payload})", silent=True, timeout=30.0)
        if not prepared.success:
            raise CodeInterpreterError(f"preparing the kernel failed: {_error(prepared)}")
        ran = await kernel.execute(
            code,
            timeout=self.execution_timeout,
            stdin=self._tool_handler(),
            user_expressions={"outcome": OUTCOME_EXPRESSION},
        )
        # ipykernel evaluates user_expressions only after a cell that succeeded; SUBMIT ends
        # its cell with an exception, so the outcome is then asked for separately.
        outcome = _outcome(ran) or _outcome(await kernel.execute("", **_ASK_OUTCOME))
        if outcome and outcome.get("submitted"):
            return FinalOutput(outcome.get("value"))
        return self._result(ran)

    def _result(self, ran: ExecutionResult) -> Any:
        if ran.restarted:
            # DSPy's protocol: a lost session is terminal, never silently replaced.
            self._ended = True
            raise CodeInterpreterError(
                f"the kernel was restarted ({ran.status}); the session's state is lost"
            )
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
        return ran.stdout.rstrip("\n") or None

    def _tool_handler(self) -> StdinHandler:
        tools = dict(self.tools)

        async def answer(prompt: str) -> str:
            if not prompt.startswith(TOOL_TAG):
                return _EOF  # input() and friends: nobody is there to type
            try:
                request = json.loads(prompt[len(TOOL_TAG) :])
                tool = tools[request["name"]]
                value = await _call_tool(
                    tool, request.get("args") or [], request.get("kwargs") or {}
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


async def _call_tool(tool: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A host tool, off the loop (DSPy's llm_query blocks on the model); async tools awaited."""
    result = await asyncio.to_thread(functools.partial(tool, *args, **kwargs))
    if inspect.isawaitable(result):
        result = await result
    return result


def _payload(
    tools: dict[str, Callable[..., Any]],
    output_fields: list[dict[str, Any]] | None,
    variables: dict[str, Any],
) -> str:
    """The JSON for dspy_kernel.prepare, as a Python string literal."""
    reserved = {"SUBMIT", *tools}
    clash = sorted(name for name in variables if name in reserved or not name.isidentifier())
    if clash:
        raise CodeInterpreterError(f"variable names clash with tools or are invalid: {clash}")
    payload = {"tools": list(tools), "output_fields": output_fields, "variables": variables}
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CodeInterpreterError(f"variables must be JSON-compatible: {exc}") from exc
    return json.dumps(text)


def _outcome(ran: ExecutionResult) -> dict[str, Any] | None:
    return _json_expression(ran.user_expressions.get("outcome"))


def _error(ran: ExecutionResult) -> str:
    if ran.error:
        return f"{ran.error.get('ename')}: {ran.error.get('evalue')}"
    return ran.stderr.strip()[-500:] or ran.status
