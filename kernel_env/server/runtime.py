"""What a running server owns: its kernel pool, its sessions, its model and its forkserver.

Every door (:mod:`.openenv`, :mod:`.e2b`) and the operator's routes reach it through
``app.state.runtime``; it is created in the app's lifespan, on the app's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kernel_env.agent import solve_child
from kernel_env.environment import EnvConfig, KernelEnvironment
from kernel_env.kernel.base import KernelSource
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.pool import KernelPool
from kernel_env.languages.catalog import served_kernels
from kernel_env.llm import HF_DEFAULT_MODEL, LLMBackend, OpenAIBackend, huggingface_router
from kernel_env.recursion import BackendForToken
from kernel_env.server.auth import DEFAULT_TENANT, Tenant
from kernel_env.server.sessions import SessionManager
from kernel_env.server.settings import ServerSettings
from kernel_env.server.store import EpisodeStore
from kernel_env.server.tenant_pools import TenantPools

__all__ = ["Runtime", "describe_kernels", "llm_backend_from"]

# On shutdown, seconds a pool's kernel start in flight may take to finish before it is
# cancelled: the whole stop must fit in what ``docker stop`` grants (10 s) after the drain of
# steps, and a kernel slow to come up (a cold start on a loaded machine) took longer.
_SHUTDOWN_START_GRACE = 2.0


def llm_backend_from(settings: ServerSettings) -> LLMBackend | None:
    """The server's model for ``llm_query``, when ``llm_base_url`` is set."""
    if not settings.llm_base_url or not settings.llm_model:
        return None
    return OpenAIBackend(settings.llm_base_url, settings.llm_model, api_key=settings.llm_api_key)


def _token_backends(settings: ServerSettings) -> BackendForToken:
    """A reset's ``hf_token`` -> that episode's backend: Hugging Face's router (or
    ``hf_router_url``) with the token as key. The token lives in that backend only."""

    def build(token: str, model: str | None) -> LLMBackend:
        # As OpenEnv's repl_env: without llm_model, its default model (the reset's
        # observation metadata says which model was used).
        model = model or settings.llm_model or HF_DEFAULT_MODEL
        if settings.hf_router_url is None:
            return huggingface_router(token, model)
        return OpenAIBackend(settings.hf_router_url, model, api_key=token)

    return build


class Runtime:
    """Everything the app owns while it runs; created in the lifespan, on the app's loop.

    ``tenant_sources`` (a tenant's name -> kernels started as that user): gateway kernels
    per tenant, each tenant with a warm pool of its own (:mod:`.tenant_pools`); the shared
    pool then serves the ``KERNEL_ENV_TOKEN`` operator only, and keeps none warm without one.
    """

    def __init__(
        self,
        settings: ServerSettings,
        kernel_factory: KernelSource,
        forkserver: ForkServer | None = None,
        tenant_sources: Callable[[str], KernelSource] | None = None,
    ) -> None:
        self.settings = settings
        self.forkserver = forkserver
        self.tenant_pools = (
            None
            if tenant_sources is None
            else TenantPools(
                tenant_sources, size=settings.pool_size, max_kernels=settings.kernel_limit
            )
        )
        shared_warm = self.tenant_pools is None or settings.token is not None
        self.pool = KernelPool(
            kernel_factory,
            size=settings.pool_size if shared_warm else 0,
            max_kernels=settings.kernel_limit,
        )
        # Other languages' kernels (--kernels), each with a small warm pool of its own.
        self.kernels, self.language_pools = served_kernels(
            settings, self.pool.acquire, pool_size=min(settings.pool_size, 1)
        )
        self.llm = llm_backend_from(settings)
        config = EnvConfig(
            step_timeout=settings.step_timeout,
            max_code_chars=settings.max_code_chars,
            max_context_chars=settings.max_context_chars,
            llm_max_calls=settings.llm_max_calls,
            llm_max_tokens=settings.llm_max_tokens,
            llm_allowed_models=settings.llm_allowed_models,
            max_prompt_chars=settings.max_prompt_chars,
            no_model_hint="the server's operator must start it with --llm-base-url and "
            "--llm-model (or KERNEL_ENV_LLM_BASE_URL and KERNEL_ENV_LLM_MODEL); or pass your "
            "own hf_token to reset()",
        )
        self._config = config
        self._token_backends = _token_backends(settings)
        self.sessions = SessionManager(
            self._session_environment,
            max_sessions=settings.max_sessions,
            idle_ttl=settings.idle_ttl,
            claim_ttl=settings.claim_ttl,
            max_sessions_per_tenant=settings.max_sessions_per_tenant,
        )
        self.started = time.monotonic()
        self.store: EpisodeStore | None = None  # opened at start, when settings.episodes

    def new_environment(
        self, llm_backend: LLMBackend | None = None, *, tenant: str | None = None
    ) -> KernelEnvironment:
        """A session's environment: the server's limits and kernels (``tenant``'s own, when
        tenants have pools of their own); ``llm_backend`` answers its ``llm_query`` instead
        of the server's model (a Ray host's caller lends its own)."""
        source: KernelSource = self.pool.acquire
        if self.tenant_pools is not None and tenant is not None and tenant != DEFAULT_TENANT:
            source = self.tenant_pools.source(tenant)
        return KernelEnvironment(
            self._config,
            kernel_source=source,
            llm_backend=llm_backend or self.llm,
            backend_for_token=self._token_backends,
            child_solver=solve_child,
            kernels=self.kernels,
        )

    def _session_environment(self, owner: Tenant) -> KernelEnvironment:
        return self.new_environment(tenant=owner.name)

    async def start(self) -> None:
        if self.settings.episodes is not None:
            self.store = await EpisodeStore.open(self.settings.episodes, self.settings.keep)
            self.sessions.store = self.store
        await self.pool.start()
        for pool in self.language_pools:
            await pool.start()
        await self.sessions.start()

    async def drain(self) -> None:
        """Graceful shutdown: in-flight steps answer (or are cancelled), then kernels go."""
        await self.sessions.drain(self.settings.drain_timeout)
        await self._close_pools(start_grace=_SHUTDOWN_START_GRACE)

    async def close(self) -> None:
        await self.sessions.close()
        if self.store is not None:
            await self.store.aclose()
        await self._close_pools()
        if self.forkserver is not None:
            await self.forkserver.close()
        if self.llm is not None:
            await self.llm.aclose()

    async def _close_pools(self, start_grace: float | None = None) -> None:
        pools = [self.pool, *self.language_pools]
        closing = [pool.close(start_grace=start_grace) for pool in pools]
        if self.tenant_pools is not None:
            closing.append(self.tenant_pools.close(start_grace=start_grace))
        await asyncio.gather(*closing)

    @property
    def start_mode(self) -> str:
        """How the server's kernels start, in words (for /health and /metadata)."""
        if self.forkserver is not None:
            return self.forkserver.status
        if self.settings.gateway_url:
            return "started by the gateway"
        return "cold start (a new interpreter per kernel; forkserver off)"


def describe_kernels(state: Any) -> dict[str, str]:
    """Where kernels run, how they start, what isolates them and which limits hold, for an
    app's ``state`` (its settings; its runtime once started; ``isolation``, once described)."""
    cached = getattr(state, "isolation", None)
    if cached is None:
        from kernel_env.kernel.factory import describe_backend
        from kernel_env.languages.catalog import describe_served_limits

        settings = state.settings
        cached = {"backend": describe_backend(settings), **describe_served_limits(settings)}
        state.isolation = cached
    runtime = getattr(state, "runtime", None)
    start = runtime.start_mode if runtime is not None else "not started"
    return {"backend": cached["backend"], "start": start, **cached}
