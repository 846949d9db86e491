"""E2B's signed file URLs (``download_url()``, ``upload_url()``): ``/files`` with no headers.

The SDK signs such a link itself, without asking the server: ``signature`` is ``v1_`` and
the unpadded base64 of SHA-256 over ``path:operation:username:access_token`` (and
``:expiration`` when the link expires), ``operation`` being ``read`` (a ``GET``) or ``write``
(a ``POST``). The link names no sandbox (with ``E2B_SANDBOX_URL`` it is the server's own
``/files``), so the sandbox is the one whose access token makes the signature: the door
checks it against each live sandbox's, in constant time. A link signed with no sandbox's
token, for another path, user or operation, or past its ``signature_expiration`` is refused
with 401 in E2B's shape, as envd refuses it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping

from starlette.responses import JSONResponse

from kernel_env.server.e2b.failures import error_response
from kernel_env.server.e2b.sandboxes import Sandbox

__all__ = ["FILES_PATH", "is_signed", "signature", "signed_sandbox"]

FILES_PATH = "/files"
_OPERATIONS = {"GET": "read", "POST": "write"}


def is_signed(method: str, path: str, query: Mapping[str, str]) -> bool:
    """Whether a request without E2B's sandbox headers is a signed file link."""
    return path == FILES_PATH and method in _OPERATIONS and "signature" in query


def signature(
    path: str, operation: str, user: str, token: str, expiration: int | None = None
) -> str:
    """E2B's v1 signature of a file link (the SDK's ``get_signature``)."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signed_sandbox(
    sandboxes: Iterable[Sandbox], method: str, query: Mapping[str, str]
) -> Sandbox | JSONResponse:
    """The live sandbox whose access token signed this link, or E2B's 401."""
    given = query.get("signature", "")
    raw_expiration = query.get("signature_expiration")
    try:
        expiration = int(raw_expiration) if raw_expiration is not None else None
    except ValueError:
        return error_response(401, "invalid signature expiration")
    path, user = query.get("path", ""), query.get("username", "")
    operation = _OPERATIONS[method]
    found = None
    for sandbox in sandboxes:
        expected = signature(path, operation, user, sandbox.access_token, expiration)
        # Every sandbox is checked, matched or not: the time taken tells nothing of which.
        if hmac.compare_digest(expected.encode(), given.encode()) and sandbox.alive:
            found = sandbox
    if found is None:
        return error_response(401, "invalid signature")
    if expiration is not None and expiration < time.time():
        return error_response(401, "signature is already expired")
    return found
