"""The episode store's answers to failures: an unknown episode (or another tenant's) is 404,
a stored notebook that cannot be read 500; both ``{"detail": ..., "exception": ...}``, as
OpenEnv's routes answer, so kernel_env's client raises the same class."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse

from kernel_env.errors import StoredEpisodeError, UnknownEpisode

__all__ = ["HANDLERS"]


def _answer(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def answer(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            {"detail": str(exc), "exception": type(exc).__name__}, status_code=status
        )

    return answer


HANDLERS: dict[type[Exception], Callable[[Request, Exception], Awaitable[JSONResponse]]] = {
    UnknownEpisode: _answer(404),
    StoredEpisodeError: _answer(500),
}
