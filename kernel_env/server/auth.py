"""Optional bearer-token auth, checked in constant time on HTTP routes and on ``/ws``.

The token is compared with ``hmac.compare_digest`` (a plain ``==`` leaks, through timing, how
many leading bytes matched) and is never logged or echoed: a rejection says only that the token
is missing or wrong.

``AuthGate`` checks it as ASGI middleware, from the headers alone: a request without the token
is answered 401 before a byte of its body is read (a 150 MB body is never received, let alone
parsed), and a WebSocket handshake without it is refused (HTTP 403).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from kernel_env.server.guard import forbid

__all__ = ["AuthGate", "BearerAuth"]

_SCHEME = "bearer"


class BearerAuth:
    """Checks ``Authorization: Bearer <token>`` headers; allows everything without a token."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def allows(self, authorization: str | None) -> bool:
        if self._token is None:
            return True
        scheme, _, credential = (authorization or "").strip().partition(" ")
        if scheme.lower() != _SCHEME:
            return False
        return hmac.compare_digest(credential.strip().encode(), self._token)

    def __repr__(self) -> str:
        return f"BearerAuth(enabled={self.enabled})"


class AuthGate:
    """Pure ASGI middleware: every path but ``public`` ones needs the token, checked on the
    headers before the body is read."""

    def __init__(
        self,
        app: ASGIApp,
        auth: BearerAuth,
        public: Iterable[str],
        public_prefixes: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.auth = auth
        self.public = frozenset(public)
        self.public_prefixes = tuple(public_prefixes)  # static files, e.g. /docs' assets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or not self.auth.enabled
            or scope["path"] in self.public
            or scope["path"].startswith(self.public_prefixes)
        ):
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"),
            None,
        )
        if self.auth.allows(authorization):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send(
                {
                    "type": "websocket.close",
                    "code": 1008,
                    "reason": "missing or invalid bearer token",
                }
            )
        else:
            await forbid(
                send, 401, "missing or invalid bearer token", [(b"www-authenticate", b"Bearer")]
            )
