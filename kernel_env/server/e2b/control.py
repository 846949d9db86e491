"""E2B's control plane (the REST API the SDK reaches at ``E2B_API_URL``), over :class:`Sandboxes`.

The SDK authenticates with the ``X-API-KEY`` header: it carries a kernel_env token (the
server's, or a tenant's), checked as ``Authorization: Bearer`` is everywhere else. Errors
have E2B's shape, ``{"code": <status>, "message": ...}``; what kernel_env does not do
(templates built from Dockerfiles, volumes, snapshots to remote storage, network and
metrics APIs) is refused with 501 and a sentence saying so.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kernel_env.errors import CapacityReached, ForkRefused, InvalidInput, KernelEnvError
from kernel_env.server.auth import Tenant, Tenants
from kernel_env.server.e2b.sandboxes import (
    DEFAULT_TEMPLATE,
    MAX_TIMEOUT,
    Sandbox,
    SandboxError,
    Sandboxes,
)

__all__ = ["CONTROL_PREFIXES", "control_app", "error_response"]

log = logging.getLogger(__name__)

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


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def control_app(
    tenants: Callable[[], Tenants],
    sandboxes: Callable[[], Sandboxes],
    prepare: Callable[[Sandbox], Awaitable[None]] | None = None,
) -> Starlette:
    """The control plane's routes. ``prepare`` finishes a new sandbox (its envs)."""

    def authed(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            tenant = _tenant(request, tenants())
            if tenant is None:
                return error_response(401, "Invalid API key: use the kernel_env server's token")
            try:
                return await handler(request, tenant)
            except SandboxError as exc:
                return error_response(exc.status, exc.message)
            except CapacityReached as exc:
                return error_response(429, str(exc))
            except ForkRefused as exc:
                return error_response(409, str(exc))
            except InvalidInput as exc:  # a template's kernel this server does not offer
                return error_response(400, str(exc))
            except KernelEnvError as exc:
                log.warning("e2b: %s failed: %s", request.url.path, exc)
                return error_response(500, f"{type(exc).__name__}: {exc}")

        return endpoint

    async def create(request: Request, tenant: Tenant) -> Response:
        body = await _json(request)
        template = body.get("templateID") or DEFAULT_TEMPLATE
        if body.get("volumeMounts"):
            raise SandboxError(501, _OUT_OF_SCOPE["volumes"])
        sandbox = await sandboxes().create(
            tenant,
            str(template),
            _timeout(body.get("timeout"), DEFAULT_TIMEOUT),
            _strings(body.get("metadata"), "metadata"),
            _strings(body.get("envVars"), "envVars"),
            prepare,
        )
        return JSONResponse(sandbox.created(), status_code=201)

    async def listing(request: Request, tenant: Tenant) -> Response:
        wanted = _metadata_query(request.query_params.get("metadata"))
        states = set(filter(None, request.query_params.get("state", "").split(",")))
        found = [
            {k: v for k, v in s.detail().items() if k != "envdAccessToken"}
            for s in sandboxes().visible_to(tenant)
            if all(s.metadata.get(k) == v for k, v in wanted.items())
            and (not states or s.state in states)
        ]
        return JSONResponse(found)

    async def get_info(request: Request, tenant: Tenant) -> Response:
        return JSONResponse(_sandbox(request, tenant).detail())

    async def kill(request: Request, tenant: Tenant) -> Response:
        await sandboxes().kill(_sandbox(request, tenant))
        return Response(status_code=204)

    async def set_timeout(request: Request, tenant: Tenant) -> Response:
        sandbox = _sandbox(request, tenant)
        body = await _json(request)
        sandboxes().set_timeout(sandbox, _timeout(body.get("timeout"), None))
        return Response(status_code=204)

    async def connect(request: Request, tenant: Tenant) -> Response:
        sandbox = _sandbox(request, tenant)
        body = await _json(request)
        timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
        registry = sandboxes()
        if sandbox.state == "paused":
            registry.resume(sandbox, timeout)
            return JSONResponse(sandbox.created(), status_code=201)
        # A running sandbox's end moves only later, as E2B's does.
        if sandbox.end < _now() + timeout:
            registry.set_timeout(sandbox, timeout)
        return JSONResponse(sandbox.created(), status_code=200)

    async def pause(request: Request, tenant: Tenant) -> Response:
        sandboxes().pause(_sandbox(request, tenant))
        return Response(status_code=204)

    async def resume(request: Request, tenant: Tenant) -> Response:
        sandbox = _sandbox(request, tenant)
        if sandbox.state != "paused":
            raise SandboxError(409, f"sandbox {sandbox.id!r} is not paused")
        body = await _json(request)
        sandboxes().resume(sandbox, _timeout(body.get("timeout"), DEFAULT_TIMEOUT))
        return JSONResponse(sandbox.created(), status_code=201)

    async def fork(request: Request, tenant: Tenant) -> Response:
        sandbox = _sandbox(request, tenant)
        body = await _json(request)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int):
            raise SandboxError(400, "count must be an integer")
        timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
        copies = await sandboxes().fork(sandbox, count, timeout)
        return JSONResponse([{"sandbox": c.created()} for c in copies], status_code=201)

    def _sandbox(request: Request, tenant: Tenant) -> Sandbox:
        return sandboxes().get(request.path_params["sandbox_id"], tenant)

    def refuse(what: str) -> Handler:
        async def refused(request: Request, tenant: Tenant) -> Response:
            return error_response(501, _OUT_OF_SCOPE[what])

        return refused

    sandbox_path = "/sandboxes/{sandbox_id}"
    routes = [
        Route("/sandboxes", authed(create), methods=["POST"]),
        Route("/v2/sandboxes", authed(create), methods=["POST"]),
        Route("/sandboxes", authed(listing), methods=["GET"]),
        Route("/v2/sandboxes", authed(listing), methods=["GET"]),
        Route("/sandboxes/metrics", authed(refuse("metrics")), methods=["GET"]),
        Route(sandbox_path, authed(get_info), methods=["GET"]),
        Route(sandbox_path, authed(kill), methods=["DELETE"]),
        Route(f"{sandbox_path}/timeout", authed(set_timeout), methods=["POST"]),
        Route(f"{sandbox_path}/connect", authed(connect), methods=["POST"]),
        Route(f"/v2{sandbox_path}/connect", authed(connect), methods=["POST"]),
        Route(f"{sandbox_path}/pause", authed(pause), methods=["POST"]),
        Route(f"{sandbox_path}/resume", authed(resume), methods=["POST"]),
        Route(f"{sandbox_path}/fork", authed(fork), methods=["POST"]),
        Route(f"{sandbox_path}/snapshots", authed(refuse("snapshots")), methods=["POST"]),
        Route(f"{sandbox_path}/network", authed(refuse("network")), methods=["PUT"]),
        Route(f"{sandbox_path}/metrics", authed(refuse("metrics")), methods=["GET"]),
    ]
    for prefix in CONTROL_PREFIXES[2:]:
        what = prefix.rsplit("/", 1)[-1]
        for path in (prefix, prefix + "/{rest:path}"):
            routes.append(
                Route(path, authed(refuse(what)), methods=["GET", "POST", "PATCH", "PUT", "DELETE"])
            )
    return Starlette(routes=routes)


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


def _strings(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SandboxError(400, f"{name} must map strings to strings")
    return dict(value)


def _metadata_query(raw: str | None) -> dict[str, str]:
    """E2B's ``metadata`` query: ``k1=v1&k2=v2``, URL-encoded once more."""
    return dict(parse_qsl(raw or ""))


def _now() -> float:
    return time.time()
