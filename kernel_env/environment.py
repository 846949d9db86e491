"""``KernelEnvironment``: an OpenEnv REPL environment whose episodes run in real Jupyter
kernels.

The async core that the local client and the server share. ``reset`` takes a fresh kernel (a
used kernel never serves another episode) of the language the reset names
(:class:`~kernel_env.languages.catalog.Language`) and starts an
:class:`~kernel_env.episode.Episode` in it; ``step`` runs one action of that episode;
``fork`` copies it (:mod:`kernel_env.forks`); ``rlm_query``'s child episodes run in
environments of their own (:mod:`kernel_env.recursion`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from kernel_env import forks, observation
from kernel_env.calls import ChildRunner, EpisodeCalls
from kernel_env.config import EnvConfig
from kernel_env.episode import Counters, Episode, OnOutput
from kernel_env.errors import NOT_INITIALIZED, LimitExceeded, LiveForkUnavailable, ResetNeeded
from kernel_env.forks import MAX_FORKS, ForkMethod
from kernel_env.hostcalls import LLMBatchFn, LLMQueryFn, RLMRunner
from kernel_env.kernel import Kernel, KernelSource
from kernel_env.languages import catalog as languages
from kernel_env.llm import CallableBackend, LLMBackend
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState, ResetOptions
from kernel_env.record import AGENT, EpisodeRecord, StepRecord
from kernel_env.recursion import BackendForToken, ChildEpisodes, ParentLink
from kernel_env.recursion import ChildSolver as _ChildSolver
from kernel_env.rubric import StepRubric, as_rubric, give_expected, is_step_rubric

log = logging.getLogger(__name__)

_REPEAT_INTERRUPT = 1.0  # seconds in which a step's cell is interrupted once at most

__all__ = [
    "MAX_FORKS",
    "ChildEpisodes",
    "ChildSolver",
    "Counters",
    "EnvConfig",
    "ForkMethod",
    "KernelEnvironment",
    "KernelSource",
]


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
        if llm_backend is None and llm_query_fn is not None:
            llm_backend = CallableBackend(llm_query_fn)
        self._child_solver = child_solver
        self._models = EpisodeCalls(
            self.config,
            backend=llm_backend,
            batch_fn=llm_batch_fn,
            backend_for_token=backend_for_token,
            parent=parent,
            children=self._children(),
        )
        self._kernel: Kernel | None = None
        self._discarding: set[asyncio.Future[None]] = set()  # reset's old kernels, shutting down
        self._episode: Episode | None = None
        self.stats = Counters()
        self._stepping = 0  # steps in flight (fork refuses to copy a running one)
        self._steps_run = 0  # steps started so far
        self._interrupted = (0, 0.0)  # the step last interrupted, and when (monotonic)

    @property
    def kernel(self) -> Kernel | None:
        return self._kernel

    @property
    def record(self) -> EpisodeRecord | None:
        """The current (or last) episode's record, for export."""
        return self._episode.record if self._episode is not None else None

    # -- reset ------------------------------------------------------------------------------

    async def reset(self, **kwargs: Any) -> REPLObservation:
        """Start a new episode in a fresh kernel. Keywords: those of :class:`ResetOptions`."""
        opts = ResetOptions(**kwargs)
        if len(opts.context) > self.config.max_context_chars:
            raise LimitExceeded(
                f"context of {len(opts.context)} chars exceeds the limit of "
                f"{self.config.max_context_chars}"
            )
        if self._episode is not None and not self._episode.record.done:
            _log_end(self._episode.record, "reset before it finished")
        self._discard_in_background()
        self._episode = episode = self._new_episode(_record_of(opts))
        episode.calls = await self._models.open(opts)
        give_expected(self._step_rubric, opts.expected_answer)
        source, episode.language = self._choose_kernel(opts.kernel_name)
        self._kernel = kernel = await source()
        await episode.prepare(kernel)
        episode.names = list(episode.language.names)
        ready = observation.ready_message(
            opts.context, opts.task_prompt, episode.language.ready_hint
        )
        seen = episode.observation(CodeBlockResult(stdout=ready), reward=None, done=False)
        seen.metadata.update(self._models.model_note(opts))
        return seen

    def _new_episode(self, record: EpisodeRecord) -> Episode:
        return Episode(
            self.config,
            record,
            stats=self.stats,
            rubric=self._rubric,
            step_rubric=self._step_rubric,
        )

    def _choose_kernel(self, name: str) -> tuple[KernelSource, languages.Language]:
        """The source of the kernel a reset names, and its language. A language that takes
        this environment's own source (Python's: a tenant's pool, on a server whose tenants
        have pools of their own) takes it wherever the menu offers it."""
        known = languages.LANGUAGES.get(name)
        if self._kernels is None and known is not None and known.own_source:
            return self._kernel_source, known  # no kernelspec to look for
        if self._kernels is None:
            self._kernels = languages.KernelMenu.local(self._kernel_source)
        source, language = self._kernels.choose(name)
        return (self._kernel_source if language.own_source else source), language

    def _children(self) -> ChildRunner | None:
        """What answers rlm_query with child episodes, given a solver for them."""
        solver = self._child_solver
        if solver is None:
            return None

        def children(backend: LLMBackend, link: ParentLink) -> RLMRunner:
            return ChildEpisodes(self._child, backend, link, solver).run

        return children

    def _child(self, backend: LLMBackend, link: ParentLink) -> KernelEnvironment:
        """A child episode's environment (rlm_query), on this one's kernel source."""
        return KernelEnvironment(
            self.config,
            kernel_source=self._kernel_source,
            llm_backend=backend,
            parent=link,
            child_solver=self._child_solver,
        )

    # -- step -------------------------------------------------------------------------------

    async def step(
        self, action: REPLAction, *, on_output: OnOutput | None = None, author: str = AGENT
    ) -> REPLObservation:
        """Run one action and return what the agent sees. ``on_output`` gets the cell's output
        events as they happen (see :mod:`kernel_env.streaming`; it must not block).
        ``author``: who runs it (:data:`~kernel_env.record.AGENT`, or a person attached to
        the kernel, whose cells are recorded but are not the agent's iterations)."""
        episode, kernel = self._current()
        self._stepping += 1
        self._steps_run += 1
        try:
            seen = await episode.step(kernel, action, on_output, author)
        finally:
            self._stepping -= 1
        record = episode.record
        if record.done:
            how = "final answer" if record.final_answer is not None else "out of iterations"
            _log_end(record, how)
        return seen

    async def interrupt(self) -> None:
        """Interrupt the running step's cell (from another task): the step returns at once,
        failed with a ``KeyboardInterrupt``, the episode's state kept. Between steps nothing
        happens: no cell runs, and the next one must not be cut short. Asked again within
        :data:`_REPEAT_INTERRUPT` s in the same step, nothing is sent either. Both seen on a
        server's forked kernels: a SIGINT between cells, or a second one landing as the cell
        ended, and the next reply never came (the step waited out its timeout, then the
        kernel was restarted)."""
        if self._kernel is None or not self._stepping:
            return
        now = time.monotonic()
        step, at = self._interrupted
        if step == self._steps_run and now - at < _REPEAT_INTERRUPT:
            return
        self._interrupted = (self._steps_run, now)
        await self._kernel.interrupt()

    async def _settle_setup(self) -> None:
        """Carry a pending setup into the kernel now (before the kernel is copied)."""
        episode, kernel = self._current()
        await episode.settle(kernel)

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
        record, _ = self._require()
        forks.check_fork(record, n, method, stepping=self.stepping)
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

    def _sibling(self, own_budget: bool) -> KernelEnvironment:
        return KernelEnvironment(
            self.config,
            kernel_source=self._kernel_source,
            llm_backend=self._models.backend,
            llm_batch_fn=self._models.batch_fn,
            parent=None if own_budget else self._models.link,
            child_solver=self._child_solver,
            kernels=self._kernels,
        )

    async def _copy_of(self, parent: KernelEnvironment) -> None:
        """Become a live copy of ``parent``'s episode, in the copy of its kernel it holds."""
        theirs, _ = parent._current()
        calls = await self._models.open(forks.options_of(theirs.record))
        self._episode = theirs.live_copy(calls, self.stats)
        give_expected(self._step_rubric, theirs.record.expected_answer)

    async def _replay_of(self, parent: EpisodeRecord, why_not_live: str) -> None:
        """Become a copy of ``parent``'s episode by re-running its steps in a fresh kernel."""
        options = forks.options_of(parent).model_dump(exclude={"episode_id"})
        await self.reset(**options, episode_id=forks.fork_id(parent))
        episode, _ = self._current()
        episode.calls.recorded = forks.recorded_answers(parent)
        try:
            matched = await forks.rerun(parent, self._rerun_step)
        finally:
            episode.calls.recorded = None
        episode.record.forked_from = forks.replayed_from(parent, why_not_live, matched)

    async def _rerun_step(self, action: REPLAction, author: str) -> StepRecord:
        await self.step(action, author=author)
        return self._require()[0].steps[-1]

    # -- state, close ---------------------------------------------------------------------

    @property
    def state(self) -> REPLState:
        """The episode's state; before the first reset, :class:`ResetNeeded` (as upstream)."""
        if self._episode is None:
            raise ResetNeeded(NOT_INITIALIZED)
        return self._episode.state(self._kernel.restarts if self._kernel else 0)

    async def close(self) -> None:
        """Shut the episode's kernel down, and those of earlier episodes still shutting
        down; idempotent. The record stays readable."""
        record = self.record
        if self._kernel is not None and record is not None and not record.done:
            _log_end(record, "closed before it finished")
        await self._discard_kernel()
        if self._discarding:
            await asyncio.gather(*self._discarding, return_exceptions=True)
        await self._models.aclose()

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

    def _current(self) -> tuple[Episode, Kernel]:
        if self._episode is None or self._kernel is None:
            raise ResetNeeded(NOT_INITIALIZED)
        return self._episode, self._kernel

    def _require(self) -> tuple[EpisodeRecord, Kernel]:
        episode, kernel = self._current()
        return episode.record, kernel


# Solves one child episode of a KernelEnvironment (kernel_env.recursion.ChildSolver).
ChildSolver = _ChildSolver[KernelEnvironment]


def _record_of(opts: ResetOptions) -> EpisodeRecord:
    """A new episode's record, as ``opts`` start it."""
    return EpisodeRecord(
        episode_id=opts.episode_id or str(uuid.uuid4()),
        task_prompt=opts.task_prompt,
        context=opts.context,
        max_iterations=opts.max_iterations,
        expected_answer=opts.expected_answer,
        llm_model=opts.llm_model,
        seed=opts.seed,
        agent_max_turns=opts.agent_max_turns,
        kernel_name=opts.kernel_name,
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
