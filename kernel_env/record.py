"""The record of an episode: what each step ran and produced, for notebook export and logs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kernel_env.hostcalls import LLMCall

__all__ = ["AGENT", "JUPYTER", "EpisodeRecord", "StepRecord"]

# Who ran a step: the episode's own client (the agent, over any door but Jupyter's), or a
# person in a Jupyter frontend attached to its kernel. A person's cells are recorded, but are
# not the agent's iterations: they spend none of its budget and never end its episode.
AGENT = "agent"
JUPYTER = "jupyter"


@dataclass
class StepRecord:
    """One executed step."""

    index: int
    code: str
    outputs: list[dict[str, Any]]
    execution_count: int | None
    started: datetime
    finished: datetime
    duration: float
    status: str  # "ok" | "error" | "timeout" | "died" | "final"
    interrupted: bool = False
    restarted: bool = False
    llm_calls: list[LLMCall] = field(default_factory=list)
    reward: float | None = None
    final_answer: str | None = None
    note: str | None = None  # the prose the agent wrote before this code (markdown)
    author: str = AGENT  # AGENT, or JUPYTER: a cell run from an attached Jupyter frontend


@dataclass
class EpisodeRecord:
    """A whole episode: its parameters, steps and outcome (no secrets: no token is kept)."""

    episode_id: str
    task_prompt: str
    context: str
    max_iterations: int
    expected_answer: str | None = None
    llm_model: str | None = None
    seed: int | None = None
    kernel_backend: str = "local"
    depth: int = 0  # 0 for a root episode; n for an rlm_query child n levels down
    llm_usage: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    final_answer: str | None = None
    reward: float | None = None
    done: bool = False
    started: float = field(default_factory=time.time)  # the reset, seconds since the epoch
    agent_max_turns: int | None = None  # the driving agent's own budget of model turns
    # A fork's origin: {"episode_id", "steps" (the shared prefix), "method", "outputs_matched"}.
    forked_from: dict[str, Any] | None = None
    forks: list[str] = field(default_factory=list)  # episode ids of this episode's forks
    kernel_name: str = "python3"  # the kernelspec the episode ran in
    # The kernel's own language_info (kernel_info_reply), for exports of other languages.
    language_info: dict[str, Any] | None = None

    @property
    def iterations(self) -> int:
        """The agent's steps so far (the budget counts them; a person's cells are not)."""
        return sum(step.author == AGENT for step in self.steps)
