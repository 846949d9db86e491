"""Exceptions -> Jupyter Server's answers, in one place: a JSON ``{"message", "reason"}``
with Jupyter's status for it, or a WebSocket handshake refused.

A kernel id that names no kernel the caller may see (another tenant's, one closed or
reaped, one never started, a session of another door) gets one answer, byte for byte the
same whatever the reason, so ids cannot be probed.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from kernel_env.errors import CapacityReached, InvalidInput, KernelEnvError, UnknownSession
from kernel_env.server.sessions import SessionError

__all__ = ["answer", "no_such_kernel", "refuse_channels"]

log = logging.getLogger(__name__)


def no_such_kernel(kernel_id: str) -> UnknownSession:
    """What a kernel id the caller may not see raises (and answers, whatever the reason)."""
    return UnknownSession(f"Kernel does not exist: {kernel_id}")


def _status_of(exc: BaseException) -> HTTPStatus:
    if isinstance(exc, (UnknownSession, SessionError)):
        return HTTPStatus.NOT_FOUND
    if isinstance(exc, CapacityReached):
        return HTTPStatus.SERVICE_UNAVAILABLE
    if isinstance(exc, InvalidInput):
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.INTERNAL_SERVER_ERROR


def answer(exc: BaseException, kernel_id: str | None = None) -> JSONResponse:
    """Jupyter Server's answer to ``exc``, raised serving a request about ``kernel_id``."""
    status = _status_of(exc)
    if status is HTTPStatus.NOT_FOUND and kernel_id is not None:
        exc = no_such_kernel(kernel_id)  # one answer for every id the caller may not see
    if status is HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(exc, KernelEnvError):
        log.error("the Jupyter API failed", exc_info=exc)
        message = "internal error: the server's log says more"
    else:
        message = str(exc)
    return JSONResponse({"message": message, "reason": status.phrase}, status_code=status)


async def refuse_channels(websocket: WebSocket, kernel_id: str) -> None:
    """Refuse a channels handshake for a kernel the caller may not see: the 404 of the REST
    routes where the server can send one before the handshake, else a plain refusal (403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(answer(no_such_kernel(kernel_id), kernel_id))
    else:
        await websocket.close(code=1008, reason="no such kernel")
