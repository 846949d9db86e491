"""rlm_query: child episodes in their own kernels, driven by a model on a loopback server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import pytest
from fake_openai import FakeOpenAI

from kernel_env import AsyncKernelEnv, KernelEnv
from kernel_env.llm import OpenAIBackend

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _first_user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def scripted_model(body: dict[str, Any]) -> str:
    """Level-1 children delegate to a level-2 child; level-2 children compute the answer."""
    prompt = _first_user(body)
    if "LEVEL2" in prompt:
        return "```repl\nFINAL(6 * 7)\n```"
    if "LEVEL1" in prompt:
        return "```repl\nr = rlm_query('LEVEL2: what is six times seven?')\nFINAL(r)\n```"
    return f"plain answer to: {prompt[:20]}"


async def test_rlm_query_child_at_depth_two(tmp_path: Path) -> None:
    """A root cell's rlm_query runs a child episode that itself recurses to depth 2; usage of
    both children counts toward the root; both are exported and linked from the root notebook."""
    with FakeOpenAI(scripted_model) as server:
        backend = OpenAIBackend(server.url, "fake-model", api_key="sk-rlm")
        async with AsyncKernelEnv(llm_backend=backend, step_timeout=60) as env:
            await env.reset(context="root", rlm_max_depth=3)
            res = (await env.execute("rlm_query('LEVEL1: ask a child')")).observation.result
            assert res.stdout.strip() == "'42'", res
            state = await env.state()
            assert state.llm_usage["calls"] == 2 and state.llm_usage["total_tokens"] > 0
            call = env.environment.record.steps[0].llm_calls[0]
            child = call.children[0]
            assert child.depth == 1 and child.final_answer == "42"
            grandchild = child.steps[0].llm_calls[0].children[0]
            assert grandchild.depth == 2 and grandchild.final_answer == "42"
            path = await env.export_notebook(tmp_path / "root.ipynb")
        await backend.aclose()
    nb = nbformat.read(path, as_version=4)
    links = [
        c.source for c in nb.cells if c.cell_type == "markdown" and "child episode" in c.source
    ]
    assert links and "root.child-1-1.ipynb" in links[0]
    child_nb = nbformat.read(tmp_path / "root.child-1-1.ipynb", as_version=4)
    nbformat.validate(child_nb)
    assert child_nb.metadata["kernel_env"]["depth"] == 1
    assert (tmp_path / "root.child-1-1.child-1-1.ipynb").exists()


@pytest.mark.parametrize("depth", [None, 0, 1])
async def test_rlm_query_past_max_depth_is_a_plain_llm_query(depth: int | None) -> None:
    """As upstream: with rlm_max_depth 1 (the default) or 0 no child runs; rlm_query and
    rlm_query_batched are plain model calls."""
    with FakeOpenAI(scripted_model) as server:
        backend = OpenAIBackend(server.url, "fake-model")
        async with AsyncKernelEnv(llm_backend=backend, step_timeout=30) as env:
            await env.reset(**({} if depth is None else {"rlm_max_depth": depth}))
            res = await env.execute("rlm_query('hello there'), rlm_query_batched(['a', 'b'])")
            out = res.observation.result.stdout
        await backend.aclose()
    assert (
        out.strip()
        == "('plain answer to: hello there', ['plain answer to: a', 'plain answer to: b'])"
    )
    assert len(server.requests) == 3


def test_default_depth_matches_upstream() -> None:
    """Upstream's example: with the default depth, rlm_query('World') is one model call."""
    calls: list[str] = []

    def llm(prompt: str) -> str:
        calls.append(prompt)
        return f"Response: {prompt[:20]}"

    with KernelEnv(llm_query_fn=llm) as env:
        env.reset()
        out = env.execute("print(rlm_query('World'))").observation.result.stdout
    assert out == "Response: World\n" and calls == ["World"]
