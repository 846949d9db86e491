"""An episode's forks: what a copy starts from, and how a replay re-runs its parent.

``KernelEnvironment.fork`` makes ``n`` copies of an episode between steps. Where its kernel
runs on this host (unsandboxed), each copy is a **live fork** of the kernel's process
(copy-on-write, :mod:`kernel_env.kernel.fork.live`) holding a copy of the parent's record
(:func:`live_record`). Elsewhere each is a **replay**: a fresh episode reset as the parent
was (:func:`options_of`) re-runs the parent's recorded steps (:func:`rerun`), with
``llm_query`` answered from the record; ``record.forked_from`` says which, and why.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import typing
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from kernel_env.errors import ForkRefused, InvalidInput, LimitExceeded, LiveForkUnavailable
from kernel_env.kernel import Kernel
from kernel_env.models import REPLAction, ResetOptions
from kernel_env.notebook import cells_match
from kernel_env.record import EpisodeRecord, StepRecord

log = logging.getLogger(__name__)

__all__ = [
    "MAX_FORKS",
    "ForkMethod",
    "Forkable",
    "check_fork",
    "copy_into",
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


class Forkable(Protocol):
    """The environment's side of a fork (``KernelEnvironment``): the parent's and each
    copy's."""

    _stepping: int  # steps in flight: one more holds steps off while the kernel forks
    _kernel: Kernel | None

    def _require(self) -> tuple[EpisodeRecord, Kernel]: ...

    async def _settle_setup(self) -> None: ...

    async def _copy_of(self, parent: Any) -> None: ...

    async def _replay_of(self, parent: EpisodeRecord, why_not_live: str) -> None: ...

    async def close(self) -> None: ...


F = TypeVar("F", bound=Forkable)


async def copy_into(parent: F, children: list[F], method: ForkMethod) -> None:
    """Make each of ``children`` (new environments) a copy of ``parent``'s episode, live
    where it can be (``method="auto"``) or as ``method`` says; on any failure, close them."""
    record, _ = parent._require()
    try:
        why_not_live: str | None = "asked for a replay"
        if method != "replay":
            why_not_live = await _fork_live(parent, children, required=method == "live")
        if why_not_live is not None:
            await asyncio.gather(*(child._replay_of(record, why_not_live) for child in children))
    except BaseException:
        await asyncio.gather(*(child.close() for child in children), return_exceptions=True)
        raise
    record.forks.extend(child._require()[0].episode_id for child in children)


async def _fork_live(parent: F, children: list[F], required: bool) -> str | None:
    """Copy ``parent``'s kernel live into ``children``; None, or why it could not."""
    record, kernel = parent._require()
    await parent._settle_setup()  # the copies take the episode as it is set up
    parent._stepping += 1  # no step may start while the kernel forks
    try:
        kernels = await kernel.live_fork(len(children), reseed=record.seed is None)
    except LiveForkUnavailable as exc:
        if required:
            raise
        log.info("episode %s: fork by replay (%s)", record.episode_id, exc)
        return str(exc)
    finally:
        parent._stepping -= 1
    for child, copied in zip(children, kernels, strict=True):
        child._kernel = copied  # closing the child closes it, whatever happens next
    for child in children:
        await child._copy_of(parent)
    return None


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


def recorded_answers(parent: EpisodeRecord) -> list[tuple[str, str]]:
    """The parent's ``llm_query`` answers, in order, for its replay to be answered from."""
    return [(c.prompt, c.response) for step in parent.steps for c in step.llm_calls if not c.error]


async def rerun(parent: EpisodeRecord, step: Callable[[REPLAction], Awaitable[StepRecord]]) -> bool:
    """Re-run ``parent``'s steps through ``step`` (which returns the new step's record);
    whether every one re-run made the same outputs. Steps that timed out, killed their kernel
    or submitted a final answer are not re-run: they would hang or crash again."""
    matched = True
    for recorded in parent.steps:
        if recorded.status in ("timeout", "died", "final"):
            matched = False
            continue
        mine = await step(REPLAction(code=recorded.code, metadata=_meta_of(recorded)))
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
