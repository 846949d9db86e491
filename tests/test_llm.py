"""Host-side LLM backends: the OpenAI-compatible client against a real loopback server, the
in-process backends, usage accounting and budgets."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from email.utils import formatdate

import pytest
from fake_openai import FakeOpenAI, Reply

from kernel_env import AsyncKernelEnv
from kernel_env.errors import KernelEnvError
from kernel_env.llm import (
    HF_ROUTER_URL,
    Budget,
    BudgetExceeded,
    CallableBackend,
    LLMError,
    MeteredBackend,
    OpenAIBackend,
    ScriptedBackend,
    Usage,
    _retry_delay,
    as_query_fn,
    huggingface_router,
    prompt_text,
)

pytestmark = pytest.mark.timeout(30)

KEY = "sk-test-7f3a9c1e5b"
USER = [{"role": "user", "content": "say hello to the world"}]


def backend_for(server: FakeOpenAI, **options: object) -> OpenAIBackend:
    options = {"backoff": 0.01, **options}
    return OpenAIBackend(server.url, "fake-model", api_key=KEY, **options)  # type: ignore[arg-type]


async def test_answer_and_usage_are_parsed() -> None:
    """The answer, model, token counts and reported cost come back in the Completion."""
    with FakeOpenAI(["hello world"], cost=0.25) as server:
        async with backend_for(server) as backend:
            done = await backend.complete(USER)
    assert (done.text, done.model) == ("hello world", "fake-model")
    assert (done.input_tokens, done.output_tokens, done.cost) == (5, 2, 0.25)
    assert done.latency > 0
    (request,) = server.requests
    assert request.body["messages"] == USER and request.body["model"] == "fake-model"


async def test_model_can_be_chosen_per_call() -> None:
    """complete(model=...) overrides the backend's default model."""
    with FakeOpenAI(lambda body: body["model"]) as server:
        async with backend_for(server) as backend:
            assert (await backend.complete(USER, model="other")).text == "other"


async def test_429_is_retried_honouring_retry_after() -> None:
    """Two 429s with Retry-After: 0.2 are waited out, then the answer arrives."""
    with FakeOpenAI(["ok"], fail_first=2, retry_after="0.2") as server:
        async with backend_for(server) as backend:
            t0 = time.perf_counter()
            done = await backend.complete(USER)
    assert done.text == "ok" and len(server.requests) == 3
    assert time.perf_counter() - t0 >= 0.4


async def test_500_is_retried_with_backoff() -> None:
    """A 500 without Retry-After is retried after a backoff."""
    with FakeOpenAI(["ok"], fail_first=1, fail_status=500, retry_after=None) as server:
        async with backend_for(server) as backend:
            assert (await backend.complete(USER)).text == "ok"
    assert len(server.requests) == 2


async def test_exhausted_retries_raise_a_clear_error() -> None:
    """After max_retries retries the call fails with the status and the number of attempts."""
    with FakeOpenAI(["never"], fail_first=10) as server:
        async with backend_for(server, max_retries=2) as backend:
            with pytest.raises(LLMError, match=r"after 3 attempts: HTTP 429") as info:
                await backend.complete(USER)
    assert isinstance(info.value, KernelEnvError) and len(server.requests) == 3


async def test_client_errors_are_not_retried_and_the_key_is_scrubbed() -> None:
    """A 401 fails at once; a key the endpoint echoes back is masked in the error."""
    body = f'{{"error": {{"message": "Incorrect API key provided: {KEY}"}}}}'
    with FakeOpenAI(lambda _: Reply(401, body)) as server:
        async with backend_for(server) as backend:
            with pytest.raises(LLMError, match="HTTP 401") as info:
                await backend.complete(USER)
    assert len(server.requests) == 1
    assert KEY not in str(info.value) and "***" in str(info.value)


async def test_connection_errors_are_retried_then_reported() -> None:
    """A closed port: ConnectError, retried, then a clear LLMError."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff=0.01)
    async with backend:
        with pytest.raises(LLMError, match="after 2 attempts: ConnectError"):
            await backend.complete(USER)


async def test_key_is_sent_as_bearer_and_hidden_everywhere_else(caplog) -> None:
    """The key goes only in the Authorization header: not in bodies, repr, logs or errors."""
    caplog.set_level(logging.DEBUG)
    with FakeOpenAI(["ok"], fail_first=1) as server:
        async with backend_for(server) as backend:
            await backend.complete(USER)
            shown = [repr(backend), str(vars(backend)), repr(huggingface_router(KEY, "m"))]
    assert [r.headers["authorization"] for r in server.requests] == [f"Bearer {KEY}"] * 2
    assert all(KEY not in r.raw for r in server.requests)
    assert "retry 1 of 4" in caplog.text
    for text in [*shown, caplog.text]:
        assert KEY not in text
    assert "api_key='***'" in shown[0]


def test_huggingface_router_is_an_openai_backend_on_the_router() -> None:
    """huggingface_router(token, model) targets HF's OpenAI-compatible router with the token."""
    backend = huggingface_router("hf_abc", "meta-llama/Llama-3.1-8B-Instruct", timeout=5)
    assert backend.base_url == HF_ROUTER_URL and backend.timeout == 5
    assert "hf_abc" not in repr(backend)


async def test_concurrency_limit_is_respected() -> None:
    """Nine concurrent calls with concurrency=3 never have more than 3 requests in flight."""
    with FakeOpenAI(lambda _: "ok", latency=0.2) as server:
        async with backend_for(server, concurrency=3) as backend:
            answers = await asyncio.gather(*(backend.complete(USER) for _ in range(9)))
    assert [a.text for a in answers] == ["ok"] * 9
    assert 1 < server.peak_in_flight <= 3


async def test_budget_of_calls_refuses_extra_concurrent_calls() -> None:
    """max_calls=2 with 5 concurrent calls: 2 reach the server, 3 raise BudgetExceeded."""
    usage = Usage()
    with FakeOpenAI(lambda _: "ok", latency=0.05) as server:
        async with backend_for(server) as backend:
            metered = MeteredBackend(backend, usage, Budget(max_calls=2))
            calls = (metered.complete(USER) for _ in range(5))
            results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert len(refused) == 3 and len(server.requests) == 2
    assert "all 2 calls" in str(refused[0])
    assert usage.as_dict() | {"latency": 0} == {
        "calls": 2, "errors": 0, "input_tokens": 10, "output_tokens": 2, "total_tokens": 12,
        "latency": 0, "cost": None,
    }  # fmt: skip


async def test_budget_of_tokens_stops_the_next_call() -> None:
    """Once the reported tokens reach max_tokens, the next call is refused."""
    usage = Usage()
    with FakeOpenAI(lambda _: "one two three") as server:
        async with backend_for(server) as backend:
            query = as_query_fn(backend, usage, Budget(max_tokens=8))
            assert await query("a b c d e") == "one two three"
            with pytest.raises(BudgetExceeded, match="8 tokens used of the episode's max_tokens=8"):
                await query("again")
    assert (usage.calls, usage.total_tokens) == (1, 8)


async def test_failed_calls_are_counted_as_errors() -> None:
    """A failing call counts as a call and an error in Usage."""
    usage = Usage()
    query = as_query_fn(ScriptedBackend([]), usage)
    with pytest.raises(LLMError, match="all 0 answers are used"):
        await query("x")
    assert (usage.calls, usage.errors) == (1, 1)


async def test_callable_backend_takes_sync_and_async_functions() -> None:
    """CallableBackend runs a sync fn (in a thread) or awaits an async one."""

    async def shout(prompt: str) -> str:
        return prompt.upper()

    hi = [{"role": "user", "content": "Hi"}]
    assert (await CallableBackend(str.lower).complete(hi)).text == "hi"
    assert (await CallableBackend(shout).complete(hi)).text == "HI"


async def test_scripted_backend_answers_in_order_and_records_prompts() -> None:
    """A list is consumed in order; a function answers from the prompt; prompts are kept."""
    listed = ScriptedBackend(["a", "b"])
    assert [(await listed.complete(USER)).text for _ in range(2)] == ["a", "b"]
    fn = ScriptedBackend(lambda p: p[::-1])
    assert (await as_query_fn(fn)("abc")) == "cba" and fn.prompts == ["abc"]


def test_prompt_text_renders_a_conversation() -> None:
    """A lone user message is the prompt itself; a conversation becomes a role-tagged transcript."""
    assert prompt_text(USER) == "say hello to the world"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert prompt_text(chat) == "[system]\nS\n\n[user]\nU"


def test_retry_delay_honours_retry_after_and_caps_backoff() -> None:
    """Retry-After (seconds or HTTP date) wins, capped; otherwise jittered exponential backoff."""
    assert _retry_delay(0, 0.5, 30.0, "2") == 2.0
    assert _retry_delay(0, 0.5, 30.0, "120") == 30.0
    assert 3.0 < _retry_delay(0, 0.5, 30.0, formatdate(time.time() + 5, usegmt=True)) <= 5.0
    assert 2.0 <= _retry_delay(3, 0.5, 30.0, None) <= 4.0
    assert _retry_delay(10, 0.5, 30.0, "soon") <= 30.0


@pytest.mark.integration
async def test_budget_exceeded_in_a_cell_is_a_clear_error_and_the_episode_continues() -> None:
    """Past the budget, llm_query raises a clear error in the cell; batched items say so."""
    usage = Usage()
    query = as_query_fn(ScriptedBackend(str.upper), usage, Budget(max_calls=1))
    async with AsyncKernelEnv(llm_query_fn=query, step_timeout=10) as env:
        await env.reset()
        assert (await env.execute("llm_query('a')")).observation.result.stdout == "'A'\n"
        refused = (await env.execute("llm_query('b')")).observation.result
        assert not refused.success and "LLM budget exceeded" in (refused.exception or "")
        batch = (await env.execute("llm_query_batched(['c', 'd'])")).observation.result
        assert batch.stdout.count("Error: LLM budget exceeded") == 2
        assert (await env.execute("1 + 1")).observation.result.stdout == "2\n"
    assert usage.calls == 1


def test_redact_removes_every_run_of_eight_chars_of_the_secret() -> None:
    """Any 8+ char piece of a secret is redacted; shorter coincidences and other text stay."""
    from kernel_env.llm import redact

    key = "sk-abcdefghijklmnop1234"
    assert redact(f"bad key {key[:-1]}!", key) == "bad key ***!"
    assert redact(f"<{key[4:12]}> and <{key[10:]}>", key) == "<***> and <***>"
    assert redact("abcdefg sk-abc", key) == "abcdefg sk-abc"  # 7 chars: too short to mean it
    assert redact("nothing here", "") == "nothing here"
