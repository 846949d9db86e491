"""``rlm_query``: a child episode in its own kernel, driven by the agent loop.

A kernel's ``rlm_query(prompt)`` asks the host; the host starts a child episode (a kernel from
the parent's source, so from the pool when there is one) whose ``context`` is the prompt, and
lets a *solver* solve it with the parent's model (``ChildSolver`` and ``ChildEpisodes``, in
:mod:`kernel_env.environment`, which runs them). The solver comes from the layer above (the
agent loop, ``kernel_env.agent.solve_child``, which the clients and the server pass in): the
episode layer never imports the loop that drives it. Without a solver, ``rlm_query`` is a plain
``llm_query``. The child's calls — its root model's and
its kernel's ``llm_query`` — count toward the parent's usage and budget. As in OpenEnv, the
root is depth 0 and a child at depth ``d`` runs only if ``d < max_depth``: the default
``max_depth`` of 1 runs none, and the call is a plain ``llm_query``. The child's record is
kept with the parent's step for export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernel_env.llm import Budget, LLMBackend, Usage

__all__ = ["CHILD_TASK", "BackendForToken", "ParentLink"]

# Builds an episode's backend from the hf_token given at reset, and the model name.
BackendForToken = Callable[[str, str | None], LLMBackend]

CHILD_TASK = (
    "Answer the request in `context` (it is a sub-question from a parent agent). Inspect it "
    "with code and reply with the answer only, through FINAL(...)."
)


@dataclass
class ParentLink:
    """What a child episode shares with its root: accounting and recursion limits."""

    usage: Usage
    budget: Budget | None
    depth: int
    max_depth: int
    max_iterations: int

    def child(self) -> ParentLink:
        return ParentLink(
            self.usage, self.budget, self.depth + 1, self.max_depth, self.max_iterations
        )
