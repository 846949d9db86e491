"""OpenEnv's answers to failures, in one place: an exception raised while a route or a frame
is answered becomes its HTTP status and ``{"detail": ...}`` body (:data:`HANDLERS`, the app's
exception handlers), or its ``/ws`` error frame (:func:`error_for`, :func:`connect_refusal`).

Both name a kernel_env exception's class (``"exception"``), so that kernel_env's remote client
raises the class a local client would. The codes and statuses are docs/server-protocol.md's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from kernel_env import errors
from kernel_env.errors import (
    NOT_INITIALIZED,
    CapacityReached,
    EpisodeError,
    EpisodeFinished,
    ForkRefused,
    InvalidInput,
    KernelError,
    KernelStartError,
    ResetNeeded,
    SessionError,
    UnknownSession,
)
from kernel_env.server.openenv.protocol import (
    CLOSE_POLICY,
    CLOSE_RESTART,
    CLOSE_TRY_LATER,
    SESSION_HEADER,
    ErrorCode,
    Frame,
    error_frame,
    invalid_frame,
    problem,
    validation_errors,
)

__all__ = [
    "EPISODE_OVER_HTTP",
    "EPISODE_OVER_WS",
    "HANDLERS",
    "connect_refusal",
    "error_for",
    "exception_name",
]

# NOT_INITIALIZED (from errors): OpenEnv's exact text for a step before reset; clients match it.
# A step after the end, for an HTTP caller (who starts another with POST /reset) ...
EPISODE_OVER_HTTP = (
    f"the episode is over; POST /reset with this {SESSION_HEADER} header to start another"
)
# ... and for a caller of /ws (who starts another with a reset frame).
EPISODE_OVER_WS = 'the episode is over; send a reset frame ({"type": "reset"}) to start another'


def exception_name(exc: BaseException) -> str | None:
    """The public kernel_env exception class ``exc`` is (the first of
    :mod:`kernel_env.errors`' in its MRO), by name; None for any other exception."""
    for cls in type(exc).__mro__:
        if cls.__name__ in errors.__all__ and getattr(errors, cls.__name__) is cls:
            return cls.__name__
    return None


# -- HTTP ---------------------------------------------------------------------------------


def _detail(
    code: int,
    detail: Any,
    headers: dict[str, str] | None = None,
    exc: BaseException | None = None,
) -> JSONResponse:
    """``{"detail": ...}``, and for a kernel_env exception ``"exception"``: its class's name."""
    body = {"detail": detail}
    name = exception_name(exc) if exc is not None else None
    if name is not None:
        body["exception"] = name
    return JSONResponse(body, status_code=code, headers=headers)


async def _unknown(_: Request, exc: Exception) -> JSONResponse:
    return _detail(404, str(exc), exc=exc)


async def _gone(_: Request, exc: Exception) -> JSONResponse:
    return _detail(410, str(exc), exc=exc)


async def _capacity(_: Request, exc: Any) -> JSONResponse:
    detail = {
        "code": "CAPACITY_REACHED",
        "message": str(exc),
        "active_sessions": exc.active_sessions,
        "max_sessions": exc.max_sessions,
    }
    return _detail(503, detail, {"Retry-After": "5"}, exc)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ValidationError):
        return _detail(422, validation_errors(exc))
    if isinstance(exc, RequestValidationError):
        # FastAPI's errors without the offending input (it may hold a token, or 100 MB).
        return _detail(
            422, [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]
        )
    return _detail(422, [{"type": "value_error", "loc": ["body"], "msg": str(exc)}], exc=exc)


async def _conflict(_: Request, exc: Exception) -> JSONResponse:
    message = str(exc)
    if isinstance(exc, ResetNeeded):
        message = NOT_INITIALIZED
    elif isinstance(exc, EpisodeFinished):
        message = EPISODE_OVER_HTTP
    return _detail(409, message, exc=exc)


async def _kernel(_: Request, exc: Exception) -> JSONResponse:
    return _detail(503, f"kernel unavailable: {exc}", exc=exc)


Handler = Callable[[Request, Any], Awaitable[JSONResponse]]

# Any other exception is the server's own fault: a 500 (Starlette's).
HANDLERS: dict[type[Exception], Handler] = {
    UnknownSession: _unknown,
    SessionError: _gone,
    CapacityReached: _capacity,
    RequestValidationError: _invalid,
    ValidationError: _invalid,
    InvalidInput: _invalid,
    ResetNeeded: _conflict,
    EpisodeFinished: _conflict,
    ForkRefused: _conflict,
    EpisodeError: _conflict,  # any other: a reset's setup command failed, ...
    KernelError: _kernel,
}


# -- /ws ----------------------------------------------------------------------------------


def error_for(exc: BaseException) -> Frame:
    """The error frame for an exception raised while answering a request; a kernel_env
    exception's frame names its class (``"exception"``)."""
    frame = _frame_for(exc)
    name = exception_name(exc)
    if name is not None:
        frame["data"]["exception"] = name
    return frame


def _frame_for(exc: BaseException) -> Frame:
    if isinstance(exc, ValidationError):
        return invalid_frame(validation_errors(exc))
    if isinstance(exc, InvalidInput):  # the caller's input: over a limit, not text
        return error_frame(
            ErrorCode.VALIDATION_ERROR, str(exc), errors=[problem("value_error", (), str(exc))]
        )
    if isinstance(exc, ResetNeeded):
        return error_frame(ErrorCode.EXECUTION_ERROR, NOT_INITIALIZED)
    if isinstance(exc, EpisodeFinished):
        return error_frame(ErrorCode.EXECUTION_ERROR, EPISODE_OVER_WS)
    if isinstance(exc, KernelStartError):
        return error_frame(ErrorCode.FACTORY_ERROR, str(exc), factory_name="kernel")
    if isinstance(exc, KernelError):
        return error_frame(ErrorCode.EXECUTION_ERROR, str(exc))
    if isinstance(exc, SessionError):
        return error_frame(ErrorCode.SESSION_ERROR, str(exc))
    if isinstance(exc, CapacityReached):  # a fork's copies would not fit
        return _capacity_frame(exc)
    if isinstance(exc, ForkRefused):
        return error_frame(ErrorCode.EXECUTION_ERROR, str(exc))
    return error_frame(ErrorCode.EXECUTION_ERROR, f"{type(exc).__name__}: {exc}")


def _capacity_frame(exc: CapacityReached) -> Frame:
    return error_frame(
        ErrorCode.CAPACITY_REACHED,
        str(exc),
        active_sessions=exc.active_sessions,
        max_sessions=exc.max_sessions,
    )


def connect_refusal(exc: Exception, *, attaching: bool) -> tuple[Frame, int]:
    """The frame and the close code that refuse a socket its session: the server is full
    (try later), or shutting down (restart), or the session to attach to is not the caller's
    to take (policy)."""
    if isinstance(exc, CapacityReached):
        return _capacity_frame(exc), CLOSE_TRY_LATER
    code = CLOSE_POLICY if attaching else CLOSE_RESTART
    return error_frame(ErrorCode.SESSION_ERROR, str(exc)), code
