"""``BrowserGuard``: Host and Origin checks on every HTTP route and on ``/ws``.

A server on loopback without a token is still reachable from any web page the user opens: a
page can open ``ws://127.0.0.1:8000/ws`` (WebSockets are not bound by the same-origin policy),
and DNS rebinding lets a page on ``rebind.evil.example`` send requests there under its own
name. Both carry tell-tale headers: a browser always sends ``Origin`` on a WebSocket handshake
and on cross-site requests, and a rebound request carries the attacker's ``Host``. So:

- a ``Host`` that is not an allowed host gets 403 (the WebSocket handshake too);
- an ``Origin`` that is neither the request's own origin (its scheme and the allowed ``Host``
  it came with: scheme, name and port all equal) nor one of the configured origins gets 403.
  A page on another local port, scheme or name is another origin, even on this machine;
- a request without ``Origin`` (curl, httpx, OpenEnv's clients) passes as before.

CORS stays closed (no ``Access-Control-Allow-*`` header) unless origins are configured.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["BrowserGuard", "host_name"]

_WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's netloc: lower case, no port, no brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # host:port (a bare IPv6 address has several colons)
        return value.split(":", 1)[0]
    return value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which Host headers and origins are accepted."""

    def __init__(self, hosts: Iterable[str], origins: Iterable[str], *, any_ip: bool) -> None:
        self.hosts = frozenset(host_name(h) for h in hosts)
        self.origins = frozenset(normal_origin(o) or o.strip().lower() for o in origins)
        self.any_host = "*" in self.hosts
        # Bound to 0.0.0.0 / :: : the server's own address is any of the machine's.
        self.any_ip = any_ip

    @classmethod
    def for_bind(cls, bind: str, hosts: Iterable[str], origins: Iterable[str]) -> HostPolicy:
        return cls(hosts, origins, any_ip=bind.strip("[]") in _WILDCARD_BINDS)

    def host_allowed(self, host: str | None) -> bool:
        if self.any_host:
            return True
        if not host:
            return False
        name = host_name(host)
        return name in self.hosts or (self.any_ip and _is_ip(name))

    def origin_allowed(self, origin: str, own: str | None) -> bool:
        """``origin`` is one of the configured origins, or ``own``: the origin the request was
        sent to (``normal_origin`` of its scheme and allowed Host). With any Host allowed, the
        Host proves nothing, so only configured origins pass."""
        origin = normal_origin(origin) or origin.strip().lower()
        if "*" in self.origins or origin in self.origins:
            return True
        return not self.any_host and own is not None and origin == own


def normal_origin(value: str) -> str | None:
    """``scheme://host[:port]`` in lower case, without the scheme's default port; None for
    anything that is not an http(s) origin ("null", a path, user info, a bad port)."""
    try:
        parts = urlsplit(value.strip().lower())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme, parts.hostname
    if scheme not in _DEFAULT_PORTS or not host or parts.username is not None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    host = f"[{host}]" if ":" in host else host
    port_part = "" if port in (None, _DEFAULT_PORTS[scheme]) else f":{port}"
    return f"{scheme}://{host}{port_part}"


def own_origin(scope: Scope, host: str | None) -> str | None:
    """The origin a request was sent to: the scheme the server serves it with (``https`` behind
    a TLS proxy whose ``X-Forwarded-Proto`` uvicorn trusts) and its ``Host`` header."""
    if not host:
        return None
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    return normal_origin(f"{scheme}://{host}")


class BrowserGuard:
    """Pure ASGI middleware: 403 for a foreign ``Host`` or ``Origin``, before anything else."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {
            k.decode(): v.decode("latin-1")
            for k, v in scope.get("headers", [])
            if k in (b"host", b"origin")
        }
        host, origin = headers.get("host"), headers.get("origin")
        problem = None
        if not self.policy.host_allowed(host):
            problem = "Host header not allowed (set --allowed-hosts to serve this name)"
        elif origin is not None and not self.policy.origin_allowed(origin, own_origin(scope, host)):
            problem = "Origin not allowed (set --allowed-origins to let a web page call)"
        if problem is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            # Closing before accept refuses the handshake: HTTP 403.
            await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
        else:
            await forbid(send, 403, problem)


async def forbid(
    send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer a plain HTTP request with ``{"detail": ...}`` and close the connection (its body,
    if any, is never read)."""
    payload = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
