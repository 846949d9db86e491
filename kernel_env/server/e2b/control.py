"""E2B's control plane (the REST API the SDK reaches at ``E2B_API_URL``), over :class:`Sandboxes`.

The SDK authenticates with the ``X-API-KEY`` header: it carries a kernel_env token (the
server's, or a tenant's), checked as ``Authorization: Bearer`` is everywhere else. Errors
have E2B's shape, ``{"code": <status>, "message": ...}``; what kernel_env does not do
(templates built from Dockerfiles, volumes, snapshots to remote storage, network and
metrics APIs) is refused with 501 and a sentence saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kernel_env.errors import KernelEnvError, SandboxError
from kernel_env.server.auth import Tenant, Tenants
from kernel_env.server.e2b.failures import control_error, error_response
from kernel_env.server.e2b.listing import page_of
from kernel_env.server.e2b.sandboxes import (
    DEFAULT_TEMPLATE,
    MAX_TIMEOUT,
    Sandbox,
    Sandboxes,
    check_fork_count,
)

__all__ = ["CONTROL_PREFIXES", "ROUTES", "control_app"]

# The paths of E2B's API: requests to these (without a sandbox header) are the control plane's.
CONTROL_PREFIXES = (
    "/sandboxes",
    "/v2/sandboxes",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/volumes",
    "/snapshots",
    "/secrets",
)
DEFAULT_TIMEOUT = 300  # seconds, E2B's

Handler = Callable[[Request, Tenant], Awaitable[Response]]

_OUT_OF_SCOPE = {
    "templates": "kernel_env serves kernels, not templates built from Dockerfiles; create a "
    "sandbox with a kernel name as its template",
    "volumes": "kernel_env has no volumes: a sandbox's files live in its own workspace",
    "snapshots": "kernel_env keeps no snapshots in remote storage; fork() copies a live "
    "sandbox instead",
    "secrets": "kernel_env keeps no secrets for sandboxes: a sandbox never holds a credential",
    "network": "a kernel_env sandbox has no network; there is nothing to configure",
    "metrics": "kernel_env reports no per-sandbox metrics; see the server's /metrics",
}


def control_app(tenants: Callable[[], Tenants], sandboxes: Callable[[], Sandboxes]) -> Starlette:
    """The control plane's app: :data:`ROUTES`, over the server's tenants and sandboxes."""
    app = Starlette(routes=ROUTES)
    app.state.tenants = tenants
    app.state.sandboxes = sandboxes
    return app


def _authed(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` behind the API key, with its failures answered in E2B's shape."""

    async def endpoint(request: Request) -> Response:
        tenant = _tenant(request, request.app.state.tenants())
        if tenant is None:
            return error_response(401, "Invalid API key: use the kernel_env server's token")
        try:
            return await handler(request, tenant)
        except KernelEnvError as exc:
            return control_error(exc, request.url.path)

    return endpoint


def _registry(request: Request) -> Sandboxes:
    registry: Sandboxes = request.app.state.sandboxes()
    return registry


def _sandbox(request: Request, tenant: Tenant) -> Sandbox:
    return _registry(request).get(request.path_params["sandbox_id"], tenant)


async def create(request: Request, tenant: Tenant) -> Response:
    body = await _json(request)
    template = body.get("templateID") or DEFAULT_TEMPLATE
    if body.get("volumeMounts"):
        raise SandboxError(501, _OUT_OF_SCOPE["volumes"])
    sandbox = await _registry(request).create(
        tenant,
        str(template),
        _timeout(body.get("timeout"), DEFAULT_TIMEOUT),
        _strings(body.get("metadata"), "metadata"),
        _strings(body.get("envVars"), "envVars"),
        on_timeout="pause" if _flag(body.get("autoPause"), "autoPause") else "kill",
        auto_resume=_flag(_auto_resume(body.get("autoResume")), "autoResume.enabled"),
    )
    return JSONResponse(sandbox.created(), status_code=201)


async def listing(request: Request, tenant: Tenant) -> Response:
    page = page_of(_registry(request).visible_to(tenant), request.query_params)
    found = [
        {k: v for k, v in s.detail().items() if k != "envdAccessToken"} for s in page.sandboxes
    ]
    headers = {"X-Total-Running": str(page.running)}
    if page.next_token is not None:
        headers["X-Next-Token"] = page.next_token
    return JSONResponse(found, headers=headers)


async def get_info(request: Request, tenant: Tenant) -> Response:
    return JSONResponse(_sandbox(request, tenant).detail())


async def kill(request: Request, tenant: Tenant) -> Response:
    await _registry(request).kill(_sandbox(request, tenant))
    return Response(status_code=204)


async def set_timeout(request: Request, tenant: Tenant) -> Response:
    sandbox = _sandbox(request, tenant)
    body = await _json(request)
    _registry(request).set_timeout(sandbox, _timeout(body.get("timeout"), None))
    return Response(status_code=204)


async def connect(request: Request, tenant: Tenant) -> Response:
    sandbox = _sandbox(request, tenant)
    body = await _json(request)
    timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
    registry = _registry(request)
    if sandbox.state == "paused":
        registry.resume(sandbox, timeout)
        return JSONResponse(sandbox.created(), status_code=201)
    # A running sandbox's end moves only later, as E2B's does; the connect is activity.
    sandbox.session.touch()
    if sandbox.end < _now() + timeout:
        registry.set_timeout(sandbox, timeout)
    return JSONResponse(sandbox.created(), status_code=200)


async def pause(request: Request, tenant: Tenant) -> Response:
    _registry(request).pause(_sandbox(request, tenant))
    return Response(status_code=204)


async def resume(request: Request, tenant: Tenant) -> Response:
    sandbox = _sandbox(request, tenant)
    if sandbox.state != "paused":
        raise SandboxError(409, f"sandbox {sandbox.id!r} is not paused")
    body = await _json(request)
    _registry(request).resume(sandbox, _timeout(body.get("timeout"), DEFAULT_TIMEOUT))
    return JSONResponse(sandbox.created(), status_code=201)


async def fork(request: Request, tenant: Tenant) -> Response:
    body = await _json(request)
    count = body.get("count", 1)
    check_fork_count(count)  # the request is checked first, as E2B's API does
    timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
    sandbox = _sandbox(request, tenant)
    copies = await _registry(request).fork(sandbox, count, timeout)
    return JSONResponse([{"sandbox": c.created()} for c in copies], status_code=201)


def _refuse(what: str) -> Handler:
    """A handler for what kernel_env does not do: 501, and why."""

    async def refused(request: Request, tenant: Tenant) -> Response:
        return error_response(501, _OUT_OF_SCOPE[what])

    return refused


_SANDBOX = "/sandboxes/{sandbox_id}"
_ANY = ["GET", "POST", "PATCH", "PUT", "DELETE"]

ROUTES = [
    Route("/sandboxes", _authed(create), methods=["POST"]),
    Route("/v2/sandboxes", _authed(create), methods=["POST"]),
    Route("/sandboxes", _authed(listing), methods=["GET"]),
    Route("/v2/sandboxes", _authed(listing), methods=["GET"]),
    Route("/sandboxes/metrics", _authed(_refuse("metrics")), methods=["GET"]),
    Route(_SANDBOX, _authed(get_info), methods=["GET"]),
    Route(_SANDBOX, _authed(kill), methods=["DELETE"]),
    Route(f"{_SANDBOX}/timeout", _authed(set_timeout), methods=["POST"]),
    Route(f"{_SANDBOX}/connect", _authed(connect), methods=["POST"]),
    Route(f"/v2{_SANDBOX}/connect", _authed(connect), methods=["POST"]),
    Route(f"{_SANDBOX}/pause", _authed(pause), methods=["POST"]),
    Route(f"{_SANDBOX}/resume", _authed(resume), methods=["POST"]),
    Route(f"{_SANDBOX}/fork", _authed(fork), methods=["POST"]),
    Route(f"{_SANDBOX}/snapshots", _authed(_refuse("snapshots")), methods=["POST"]),
    Route(f"{_SANDBOX}/network", _authed(_refuse("network")), methods=["PUT"]),
    Route(f"{_SANDBOX}/metrics", _authed(_refuse("metrics")), methods=["GET"]),
    # The rest of E2B's API (templates, volumes, snapshots, secrets): out of kernel_env's scope.
    *(
        Route(path, _authed(_refuse(prefix.rsplit("/", 1)[-1])), methods=_ANY)
        for prefix in CONTROL_PREFIXES[2:]
        for path in (prefix, prefix + "/{rest:path}")
    ),
]


def _tenant(request: Request, tenants: Tenants) -> Tenant | None:
    key = request.headers.get("x-api-key")
    if key is not None:
        return tenants.identify(f"Bearer {key}")
    return tenants.identify(request.headers.get("authorization"))


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise SandboxError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise SandboxError(400, "the body must be a JSON object")
    return body


def _timeout(value: Any, default: int | None) -> float:
    if value is None:
        if default is None:
            raise SandboxError(400, "timeout is required")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SandboxError(400, "timeout must be a number of seconds")
    if not 0 <= value <= MAX_TIMEOUT:
        raise SandboxError(400, f"timeout must be between 0 and {MAX_TIMEOUT} seconds")
    return float(value)


def _flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SandboxError(400, f"{name} must be a boolean")
    return value


def _auto_resume(value: Any) -> Any:
    """E2B's ``autoResume``: ``{"enabled": <bool>}``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SandboxError(400, "autoResume must be an object")
    return value.get("enabled")


def _strings(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SandboxError(400, f"{name} must map strings to strings")
    return dict(value)


def _now() -> float:
    return time.time()
