"""``create_app(settings)``: the FastAPI app of ``kernel-env serve``, assembled.

It builds what the running server owns (:class:`~kernel_env.server.runtime.Runtime`, in the
app's lifespan), puts the middleware around it (browser guard, CORS, the token, body limits),
and mounts each front door: OpenEnv's HTTP routes and ``/ws`` (:mod:`.openenv`), E2B's
sandbox protocol (:mod:`.e2b`), Jupyter's kernel API (:mod:`.jupyter`), MCP's tools
(:mod:`.mcp`), the stored episodes (:mod:`.episodes`), and beside them the operator's routes
(:mod:`.operator`) and the live web view (:mod:`.web`). Every door speaks to the sessions
(:mod:`.sessions`) alone; docs/architecture.md ("Doors") says how one is added.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from kernel_env import __version__
from kernel_env.kernel import KernelSource
from kernel_env.kernel.factory import kernel_source_from
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.server.auth import AuthGate, Tenants, load_tenants, redact_client_secrets_in_logs
from kernel_env.server.e2b import add_e2b
from kernel_env.server.episodes.routes import add_episodes
from kernel_env.server.guard import BrowserGuard, HostPolicy
from kernel_env.server.jupyter.routes import PREFIXES as JUPYTER_PREFIXES
from kernel_env.server.jupyter.routes import add_jupyter
from kernel_env.server.limits import BodyLimit
from kernel_env.server.mcp.routes import PATH as MCP_PATH
from kernel_env.server.mcp.routes import add_mcp
from kernel_env.server.mcp.routes import probe as mcp_probe
from kernel_env.server.openenv.info import SESSIONS_DOC
from kernel_env.server.openenv.protocol import SESSION_HEADER
from kernel_env.server.openenv.routes import PUBLIC as OPENENV_PUBLIC
from kernel_env.server.openenv.routes import add_openenv
from kernel_env.server.operator import OPERATOR_PUBLIC, add_operator_routes
from kernel_env.server.runtime import Runtime, llm_backend_from
from kernel_env.server.settings import ServerSettings
from kernel_env.server.web import WEB_PUBLIC, add_web_routes

__all__ = [
    "SESSION_HEADER",
    "Runtime",
    "create_app",
    "llm_backend_from",
]

log = logging.getLogger(__name__)


def _tenant_sources(settings: ServerSettings) -> Callable[[str], KernelSource] | None:
    """With tenants and a gateway: each tenant's kernels start as its own user (Enterprise
    Gateway's ``KERNEL_USERNAME``), from a pool of its own (:mod:`.tenant_pools`)."""
    if not (settings.gateway_url and settings.tokens_file):
        return None
    return functools.partial(_tenant_source, settings)


def _tenant_source(settings: ServerSettings, tenant: str) -> KernelSource:
    return kernel_source_from(settings, username=tenant)


def create_app(
    settings: ServerSettings | None = None, *, kernel_factory: KernelSource | None = None
) -> FastAPI:
    """The app. ``kernel_factory`` starts the kernels (default: from the settings: local
    kernels, sandboxed per ``settings.sandbox``, or a gateway's when ``gateway_url`` is set)."""
    settings = settings or ServerSettings()
    # First: a tokens file that cannot be used stops the server before anything starts.
    tenants = load_tenants(settings.token, settings.tokens_file)
    redact_client_secrets_in_logs()
    forkserver = _forkserver_for(settings) if kernel_factory is None else None
    factory = kernel_factory or kernel_source_from(settings, forkserver=forkserver)
    tenant_sources = _tenant_sources(settings) if kernel_factory is None else None
    runtime = functools.partial(Runtime, settings, factory, forkserver, tenant_sources)
    app = FastAPIOffline(  # /docs from the package's own Swagger UI assets, no CDN
        title="kernel_env",
        version=__version__,  # one version everywhere: the package's
        description="OpenEnv REPL environment whose episodes run in real IPython kernels.\n"
        + SESSIONS_DOC,
        lifespan=_lifespan(runtime, tenants),
    )
    app.state.tenants = tenants
    app.state.settings = settings
    app.state.isolation = {"backend": "kernels from a custom factory"} if kernel_factory else None
    _add_middleware(app, settings)
    add_openenv(app)
    add_jupyter(app)
    add_mcp(app)
    add_operator_routes(app)
    add_episodes(app)
    add_web_routes(app)
    return app


def _lifespan(
    runtime: Callable[[], Runtime], tenants: Tenants
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: its runtime, made and started on the app's loop, closed after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for warning in tenants.warnings:
            log.warning(warning)
        running = runtime()
        app.state.runtime = running
        await running.start()
        try:
            yield
        finally:
            await running.close()

    return lifespan


def _forkserver_for(settings: ServerSettings) -> ForkServer | None:
    """The forkserver of a server whose kernels are local (started with the app)."""
    if settings.gateway_url or not settings.forkserver:
        return None
    return ForkServer(preload=settings.preload)


# The API docs, their assets (fastapi-offline's Swagger UI files) and the routes that hold no
# data answer without a token.
DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
DOCS_ASSETS = "/static-offline-docs/"
PUBLIC_PATHS = (*OPERATOR_PUBLIC, *OPENENV_PUBLIC, *DOCS, *WEB_PUBLIC)
_SMALL_BODY = 1 << 20  # any route but OpenEnv's /reset and /step: a small JSON document


def _add_middleware(app: FastAPI, settings: ServerSettings) -> None:
    """Outermost first: browser policy (Host, Origin), CORS if configured, the token, then the
    body limit, so a body is read only from an allowed, authenticated request."""
    # Added innermost first (each add_middleware wraps everything added before it).
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_message_bytes,
        per_path={
            "/reset": settings.max_message_bytes,
            "/step": settings.step_body_bytes,
            MCP_PATH: settings.step_body_bytes,  # a tool call carries a cell's code
        },
        default_bytes=min(settings.max_message_bytes, _SMALL_BODY),
    )
    app.add_middleware(
        AuthGate,
        tenants=app.state.tenants,
        public=PUBLIC_PATHS,
        public_prefixes=(DOCS_ASSETS,),
        query_token_prefixes=JUPYTER_PREFIXES,
        probes={MCP_PATH: mcp_probe},
    )
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[SESSION_HEADER],
        )
    add_e2b(app)  # E2B's SDK: its own token checks, so inside the browser guard only
    hosts = settings.allowed_hosts
    if hosts is None and settings.token:
        # With a token, the token admits, whatever name the server is reached by (a Space, a
        # Service, a proxy); the Host check is what guards a server that has none.
        hosts = ("*",)
    policy = HostPolicy.for_bind(
        settings.host, hosts or settings.host_allowlist, settings.allowed_origins
    )
    app.add_middleware(BrowserGuard, policy=policy)


_APP: list[FastAPI] = []


def __getattr__(name: str) -> Any:
    """``kernel_env.server.app:app``, for ASGI servers and OpenEnv's manifest: an app with
    settings from the ``KERNEL_ENV_*`` variables, built on first use."""
    if name == "app":
        if not _APP:
            _APP.append(create_app(ServerSettings.from_env()))
        return _APP[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
