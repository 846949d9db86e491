"""``KernelEnvironment``: an OpenEnv REPL episode whose code runs in a real IPython kernel.

The async core that the local client and the server share. ``reset`` takes a fresh kernel (a
used kernel never serves another episode), loads ``context`` without pasting it into code, and
configures the in-kernel helpers; ``step`` runs one action, reads the episode state the kernel
reports in the same reply, detects a final answer, and scores it. ``rlm_query``'s child
episodes run here too (``ChildEpisodes``, each a ``KernelEnvironment`` of its own).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import typing
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

from kernel_env import answers
from kernel_env.errors import (
    EPISODE_OVER,
    NOT_INITIALIZED,
    EpisodeFinished,
    ForkRefused,
    InvalidInput,
    KernelError,
    LimitExceeded,
    LiveForkUnavailable,
    ResetNeeded,
    RubricError,
)
from kernel_env.hostcalls import HostCalls, LLMBatchFn, LLMQueryFn
from kernel_env.inkernel.contract import (
    DEFAULT_DISPLAY_CHARS,
    DEFAULT_DISPLAY_COUNT,
    DEFAULT_OUTPUT_CAP,
    EXTENSION,
    SETUP_METADATA,
    STATE_EXPRESSION,
    final_from_outputs,
    unsent_marker,
)
from kernel_env.kernel import ExecutionResult, Kernel, KernelSource
from kernel_env.languages import catalog as languages
from kernel_env.llm import Budget, CallableBackend, LLMBackend, Usage
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState, ResetOptions
from kernel_env.notebook import cells_match
from kernel_env.outputs import OutputBudget, truncate
from kernel_env.record import EpisodeRecord, StepRecord
from kernel_env.recursion import BackendForToken, ParentLink
from kernel_env.rubric import Rewards, Rubric, StepRubric, as_rubric, is_step_rubric, score_final
from kernel_env.text import shorten

log = logging.getLogger(__name__)

__all__ = [
    "ChildEpisodes",
    "ChildSolver",
    "Counters",
    "EnvConfig",
    "KernelEnvironment",
    "KernelSource",
]

# Starts (or takes from a pool) a ready kernel for a new episode.

_KERNEL = EXTENSION


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """How episodes run. Defaults follow OpenEnv's repl_env where it has one."""

    step_timeout: float = 30.0  # below the 60 s an OpenEnv client waits for a reply
    max_output_length: int = 8192  # chars of stdout/stderr each, for the model
    context_preview_length: int = 500
    kernel_output_cap: int = DEFAULT_OUTPUT_CAP  # chars per stream per cell leaving the kernel
    max_code_chars: int = 1024 * 1024
    max_context_chars: int = 512 * 1024 * 1024
    inline_context_chars: int = 64 * 1024  # larger contexts travel as a file
    rewards: Rewards = field(default_factory=Rewards)
    success_reward: float = 1.0  # scales the rubric's score of a final answer
    # (answer, expected) -> score for final answers; or an OpenEnv rubric (upstream's
    # REPLRubric), which then gives every step's reward from (action, observation).
    rubric: Rubric | StepRubric | str | None = None
    llm_concurrency: int = 16
    llm_max_calls: int | None = None  # per-episode budget, children's calls included
    llm_max_tokens: int | None = None
    rlm_concurrency: int = 4  # child episodes of one rlm_query_batched at a time
    rlm_max_iterations: int = 10  # default for a child episode's agent loop
    # What one episode keeps of its cells' outputs (observations, record, export); each cell
    # is bounded first by the kernel and by kernel_env.outputs.MAX_STEP_OUTPUT*.
    # A server holds one record per open session: 16 M chars x max_sessions bounds its memory.
    max_episode_outputs: int = 5_000
    max_episode_output_chars: int = 16_000_000
    display_count: int = DEFAULT_DISPLAY_COUNT  # rich outputs a cell sends, at most
    display_chars: int = DEFAULT_DISPLAY_CHARS  # ... and their chars
    max_prompt_chars: int = 1_000_000  # one llm_query prompt
    # What llm_query says when no model is configured: who can configure one, and how.
    no_model_hint: str = "pass llm_query_fn or llm_backend to the environment"
    llm_allowed_models: tuple[str, ...] = ()  # besides the episode's own model


@dataclass
class Counters:
    """What happened in episodes: an environment's own (``stats``), or summed by a server."""

    steps: int = 0
    timeouts: int = 0
    restarts: int = 0
    truncations: int = 0
    # Counted from the kernels by their owner (the server's sessions): output printed after its
    # cell went idle goes to the episode log, not a step; lost output reached neither.
    late_outputs: int = 0
    lost_outputs: int = 0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# Solves one child episode: (its environment, not yet reset; the model's backend; the prompt,
# which becomes the child's context; the model name; the link to the root) -> its answer.
ChildSolver = Callable[
    ["KernelEnvironment", LLMBackend, str, "str | None", "ParentLink"], Awaitable["str | None"]
]


class ChildEpisodes:
    """Runs the child episodes of one parent episode."""

    def __init__(
        self,
        config: EnvConfig,
        kernel_source: KernelSource,
        backend: LLMBackend,
        link: ParentLink,
        solver: ChildSolver,
    ) -> None:
        self.config = config
        self.kernel_source = kernel_source
        self.backend = backend
        self.link = link
        self.solver = solver

    async def run(self, prompt: str, model: str | None) -> tuple[str, list[Any]]:
        """The child's answer and its record (one child episode per call)."""
        link = self.link.child()
        environment = KernelEnvironment(
            self.config,
            kernel_source=self.kernel_source,
            llm_backend=self.backend,
            parent=link,
            child_solver=self.solver,
        )
        try:
            answer = await self.solver(environment, self.backend, prompt, model, link)
        finally:
            await environment.close()
        record = environment.record
        if record is not None:
            record.depth = link.depth
        return answer or "", [record] if record is not None else []


async def _start_local_kernel() -> Kernel:
    # The default source: sandboxed where bubblewrap works (kernel_env.kernel.factory).
    from kernel_env.kernel.factory import local_source

    return await local_source()()


class KernelEnvironment:
    """One episode at a time in its own kernel. Not safe for concurrent calls: one caller."""

    def __init__(
        self,
        config: EnvConfig | None = None,
        *,
        kernel_source: KernelSource | None = None,
        llm_query_fn: LLMQueryFn | None = None,
        llm_batch_fn: LLMBatchFn | None = None,
        llm_backend: LLMBackend | None = None,
        backend_for_token: BackendForToken | None = None,
        parent: ParentLink | None = None,
        child_solver: ChildSolver | None = None,
        kernels: languages.KernelMenu | None = None,
    ) -> None:
        """``kernels``: the kernels a reset's ``kernel_name`` may choose (default: python3
        from ``kernel_source``, and every other kernelspec installed here, started locally).

        ``llm_backend`` (or the simpler ``llm_query_fn``) answers the kernel's ``llm_query``;
        ``backend_for_token(hf_token, model)`` builds a per-episode backend when ``reset`` gets
        an ``hf_token`` (the token lives in that backend only). ``child_solver`` solves the
        child episodes of ``rlm_query`` (``kernel_env.agent.solve_child``; without one,
        ``rlm_query`` is a plain ``llm_query``). ``parent`` is set for those children: they
        share the parent's usage and budget."""
        self.config = config or EnvConfig()
        rubric = self.config.rubric
        self._step_rubric: StepRubric | None = rubric if is_step_rubric(rubric) else None  # type: ignore[assignment]
        self._rubric = as_rubric(None if self._step_rubric is not None else rubric)
        self._kernel_source = kernel_source or _start_local_kernel
        self._kernels = kernels
        self._language: languages.Language | None = None  # the episode's, when not Python
        if llm_backend is None and llm_query_fn is not None:
            llm_backend = CallableBackend(llm_query_fn)
        self._llm_backend = llm_backend
        self._llm_batch_fn = llm_batch_fn
        self._backend_for_token = backend_for_token
        self._token_backend: LLMBackend | None = None
        self._parent = parent
        self._child_solver = child_solver
        self._kernel: Kernel | None = None
        self._discarding: set[asyncio.Future[None]] = set()  # reset's old kernels, shutting down
        self._record: EpisodeRecord | None = None
        self._calls = HostCalls()
        self._names: list[str] = []
        self._cut: dict[str, int] = {}  # chars cut from the last step's stdout / stderr
        self._total_time = 0.0
        self._output_budget = self._new_output_budget()
        self.stats = Counters()
        self._stepping = 0  # steps in flight (fork refuses to copy a running one)
        self._link: ParentLink | None = None  # the episode's accounting, shared with its forks
        # The episode's setup, until a request has carried it into the kernel (_prepare_setup).
        self._setup: dict[str, Any] | None = None

    def _new_output_budget(self) -> OutputBudget:
        return OutputBudget(
            self.config.max_episode_outputs, self.config.max_episode_output_chars, scope="episode"
        )

    @property
    def kernel(self) -> Kernel | None:
        return self._kernel

    @property
    def record(self) -> EpisodeRecord | None:
        """The current (or last) episode's record, for export."""
        return self._record

    # -- reset ------------------------------------------------------------------------------

    async def reset(self, **kwargs: Any) -> REPLObservation:
        """Start a new episode in a fresh kernel. Keywords: those of :class:`ResetOptions`."""
        opts = ResetOptions(**kwargs)
        if len(opts.context) > self.config.max_context_chars:
            raise LimitExceeded(
                f"context of {len(opts.context)} chars exceeds the limit of "
                f"{self.config.max_context_chars}"
            )
        if self._record is not None and not self._record.done:
            _log_end(self._record, "reset before it finished")
        self._discard_in_background()
        self._record = EpisodeRecord(
            episode_id=opts.episode_id or str(uuid.uuid4()),
            task_prompt=opts.task_prompt,
            context=opts.context,
            max_iterations=opts.max_iterations,
            expected_answer=opts.expected_answer,
            llm_model=opts.llm_model,
            seed=opts.seed,
            agent_max_turns=opts.agent_max_turns,
        )
        self._calls = await self._host_calls(opts)
        self._total_time = 0.0
        self._output_budget = self._new_output_budget()
        self._cut = {}
        _give_expected(self._step_rubric, opts.expected_answer)
        source, self._language = self._choose_kernel(opts.kernel_name)
        self._record.kernel_name = opts.kernel_name
        self._kernel = await source()
        await self._prepare_setup()
        self._names = ["answer", "context"] if self._language is None else ["context"]
        hint = self._language.ready_hint if self._language is not None else None
        ready = CodeBlockResult(stdout=_ready_message(opts.context, opts.task_prompt, hint))
        observation = self._observation(ready, reward=None, done=False)
        observation.metadata.update(self._model_note(opts))
        return observation

    def _choose_kernel(self, name: str) -> tuple[KernelSource, languages.Language | None]:
        """The source of the kernel a reset names, and its language (None: Python's). A
        Python episode takes this environment's own source (a tenant's pool, on a server
        whose tenants have pools of their own) wherever the menu offers python3."""
        if self._kernels is None:
            if name == languages.DEFAULT_KERNEL:
                return self._kernel_source, None
            self._kernels = languages.KernelMenu.local(self._kernel_source)
        source, language = self._kernels.choose(name)
        if language is None and name == languages.DEFAULT_KERNEL:
            return self._kernel_source, None
        return source, language

    async def _host_calls(self, opts: ResetOptions) -> HostCalls:
        """The episode's LLM plumbing: backend, usage, budget, and rlm_query's children."""
        await self._close_token_backend()
        backend = self._llm_backend
        if opts.hf_token and self._backend_for_token is not None:
            # The token goes into this episode's backend and nowhere else: not the record, the
            # state, a log, or the kernel.
            backend = self._token_backend = self._backend_for_token(opts.hf_token, opts.llm_model)
        if self._parent is not None:
            link = self._parent
        else:
            link = ParentLink(
                usage=Usage(),
                budget=Budget(self.config.llm_max_calls, self.config.llm_max_tokens),
                depth=0,
                max_depth=opts.rlm_max_depth,
                max_iterations=opts.rlm_max_iterations or self.config.rlm_max_iterations,
            )
        self._link = link
        runner = None
        # OpenEnv's meaning: a child runs at depth d + 1 only if d + 1 < max_depth, so the
        # default of 1 runs none (rlm_query is then a plain llm_query).
        solver = self._child_solver
        if backend is not None and solver is not None and link.depth + 1 < link.max_depth:
            runner = ChildEpisodes(self.config, self._kernel_source, backend, link, solver).run
        backend_model = getattr(backend, "model", None)
        allowed = {*self.config.llm_allowed_models, opts.llm_model, backend_model}
        # A backend that routes model names itself (rlm's LM handler knows which models it
        # serves) is given whatever name a cell asks for.
        routes_models = getattr(backend, "routes_models", False) is True
        return HostCalls(
            backend=backend,
            usage=link.usage,
            budget=link.budget,
            batch_fn=self._llm_batch_fn,
            rlm=runner,
            max_concurrency=self.config.llm_concurrency,
            rlm_concurrency=self.config.rlm_concurrency,
            default_model=opts.llm_model,
            allowed_models=None
            if routes_models
            else frozenset(m for m in allowed if isinstance(m, str) and m),
            max_prompt_chars=self.config.max_prompt_chars,
            no_model_hint=self.config.no_model_hint,
        )

    def _model_note(self, opts: ResetOptions) -> dict[str, Any]:
        """Reset metadata naming the model an hf_token episode calls when the reset named
        none (OpenEnv's repl_env default, unless the server has one)."""
        model = getattr(self._token_backend, "model", None)
        if not opts.hf_token or opts.llm_model or not isinstance(model, str):
            return {}
        return {"llm_model": model, "llm_model_defaulted": True}

    async def _close_token_backend(self) -> None:
        backend, self._token_backend = self._token_backend, None
        if backend is not None:
            await backend.aclose()

    async def _prepare_setup(self) -> None:
        """Make the episode's setup (staging a long context in the kernel's runtime dir),
        which the episode's next request to the kernel carries (``_carried_setup``): a cell of
        its own would cost each reset a round trip to the kernel and its CPU."""
        record, kernel = self._require()
        if self._language is not None:
            self._setup = None
            await self._set_up_language(record, kernel, self._language)
            return
        params: dict[str, Any] = {
            "token": uuid.uuid4().hex,
            "seed": record.seed,
            "output_cap": self.config.kernel_output_cap,
            "display_count": self.config.display_count,
            "display_chars": self.config.display_chars,
            "max_prompt_chars": self.config.max_prompt_chars,
        }
        if kernel.quiet_iopub:
            params["quiet"] = True
        if len(record.context) <= self.config.inline_context_chars:
            params["context"] = record.context
        else:
            data = record.context.encode("utf-8")
            try:
                params["context_path"] = await kernel.stage_file(".kernel_env_context.txt", data)
            except OSError as exc:  # the kernel put something in the way (a dir, a symlink)
                raise KernelError(
                    f"episode setup failed: the context could not be staged ({exc.strerror})",
                    kernel_id=kernel.kernel_id,
                    episode_id=record.episode_id,
                ) from None
        self._setup = params

    async def _set_up_language(
        self, record: EpisodeRecord, kernel: Kernel, language: languages.Language
    ) -> None:
        """Another language's episode: its shim, context and task prompt, as a setup cell."""
        why = await languages.set_up(kernel, language, record.context, record.task_prompt)
        if why is None and record.language_info is None:
            record.language_info = await kernel.language_info()
        if why is not None:
            raise KernelError(
                f"episode setup failed in the {language.kernel_name!r} kernel: {shorten(why, 500)}",
                kernel_id=kernel.kernel_id,
                episode_id=record.episode_id,
            )

    def _carried_setup(self) -> dict[str, Any] | None:
        """The metadata of a request that carries the episode's setup, while it is pending."""
        return {SETUP_METADATA: json.dumps(self._setup)} if self._setup is not None else None

    async def _check_setup(self, state: dict[str, Any]) -> None:
        """The setup is done once the kernel's state names its token; else why not.

        A kernel whose state names no token and no error does not take a setup from a
        request (an older kernel_env's extension, in a gateway's kernel image): it gets the
        setup as a cell of its own. With no state to tell (a cell broke the state's helper),
        the setup stays pending: the next request carries it again, and the kernel applies a
        token once."""
        if self._setup is None:
            return
        if state.get("setup") == self._setup["token"]:
            self._setup = None
            return
        why = state.get("setup_error") or state.get("error")
        if why is None and "names" not in state:
            return
        if why is None:
            why = await self._setup_as_a_cell()
            if why is None:
                self._setup = None
                return
        record, kernel = self._require()
        raise KernelError(
            f"episode setup failed in the kernel: {shorten(str(why), 500)}",
            kernel_id=kernel.kernel_id,
            episode_id=record.episode_id,
        )

    async def _setup_as_a_cell(self) -> str | None:
        """Run the pending setup as a silent cell; None, or why it failed."""
        _, kernel = self._require()
        code = f"{_KERNEL}.setup({json.dumps(json.dumps(self._setup))})"
        result = await kernel.execute(code, silent=True, timeout=15.0)
        return None if result.success else result.stderr.strip()[-500:] or result.status

    async def _settle_setup(self) -> None:
        """Carry a pending setup into the kernel now (before the kernel is copied)."""
        if self._setup is not None:
            await self._check_setup(await self._query_state())

    # -- step -------------------------------------------------------------------------------

    async def step(
        self, action: REPLAction, *, on_output: Callable[[dict[str, Any]], None] | None = None
    ) -> REPLObservation:
        """Run one action and return what the agent sees. ``on_output`` gets the cell's output
        events as they happen (see :mod:`kernel_env.streaming`; it must not block)."""
        self._stepping += 1
        try:
            return await self._step(action, on_output)
        finally:
            self._stepping -= 1

    async def _step(
        self, action: REPLAction, on_output: Callable[[dict[str, Any]], None] | None
    ) -> REPLObservation:
        record, kernel = self._require()
        if record.done:
            raise EpisodeFinished(EPISODE_OVER, episode_id=record.episode_id)
        if action.is_final:
            answer = action.final_answer or ""
            self._cut = {}
            result = CodeBlockResult(stdout="Final answer submitted.")
            return self._finish_step(action, None, result, answer)
        if len(action.code) > self.config.max_code_chars:
            raise LimitExceeded(
                f"code of {len(action.code)} chars exceeds the limit of "
                f"{self.config.max_code_chars}"
            )
        python = self._language is None
        execution = await kernel.execute(
            action.code,
            timeout=self.config.step_timeout,
            stdin=self._calls.handle,
            user_expressions={"state": STATE_EXPRESSION} if python else None,
            on_output=on_output,
            metadata=self._carried_setup(),
        )
        if execution.restarted:
            self.stats.restarts += 1  # counted before the setup, which may fail
            await self._prepare_setup()
        state: dict[str, Any] = {}
        if python:  # other languages report no state: their final answer is a display
            state = _state_from(execution) or await self._query_state()
            await self._check_setup(state)
            self._names = list(state.get("names") or [])
        result = self._code_block_result(execution, state)
        final = await self._detect_final(state, execution)
        partial = str((state.get("answer") or {}).get("content") or "") or None
        return self._finish_step(action, execution, result, final, partial)

    async def _query_state(self) -> dict[str, Any]:
        _, kernel = self._require()
        execution = await kernel.execute(
            "",
            silent=True,
            timeout=15.0,  # a setup it carries may read a long context
            user_expressions={"state": STATE_EXPRESSION},
            metadata=self._carried_setup(),
        )
        return _state_from(execution) or {}

    def _code_block_result(self, ex: ExecutionResult, state: dict[str, Any]) -> CodeBlockResult:
        limit = self.config.max_output_length
        dropped = self._output_budget.dropped
        outputs = self._output_budget.keep([dict(o) for o in ex.outputs])
        notes = _fault_notes(ex, self.config.step_timeout)
        if self._output_budget.dropped > dropped:  # the episode's marker: the model sees it
            notes += str(outputs[-1]["text"])
        unsent = state.get("unsent")
        unsent = unsent if isinstance(unsent, dict) else {}
        stdout, cut_out = truncate(ex.stdout, limit, printed=_printed(ex.stdout, unsent, "stdout"))
        stderr, cut_err = truncate(
            ex.stderr + notes, limit, printed=_printed(ex.stderr, unsent, "stderr", len(notes))
        )
        self.stats.truncations += (cut_out > 0) + (cut_err > 0)
        self._cut = {k: v for k, v in (("stdout", cut_out), ("stderr", cut_err)) if v}
        return CodeBlockResult(
            stdout=stdout,
            stderr=stderr,
            locals_snapshot=dict(state.get("snapshot") or {}),
            execution_time=ex.duration,
            success=ex.success,
            exception=_exception_text(ex),
            outputs=outputs,
            execution_count=ex.execution_count,
            timed_out=ex.status == "timeout",
            kernel_restarted=ex.restarted,
            state_lost=ex.restarted,
        )

    async def _detect_final(self, state: dict[str, Any], ex: ExecutionResult) -> str | None:
        """The four dialects, in OpenEnv's order: FINAL(...) called or printed, FINAL_VAR,
        then ``answer["ready"]``; before them, another language's ``FINAL`` display."""
        if (shown := final_from_outputs(ex.outputs)) is not None:
            return shown
        if state.get("final") is not None:
            return str(state["final"])
        printed = "".join(
            o.get("text", "")
            for o in ex.outputs
            if o.get("output_type") == "stream" and o.get("name") == "stdout"
        )
        if (value := answers.find_final(printed)) is not None:
            return value
        if (name := answers.find_final_var(printed)) is not None and self._language is None:
            found = await self._lookup(name)
            if found is not None:
                return found
        answer = state.get("answer") or {}
        return str(answer.get("content", "")) if answer.get("ready") else None

    async def _lookup(self, name: str) -> str | None:
        _, kernel = self._require()
        expr = f"{_KERNEL}.lookup({name!r})"
        ex = await kernel.execute("", silent=True, timeout=10.0, user_expressions={"v": expr})
        value = _json_expression(ex.user_expressions.get("v"))
        return str(value["value"]) if value and value.get("found") else None

    def _finish_step(
        self,
        action: REPLAction,
        ex: ExecutionResult | None,
        result: CodeBlockResult,
        final: str | None,
        partial: str | None = None,
    ) -> REPLObservation:
        record, _ = self._require()
        self.stats.steps += 1
        self.stats.timeouts += result.timed_out
        self._total_time += result.execution_time
        calls = self._calls.take_calls()
        iteration = len(record.steps) + 1
        exhausted = final is None and iteration >= record.max_iterations
        if exhausted:
            # As upstream: say so in stdout, and take an unfinished answer["content"].
            end = f"Maximum iterations ({record.max_iterations}) reached.\n"
            sep = "\n" if result.stdout and not result.stdout.endswith("\n") else ""
            result.stdout += sep + end
            final = partial
        done = exhausted or final is not None
        reward, rubric_error = self._reward(record, result, final, done)
        step = _step_record(iteration, action.code, ex, result, calls, reward, final)
        step.note = _note(action)
        record.steps.append(step)
        record.done, record.final_answer = done, final
        record.llm_usage = self._calls.usage.as_dict()
        observation = self._observation(result, reward=reward, done=done)
        if self._step_rubric is not None:
            reward, rubric_error = _score_step(self._step_rubric, action, observation)
            observation.reward = step.reward = reward
        if rubric_error is not None:  # the rubric's failure, not the step's: scored 0, said why
            observation.metadata["rubric_error"] = rubric_error
        if done:
            record.reward = reward
            _log_end(record, "final answer" if final is not None else "out of iterations")
        return observation

    def _reward(
        self, record: EpisodeRecord, result: CodeBlockResult, final: str | None, done: bool
    ) -> tuple[float, str | None]:
        """The step's reward, and the rubric's error when scoring a final answer failed."""
        rewards = self.config.rewards
        if final is not None:
            try:
                score = score_final(final, record.expected_answer, self._rubric, rewards)
            except RubricError as exc:
                return 0.0, str(exc)
            return score * self.config.success_reward, None
        if done:
            return rewards.budget_exhausted, None
        return (rewards.step_ok if result.success else rewards.step_failed), None

    # -- fork ------------------------------------------------------------------------------

    @property
    def stepping(self) -> bool:
        """A step is running now."""
        return self._stepping > 0

    async def fork(
        self, n: int = 1, *, own_budget: bool = False, method: ForkMethod = "auto"
    ) -> list[KernelEnvironment]:
        """``n`` independent copies of this episode, between steps: each a new environment in
        its own kernel holding the same state (variables, imports, workspace files, the
        context) and the same record so far; its steps continue the count.

        Where the kernel runs on this host (unsandboxed), each copy is a **live fork** of its
        process: copy-on-write, ready in tens of milliseconds whatever the state holds
        (:mod:`kernel_env.kernel.fork.live`). Elsewhere (a gateway's or a sandboxed kernel, or
        one running a thread or child process of its own) it is a **replay**: a fresh kernel
        re-runs the recorded steps, with ``llm_query`` answered from the record (never asked
        again); steps that timed out or killed their kernel are not re-run.
        ``record.forked_from`` says which (``method``), why not live (``live_fork``), and for a
        replay whether the outputs matched. RNGs are fresh unless the reset gave a ``seed``
        (then a live copy keeps the parent's random state, and a replay reseeds as the reset
        did). The children share this episode's LLM usage and budget unless ``own_budget``.

        ``method``: ``"auto"`` (live where it can be), ``"live"`` (raise
        :class:`LiveForkUnavailable` where it cannot) or ``"replay"``."""
        if method not in typing.get_args(ForkMethod):
            raise InvalidInput(f"method must be 'auto', 'live' or 'replay', not {method!r}")
        record, _ = self._require()
        if self.stepping:
            raise ForkRefused("a step is running: fork between steps", episode_id=record.episode_id)
        if record.done:
            raise ForkRefused(
                "the episode is over: nothing to fork; fork before the final answer, or reset()",
                episode_id=record.episode_id,
            )
        if not 1 <= n <= MAX_FORKS:
            raise LimitExceeded(f"n must be between 1 and {MAX_FORKS}, got {n}")
        children = [self._sibling(own_budget) for _ in range(n)]
        try:
            why_not_live: str | None = "asked for a replay"
            if method != "replay":
                why_not_live = await self._fork_live(children, required=method == "live")
            if why_not_live is not None:
                await asyncio.gather(
                    *(child._replay_of(record, why_not_live) for child in children)
                )
        except BaseException:
            await asyncio.gather(*(child.close() for child in children), return_exceptions=True)
            raise
        record.forks.extend(child._require()[0].episode_id for child in children)
        return children

    async def _fork_live(self, children: list[KernelEnvironment], required: bool) -> str | None:
        """Copy this episode's kernel live into ``children``; None, or why it could not."""
        record, kernel = self._require()
        await self._settle_setup()  # the copies take the episode as it is set up
        self._stepping += 1  # no step may start while the kernel forks
        try:
            kernels = await kernel.live_fork(len(children), reseed=record.seed is None)
        except LiveForkUnavailable as exc:
            if required:
                raise
            log.info("episode %s: fork by replay (%s)", record.episode_id, exc)
            return str(exc)
        finally:
            self._stepping -= 1
        for child, copied in zip(children, kernels, strict=True):
            child._kernel = copied  # closing the child closes it, whatever happens next
        for child in children:
            await child._copy_of(self)
        return None

    async def _copy_of(self, parent: KernelEnvironment) -> None:
        """Become a live copy of ``parent``'s episode, in the copy of its kernel it holds."""
        theirs, _ = parent._require()
        self._record = replace(
            copy.deepcopy(theirs),
            episode_id=_fork_id(theirs),
            forks=[],
            forked_from={
                "episode_id": theirs.episode_id,
                "steps": len(theirs.steps),
                "method": "live",
            },
        )
        self._calls = await self._host_calls(_options_of(theirs))
        self._total_time = parent._total_time
        self._output_budget = copy.deepcopy(parent._output_budget)
        self._cut = {}
        self._names = list(parent._names)
        _give_expected(self._step_rubric, theirs.expected_answer)

    def _sibling(self, own_budget: bool) -> KernelEnvironment:
        return KernelEnvironment(
            self.config,
            kernel_source=self._kernel_source,
            llm_backend=self._token_backend or self._llm_backend,
            llm_batch_fn=self._llm_batch_fn,
            parent=None if own_budget else self._link,
            child_solver=self._child_solver,
            kernels=self._kernels,
        )

    async def _replay_of(self, parent: EpisodeRecord, why_not_live: str) -> None:
        options = _options_of(parent).model_dump(exclude={"episode_id"})
        await self.reset(**options, episode_id=_fork_id(parent))
        self._calls.recorded = [
            (c.prompt, c.response) for step in parent.steps for c in step.llm_calls if not c.error
        ]
        matched = True
        try:
            for step in parent.steps:
                if step.status in ("timeout", "died", "final"):
                    matched = False  # not re-run: it would hang or crash again
                    continue
                await self.step(REPLAction(code=step.code, metadata=_meta_of(step)))
                mine = self._require()[0].steps[-1]
                matched = matched and cells_match(step.outputs, mine.outputs)
        finally:
            self._calls.recorded = None
        self._require()[0].forked_from = {
            "episode_id": parent.episode_id,
            "steps": len(parent.steps),
            "method": "replay",
            "live_fork": why_not_live,
            "outputs_matched": matched,
        }

    # -- state, observation, close ------------------------------------------------------------

    @property
    def state(self) -> REPLState:
        """The episode's state; before the first reset, :class:`ResetNeeded` (as upstream)."""
        record = self._record
        if record is None:
            raise ResetNeeded(NOT_INITIALIZED)
        return REPLState(
            episode_id=record.episode_id,
            step_count=len(record.steps),
            context=record.context,
            task_prompt=record.task_prompt,
            iteration=len(record.steps),
            max_iterations=record.max_iterations,
            namespace_keys=list(self._names),
            final_answer=record.final_answer,
            total_execution_time=self._total_time,
            done=record.done,
            reward=record.reward,
            kernel_restarts=self._kernel.restarts if self._kernel else 0,
            llm_calls=self._calls.usage.calls,
            llm_usage=self._calls.usage.as_dict(),
        )

    def _observation(
        self, result: CodeBlockResult, *, reward: float | None, done: bool
    ) -> REPLObservation:
        record, _ = self._require()
        if done:
            metadata: dict[str, Any] = {
                "final_answer": record.final_answer,
                "total_execution_time": self._total_time,
                "total_iterations": len(record.steps),
            }
        else:
            metadata = {
                "task_prompt": record.task_prompt,
                "final_answer": record.final_answer,
                "execution_time": result.execution_time,
            }
        metadata["episode_id"] = record.episode_id
        if self._cut:
            metadata["truncated"] = dict(self._cut)  # chars cut, by stream
        return REPLObservation(
            result=result,
            context_preview=record.context[: self.config.context_preview_length] or None,
            context_length=len(record.context),
            available_variables=list(self._names),
            iteration=len(record.steps),
            max_iterations=record.max_iterations,
            done=done,
            reward=reward,
            metadata=metadata,
        )

    async def close(self) -> None:
        """Shut the episode's kernel down, and those of earlier episodes still shutting
        down; idempotent. The record stays readable."""
        if self._kernel is not None and self._record is not None and not self._record.done:
            _log_end(self._record, "closed before it finished")
        await self._discard_kernel()
        if self._discarding:
            await asyncio.gather(*self._discarding, return_exceptions=True)
        await self._close_token_backend()

    async def _discard_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            await kernel.shutdown()

    def _discard_in_background(self) -> None:
        """A reset's old kernel shuts down while the new episode starts; ``close``
        waits for it."""
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            task = asyncio.ensure_future(kernel.shutdown())
            self._discarding.add(task)
            task.add_done_callback(self._discarded)

    def _discarded(self, task: asyncio.Future[None]) -> None:
        self._discarding.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a discarded kernel failed to shut down: %r", task.exception())

    def _require(self) -> tuple[EpisodeRecord, Kernel]:
        if self._record is None or self._kernel is None:
            raise ResetNeeded(NOT_INITIALIZED)
        return self._record, self._kernel


def _printed(text: str, unsent: dict[str, Any], name: str, extra: int = 0) -> int | None:
    """How many chars a stream printed when the kernel sent only part (its state says how
    many it kept back, and ``text`` holds its marker line for them), else None."""
    count = unsent.get(name)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return len(text) - len(unsent_marker(count)) + count + extra


def _ready_message(context: str, task_prompt: str, hint: str | None = None) -> str:
    """The reset observation's stdout, worded as upstream's (models are prompted with it);
    ``hint``: how another language's episode ends."""
    parts = ["REPL environment initialized."]
    if context:
        parts.append(f"Context loaded ({len(context)} chars). Use 'context' variable to access it.")
    if task_prompt:
        parts.append(f"Task: {task_prompt}")
    parts.append(
        hint
        or "Use answer['content'] to store your answer, and set answer['ready'] = True when done."
    )
    return "\n".join(parts)


def _score_step(
    rubric: StepRubric, action: REPLAction, observation: REPLObservation
) -> tuple[float, str | None]:
    """An OpenEnv rubric's reward for a step; a rubric that raises or returns no number
    scores 0 with its error, so the step itself is never lost."""
    name = type(rubric).__qualname__
    try:
        result = rubric(action, observation)
    except Exception as exc:  # user code: any failure is the rubric's, reported as data
        return 0.0, f"rubric {name} raised {type(exc).__name__}: {exc}"
    try:
        return float(result), None
    except (TypeError, ValueError):
        return 0.0, f"rubric {name} returned {result!r}, which is not a number or bool"


def _options_of(record: EpisodeRecord) -> ResetOptions:
    """The reset that started ``record``'s episode (what a fork's copy starts from)."""
    return ResetOptions(
        context=record.context,
        task_prompt=record.task_prompt,
        max_iterations=record.max_iterations,
        seed=record.seed,
        expected_answer=record.expected_answer,
        llm_model=record.llm_model,
        agent_max_turns=record.agent_max_turns,
        kernel_name=record.kernel_name,
    )


def _fork_id(parent: EpisodeRecord) -> str:
    return f"{parent.episode_id}.fork-{uuid.uuid4().hex[:8]}"


def _give_expected(rubric: StepRubric | None, expected: str | None) -> None:
    """Give an OpenEnv rubric the new episode's expected answer, as upstream's reset does."""
    if rubric is None:
        return
    reset = getattr(rubric, "reset", None)
    if callable(reset):
        reset()
    set_expected = getattr(rubric, "set_expected", None)
    if callable(set_expected) and expected is not None:
        set_expected(expected)


def _json_expression(value: Any) -> dict[str, Any] | None:
    """A user_expressions entry whose text/plain is JSON (see inkernel.extension._JSONState)."""
    if not isinstance(value, dict) or value.get("status") != "ok":
        return None
    try:
        parsed = json.loads(value.get("data", {}).get("text/plain", ""))
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _state_from(ex: ExecutionResult) -> dict[str, Any] | None:
    return _json_expression(ex.user_expressions.get("state"))


def _exception_text(ex: ExecutionResult) -> str | None:
    if ex.status == "timeout":
        return "TimeoutError: the cell exceeded the step timeout"
    if ex.status == "died":
        return "KernelDied: the kernel process exited while running the cell"
    if ex.error:
        return f"{ex.error.get('ename', 'Error')}: {ex.error.get('evalue', '')}"
    return None


def _fault_notes(ex: ExecutionResult, timeout: float) -> str:
    if ex.status == "timeout" and not ex.restarted:
        return (
            f"\n[kernel_env] The cell ran longer than {timeout:g} s and was interrupted. "
            "The kernel kept its state: variables from earlier steps are still defined.\n"
        )
    if ex.status == "timeout":
        return (
            f"\n[kernel_env] The cell ran longer than {timeout:g} s and did not stop when "
            "interrupted, so the kernel was restarted. All variables were lost; `context` and "
            "the helpers were loaded again.\n"
        )
    if ex.status == "died":
        return (
            "\n[kernel_env] The kernel process died while running this cell (os._exit, a "
            "signal, or a crash) and was restarted. All variables were lost; `context` and the "
            "helpers were loaded again.\n"
        )
    return ""


def _step_record(
    index: int,
    code: str,
    ex: ExecutionResult | None,
    result: CodeBlockResult,
    calls: list[Any],
    reward: float,
    final: str | None,
) -> StepRecord:
    if ex is None:  # a final answer submitted directly: nothing ran
        now = datetime.now(UTC)
        return StepRecord(
            index, code, [], None, now, now, 0.0, "final", reward=reward, final_answer=final
        )
    return StepRecord(
        index=index,
        code=code,
        outputs=result.outputs,
        execution_count=ex.execution_count,
        started=ex.started,
        finished=ex.finished,
        duration=ex.duration,
        status=ex.status,
        interrupted=ex.interrupted,
        restarted=ex.restarted,
        llm_calls=calls,
        reward=reward,
        final_answer=final,
    )


def _log_end(record: EpisodeRecord, how: str) -> None:
    """One line per episode end, for operators: id, how, steps, reward, duration, LLM calls."""
    log.info(
        "episode %s ended (%s): %d step(s), reward %s, %.1f s, %d LLM call(s)",
        record.episode_id,
        how,
        len(record.steps),
        "none" if record.reward is None else f"{record.reward:g}",
        time.time() - record.started,
        record.llm_usage.get("calls", 0),
    )


_MAX_NOTE_CHARS = 20_000
MAX_FORKS = 64  # copies one fork() makes at most
# How fork() copies an episode: live where it can be, or as asked.
ForkMethod = typing.Literal["auto", "live", "replay"]


def _note(action: REPLAction) -> str | None:
    """The prose an agent sent with a step (``metadata["note"]``), kept for the export."""
    note = action.metadata.get("note")
    return shorten(note, _MAX_NOTE_CHARS) if isinstance(note, str) and note.strip() else None


def _meta_of(step: StepRecord) -> dict[str, Any]:
    """A replayed step's metadata: its prose, so a fork's export tells the same story."""
    return {"note": step.note} if step.note else {}
