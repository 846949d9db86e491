"""Jupyter Server's kernel API, as a table: each path and its handler, and
:func:`add_jupyter`, which mounts them with the door's one mapping of failures
(:mod:`.failures`) around every handler.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from kernel_env.server.jupyter import kernels, kernelspecs
from kernel_env.server.jupyter.channels import channels_endpoint
from kernel_env.server.jupyter.failures import answer

__all__ = ["PREFIXES", "ROUTES", "add_jupyter"]

# Where the door's clients may send the token as ?token= (a browser's WebSocket has no header).
PREFIXES = ("/api/", "/kernelspecs/")

Handler = Callable[[Request], Awaitable[Response]]


def _answered(handler: Handler) -> Handler:
    """``handler``, with every failure answered as Jupyter Server answers it."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return answer(exc, request.path_params.get("kernel_id"))

    return run


def _route(path: str, handler: Handler, method: str) -> Route:
    return Route(path, _answered(handler), methods=[method])


ROUTES = [
    _route("/api", kernels.api, "GET"),
    _route("/api/kernelspecs", kernelspecs.kernelspecs, "GET"),
    _route("/api/kernelspecs/{name}", kernelspecs.kernelspec, "GET"),
    _route("/kernelspecs/{name}/{resource}", kernelspecs.resource, "GET"),
    _route("/api/kernels", kernels.list_kernels, "GET"),
    _route("/api/kernels", kernels.start, "POST"),
    _route("/api/kernels/{kernel_id}", kernels.get_kernel, "GET"),
    _route("/api/kernels/{kernel_id}", kernels.shut_down, "DELETE"),
    _route("/api/kernels/{kernel_id}/interrupt", kernels.interrupt, "POST"),
    _route("/api/kernels/{kernel_id}/restart", kernels.restart, "POST"),
    WebSocketRoute("/api/kernels/{kernel_id}/channels", channels_endpoint),
]


def add_jupyter(app: FastAPI) -> None:
    """Jupyter's kernel API on ``app``, beside kernel_env's own routes."""
    app.router.routes.extend(ROUTES)
