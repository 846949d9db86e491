"""The host side of the kernel's helper calls (``llm_query`` & co. over the stdin channel).

A kernel asks with an ``input_request`` whose prompt is ``REQUEST_TAG + json``; this module
validates that request as untrusted input (user code can send anything), runs it against the
episode's LLM functions, records the call for the step record, and returns the JSON text of the
reply. Batched calls are fanned out concurrently here, not in the kernel.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kernel_env.kernel_side import REQUEST_TAG
from kernel_env.llm import Budget, LLMBackend, MeteredBackend, Usage

__all__ = ["HostCalls", "LLMBatchFn", "LLMCall", "LLMQueryFn", "RLMRunner"]

LLMQueryFn = Callable[[str], str] | Callable[[str], Awaitable[str]]
LLMBatchFn = Callable[[list[str]], list[str]] | Callable[[list[str]], Awaitable[list[str]]]

MAX_REQUEST_CHARS = 16 * 1024 * 1024
MAX_BATCH = 10_000
_OPS = ("llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched")


@dataclass
class LLMCall:
    """One prompt answered for the kernel (for the step record and notebook export)."""

    op: str
    prompt: str
    response: str
    model: str | None
    duration: float
    error: bool = False
    input_tokens: int | None = None
    output_tokens: int | None = None
    # rlm_query: the child episodes that produced the answer (kernel_env.record.EpisodeRecord)
    children: list[Any] = field(default_factory=list)


class RequestError(ValueError):
    """A kernel's request is malformed; the kernel gets the message back as an error."""


# Answers an rlm_query with a child episode: (prompt, model) -> (answer, child records).
RLMRunner = Callable[[str, str | None], Awaitable[tuple[str, list[Any]]]]


@dataclass
class HostCalls:
    """Answers one episode's helper calls.

    Every model call goes through ``backend`` metered by ``usage`` and refused past ``budget``
    on the host, where user code cannot reach either. ``rlm`` answers ``rlm_query`` with a
    child episode; without it (or past the depth limit) ``rlm_query`` is a plain ``llm_query``.
    """

    backend: LLMBackend | None = None
    usage: Usage = field(default_factory=Usage)
    budget: Budget | None = None
    batch_fn: LLMBatchFn | None = None
    rlm: RLMRunner | None = None
    max_concurrency: int = 16
    rlm_concurrency: int = 4
    default_model: str | None = None
    calls: list[LLMCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._metered = (
            MeteredBackend(self.backend, self.usage, self.budget) if self.backend else None
        )

    def take_calls(self) -> list[LLMCall]:
        """The calls recorded since the last take (one step's worth)."""
        calls, self.calls = self.calls, []
        return calls

    async def handle(self, prompt: str) -> str:
        """The input_reply value for an input_request prompt."""
        if not prompt.startswith(REQUEST_TAG):
            # Plain input() that slipped past the kernel-side guard: EOF, the kernel raises.
            return "\x04"
        try:
            op, args = _parse(prompt[len(REQUEST_TAG) :])
            result = await self._dispatch(op, args)
        except RequestError as exc:
            return json.dumps({"ok": False, "error": f"bad request: {exc}"})
        except Exception as exc:
            return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return json.dumps({"ok": True, "result": result})

    async def _dispatch(self, op: str, args: dict[str, Any]) -> Any:
        model = args.get("model") or self.default_model
        if op in ("llm_query", "rlm_query"):
            call = await self._ask(op, args["prompt"], model)
            self.calls.append(call)
            if call.error:
                raise RuntimeError(call.response)
            return call.response
        return await self._batch(op, args["prompts"], model)

    async def _ask(self, op: str, prompt: str, model: str | None) -> LLMCall:
        """One prompt; a failure is a call record with ``error`` set, never an exception."""
        t0 = time.perf_counter()
        try:
            if op == "rlm_query" and self.rlm is not None:
                text, children = await self.rlm(prompt, model)
                return LLMCall(op, prompt, text, model, time.perf_counter() - t0, children=children)
            if self._metered is None:
                raise RuntimeError("no LLM is configured for this episode (pass llm_query_fn)")
            done = await self._metered.complete([{"role": "user", "content": prompt}], model=model)
        except Exception as exc:
            return LLMCall(op, prompt, str(exc), model, time.perf_counter() - t0, error=True)
        return LLMCall(
            op,
            prompt,
            done.text,
            done.model or model,
            done.latency,
            input_tokens=done.input_tokens,
            output_tokens=done.output_tokens,
        )

    async def _batch(self, op: str, prompts: list[str], model: str | None) -> list[str]:
        single = op.removesuffix("_batched")
        if self.batch_fn is not None and single == "llm_query":
            return await self._batch_fn(single, prompts, model)
        limit = asyncio.Semaphore(
            self.rlm_concurrency if single == "rlm_query" else self.max_concurrency
        )

        async def one(prompt: str) -> LLMCall:
            async with limit:
                return await self._ask(single, prompt, model)

        calls = await asyncio.gather(*(one(p) for p in prompts))
        self.calls.extend(calls)  # in prompt order, whatever order they finished in
        return [f"Error: {c.response}" if c.error else c.response for c in calls]

    async def _batch_fn(self, op: str, prompts: list[str], model: str | None) -> list[str]:
        """A user's batch function answers the whole batch; each prompt counts as one call."""
        for _ in prompts:
            self.usage.start(self.budget)  # refuses the batch when it would not fit
        assert self.batch_fn is not None  # only called when the user gave one
        t0 = time.perf_counter()
        responses = [str(r) for r in await _call(self.batch_fn, prompts)]
        if len(responses) != len(prompts):
            raise RuntimeError(
                f"llm_batch_fn returned {len(responses)} answers for {len(prompts)} prompts"
            )
        each = (time.perf_counter() - t0) / len(prompts)
        pairs = zip(prompts, responses, strict=True)
        self.calls.extend(LLMCall(op, p, r, model, each) for p, r in pairs)
        return responses


def _parse(text: str) -> tuple[str, dict[str, Any]]:
    if len(text) > MAX_REQUEST_CHARS:
        raise RequestError(f"request of {len(text)} chars exceeds {MAX_REQUEST_CHARS}")
    try:
        request = json.loads(text)
    except ValueError as exc:
        raise RequestError("not JSON") from exc
    if not isinstance(request, dict) or request.get("op") not in _OPS:
        raise RequestError(f"op must be one of {', '.join(_OPS)}")
    args = request.get("args")
    if not isinstance(args, dict):
        raise RequestError("args must be an object")
    model = args.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string")
    op = request["op"]
    if op.endswith("_batched"):
        prompts = args.get("prompts")
        if not isinstance(prompts, list) or not _strings(prompts) or len(prompts) > MAX_BATCH:
            raise RequestError(f"prompts must be a list of at most {MAX_BATCH} strings")
        return op, {"prompts": list(prompts), "model": model}
    if not isinstance(args.get("prompt"), str):
        raise RequestError("prompt must be a string")
    return op, {"prompt": args["prompt"], "model": model}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


async def _call(fn: Callable[..., Any], arg: str | Sequence[str]) -> Any:
    """Await an async function; run a sync one in a thread so the event loop stays free."""
    if inspect.iscoroutinefunction(fn):
        return await fn(arg)
    result = await asyncio.to_thread(fn, arg)
    return await result if inspect.isawaitable(result) else result
