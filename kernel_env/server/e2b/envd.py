"""E2B's sandbox daemon, envd (the sandbox's port 49983): its Connect RPC services and HTTP API.

The ``process.Process`` and ``filesystem.Filesystem`` services are served by ``connectrpc``
(the library E2B's SDK uses for its client side) from code generated from E2B's own
``.proto`` files (:mod:`kernel_env.server.e2b.proto`); ``/files`` (upload, download) and
``/health`` are plain HTTP, as envd's are. Every file operation and every command runs in
the sandbox's kernel (:mod:`.kernelcalls`), so in its sandbox; ``/files`` moves a file in
bounded chunks, a few transfers per sandbox at once (:mod:`.transfers`).

A command's output is collected from the kernel between cells, so while a ``run_code`` cell
runs, a command's output waits for it (the command itself runs on). A stream of it ends as
soon as its client goes away (an output that stays open would otherwise be polled forever);
its polls are not the sandbox's activity, and a sandbox follows at most
:data:`~kernel_env.server.sessions.MAX_STREAMS` at once. PTYs and directory watches are not
served (``unimplemented``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof
from protobuf.wkt import Timestamp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kernel_env.errors import KernelCallError, SessionError
from kernel_env.server.e2b import transfers
from kernel_env.server.e2b.door import sandbox_in
from kernel_env.server.e2b.failures import connect_error
from kernel_env.server.e2b.kernelcalls import in_kernel
from kernel_env.server.e2b.proto.filesystem import filesystem_pb as fs
from kernel_env.server.e2b.proto.filesystem.filesystem_connect import (
    Filesystem,
    FilesystemASGIApplication,
)
from kernel_env.server.e2b.proto.process import process_pb as pb
from kernel_env.server.e2b.proto.process.process_connect import Process, ProcessASGIApplication
from kernel_env.server.e2b.sandboxes import Sandbox
from kernel_env.server.sessions import SessionManager

__all__ = ["ENVD_PORT", "envd_app"]

ENVD_PORT = "49983"
_CURRENT: contextvars.ContextVar[Sandbox] = contextvars.ContextVar("e2b_sandbox")
# Set once the current request's client has gone (its connection closed).
_GONE: contextvars.ContextVar[asyncio.Event] = contextvars.ContextVar("e2b_client_gone")
_FIRST_POLL, _LAST_POLL = 0.002, 0.05  # seconds between polls of a command's output
_TYPES = {"file": fs.FileType.FILE, "dir": fs.FileType.DIRECTORY, "symlink": fs.FileType.SYMLINK}


class _Calls:
    """envd's operations on the current request's sandbox, in its kernel."""

    def __init__(self, sessions: Callable[[], SessionManager]) -> None:
        self.sessions = sessions

    async def __call__(self, name: str, **args: Any) -> Any:
        return await self.in_sandbox(_CURRENT.get(), name, **args)

    def on(self, sandbox: Sandbox) -> Callable[..., Awaitable[Any]]:
        """The operations of ``sandbox`` (for a transfer, which outlives its handler)."""
        return functools.partial(self.in_sandbox, sandbox)

    async def in_sandbox(self, sandbox: Sandbox, name: str, **args: Any) -> Any:
        manager = self.sessions()
        try:
            async with manager.request(sandbox.session):
                return await in_kernel(sandbox.session, name, **args)
        except (KernelCallError, SessionError) as exc:
            raise connect_error(exc) from None

    async def poll(self, pid: int) -> Any:
        """A stream's poll of ``pid``: not a request of its client, so neither activity nor
        in flight (the reaper and a drain do not wait for a stream)."""
        try:
            return await in_kernel(_CURRENT.get().session, "proc_poll", activity=False, pid=pid)
        except (KernelCallError, SessionError) as exc:
            raise connect_error(exc) from None

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[None]:
        """One stream of the current sandbox open (bounded per sandbox)."""
        try:
            async with self.sessions().stream(_CURRENT.get().session):
                yield
        except (KernelCallError, SessionError) as exc:
            raise connect_error(exc) from None


class ProcessService(Process):
    """``process.Process``: commands, as children of the sandbox's kernel (what is not here
    answers ``unimplemented``: PTYs, streamed input)."""

    def __init__(self, call: _Calls) -> None:
        self.call = call
        self._killing: set[asyncio.Task[None]] = set()  # kills at a deadline, under way

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "PTYs are not served by kernel_env")
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        sandbox = _CURRENT.get()
        deadline = _deadline(ctx)
        async with self.call.stream():  # refused past the bound before the command starts
            pid = await self.call(
                "proc_start",
                cmd=config.cmd,
                args=_without_login(config.cmd, list(config.args)),
                envs={**sandbox.envs, **dict(config.envs)},
                cwd=config.cwd or None,
                stdin=bool(request.stdin),
                tag=request.tag or None,
            )
            yield pb.StartResponse(event=_event("start", pb.ProcessEvent.StartEvent(pid=pid)))
            ended = False
            try:
                async for event in self._follow(pid, deadline):
                    ended = ended or (event.event is not None and event.event.field == "end")
                    yield pb.StartResponse(event=event)
            except _DeadlineExceeded:
                ended = True
                await self._kill(sandbox, pid)
                raise _deadline_error(pid) from None
            finally:
                # The deadline is the command's lifetime, as envd's: its client gone, it is
                # still killed then.
                if not ended and deadline is not None:
                    self._kill_at(sandbox, pid, deadline)

    async def connect(
        self, request: pb.ConnectRequest, ctx: Any
    ) -> AsyncIterator[pb.ConnectResponse]:
        deadline = _deadline(ctx)
        async with self.call.stream():
            pid = await self._pid(request.process)
            yield pb.ConnectResponse(event=_event("start", pb.ProcessEvent.StartEvent(pid=pid)))
            try:
                async for event in self._follow(pid, deadline):
                    yield pb.ConnectResponse(event=event)
            except _DeadlineExceeded:
                raise _deadline_error(pid) from None  # only the stream ends: not its command

    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        processes = [
            pb.ProcessInfo(
                pid=p["pid"],
                tag=p["tag"],
                config=pb.ProcessConfig(
                    cmd=p["config"]["cmd"],
                    args=p["config"]["args"],
                    envs=p["config"]["envs"],
                    cwd=p["config"]["cwd"],
                ),
            )
            for p in await self.call("proc_list")
        ]
        return pb.ListResponse(processes=processes)

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any) -> pb.SendSignalResponse:
        number = int(request.signal) or 15
        await self.call("proc_signal", signal_number=number, **_selector(request.process))
        return pb.SendSignalResponse()

    async def send_input(self, request: pb.SendInputRequest, ctx: Any) -> pb.SendInputResponse:
        given = request.input.input if request.input is not None else None
        if given is None or given.field != "stdin":
            raise ConnectError(Code.UNIMPLEMENTED, "only stdin input is served (no PTYs)")
        data = base64.b64encode(given.value).decode("ascii")
        await self.call("proc_input", data=data, **_selector(request.process))
        return pb.SendInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any) -> pb.CloseStdinResponse:
        await self.call("proc_close_stdin", **_selector(request.process))
        return pb.CloseStdinResponse()

    async def _pid(self, selector: pb.ProcessSelector | None) -> int:
        """The pid a selector names; not_found (before any stream starts) if no command of
        the sandbox has it."""
        found: int = await self.call("proc_find", **_selector(selector))
        return found

    async def _follow(self, pid: int, deadline: float | None) -> AsyncIterator[pb.ProcessEvent]:
        """The command's output as it comes, then its end; nothing more once the client has
        gone (the command runs on: ``connect`` follows it again). :class:`_DeadlineExceeded`
        once ``deadline`` (the loop's time) passes first."""
        gone = _GONE.get()
        loop = asyncio.get_running_loop()
        delay = _FIRST_POLL
        while not gone.is_set():
            polled = await self.call.poll(pid)
            for name, data in polled["output"]:
                output = pb.ProcessEvent.DataEvent(output=Oneof(name, base64.b64decode(data)))
                yield _event("data", output)
            end = polled["end"]
            if end is not None:
                yield _event("end", pb.ProcessEvent.EndEvent(**end))
                return
            if deadline is not None and loop.time() >= deadline:
                raise _DeadlineExceeded
            delay = _FIRST_POLL if polled["output"] else min(_LAST_POLL, delay * 2)
            if deadline is not None:
                delay = max(0.0, min(delay, deadline - loop.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), delay)

    def _kill_at(self, sandbox: Sandbox, pid: int, deadline: float) -> None:
        """Kill ``pid`` at ``deadline`` (the loop's time)."""

        def expire() -> None:
            task = asyncio.ensure_future(self._kill(sandbox, pid))
            self._killing.add(task)
            task.add_done_callback(self._killing.discard)

        asyncio.get_running_loop().call_at(deadline, expire)

    async def _kill(self, sandbox: Sandbox, pid: int) -> None:
        """SIGKILL to the command's process group; nothing if it, or its sandbox, has ended."""
        with contextlib.suppress(ConnectError):
            await self.call.in_sandbox(sandbox, "proc_signal", signal_number=9, pid=pid)


class _DeadlineExceeded(Exception):
    """A stream's Connect deadline (``connect-timeout-ms``) has passed."""


def _deadline(ctx: Any) -> float | None:
    """The loop's time at which the request's Connect deadline passes (None: it has none)."""
    remaining = ctx.timeout_ms
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + max(0.0, remaining / 1000)


def _deadline_error(pid: int) -> ConnectError:
    return ConnectError(
        Code.DEADLINE_EXCEEDED, f"process {pid}: the request's timeout passed (context deadline)"
    )


def _without_login(cmd: str, args: list[str]) -> list[str]:
    """The SDK runs a command as ``bash -l -c CMD``: a login shell, whose /etc/profile would
    reset PATH and lose the kernel's own Python. The command runs in the kernel's environment
    instead, in a plain ``bash -c``."""
    if cmd.rsplit("/", 1)[-1] == "bash" and args[:1] == ["-l"]:
        return args[1:]
    return args


def _event(kind: str, value: Any) -> pb.ProcessEvent:
    event: Any = Oneof(kind, value)  # one of start, data, end (checked by the message)
    return pb.ProcessEvent(event=event)


def _selector(selector: pb.ProcessSelector | None) -> dict[str, Any]:
    chosen = selector.selector if selector is not None else None
    if chosen is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")
    return {chosen.field: chosen.value}


class FilesystemService(Filesystem):
    """``filesystem.Filesystem``: the sandbox's files, through its kernel (directory watches
    answer ``unimplemented``)."""

    def __init__(self, call: _Calls) -> None:
        self.call = call

    async def stat(self, request: fs.StatRequest, ctx: Any) -> fs.StatResponse:
        return fs.StatResponse(entry=_entry(await self.call("stat", path=request.path)))

    async def make_dir(self, request: fs.MakeDirRequest, ctx: Any) -> fs.MakeDirResponse:
        return fs.MakeDirResponse(entry=_entry(await self.call("make_dir", path=request.path)))

    async def move(self, request: fs.MoveRequest, ctx: Any) -> fs.MoveResponse:
        moved = await self.call("move", source=request.source, destination=request.destination)
        return fs.MoveResponse(entry=_entry(moved))

    async def list_dir(self, request: fs.ListDirRequest, ctx: Any) -> fs.ListDirResponse:
        found = await self.call("list_dir", path=request.path, depth=request.depth or 1)
        return fs.ListDirResponse(entries=[_entry(e) for e in found])

    async def remove(self, request: fs.RemoveRequest, ctx: Any) -> fs.RemoveResponse:
        await self.call("remove", path=request.path)
        return fs.RemoveResponse()


def _entry(found: dict[str, Any]) -> fs.EntryInfo:
    modified = datetime.fromtimestamp(found["modified"], UTC)
    return fs.EntryInfo(
        name=found["name"],
        type=_TYPES[found["type"]],
        path=found["path"],
        size=found["size"],
        mode=found["mode"],
        permissions=found["permissions"],
        owner=found["owner"],
        group=found["group"],
        modified_time=Timestamp.from_datetime(modified),
        symlink_target=found.get("symlink_target"),
    )


def envd_app(sessions: Callable[[], SessionManager]) -> Callable[[Scope, Receive, Send], Any]:
    """envd's ASGI app: the two Connect services and the HTTP routes."""
    call = _Calls(sessions)
    rpc: dict[str, ASGIApp] = {
        "/process.Process/": ProcessASGIApplication(ProcessService(call)),
        "/filesystem.Filesystem/": FilesystemASGIApplication(FilesystemService(call)),
    }

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    http = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            *transfers.file_routes(call.on),
        ]
    )
    return _routed(rpc, http)


def _routed(rpc: dict[str, ASGIApp], http: ASGIApp) -> Callable[[Scope, Receive, Send], Any]:
    """The app that hands a request to its Connect service (by path prefix) or else to the
    HTTP routes, with its sandbox and its client's departure in context."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()
        token, gone_token = _CURRENT.set(sandbox_in(scope)), _GONE.set(gone)
        try:
            for prefix, service in rpc.items():
                if scope["path"].startswith(prefix):
                    await service(scope, _watched(receive, gone), send)
                    return
            await http(scope, receive, send)
        finally:
            _GONE.reset(gone_token)
            _CURRENT.reset(token)

    return app


def _watched(receive: Receive, gone: asyncio.Event) -> Receive:
    """``receive``, setting ``gone`` once it tells of the client's disconnect. connectrpc
    reads that message for a server stream but looks at it only when the stream yields: a
    silent command's stream would never see it."""

    async def watched() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
        return message

    return watched
