"""A session's live feed for the web view: what its episodes did, as numbered events.

The server appends as things happen (an episode starts, a step starts, its output arrives, it
ends); ``/web`` reads with ``GET /web/api/sessions/{id}/events?after=N``, waiting a little for
news. Events hold no secret and no context (the task and code do appear, as in an export).
Memory is bounded: each step keeps at most ``step_chars`` of output events (the rest is
counted in a ``dropped`` event), and the feed keeps its newest events within ``max_events`` and
``max_chars``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from kernel_env.hostcalls import LLMCall
from kernel_env.models import REPLObservation
from kernel_env.outputs import output_size
from kernel_env.record import AGENT
from kernel_env.text import shorten

__all__ = ["EpisodeFeed"]

_SHOWN_CHARS = 4000  # of an llm_query prompt or answer, in the feed


class EpisodeFeed:
    def __init__(
        self, *, max_events: int = 5000, max_chars: int = 4 << 20, step_chars: int = 256 << 10
    ) -> None:
        self.max_events = max_events
        self.max_chars = max_chars  # all kept events together: the oldest go first
        self.step_chars = step_chars
        self._events: deque[tuple[dict[str, Any], int]] = deque()  # (event, its size)
        self._chars = 0
        self._next = 1
        self._step_chars = 0
        self._dropped = 0
        self._news = asyncio.Event()
        self.closed = False  # the session is gone: readers stop waiting

    # -- writing (the session) ----------------------------------------------------------------

    def episode_started(self, episode_id: str, task: str, max_iterations: int) -> None:
        self._add(
            "episode",
            len(task),
            episode_id=episode_id,
            task=shorten(task, 2000),
            max_iterations=max_iterations,
            started=time.time(),
        )

    def step_started(self, code: str, is_final: bool, author: str = AGENT) -> None:
        self._step_chars = self._dropped = 0
        code = shorten(code, 100_000)
        self._add(
            "step", len(code), code=code, is_final=is_final, author=author, started=time.time()
        )

    def output(self, event: dict[str, Any]) -> None:
        """One output event of the running step (``kernel_env.streaming``'s shape)."""
        size = max(1, output_size(event))
        if self._step_chars + size > self.step_chars:
            self._dropped += size
            return
        self._step_chars += size
        self._add("output", size, output=event)

    def step_ended(self, observation: REPLObservation, calls: list[LLMCall]) -> None:
        if self._dropped:
            self._add("output", 1, output={"output_type": "dropped", "bytes": self._dropped})
            self._dropped = 0
        result = observation.result
        shown = [_call(c) for c in calls]
        self._add(
            "step_end",
            sum(len(c["prompt"]) + len(c["response"]) for c in shown),
            execution_count=result.execution_count,
            success=result.success,
            timed_out=result.timed_out,
            seconds=round(result.execution_time, 3),
            llm_calls=shown,
            done=observation.done,
            reward=observation.reward,
            final_answer=observation.metadata.get("final_answer") if observation.done else None,
        )

    def step_failed(self, message: str) -> None:
        """The step raised (refused, cancelled, the kernel lost): said, so the view closes it."""
        error = shorten(message, 500)
        self._add("step_end", len(error), success=False, error=error, llm_calls=[], done=False)

    # -- reading (/web) ------------------------------------------------------------------------

    def close(self) -> None:
        """The session closed: wake every reader, and let none wait again."""
        self.closed = True
        self._news.set()

    def since(self, after: int) -> list[dict[str, Any]]:
        """Events numbered above ``after`` that are still kept, oldest first."""
        return [event for event, _ in self._events if event["seq"] > after]

    async def wait(self, after: int, timeout: float) -> list[dict[str, Any]]:
        """Events above ``after``, waiting up to ``timeout`` seconds for the first one."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not (events := self.since(after)) and not self.closed:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return []
            self._news.clear()
            try:
                await asyncio.wait_for(self._news.wait(), left)
            except TimeoutError:
                return []
        return events

    @property
    def last(self) -> int:
        return self._next - 1

    def _add(self, kind: str, size: int, **fields: Any) -> None:
        self._events.append(({"seq": self._next, "kind": kind, **fields}, size))
        self._chars += size
        while len(self._events) > self.max_events or (
            self._chars > self.max_chars and len(self._events) > 1
        ):
            self._chars -= self._events.popleft()[1]
        self._next += 1
        self._news.set()


def _call(call: LLMCall) -> dict[str, Any]:
    return {
        "op": call.op,
        "prompt": shorten(str(call.prompt), _SHOWN_CHARS),
        "response": shorten(str(call.response), _SHOWN_CHARS),
        "error": bool(call.error),
        "model": call.model,
    }
