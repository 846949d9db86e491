"""A running cell's output, as it happens: events, and the bounded buffer that carries them
from the kernel's reader to a consumer of any speed.

An event is a plain dict, nbformat's output shape plus ``clear_output``::

    {"output_type": "stream", "name": "stdout", "text": "..."}
    {"output_type": "display_data" | "execute_result", "data": {...}, "metadata": {...}}
    {"output_type": "update_display_data", "data": {...}, "transient": {"display_id": ...}}
    {"output_type": "error", "ename": ..., "evalue": ..., "traceback": [...]}
    {"output_type": "clear_output", "wait": false}
    {"output_type": "dropped", "bytes": n}     # what a slow consumer missed, in order

:class:`OutputStream` never blocks its producer (the kernel's iopub reader): consecutive stream
text of one name is merged, and past ``max_bytes`` of undelivered output the rest is dropped,
counted, and reported to the consumer as one ``dropped`` event where it was lost. Whatever the
consumer's speed, the kernel runs at its own and memory stays bounded. The observation at the
end of the step is built from the full output as before, so streaming never changes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kernel_env.outputs import output_size

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "OutputCallback",
    "OutputStream",
    "event_from_message",
    "streamed",
]

T = TypeVar("T")
log = logging.getLogger(__name__)

# Undelivered output kept for a slow consumer (a cell's output leaving the kernel is capped at
# 1 MB a stream already; a live view needs far less than that to keep up).
DEFAULT_BUFFER_BYTES = 256 << 10
OutputCallback = Callable[[dict[str, Any]], Any] | Callable[[dict[str, Any]], Awaitable[Any]]
_EVENT_TYPES = {
    "stream",
    "display_data",
    "execute_result",
    "update_display_data",
    "error",
    "clear_output",
}


def event_from_message(msg: dict[str, Any]) -> dict[str, Any] | None:
    """The event for one iopub message of a cell, or None for messages that are not output."""
    msg_type = (msg.get("header") or {}).get("msg_type")
    if msg_type not in _EVENT_TYPES:
        return None
    content = msg.get("content") or {}
    if msg_type == "stream":
        return {"output_type": "stream", "name": content.get("name"), "text": content.get("text")}
    if msg_type == "clear_output":
        return {"output_type": "clear_output", "wait": bool(content.get("wait"))}
    keys: tuple[str, ...] = (
        ("ename", "evalue", "traceback")
        if msg_type == "error"
        else ("data", "metadata", "transient", "execution_count")
    )
    event = {key: content[key] for key in keys if key in content}
    return {"output_type": msg_type, **event}


def _size(event: dict[str, Any]) -> int:
    """About how many chars an event carries (at least 1: no event is free)."""
    return max(1, output_size(event))


class OutputStream:
    """A bounded, coalescing queue of output events: ``push`` from the producer (never
    blocks), ``async for`` (or :meth:`deliver`) on the consumer's side, ``close`` at the end.
    """

    def __init__(self, max_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.max_bytes = max_bytes
        self._events: deque[dict[str, Any]] = deque()
        self._bytes = 0
        self._dropped = 0  # bytes lost since the last event kept (reported before the next)
        self.dropped_total = 0
        self._closed = False
        self._wake = asyncio.Event()

    def push(self, event: dict[str, Any]) -> None:
        """Queue ``event`` (or merge it into the last one). Past the bound it is dropped and
        counted; a stream text that half fits keeps its head."""
        if self._closed:
            return
        size, room = _size(event), self.max_bytes - self._bytes
        if size <= room:
            self._mark_dropped()
            self._append(event, size)
        elif event["output_type"] == "stream" and room > 0:
            self._mark_dropped()
            self._append({**event, "text": str(event.get("text") or "")[:room]}, room)
            self._drop(size - room)
        else:
            self._drop(size)
        self._wake.set()

    def _append(self, event: dict[str, Any], size: int) -> None:
        last = self._events[-1] if self._events else None
        if (
            last is not None
            and event["output_type"] == "stream"
            and last["output_type"] == "stream"
            and last.get("name") == event.get("name")
        ):
            last["text"] = (last.get("text") or "") + (event.get("text") or "")
        else:
            self._events.append(dict(event))
        self._bytes += size

    def _drop(self, size: int) -> None:
        self._dropped += size
        self.dropped_total += size

    def _mark_dropped(self) -> None:
        """What was lost since the last event kept, said where it was lost."""
        if self._dropped:
            self._events.append({"output_type": "dropped", "bytes": self._dropped})
            self._dropped = 0

    def close(self) -> None:
        """No more events: the consumer gets what is queued (and what was dropped), then stops."""
        self._mark_dropped()
        self._closed = True
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            while self._events:
                event = self._events.popleft()
                self._bytes -= _size(event) if event["output_type"] != "dropped" else 0
                yield event
            if self._closed:
                return
            self._wake.clear()
            if not self._events and not self._closed:
                await self._wake.wait()

    async def deliver(self, callback: OutputCallback) -> None:
        """Hand every event to ``callback`` until the stream closes. A plain function runs in a
        thread (a slow one holds up nothing but its own delivery); a coroutine function is
        awaited. A callback that raises stops delivery (the step itself goes on)."""
        if inspect.iscoroutinefunction(callback):
            async for event in self:
                await callback(event)
        else:
            async for event in self:
                await asyncio.to_thread(callback, event)


async def streamed(
    run: Callable[[Callable[[dict[str, Any]], None]], Awaitable[T]],
    callback: OutputCallback,
    max_bytes: int = DEFAULT_BUFFER_BYTES,
) -> T:
    """``await run(push)`` while ``callback`` gets what ``push`` is given, in order; returns
    once the step is done *and* every event was handed over (the callback sees all output
    before the caller sees the result). A callback that raises is logged and gets no more."""
    stream = OutputStream(max_bytes)

    async def deliver() -> None:
        try:
            await stream.deliver(callback)
        except Exception:
            log.exception("an on_output callback raised; it gets no more output of this step")

    delivery = asyncio.create_task(deliver())
    try:
        result = await run(stream.push)
    except BaseException:
        stream.close()
        delivery.cancel()
        raise
    stream.close()
    await delivery
    return result
