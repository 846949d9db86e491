"""The server's model: llm_query in served kernels reaches the configured OpenAI-compatible
endpoint, and a reset's hf_token reaches only that episode's backend (S1 over the server)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from fake_openai import FakeOpenAI, Reply
from serverkit import serve_process, small_settings, thread_server

from kernel_env import KernelEnv
from kernel_env.llm import HF_DEFAULT_MODEL

pytestmark = pytest.mark.integration  # kernels, servers or other processes

HF_TOKEN = "hf_episode_" + "secret_4242"  # in two parts: a search for it finds no source file
API_KEY = "sk-server-secret-1717"

# Searches the kernel for the token, which it builds from its reverse (so that neither the
# code nor, after the `del`, the namespace holds it).
SNOOP = r"""
import glob, os
SECRET = REVERSED[::-1]
hits = [k for k, v in os.environ.items() if SECRET in v or SECRET in k]
for path in glob.glob('/proc/*/environ') + glob.glob('/tmp/**', recursive=True):
    try:
        if SECRET.encode() in open(path, 'rb').read():
            hits.append(path)
    except OSError:
        pass
print('hits:', hits)
del SECRET
"""


def test_llm_query_uses_the_servers_model() -> None:
    with FakeOpenAI(lambda body: f"{body['model']} says hi") as fake:
        settings = small_settings(
            llm_base_url=fake.url, llm_model="served-model", llm_api_key=API_KEY
        )
        with thread_server(settings) as url, KernelEnv(url) as env:
            env.reset(context="x")
            out = env.execute("print(llm_query('hello'))").observation.result
            assert out.stdout == "served-model says hi\n", out
            usage = env.state().llm_usage
    assert usage["calls"] == 1 and usage["total_tokens"] > 0
    assert fake.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert "hello" in json.dumps(fake.requests[0].body)


def test_hf_token_reaches_only_its_backend(tmp_path: Path) -> None:
    """S1: the token authorizes the episode's calls and appears nowhere else: not in the
    kernel (environment, /proc, files), observations, state, the notebook, or server logs."""
    with FakeOpenAI(lambda body: "router answer") as fake:
        env_vars = {**os.environ, "KERNEL_ENV_HF_ROUTER_URL": fake.url}
        with serve_process("--log-level", "debug", env=env_vars) as server:
            with KernelEnv(server.url) as env:
                first = env.reset(context="x", hf_token=HF_TOKEN, llm_model="org/model")
                seen = [first.observation.model_dump_json()]
                for code in [f"REVERSED = {HF_TOKEN[::-1]!r}", SNOOP, "print(llm_query('q'))"]:
                    seen.append(env.execute(code).observation.model_dump_json())
                assert '"stdout":"hits: []\\n"' in seen[2], seen[2]
                assert '"stdout":"router answer\\n"' in seen[3], seen[3]
                seen.append(env.state().model_dump_json())
                notebook = env.export_notebook(tmp_path / "episode.ipynb")
            log = server.log.read_text(errors="replace")
    request = fake.requests[0]
    assert request.headers["authorization"] == f"Bearer {HF_TOKEN}"
    assert request.body["model"] == "org/model"
    exported = "".join(p.read_text() for p in tmp_path.iterdir())
    assert notebook.exists() and "router answer" in exported
    for place, text in [
        ("observations/state", "".join(seen)),
        ("export", exported),
        ("server log", log),
    ]:
        assert HF_TOKEN not in text, place


def test_hf_token_without_a_model_uses_the_reference_default() -> None:
    """Item 7: as OpenEnv's repl_env, reset(hf_token=...) with no llm_model calls
    Qwen/Qwen3-Coder-480B-A35B-Instruct, and the reset's metadata says so."""
    with FakeOpenAI(lambda body: f"{body['model']} answers") as fake:
        settings = small_settings(hf_router_url=fake.url)
        with thread_server(settings) as url, KernelEnv(url) as env:
            reset = env.reset(context="x", hf_token=HF_TOKEN)
            meta = reset.observation.metadata
            assert meta["llm_model"] == HF_DEFAULT_MODEL and meta["llm_model_defaulted"] is True
            out = env.execute("print(llm_query('hi'))").observation.result.stdout
    assert out == f"{HF_DEFAULT_MODEL} answers\n"
    assert fake.requests[0].body["model"] == HF_DEFAULT_MODEL
    assert fake.requests[0].headers["authorization"] == f"Bearer {HF_TOKEN}"
    assert HF_TOKEN not in str(meta)


def test_served_llm_settings_come_from_the_environment() -> None:
    """KERNEL_ENV_LLM_* configure `kernel-env serve`; the status line names the model and
    never the key."""
    with FakeOpenAI(lambda body: "ok") as fake:
        env_vars = {
            **os.environ,
            "KERNEL_ENV_LLM_BASE_URL": fake.url,
            "KERNEL_ENV_LLM_MODEL": "env-model",
            "KERNEL_ENV_LLM_API_KEY": API_KEY,
        }
        with serve_process(env=env_vars) as server:
            with KernelEnv(server.url) as env:
                env.reset(context="x")
                assert env.execute("llm_query('a')").observation.result.stdout == "'ok'\n"
            log = server.log.read_text(errors="replace")
            assert httpx.get(f"{server.url}/health").status_code == 200
    assert f"llm_query -> env-model at {fake.url}" in log
    assert API_KEY not in log
    assert fake.requests[0].body["model"] == "env-model"


def test_a_cell_may_name_only_the_configured_models() -> None:
    """Item 6: llm_query("hi", model="any-expensive-model") never reaches the operator's
    endpoint; --llm-allowed-models names the extra models a cell may pick."""
    with FakeOpenAI(lambda body: f"{body['model']} says hi") as fake:
        settings = small_settings(
            llm_base_url=fake.url,
            llm_model="served-model",
            llm_api_key=API_KEY,
            llm_allowed_models=("cheap-model",),
        )
        with thread_server(settings) as url, KernelEnv(url) as env:
            env.reset(context="x")
            refused = env.execute("llm_query('hi', model='any-expensive-model')")
            result = refused.observation.result
            assert not result.success and "not allowed" in (result.exception or "")
            assert "'cheap-model', 'served-model'" in (result.exception or "")
            batch = env.execute("print(llm_query_batched(['a'], model='gpt-x'))")
            assert "not allowed" in batch.observation.result.stderr
            assert fake.requests == []
            ok = env.execute("print(llm_query('hi', model='cheap-model'))")
            assert ok.observation.result.stdout == "cheap-model says hi\n"
            same = env.execute("print(llm_query('hi', model='served-model'))")
            assert same.observation.result.stdout == "served-model says hi\n"
    assert [r.body["model"] for r in fake.requests] == ["cheap-model", "served-model"]


def test_endpoint_errors_echoing_most_of_the_key_are_redacted() -> None:
    """Item 6: an endpoint error that echoes the key minus one character (or any 8+ char
    piece of it) reaches the kernel with those pieces redacted."""

    def echo_key(body: dict[str, object]) -> Reply:
        return Reply(401, f"invalid key {API_KEY[:-1]} / tail {API_KEY[5:14]}")

    with FakeOpenAI(echo_key) as fake:
        settings = small_settings(llm_base_url=fake.url, llm_model="m", llm_api_key=API_KEY)
        with thread_server(settings) as url, KernelEnv(url) as env:
            env.reset(context="x")
            result = env.execute("llm_query('hi')").observation.result
            state = env.state().model_dump_json()
    seen = (result.exception or "") + result.stderr + state
    assert "HTTP 401" in seen and "invalid key ***" in seen
    for i in range(len(API_KEY) - 7):
        assert API_KEY[i : i + 8] not in seen, API_KEY[i : i + 8]
