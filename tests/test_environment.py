"""The episode (kernel_env/environment.py, hostcalls.py) against scripted in-process kernels:
the quick tier's reach into reset, step, the setup a request carries, final answers in each
dialect, llm_query over stdin, timeouts, a dead kernel and the iteration budget. The same
episodes in real kernels are in tests/test_episode.py and tests/test_upstream_compat.py."""

from __future__ import annotations

import json

import pytest

from kernel_env.environment import EnvConfig, KernelEnvironment
from kernel_env.errors import EpisodeFinished
from kernel_env.inkernel.contract import REQUEST_TAG, SETUP_METADATA
from kernel_env.kernel import Cell, ScriptedSource
from kernel_env.llm import ScriptedBackend
from kernel_env.models import REPLAction

CELLS = {
    "print('hi')": Cell(stdout="hi\n"),
    "FINAL('42')": Cell(final="42"),
    "print('FINAL(7)')": Cell(stdout="FINAL(7)\n"),
    "x = 'forty-two'; print('FINAL_VAR(x)')": Cell(
        stdout="FINAL_VAR(x)\n", variables={"x": "forty-two"}
    ),
    "answer['content'] = 'done'; answer['ready'] = True": Cell(
        answer={"content": "done", "ready": True}
    ),
    "1/0": Cell(error=("ZeroDivisionError", "division by zero")),
    "while True: pass": Cell(seconds=60),
    "import os; os._exit(1)": Cell(dies=True),
    "print(llm_query('capital of France?'))": Cell(queries=["capital of France?"]),
    "x = 1": Cell(variables={"x": "1"}),
}


def step(code: str) -> REPLAction:
    return REPLAction(code=code)


async def test_a_step_shows_its_output_and_the_episode_goes_on() -> None:
    """A reset takes a started kernel; a step's stdout is the observation's, with no reward
    beyond a plain step's and the episode not done."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(kernel_source=source)
    try:
        reset = await env.reset(context="some text", task_prompt="say hi")
        assert not reset.done and reset.context_length == len("some text")
        obs = await env.step(step("print('hi')"))
        assert (obs.result.stdout, obs.result.success, obs.done, obs.reward) == (
            "hi\n",
            True,
            False,
            0.0,
        )
        assert obs.iteration == 1
    finally:
        await env.close()


async def test_the_first_request_carries_the_setup_and_no_cell_is_added() -> None:
    """The episode's setup (context, seed, token) travels in the first execute_request's
    metadata: the kernel runs the agent's code and nothing else, and its state names the
    token, so the next request carries no setup."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(kernel_source=source)
    try:
        await env.reset(context="CONTEXT", seed=3)
        await env.step(step("x = 1"))
        obs = await env.step(step("print('hi')"))
        kernel = source.kernels[0]
        assert kernel.executed == ["x = 1", "print('hi')"]
        assert kernel._namespace["context"] == "CONTEXT"
        assert env._episode is not None and env._episode.setup is None
        assert "x" in obs.available_variables
    finally:
        await env.close()


async def test_a_long_context_is_staged_as_a_file() -> None:
    """A context over inline_context_chars travels as a staged file, not in the request."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(EnvConfig(inline_context_chars=10), kernel_source=source)
    try:
        await env.reset(context="a context longer than ten characters")
        await env.step(step("x = 1"))
        kernel = source.kernels[0]
        assert kernel.staged[".kernel_env_context.txt"].decode() == kernel._namespace["context"]
    finally:
        await env.close()


@pytest.mark.parametrize(
    ("code", "answer"),
    [
        ("FINAL('42')", "42"),
        ("print('FINAL(7)')", "7"),
        ("x = 'forty-two'; print('FINAL_VAR(x)')", "forty-two"),
        ("answer['content'] = 'done'; answer['ready'] = True", "done"),
    ],
)
async def test_each_final_answer_dialect_ends_the_episode(code: str, answer: str) -> None:
    """FINAL called or printed, FINAL_VAR printed, and answer["ready"] each end the episode
    with their answer, scored against the expected one."""
    env = KernelEnvironment(kernel_source=ScriptedSource(CELLS))
    try:
        await env.reset(context="c", expected_answer=answer)
        obs = await env.step(step(code))
        assert obs.done and obs.reward == 1.0
        assert env.record is not None and env.record.final_answer == answer
        with pytest.raises(EpisodeFinished):
            await env.step(step("print('hi')"))
    finally:
        await env.close()


async def test_a_wrong_final_answer_scores_zero_and_a_submitted_one_runs_no_code() -> None:
    """A final answer is scored against the expected one; one submitted with is_final ends
    the episode without running code."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(kernel_source=source)
    try:
        await env.reset(context="c", expected_answer="41")
        assert (await env.step(step("FINAL('42')"))).reward == 0.0
        await env.reset(context="c", expected_answer="41")
        obs = await env.step(REPLAction(is_final=True, final_answer="41"))
        assert obs.done and obs.reward == 1.0
        assert source.kernels[1].executed == []
    finally:
        await env.close()


async def test_llm_query_asks_the_host_over_stdin() -> None:
    """The kernel's llm_query is an input_request the host answers from its backend; the
    call is metered and kept with the step."""
    backend = ScriptedBackend(["Paris"])
    env = KernelEnvironment(kernel_source=ScriptedSource(CELLS), llm_backend=backend)
    try:
        await env.reset(context="c")
        obs = await env.step(step("print(llm_query('capital of France?'))"))
        assert obs.result.stdout == "Paris\n"
        assert backend.prompts == ["capital of France?"]
        assert env.record is not None
        assert env.record.llm_usage["calls"] == 1
        assert [c.prompt for c in env.record.steps[-1].llm_calls] == ["capital of France?"]
    finally:
        await env.close()


async def test_llm_query_without_a_model_fails_in_the_cell_not_the_host() -> None:
    """With no backend the host answers with an error the kernel raises: the step fails,
    the episode goes on."""
    env = KernelEnvironment(kernel_source=ScriptedSource(CELLS))
    try:
        await env.reset(context="c")
        obs = await env.step(step("print(llm_query('capital of France?'))"))
        assert not obs.result.success and not obs.done
        assert obs.reward == -0.05
    finally:
        await env.close()


async def test_a_timeout_interrupts_and_keeps_the_state() -> None:
    """A step past step_timeout is interrupted: the observation says it timed out, the
    kernel was not restarted, and the episode goes on."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(EnvConfig(step_timeout=0.2), kernel_source=source)
    try:
        await env.reset(context="c")
        obs = await env.step(step("while True: pass"))
        assert obs.result.timed_out and not obs.result.kernel_restarted
        assert obs.result.exception == "TimeoutError: the cell exceeded the step timeout"
        assert "was interrupted" in obs.result.stderr
        assert env.stats.timeouts == 1 and env.stats.restarts == 0
        assert (await env.step(step("print('hi')"))).result.stdout == "hi\n"
    finally:
        await env.close()


async def test_a_dead_kernel_is_restarted_and_set_up_again() -> None:
    """A kernel that dies mid-step is restarted; the observation says state was lost, and
    the episode's setup travels again with the next request."""
    source = ScriptedSource(CELLS)
    env = KernelEnvironment(kernel_source=source)
    try:
        await env.reset(context="CONTEXT")
        obs = await env.step(step("import os; os._exit(1)"))
        assert obs.result.kernel_restarted and obs.result.state_lost
        assert env.stats.restarts == 1 and not obs.done
        kernel = source.kernels[0]
        assert kernel.launches == 2 and kernel._namespace["context"] == "CONTEXT"
        assert (await env.step(step("print('hi')"))).result.stdout == "hi\n"
    finally:
        await env.close()


async def test_the_iteration_budget_ends_the_episode() -> None:
    """The last allowed step without a final answer ends the episode, says so and is
    rewarded as an exhausted budget."""
    env = KernelEnvironment(kernel_source=ScriptedSource(CELLS))
    try:
        await env.reset(context="c", max_iterations=2)
        assert not (await env.step(step("print('hi')"))).done
        obs = await env.step(step("1/0"))
        assert obs.done and obs.reward == -0.1
        assert "Maximum iterations (2) reached." in obs.result.stdout
    finally:
        await env.close()


async def test_the_scripted_kernel_keeps_the_contract() -> None:
    """What the scripted kernel reads and answers is the contract's: the setup metadata key
    and the tagged stdin request."""
    source = ScriptedSource({"q": Cell(queries=["p"])})
    kernel = await source()
    try:
        setup = {SETUP_METADATA: json.dumps({"token": "t", "context": "ctx"})}
        requests: list[str] = []

        async def host(prompt: str) -> str:
            requests.append(prompt)
            return json.dumps({"ok": True, "result": "r"})

        result = await kernel.execute("q", stdin=host, metadata=setup)
        assert result.stdout == "r\n"
        assert requests == [REQUEST_TAG + json.dumps({"op": "llm_query", "args": {"prompt": "p"}})]
    finally:
        await kernel.shutdown()
