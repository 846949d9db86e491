"""``BodyLimit``: HTTP request bodies larger than the limit get 413 before anything parses them.

uvicorn bounds WebSocket messages (``ws_max_size``, close 1009) but not HTTP bodies. This pure
ASGI middleware refuses a declared ``Content-Length`` over the limit at once, and otherwise reads
the body (chunked or not) only up to the limit before replaying it to the app, so no request
buffers more than its limit. The limit depends on the route: only ``POST /reset`` carries a
context (``max_bytes``); a step carries at most ``max_code_chars`` of code, and every other
route a small JSON document (``default_bytes``). It runs after ``AuthGate``: a body is read
only once the token is known to be right. The refusal is kernel_env's ``{"detail": ...}``
unless the app speaks another protocol (``refusal``: E2B's door answers in E2B's shape).

A route that reads its body as a stream (``streamed``: envd's file uploads) is not buffered:
a declared ``Content-Length`` over the limit is refused at once as elsewhere, and a body that
runs past it raises :class:`BodyTooLarge` from ``receive`` in the app, which answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit", "BodyTooLarge", "Refusal", "too_large"]

Refusal = Callable[[int, str], Response]  # (limit, path) -> the 413 to send


class BodyTooLarge(Exception):
    """A streamed body ran past its route's limit (raised by ``receive``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


def too_large(limit: int, path: str) -> Response:
    """kernel_env's own answer to a body over ``limit`` bytes."""
    detail = f"request body exceeds the server's limit of {limit} bytes for {path}"
    return JSONResponse({"detail": detail}, status_code=413)


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        per_path: dict[str, int] | None = None,
        default_bytes: int | None = None,
        refusal: Refusal = too_large,
        streamed: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.streamed = streamed
        self.max_bytes = max_bytes
        self.per_path = dict(per_path or {})
        self.default_bytes = default_bytes or max_bytes
        self.refusal = refusal

    def limit_for(self, path: str) -> int:
        return self.per_path.get(path, self.default_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(scope, receive, send, limit)
            return
        if scope["path"] in self.streamed:
            await self.app(scope, _counted(receive, limit), send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await self._too_large(scope, receive, send, limit)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = self.refusal(limit, scope["path"])
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _counted(receive: Receive, limit: int) -> Receive:
    """``receive``, raising :class:`BodyTooLarge` once the body passes ``limit`` bytes."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise BodyTooLarge(limit)
        return message

    return counted


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
            return message
        return await receive()  # after the body: disconnect notifications, as usual

    return replay
