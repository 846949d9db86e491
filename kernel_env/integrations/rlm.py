"""rlm's REPL environment on a kernel_env episode: ``RLM(environment="kernel_env")``. ::

    import kernel_env.integrations.rlm  # adds "kernel_env" to rlm's environments
    from rlm import RLM

    rlm = RLM(backend="openai", backend_kwargs={"model_name": "gpt-4o-mini"},
              environment="kernel_env",
              environment_kwargs={"sandbox": "bwrap", "export_path": "runs/episode.ipynb"})
    print(rlm.completion(long_text).response)

Each ``completion()`` runs in one kernel_env episode: a real IPython kernel (sandboxed by
bubblewrap where it works, from a forkserver or pool if given one, or on a ``kernel-env serve``
server), with kernel_env's ``llm_query``/``llm_query_batched``/``rlm_query`` answered by rlm's own
LM handler (so rlm's usage, budgets and sub-backends hold), rlm's ``answer`` dict ending the run,
and the episode exportable as a notebook. With ``persistent=True`` every completion is an episode
of its own on one kernel, kept until ``RLM.close()``. rlm has no environment registry, so
importing this module adds the name to ``rlm.environments.get_environment`` (and to the
environments rlm lets be persistent). What does not map is listed in
``docs/rlm.md``. Needs ``pip install 'kernel-env[rlm]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import rlm.core.rlm as _rlm_core
import rlm.environments as _rlm_environments
from rlm.core.comms_utils import LMRequest, send_lm_request
from rlm.core.types import REPLResult, RLMChatCompletion
from rlm.environments.base_env import NonIsolatedEnv, extract_tool_value, validate_custom_tools

from kernel_env.client import TOKEN_VARIABLE, KernelEnv
from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.llm import Completion, Messages
from kernel_env.models import MAX_ITERATIONS

__all__ = ["ENVIRONMENT", "KernelREPL", "register"]

ENVIRONMENT = "kernel_env"
# rlm enforces its own iteration limit; the episode's is only a backstop.
_EPISODE_ITERATIONS = MAX_ITERATIONS
_NOT_RUN = "not run: the episode already ended with a final answer"


class _HandlerBackend:
    """kernel_env's LLM backend protocol over rlm's LM handler (its socket protocol), so a
    kernel's ``llm_query`` is one of rlm's sub-calls: counted in rlm's usage, routed by depth
    or by the model a cell names (the handler knows which models it serves)."""

    routes_models = True

    def __init__(self, address: tuple[str, int], depth: int) -> None:
        self.address = address
        self.depth = depth
        self._lock = threading.Lock()
        self._calls: list[RLMChatCompletion] = []

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion:
        prompt: str | Any = messages[0]["content"] if len(messages) == 1 else messages
        request = LMRequest(prompt=prompt, model=model, depth=self.depth)
        response = await asyncio.to_thread(send_lm_request, self.address, request)
        if not response.success or response.chat_completion is None:
            raise RuntimeError(response.error or "rlm's LM handler gave no completion")
        done = response.chat_completion
        with self._lock:
            self._calls.append(done)
        usage = done.usage_summary
        return Completion(
            text=done.response,
            model=done.root_model,
            input_tokens=usage.total_input_tokens,
            output_tokens=usage.total_output_tokens,
            latency=done.execution_time,
            cost=usage.total_cost,
        )

    def take_calls(self) -> list[RLMChatCompletion]:
        with self._lock:
            calls, self._calls = self._calls, []
        return calls

    async def aclose(self) -> None:
        return None


class _KeptKernel:
    """One kernel for every episode of a persistent session: an episode's end leaves it
    running (each gets a view whose ``shutdown`` does nothing) until ``release``."""

    def __init__(self, source: KernelSource) -> None:
        self._source = source
        self.kernel: Kernel | None = None
        self.released = False

    async def __call__(self) -> Kernel:
        if self.kernel is None:
            self.kernel = await self._source()
        return cast(Kernel, _KernelView(self, self.kernel))


class _KernelView:
    """A kept kernel, as one episode sees it."""

    def __init__(self, kept: _KeptKernel, kernel: Kernel) -> None:
        self._kept = kept
        self._kernel = kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)

    async def shutdown(self) -> None:
        if self._kept.released:
            self._kept.kernel = None
            await self._kernel.shutdown()


class KernelREPL(NonIsolatedEnv):
    """rlm's ``BaseEnv`` on a kernel_env episode.

    rlm passes ``lm_handler_address``, ``context_payload``, ``depth``, ``custom_tools``,
    ``persistent`` and ``max_concurrent_subcalls``; the rest come from ``environment_kwargs``:

    - ``sandbox``: ``"auto"`` (default), ``"bwrap"`` or ``"none"``, for a new local kernel;
    - ``kernel_source``: where kernels come from instead (a forkserver's or pool's, a gateway's);
    - ``base_url``: run the episode on a ``kernel-env serve`` server instead; its token in
      ``api_key`` or ``$KERNEL_ENV_TOKEN`` (rlm's logger leaves ``*api*key*`` keys out);
    - ``step_timeout``: seconds a code block may run (default 120); ``max_output_length``;
    - ``export_path``: write the episode as a notebook there when the environment is cleaned up.
    """

    def __init__(
        self,
        lm_handler_address: tuple[str, int] | None = None,
        context_payload: dict[str, Any] | list[Any] | str | None = None,
        setup_code: str | None = None,
        persistent: bool = False,
        depth: int = 1,
        custom_tools: dict[str, Any] | None = None,
        custom_sub_tools: dict[str, Any] | None = None,
        max_concurrent_subcalls: int = 4,
        subcall_fn: Callable[..., Any] | None = None,
        compaction: bool = False,
        *,
        sandbox: str = "auto",
        kernel_source: KernelSource | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        step_timeout: float = 120.0,
        max_output_length: int = 20_000,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            persistent=persistent, depth=depth, max_concurrent_subcalls=max_concurrent_subcalls
        )
        validate_custom_tools(custom_tools)
        self.custom_tools = _data_tools(custom_tools)
        self.lm_handler_address = lm_handler_address
        self.export_path = export_path
        self._backend: _HandlerBackend | None = None
        self._kept: _KeptKernel | None = None
        self._options: dict[str, Any] = {
            "step_timeout": step_timeout,
            "max_output_length": max_output_length,
        }
        if base_url is not None:
            self._options.update(base_url=base_url, token=api_key or os.environ.get(TOKEN_VARIABLE))
        else:
            # rlm does not tell an environment it is persistent: it calls add_context for the
            # next completion. Each completion is an episode of its own on this kernel.
            self._kept = _KeptKernel(kernel_source or _local(sandbox))
            self._options["kernel_source"] = self._kept
        self.env: KernelEnv | None = None
        self._started = False
        self._ended = False
        self._contexts = 0
        self._histories: list[tuple[int, str]] = []  # (index, JSON) not yet in the kernel
        self._history_count = 0
        self.setup()
        if context_payload is not None:
            self.load_context(context_payload)
        if setup_code:
            self._setup_step(setup_code)

    # -- rlm's BaseEnv ------------------------------------------------------------------------

    def setup(self) -> None:
        """Open the episode client; the kernel starts with the context (``load_context``)."""
        if "base_url" not in self._options and self.lm_handler_address is not None:
            self._backend = _HandlerBackend(tuple(self.lm_handler_address), self.depth)  # type: ignore[arg-type]
            self._options["llm_backend"] = self._backend
        self.env = KernelEnv(**self._options)

    def load_context(self, context_payload: dict[str, Any] | list[Any] | str) -> None:
        """Start the episode with ``context`` (and ``context_0``): text as it is, other data as
        JSON parsed in the kernel (one setup step, which also binds the data custom tools)."""
        self.add_context(context_payload, 0)

    # -- rlm's SupportsPersistence ------------------------------------------------------------

    def add_context(
        self, context_payload: dict[str, Any] | list[Any] | str, context_index: int | None = None
    ) -> int:
        """``context_N`` in the kernel (``context`` stays ``context_0``). Each context starts
        an episode (rlm adds one for each completion of a persistent session) on the same
        kernel, the text staged as kernel_env stages a long context."""
        index = self._contexts if context_index is None else context_index
        text = context_payload if isinstance(context_payload, str) else json.dumps(context_payload)
        value = "context" if isinstance(context_payload, str) else "json.loads(context)"
        if not self._started or self._kept is not None:
            self._start(text, [f"context_{index} = {value}", "context = context_0"])
        else:  # on a server, whose next episode would be a new kernel
            if self._ended:
                raise RuntimeError(
                    "a kernel-env serve session ends with its final answer: persistent "
                    "sessions need a local or gateway kernel_source"
                )
            parsed = repr(text) if value == "context" else f"json.loads({text!r})"
            self._setup_step(f"import json\ncontext_{index} = {parsed}")
        self._contexts = max(self._contexts, index + 1)
        return index

    def get_context_count(self) -> int:
        return self._contexts

    def add_history(
        self, message_history: list[dict[str, Any]], history_index: int | None = None
    ) -> int:
        """``history_N`` in the kernel (``history`` is ``history_0``): a copy of the messages,
        bound by the next episode's setup step (rlm adds one when a completion has ended)."""
        index = self._history_count if history_index is None else history_index
        self._histories.append((index, json.dumps(message_history)))
        self._history_count = max(self._history_count, index + 1)
        return index

    def get_history_count(self) -> int:
        return self._history_count

    def update_handler_address(self, address: tuple[str, int]) -> None:
        """The next completion's LM handler: where the kernel's ``llm_query`` goes now."""
        self.lm_handler_address = address
        if self._backend is not None:
            self._backend.address = tuple(address)  # type: ignore[assignment]

    def execute_code(self, code: str) -> REPLResult:
        """Run one code block as one step of the episode."""
        start = time.perf_counter()
        if self._ended:
            return REPLResult(stdout="", stderr=_NOT_RUN, locals={}, execution_time=0.0)
        if not self._started:
            self._start("")
        observation = self._env().execute(code).observation
        result = observation.result
        final = observation.metadata.get("final_answer") if observation.done else None
        self._ended = observation.done
        stderr = result.stderr
        if result.exception and result.exception not in stderr:
            stderr = f"{stderr}\n{result.exception}".lstrip("\n")
        return REPLResult(
            stdout=result.stdout,
            stderr=stderr,
            locals=dict(result.locals_snapshot),
            execution_time=time.perf_counter() - start,
            rlm_calls=self._backend.take_calls() if self._backend else [],
            final_answer=None if final is None else str(final),
        )

    def cleanup(self) -> None:
        """Export the episode if asked, then shut its kernel down (a persistent session's
        too); idempotent."""
        env, self.env = self.env, None
        if env is None:
            return
        try:
            if self.export_path is not None and self._started:
                env.export_notebook(self.export_path, overwrite=True)
        finally:
            if self._kept is not None:
                self._kept.released = True
            env.close()

    # -- helpers ------------------------------------------------------------------------------

    def _env(self) -> KernelEnv:
        if self.env is None:
            raise RuntimeError("this rlm environment was cleaned up")
        return self.env

    def _start(self, context: str, lines: list[str] | None = None) -> None:
        """A new episode (on the kept kernel, in a persistent session), then one setup step:
        ``lines``, the data custom tools and the histories not yet in the kernel."""
        self._env().reset(context=context, max_iterations=_EPISODE_ITERATIONS)
        self._started, self._ended = True, False
        lines = [*(lines or []), *self._tool_lines(), *self._history_lines()]
        if lines:
            self._setup_step("\n".join(["import json", *lines]))

    def _tool_lines(self) -> list[str]:
        return [f"{name} = json.loads({json.dumps(v)!r})" for name, v in self.custom_tools]

    def _history_lines(self) -> list[str]:
        pending, self._histories = self._histories, []
        lines = [f"history_{index} = json.loads({text!r})" for index, text in pending]
        if any(index == 0 for index, _ in pending):
            lines.append("history = history_0")
        return lines

    def _setup_step(self, code: str) -> None:
        if not self._started:
            self._start("")
        result = self._env().execute(code).observation.result
        if not result.success:
            raise RuntimeError(f"setup code failed: {result.exception or result.stderr}")

    def __enter__(self) -> KernelREPL:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.cleanup()


def _local(sandbox: str) -> KernelSource:
    from kernel_env.kernel.factory import local_source

    return local_source(sandbox)


def _data_tools(custom_tools: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """rlm's custom tools that can enter an isolated kernel: JSON data. A host callable can't."""
    tools = []
    for name, entry in (custom_tools or {}).items():
        value = extract_tool_value(entry)
        if callable(value):
            raise TypeError(
                f"custom tool {name!r} is a host function, which can't enter an isolated "
                "kernel; pass data, or define the function in setup_code"
            )
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"custom tool {name!r} must be JSON data: {exc}") from None
        if not name.isidentifier():
            raise ValueError(f"custom tool name {name!r} is not a Python identifier")
        tools.append((name, value))
    return tools


def register() -> None:
    """Add ``"kernel_env"`` to the environments rlm's ``get_environment`` knows; idempotent."""
    original: Callable[..., Any] = _rlm_environments.get_environment
    if getattr(original, "kernel_env", False):
        return

    def get_environment(environment: str, environment_kwargs: dict[str, Any]) -> Any:
        if environment == ENVIRONMENT:
            return KernelREPL(**environment_kwargs)
        return original(environment, environment_kwargs)

    get_environment.kernel_env = True  # type: ignore[attr-defined]
    get_environment.__doc__ = original.__doc__
    _rlm_environments.get_environment = get_environment
    _rlm_core.get_environment = get_environment  # rlm.core.rlm imported the name
    _allow_persistence()


def _allow_persistence() -> None:
    """rlm lets only environments it names be persistent (``RLM(persistent=True)`` checks a
    fixed set); KernelREPL implements rlm's ``SupportsPersistence``, so "kernel_env" joins."""
    rlm_class = _rlm_core.RLM
    original: Callable[[Any], None] = rlm_class._validate_persistent_environment_support

    def check(self: Any) -> None:
        if self.environment_type != ENVIRONMENT:
            original(self)

    check.__doc__ = original.__doc__
    rlm_class._validate_persistent_environment_support = check


register()
