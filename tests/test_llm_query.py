"""llm_query & co. inside a cell reach a host callable over the stdin channel."""

from __future__ import annotations

import threading
import time

import pytest

from kernel_env import KernelEnv

pytestmark = pytest.mark.integration  # kernels, servers or other processes


def test_llm_query_and_batched_call_the_host() -> None:
    """llm_query returns the host callable's answer; batched keeps order, errors as strings."""
    seen: list[str] = []

    def llm(prompt: str) -> str:
        seen.append(prompt)
        if prompt == "boom":
            raise RuntimeError("model unavailable")
        return prompt.upper()

    with KernelEnv(llm_query_fn=llm) as env:
        env.reset()
        one = env.execute("llm_query('hello')").observation.result
        assert one.stdout.strip() == "'HELLO'"
        many = env.execute("llm_query_batched(['a', 'boom', 'c'])").observation.result
        assert many.stdout.strip() == "['A', 'Error: model unavailable', 'C']"
        assert env.execute("llm_batch(['x'])").observation.result.stdout.strip() == "['X']"
        assert env.state().llm_calls == 5
    assert seen[:1] == ["hello"] and sorted(seen[1:4]) == ["a", "boom", "c"]


def test_batched_calls_run_concurrently_on_the_host() -> None:
    """A batch of 8 prompts against a 0.3 s model finishes far faster than 8 x 0.3 s."""
    active, peak = 0, 0
    lock = threading.Lock()

    def slow(prompt: str) -> str:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.3)
        with lock:
            active -= 1
        return prompt

    with KernelEnv(llm_query_fn=slow) as env:
        env.reset()
        res = env.execute("llm_query_batched([str(i) for i in range(8)])").observation.result
    assert res.stdout.strip() == str([str(i) for i in range(8)])
    assert peak >= 4


def test_llm_batch_fn_is_used_for_batches() -> None:
    """A given llm_batch_fn answers batched calls in one call."""
    batches: list[list[str]] = []

    def batch(prompts: list[str]) -> list[str]:
        batches.append(prompts)
        return [p[::-1] for p in prompts]

    with KernelEnv(llm_query_fn=str.upper, llm_batch_fn=batch) as env:
        env.reset()
        res = env.execute("llm_query_batched(['ab', 'cd'])").observation.result
    assert res.stdout.strip() == "['ba', 'dc']" and batches == [["ab", "cd"]]


def test_no_llm_configured_is_a_clear_error_in_the_cell() -> None:
    """Without an LLM function, llm_query raises a clear error; the episode goes on."""
    with KernelEnv() as env:
        env.reset()
        res = env.execute("llm_query('x')").observation.result
        assert not res.success and "no model is configured" in res.exception
        assert env.execute("1").observation.result.success


def test_token_never_reaches_the_kernel(monkeypatch) -> None:
    """Neither an hf_token given at reset nor the host's secret variables appear in the kernel:
    not in its environment, nor in the episode's setup, which the first step's request carries
    in its metadata (the cell reads that request and what the setup left)."""
    monkeypatch.setenv("HF_TOKEN", "hf_host_secret_value")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host-secret")
    with KernelEnv(llm_query_fn=str) as env:
        env.reset(hf_token="hf_reset_secret_value")
        res = env.execute(
            "import os, glob, kernel_env.inkernel.extension as ks\n"
            "request = get_ipython().kernel.get_parent('shell')\n"
            "assert 'kernel_env.setup' in request['metadata']\n"
            "blob = repr(request) + repr(ks._episode.setup_params)\n"
            "blob += repr(dict(os.environ))\n"
            "for p in glob.glob('/proc/self/environ'):\n"
            "    blob += open(p, 'rb').read().decode(errors='replace')\n"
            "print(blob)"
        ).observation.result
        assert res.success
        assert "HOME" in res.stdout
        for secret in ("hf_host_secret_value", "sk-host-secret", "hf_reset_secret_value"):
            assert secret not in res.stdout
            assert secret not in env.state().model_dump_json()


def test_rebinding_input_cannot_reach_the_host() -> None:
    """A raw input_request not made by the helpers gets EOF, not an LLM call."""
    calls: list[str] = []
    with KernelEnv(llm_query_fn=lambda p: calls.append(p) or "x") as env:
        env.reset()
        res = env.execute(
            "k = get_ipython().kernel\nk.raw_input('plain prompt')"
        ).observation.result
    assert "EOFError" in (res.exception or "") and calls == []


def test_malformed_tagged_request_is_rejected() -> None:
    """A forged helper request with a bad shape is answered with an error, never run."""
    calls: list[str] = []
    with KernelEnv(llm_query_fn=lambda p: calls.append(p) or "x") as env:
        env.reset()
        res = env.execute(
            "import sys\n"
            "ks = sys.modules['kernel_env.inkernel.extension']\n"
            "ks._episode.call_host('llm_query_batched', prompts='not a list')"
        ).observation.result
    assert "bad request" in (res.exception or "") and calls == []


def test_spare_probe_reply_is_never_an_answer() -> None:
    """A readiness probe's spare stdin reply that lands as a cell asks is not llm_query's
    answer: the helper asks again and gets the host's."""
    calls: list[str] = []
    with KernelEnv(llm_query_fn=lambda p: calls.append(p) or "real") as env:
        env.reset()
        res = env.execute(
            "import sys\n"
            "ks = sys.modules['kernel_env.inkernel.extension']\n"
            "k = get_ipython().kernel\n"
            "spare, real_input = [ks.PROBE_REPLY], k.raw_input\n"
            "k.raw_input = lambda prompt='': spare.pop() if spare else real_input(prompt)\n"
            "print(llm_query('q'), spare)"
        ).observation.result
    assert res.stdout == "real []\n" and calls == ["q"]
