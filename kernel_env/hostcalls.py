"""The host side of the kernel's helper calls (``llm_query`` & co. over the stdin channel).

A kernel asks with an ``input_request`` whose prompt is ``REQUEST_TAG + json``; this module
validates that request as untrusted input (user code can send anything), runs it against the
episode's LLM functions, records the call for the step record, and returns the JSON text of the
reply. Batched calls are fanned out concurrently here, not in the kernel.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kernel_env.errors import RequestError
from kernel_env.inkernel.contract import (
    LANGUAGE_REQUEST_TAG,
    REQUEST_TAG,
    failure_text,
    recorded_failure,
    take_recorded,
)
from kernel_env.llm import Budget, LLMBackend, MeteredBackend, Usage, call_off_loop

__all__ = ["HostCalls", "LLMBatchFn", "LLMCall", "LLMQueryFn", "RLMRunner"]

LLMQueryFn = Callable[[str], str] | Callable[[str], Awaitable[str]]
LLMBatchFn = Callable[[list[str]], list[str]] | Callable[[list[str]], Awaitable[list[str]]]

MAX_REQUEST_CHARS = 16 * 1024 * 1024
MAX_BATCH = 10_000
MAX_PROMPT_CHARS = 1_000_000  # one prompt; the default of HostCalls.max_prompt_chars
# What an episode's record keeps of its calls' prompts and responses, in chars; past it, a
# call keeps a marker instead (the answer still reaches the kernel).
MAX_KEPT_CHARS = 16_000_000
_OFF_LOOP_CHARS = 1 << 20  # requests bigger than this are parsed in a thread
_MAX_ERROR_CHARS = 2_000
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
    # Models a cell may name (None: any); the default model is always allowed.
    allowed_models: frozenset[str] | None = None
    max_prompt_chars: int = MAX_PROMPT_CHARS
    no_model_hint: str = "pass llm_query_fn or llm_backend to the environment"
    # While a fork replays its parent's steps: the pairs (contract.recorded_pair) answering
    # every call, a failed one with its failure.
    recorded: list[Any] | None = None
    max_kept_chars: int = MAX_KEPT_CHARS
    calls: list[LLMCall] = field(default_factory=list)
    kept_chars: int = 0

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
        tag = next((t for t in (REQUEST_TAG, LANGUAGE_REQUEST_TAG) if prompt.startswith(t)), None)
        if tag is None:
            # Plain input() that slipped past the kernel-side guard: EOF, the kernel raises.
            return "\x04"
        try:
            text = prompt[len(tag) :]
            # A 15 MB prompt's JSON must not stall every other session's steps.
            parsed = (
                await asyncio.to_thread(_parse, text)
                if len(text) > _OFF_LOOP_CHARS
                else _parse(text)
            )
            result = await self._dispatch(*parsed)
        except RequestError as exc:
            return json.dumps({"ok": False, "error": f"bad request: {exc}"})
        except Exception as exc:
            return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return json.dumps({"ok": True, "result": result})

    async def _dispatch(self, op: str, args: dict[str, Any]) -> Any:
        model = self._model(args.get("model"))
        if op in ("llm_query", "rlm_query"):
            call = await self._ask(op, args["prompt"], model)
            self._record(call)
            if call.error:
                raise RuntimeError(call.response)
            return call.response
        return await self._batch(op, args["prompts"], model)

    def _model(self, asked: str | None) -> str | None:
        """The model a cell named, if it may name it (an operator pays for every call)."""
        if asked is None or asked == self.default_model or self.allowed_models is None:
            return asked or self.default_model
        if asked not in self.allowed_models:
            default = {self.default_model} if self.default_model else set()
            allowed = sorted(self.allowed_models | default)
            raise RequestError(
                f"model {asked[:100]!r} is not allowed here; a cell may name "
                + (", ".join(repr(m) for m in allowed) if allowed else "no model (omit model=)")
            )
        return asked

    def _record(self, call: LLMCall) -> None:
        self.calls.append(self._bounded(call))

    def _bounded(self, call: LLMCall) -> LLMCall:
        """What the record keeps of a call: a refused or failed one keeps only its error; past
        the episode's ``max_kept_chars``, a call keeps markers instead of its texts."""
        if call.error:
            call.prompt = _not_kept(call.prompt, "the call failed; only its error is kept")
            call.response = call.response[:_MAX_ERROR_CHARS]
            return call
        size = len(call.prompt) + len(call.response)
        if self.kept_chars + size > self.max_kept_chars:
            reason = f"over the episode's {self.max_kept_chars:,} chars of kept calls"
            call.prompt = _not_kept(call.prompt, reason)
            call.response = _not_kept(call.response, reason)
            return call
        self.kept_chars += size
        return call

    async def _ask(self, op: str, prompt: str, model: str | None) -> LLMCall:
        """One prompt; a failure is a call record with ``error`` set, never an exception."""
        if self.recorded is not None:
            return self._from_record(op, prompt, model)
        t0 = time.perf_counter()
        if len(prompt) > self.max_prompt_chars:
            message = (
                f"prompt of {len(prompt):,} chars exceeds the limit of "
                f"{self.max_prompt_chars:,}; split it (llm_query_batched) or shorten it"
            )
            return LLMCall(op, prompt, message, model, 0.0, error=True)
        try:
            if op == "rlm_query" and self.rlm is not None:
                text, children = await self.rlm(prompt, model)
                return LLMCall(op, prompt, text, model, time.perf_counter() - t0, children=children)
            if self._metered is None:
                raise RuntimeError(f"no model is configured for this episode: {self.no_model_hint}")
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

    def _from_record(self, op: str, prompt: str, model: str | None) -> LLMCall:
        """A replay's answer: the response recorded for this prompt (the model is not asked,
        and nothing is metered)."""
        response = take_recorded(self.recorded or [], prompt)
        if response is None:
            message = "no recorded response for this prompt (the replay diverged)"
            return LLMCall(op, prompt, message, model, 0.0, error=True)
        if (failure := recorded_failure(response)) is not None:
            return LLMCall(op, prompt, failure, model, 0.0, error=True)
        return LLMCall(op, prompt, str(response), model, 0.0)

    async def _batch(self, op: str, prompts: list[str], model: str | None) -> list[str]:
        single = op.removesuffix("_batched")
        if self.batch_fn is not None and single == "llm_query" and self.recorded is None:
            return await self._batch_fn(single, prompts, model)
        limit = asyncio.Semaphore(
            self.rlm_concurrency if single == "rlm_query" else self.max_concurrency
        )

        async def one(prompt: str) -> LLMCall:
            async with limit:
                return await self._ask(single, prompt, model)

        calls = await asyncio.gather(*(one(p) for p in prompts))
        replies = [failure_text(c.response, batched=True) if c.error else c.response for c in calls]
        for call in calls:  # in prompt order, whatever order they finished in
            self._record(call)
        return replies

    async def _batch_fn(self, op: str, prompts: list[str], model: str | None) -> list[str]:
        """A user's batch function answers the whole batch; each prompt counts as one call."""
        for prompt in prompts:
            if len(prompt) > self.max_prompt_chars:
                raise RequestError(
                    f"a prompt of {len(prompt):,} chars exceeds the limit of "
                    f"{self.max_prompt_chars:,}"
                )
        for _ in prompts:
            self.usage.start(self.budget)  # refuses the batch when it would not fit
        assert self.batch_fn is not None  # only called when the user gave one
        t0 = time.perf_counter()
        responses = [str(r) for r in await call_off_loop(self.batch_fn, prompts)]
        if len(responses) != len(prompts):
            raise RuntimeError(
                f"llm_batch_fn returned {len(responses)} answers for {len(prompts)} prompts"
            )
        each = (time.perf_counter() - t0) / len(prompts)
        for prompt, response in zip(prompts, responses, strict=True):
            self._record(LLMCall(op, prompt, response, model, each))
        return responses


def _not_kept(text: str, reason: str) -> str:
    if len(text) <= 200:
        return text
    return f"[kernel_env: {len(text):,} chars not kept: {reason}]"


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
