"""``create_app(settings)``: the FastAPI app of ``kernel-env serve``.

OpenEnv's routes (``/health``, ``/metadata``, ``/schema``, ``/reset``, ``/step``, ``/state``,
``/mcp``, ``WS /ws``) plus ``/metrics`` and session routes (close, and the episode as a
notebook). Handlers are thin: sessions live in
``sessions``, frames in ``protocol``, and exceptions map to responses in one place
(``_install_error_handlers``).

Unlike OpenEnv's stateless HTTP, ``/reset`` opens a *session*: its id comes back in the
``X-Session-Id`` response header (and in ``observation.metadata.session_id``); ``/step`` and
``/state`` take it in the ``X-Session-Id`` request header.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, FastAPI, Header, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel_env import __version__
from kernel_env.errors import (
    EpisodeFinished,
    ForkRefused,
    InvalidInput,
    KernelError,
    ResetNeeded,
)
from kernel_env.kernel import KernelSource
from kernel_env.kernel.factory import kernel_source_from
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.models import REPLAction, REPLObservation, REPLState, ResetOptions
from kernel_env.notebook import ExportPathError, export_zip, named_notebook, notebook_name
from kernel_env.record import EpisodeRecord
from kernel_env.server import protocol
from kernel_env.server.auth import (
    AuthGate,
    load_tenants,
    redact_client_secrets_in_logs,
    tenant_of,
)
from kernel_env.server.e2b import add_e2b
from kernel_env.server.guard import BrowserGuard, HostPolicy
from kernel_env.server.limits import BodyLimit
from kernel_env.server.operator import add_operator_routes
from kernel_env.server.runtime import Runtime, llm_backend_from
from kernel_env.server.sessions import (
    CapacityReached,
    Session,
    SessionError,
    UnknownSession,
)
from kernel_env.server.settings import ServerSettings
from kernel_env.server.web import WEB_PUBLIC, add_web_routes
from kernel_env.server.websocket import websocket_endpoint

__all__ = [
    "SESSION_HEADER",
    "Runtime",
    "create_app",
    "llm_backend_from",
]

SESSION_HEADER = "X-Session-Id"

log = logging.getLogger(__name__)

_SESSIONS_DOC = f"""
**Sessions over HTTP.** Unlike OpenEnv's stateless HTTP routes, kernel_env keeps a session
(one kernel) per client. `POST /reset` without an `{SESSION_HEADER}` header opens a new session
and returns its id in the `{SESSION_HEADER}` response header and in
`observation.metadata.session_id`. Send it back in the `{SESSION_HEADER}` request header to
`POST /step`, `GET /state`, or `POST /reset` (a new episode in the same session). A session idle
longer than the server's TTL is reaped: later calls get 410 "session expired". Close a session
with `DELETE /sessions/{{id}}`. The WebSocket `/ws` needs none of this: one socket is one
session.
"""


class StepRequest(BaseModel):
    """The body of ``POST /step`` (OpenEnv's shape; extra keys are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    action: REPLAction
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Accepted for compatibility; the server's step timeout "
        "applies (it is kept below OpenEnv clients' 60 s wait).",
    )
    request_id: str | None = Field(default=None, max_length=255)


class ForkRequest(BaseModel):
    """The body of ``POST /sessions/{id}/fork``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1, le=64, description="How many copies.")
    own_budget: bool = Field(
        default=False, description="Each copy gets its own LLM budget (default: the parent's)."
    )


class StepResponse(BaseModel):
    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for warning in tenants.warnings:
            log.warning(warning)
        runtime = Runtime(settings, factory, forkserver, tenant_sources)
        app.state.runtime = runtime
        await runtime.start()
        try:
            yield
        finally:
            await runtime.close()

    app = FastAPIOffline(  # /docs from the package's own Swagger UI assets, no CDN
        title="kernel_env",
        version=__version__,  # one version everywhere: the package's
        description="OpenEnv REPL environment whose episodes run in real IPython kernels.\n"
        + _SESSIONS_DOC,
        lifespan=lifespan,
    )
    app.state.tenants = tenants
    app.state.settings = settings
    app.state.isolation = {"backend": "kernels from a custom factory"} if kernel_factory else None
    _add_middleware(app, settings)
    _install_error_handlers(app)
    _add_info_routes(app)
    add_operator_routes(app)
    add_web_routes(app)
    _add_episode_routes(app)
    app.add_api_websocket_route("/ws", websocket_endpoint)
    return app


PUBLIC_PATHS = (
    "/",
    "/health",
    "/ready",
    "/metadata",
    "/schema",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/mcp",
)
DOCS_ASSETS = "/static-offline-docs/"  # fastapi-offline's Swagger UI files
_SMALL_BODY = 1 << 20  # any route but /reset and /step: a small JSON document


def _add_middleware(app: FastAPI, settings: ServerSettings) -> None:
    """Outermost first: browser policy (Host, Origin), CORS if configured, the token, then the
    body limit, so a body is read only from an allowed, authenticated request."""
    # Added innermost first (each add_middleware wraps everything added before it).
    step_bytes = min(settings.max_message_bytes, 6 * settings.max_code_chars + (64 << 10))
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_message_bytes,
        per_path={"/reset": settings.max_message_bytes, "/step": step_bytes},
        default_bytes=min(settings.max_message_bytes, _SMALL_BODY),
    )
    app.add_middleware(
        AuthGate,
        tenants=app.state.tenants,
        public=(*PUBLIC_PATHS, *WEB_PUBLIC),
        public_prefixes=(DOCS_ASSETS,),
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


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


# -- info routes (public: providers and `openenv validate` poll them) ------------------------


def _isolation(app: FastAPI) -> dict[str, str]:
    """Where kernels run, how they start, what isolates them and which limits hold."""
    cached = getattr(app.state, "isolation", None)
    if cached is None:
        from kernel_env.kernel.factory import describe_backend, describe_limits

        settings = app.state.settings
        cached = {"backend": describe_backend(settings), **describe_limits(settings)}
        app.state.isolation = cached
    runtime = getattr(app.state, "runtime", None)
    start = runtime.start_mode if runtime is not None else "not started"
    return {"backend": cached["backend"], "start": start, **cached}


def _forkserver_for(settings: ServerSettings) -> ForkServer | None:
    """The forkserver of a server whose kernels are local (started with the app)."""
    if settings.gateway_url or not settings.forkserver:
        return None
    return ForkServer(preload=settings.preload)


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health", tags=["Health"], summary="Health check")
    async def health() -> dict[str, Any]:
        return {"status": "healthy", "kernels": _isolation(app)}

    @app.get("/metadata", tags=["Environment Info"], summary="Environment metadata")
    async def metadata() -> dict[str, Any]:
        return {
            "name": "kernel_env",
            "description": "A REPL environment for language-model agents in which every "
            "episode runs in a real IPython kernel (OpenEnv repl_env compatible).",
            "readme_content": _SESSIONS_DOC.strip(),
            "version": __version__,
            "author": "kernel_env contributors",
            "documentation_url": "https://github.com/kernel-env/kernel-env#readme",
            "kernels": _isolation(app),
            "kernel_names": app.state.runtime.kernels.describe(),
        }

    @app.get("/schema", tags=["Schema"], summary="JSON schemas of action, observation, state")
    async def schema() -> dict[str, Any]:
        return {
            "action": REPLAction.model_json_schema(),
            "observation": REPLObservation.model_json_schema(),
            "state": REPLState.model_json_schema(),
        }

    @app.post("/mcp", tags=["MCP"], summary="JSON-RPC 2.0 (no tools: every call is an error)")
    async def mcp(request: Request) -> JSONResponse:
        return JSONResponse(protocol.mcp_response(await request.body()))


# -- episode routes -----------------------------------------------------------------------

SessionHeader = Annotated[
    str | None,
    Header(
        alias=SESSION_HEADER,
        description="The session id that `POST /reset` returned in its `X-Session-Id` header.",
    ),
]


def _add_episode_routes(app: FastAPI) -> None:
    @app.post(
        "/reset",
        tags=["Environment Control"],
        response_model=StepResponse,
        summary="Start an episode (opens a session if none is named)",
        description=_SESSIONS_DOC,
    )
    async def reset(
        request: Request,
        options: Annotated[ResetOptions | None, Body()] = None,
        session_id: SessionHeader = None,
    ) -> Response:
        runtime = _runtime(request)
        # Every field the caller set, hf_token included (ResetOptions never dumps it).
        kwargs = (
            {name: getattr(options, name) for name in options.model_fields_set}
            if options is not None
            else {}
        )
        _require_text(kwargs)
        tenant = tenant_of(request)
        session = runtime.sessions.get(session_id, tenant) if session_id else None
        new = session is None
        session = session or runtime.sessions.open("http", tenant)
        try:
            async with runtime.sessions.request(session):
                obs = await session.reset(kwargs)
            # Built here, inside the try: a reply that cannot be built is a failed reset too.
            return _observation_response(obs, session)
        except BaseException:
            if new:  # a session whose first reset failed is of no use to anyone
                await asyncio.shield(runtime.sessions.close_soon(session))
            raise

    @app.post(
        "/step",
        tags=["Environment Control"],
        response_model=StepResponse,
        summary="Run one action in the session's episode",
        description="Requires the `X-Session-Id` header from `POST /reset`; without it, "
        "400. An invalid action is 422.\n" + _SESSIONS_DOC,
    )
    async def step(
        request: Request, body: StepRequest, session_id: SessionHeader = None
    ) -> Response:
        runtime = _runtime(request)
        session = _require_session(request, session_id)
        async with runtime.sessions.request(session):
            obs = await session.step(body.action)
        return _observation_response(obs, session)

    @app.get(
        "/state",
        tags=["State Management"],
        response_model=REPLState,
        summary="The session's episode state",
        description="Requires the `X-Session-Id` header from `POST /reset`.",
    )
    async def state(request: Request, session_id: SessionHeader = None) -> Response:
        session = _require_session(request, session_id)
        current = session.state()
        big = len(current.context or "") > 1 << 20
        body = (
            await asyncio.to_thread(current.model_dump_json) if big else current.model_dump_json()
        )
        return Response(body, media_type="application/json")

    @app.delete(
        "/sessions/{session_id}",
        tags=["Sessions"],
        status_code=status.HTTP_204_NO_CONTENT,
        summary="Close a session (idempotent)",
    )
    async def close_session(request: Request, session_id: str) -> Response:
        runtime = _runtime(request)
        try:
            session = runtime.sessions.get(session_id, tenant_of(request))
        except SessionError:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        await runtime.sessions.close_session(session)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    @app.post(
        "/sessions/{session_id}/fork",
        tags=["Sessions"],
        summary="Fork the session's episode into new sessions (between steps)",
        description="Each copy is a new HTTP session (an `X-Session-Id`, or `/ws?session=`) "
        "whose episode holds this one's state and record so far, re-run in a fresh kernel "
        "with `llm_query` answered from the record. Copies count toward `max_sessions`; a "
        "fork while a step runs gets 409.",
    )
    async def fork(
        request: Request, session_id: str, body: ForkRequest | None = None
    ) -> dict[str, Any]:
        runtime = _runtime(request)
        wanted = body or ForkRequest()
        session = runtime.sessions.get(session_id, tenant_of(request))
        children = await runtime.sessions.fork(session, wanted.n, own_budget=wanted.own_budget)
        return protocol.fork_payload(children)

    @app.get(
        "/sessions/{session_id}/notebook",
        tags=["Sessions"],
        summary="The session's current (or last) episode as a Jupyter notebook",
        description="A context larger than 10,000 characters is not inlined: the "
        "notebook reads it from `<name>.context.txt` beside it, and child episodes are "
        "separate notebooks; `GET /sessions/{id}/export.zip` has them all.",
        response_class=Response,
        responses={200: {"content": {NOTEBOOK_MEDIA_TYPE: {}}}},
    )
    async def notebook(request: Request, session_id: str) -> Response:
        session = _exported(request, session_id)
        name, body = await session.export(named_notebook)
        return Response(body, media_type=NOTEBOOK_MEDIA_TYPE, headers=_attachment(name))

    @app.get(
        "/sessions/{session_id}/export.zip",
        tags=["Sessions"],
        summary="The episode's notebook, context file and child episodes, zipped",
        response_class=Response,
        responses={200: {"content": {"application/zip": {}}}},
    )
    async def export(request: Request, session_id: str, name: str | None = None) -> Response:
        """``name``: the notebook's file name in the archive (default: the episode id)."""
        session = _exported(request, session_id)
        if name is not None and (
            not name
            or Path(name).name != name
            or name[0] == "."
            or len(name.encode()) > _MAX_NAME_BYTES
        ):
            raise ExportPathError(
                f"name must be a plain file name of at most "
                f"{_MAX_NAME_BYTES} bytes, got {name[:80]!r}"
            )

        def archive(record: EpisodeRecord) -> bytes:
            return export_zip(record, name or notebook_name(record.episode_id))

        body = await session.export(archive)
        return Response(body, media_type="application/zip", headers=_attachment("episode.zip"))


NOTEBOOK_MEDIA_TYPE = "application/x-ipynb+json"
# File names are at most 255 bytes; the export adds ".context.txt" or ".child-N-M.ipynb".
_MAX_NAME_BYTES = 200


def _require_text(kwargs: dict[str, Any]) -> None:
    """Refuse strings that are not text (lone surrogates such as "\\ud800", which JSON allows
    but UTF-8 cannot carry) before a session opens: they would fail later, half-way."""
    for key, value in kwargs.items():
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInput(
                    f"{key} is not valid Unicode text (a lone surrogate at position {exc.start})"
                ) from None


def _attachment(filename: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{filename}"'}


def _require_session(request: Request, session_id: str | None) -> Session:
    if not session_id:
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST,
            f"missing {SESSION_HEADER} header: call POST /reset first; it returns the session "
            f"id in its {SESSION_HEADER} response header",
        )
    return _session(request, session_id)


def _session(request: Request, session_id: str) -> Session:
    """The session with this id, if the request's tenant may use it (else: unknown)."""
    return _runtime(request).sessions.get(session_id, tenant_of(request))


def _exported(request: Request, key: str) -> Session:
    """The session a notebook route names: by its session id, or by its episode's id (the one
    ``state()`` and the web view show), among the request's tenant's own sessions."""
    return _runtime(request).sessions.resolve(key, tenant_of(request))


def _observation_response(obs: REPLObservation, session: Session) -> JSONResponse:
    payload = protocol.observation_payload(obs, session_id=session.id)
    del payload["metadata"]  # HTTP keeps OpenEnv's three keys; metadata is in the observation
    return JSONResponse(payload, headers={SESSION_HEADER: session.id})


# -- exceptions -> responses, in one place ------------------------------------------------


# A step after the end, for an HTTP caller (who starts another with POST /reset).
EPISODE_OVER_HTTP = (
    f"the episode is over; POST /reset with this {SESSION_HEADER} header to start another"
)


def _detail(
    code: int,
    detail: Any,
    headers: dict[str, str] | None = None,
    exc: BaseException | None = None,
) -> JSONResponse:
    """``{"detail": ...}``, and for a kernel_env exception ``"exception"``: its class's name
    (kernel_env's clients raise that class)."""
    body = {"detail": detail}
    name = protocol.exception_name(exc) if exc is not None else None
    if name is not None:
        body["exception"] = name
    return JSONResponse(body, status_code=code, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def unknown(_: Request, exc: Exception) -> JSONResponse:
        return _detail(404, str(exc), exc=exc)

    async def gone(_: Request, exc: Exception) -> JSONResponse:
        return _detail(410, str(exc), exc=exc)

    async def capacity(_: Request, exc: Any) -> JSONResponse:
        return _detail(
            503,
            {
                "code": "CAPACITY_REACHED",
                "message": str(exc),
                "active_sessions": exc.active_sessions,
                "max_sessions": exc.max_sessions,
            },
            {"Retry-After": "5"},
            exc,
        )

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ValidationError):
            return _detail(422, protocol.validation_errors(exc))
        if isinstance(exc, RequestValidationError):
            # FastAPI's errors without the offending input (it may hold a token, or 100 MB).
            return _detail(
                422, [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]
            )
        return _detail(422, [{"type": "value_error", "loc": ["body"], "msg": str(exc)}], exc=exc)

    async def conflict(_: Request, exc: Exception) -> JSONResponse:
        message = str(exc)
        if isinstance(exc, ResetNeeded):
            message = protocol.NOT_INITIALIZED
        elif isinstance(exc, EpisodeFinished):
            message = EPISODE_OVER_HTTP
        return _detail(409, message, exc=exc)

    async def kernel(_: Request, exc: Exception) -> JSONResponse:
        return _detail(503, f"kernel unavailable: {exc}", exc=exc)

    for exc_type, handler in [
        (UnknownSession, unknown),
        (SessionError, gone),
        (CapacityReached, capacity),
        (RequestValidationError, invalid),
        (ValidationError, invalid),
        (InvalidInput, invalid),
        (ResetNeeded, conflict),
        (EpisodeFinished, conflict),
        (ForkRefused, conflict),
        (KernelError, kernel),
    ]:
        app.add_exception_handler(exc_type, handler)


_APP: list[FastAPI] = []


def __getattr__(name: str) -> Any:
    """``kernel_env.server.app:app``, for ASGI servers and OpenEnv's manifest: an app with
    settings from the ``KERNEL_ENV_*`` variables, built on first use."""
    if name == "app":
        if not _APP:
            _APP.append(create_app(ServerSettings.from_env()))
        return _APP[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
