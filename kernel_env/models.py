"""The data that crosses kernel_env's interfaces: actions, observations, state.

Field names follow OpenEnv's ``repl_env`` (the wire contract); kernel_env adds fields of its
own (rich ``outputs``, ``kernel_restarted``, ``state_lost``, ``timed_out``) that OpenEnv
clients ignore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_ITERATIONS",
    "CodeBlockResult",
    "REPLAction",
    "REPLObservation",
    "REPLState",
    "ResetOptions",
    "StepResult",
]


# The largest iteration budget a reset accepts: an episode that in practice never runs out of
# cells (an E2B sandbox's, an rlm episode's, whose own loops keep their budgets).
MAX_ITERATIONS = 100_000


class REPLAction(BaseModel):
    """One agent action: code to run, or a final answer submitted directly."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(default="", description="Python code to run in the episode's kernel.")
    is_final: bool = Field(
        default=False, description="Submit `final_answer` and end the episode; `code` is not run."
    )
    final_answer: str | None = Field(default=None, description="The answer, when `is_final`.")
    metadata: dict[str, Any] = Field(default_factory=dict)


class CodeBlockResult(BaseModel):
    """What running one code block produced, as text for the model plus rich outputs."""

    model_config = ConfigDict(extra="forbid")

    stdout: str = ""
    stderr: str = ""
    locals_snapshot: dict[str, str] = Field(default_factory=dict)
    execution_time: float = Field(default=0.0, ge=0)
    success: bool = True
    exception: str | None = None
    # kernel_env additions
    outputs: list[dict[str, Any]] = Field(
        default_factory=list, description="The cell's outputs as nbformat v4 output dicts."
    )
    execution_count: int | None = None
    timed_out: bool = False
    kernel_restarted: bool = Field(
        default=False, description="The kernel was restarted during this step (timeout or crash)."
    )
    state_lost: bool = Field(
        default=False, description="Variables from earlier steps are gone (the kernel restarted)."
    )


class REPLObservation(BaseModel):
    """What the agent sees after a reset or a step."""

    model_config = ConfigDict(extra="forbid")

    result: CodeBlockResult = Field(default_factory=CodeBlockResult)
    context_preview: str | None = None
    context_length: int = 0
    available_variables: list[str] = Field(default_factory=list)
    iteration: int = 0
    max_iterations: int = 30
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class REPLState(BaseModel):
    """The episode's state, as `GET /state` and `env.state()` report it."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str | None = None
    step_count: int = 0
    context: str | None = None
    task_prompt: str | None = None
    iteration: int = 0
    max_iterations: int = 30
    namespace_keys: list[str] = Field(default_factory=list)
    final_answer: str | None = None
    total_execution_time: float = 0.0
    # kernel_env additions
    done: bool = False
    reward: float | None = None
    kernel_restarts: int = 0
    llm_calls: int = 0
    llm_usage: dict[str, Any] = Field(default_factory=dict)


class ResetOptions(BaseModel):
    """The keyword arguments of ``reset()``, validated (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid")

    context: str = ""
    task_prompt: str = ""
    max_iterations: int = Field(default=30, ge=1, le=MAX_ITERATIONS)
    seed: int | None = Field(default=None, ge=0)
    episode_id: str | None = Field(default=None, max_length=255)
    hf_token: str | None = Field(default=None, repr=False, exclude=True)
    llm_model: str | None = None
    expected_answer: str | None = None
    rlm_max_depth: int = Field(default=1, ge=0, le=10)
    rlm_max_iterations: int | None = Field(default=None, ge=1)
    # kernel_env: an agent driving the episode (run_agent) counts model turns, the episode
    # counts cells; exports show the agent's budget as the user set it.
    agent_max_turns: int | None = Field(default=None, ge=1, le=100_000)
    # kernel_env: the episode's kernel, by its kernelspec name (Jupyter's term): python3, or
    # another language's kernel the environment offers (ir, bash, deno, ...).
    kernel_name: str = Field(default="python3", min_length=1, max_length=255)


ObsT = TypeVar("ObsT")


@dataclass
class StepResult(Generic[ObsT]):
    """What ``reset``/``step`` return on the client: OpenEnv's ``StepResult`` shape."""

    observation: ObsT
    reward: float | None = None
    done: bool = False
