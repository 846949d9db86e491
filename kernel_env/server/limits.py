"""``BodyLimit``: HTTP request bodies larger than the limit get 413 before anything parses them.

uvicorn bounds WebSocket messages (``ws_max_size``, close 1009) but not HTTP bodies. This pure
ASGI middleware refuses a declared ``Content-Length`` over the limit at once, and otherwise reads
the body (chunked or not) only up to the limit before replaying it to the app, so no request
buffers more than its limit. The limit depends on the route: only ``POST /reset`` carries a
context (``max_bytes``); a step carries at most ``max_code_chars`` of code, and every other
route a small JSON document (``default_bytes``). It runs after ``AuthGate``: a body is read
only once the token is known to be right.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit"]


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        per_path: dict[str, int] | None = None,
        default_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = dict(per_path or {})
        self.default_bytes = default_bytes or max_bytes

    def limit_for(self, path: str) -> int:
        return self.per_path.get(path, self.default_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(send, limit, scope["path"])
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await self._too_large(send, limit, scope["path"])
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, send: Send, limit: int, path: str) -> None:
        payload = json.dumps(
            {"detail": f"request body exceeds the server's limit of {limit} bytes for {path}"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


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
