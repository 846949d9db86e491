"""``check_env``: does a client behave like an OpenEnv REPL environment?

A reusable conformance run (in the spirit of Gymnasium's ``check_env``) that any
``KernelEnv``, local or remote, must pass: reset, shared variables across steps, a bare last
expression shown, errors as data, state, a final answer, no step after the end, a fresh
namespace on the next reset, and an idempotent close. It raises :class:`ConformanceError`
naming the first broken expectation.
"""

from __future__ import annotations

from typing import Any

from kernel_env.errors import ConformanceError, KernelEnvError
from kernel_env.models import REPLObservation, REPLState

__all__ = ["ConformanceError", "check_env"]


def _expect(condition: bool, message: str, detail: Any = None) -> None:
    if not condition:
        raise ConformanceError(message if detail is None else f"{message}: {detail!r}")


def check_env(env: Any, *, close: bool = True) -> None:
    """Run the conformance sequence on a synchronous client (``KernelEnv``)."""
    result = env.reset(context="Hello World", task_prompt="Count the characters")
    obs = result.observation
    _expect(isinstance(obs, REPLObservation), "reset returns an observation", type(obs))
    _expect(not result.done and result.reward is None, "reset: not done, no reward")
    _expect(obs.context_length == 11, "reset: context_length", obs.context_length)
    _expect(obs.iteration == 0, "reset: iteration 0", obs.iteration)

    step = env.execute("x = 40")
    _expect(step.observation.result.success, "a plain assignment succeeds", step.observation)
    step = env.execute("x + len(context) - 9")
    _expect(
        "42" in step.observation.result.stdout,
        "a bare last expression is shown",
        step.observation.result.stdout,
    )
    _expect(
        "x" in step.observation.available_variables,
        "variables are listed",
        step.observation.available_variables,
    )

    step = env.execute("1/0")
    res = step.observation.result
    _expect(not res.success, "an error is reported as success=False")
    _expect(
        (res.exception or "").startswith("ZeroDivisionError"),
        "exception names the error",
        res.exception,
    )
    _expect(not step.done, "an error does not end the episode")

    state = env.state()
    _expect(isinstance(state, REPLState), "state() returns REPLState", type(state))
    _expect(state.step_count == 3, "state counts steps", state.step_count)
    _expect(bool(state.episode_id), "state has an episode id")

    final = env.submit_final_answer("11")
    _expect(final.done, "a submitted final answer ends the episode")
    _expect(
        final.observation.metadata.get("final_answer") == "11",
        "final answer in metadata",
        final.observation.metadata,
    )
    try:
        env.execute("x")
    except KernelEnvError:
        pass
    else:
        raise ConformanceError("a step after the episode ended must raise")

    env.reset(context="again")
    step = env.execute("'x' in globals()")
    _expect(
        "False" in step.observation.result.stdout,
        "reset gives a fresh namespace",
        step.observation.result.stdout,
    )
    if close:
        env.close()
        env.close()  # idempotent
