"""The E2B front door: ASGI middleware that hands E2B's traffic to its own apps.

With ``E2B_SANDBOX_URL`` set, the SDK sends every request meant for a sandbox to that one
URL and names the sandbox and the port in headers (``E2b-Sandbox-Id``,
``E2b-Sandbox-Port``), with the sandbox's access token (``X-Access-Token`` or
``E2B-Traffic-Access-Token``) instead of an API key. A request that carries
``E2b-Sandbox-Id`` is therefore the sandbox's, whatever its path: it goes to envd's app
(port 49983) or the code interpreter's (49999) once the sandbox and its token check out.
A signed file link (``download_url()``, ``upload_url()``: ``/files`` with a ``signature``
and no headers) goes to envd's app of the sandbox whose token signed it (:mod:`.signed`).
Requests to E2B's API paths (``/sandboxes``, ...) go to the control plane, which checks
the API key itself. Everything else passes on to kernel_env's own routes, behind
:class:`~kernel_env.server.auth.AuthGate`.

A sandbox that is gone (killed, timed out, never was) answers 502, as E2B's proxy does: the
SDK reads that as "the sandbox is not running". A live sandbox's id with a wrong or missing
token gets that same answer, byte for byte, so ids cannot be probed.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kernel_env.errors import SandboxError
from kernel_env.server.e2b.failures import error_response, sandbox_not_found
from kernel_env.server.e2b.sandboxes import Sandbox, Sandboxes
from kernel_env.server.e2b.signed import is_signed, signed_sandbox

__all__ = ["SANDBOX_KEY", "E2BDoor"]

SANDBOX_KEY = "kernel_env.e2b.sandbox"  # the checked sandbox, in the request's scope state


class E2BDoor:
    def __init__(
        self,
        app: ASGIApp,
        *,
        control: ASGIApp,
        control_prefixes: tuple[str, ...],
        ports: dict[str, ASGIApp],
        files_port: str,
        sandboxes: Callable[[], Sandboxes],
    ) -> None:
        self.app = app
        self.control = control
        self.control_prefixes = control_prefixes
        self.ports = ports
        self.files_port = files_port  # the port whose /files a signed link reaches (envd's)
        self.sandboxes = sandboxes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        sandbox_id = headers.get("e2b-sandbox-id")
        query = QueryParams(scope.get("query_string", b""))
        if sandbox_id is not None:
            await self._to_sandbox(sandbox_id, headers, scope, receive, send)
        elif is_signed(scope["method"], scope["path"], query):
            await self._signed(query, scope, receive, send)
        elif _under(scope["path"], self.control_prefixes):
            await self.control(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _to_sandbox(
        self, sandbox_id: str, headers: dict[str, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        checked = self._check(sandbox_id, headers)
        if isinstance(checked, JSONResponse):
            await checked(scope, receive, send)
            return
        sandbox, app = checked
        scope.setdefault("state", {})[SANDBOX_KEY] = sandbox
        await app(scope, receive, send)

    async def _signed(self, query: QueryParams, scope: Scope, receive: Receive, send: Send) -> None:
        """A signed file link: to envd's ``/files`` of the sandbox whose token signed it."""
        found = signed_sandbox(self.sandboxes().live(), scope["method"], query)
        if isinstance(found, Sandbox) and found.state == "paused":
            found = error_response(502, "The sandbox is paused: connect() resumes it", found.id)
        if isinstance(found, JSONResponse):
            await found(scope, receive, send)
            return
        scope.setdefault("state", {})[SANDBOX_KEY] = found
        await self.ports[self.files_port](scope, receive, send)

    def _check(
        self, sandbox_id: str, headers: dict[str, str]
    ) -> tuple[Sandbox, ASGIApp] | JSONResponse:
        """The sandbox and the app of the port a request names, or E2B's refusal."""
        try:
            sandbox = self.sandboxes().get(sandbox_id)
        except SandboxError:
            return sandbox_not_found()
        token = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
        if not sandbox.admits(token):
            return sandbox_not_found()
        if sandbox.state == "paused" and sandbox.auto_resume:
            self.sandboxes().resume(sandbox, sandbox.timeout)  # its lifecycle's auto-resume
        if sandbox.state == "paused":
            return error_response(502, "The sandbox is paused: connect() resumes it", sandbox_id)
        port = headers.get("e2b-sandbox-port", "")
        app = self.ports.get(port)
        if app is None:
            served = ", ".join(sorted(self.ports))
            return error_response(
                502, f"port {port!r} is not open in a kernel_env sandbox (served: {served})"
            )
        return sandbox, app


def sandbox_in(scope: Scope) -> Sandbox:
    """The sandbox :class:`E2BDoor` checked for this request."""
    sandbox = scope.get("state", {}).get(SANDBOX_KEY)
    if not isinstance(sandbox, Sandbox):
        raise RuntimeError("no sandbox for this request: the route is not behind E2BDoor")
    return sandbox


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)
