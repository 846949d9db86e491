"""The RLM agent loop: pure helpers on plain data, then whole runs in real kernels with a root
model served by a loopback OpenAI-compatible server (or the shipped ScriptedBackend)."""

from __future__ import annotations

import json
from typing import Any

import nbformat
import pytest
from fake_openai import FakeOpenAI

from kernel_env import AsyncKernelEnv, CodeBlockResult
from kernel_env.agent import (
    FINAL_REQUEST,
    NO_CODE,
    Iteration,
    extract_code_blocks,
    first_messages,
    format_observation,
    run_agent,
    text_final,
    turn_feedback,
)
from kernel_env.llm import Budget, OpenAIBackend, ScriptedBackend, Usage, as_query_fn

pytestmark = pytest.mark.timeout(60)

KEY = "sk-agent-test-0d9e8c7b"


# -- pure helpers ----------------------------------------------------------------------------


def test_code_blocks_come_from_repl_and_python_fences_in_order() -> None:
    """```repl and ```python blocks are extracted in order; other languages and bare fences not."""
    reply = (
        "First:\n```repl\nx = 1\n```\nthen\n```python\ns = '```'\nx\n```\n"
        "```bash\nls\n```\n```\nplain\n```\n```PY\ny = 2\n```\n```repl\nunclosed = 1\n"
    )
    assert extract_code_blocks(reply) == ["x = 1\n", "s = '```'\nx\n", "y = 2\n"]


def test_a_final_answer_written_as_text_starts_a_line_outside_code() -> None:
    """FINAL(...) / FINAL_VAR(name) count at a line start outside code, not in prose or code."""
    assert text_final("Done.\nFINAL(the answer is f(x))") == ("value", "the answer is f(x)")
    assert text_final('**FINAL("Paris")**') == ("value", "Paris")
    assert text_final("```repl\ntotal = 3\n```\nFINAL_VAR(total)") == ("variable", "total")
    assert text_final("I will call FINAL(x) when done.") is None
    assert text_final("```repl\nFINAL(3)\n```") is None
    assert text_final("FINAL()") is None


def test_first_messages_give_metadata_not_the_context() -> None:
    """The model is told the context's size and a short preview, never the whole of it."""
    context = "abc\n" * 10_000
    system, user = first_messages("Count lines.", context, max_iterations=7, preview_chars=40)
    assert system["role"] == "system" and "bare expression" in system["content"]
    assert "40,000 characters in 10,001 lines" in user["content"]
    assert repr(context[:40]) in user["content"] and context[:100] not in user["content"]
    assert "Count lines." in user["content"] and "7 replies" in user["content"]


def test_observations_are_truncated_and_say_what_failed() -> None:
    """A cell's text is head+tail truncated; an error without stderr is named."""
    long = format_observation(CodeBlockResult(stdout="x" * 1000), 100)
    assert long.startswith("x" * 50) and "truncated" in long and len(long) < 200
    failed = CodeBlockResult(success=False, exception="NameError: name 'y' is not defined")
    assert format_observation(failed, 100) == "[error] NameError: name 'y' is not defined"
    assert format_observation(CodeBlockResult(), 100) == "(no output)"
    assert turn_feedback([], 1, 5) == NO_CODE
    assert turn_feedback(["a", "b"], 2, 5).startswith("Output of block 1:\na\n\nOutput of block 2")


# -- whole runs ------------------------------------------------------------------------------


def needle_context() -> str:
    return "\n".join(f"line {i}: {'needle' if i % 7 == 0 else 'hay'}" for i in range(400))


ROOT_TURNS = [
    "Let me look at the context.\n```repl\nprint(len(context))\ncontext[:60]\n```",
    "Now count per chunk.\n"
    "```repl\nlines = context.splitlines()\n"
    "chunks = ['\\n'.join(lines[i:i + 50]) for i in range(0, len(lines), 50)]\n"
    "counts = llm_query_batched(['How many marked lines?\\n' + c for c in chunks])\n```\n"
    "```python\ntotal = sum(int(c) for c in counts)\nFINAL_VAR('total')\n```",
]


def scripted_models(body: dict[str, Any]) -> str:
    """The root model follows ROOT_TURNS; the sub-model counts the marker in its chunk."""
    messages = body["messages"]
    if body["model"] == "sub-model":
        return str(messages[-1]["content"].count("needle"))
    turn = sum(m["role"] == "assistant" for m in messages)
    if turn == 1 and not messages[-1]["content"].startswith("Output:\n"):
        return "FINAL(unexpected feedback)"
    return ROOT_TURNS[turn] if turn < len(ROOT_TURNS) else "FINAL(too many turns)"


@pytest.mark.integration
async def test_root_model_inspects_the_context_batches_chunks_and_answers(tmp_path) -> None:
    """Root model over loopback HTTP: inspects, llm_query_batched over chunks, FINAL_VAR."""
    context = needle_context()
    expected = str(context.count("needle"))
    usage, seen = Usage(), []

    async def on_iteration(turn: Iteration) -> None:
        seen.append((turn.index, turn.kind, len(turn.code_blocks)))

    path = tmp_path / "run" / "trajectory.jsonl"
    with FakeOpenAI(scripted_models) as server:
        async with OpenAIBackend(server.url, "root-model", api_key=KEY) as backend:
            sub = as_query_fn(backend, usage, model="sub-model")
            async with AsyncKernelEnv(llm_query_fn=sub, step_timeout=10) as env:
                result = await run_agent(
                    env,
                    backend,
                    context=context,
                    task="How many lines say needle?",
                    usage=usage,
                    on_iteration=on_iteration,
                    trajectory_path=path,
                    expected_answer=expected,
                )
                state = (await env.state()).model_dump_json()
    assert (result.answer, result.stop_reason, result.reward) == (expected, "final", 1.0)
    assert seen == [(1, "turn", 1), (2, "turn", 2)]
    root = [r for r in server.requests if r.body["model"] == "root-model"]
    subs = [r for r in server.requests if r.body["model"] == "sub-model"]
    assert len(root) == 2 and len(subs) == 8 and usage.calls == 10 and usage.total_tokens > 0
    first_prompt = json.dumps(root[0].body)
    assert f"{len(context):,} characters" in first_prompt and "line 399" not in first_prompt
    # The first cell's output came back in the second request.
    assert root[1].body["messages"][-1]["content"].startswith(f"Output:\n{len(context)}\n")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["index"] for line in lines] == [1, 2]
    assert lines[0]["messages"][0]["role"] == "system" and lines[1]["messages"][0]["role"] == "user"
    assert lines[1]["final_answer"] == expected and lines[1]["usage"]["calls"] == 10
    # S1: the key travels only in the Authorization header.
    assert {r.headers["authorization"] for r in server.requests} == {f"Bearer {KEY}"}
    for text in [path.read_text(), state, *(r.raw for r in server.requests)]:
        assert KEY not in text


@pytest.mark.integration
async def test_out_of_iterations_the_model_is_asked_once_for_an_answer(tmp_path) -> None:
    """After max_iterations the model is asked for a final answer, which is submitted."""
    backend = ScriptedBackend(["```repl\nx = 1\n```", "```python\nx += 1\nx\n```", "FINAL(2)"])
    seen: list[str] = []
    async with AsyncKernelEnv(step_timeout=10) as env:
        result = await run_agent(
            env,
            backend,
            context="some text",
            task="t",
            max_iterations=2,
            expected_answer="2",
            on_iteration=lambda turn: seen.append(turn.kind),
        )
    assert (result.answer, result.stop_reason, result.reward) == ("2", "max_iterations", 1.0)
    assert seen == ["turn", "turn", "final_request"] and result.iterations == 3
    assert backend.prompts[2].endswith(FINAL_REQUEST) and "Output:\n2" in backend.prompts[2]


@pytest.mark.integration
async def test_a_text_final_var_after_code_is_read_from_the_kernel() -> None:
    """A reply without code is told so; FINAL_VAR(x) as text after a block answers with x."""
    backend = ScriptedBackend(["Let me think.", "```python\nx = 6 * 7\n```\nFINAL_VAR(x)"])
    async with AsyncKernelEnv(step_timeout=10) as env:
        result = await run_agent(env, backend, context="c", task="6 times 7?")
    assert (result.answer, result.stop_reason, result.iterations) == ("42", "final", 2)
    assert backend.prompts[1].endswith(NO_CODE)


@pytest.mark.integration
async def test_budget_and_time_limits_stop_the_loop() -> None:
    """A spent LLM budget or time limit ends the run without an answer."""
    usage = Usage()
    backend = ScriptedBackend(lambda _: "```repl\n1 + 1\n```")
    async with AsyncKernelEnv(step_timeout=10) as env:
        spent = await run_agent(
            env, backend, context="c", task="t", usage=usage, budget=Budget(max_calls=1)
        )
        late = await run_agent(env, backend, context="c", task="t", time_limit=0)
    assert (spent.stop_reason, spent.answer, spent.iterations) == ("budget", None, 1)
    assert usage.calls == 1
    assert (late.stop_reason, late.iterations) == ("time_limit", 0)


@pytest.mark.integration
async def test_the_export_tells_the_whole_story(tmp_path) -> None:
    """The model's prose goes in as markdown before each cell, the task is the notebook's
    title (and the HTML page's), and the steps line shows the agent's budget as set."""
    backend = ScriptedBackend(
        [
            "First I count the words.\n```repl\nn = len(context.split())\n```\n"
            "Then I print it.\n```python\nprint(n)\n```",
            "FINAL_VAR(n)",
        ]
    )
    async with AsyncKernelEnv(step_timeout=10) as env:
        await run_agent(env, backend, context="a b c", task="How many words?", max_iterations=7)
        path = await env.export_notebook(tmp_path / "story.ipynb")
    nb = nbformat.read(path, as_version=4)
    sources = [(c.cell_type, c.source) for c in nb.cells]
    notes = [i for i, (kind, text) in enumerate(sources) if text == "First I count the words."]
    assert notes and sources[notes[0]][0] == "markdown"
    assert sources[notes[0] + 1] == ("code", "n = len(context.split())\n")
    assert ("markdown", "Then I print it.") in sources
    assert nb.metadata["title"] == "How many words?" and sources[0][1].startswith("# How many")
    assert "the agent's budget: 7 model turns" in sources[-1][1]
    from kernel_env.notebook import write_html

    assert "<title>How many words?</title>" in write_html(path).read_text()
