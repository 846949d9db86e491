"""``EnvConfig``: how episodes run (timeouts, output limits, rewards, LLM budgets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kernel_env.inkernel.contract import (
    DEFAULT_DISPLAY_CHARS,
    DEFAULT_DISPLAY_COUNT,
    DEFAULT_OUTPUT_CAP,
)
from kernel_env.rubric import Rewards, Rubric, StepRubric

__all__ = ["EnvConfig"]


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """How episodes run. Defaults follow OpenEnv's repl_env where it has one."""

    step_timeout: float = 30.0  # below the 60 s an OpenEnv client waits for a reply
    max_output_length: int = 8192  # chars of stdout/stderr each, for the model
    context_preview_length: int = 500
    kernel_output_cap: int = DEFAULT_OUTPUT_CAP  # chars per stream per cell leaving the kernel
    max_code_chars: int = 1024 * 1024
    max_context_chars: int = 512 * 1024 * 1024
    inline_context_chars: int = 64 * 1024  # larger contexts travel as a file
    rewards: Rewards = field(default_factory=Rewards)
    success_reward: float = 1.0  # scales the rubric's score of a final answer
    # (answer, expected) -> score for final answers; or an OpenEnv rubric (upstream's
    # REPLRubric), which then gives every step's reward from (action, observation).
    rubric: Rubric | StepRubric | str | None = None
    llm_concurrency: int = 16
    llm_max_calls: int | None = None  # per-episode budget, children's calls included
    llm_max_tokens: int | None = None
    rlm_concurrency: int = 4  # child episodes of one rlm_query_batched at a time
    rlm_max_iterations: int = 10  # default for a child episode's agent loop
    # What one episode keeps of its cells' outputs (observations, record, export); each cell
    # is bounded first by the kernel and by kernel_env.outputs.MAX_STEP_OUTPUT*.
    # A server holds one record per open session: 16 M chars x max_sessions bounds its memory.
    max_episode_outputs: int = 5_000
    max_episode_output_chars: int = 16_000_000
    display_count: int = DEFAULT_DISPLAY_COUNT  # rich outputs a cell sends, at most
    display_chars: int = DEFAULT_DISPLAY_CHARS  # ... and their chars
    max_prompt_chars: int = 1_000_000  # one llm_query prompt
    # What llm_query says when no model is configured: who can configure one, and how.
    no_model_hint: str = "pass llm_query_fn or llm_backend to the environment"
    llm_allowed_models: tuple[str, ...] = ()  # besides the episode's own model
