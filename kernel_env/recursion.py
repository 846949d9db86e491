"""``rlm_query``: a child episode in its own kernel, driven by the agent loop.

A kernel's ``rlm_query(prompt)`` asks the host; the host starts a child episode (a kernel from
the parent's source, so from the pool when there is one) whose ``context`` is the prompt, and
lets a *solver* solve it with the parent's model. The solver comes from the layer above (the
agent loop, ``kernel_env.agent.solve_child``, which the clients and the server pass in): the
episode layer never imports the loop that drives it. Without a solver, ``rlm_query`` is a plain
``llm_query``. The child's calls — its root model's and
its kernel's ``llm_query`` — count toward the parent's usage and budget. As in OpenEnv, the
root is depth 0 and a child at depth ``d`` runs only if ``d < max_depth``: the default
``max_depth`` of 1 runs none, and the call is a plain ``llm_query``. The child's record is
kept with the parent's step for export.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernel_env.llm import Budget, LLMBackend, Usage

if TYPE_CHECKING:
    from kernel_env.environment import EnvConfig, KernelEnvironment, KernelSource

__all__ = ["CHILD_TASK", "BackendForToken", "ChildEpisodes", "ChildSolver", "ParentLink"]

# Builds an episode's backend from the hf_token given at reset, and the model name.
BackendForToken = Callable[[str, str | None], LLMBackend]

CHILD_TASK = (
    "Answer the request in `context` (it is a sub-question from a parent agent). Inspect it "
    "with code and reply with the answer only, through FINAL(...)."
)


# Solves one child episode: (its environment, not yet reset; the model's backend; the prompt,
# which becomes the child's context; the model name; the link to the root) -> its answer.
ChildSolver = Callable[
    ["KernelEnvironment", LLMBackend, str, "str | None", "ParentLink"], Awaitable["str | None"]
]


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


class ChildEpisodes:
    """Runs the child episodes of one parent episode."""

    def __init__(
        self,
        config: EnvConfig,
        kernel_source: KernelSource,
        backend: LLMBackend,
        link: ParentLink,
        solver: ChildSolver,
    ) -> None:
        self.config = config
        self.kernel_source = kernel_source
        self.backend = backend
        self.link = link
        self.solver = solver

    async def run(self, prompt: str, model: str | None) -> tuple[str, list[Any]]:
        """The child's answer and its record (one child episode per call)."""
        from kernel_env.environment import KernelEnvironment  # it imports this module

        link = self.link.child()
        environment = KernelEnvironment(
            self.config,
            kernel_source=self.kernel_source,
            llm_backend=self.backend,
            parent=link,
            child_solver=self.solver,
        )
        try:
            answer = await self.solver(environment, self.backend, prompt, model, link)
        finally:
            await environment.close()
        record = environment.record
        if record is not None:
            record.depth = link.depth
        return answer or "", [record] if record is not None else []
