"""Who is calling: bearer tokens, each naming a *tenant*, checked in constant time.

A tenant is a name and a role. A ``client`` sees and acts on its own sessions only (another
tenant's session id answers as an unknown one); an ``operator`` sees and acts on every session
and reads the server's metrics. Tokens come from ``KERNEL_ENV_TOKEN`` (the operator
``default``: a server with one token works as it always has) and from a tokens file
(``--tokens-file``; :func:`load_tenants`). With neither, the server is open and every caller is
the operator ``anonymous``.

Tokens are kept only as SHA-256 digests, compared with ``hmac.compare_digest`` (a plain ``==``
leaks, through timing, how many leading bytes matched; equal-length digests leak no length
either), against every tenant's without stopping at a match. A token is never logged or echoed:
a rejection says only that the token is missing or wrong, and an error in the tokens file names
its line, never a field of it.

``AuthGate`` checks the token as ASGI middleware, from the headers alone: a request without one
is answered 401 before a byte of its body is read (a 150 MB body is never received, let alone
parsed), and a WebSocket handshake without one is refused (HTTP 403). It hands the caller's
tenant to the routes in the request's state (:func:`tenant_of`). The token comes as
``Authorization: Bearer T`` or, as Jupyter's clients send it, ``Authorization: token T``; and
on the paths of a door whose clients put it in the URL (Jupyter's, for its WebSocket), as
``?token=T``, which the access log then shows as ``token=[redacted]``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs

from fastapi import HTTPException
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from kernel_env.server.guard import forbid

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TENANT",
    "AuthGate",
    "Tenant",
    "Tenants",
    "TokensFileError",
    "load_tenants",
    "redact_client_secrets_in_logs",
    "require_operator",
    "tenant_of",
]

Role = Literal["client", "operator"]
ROLES: tuple[Role, ...] = ("client", "operator")

_SCHEMES = ("bearer", "token")  # "token": Jupyter's clients (its gateway client, JupyterLab)
_STATE_KEY = "kernel_env.tenant"


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from: a name and a role, never the token."""

    name: str
    role: Role

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"

    def may_use(self, owner: str) -> bool:
        """Whether this tenant may see and act on a session owned by ``owner``."""
        return self.is_operator or owner == self.name


ANONYMOUS = Tenant("anonymous", "operator")  # a server without tokens: everyone, as ever
DEFAULT_TENANT = "default"  # KERNEL_ENV_TOKEN's tenant, an operator


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tenants:
    """The server's tenants, by their tokens' digests; none means no auth."""

    def __init__(
        self, entries: Iterable[tuple[str, Tenant]] = (), warnings: Iterable[str] = ()
    ) -> None:
        self._entries = [(_digest(token), tenant) for token, tenant in entries]
        self.warnings = tuple(warnings)  # said in the log at start (a file others can read)

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant an ``Authorization`` header names, or None (missing, wrong). Without
        tokens everyone is :data:`ANONYMOUS`."""
        if not self._entries:
            return ANONYMOUS
        scheme, _, credential = (authorization or "").strip().partition(" ")
        if scheme.lower() not in _SCHEMES:
            return None
        presented = _digest(credential.strip())
        found = None
        for digest, tenant in self._entries:  # every one, match or not: no timing of which
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def __repr__(self) -> str:
        return f"Tenants({len(self._entries)} tenant(s))"


def tenant_of(connection: HTTPConnection) -> Tenant:
    """The tenant :class:`AuthGate` found for this request (a route behind the gate only)."""
    tenant = connection.scope.get("state", {}).get(_STATE_KEY)
    if not isinstance(tenant, Tenant):  # fail closed: a route the gate did not see
        raise RuntimeError("no tenant for this request: the route is not behind AuthGate")
    return tenant


def require_operator(connection: HTTPConnection) -> Tenant:
    """The request's tenant, if an operator; else 403."""
    tenant = tenant_of(connection)
    if not tenant.is_operator:
        raise HTTPException(403, "this route is for operators; a client's token cannot read it")
    return tenant


class AuthGate:
    """Pure ASGI middleware: every path but ``public`` ones needs a tenant's token, checked on
    the headers before the body is read."""

    def __init__(
        self,
        app: ASGIApp,
        tenants: Tenants,
        public: Iterable[str],
        public_prefixes: Iterable[str] = (),
        query_token_prefixes: Iterable[str] = (),
        probes: dict[str, ASGIApp] | None = None,
    ) -> None:
        self.app = app
        self.tenants = tenants
        self.public = frozenset(public)
        self.public_prefixes = tuple(public_prefixes)  # static files, e.g. /docs' assets
        # Paths whose clients may send the token as ?token= (a browser's WebSocket cannot
        # set a header): Jupyter's API.
        self.query_token_prefixes = tuple(query_token_prefixes)
        # Paths whose requests without a token a door answers itself, instead of the 401
        # (MCP's /mcp answers `openenv validate`'s empty probe as JSON-RPC).
        self.probes = dict(probes or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope["path"] in self.public
            or scope["path"].startswith(self.public_prefixes)
        ):
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"),
            None,
        )
        if authorization is None and scope["path"].startswith(self.query_token_prefixes):
            authorization = _query_token(scope)
        tenant = self.tenants.identify(authorization)
        if tenant is not None:
            scope.setdefault("state", {})[_STATE_KEY] = tenant
            await self.app(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in self.probes:
            await self.probes[scope["path"]](scope, receive, send)
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


def _query_token(scope: Scope) -> str | None:
    """``?token=T`` as the header it stands for (``token T``), or None."""
    query = scope.get("query_string", b"").decode("latin-1")
    tokens = parse_qs(query, keep_blank_values=True).get("token")
    return f"token {tokens[0]}" if tokens else None


# -- logs -------------------------------------------------------------------------------------

_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
# The loggers the websockets library writes to: the one uvicorn gives it, and its own default.
_WEBSOCKET_LOGGERS = ("uvicorn.error", "websockets.server")
# uvicorn's access lines and its WebSocket lines show the path with its query: ?token=T.
_QUERY_TOKEN = re.compile(r"([?&]token=)[^&\s\"']*")
_PATH_LOGGERS = ("uvicorn.access", "uvicorn.error")


class _RedactClientSecrets(logging.Filter):
    """At debug level the websockets library logs every handshake header (``< authorization:
    Bearer ...``) and the start and end of every frame (a reset frame's ``hf_token``): the
    header's value and the frame's payload are left out, its kind and size kept. A path's
    ``?token=`` (uvicorn's access and WebSocket lines) is left out too."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if any(isinstance(a, str) and "token=" in a for a in args):
            args = tuple(
                _QUERY_TOKEN.sub(r"\1[redacted]", a) if isinstance(a, str) else a for a in args
            )
            record.args = args
        if record.msg == "< %s: %s" and len(args) == 2:
            if str(args[0]).lower() in _SECRET_HEADERS:
                record.args = (args[0], "[redacted]")
        elif record.msg in ("< %s", "> %s") and len(args) == 1 and hasattr(args[0], "opcode"):
            frame: Any = args[0]
            record.args = (f"{frame.opcode.name} [{len(frame.data)} bytes]",)
        return True


_REDACT = _RedactClientSecrets()


def redact_client_secrets_in_logs() -> None:
    """Install the filter that keeps tokens out of the websockets library's debug lines
    (once per process; a logger's filters outlive a later ``dictConfig``)."""
    for name in dict.fromkeys((*_WEBSOCKET_LOGGERS, *_PATH_LOGGERS)):
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


# -- the tokens file --------------------------------------------------------------------------


class TokensFileError(ValueError):
    """The tokens file cannot be used; the message names the file and the line."""


_MAX_FILE_BYTES = 1 << 20
_MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def load_tenants(token: str | None, tokens_file: str | None) -> Tenants:
    """The server's tenants: ``token`` (``KERNEL_ENV_TOKEN``) as the operator ``default``, and
    a line ``name role token`` of ``tokens_file`` each; :class:`TokensFileError` on any
    problem with the file."""
    entries = [(token, Tenant(DEFAULT_TENANT, "operator"))] if token else []
    if not tokens_file:
        return Tenants(entries)
    text, warnings = _read_tokens_file(tokens_file)
    return Tenants([*entries, *_parse_tokens(text, tokens_file, token)], warnings)


def _read_tokens_file(path: str) -> tuple[str, tuple[str, ...]]:
    """The file's text, and a warning when others can read it. A file others can write is
    refused: anyone could make themselves an operator."""
    where = f"tokens file {path}"
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise TokensFileError(f"{where}: not a regular file")
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TokensFileError(f"{where}: cannot read it: {exc.strerror}") from None
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH:
        raise TokensFileError(f"{where}: others can write it (mode {mode:04o}); chmod 600 it")
    if len(data) > _MAX_FILE_BYTES:
        raise TokensFileError(f"{where}: larger than {_MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokensFileError(f"{where}: not UTF-8 text") from None
    warnings: tuple[str, ...] = ()
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warnings = (f"{where}: others can read it (mode {mode:04o}); chmod 600 it",)
    return text, warnings


def _parse_tokens(text: str, path: str, single: str | None) -> list[tuple[str, Tenant]]:
    """``(token, tenant)`` for each line ``name role token``; blank lines and lines starting
    with ``#`` are skipped. Names and tokens are unique, also against ``single``."""
    entries: list[tuple[str, Tenant]] = []
    names: dict[str, int] = {DEFAULT_TENANT: 0} if single else {}
    tokens: dict[bytes, int] = {_digest(single): 0} if single else {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        problem = (
            _line_problem(fields)
            or _clash(names.get(fields[0]), "name")
            or _clash(tokens.get(_digest(fields[2])), "token")
        )
        if problem is not None:
            raise TokensFileError(f"tokens file {path}, line {number}: {problem}")
        name, role, token = fields
        names[name] = tokens[_digest(token)] = number
        entries.append((token, Tenant(name, "client" if role == "client" else "operator")))
    if not entries:
        raise TokensFileError(
            f"tokens file {path} names no tenant: write one a line, as name role token"
        )
    return entries


def _line_problem(fields: list[str]) -> str | None:
    """What is wrong with one line's fields, in words that quote none of them."""
    if len(fields) != 3:
        return "expected three fields, name role token (a token holds no space)"
    name, role, token = fields
    if not _NAME.fullmatch(name):
        return (
            "the name (first field) must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if role not in ROLES:
        return "the role (second field) must be client or operator"
    if not all("!" <= c <= "~" for c in token):
        return "the token (third field) must be printable ASCII"
    if len(token) < _MIN_TOKEN_CHARS:
        return f"the token (third field) must be at least {_MIN_TOKEN_CHARS} characters"
    return None


def _clash(earlier: int | None, what: str) -> str | None:
    """Which earlier line (0: ``KERNEL_ENV_TOKEN``) already has this name or token."""
    if earlier is None:
        return None
    if earlier > 0:
        return f"the same {what} as line {earlier}"
    if what == "name":
        return f"the name {DEFAULT_TENANT} is KERNEL_ENV_TOKEN's (an operator); choose another"
    return "the token is KERNEL_ENV_TOKEN's; give each tenant a token of its own"
