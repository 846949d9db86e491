"""An episode's model calls: the backend that answers them (the environment's, or one built
for the hf_token a reset brings), the accounts they are charged to (a root episode's usage
and budget, shared with its forks and its ``rlm_query`` children), and the
:class:`~kernel_env.hostcalls.HostCalls` that serves each episode's kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernel_env.config import EnvConfig
from kernel_env.hostcalls import HostCalls, LLMBatchFn, RLMRunner
from kernel_env.llm import Budget, LLMBackend, Usage
from kernel_env.models import ResetOptions
from kernel_env.recursion import BackendForToken, ParentLink

__all__ = ["ChildRunner", "EpisodeCalls"]

# Answers rlm_query with child episodes that call ``backend`` and are charged to ``link``.
ChildRunner = Callable[[LLMBackend, ParentLink], RLMRunner]


class EpisodeCalls:
    """The model calls of one environment's episodes, one episode at a time."""

    def __init__(
        self,
        config: EnvConfig,
        *,
        backend: LLMBackend | None,
        batch_fn: LLMBatchFn | None,
        backend_for_token: BackendForToken | None,
        parent: ParentLink | None,
        children: ChildRunner | None,
    ) -> None:
        self.config = config
        self.batch_fn = batch_fn
        self._backend = backend
        self._backend_for_token = backend_for_token
        self._parent = parent
        self._children = children
        self._token_backend: LLMBackend | None = None
        self.link: ParentLink | None = None  # the episode's accounts, shared with its forks

    @property
    def backend(self) -> LLMBackend | None:
        """The current episode's backend (what its forks and children call)."""
        return self._token_backend or self._backend

    async def open(self, opts: ResetOptions) -> HostCalls:
        """The host calls of a new episode started by ``opts``."""
        await self.aclose()
        if opts.hf_token and self._backend_for_token is not None:
            # The token goes into this episode's backend and nowhere else: not the record, the
            # state, a log, or the kernel.
            self._token_backend = self._backend_for_token(opts.hf_token, opts.llm_model)
        backend, config = self.backend, self.config
        link = self.link = self._parent or ParentLink(
            usage=Usage(),
            budget=Budget(config.llm_max_calls, config.llm_max_tokens),
            depth=0,
            max_depth=opts.rlm_max_depth,
            max_iterations=opts.rlm_max_iterations or config.rlm_max_iterations,
        )
        runner = None
        if backend is not None and self._children is not None and link.may_recurse:
            runner = self._children(backend, link)
        return HostCalls(
            backend=backend,
            usage=link.usage,
            budget=link.budget,
            batch_fn=self.batch_fn,
            rlm=runner,
            max_concurrency=config.llm_concurrency,
            rlm_concurrency=config.rlm_concurrency,
            default_model=opts.llm_model,
            allowed_models=self._allowed_models(opts, backend),
            max_prompt_chars=config.max_prompt_chars,
            no_model_hint=config.no_model_hint,
        )

    def _allowed_models(
        self, opts: ResetOptions, backend: LLMBackend | None
    ) -> frozenset[str] | None:
        # A backend that routes model names itself (rlm's LM handler knows which models it
        # serves) is given whatever name a cell asks for.
        if getattr(backend, "routes_models", False) is True:
            return None
        allowed = {*self.config.llm_allowed_models, opts.llm_model, getattr(backend, "model", None)}
        return frozenset(m for m in allowed if isinstance(m, str) and m)

    def model_note(self, opts: ResetOptions) -> dict[str, Any]:
        """Reset metadata naming the model an hf_token episode calls when the reset named
        none (OpenEnv's repl_env default, unless the server has one)."""
        model = getattr(self._token_backend, "model", None)
        if not opts.hf_token or opts.llm_model or not isinstance(model, str):
            return {}
        return {"llm_model": model, "llm_model_defaulted": True}

    async def aclose(self) -> None:
        """Close the backend built for an episode's token, if any; idempotent."""
        backend, self._token_backend = self._token_backend, None
        if backend is not None:
            await backend.aclose()
