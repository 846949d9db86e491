"""``RemoteSession``: one episode session on a ``kernel-env serve`` server, over its ``/ws``.

The same frames as OpenEnv's ``EnvClient`` (so it also works against any OpenEnv server that
speaks them), with two differences that matter in practice: a reply that does not arrive in
``message_timeout_s`` ends the connection (otherwise every later reply would be shifted by one),
and error frames raise :class:`~kernel_env.errors.RemoteError` with their code and data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from kernel_env.errors import RemoteError
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState, StepResult
from kernel_env.streaming import OutputCallback, streamed

__all__ = ["RemoteSession", "fetch_export", "http_url", "ws_url"]

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


async def fetch_export(
    base_url: str, session_id: str, name: str, *, token: str | None, timeout: float = 60.0
) -> bytes:
    """``GET /sessions/{session_id}/export.zip?name=...``: the zip's bytes, or a clear error."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{http_url(base_url)}/sessions/{session_id}/export.zip"
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        try:
            response = await http.get(url, params={"name": name}, headers=headers)
        except httpx.TransportError as exc:
            raise ConnectionError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        try:
            detail = str(response.json().get("detail", response.text))
        except ValueError:
            detail = response.text
        raise RemoteError(
            f"notebook export failed: HTTP {response.status_code}: {detail[:300]}",
            code="EXPORT_FAILED",
            data={"status": response.status_code},
        )
    return response.content


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


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

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        token: str | None = None,
        max_message_bytes: int | None = 256 * 1024 * 1024,
    ) -> RemoteSession:
        """Open a session; raises ``ConnectionError`` when the server cannot be reached and
        :class:`RemoteError` when it refuses (``UNAUTHORIZED``)."""
        url = ws_url(base_url)
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
                problem = "a wrong token" if token else "no token"
                raise RemoteError(
                    f"the server at {http_url(base_url)} refused the connection (HTTP {status}): "
                    f"{problem}; pass token= or set KERNEL_ENV_TOKEN",
                    code="UNAUTHORIZED",
                    data={"status": status},
                ) from None
            raise ConnectionError(f"cannot open {url}: HTTP {status}") from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise ConnectionError(
                f"cannot reach the kernel-env server at {http_url(base_url)} ({_reason(exc)}); "
                "is `kernel-env serve` running there?"
            ) from None
        return cls(ws, message_timeout_s=message_timeout_s, base_url=base_url, token=token)

    async def reset(self, **kwargs: Any) -> StepResult[REPLObservation]:
        reply = await self._request({"type": "reset", "data": kwargs}, "observation")
        result = _step_result(reply)
        self.session_id = result.observation.metadata.get("session_id", self.session_id)
        return result

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

    async def export_zip(self, name: str) -> bytes:
        """The episode's notebook (named ``name``), context file and child episodes as a zip,
        from ``GET /sessions/{id}/export.zip``."""
        if self.session_id is None or self._base_url is None:
            raise RemoteError("no episode to export: call reset() first", code="NO_EPISODE")
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
            except TimeoutError:
                # The reply may still come, and would answer the *next* request: drop the socket.
                await self._abandon()
                raise RemoteError(
                    f"no reply within {self.message_timeout_s:g} s; the connection was closed",
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
            raise RemoteError(
                str(data.get("message", "server error")),
                code=str(data.get("code", "UNKNOWN")),
                data=data,
            )
        if kind != expect:
            raise RemoteError(
                f"expected a {expect!r} frame, got {kind!r}", code="PROTOCOL_ERROR", data=reply
            )
        return dict(data)

    async def _abandon(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()


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
