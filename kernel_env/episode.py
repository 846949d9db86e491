"""``Episode``: one episode's state and steps, in the kernel its environment gives it.

The environment (:class:`~kernel_env.environment.KernelEnvironment`) owns kernels and starts
an ``Episode`` per reset; the episode holds its record, its language, the setup not yet
carried into the kernel, what its steps have used (time, the output budget) and what the
agent last saw (the namespace, the chars cut). A step runs the action, reads the state the
kernel reports in the same reply, detects a final answer, scores it and records the step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kernel_env import forks, observation, setup
from kernel_env.config import EnvConfig
from kernel_env.errors import EPISODE_OVER, EpisodeFinished, LimitExceeded, RubricError
from kernel_env.hostcalls import HostCalls
from kernel_env.kernel import ExecutionResult, Kernel
from kernel_env.languages import catalog as languages
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState
from kernel_env.outputs import OutputBudget
from kernel_env.record import AGENT, EpisodeRecord
from kernel_env.rubric import Rubric, StepRubric, score_final, score_step

__all__ = ["Counters", "Episode"]

OnOutput = Callable[[dict[str, Any]], None]


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
    oversize_messages: int = 0  # over the host's limit: each restarted its kernel

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Episode:
    """One episode: its record, language, pending setup and steps so far."""

    def __init__(
        self,
        config: EnvConfig,
        record: EpisodeRecord,
        *,
        stats: Counters,
        rubric: Rubric,
        step_rubric: StepRubric | None,
    ) -> None:
        self.config = config
        self.record = record
        self.stats = stats  # the environment's, counted into by every episode
        self.rubric = rubric
        self.step_rubric = step_rubric
        self.language = languages.PYTHON
        self.calls = HostCalls()
        self.names: list[str] = []
        self.cut: dict[str, int] = {}  # chars cut from the last step's stdout / stderr
        self.total_time = 0.0
        self.output_budget = OutputBudget(
            config.max_episode_outputs, config.max_episode_output_chars, scope="episode"
        )
        # The setup, until a request has carried it into the kernel (kernel_env.setup).
        self.setup: dict[str, Any] | None = None

    def live_copy(self, calls: HostCalls, stats: Counters) -> Episode:
        """This episode as a live fork's copy continues it: under an id of its own, with
        the copy's ``calls`` and ``stats``."""
        twin = Episode(
            self.config,
            forks.live_record(self.record),
            stats=stats,
            rubric=self.rubric,
            step_rubric=self.step_rubric,
        )
        twin.language, twin.calls, twin.names = self.language, calls, list(self.names)
        twin.total_time = self.total_time
        twin.output_budget = copy.deepcopy(self.output_budget)
        return twin

    # -- setup ------------------------------------------------------------------------------

    async def prepare(self, kernel: Kernel) -> None:
        """Set the episode up in ``kernel``: now (a setup cell), or with its next request."""
        self.setup = await setup.prepare(self.config, self.record, kernel, self.language)

    async def settle(self, kernel: Kernel, state: dict[str, Any] | None = None) -> None:
        """Check a pending setup against the kernel's ``state`` (read now if not given)."""
        if self.setup is not None:
            state = await self._query_state(kernel) if state is None else state
            self.setup = await setup.check(self.setup, state, self.record, kernel, self.language)

    def _carried_setup(self) -> dict[str, str] | None:
        """The metadata of a request that carries the setup, while it is pending."""
        return self.language.setup_metadata(self.setup) if self.setup is not None else None

    async def _query_state(self, kernel: Kernel) -> dict[str, Any]:
        reports = self.language.state_expression
        if reports is None:
            return {}
        execution = await kernel.execute(
            "",
            silent=True,
            timeout=15.0,  # a setup it carries may read a long context
            user_expressions={"state": reports},
            metadata=self._carried_setup(),
        )
        return observation.state_from(execution) or {}

    # -- step -------------------------------------------------------------------------------

    async def step(
        self,
        kernel: Kernel,
        action: REPLAction,
        on_output: OnOutput | None,
        author: str = AGENT,
    ) -> REPLObservation:
        """Run one action in ``kernel`` and return what the agent sees. Of another ``author``
        (a person attached to the kernel), a cell: run and recorded as a step is, but not an
        iteration of the agent's, never a final answer, and allowed once the episode ended (a
        person may look into a finished episode's kernel)."""
        if self.record.done and author == AGENT:
            raise EpisodeFinished(EPISODE_OVER, episode_id=self.record.episode_id)
        if action.is_final and author != AGENT:
            raise LimitExceeded("only the episode's agent submits its final answer")
        if action.is_final:
            self.cut = {}
            result = CodeBlockResult(stdout="Final answer submitted.")
            return self._finish(action, None, result, action.final_answer or "")
        if len(action.code) > self.config.max_code_chars:
            raise LimitExceeded(
                f"code of {len(action.code)} chars exceeds the limit of "
                f"{self.config.max_code_chars}"
            )
        reports = self.language.state_expression
        execution = await kernel.execute(
            action.code,
            timeout=self.config.step_timeout,
            stdin=self.calls.handle,
            user_expressions={"state": reports} if reports is not None else None,
            on_output=on_output,
            metadata=self._carried_setup(),
        )
        if execution.restarted:
            self.stats.restarts += 1  # counted before the setup, which may fail
            await self.prepare(kernel)
        state: dict[str, Any] = {}
        if reports is not None:  # a language without: its final answer is a display
            state = observation.state_from(execution) or await self._query_state(kernel)
            await self.settle(kernel, state)
            self.names = list(state.get("names") or [])
        result, self.cut = observation.code_block_result(
            execution,
            state,
            limit=self.config.max_output_length,
            timeout=self.config.step_timeout,
            budget=self.output_budget,
        )
        self.stats.truncations += len(self.cut)
        if author != AGENT:
            return self._record_cell(action, execution, result, author)

        async def lookup(expression: str) -> str | None:
            return await _lookup(kernel, expression)

        final = await observation.detect_final(execution, state, self.language, lookup)
        partial = str((state.get("answer") or {}).get("content") or "") or None
        return self._finish(action, execution, result, final, partial)

    def _finish(
        self,
        action: REPLAction,
        ex: ExecutionResult | None,
        result: CodeBlockResult,
        final: str | None,
        partial: str | None = None,
    ) -> REPLObservation:
        record = self.record
        self.stats.steps += 1
        self.stats.timeouts += result.timed_out
        self.total_time += result.execution_time
        calls = self.calls.take_calls()
        iteration = record.iterations + 1
        exhausted = final is None and iteration >= record.max_iterations
        if exhausted:
            # As upstream: say so in stdout, and take an unfinished answer["content"].
            end = f"Maximum iterations ({record.max_iterations}) reached.\n"
            sep = "\n" if result.stdout and not result.stdout.endswith("\n") else ""
            result.stdout += sep + end
            final = partial
        done = exhausted or final is not None
        reward, rubric_error = self._reward(result, final, done)
        step = observation.step_record(iteration, action, ex, result, calls, reward, final)
        record.steps.append(step)
        record.done, record.final_answer = done, final
        record.llm_usage = self.calls.usage.as_dict()
        seen = self.observation(result, reward=reward, done=done)
        if self.step_rubric is not None:
            reward, rubric_error = score_step(self.step_rubric, action, seen)
            seen.reward = step.reward = reward
        if rubric_error is not None:  # the rubric's failure, not the step's: scored 0, said why
            seen.metadata["rubric_error"] = rubric_error
        if done:
            record.reward = reward
        return seen

    def _record_cell(
        self, action: REPLAction, ex: ExecutionResult, result: CodeBlockResult, author: str
    ) -> REPLObservation:
        """Record a person's cell: numbered after the agent's last step, with no reward."""
        self.stats.steps += 1
        self.total_time += result.execution_time
        calls = self.calls.take_calls()
        step = observation.step_record(self.record.iterations, action, ex, result, calls, 0.0, None)
        step.reward, step.author = None, author
        self.record.steps.append(step)
        self.record.llm_usage = self.calls.usage.as_dict()
        return self.observation(result, reward=None, done=self.record.done)

    def _reward(
        self, result: CodeBlockResult, final: str | None, done: bool
    ) -> tuple[float, str | None]:
        """The step's reward, and the rubric's error when scoring a final answer failed."""
        rewards = self.config.rewards
        if final is not None:
            try:
                score = score_final(final, self.record.expected_answer, self.rubric, rewards)
            except RubricError as exc:
                return 0.0, str(exc)
            return score * self.config.success_reward, None
        if done:
            return rewards.budget_exhausted, None
        return (rewards.step_ok if result.success else rewards.step_failed), None

    # -- what the agent sees ------------------------------------------------------------------

    def observation(
        self, result: CodeBlockResult, *, reward: float | None, done: bool
    ) -> REPLObservation:
        return observation.observation(
            self.record,
            result,
            names=self.names,
            cut=self.cut,
            total_time=self.total_time,
            preview=self.config.context_preview_length,
            reward=reward,
            done=done,
        )

    def state(self, restarts: int) -> REPLState:
        """The episode's state (``restarts``: its kernel's)."""
        return observation.state(
            self.record,
            names=self.names,
            total_time=self.total_time,
            restarts=restarts,
            usage=self.calls.usage,
        )


async def _lookup(kernel: Kernel, expression: str) -> str | None:
    """The value a user expression (Language.lookup) reads in ``kernel``, or None."""
    ex = await kernel.execute("", silent=True, timeout=10.0, user_expressions={"v": expression})
    value = observation.json_expression(ex.user_expressions.get("v"))
    return str(value["value"]) if value and value.get("found") else None
