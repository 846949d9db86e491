"""``RemoteSession``: one episode session on a ``kernel-env serve`` server, over its ``/ws``.

The same frames as OpenEnv's ``EnvClient`` (so it also works against any OpenEnv server that
speaks them), with two differences that matter in practice: a reply that does not arrive in
``message_timeout_s`` ends the connection (otherwise every later reply would be shifted by one),
and an error frame raises the exception a local episode raises in the same situation (the class
the frame names, ``EpisodeFinished``, ``ResetNeeded``, ...), which is also a
:class:`~kernel_env.errors.RemoteError` carrying the frame's code and data.

The words for a server that cannot be reached (:func:`unreachable`) or that refuses a token
(:func:`auth_refused`) are here, for the client and the command line alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import httpx
from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from kernel_env.errors import (
    EPISODE_OVER,
    NOT_INITIALIZED,
    RemoteError,
    invalid_call,
    remote_error,
)
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState, StepResult
from kernel_env.streaming import OutputCallback, streamed

__all__ = [
    "RemoteSession",
    "auth_refused",
    "fetch_export",
    "http_get",
    "http_url",
    "list_episodes",
    "unreachable",
    "ws_url",
]

M = TypeVar("M", bound=BaseModel)

_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


def ws_url(base_url: str) -> str:
    """``http(s)://host:port[/prefix]`` -> ``ws(s)://host:port[/prefix]/ws``."""
    parts = urlsplit(base_url.strip() if "://" in base_url else f"http://{base_url.strip()}")
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(f"not an http(s) or ws(s) URL: {base_url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def http_url(base_url: str) -> str:
    """The server's HTTP root for any URL :func:`ws_url` accepts (``.../ws`` removed)."""
    parts = urlsplit(ws_url(base_url))
    scheme = "https" if parts.scheme == "wss" else "http"
    return urlunsplit((scheme, parts.netloc, parts.path.removesuffix("/ws"), "", ""))


_START_A_SERVER = (
    "Start one with `kernel-env serve` (`make serve` in a clone of kernel_env), or name yours "
    "with --url or KERNEL_ENV_URL (base_url= in Python)"
)


def unreachable(
    url: str,
    problem: BaseException | str,
    *,
    what: str = "the kernel-env server",
    fix: str = _START_A_SERVER,
) -> str:
    """The one sentence for a server nobody answers at ``url``: the client's, ``kernel-env ps``'
    and ``export``'s (and ``run``'s, for the model's endpoint). ``problem``: the connection's
    error (said in a few words), or those words."""
    reason = problem if isinstance(problem, str) else _reason(problem)
    return f"cannot reach {what} at {url} ({reason}): is it running? {fix}"


def auth_refused(url: str, status: int, token: str | None, *, cli: bool = False) -> str:
    """The one sentence for a server that refused the request's token (or its lack of one);
    ``cli``: for the command line, which reads the token from KERNEL_ENV_TOKEN only."""
    if token:
        given = "in KERNEL_ENV_TOKEN" if cli else "given (token= or KERNEL_ENV_TOKEN)"
        return (
            f"the server at {url} refused the token {given} (HTTP {status}): it is not the "
            "server's token, nor a tenant's"
        )
    fix = "set KERNEL_ENV_TOKEN" if cli else "pass token= or set KERNEL_ENV_TOKEN"
    return f"the server at {url} requires a token (HTTP {status}): {fix}"


async def fetch_export(
    base_url: str,
    session_id: str,
    name: str,
    *,
    token: str | None,
    timeout: float = 60.0,
    cli: bool = False,
) -> bytes:
    """``GET /sessions/{id}/export.zip?name=...`` (``session_id``: a session's id, or its
    episode's): the zip's bytes. Errors raise what a local client raises where there is one
    (``UnknownSession``, ``SessionExpired``, ...; each also a RemoteError ``EXPORT_FAILED``),
    ``ConnectionError`` when nobody answers; ``cli``: words for the command line."""
    path = f"/sessions/{quote(session_id, safe='')}/export.zip"
    return await http_get(
        base_url,
        path,
        token=token,
        params={"name": name},
        timeout=timeout,
        cli=cli,
        failed=("notebook export", "EXPORT_FAILED"),
    )


async def http_get(
    base_url: str,
    path: str,
    *,
    token: str | None,
    params: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    cli: bool = False,
    failed: tuple[str, str] = ("request", "REQUEST_FAILED"),
) -> bytes:
    """``GET path`` of the server: the body's bytes. A refusal raises the class the server
    names (``UnknownEpisode``, ...; also a RemoteError with ``failed``'s code), a server nobody
    answers ``ConnectionError``; ``failed``: what the request was, in words, and its code."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    root = http_url(base_url)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        try:
            response = await http.get(f"{root}{path}", params=params, headers=headers)
        except httpx.TransportError as exc:
            raise ConnectionError(unreachable(root, exc)) from None
    status = response.status_code
    if status == 200:
        return response.content
    if status in (401, 403):
        message = auth_refused(root, status, token, cli=cli)
        raise RemoteError(message, code="UNAUTHORIZED", data={"status": status})
    try:
        body = response.json()
        detail, kind = body.get("detail", response.text), body.get("exception")
    except (ValueError, AttributeError):
        detail, kind = response.text, None
    if isinstance(detail, dict):  # CAPACITY_REACHED's detail is an object
        detail, data = detail.get("message", ""), {**detail, "status": status}
    else:
        data = {"status": status}
    message = f"{failed[0]} failed (HTTP {status}): {str(detail)[:300]}"
    raise remote_error(kind, message, code=failed[1], data=data)


_EPISODES_PAGE = 1000  # the server's largest page of GET /episodes


async def list_episodes(
    base_url: str, *, token: str | None, filters: Mapping[str, Any], limit: int | None
) -> list[dict[str, Any]]:
    """The stored episodes ``GET /episodes`` lists with ``filters`` (the route's query
    parameters; None values left out), newest first, page after page, ``limit`` at most."""
    params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in filters.items()}
    params = {k: v for k, v in params.items() if v is not None}
    found: list[dict[str, Any]] = []
    cursor: int | None = None
    while limit is None or len(found) < limit:
        page_size = _EPISODES_PAGE if limit is None else min(_EPISODES_PAGE, limit - len(found))
        query = {**params, "limit": page_size, **({"cursor": cursor} if cursor else {})}
        body = await http_get(
            base_url, "/episodes", token=token, params=query, failed=("listing", "LIST_FAILED")
        )
        page = json.loads(body)
        found += page["episodes"]
        cursor = page.get("next_cursor")
        if cursor is None:
            break
    return found


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words (the cause of a wrapped error, if known)."""
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, (TimeoutError, httpx.TimeoutException)):
            return "timed out"
        if isinstance(cause, socket.gaierror):
            return "no such host"
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


# A kernel_env server names the class in its error frames; these stand in for other servers.
_BY_CODE = {
    "VALIDATION_ERROR": "InvalidInput",
    "CAPACITY_REACHED": "CapacityReached",
    "SESSION_ERROR": "SessionError",
    "FACTORY_ERROR": "KernelStartError",
}
# What a caller of the client does about these is what a local client says (the server's
# words are for callers of its frames); the frame's own message stays in ``data``.
_CLIENT_WORDS = {"ResetNeeded": NOT_INITIALIZED, "EpisodeFinished": EPISODE_OVER}


def _frame_error(data: Mapping[str, Any], request: str) -> RemoteError:
    """The exception for an error frame's ``data``, answering a ``request`` frame."""
    code = str(data.get("code", "UNKNOWN"))
    message = str(data.get("message", "server error"))
    kind = data.get("exception")
    if not isinstance(kind, str):
        kind = "ResetNeeded" if message == NOT_INITIALIZED else _BY_CODE.get(code)
    message = _CLIENT_WORDS.get(kind or "", message)
    problems = data.get("errors")
    if code == "VALIDATION_ERROR" and isinstance(problems, list) and message == "Invalid message":
        message = invalid_call(request, [p for p in problems if isinstance(p, Mapping)])
    return remote_error(kind, message, code=code, data=dict(data))


class RemoteSession:
    """One connection = one server-side session. Use :meth:`connect` to create one."""

    def __init__(
        self,
        ws: ClientConnection,
        *,
        message_timeout_s: float,
        base_url: str | None = None,
        token: str | None = None,
    ) -> None:
        self._ws: ClientConnection | None = ws
        self.message_timeout_s = message_timeout_s  # how long a request waits for its reply
        self._base_url = base_url
        self._token = token
        self._lock = asyncio.Lock()  # one request in flight: replies carry no correlation id
        self.session_id: str | None = None
        self.kernel_id: str | None = None  # the episode's, in Jupyter's kernel API (its reset says)

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        token: str | None = None,
        max_message_bytes: int | None = 256 * 1024 * 1024,
        session_id: str | None = None,
    ) -> RemoteSession:
        """Open a session (or, with ``session_id``, attach to that open one: a fork's copy);
        raises ``ConnectionError`` when the server cannot be reached and
        :class:`RemoteError` when it refuses (``UNAUTHORIZED``)."""
        url = ws_url(base_url)
        if session_id is not None:
            query = urlencode({"session": session_id})
            url += f"&{query}" if urlsplit(url).query else f"?{query}"
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                open_timeout=connect_timeout_s,
                max_size=max_message_bytes,
                proxy=None,  # loopback and cluster-internal servers: never via a proxy
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise RemoteError(
                    auth_refused(http_url(base_url), status, token),
                    code="UNAUTHORIZED",
                    data={"status": status},
                ) from None
            raise ConnectionError(f"cannot open {url}: HTTP {status}") from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ConnectionError(unreachable(http_url(base_url), exc)) from None
        session = cls(ws, message_timeout_s=message_timeout_s, base_url=base_url, token=token)
        session.session_id = session_id
        return session

    async def reset(self, **kwargs: Any) -> StepResult[REPLObservation]:
        reply = await self._request({"type": "reset", "data": kwargs}, "observation")
        result = _step_result(reply)
        self.session_id = result.observation.metadata.get("session_id", self.session_id)
        self.kernel_id = result.observation.metadata.get("kernel_id", self.kernel_id)
        return result

    async def interrupt(self) -> None:
        """Interrupt the episode's running cell: ``POST /api/kernels/{id}/interrupt``, Jupyter's
        kernel API on the same server, over HTTP beside the socket (which the running step
        holds). Before a reset, nothing runs: nothing is sent."""
        kernel = self.kernel_id or self.session_id  # the route takes a session's id too
        if kernel is None or self._base_url is None:
            return
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        root = http_url(self._base_url)
        url = f"{root}/api/kernels/{quote(kernel, safe='')}/interrupt"
        try:
            status, text = await asyncio.to_thread(_post, url, headers, self.message_timeout_s)
        except OSError as exc:
            raise ConnectionError(unreachable(root, exc)) from None
        if status == 204:
            return
        if status in (401, 403):
            message = auth_refused(root, status, self._token)
            raise RemoteError(message, code="UNAUTHORIZED", data={"status": status})
        raise RemoteError(
            f"the interrupt failed (HTTP {status}): {text[:300]}",
            code="INTERRUPT_FAILED",
            data={"status": status},
        )

    async def step(
        self, action: REPLAction, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        data = action.model_dump(exclude_defaults=True, exclude={"metadata"})
        if action.metadata:
            data["metadata"] = action.metadata
        frame: dict[str, Any] = {"type": "step", "data": data}
        if on_output is None:
            return _step_result(await self._request(frame, "observation"))
        frame["stream"] = True  # kernel_env's extension: "output" frames, then the observation
        reply = await streamed(lambda push: self._request(frame, "observation", push), on_output)
        return _step_result(reply)

    async def state(self) -> REPLState:
        reply = await self._request({"type": "state"}, "state")
        return _lenient(REPLState, reply)

    async def fork(self, n: int, *, own_budget: bool) -> list[dict[str, Any]]:
        """A ``fork`` frame: ``n`` copies of the episode as new sessions on the server; each
        one's ``session_id``, ``episode_id`` and how it was made (attach with
        ``connect(..., session_id=)``)."""
        frame = {"type": "fork", "data": {"n": n, "own_budget": own_budget}}
        reply = await self._request(frame, "fork")
        return [dict(copy) for copy in reply.get("sessions") or []]

    async def export_zip(self, name: str) -> bytes:
        """The episode's notebook (named ``name``), context file and child episodes as a zip,
        from ``GET /sessions/{id}/export.zip``."""
        if self.session_id is None or self._base_url is None:
            raise remote_error("ResetNeeded", NOT_INITIALIZED, code="NO_EPISODE")
        return await fetch_export(
            self._base_url, self.session_id, name, token=self._token, timeout=self.message_timeout_s
        )

    async def close(self) -> None:
        """Tell the server to end the session and close the socket; idempotent."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        # If the server already ended it, the socket is gone either way.
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps({"type": "close"}))
        await ws.close()

    async def _request(
        self,
        frame: dict[str, Any],
        expect: str,
        on_output: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Send ``frame`` and return its reply's data; ``output`` frames before the reply go
        to ``on_output`` (each one restarts the reply's timeout)."""
        async with self._lock:
            ws = self._ws
            if ws is None:
                raise RemoteError("the connection is closed", code="CONNECTION_CLOSED")
            parsed: Any = None  # the reply, parsed already when output frames came first
            try:
                await ws.send(json.dumps(frame))
                raw: str | bytes = await asyncio.wait_for(ws.recv(), self.message_timeout_s)
                if on_output is not None:
                    parsed = json.loads(raw)
                while on_output is not None and _is_output(parsed):
                    on_output(parsed["data"])
                    raw = await asyncio.wait_for(ws.recv(), self.message_timeout_s)
                    parsed = json.loads(raw)
            except asyncio.CancelledError:
                # Its reply would answer the next request: the socket cannot serve another.
                await self._abandon()
                raise
            except TimeoutError:
                # The reply may still come, and would answer the *next* request: drop the socket.
                await self._abandon()
                raise RemoteError(
                    f"no reply within {self.message_timeout_s:g} s (message_timeout_s); the "
                    "connection was closed: use a new client, with a longer message_timeout_s "
                    "than the server's step timeout",
                    code="TIMEOUT",
                ) from None
            except ConnectionClosed as exc:
                # A server that refuses a session (CAPACITY_REACHED) sends an error frame and
                # closes; the send may fail first, but the frame is still there to read.
                pending = await _pending(ws)
                await self._abandon()
                if pending is None:
                    raise _closed_error(exc) from None
                raw, parsed = pending, None
        reply = parsed if parsed is not None else json.loads(raw)
        kind, data = reply.get("type"), reply.get("data") or {}
        if kind == "error":
            raise _frame_error(data, str(frame.get("type")))
        if kind != expect:
            raise RemoteError(
                f"expected a {expect!r} frame, got {kind!r}", code="PROTOCOL_ERROR", data=reply
            )
        return dict(data)

    async def _abandon(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()


def _post(url: str, headers: dict[str, str], timeout: float) -> tuple[int, str]:
    """``POST url`` with no body: its status and the start of its body. By the standard
    library, not httpx: a Ctrl-C waits on this request, and httpx's first client costs
    0.4 to 1 s on a loaded host (its transports' imports, its CA bundle)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = kind(parts.netloc, timeout=timeout)
    try:
        connection.request("POST", parts.path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(4096).decode("utf-8", "replace")
    finally:
        connection.close()


def _is_output(frame: Any) -> bool:
    return (
        isinstance(frame, dict)
        and frame.get("type") == "output"
        and isinstance(frame.get("data"), dict)
    )


async def _pending(ws: ClientConnection) -> str | bytes | None:
    try:
        return await asyncio.wait_for(ws.recv(), 1.0)
    except (ConnectionClosed, TimeoutError):
        return None


def _closed_error(exc: ConnectionClosed) -> RemoteError:
    close = exc.rcvd
    code, reason = (close.code, close.reason) if close is not None else (1006, "")
    return RemoteError(
        f"the server closed the connection ({code}{': ' + reason if reason else ''})",
        code="CONNECTION_CLOSED",
        data={"close_code": code, "reason": reason},
    )


def _step_result(data: dict[str, Any]) -> StepResult[REPLObservation]:
    """Parse an observation payload tolerantly: unknown keys are dropped, missing ones default,
    metadata is read from ``data.metadata`` or, for older servers, from the observation."""
    obs = dict(data.get("observation") or {})
    obs["result"] = _lenient(CodeBlockResult, obs.get("result") or {})
    obs["metadata"] = data.get("metadata") or obs.get("metadata") or {}
    obs["reward"] = data.get("reward")
    obs["done"] = bool(data.get("done", False))
    observation = _lenient(REPLObservation, obs)
    return StepResult(observation=observation, reward=observation.reward, done=observation.done)


def _lenient(model: type[M], data: dict[str, Any]) -> M:
    known = {k: v for k, v in data.items() if k in model.model_fields and v is not None}
    return model.model_validate(known)
