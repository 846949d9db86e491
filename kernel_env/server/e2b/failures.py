"""E2B's answers to failures, in one place, for each of the door's protocols:

- the control plane and envd's HTTP routes: E2B's shape, ``{"code": <status>, "message"}``
  (:func:`error_response`, :func:`control_error`, :func:`file_error`);
- the door, for any port: a sandbox it cannot open (:func:`sandbox_not_found`) and a body
  over its route's limit (:func:`too_large`), in the same shape;
- envd's Connect services: a ``ConnectError`` with the code the kernel named
  (:func:`connect_error`);
- the code interpreter: a plain-text 400 for a request it refuses (:func:`refused`), and an
  ``error`` line in the cell's stream for a step that fails (:func:`step_failure`).
"""

from __future__ import annotations

import logging
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.responses import JSONResponse, PlainTextResponse

from kernel_env.errors import (
    CapacityReached,
    EpisodeFinished,
    ForkRefused,
    InvalidInput,
    KernelCallError,
    KernelEnvError,
    SandboxError,
    SessionError,
)

__all__ = [
    "connect_error",
    "control_error",
    "error_response",
    "file_error",
    "refused",
    "sandbox_not_found",
    "step_failure",
    "too_large",
]

log = logging.getLogger(__name__)

_CONNECT_CODES = {code.value for code in Code}


def error_response(status: int, message: str, sandbox_id: str | None = None) -> JSONResponse:
    """E2B's error: ``{"code": status, "message": ...}`` (and the sandbox it names, if any)."""
    body: dict[str, object] = {"code": status, "message": message}
    if sandbox_id is not None:
        body["sandboxId"] = sandbox_id
    return JSONResponse(body, status_code=status)


def sandbox_not_found() -> JSONResponse:
    """The answer to a sandbox id that names no running sandbox and to one whose access token
    is wrong (or missing): byte for byte the same, so that an id tells nothing to whoever does
    not hold its token. 502, as E2B's proxy answers: the SDK reads it as "not running"."""
    return error_response(502, "The sandbox was not found, or the access token is not its own")


def too_large(limit: int, path: str) -> JSONResponse:
    """The answer to a request body over its route's limit (sent before the body is read)."""
    return error_response(
        413, f"request body exceeds the server's limit of {limit} bytes for {path}"
    )


def control_error(exc: KernelEnvError, path: str) -> JSONResponse:
    """The control plane's answer to what a route raised."""
    if isinstance(exc, SandboxError):
        return error_response(exc.status, exc.message)
    if isinstance(exc, CapacityReached):
        return error_response(429, str(exc))
    if isinstance(exc, ForkRefused):
        return error_response(409, str(exc))
    if isinstance(exc, InvalidInput):  # a template's kernel this server does not offer
        return error_response(400, str(exc))
    log.warning("e2b: %s failed: %s", path, exc)
    return error_response(500, f"{type(exc).__name__}: {exc}")


def connect_error(exc: KernelCallError | SessionError) -> ConnectError:
    """envd's answer to an operation the kernel refused, or a sandbox gone meanwhile (killed,
    timed out, reaped: E2B's "unavailable")."""
    if isinstance(exc, SessionError):
        return ConnectError(Code.UNAVAILABLE, str(exc))
    return ConnectError(
        Code(exc.code) if exc.code in _CONNECT_CODES else Code.INTERNAL, exc.message
    )


def file_error(exc: ConnectError, *, missing: int = 400) -> JSONResponse:
    """envd's ``/files`` answer to a failed read or write: ``missing`` for a path that is not
    there, else 400."""
    return error_response(missing if exc.code == Code.NOT_FOUND else 400, exc.message)


def refused(message: str, status: int = 400) -> PlainTextResponse:
    """The code interpreter's refusal of a request: plain text."""
    return PlainTextResponse(message, status_code=status)


def step_failure(exc: KernelEnvError) -> dict[str, Any]:
    """The output event (an ``error``) that ends a cell whose step failed."""
    if isinstance(exc, EpisodeFinished):
        name, value = "EpisodeFinished", "the sandbox's episode is over (FINAL was called)"
    else:
        name, value = type(exc).__name__, str(exc)
    return {"output_type": "error", "ename": name, "evalue": value, "traceback": []}
