"""``rlm_query``: a child episode in its own kernel, driven by the agent loop.

A kernel's ``rlm_query(prompt)`` asks the host; the host starts a child episode (a kernel from
the parent's source, so from the pool when there is one) whose ``context`` is the prompt, and
lets the agent loop solve it with the parent's model. The child's calls — its root model's and
its kernel's ``llm_query`` — count toward the parent's usage and budget. As in OpenEnv, the
root is depth 0 and a child at depth ``d`` runs only if ``d < max_depth``: the default
``max_depth`` of 1 runs none, and the call is a plain ``llm_query``. The child's record is
kept with the parent's step for export.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernel_env.llm import Budget, LLMBackend, Usage

if TYPE_CHECKING:
    from kernel_env.environment import EnvConfig, KernelSource

__all__ = ["CHILD_TASK", "BackendForToken", "ChildEpisodes", "ParentLink"]

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


class ChildEpisodes:
    """Runs the child episodes of one parent episode."""

    def __init__(
        self,
        config: EnvConfig,
        kernel_source: KernelSource,
        backend: LLMBackend,
        link: ParentLink,
    ) -> None:
        self.config = config
        self.kernel_source = kernel_source
        self.backend = backend
        self.link = link

    async def run(self, prompt: str, model: str | None) -> tuple[str, list[Any]]:
        """The child's answer and its record (one child episode per call)."""
        # Imported here: the environment imports this module.
        from kernel_env.agent import run_agent
        from kernel_env.client import AsyncKernelEnv
        from kernel_env.environment import KernelEnvironment

        link = self.link.child()
        environment = KernelEnvironment(
            self.config,
            kernel_source=self.kernel_source,
            llm_backend=self.backend,
            parent=link,
        )
        env = AsyncKernelEnv.wrapping(environment)
        try:
            result = await run_agent(
                env,
                self.backend,
                context=prompt,
                task=CHILD_TASK,
                max_iterations=link.max_iterations,
                model=model,
                usage=link.usage,
                budget=link.budget,
            )
        finally:
            await env.close()
        record = environment.record
        if record is not None:
            record.depth = link.depth
        return result.answer or "", [record] if record is not None else []
