"""Behaviours a user of OpenEnv's ``repl_env`` can tell apart, matched (issue 15, item 3):
the ``answer`` variable, the helpers' persistence, lifecycle errors, ``rubric=``, the
iteration budget's message, and output truncation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kernel_env import ClientClosed, EnvConfig, KernelEnv, ResetNeeded

# OpenEnv's rubrics come with openenv-core, in the dev extra (make test), not the test extra.
Rubric = pytest.importorskip("openenv.core.rubrics.base").Rubric

pytestmark = pytest.mark.integration  # kernels, servers or other processes


@pytest.fixture(scope="module")
def env() -> Iterator[KernelEnv]:
    """One client for the module; every test resets it (a fresh kernel each time)."""
    with KernelEnv(llm_query_fn=lambda p: f"echo:{p}", step_timeout=10) as client:
        yield client


# -- a user variable named `answer` -----------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "print(FINAL(answer))",  # upstream README's own example
        "FINAL(answer)",
        "print(f'FINAL({answer})')",
        "FINAL_VAR('answer')",
        "print(FINAL_VAR('answer'))",
        "print('FINAL_VAR(answer)')",
    ],
)
def test_final_answer_of_a_variable_named_answer(env: KernelEnv, code: str) -> None:
    """`answer = 42` in one step, then any final-answer form naming it, gives '42'."""
    env.reset(expected_answer="42")
    assert not env.execute("answer = 42").done
    result = env.execute(code)
    assert result.done and result.observation.metadata["final_answer"] == "42"
    assert result.reward == 1.0


def test_answer_dict_form_still_ends_the_episode(env: KernelEnv) -> None:
    """`answer = {"content": ..., "ready": True}` rebinding the whole dict ends the episode."""
    env.reset()
    result = env.execute("answer = {'content': 42, 'ready': True}")
    assert result.done and result.observation.metadata["final_answer"] == "42"


# -- which names persist ---------------------------------------------------------------------


def test_context_and_answer_are_user_data(env: KernelEnv) -> None:
    """As upstream, `context` and `answer` are plain variables: rebinding one persists, and
    deleting one lasts (NameError on the next step)."""
    env.reset(context="original")
    env.execute("context = 'mine'\nanswer = [1, 2]")
    assert env.execute("print(context, answer)").observation.result.stdout == "mine [1, 2]\n"
    env.execute("del context, answer")
    gone = env.execute("context").observation.result
    assert not gone.success and "NameError" in (gone.exception or "")
    assert "NameError" in (env.execute("answer").observation.result.exception or "")


def test_helper_functions_come_back_next_step(env: KernelEnv) -> None:
    """Rebinding or deleting a helper function lasts only until the next step (upstream refuses
    the assignment outright; real Python cannot, so the helper is put back)."""
    env.reset()
    env.execute("llm_query = None\ndel FINAL")
    out = env.execute("print(callable(llm_query), callable(FINAL))").observation.result.stdout
    assert out == "True True\n"


# -- lifecycle errors -------------------------------------------------------------------------


def test_state_before_reset_raises_runtime_error() -> None:
    """As upstream, state before any reset raises a RuntimeError (ResetNeeded)."""
    with KernelEnv() as fresh:
        with pytest.raises(ResetNeeded) as raised:
            fresh.state()
        assert isinstance(raised.value, RuntimeError)
        with pytest.raises(RuntimeError):
            fresh.execute("1")


def test_every_call_after_close_raises_runtime_error() -> None:
    """After close(), step, state and reset raise RuntimeError (ClientClosed)."""
    closed = KernelEnv()
    closed.reset()
    closed.close()
    for call in (lambda: closed.execute("1"), closed.state, closed.reset):
        with pytest.raises(ClientClosed) as raised:
            call()
        assert isinstance(raised.value, RuntimeError)


# -- rubric= ------------------------------------------------------------------------------------


class _UpstreamStyleRubric(Rubric):
    """An OpenEnv RFC 004 rubric shaped like upstream's REPLRubric: `set_expected`, then
    `forward(action, observation)` on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: str | None = None
        self.seen: list[tuple[bool, Any]] = []

    def set_expected(self, expected: str | None) -> None:
        self.expected = expected

    def forward(self, action: Any, observation: Any) -> float:
        self.seen.append((observation.done, observation.metadata.get("final_answer")))
        if not observation.done:
            return 0.5 if observation.result.success else -0.5
        final = observation.metadata.get("final_answer")
        return 2.0 if final is not None and final == self.expected else -1.0


def test_rubric_keyword_takes_a_callable() -> None:
    """KernelEnv(rubric=fn) scores final answers with fn(answer, expected)."""
    with KernelEnv(rubric=lambda answer, expected: answer.startswith(expected)) as client:
        client.reset(expected_answer="4")
        assert client.submit_final_answer("42").reward == 1.0


def test_rubric_keyword_takes_an_openenv_rubric() -> None:
    """An OpenEnv Rubric (upstream's REPLRubric interface) gives every step's reward."""
    rubric = _UpstreamStyleRubric()
    with KernelEnv(rubric=rubric) as client:
        client.reset(expected_answer="7")
        assert client.execute("x = 7").reward == 0.5
        assert client.execute("1 / 0").reward == -0.5
        last = client.execute("FINAL(x)")
    assert last.done and last.reward == 2.0
    assert rubric.seen == [(False, None), (False, None), (True, "7")]


def test_a_rubric_that_raises_scores_zero_and_the_step_counts() -> None:
    """A rubric that raises on FINAL(...) does not lose the step: it is counted, the episode
    is done, the reward is 0 and the observation's metadata says what the rubric raised."""

    def broken(answer: str, expected: str) -> float:
        raise KeyError("no such grader")

    with KernelEnv(rubric=broken) as client:
        client.reset(expected_answer="7")
        result = client.execute("FINAL(7)")
        assert result.done and result.reward == 0.0
        assert "KeyError" in result.observation.metadata["rubric_error"]
        state = client.state()
        assert state.step_count == 1 and state.done and state.final_answer == "7"


def test_an_openenv_rubric_that_raises_scores_zero_and_the_step_counts() -> None:
    """The same for an OpenEnv rubric raising in forward(): every step still completes."""

    class Broken(_UpstreamStyleRubric):
        def forward(self, action: Any, observation: Any) -> float:
            raise RuntimeError("grader offline")

    with KernelEnv(rubric=Broken()) as client:
        client.reset(expected_answer="7")
        first = client.execute("x = 7")
        assert first.reward == 0.0
        assert "grader offline" in first.observation.metadata["rubric_error"]
        assert client.execute("FINAL(x)").done
        assert client.state().step_count == 2


# -- the iteration budget -------------------------------------------------------------------


def test_budget_end_says_so_in_stdout(env: KernelEnv) -> None:
    """The step that spends the budget ends the episode and says so in stdout, after the
    cell's own output."""
    env.reset(max_iterations=2)
    env.execute("x = 1")
    last = env.execute("print('last')")
    assert last.done and last.reward == pytest.approx(-0.1)
    assert last.observation.result.stdout == "last\nMaximum iterations (2) reached.\n"


def test_budget_end_takes_a_partial_answer(env: KernelEnv) -> None:
    """As upstream, an answer["content"] left unfinished is the final answer at the budget's
    end, scored by the rubric."""
    env.reset(max_iterations=1, expected_answer="partial")
    last = env.execute("answer['content'] = 'partial'")
    assert last.done and last.observation.metadata["final_answer"] == "partial"
    assert last.reward == 1.0


# -- max_output_length -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"max_output_length": 100}, {"config": EnvConfig(max_output_length=100)}],
    ids=["keyword", "config"],
)
def test_max_output_length_is_honoured_and_reported(options: dict[str, Any]) -> None:
    """Output beyond max_output_length is cut, and the observation says how much."""
    with KernelEnv(**options) as client:
        client.reset()
        obs = client.execute("print('x' * 1000)\nimport sys; print('e' * 300, file=sys.stderr)")
    result = obs.observation.result
    marker = "\n... (truncated: 901 of 1001 chars cut) ...\n"
    assert marker in result.stdout and len(result.stdout.replace(marker, "")) == 100
    assert len(result.stderr.replace("\n... (truncated: 201 of 301 chars cut) ...\n", "")) == 100
    assert obs.observation.metadata["truncated"] == {"stdout": 901, "stderr": 201}


def test_reset_says_what_is_ready(env: KernelEnv) -> None:
    """The reset observation's stdout is upstream's message: context size, task, answer."""
    out = env.reset(context="Hello", task_prompt="Count").observation.result.stdout
    assert out == (
        "REPL environment initialized.\n"
        "Context loaded (5 chars). Use 'context' variable to access it.\n"
        "Task: Count\n"
        "Use answer['content'] to store your answer, and set answer['ready'] = True when done."
    )
