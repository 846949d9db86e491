"""MCP's answers to failures, in one place: an exception raised while a message is answered
becomes a JSON-RPC error (with its HTTP status), unless it is a tool call that ran into the
episode, which is a tool result with ``isError`` the model reads
(:func:`kernel_env.server.tools.failure_text`). Nothing here is a 500: a failure of the
server's own is a JSON-RPC internal error, logged.

- a session that is gone (closed, expired, another tenant's, never there): HTTP 404, which
  tells an MCP client to start a new session;
- the server full: HTTP 503 with ``Retry-After``;
- bad input (reset options, code over the limit, text that is not Unicode): invalid params;
- the episode over, no episode, the kernel unreachable, a command refused: ``isError``.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from kernel_env.errors import (
    CapacityReached,
    InvalidInput,
    KernelError,
    SessionError,
    UnknownSession,
)
from kernel_env.server.mcp.protocol import INTERNAL_ERROR, INVALID_PARAMS, RpcError

__all__ = ["GONE", "rpc_error_for"]

log = logging.getLogger(__name__)

GONE = "Session not found: it ended, expired, or never existed; initialize a new one"


def rpc_error_for(exc: BaseException) -> RpcError:
    """The JSON-RPC error (and HTTP status) for any other failure."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, (UnknownSession, SessionError)):
        return RpcError(INTERNAL_ERROR, GONE, 404)
    if isinstance(exc, CapacityReached):
        return RpcError(INTERNAL_ERROR, f"Server at capacity: {exc}", 503)
    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        return RpcError(INVALID_PARAMS, f"Invalid params: {problems}")
    if isinstance(exc, InvalidInput):
        return RpcError(INVALID_PARAMS, f"Invalid params: {exc}")
    if isinstance(exc, KernelError):
        return RpcError(INTERNAL_ERROR, f"kernel unavailable: {exc}", 503)
    log.error("MCP: an unexpected failure answered as an internal error", exc_info=exc)
    return RpcError(INTERNAL_ERROR, f"Internal error: {type(exc).__name__}")
