"""A kernel on a Jupyter Kernel Gateway or Enterprise Gateway: REST for its lifecycle, one
WebSocket for its channels.

The lifecycle is ``GET /api/kernelspecs`` (a clear error for a wrong token or kernel name),
``POST /api/kernels``, ``POST .../interrupt``, ``POST .../restart`` and ``DELETE``. The channels
travel as JSON messages with a ``channel`` field over ``WS /api/kernels/{id}/channels``: one
reader task hands every message to the driver's per-channel queues, one writer task sends, no
threads. What the gateways do, measured on Kernel Gateway 3.0.1, that shapes this module:

- **Delayed ACKs.** The gateway never sets TCP_NODELAY, so each reply frame after the first waits
  for our ACK of the previous one, and Linux delays that ACK by 40 ms, on every step.
  asyncio already sets TCP_NODELAY on our side (that changes nothing); re-arming TCP_QUICKACK on
  our socket whenever data arrives sends the ACK at once and removes the stall (a step then
  costs little more than a local kernel's: ``benchmarks/bench_gateway.py``).
- **A dead kernel** is noticed by the gateway's restarter (every ``KernelRestarter.time_to_dead``,
  3 s by default), which auto-restarts it and sends ``status: restarting`` (no parent) on the
  socket; a failed restart sends ``status: dead``. The REST model keeps saying ``busy``, so the
  socket, not REST, is what tells us. We then replace the kernel (DELETE, POST) rather than use
  the gateway's restart: racing it, our ``POST .../restart`` answered 500 or killed its
  half-started kernel, and channels opened meanwhile now and then never got a reply (a kernel
  that died young is restarted on new ports); its activity record was no reliable sign either.
  A socket that closes while the gateway still answers means the kernel is gone (deleted,
  culled): reported dead, and a new kernel replaces it. If the gateway does not answer either,
  the step fails with KernelError.
- **Environment.** An ``env`` in the POST body *replaces* the kernel's environment (PATH, the
  gateway's whitelist, and our ``KERNEL_*`` entries): we always send one, so a kernel never
  inherits the gateway's own variables.
- **Message size.** The gateway accepts WebSocket messages up to 10 MiB (tornado's default), so a
  large file is staged in chunks, as binary messages whose buffer the kernel reads from its
  parent message: 100 MB of base64 pasted into cells took minutes to compile.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import json
import logging
import socket
import ssl
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import websockets
from jupyter_client.jsonutil import json_default
from jupyter_client.session import Session
from websockets.asyncio.client import ClientConnection

from kernel_env.errors import KernelError, KernelStartError
from kernel_env.inkernel import contract, extension
from kernel_env.kernel.base import ExecutionResult, Kernel
from kernel_env.kernel.modes import DEFAULT_KERNEL_USERNAME

__all__ = ["GatewayConfig", "GatewayKernel"]

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only
_AUTORESTART_SETTLE = 0.5  # seconds; see GatewayKernel._replace

# Metadata and buffers for the next execute_request this task sends (see stage_file).
_ATTACHED: contextvars.ContextVar[tuple[dict[str, Any], list[bytes]] | None] = (
    contextvars.ContextVar("kernel_env_gateway_attached", default=None)
)

# Code sent to the kernel is constant; its parameters travel in the message's metadata and
# buffers, which ipykernel keeps in ``kernel.get_parent()`` while the cell runs.
_HELPERS_LOADED = (
    f"__import__('sys').modules.get({contract.EXTENSION_MODULE!r}) is not None"
    f" or get_ipython().extension_manager.load_extension({contract.EXTENSION_MODULE!r}) is None"
)
# A kernel without kernel_env is sent the extension's source and the contract's, each run as
# the module of its name (the metadata's names, the buffers' sources, in order): the
# extension's ``from kernel_env.inkernel.contract import ...`` finds the contract in
# sys.modules, without the packages above it. The last one is loaded as the extension.
_SHIPPED = (contract, extension)
_SHIP_HELPERS = """\
def _kernel_env_ship(parent):
    import sys, types
    for name, source in zip(parent["metadata"]["kernel_env_ship"], parent["buffers"]):
        module = types.ModuleType(name)
        module.__file__ = f"<{name}>"
        sys.modules[name] = module
        exec(compile(bytes(source).decode("utf-8"), module.__file__, "exec"), module.__dict__)
    module.load_ipython_extension(get_ipython())
_kernel_env_ship(get_ipython().kernel.get_parent())
del _kernel_env_ship
"""
# A private directory for staged files, removed when the kernel process exits.
_STAGE_DIR = (
    "(lambda d: (__import__('atexit').register(__import__('shutil').rmtree, d, True), d)[1])"
    "(__import__('tempfile').mkdtemp(prefix='kernel-env-'))"
)
_STAGE_CHUNK = """\
with open(*get_ipython().kernel.get_parent()["metadata"]["kernel_env_stage"]) as _kernel_env_f:
    _kernel_env_f.write(get_ipython().kernel.get_parent()["buffers"][0])
del _kernel_env_f
"""


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Where the gateway is and how to talk to it. Times in seconds."""

    url: str  # http(s)://host:port[/base_url]
    token: str | None = field(default=None, repr=False)  # sent as "Authorization: token ..."
    kernel_name: str = "python3"
    # KERNEL_* entries for every kernel; KERNEL_USERNAME is DEFAULT_KERNEL_USERNAME unless given
    # (Enterprise Gateway refuses root, and its per-user limits count by it).
    env: Mapping[str, str] = field(default_factory=dict)
    verify: bool | str | ssl.SSLContext = True  # TLS: verify, a CA bundle path, or a context
    connect_timeout: float = 10.0  # TCP/TLS/WebSocket handshakes
    request_timeout: float = 30.0  # REST calls other than starting a kernel
    start_timeout: float = 120.0  # starting or restarting a kernel (a pod may need pulling)
    check_interval: float = 2.0  # REST liveness check, per kernel
    ping_interval: float | None = 5.0  # WebSocket pings: a vanished host is noticed in two
    ping_timeout: float | None = 5.0
    max_message_bytes: int | None = 512 * _MiB  # one message from the gateway
    stage_chunk_bytes: int = 8 * _MiB  # below the gateway's 10 MiB message limit
    quickack: bool = True  # re-arm TCP_QUICKACK as data arrives (the 40 ms stall fix)
    ship_helpers: bool | None = None  # None: only when the kernel cannot import kernel_env

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"gateway url must be http(s)://host[:port][/path], got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.token == "":
            raise ValueError("gateway token must not be empty (leave it unset for no token)")
        if not self.kernel_name:
            raise ValueError("kernel_name must not be empty")
        bad = sorted(k for k in self.env if not k.startswith("KERNEL_"))
        if bad:
            raise ValueError(
                f"gateway kernels only receive KERNEL_* variables; not allowed: {', '.join(bad)}"
            )
        object.__setattr__(self, "env", dict(self.env))
        for name in (
            "connect_timeout",
            "request_timeout",
            "start_timeout",
            "check_interval",
            "stage_chunk_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def ws_url(self) -> str:
        return "ws" + self.url.removeprefix("http")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https:"):
            return None
        if isinstance(self.verify, ssl.SSLContext):
            return self.verify
        return _ssl_context(self.verify)


@functools.lru_cache(maxsize=8)
def _ssl_context(verify: bool | str) -> ssl.SSLContext:
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)


@functools.cache
def _helpers_source() -> tuple[bytes, ...]:
    return tuple(inspect.getsource(module).encode("utf-8") for module in _SHIPPED)


class _QuickAckConnection(ClientConnection):
    """A client connection that ACKs every segment at once (see the module docstring).

    TCP_QUICKACK is not sticky: Linux falls back to delayed ACKs after a few segments, so it is
    re-armed on each arrival, which also sends an ACK that is already pending right away.
    """

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._tcp = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        sock = self._tcp
        if sock is not None and _TCP_QUICKACK is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
        super().data_received(data)


def encode_message(msg: dict[str, Any], buffers: Sequence[bytes] = ()) -> str | bytes:
    """A message as Jupyter's WebSocket protocol frames it: JSON text, or binary with buffers."""
    head = json.dumps(msg, default=json_default)
    if not buffers:
        return head
    parts = [head.encode("utf-8"), *buffers]
    offsets, pos = [], 4 * (len(parts) + 1)
    for part in parts:
        offsets.append(pos)
        pos += len(part)
    return b"".join([struct.pack(f"!{len(parts) + 1}I", len(parts), *offsets), *parts])


def decode_message(frame: str | bytes) -> dict[str, Any]:
    """The inverse of :func:`encode_message` (binary frames carry ``buffers``)."""
    if isinstance(frame, str):
        msg: dict[str, Any] = json.loads(frame)
        return msg
    view = memoryview(frame)
    (count,) = struct.unpack_from("!I", view)
    offsets = [*struct.unpack_from(f"!{count}I", view, 4), len(view)]
    msg = json.loads(bytes(view[offsets[0] : offsets[1]]))
    msg["buffers"] = [view[a:b] for a, b in itertools.pairwise(offsets[1:])]
    return msg


def _describe(response: httpx.Response) -> str:
    """The gateway's own words for an error response."""
    try:
        body = response.json()
        detail = body.get("message") or body.get("reason") or ""
    except ValueError:
        detail = response.text[:200]
    return f"{response.status_code} {response.reason_phrase}" + (f": {detail}" if detail else "")


def _refusal(response: httpx.Response, env: Mapping[str, str]) -> str:
    """A gateway's refusal of a new kernel in one line: its words, and what to change."""
    said = _describe(response)
    if "KERNEL_USERNAME" in said or "not authorized" in said:
        user = env.get("KERNEL_USERNAME")
        return (
            f"the gateway refused a kernel for user {user!r} ({said}); give it one it accepts: "
            "kernel-env serve --gateway-env KERNEL_USERNAME=NAME (or GatewayConfig(env=...))"
        )
    if "per user" in said:
        return (
            f"the gateway refused a new kernel ({said}): its per-user kernel limit is reached; "
            "close a session or raise the gateway's max_kernels_per_user"
        )
    return (
        f"the gateway refused a new kernel ({said}): its kernel limit (max_kernels) is reached "
        "or the token lacks permission"
    )


class GatewayKernel(Kernel):
    """A kernel started by a Jupyter (Kernel|Enterprise) Gateway, driven over its WebSocket."""

    def __init__(
        self, config: GatewayConfig, *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        extra = dict(env or {})
        bad = sorted(k for k in extra if not k.startswith("KERNEL_"))
        if bad:
            raise ValueError(f"gateway kernels only receive KERNEL_* variables: {', '.join(bad)}")
        self.config = config
        self._env = {"KERNEL_USERNAME": DEFAULT_KERNEL_USERNAME, **config.env, **extra}
        self._http: httpx.AsyncClient | None = None
        self._ws: ClientConnection | None = None
        self._session: Session | None = None
        self._outbox: asyncio.Queue[str | bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._created = False
        self._lost: str | None = None  # why the kernel is gone: "restarting", "dead", ...
        self._last_check = 0.0
        self._helpers_needed = True

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        try:
            await self._load_helpers()
        except BaseException:
            await self.shutdown()
            raise

    async def execute(self, code: str, **kwargs: Any) -> ExecutionResult:
        if self.started and self._lost is not None:
            return await self._replace_lost_kernel()
        # After a restart (which happens inside an execute, holding its lock) the helpers are
        # loaded before the next cell: the episode's setup calls into them.
        if self._helpers_needed and self.started:
            await self._load_helpers()
        return await super().execute(code, **kwargs)

    async def _replace_lost_kernel(self) -> ExecutionResult:
        """The kernel died between cells: restart it, and report the cell as died, not run.

        Sent as usual, the cell could run in the kernel the gateway restarted meanwhile, with
        no helpers and no context, and the episode would not know its state was lost.
        """
        log.warning("kernel %s died between cells (%s); restarting", self.kernel_id, self._lost)
        started, t0 = datetime.now(UTC), time.perf_counter()
        async with self._lock:
            await self.restart()
        return ExecutionResult(
            status="died",
            outputs=[],
            stdout="",
            stderr="",
            error=None,
            execution_count=None,
            user_expressions={},
            started=started,
            finished=datetime.now(UTC),
            duration=time.perf_counter() - t0,
            restarted=True,
        )

    async def _load_helpers(self) -> None:
        self._helpers_needed = False
        if not self.config.ship_helpers:
            probe = await Kernel.execute(
                self,
                "",
                silent=True,
                user_expressions={"ok": _HELPERS_LOADED},
                timeout=self.config.request_timeout,
            )
            if _expression(probe, "ok") == "True":
                return
            if self.config.ship_helpers is False:
                raise KernelStartError(
                    f"the kernel cannot import {contract.EXTENSION_MODULE} (ship_helpers=False)",
                    kernel_id=self.kernel_id,
                )
        log.info("kernel %s lacks kernel_env: sending the helpers' source", self.kernel_id)
        names = [module.__name__ for module in _SHIPPED]
        result = await self._execute_with(
            _SHIP_HELPERS,
            {"kernel_env_ship": names},
            list(_helpers_source()),
            self.config.request_timeout,
        )
        if not result.success:
            self._helpers_needed = True
            raise KernelStartError(
                f"loading the helpers into the kernel failed: {_error_text(result)}",
                kernel_id=self.kernel_id,
            )

    # -- transport hooks ------------------------------------------------------------------

    async def _launch(self) -> None:
        self._http = httpx.AsyncClient(
            base_url=self.config.url,
            headers=self.config.headers,
            timeout=httpx.Timeout(self.config.request_timeout, connect=self.config.connect_timeout),
            verify=self.config.ssl_context() or True,
        )
        try:
            await self._check_kernelspec()
            await self._create_kernel()
            await self._connect(self.config.connect_timeout)
        except BaseException:
            await self._terminate()
            raise

    async def _relaunch(self) -> None:
        await self._disconnect()
        lost, self._lost = self._lost, None
        self._helpers_needed = True
        if lost is None:  # alive but stuck (the timeout ladder): restart it in place
            await self._restart_or_replace()
        else:
            await self._replace(lost)
        await self._connect(self.config.connect_timeout)

    async def _terminate(self) -> None:
        await self._disconnect()
        http, self._http = self._http, None
        if http is None:
            return
        try:
            if self._created:
                self._created = False
                with contextlib.suppress(httpx.HTTPError):  # gone already is fine
                    await http.delete(self._path(), timeout=min(self.config.request_timeout, 10.0))
        finally:
            await http.aclose()

    def _send(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        parent: dict | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        if self._session is None or self._outbox is None:
            raise KernelError("not connected to the gateway", kernel_id=self.kernel_id)
        attached = _ATTACHED.get() if msg_type == "execute_request" else None
        carried, buffers = attached or ({}, [])
        msg = self._session.msg(
            msg_type, content, parent=parent, metadata={**carried, **(metadata or {})}
        )
        msg["channel"] = channel
        self._outbox.put_nowait(encode_message(msg, buffers))
        return str(msg["header"]["msg_id"])

    async def is_alive(self) -> bool:
        if self._lost is not None or self._ws is None:
            return False
        now = time.monotonic()
        if now - self._last_check >= self.config.check_interval:
            self._last_check = now
            state = await self._rest_state()
            if state in ("missing", "dead"):
                self._lost = state
        return self._lost is None

    async def interrupt(self) -> None:
        await self._post(self._path("interrupt"), self.config.request_timeout, "interrupt")

    async def stage_file(self, name: str, data: bytes) -> str:
        """Send ``data`` to a file in the kernel (it cannot read ours), in binary chunks."""
        made = await Kernel.execute(
            self,
            "",
            silent=True,
            user_expressions={"dir": _STAGE_DIR},
            timeout=self.config.request_timeout,
        )
        directory = _expression(made, "dir")
        if directory is None:
            raise KernelError(
                f"could not make a staging directory in the kernel: {_error_text(made)}",
                kernel_id=self.kernel_id,
            )
        path = f"{_literal(directory)}/{name}"
        step = self.config.stage_chunk_bytes
        view = memoryview(data)
        for offset in range(0, max(len(view), 1), step):
            chunk = view[offset : offset + step]
            meta = {"kernel_env_stage": [path, "ab" if offset else "wb"]}
            result = await self._execute_with(
                _STAGE_CHUNK, meta, [chunk], self.config.request_timeout
            )
            if not result.success:
                raise KernelError(
                    f"staging {name} in the kernel failed: {_error_text(result)}",
                    kernel_id=self.kernel_id,
                )
        return path

    # -- REST -----------------------------------------------------------------------------

    def _path(self, action: str | None = None) -> str:
        path = f"/api/kernels/{quote(self.kernel_id)}"
        return f"{path}/{action}" if action else path

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise KernelError("the kernel is shut down", kernel_id=self.kernel_id)
        return self._http

    async def _request(
        self, method: str, path: str, timeout: float, what: str, **kwargs: Any
    ) -> httpx.Response:
        try:
            return await self._client().request(method, path, timeout=timeout, **kwargs)
        except httpx.TimeoutException as exc:
            raise KernelError(
                f"{what}: the gateway at {self.config.url} did not answer within {timeout:g} s",
                kernel_id=self.kernel_id,
            ) from exc
        except httpx.HTTPError as exc:
            raise KernelError(
                f"{what}: cannot reach the gateway at {self.config.url}: {exc!r}",
                kernel_id=self.kernel_id,
            ) from exc

    async def _post(self, path: str, timeout: float, what: str, **kwargs: Any) -> httpx.Response:
        response = await self._request("POST", path, timeout, what, **kwargs)
        if response.is_error:
            raise KernelError(
                f"{what}: the gateway answered {_describe(response)}", kernel_id=self.kernel_id
            )
        return response

    async def _check_kernelspec(self) -> None:
        what = "listing the gateway's kernel specs"
        try:
            response = await self._request(
                "GET", "/api/kernelspecs", self.config.request_timeout, what
            )
        except KernelError as exc:
            raise KernelStartError(str(exc)) from exc.__cause__
        if response.status_code in (401, 403):
            raise KernelStartError(
                f"the gateway at {self.config.url} refused our token ({_describe(response)}); "
                "set the gateway token"
            )
        if response.is_error:
            raise KernelStartError(f"{what}: the gateway answered {_describe(response)}")
        names = sorted((response.json().get("kernelspecs") or {}).keys())
        if self.config.kernel_name not in names:
            raise KernelStartError(
                f"the gateway has no kernel spec {self.config.kernel_name!r} "
                f"(it has: {', '.join(names) or 'none'})"
            )

    async def _create_kernel(self) -> None:
        body = {"name": self.config.kernel_name, "env": self._env}
        what = f"starting a {self.config.kernel_name!r} kernel on the gateway"
        try:
            response = await self._request(
                "POST", "/api/kernels", self.config.start_timeout, what, json=body
            )
        except KernelError as exc:
            raise KernelStartError(str(exc)) from exc.__cause__
        if response.status_code == 403:
            raise KernelStartError(_refusal(response, self._env))
        if response.is_error:
            raise KernelStartError(f"{what}: the gateway answered {_describe(response)}")
        self.kernel_id = str(response.json()["id"])
        self._created = True
        log.debug("gateway kernel %s started", self.kernel_id)

    async def _restart_or_replace(self) -> None:
        try:
            response = await self._request(
                "POST", self._path("restart"), self.config.start_timeout, "restarting the kernel"
            )
        except KernelError as exc:
            raise KernelStartError(str(exc), kernel_id=self.kernel_id) from exc.__cause__
        if response.is_error:  # gone meanwhile, or not restartable: a new kernel is as fresh
            await self._replace(f"restart answered {_describe(response)}")

    async def _replace(self, why: str) -> None:
        """Delete the kernel (if the gateway still has it) and start a new one."""
        log.warning("kernel %s lost (%s): starting a new kernel", self.kernel_id, why)
        if why == "restarting":
            # Let the gateway's own restart finish launching, so that the DELETE kills the
            # process it started rather than racing its start.
            await asyncio.sleep(_AUTORESTART_SETTLE)
        if self._created:
            self._created = False
            with contextlib.suppress(KernelError):  # already gone is fine
                await self._request("DELETE", self._path(), self.config.request_timeout, "delete")
        await self._create_kernel()

    async def _channels_problem(self, exc: BaseException) -> str:
        """Why the channels did not open: the kernel died (a gateway holds the handshake
        while it restarts a kernel that fails to start), or the connection itself."""
        if self._http is not None and await self._rest_state() in ("missing", "dead"):
            return (
                f"the {self.config.kernel_name!r} kernel died as it started on the gateway at "
                f"{self.config.url} (its kernel spec's command failed; the gateway's log says why)"
            )
        return f"cannot open the kernel's channels at {self.config.ws_url}: {exc!r}"

    async def _rest_state(self) -> str | None:
        """``missing``/``dead``/the execution state, or None if the gateway did not answer."""
        timeout = max(self.config.check_interval, 1.0)
        try:
            response = await self._client().get(self._path(), timeout=timeout)
        except (httpx.HTTPError, KernelError):
            return None
        if response.status_code == 404:
            return "missing"
        if response.is_error:
            return None
        return str(response.json().get("execution_state"))

    # -- channels -------------------------------------------------------------------------

    async def _connect(self, open_timeout: float) -> None:
        # A fresh session per connection: new msg ids, and the gateway does not replay what
        # it buffered for an earlier connection.
        session = Session()
        url = f"{self.config.ws_url}{self._path('channels')}?session_id={session.session}"
        options: dict[str, Any] = {}
        if self.config.quickack and _TCP_QUICKACK is not None:
            options["create_connection"] = _QuickAckConnection
        if url.startswith("wss:"):
            options["ssl"] = self.config.ssl_context()
        try:
            ws = await websockets.connect(
                url,
                additional_headers=self.config.headers,
                open_timeout=open_timeout,
                ping_interval=self.config.ping_interval,
                ping_timeout=self.config.ping_timeout,
                close_timeout=2.0,
                max_size=self.config.max_message_bytes,
                compression=None,  # contexts are large; deflate would cost more than it saves
                **options,
            )
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            problem = await self._channels_problem(exc)
            raise KernelStartError(problem, kernel_id=self.kernel_id) from exc
        self._ws, self._session, self._outbox = ws, session, asyncio.Queue()
        self._last_check = time.monotonic()
        name = f"gateway-{self.kernel_id}"
        self._tasks = [
            asyncio.create_task(self._read(ws), name=f"{name}-read"),
            asyncio.create_task(self._write(ws, self._outbox), name=f"{name}-write"),
        ]

    async def _disconnect(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ws, self._ws, self._outbox, self._session = self._ws, None, None, None
        if ws is not None:
            await ws.close()

    async def _read(self, ws: ClientConnection) -> None:
        """The one reader of the socket: each message goes to its channel's queue."""
        try:
            async for frame in ws:
                msg = decode_message(frame)
                channel = msg.pop("channel", None)
                if channel == "iopub" and not (msg.get("parent_header") or {}).get("msg_id"):
                    self._note_gateway_status(msg)
                self._deliver(channel, msg)
            closed: BaseException = ConnectionError("the gateway closed the kernel's channels")
        except websockets.ConnectionClosed as exc:
            closed = exc
        except Exception as exc:
            self._transport_failed(exc)
            return
        # The socket closed. If the gateway still answers, the kernel went away (deleted,
        # culled): report it dead, and the restart replaces it. If not, the gateway is down.
        if await self._rest_state() is not None:
            log.warning("kernel %s: channels closed (%s); kernel lost", self.kernel_id, closed)
            self._lost = "disconnected"
        else:
            self._transport_failed(
                ConnectionError(f"the gateway at {self.config.url} is gone ({closed})")
            )

    def _note_gateway_status(self, msg: dict[str, Any]) -> None:
        if (msg.get("header") or {}).get("msg_type") != "status":
            return
        state = (msg.get("content") or {}).get("execution_state")
        if state in ("restarting", "dead"):
            log.warning(
                "kernel %s: the gateway reports %s (the kernel died)", self.kernel_id, state
            )
            self._lost = str(state)

    async def _write(self, ws: ClientConnection, outbox: asyncio.Queue[str | bytes]) -> None:
        try:
            while True:
                await ws.send(await outbox.get())
        except websockets.ConnectionClosed:
            return  # the reader reports it
        except Exception as exc:
            self._transport_failed(exc)

    async def _execute_with(
        self, code: str, metadata: dict[str, Any], buffers: list[Any], timeout: float
    ) -> ExecutionResult:
        token = _ATTACHED.set((metadata, buffers))
        try:
            return await Kernel.execute(self, code, silent=True, timeout=timeout)
        finally:
            _ATTACHED.reset(token)


def _expression(result: ExecutionResult, name: str) -> str | None:
    value = result.user_expressions.get(name)
    if not isinstance(value, dict) or value.get("status") != "ok":
        return None
    text = (value.get("data") or {}).get("text/plain")
    return str(text) if text is not None else None


def _error_text(result: ExecutionResult) -> str:
    if result.error:
        return f"{result.error.get('ename')}: {result.error.get('evalue')}"
    return result.stderr.strip()[-300:] or result.status


def _literal(text: str) -> str:
    """A str shown as text/plain (its repr), back to the str."""
    value = ast.literal_eval(text)
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {text!r}")
    return value
