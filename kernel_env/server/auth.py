"""Optional bearer-token auth, checked in constant time on HTTP routes and on ``/ws``.

The token is compared with ``hmac.compare_digest`` (a plain ``==`` leaks, through timing, how
many leading bytes matched) and is never logged or echoed: a rejection says only that the token
is missing or wrong.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, status

__all__ = ["BearerAuth", "require_token"]

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


async def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the server's token (if it has one)."""
    auth: BearerAuth = request.app.state.auth
    if not auth.allows(request.headers.get("authorization")):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
