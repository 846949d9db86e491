"""``rlm_query``: a child episode in its own kernel, driven by the agent loop.

A kernel's ``rlm_query(prompt)`` asks the host; the host starts a child episode (a kernel from
the parent's source, so from the pool when there is one) whose ``context`` is the prompt, and
lets a *solver* solve it with the parent's model (``ChildSolver``; ``ChildEpisodes`` runs
them). The solver comes from the layer above (the
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
from typing import Any, Generic, Protocol, TypeVar

from kernel_env.llm import Budget, LLMBackend, Usage
from kernel_env.record import EpisodeRecord

__all__ = ["CHILD_TASK", "BackendForToken", "ChildEpisodes", "ChildSolver", "ParentLink"]

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

    @property
    def may_recurse(self) -> bool:
        """A child of this episode may run (OpenEnv's meaning: one at depth d + 1 runs only
        if d + 1 < max_depth, so the default of 1 runs none)."""
        return self.depth + 1 < self.max_depth


class ChildEnvironment(Protocol):
    """What :class:`ChildEpisodes` needs of a child's environment."""

    @property
    def record(self) -> EpisodeRecord | None: ...

    async def close(self) -> None: ...


Env = TypeVar("Env", bound=ChildEnvironment)

# Solves one child episode: (its environment, not yet reset; the model's backend; the prompt,
# which becomes the child's context; the model name; the link to the root) -> its answer.
ChildSolver = Callable[[Env, LLMBackend, str, "str | None", ParentLink], Awaitable["str | None"]]


class ChildEpisodes(Generic[Env]):
    """Runs the child episodes of one parent episode, each in an environment of its own that
    ``new_environment(backend, link)`` builds (calling ``backend``, charged to ``link``)."""

    def __init__(
        self,
        new_environment: Callable[[LLMBackend, ParentLink], Env],
        backend: LLMBackend,
        link: ParentLink,
        solver: ChildSolver[Env],
    ) -> None:
        self.new_environment = new_environment
        self.backend = backend
        self.link = link
        self.solver = solver

    async def run(self, prompt: str, model: str | None) -> tuple[str, list[Any]]:
        """The child's answer and its record (one child episode per call)."""
        link = self.link.child()
        environment = self.new_environment(self.backend, link)
        try:
            answer = await self.solver(environment, self.backend, prompt, model, link)
        finally:
            await environment.close()
        record = environment.record
        if record is not None:
            record.depth = link.depth
        return answer or "", [record] if record is not None else []
