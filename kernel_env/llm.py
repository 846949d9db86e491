"""Host-side LLM backends behind one small protocol, with usage accounting and budgets.

Every backend answers ``await backend.complete(messages, model=None) -> Completion``::

    LLMBackend
    ├── OpenAIBackend     any OpenAI-compatible /chat/completions endpoint: vLLM, SGLang, Ollama,
    │                     llama.cpp, OpenAI, Hugging Face's router (``huggingface_router``)
    ├── CallableBackend   a Python ``fn(prompt) -> str``, sync or async
    ├── ScriptedBackend   answers from a list or a function (tests, demos, offline replay)
    └── MeteredBackend    wraps any of them: counts ``Usage``, enforces a ``Budget``

``as_query_fn(backend, usage, budget)`` turns a backend into the ``llm_query_fn`` that
``HostCalls`` (and ``KernelEnv(llm_query_fn=...)``) takes. Failures raise ``LLMError`` and
``BudgetExceeded`` (from :mod:`kernel_env.errors`, re-exported here).

API keys are held in a ``_Secret`` that never shows its value in a repr, a log or an error.
"""

from __future__ import annotations

import asyncio
import email.utils
import inspect
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kernel_env.errors import BudgetExceeded, LLMError
from kernel_env.text import shorten

if TYPE_CHECKING:  # httpx loads with the first OpenAIBackend call: a local episode needs none
    import httpx

__all__ = [
    "Budget",
    "BudgetExceeded",
    "CallableBackend",
    "Completion",
    "LLMBackend",
    "LLMError",
    "MeteredBackend",
    "OpenAIBackend",
    "ScriptedBackend",
    "Usage",
    "as_query_fn",
    "call_off_loop",
    "huggingface_router",
]

logger = logging.getLogger("kernel_env.llm")

HF_ROUTER_URL = "https://router.huggingface.co/v1"
# What OpenEnv's repl_env calls when a reset brings an hf_token and no llm_model.
HF_DEFAULT_MODEL = "Qwen/Qwen3-Coder-480B-A35B-Instruct"
Messages = list[dict[str, Any]]
# One lock for every Usage (updates are tiny), so a Usage stays a plain, copyable dataclass.
# A lock at all because one Usage may be shared by two loops (a sync client's loop thread and
# an agent's loop).
_USAGE_LOCK = threading.Lock()
_RETRY_STATUS = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))


@dataclass(frozen=True)
class Completion:
    """One model answer and what it cost. Token counts are None when the backend doesn't say."""

    text: str
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency: float = 0.0
    cost: float | None = None


class LLMBackend(Protocol):
    """What kernel_env needs from a model: one chat completion at a time (concurrency-safe)."""

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion: ...

    async def aclose(self) -> None: ...


# -- accounting ----------------------------------------------------------------------------


@dataclass
class Usage:
    """An episode's LLM usage. ``calls`` counts calls started (failed ones too)."""

    calls: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    latency: float = 0.0  # summed over calls; concurrent calls overlap in wall time
    cost: float | None = None  # only where the endpoint reports it

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def start(self, budget: Budget | None) -> None:
        """Count a call about to start, or raise BudgetExceeded if it would exceed ``budget``."""
        # Check and count under one lock: a batch of 100 concurrent calls must not all pass a
        # check that none of them has been counted in yet.
        with _USAGE_LOCK:
            if budget is not None:
                budget.check(self)
            self.calls += 1

    def finish(self, completion: Completion) -> None:
        with _USAGE_LOCK:
            self.input_tokens += completion.input_tokens or 0
            self.output_tokens += completion.output_tokens or 0
            self.latency += completion.latency
            if completion.cost is not None:
                self.cost = (self.cost or 0.0) + completion.cost

    def fail(self, latency: float) -> None:
        with _USAGE_LOCK:
            self.errors += 1
            self.latency += latency

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot (for state, trajectories and exports)."""
        with _USAGE_LOCK:
            return {
                "calls": self.calls,
                "errors": self.errors,
                "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens,
                "latency": round(self.latency, 6),
                "cost": self.cost,
            }


@dataclass(frozen=True)
class Budget:
    """Per-episode limits, checked on the host before each call. None means no limit.

    ``max_tokens`` counts the tokens backends report (input + output) of finished calls, so
    calls already in flight when it is reached can overshoot it by their own size.
    """

    max_calls: int | None = None
    max_tokens: int | None = None

    def check(self, usage: Usage) -> None:
        """Raise BudgetExceeded if one more call would go over this budget."""
        if self.max_calls is not None and usage.calls >= self.max_calls:
            raise BudgetExceeded(
                f"LLM budget exceeded: all {self.max_calls} calls of this episode are used"
            )
        if self.max_tokens is not None and usage.total_tokens >= self.max_tokens:
            raise BudgetExceeded(
                f"LLM budget exceeded: {usage.total_tokens} tokens used of the episode's "
                f"max_tokens={self.max_tokens}"
            )


class MeteredBackend:
    """A backend whose calls are counted in ``usage`` and refused past ``budget``.

    Share one ``MeteredBackend`` (or one ``Usage``) between a root model and the kernel's
    ``llm_query`` to account for and limit the whole episode.
    """

    def __init__(
        self, backend: LLMBackend, usage: Usage | None = None, budget: Budget | None = None
    ) -> None:
        self.backend = backend
        self.usage = usage if usage is not None else Usage()
        self.budget = budget

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion:
        self.usage.start(self.budget)
        t0 = time.perf_counter()
        try:
            completion = await self.backend.complete(messages, model=model)
        except BaseException:
            self.usage.fail(time.perf_counter() - t0)
            raise
        self.usage.finish(completion)
        return completion

    async def aclose(self) -> None:
        await self.backend.aclose()

    def __repr__(self) -> str:
        return f"MeteredBackend({self.backend!r}, budget={self.budget!r})"


def as_query_fn(
    backend: LLMBackend,
    usage: Usage | None = None,
    budget: Budget | None = None,
    *,
    model: str | None = None,
) -> Callable[[str], Awaitable[str]]:
    """An async ``llm_query_fn(prompt) -> str`` for ``HostCalls`` / ``KernelEnv``.

    Each prompt is sent as one user message; usage is recorded in ``usage`` and ``budget`` is
    enforced (a refused call raises BudgetExceeded, which the kernel sees as a clear error).
    """
    metered = MeteredBackend(backend, usage, budget)

    async def llm_query(prompt: str) -> str:
        completion = await metered.complete([{"role": "user", "content": prompt}], model=model)
        return completion.text

    return llm_query


# -- OpenAI-compatible HTTP ------------------------------------------------------------------


_MIN_SECRET_RUN = 8  # shorter runs are too common in any text to mean a leak


def redact(text: str, secret: str, min_run: int = _MIN_SECRET_RUN) -> str:
    """Replace every substring of ``text`` of ``min_run`` or more chars that is also a substring
    of ``secret`` with ``***`` (linear in ``len(text)``: a set of the secret's n-grams)."""
    if len(secret) < min_run or len(text) < min_run:
        return text.replace(secret, "***") if secret else text
    grams = {secret[i : i + min_run] for i in range(len(secret) - min_run + 1)}
    covered = [False] * len(text)
    for i in range(len(text) - min_run + 1):
        if text[i : i + min_run] in grams:
            covered[i : i + min_run] = [True] * min_run
    out: list[str] = []
    i = 0
    while i < len(text):
        if covered[i]:
            while i < len(text) and covered[i]:
                i += 1
            out.append("***")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


class _Secret:
    """A string that never shows itself: not in repr, str, f-strings or tracebacks' locals."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        """``text`` with every run of 8 or more chars that also occurs in the secret replaced
        by ``***``: an endpoint that echoes the key, or most of it, does not leak it."""
        return redact(text, self._value)

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__


class OpenAIBackend:
    """An OpenAI-compatible chat-completions endpoint over ``httpx.AsyncClient``.

    Retries 429, 5xx and connection errors with exponential backoff and jitter, honouring
    ``Retry-After`` (up to ``max_backoff`` seconds); at most ``concurrency`` requests in flight.
    The HTTP client belongs to the event loop of the first call; ``aclose()`` releases it.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 4,
        concurrency: int = 16,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if concurrency < 1 or max_retries < 0:
            raise ValueError("concurrency must be >= 1 and max_retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.concurrency = concurrency
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.extra_body = dict(extra_body or {})
        self._key = _Secret(api_key or "")
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        key = "'***'" if self._key.get() else "None"
        return f"OpenAIBackend(base_url={self.base_url!r}, model={self.model!r}, api_key={key})"

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion:
        client, slots = self._bind()
        body = {**self.extra_body, "model": model or self.model, "messages": messages}
        async with slots:
            t0 = time.perf_counter()
            data = await self._post(client, body)
            latency = time.perf_counter() - t0
        return _parse_completion(data, latency, self._key)

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
        import httpx

        headers = {"Authorization": f"Bearer {self._key.get()}"} if self._key.get() else {}
        url = f"{self.base_url}/chat/completions"
        attempt = 0
        while True:
            try:
                response = await client.post(url, json=body, headers=headers)
            except httpx.TransportError as exc:
                problem, retry_after = f"{type(exc).__name__}: {exc}", None
            else:
                if response.status_code == 200:
                    return self._json(response, attempt)
                said = shorten(response.text, 300, one_line=True)
                problem = f"HTTP {response.status_code}: {said}"
                retry_after = response.headers.get("retry-after")
                if response.status_code not in _RETRY_STATUS:
                    raise LLMError(self._failure(problem, attempt))
            if attempt >= self.max_retries:
                raise LLMError(self._failure(problem, attempt))
            await self._wait(problem, attempt, retry_after)
            attempt += 1

    def _json(self, response: httpx.Response, attempt: int) -> Any:
        try:
            return response.json()
        except ValueError:
            raise LLMError(self._failure("a body that is not JSON", attempt)) from None

    async def _wait(self, problem: str, attempt: int, retry_after: str | None) -> None:
        delay = _retry_delay(attempt, self.backoff, self.max_backoff, retry_after)
        logger.warning(
            "LLM call to %s failed (%s); retry %d of %d in %.2f s",
            self._key.scrub(self.base_url),
            self._key.scrub(problem),
            attempt + 1,
            self.max_retries,
            delay,
        )
        await asyncio.sleep(delay)

    def _failure(self, problem: str, attempt: int) -> str:
        tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
        return self._key.scrub(f"LLM call to {self.base_url} failed after {tries}: {problem}")

    def _bind(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._slots is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
            self._slots = asyncio.Semaphore(self.concurrency)
            self._loop = loop
        elif loop is not self._loop:
            # httpx's pooled connections and asyncio's semaphore both belong to one loop.
            raise LLMError(
                "this OpenAIBackend is in use on another event loop; create one backend per loop"
            )
        return self._client, self._slots

    async def aclose(self) -> None:
        """Close the HTTP connections, from any loop or thread; idempotent. Reopens on use."""
        client, loop = self._client, self._loop
        self._client = self._slots = self._loop = None
        if client is None or loop is None or loop.is_closed():
            return  # nothing open, or its connections went with their loop
        if loop is not asyncio.get_running_loop() and loop.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.aclose(), loop))
        else:
            await client.aclose()

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def huggingface_router(token: str, model: str = HF_DEFAULT_MODEL, **options: Any) -> OpenAIBackend:
    """Hugging Face's OpenAI-compatible router, with ``token`` (an ``hf_...`` token) as key;
    ``model`` defaults to OpenEnv repl_env's default (:data:`HF_DEFAULT_MODEL`)."""
    return OpenAIBackend(HF_ROUTER_URL, model, api_key=token, **options)


def _retry_delay(attempt: int, base: float, cap: float, retry_after: str | None) -> float:
    """Seconds to wait before retry ``attempt + 1``: the server's Retry-After if it gave one,
    else exponential backoff with jitter (so many clients don't retry in lockstep)."""
    told = _parse_retry_after(retry_after)
    if told is not None:
        return min(told, cap)
    return min(cap, base * 2**attempt) * random.uniform(0.5, 1.0)


def _parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date (RFC 9110)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _parse_completion(data: Any, latency: float, key: _Secret) -> Completion:
    try:
        choice = data["choices"][0]
        content = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        text = shorten(str(data), 300, one_line=True)
        raise LLMError(key.scrub(f"unreadable chat completion: {text}")) from None
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return Completion(
        text=content or "",
        model=data.get("model"),
        input_tokens=_int_or_none(usage.get("prompt_tokens")),
        output_tokens=_int_or_none(usage.get("completion_tokens")),
        latency=latency,
        cost=_float_or_none(usage.get("cost")),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# -- in-process backends --------------------------------------------------------------------


def prompt_text(messages: Messages) -> str:
    """The prompt a ``fn(prompt)`` backend sees: a lone user message as is, else the transcript."""
    if len(messages) == 1 and messages[0].get("role") == "user":
        return str(messages[0].get("content", ""))
    return "\n\n".join(f"[{m.get('role', 'user')}]\n{m.get('content', '')}" for m in messages)


async def call_off_loop(fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)`` for a sync or an async user function: awaited when async; a sync one may
    block (a local model, an HTTP call), so it runs in a thread and the event loop stays free."""
    if inspect.iscoroutinefunction(fn):
        return await fn(arg)
    result = await asyncio.to_thread(fn, arg)
    return await result if inspect.isawaitable(result) else result


class CallableBackend:
    """A Python function as a model: ``fn(prompt) -> str``, sync (run in a thread) or async."""

    def __init__(self, fn: Callable[[str], str] | Callable[[str], Awaitable[str]]) -> None:
        self.fn = fn

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion:
        prompt = prompt_text(messages)
        t0 = time.perf_counter()
        text = await call_off_loop(self.fn, prompt)
        return Completion(str(text), model=model, latency=time.perf_counter() - t0)

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"CallableBackend({getattr(self.fn, '__qualname__', self.fn)!r})"


class ScriptedBackend:
    """Canned answers: a list consumed in order, or a function of the prompt (run inline).

    Records every prompt in ``prompts``. For tests, demos and offline replays of recorded runs.
    """

    def __init__(self, answers: list[str] | Callable[[str], str]) -> None:
        self._answers = answers if callable(answers) else list(answers)
        self._next = 0
        self.prompts: list[str] = []

    async def complete(self, messages: Messages, *, model: str | None = None) -> Completion:
        prompt = prompt_text(messages)
        self.prompts.append(prompt)
        if callable(self._answers):
            return Completion(str(self._answers(prompt)), model=model)
        if self._next >= len(self._answers):
            raise LLMError(f"ScriptedBackend: all {len(self._answers)} answers are used")
        self._next += 1
        return Completion(self._answers[self._next - 1], model=model)

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"ScriptedBackend({len(self.prompts)} prompts answered)"
