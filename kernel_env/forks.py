"""An episode's forks: what a copy starts from, and how a replay re-runs its parent.

``KernelEnvironment.fork`` makes ``n`` copies of an episode between steps. Where its kernel
runs on this host (unsandboxed), each copy is a **live fork** of the kernel's process
(copy-on-write, :mod:`kernel_env.kernel.fork.live`) holding a copy of the parent's record
(:func:`live_record`). Elsewhere each is a **replay**: a fresh episode reset as the parent
was (:func:`options_of`) re-runs the parent's recorded steps (:func:`rerun`), with
``llm_query`` answered from the record; ``record.forked_from`` says which, and why.
"""

from __future__ import annotations

import copy
import logging
import typing
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from kernel_env.errors import ForkRefused, InvalidInput, LimitExceeded
from kernel_env.inkernel.contract import recorded_pair
from kernel_env.models import REPLAction, ResetOptions
from kernel_env.notebook import cells_match
from kernel_env.record import EpisodeRecord, StepRecord

log = logging.getLogger(__name__)

__all__ = [
    "MAX_FORKS",
    "ForkMethod",
    "check_fork",
    "fork_id",
    "live_record",
    "options_of",
    "recorded_answers",
    "replayed_from",
    "rerun",
]

MAX_FORKS = 64  # copies one fork() makes at most
# How fork() copies an episode: live where it can be, or as asked.
ForkMethod = typing.Literal["auto", "live", "replay"]


def check_fork(record: EpisodeRecord, n: int, method: str, *, stepping: bool) -> None:
    """Refuse a fork of ``record``'s episode that cannot be made, saying why."""
    if method not in typing.get_args(ForkMethod):
        raise InvalidInput(f"method must be 'auto', 'live' or 'replay', not {method!r}")
    if stepping:
        raise ForkRefused("a step is running: fork between steps", episode_id=record.episode_id)
    if record.done:
        raise ForkRefused(
            "the episode is over: nothing to fork; fork before the final answer, or reset()",
            episode_id=record.episode_id,
        )
    if not 1 <= n <= MAX_FORKS:
        raise LimitExceeded(f"n must be between 1 and {MAX_FORKS}, got {n}")


def options_of(record: EpisodeRecord) -> ResetOptions:
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


def fork_id(parent: EpisodeRecord) -> str:
    return f"{parent.episode_id}.fork-{uuid.uuid4().hex[:8]}"


def live_record(parent: EpisodeRecord) -> EpisodeRecord:
    """A live copy's record: the parent's so far, under an id of its own."""
    return replace(
        copy.deepcopy(parent),
        episode_id=fork_id(parent),
        forks=[],
        forked_from={"episode_id": parent.episode_id, "steps": len(parent.steps), "method": "live"},
    )


def recorded_answers(parent: EpisodeRecord) -> list[Any]:
    """The parent's ``llm_query`` answers and failures, in order, for its replay to be
    answered from."""
    return [
        recorded_pair(c.prompt, c.response, error=c.error)
        for step in parent.steps
        for c in step.llm_calls
    ]


async def rerun(
    parent: EpisodeRecord, step: Callable[[REPLAction, str], Awaitable[StepRecord]]
) -> bool:
    """Re-run ``parent``'s steps through ``step`` (given each one's author; it returns the
    new step's record);
    whether every one re-run made the same outputs. Steps that timed out, killed their kernel
    or submitted a final answer are not re-run: they would hang or crash again."""
    matched = True
    for recorded in parent.steps:
        if recorded.status in ("timeout", "died", "final"):
            matched = False
            continue
        action = REPLAction(code=recorded.code, metadata=_meta_of(recorded))
        mine = await step(action, recorded.author)
        matched = matched and cells_match(recorded.outputs, mine.outputs)
    return matched


def replayed_from(parent: EpisodeRecord, why_not_live: str, matched: bool) -> dict[str, Any]:
    """A replay's ``record.forked_from``."""
    return {
        "episode_id": parent.episode_id,
        "steps": len(parent.steps),
        "method": "replay",
        "live_fork": why_not_live,
        "outputs_matched": matched,
    }


def _meta_of(step: StepRecord) -> dict[str, Any]:
    """A replayed step's metadata: its prose, so a fork's export tells the same story."""
    return {"note": step.note} if step.note else {}
