"""Routes for the people who run a server: a landing page, readiness, Prometheus metrics and
the list of running episodes, a page at a time. Not a protocol's door: they read the runtime
and the session manager, and answer errors as the app does.

``/health`` stays liveness (the process answers); ``/ready`` is readiness: 503 while kernels
cannot start (an unreachable gateway, say) and no warm kernel is left, so a load balancer sends
no new episode to a server that would fail it. The metrics are an operator's
(:mod:`kernel_env.server.auth`); ``/sessions`` lists a client's own sessions, and every one for
an operator.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute

from kernel_env import __version__
from kernel_env.server import metrics
from kernel_env.server.auth import require_operator, tenant_of

__all__ = ["MAX_SESSIONS_PAGE", "OPERATOR_PUBLIC", "ROUTES", "SESSIONS_PAGE", "add_operator_routes"]

OPERATOR_PUBLIC = ("/", "/ready")  # no token needed: they tell nothing of an episode
# GET /sessions answers a page: a server of a thousand sessions never builds them all at once.
SESSIONS_PAGE = 100
MAX_SESSIONS_PAGE = 1000

_LINKS = (
    ("/web", "the running episodes, live, as notebooks"),
    ("/docs", "API docs (Swagger UI; works offline)"),
    ("/health", "liveness"),
    ("/ready", "readiness: can kernels start?"),
    ("/metrics", "counters (JSON; Prometheus text with Accept: text/plain; operators)"),
    ("/metrics/prometheus", "counters in Prometheus' text format (operators)"),
    ("/sessions", "running episodes: a client's own, every one for an operator"),
)


async def landing() -> HTMLResponse:
    items = "".join(
        f'<li><a href="{path}">{path}</a> {html.escape(text)}</li>' for path, text in _LINKS
    )
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>kernel_env</title>"
        f"</head><body><h1>kernel_env {html.escape(__version__)}</h1>"
        f"<p>REPL environments for language-model agents, in real IPython kernels.</p>"
        f"<ul>{items}</ul></body></html>",
        headers={"Content-Security-Policy": "default-src 'none'"},
    )


async def ready(request: Request) -> JSONResponse:
    runtime = request.app.state.runtime
    pool = runtime.pool
    if runtime.sessions.draining:
        return JSONResponse({"status": "not ready", "reason": "shutting down"}, 503)
    if not pool.can_start:
        reason = f"kernels cannot start: {pool.last_failure}"
        return JSONResponse({"status": "not ready", "reason": reason}, 503)
    return JSONResponse({"status": "ready", "warm_kernels": pool.warm})


async def get_metrics(request: Request) -> Any:
    require_operator(request)
    snapshot = _snapshot(request)
    accept = request.headers.get("accept", "")
    if "text/plain" in accept and "application/json" not in accept:
        return _prometheus(snapshot)
    return snapshot


async def get_prometheus(request: Request) -> Response:
    require_operator(request)
    return _prometheus(_snapshot(request))


async def list_sessions(
    request: Request,
    limit: int = Query(SESSIONS_PAGE, ge=1, le=MAX_SESSIONS_PAGE, description="sessions a page"),
    after: int = Query(0, ge=0, description="the `next` of the page before; 0: the first page"),
) -> dict[str, Any]:
    sessions = request.app.state.runtime.sessions
    tenant = tenant_of(request)
    page, next_after = sessions.page(tenant, after=after, limit=limit)
    return {
        "sessions": [s.summary() for s in page],
        "total": sessions.visible_count(tenant),
        "next": next_after,
    }


ROUTES = [
    APIRoute("/", landing, methods=["GET"], include_in_schema=False),
    APIRoute(
        "/ready",
        ready,
        methods=["GET"],
        tags=["Health"],
        summary="Readiness: 503 while kernels cannot start",
    ),
    APIRoute(
        "/metrics",
        get_metrics,
        methods=["GET"],
        tags=["Operations"],
        summary="Server counters (JSON or Prometheus)",
    ),
    APIRoute(
        "/metrics/prometheus",
        get_prometheus,
        methods=["GET"],
        tags=["Operations"],
        summary="Counters, Prometheus' format",
    ),
    APIRoute(
        "/sessions",
        list_sessions,
        methods=["GET"],
        tags=["Operations"],
        summary="Running sessions and their episodes (a client's own; all for an operator), "
        "a page at a time: ask again with `after` set to the page's `next` until it is null",
    ),
]


def add_operator_routes(app: FastAPI) -> None:
    app.include_router(APIRouter(routes=list(ROUTES)))


def _snapshot(request: Request) -> dict[str, Any]:
    runtime = request.app.state.runtime
    return metrics.collect(runtime.sessions, runtime.pool, runtime.started)


def _prometheus(snapshot: dict[str, Any]) -> Response:
    body, content_type = metrics.prometheus_text(snapshot)
    return Response(body, media_type=content_type)
