"""The backend-independent driver of one kernel: readiness, execute, the timeout ladder.

A backend (local ZMQ, gateway WebSocket) launches the kernel process, sends messages and
delivers what arrives, one reader per channel, into the three queues here. Everything that
interprets messages lives in this module, so every backend behaves the same:

- ready = our iopub subscription shown (ipykernel's welcome to it; ``kernel_info`` sent every
  50 ms for a kernel that sends none), for a local episode kernel, whose stdin asks again
  until the host is there; for others, also a stdin probe cell answered and replied on shell
  (else a first cell's ``llm_query`` could be lost). ``wait_for_ready()`` sleeps, and after a
  restart without this the next cell's iopub was lost;
- an execute is complete when both the shell ``execute_reply`` and the iopub ``idle`` for its
  ``msg_id`` arrived; output for another parent (a thread printing late) is kept aside, never
  put into the next cell;
- a liveness watcher races each execute, so a dead kernel is reported at once, not after the
  timeout; the kernel is then restarted and the result says state was lost;
- on timeout: interrupt, wait ``interrupt_grace`` (1 s, twice the longest a Python-level
  interrupt took to land with 16 busy kernels) for the cell to end, else restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from kernel_env.errors import (
    KernelCallError,
    KernelDied,
    KernelError,
    KernelStartError,
    LiveForkUnavailable,
    MessageTooLarge,
)
from kernel_env.inkernel.contract import PROBE_REPLY
from kernel_env.kernel.commands import CommandRun
from kernel_env.outputs import OutputCollector
from kernel_env.streaming import event_from_message

__all__ = ["STDIN_PROBE_CODE", "ExecutionResult", "Kernel", "StdinHandler", "probe_request"]

log = logging.getLogger(__name__)

# Answers a kernel's input_request prompt with the input_reply value.
StdinHandler = Callable[[str], Awaitable[str]]
Status = Literal["ok", "error", "timeout", "died"]

# A silent cell (no execution count, no history) that waits for one stdin reply: an
# ipykernel's; another language's kernel names its own (kernel_env.languages).
STDIN_PROBE_CODE = "get_ipython().kernel.raw_input('')"


def probe_request(code: str) -> dict[str, Any]:
    """The execute_request of a stdin probe cell."""
    return {
        "code": code,
        "silent": True,
        "store_history": False,
        "user_expressions": {},
        "allow_stdin": True,
        "stop_on_error": False,
    }


_STDIN_PROBE = probe_request(STDIN_PROBE_CODE)
# The probe's request is usually the one lost (stdin connects up to a zmq retry after shell):
# a short tick answers it soon after the connection is up. Spare answers are cheap and harmless.
_STDIN_TICK = 0.01
_READY_RECHECK = 0.05  # is the starting kernel alive; send kernel_info until iopub shows
_WELCOME_OVERDUE = 2.0  # when a kernel that welcomes its subscribers is asked for kernel_info
_STDIN_SETTLE = 0.05  # see Kernel._wait_answered
_EOF = "\x04"  # an input_reply of EOT makes the kernel's input() raise EOFError
_OUTPUT_TYPES = {"stream", "display_data", "execute_result", "error", "update_display_data"}


@dataclass
class ExecutionResult:
    """What one execute produced, and what happened to the kernel meanwhile."""

    status: Status
    outputs: list[Any]
    stdout: str
    stderr: str
    error: dict[str, Any] | None
    execution_count: int | None
    user_expressions: dict[str, Any]
    started: datetime
    finished: datetime
    duration: float
    interrupted: bool = False
    restarted: bool = False
    fault: str | None = None  # why the host restarted the kernel, if not a timeout or a death

    @property
    def success(self) -> bool:
        return self.status == "ok"


@dataclass
class _Run:
    """The state of one execute_request while it is in flight."""

    msg_id: str
    collector: OutputCollector = field(default_factory=OutputCollector)
    reply: dict[str, Any] | None = None
    idle: bool = False
    status: Status | None = None
    interrupted: bool = False
    restarted: bool = False
    fault: str | None = None
    on_output: Callable[[dict[str, Any]], None] | None = None  # each output event, at once


def _parent_id(msg: dict[str, Any]) -> str | None:
    return (msg.get("parent_header") or {}).get("msg_id")


def _msg_type(msg: dict[str, Any]) -> str | None:
    return (msg.get("header") or {}).get("msg_type")


# Where an episode's kernels come from: a coroutine function that returns a started, ready
# kernel (kernel_env.kernel.factory builds them: local, sandboxed, or a gateway's).
KernelSource = Callable[[], Awaitable["Kernel"]]


class Kernel(ABC):
    """One kernel process and its channels. Subclasses implement the transport hooks."""

    kernel_id: str = ""

    def __init__(
        self,
        *,
        interrupt_grace: float = 1.0,
        liveness_interval: float = 0.2,
        ready_timeout: float = 60.0,
    ) -> None:
        self.interrupt_grace = interrupt_grace
        self.liveness_interval = liveness_interval
        self.ready_timeout = ready_timeout
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._lock = asyncio.Lock()
        self.late_outputs: deque[dict[str, Any]] = deque(maxlen=1000)
        self.late_output_count = 0
        self.oversize_messages = 0  # messages over the host's limit, each restarted the kernel
        self.restarts = 0
        self.started = False

    # -- transport hooks ------------------------------------------------------------------

    @abstractmethod
    async def _launch(self) -> None:
        """Start the kernel process and the channel readers."""

    @abstractmethod
    async def _relaunch(self) -> None:
        """Restart the kernel process (state is lost) and the channel readers."""

    @abstractmethod
    async def _terminate(self) -> None:
        """Stop the readers, kill the kernel, release every resource."""

    @abstractmethod
    def _send(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        parent: dict | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        """Send a message on ``channel`` ("shell" or "stdin"); return its msg_id."""

    @abstractmethod
    async def is_alive(self) -> bool:
        """Whether the kernel process is running."""

    def exit_reasons(self) -> list[str]:
        """What is known of why the kernel process ended (its exit status, a limit it hit),
        in words; empty where nothing is."""
        return []

    def _exited_while_starting(self) -> KernelStartError:
        reasons = self.exit_reasons()
        said = f": {'; '.join(reasons)}" if reasons else " (no reason known)"
        return KernelStartError(f"kernel exited while starting{said}", kernel_id=self.kernel_id)

    @abstractmethod
    async def interrupt(self) -> None:
        """Interrupt the running cell (SIGINT, or the backend's equivalent)."""

    @abstractmethod
    async def stage_file(self, name: str, data: bytes) -> str:
        """Make ``data`` readable by the kernel; return the path the kernel should open."""

    async def run_command(self, command: str, *, timeout: float, max_output: int) -> CommandRun:
        """Run the shell ``command`` as a process of its own beside the kernel: in its
        sandbox, as its uid, in its workspace, with its minimal environment, but not a child
        of the kernel, so a cell cannot change what it runs or reports
        (:mod:`kernel_env.kernel.commands`). A backend that cannot raises
        :class:`KernelCallError` (``unimplemented``)."""
        raise KernelCallError(
            "unimplemented", f"{type(self).__name__} kernels cannot run commands beside them"
        )

    async def live_fork(self, n: int, *, reseed: bool = True) -> list[Kernel]:
        """``n`` started copies of this kernel's process, holding its state (copy-on-write),
        each ready, with fresh random state if ``reseed``; raises
        :class:`LiveForkUnavailable` where a backend cannot (the caller then replays). Call
        it between executes."""
        raise LiveForkUnavailable(
            f"{type(self).__name__} kernels cannot be copied live", kernel_id=self.kernel_id
        )

    # -- what backends call ---------------------------------------------------------------

    def _reset_queues(self) -> None:
        self._queues = {name: asyncio.Queue() for name in ("shell", "iopub", "stdin")}
        self._failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _transport_failed(self, exc: BaseException) -> None:
        """A channel reader died: fail the execute in flight instead of letting it hang. A
        message over the host's limit fails it as a death does (the kernel is restarted)."""
        log.error("kernel %s: channel reader failed: %r", self.kernel_id, exc)
        if not self._failure.done():
            self._failure.set_exception(
                exc
                if isinstance(exc, MessageTooLarge)
                else KernelError(f"lost the kernel's channels: {exc!r}", kernel_id=self.kernel_id)
            )

    def _deliver(self, channel: str, msg: dict[str, Any]) -> None:
        """Hand a received message to the driver (called by the backend's channel reader)."""
        queue = self._queues.get(channel)
        if queue is not None:
            queue.put_nowait(msg)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Launch the kernel and wait until it is ready."""
        self._reset_queues()
        try:
            await self._launch()
            await self._wait_ready()
        except BaseException:
            # A failed or cancelled start must not leave a process or sockets behind.
            await asyncio.shield(self.shutdown())
            raise
        self.started = True

    async def restart(self) -> None:
        """Restart the kernel process: a fresh namespace, same kernel object."""
        self._reset_queues()
        await self._relaunch()
        await self._wait_ready()
        self.restarts += 1

    async def shutdown(self) -> None:
        """Kill the kernel and release its resources; idempotent."""
        self.started = False
        await self._terminate()

    async def __aenter__(self) -> Kernel:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # Whether this host alone reads the kernel's iopub, so that an episode's setup may ask it
    # to send only what the host reads (inkernel.extension._publish_only_what_the_host_reads). Not
    # for a gateway's kernel: the gateway reads its busy status too.
    quiet_iopub = False

    # Whether the kernel refuses an input request to a stdin peer it has not seen and asks
    # again (inkernel.extension._insist_on_a_stdin_peer, an episode kernel's extension) rather than
    # losing the request: its readiness then needs no probe of stdin (_wait_connected).
    _stdin_waits_for_the_host = False

    # Whether the kernel's iopub welcomes each subscriber (ipykernel 7 and later): readiness
    # then waits for the welcome without asking for kernel_info (_wait_connected).
    _welcomes_subscribers = False

    # Seconds a cell's output may come after its idle (see _read_late): 0 for a kernel that
    # keeps the protocol's order, as ipykernel does.
    idle_grace = 0.0

    # The silent cell that probes the kernel's stdin channel (None: a kernel without stdin
    # requests, or one that waits for its stdin peer, is ready once it answers kernel_info).
    _stdin_probe: dict[str, Any] | None = _STDIN_PROBE

    async def _wait_ready(self) -> None:
        if self._stdin_waits_for_the_host:
            await self._wait_connected()
        elif self._stdin_probe is None:
            await self._wait_answered()
        else:
            await self._wait_probed()

    async def _wait_answered(self) -> None:
        """Wait for a ``kernel_info`` reply on shell and a message on iopub, asking every
        50 ms until both came: a kernel publishes its status for each request, and what it
        published before our subscription reached it is lost (a Deno kernel slow to come
        up answered on shell first; asked no more, it published nothing we could see).
        Then a moment more, for stdin, which connects on its own (the host's sockets retry
        every 5 ms): a kernel without a probe cell (R's, Deno's) cannot be asked to prove
        it, and IRkernel queues every stdin message it gets, so spare answers would be read
        as replies."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        answered = subscribed = False
        while not (answered and subscribed):
            if loop.time() > deadline:
                missing = "no message on iopub" if answered else "no kernel_info reply"
                raise KernelStartError(
                    f"kernel not ready after {self.ready_timeout:.0f} s ({missing})",
                    kernel_id=self.kernel_id,
                )
            if not await self.is_alive():
                raise self._exited_while_starting()
            self._send("shell", "kernel_info_request", {})
            msg = await _get(self._queues["shell"], _READY_RECHECK)
            answered |= msg is not None and _msg_type(msg) == "kernel_info_reply"
            subscribed |= not self._queues["iopub"].empty()
        await asyncio.sleep(_STDIN_SETTLE)
        self._drop_noise()

    async def _wait_connected(self) -> None:
        """Wait until iopub shows our subscription: ipykernel's welcome to it (its iopub
        thread sends one as our subscription arrives, early in the kernel's start), else its
        ``starting`` status, else, for a kernel that sends neither, a ``kernel_info`` reply
        (requested every 50 ms, from the start, or once a welcome is 2 s overdue from a
        kernel that sends them; answered on shell and on iopub). A cell's iopub messages then
        reach us; the execute request waits in zmq until the kernel serves its shell, and
        the kernel asks again on stdin until the host's stdin socket is there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        recheck = loop.time() + _READY_RECHECK
        # A kernel that welcomes every subscriber needs no kernel_info request, which costs it
        # CPU once it serves its shell, one for every 50 ms its start took (under
        # load, three a kernel): only a welcome long overdue asks.
        ask_from = loop.time() + (
            _WELCOME_OVERDUE if self._welcomes_subscribers else _READY_RECHECK
        )
        subscribed = False
        while True:
            # Until the next recheck: what a kernel_info request brings on shell comes with
            # its status messages on iopub, which end this wait.
            msg = await _get(self._queues["iopub"], max(recheck - loop.time(), 0.001))
            if msg is not None:
                subscribed = True
                if _msg_type(msg) == "iopub_welcome" or (
                    _msg_type(msg) == "status"
                    and msg["content"].get("execution_state") == "starting"
                ):
                    break
            if subscribed and _drain_for(self._queues["shell"], "kernel_info_reply"):
                break
            now = loop.time()
            if now >= recheck:
                if now > deadline:
                    raise KernelStartError(
                        f"kernel not ready after {self.ready_timeout:.0f} s "
                        f"({'no kernel_info reply' if subscribed else 'no message on iopub'})",
                        kernel_id=self.kernel_id,
                    )
                if not await self.is_alive():
                    raise self._exited_while_starting()
                if now >= ask_from:
                    self._send("shell", "kernel_info_request", {})
                recheck = now + _READY_RECHECK
        self._drop_noise()

    async def _wait_probed(self) -> None:
        """Wait until the kernel answers on shell, its iopub messages reach us and its stdin
        requests reach us, whichever channel connects last.

        Each channel connects on its own, so a ready shell says nothing about the others:

        - iopub: any message proves our subscription (ipykernel's XPUB welcomes each
          subscriber; the probe's status messages, or those of a kernel_info request sent
          every 50 ms until one arrives, do for a kernel that sends no welcome);
        - stdin: the kernel's stdin socket is a ROUTER, and an ``input_request`` sent before
          our stdin socket connected is silently dropped (a first cell calling
          ``llm_query`` then waited out the step timeout). A probe cell asks for input and
          is answered; a lost request is answered anyway, every 10 ms, since ipykernel
          takes the next message on stdin as the reply (it purges anything that arrived
          before it asked). Once the probe's cell has replied, the kernel has heard from our
          stdin socket, so its requests reach us. A spare answer still on its way then is
          :data:`PROBE_REPLY`, which ``llm_query`` never takes for its own. Spares go out
          every 10 ms once iopub shows the probe running (an answer sent before the kernel
          asks is purged), and every 50 ms until then, in case iopub missed its start.

        The probe's reply proves shell too: one round trip to the kernel, and no kernel_info
        request to serve first (a share of a forked kernel's start) unless iopub is late.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        if not await self.is_alive():
            raise self._exited_while_starting()
        probe = _Run(self._send("shell", "execute_request", self._stdin_probe or _STDIN_PROBE))
        answer = asyncio.ensure_future(self._serve_stdin(probe, _answer_probe))
        got_iopub = probe_running = False
        recheck = loop.time() + _READY_RECHECK
        try:
            while not (got_iopub and probe.reply is not None):
                now = loop.time()
                if now > deadline:
                    missing = "no probe reply" if got_iopub else "no message on iopub"
                    raise KernelStartError(
                        f"kernel not ready after {self.ready_timeout:.0f} s ({missing})",
                        kernel_id=self.kernel_id,
                    )
                spare = probe_running
                if now >= recheck:
                    if not await self.is_alive():
                        raise self._exited_while_starting()
                    if not got_iopub:
                        self._send("shell", "kernel_info_request", {})
                    recheck, spare = now + _READY_RECHECK, True
                if spare and probe.reply is None:
                    self._send("stdin", "input_reply", {"value": PROBE_REPLY})
                msg = await _get(self._queues["shell"], _STDIN_TICK)
                if msg is not None and _parent_id(msg) == probe.msg_id:
                    probe.reply = msg.get("content") or {}
                while not self._queues["iopub"].empty():  # noise once ready: see below
                    got_iopub = True
                    probe_running |= _parent_id(self._queues["iopub"].get_nowait()) == probe.msg_id
                if answer.done():
                    answer.result()  # _serve_stdin only ends by raising
        finally:
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
        if probe.reply.get("status") != "ok":
            log.warning("kernel %s: stdin probe failed: %s", self.kernel_id, probe.reply)
        self._drop_noise()

    def _drop_noise(self) -> None:
        """What arrived while the kernel got ready (kernel_info replies, a probe's messages)
        is noise once it is."""
        log.debug("kernel %s ready", self.kernel_id)
        for queue in self._queues.values():
            while not queue.empty():
                queue.get_nowait()

    async def language_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """The ``language_info`` of the kernel's ``kernel_info_reply`` ({} if none came)."""
        async with self._lock:
            msg_id = self._send("shell", "kernel_info_request", {})
            queue = self._queues["shell"]
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        msg = await queue.get()
                        if _parent_id(msg) == msg_id:
                            info = (msg.get("content") or {}).get("language_info")
                            return dict(info) if isinstance(info, dict) else {}
            except TimeoutError:
                return {}

    # -- execute --------------------------------------------------------------------------

    async def execute(
        self,
        code: str,
        *,
        timeout: float | None = None,
        stdin: StdinHandler | None = None,
        user_expressions: dict[str, str] | None = None,
        silent: bool = False,
        store_history: bool = True,
        on_output: Callable[[dict[str, Any]], None] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ExecutionResult:
        """Run ``code``; never raises for errors in the code itself (they are in the result).
        ``metadata``: the request's (kernel_env's extension reads an episode's setup there).

        ``on_output`` gets each output event (:mod:`kernel_env.streaming`) as it arrives; it
        must not block (``OutputStream.push`` doesn't). Raises :class:`KernelError` only when
        the kernel cannot be brought back.
        """
        async with self._lock:
            started, t0 = datetime.now(UTC), time.perf_counter()
            fault = await self._recover()
            if fault is not None:  # the cell is not run: the episode sets the kernel up first
                lost = _Run("", status="died", restarted=True, fault=fault)
                return _result(lost, started, time.perf_counter() - t0)
            msg_id = self._send(
                "shell",
                "execute_request",
                {
                    "code": code,
                    "silent": silent,
                    "store_history": store_history and not silent,
                    "user_expressions": user_expressions or {},
                    "allow_stdin": True,
                    "stop_on_error": False,
                },
                metadata=metadata,
            )
            run = _Run(msg_id, on_output=on_output)
            log.debug("kernel %s: execute %s sent", self.kernel_id, msg_id)
            try:
                await asyncio.wait_for(self._drive(run, stdin), timeout)
                if self.idle_grace:
                    await self._read_late(run)
            except TimeoutError:
                await self._on_timeout(run, stdin)
            except KernelDied as exc:
                run.status = "died"
                run.fault = await self._fault(exc)
                if run.fault is None:
                    log.warning("kernel %s died during a cell; restarting", self.kernel_id)
                await self._restart_for(run)
            return _result(run, started, time.perf_counter() - t0)

    async def _fault(self, exc: KernelDied) -> str | None:
        """Why a kernel that did not die is restarted (a message over the host's limit, the
        kernel alive), counted; None for a death."""
        if not isinstance(exc, MessageTooLarge) or not await self.is_alive():
            return None
        log.warning("kernel %s: %s; restarting it", self.kernel_id, exc)
        self.oversize_messages += 1
        return str(exc)

    async def _recover(self) -> str | None:
        """Before a cell: restart a kernel whose channels failed since the last cell with a
        message over the limit (from a thread, say); why, or None."""
        failure = self._failure
        exc = failure.exception() if failure.done() else None
        if not isinstance(exc, KernelDied):
            return None
        fault = await self._fault(exc)
        await self.restart()
        return fault or "the kernel process exited after the previous cell"  # meanwhile

    async def _drive(self, run: _Run, stdin: StdinHandler | None) -> None:
        """Until reply and idle both arrived; raises KernelDied if the process exits first."""
        tasks = [
            asyncio.create_task(self._until_complete(run)),
            asyncio.create_task(self._serve_stdin(run, stdin)),
            asyncio.create_task(self._watch_liveness()),
            asyncio.ensure_future(asyncio.shield(self._failure)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _until_complete(self, run: _Run) -> None:
        await asyncio.gather(self._read_iopub(run), self._read_shell(run))

    async def _read_iopub(self, run: _Run) -> None:
        queue = self._queues["iopub"]
        while not run.idle:
            self._take_iopub(run, await queue.get())

    async def _read_late(self, run: _Run) -> None:
        """The cell's iopub messages that come after its idle, until none comes for
        ``idle_grace`` seconds (a kernel that forwards its stdout from another task, as
        Deno's does, may publish it after the idle)."""
        queue = self._queues["iopub"]
        while (msg := await _get(queue, self.idle_grace)) is not None:
            self._take_iopub(run, msg)

    def _take_iopub(self, run: _Run, msg: dict[str, Any]) -> None:
        """One iopub message during ``run``: its status, or an output of its own (collected
        and told), or a stray one."""
        msg_type = _msg_type(msg)
        if _parent_id(msg) != run.msg_id:
            self._stray(msg, msg_type)
        elif msg_type == "status":
            run.idle = msg.get("content", {}).get("execution_state") == "idle"
        else:
            run.collector.feed(msg)
            if run.on_output is not None:
                _tell(run, msg)

    def _stray(self, msg: dict[str, Any], msg_type: str | None) -> None:
        if msg_type in _OUTPUT_TYPES:
            # Printed by a thread after its cell went idle: logged, never shown in this cell.
            self.late_outputs.append(msg)
            self.late_output_count += 1

    async def _read_shell(self, run: _Run) -> None:
        queue = self._queues["shell"]
        while run.reply is None:
            msg = await queue.get()
            if _parent_id(msg) == run.msg_id and _msg_type(msg) == "execute_reply":
                run.reply = msg.get("content") or {}

    async def _serve_stdin(self, run: _Run, handler: StdinHandler | None) -> None:
        queue = self._queues["stdin"]
        while True:
            msg = await queue.get()
            if _msg_type(msg) != "input_request" or _parent_id(msg) != run.msg_id:
                continue
            prompt = str(msg.get("content", {}).get("prompt", ""))
            value = _EOF
            if handler is not None:
                try:
                    value = await handler(prompt)
                except Exception:
                    # The kernel must never wait forever on stdin: answer EOF, it raises EOFError.
                    log.exception("stdin handler failed; answering EOF")
            self._send("stdin", "input_reply", {"value": value}, parent=msg)

    async def _watch_liveness(self) -> None:
        while True:
            await asyncio.sleep(self.liveness_interval)
            if not await self.is_alive():
                raise KernelDied("kernel process exited", kernel_id=self.kernel_id)

    async def _on_timeout(self, run: _Run, stdin: StdinHandler | None) -> None:
        run.status = "timeout"
        with contextlib.suppress(KernelError):
            await self.interrupt()
        try:
            await asyncio.wait_for(self._drive(run, stdin), self.interrupt_grace)
            run.interrupted = True
            return
        except (TimeoutError, KernelDied):
            # C code holding the GIL, or SIGINT ignored: only a restart ends it.
            log.warning("kernel %s ignored the interrupt; restarting", self.kernel_id)
        await self._restart_for(run)

    async def _restart_for(self, run: _Run) -> None:
        await self.restart()
        run.restarted = True


def _tell(run: _Run, msg: dict[str, Any]) -> None:
    """Hand one output message to the run's listener; a listener's failure never reaches the
    kernel's reader (the step's outputs are collected regardless)."""
    event = event_from_message(msg)
    if event is None or run.on_output is None:
        return
    try:
        run.on_output(event)
    except Exception:
        log.exception("an output listener failed; it gets no more of this cell")
        run.on_output = None


async def _get(queue: asyncio.Queue[dict[str, Any]], timeout: float) -> dict[str, Any] | None:
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        return None


def _drain_for(queue: asyncio.Queue[dict[str, Any]], msg_type: str) -> bool:
    """Empty ``queue``; whether a message of ``msg_type`` was in it."""
    found = False
    while not queue.empty():
        found |= queue.get_nowait()["header"]["msg_type"] == msg_type
    return found


async def _answer_probe(prompt: str) -> str:
    return PROBE_REPLY


def _result(run: _Run, started: datetime, duration: float) -> ExecutionResult:
    reply = run.reply or {}
    status: Status = run.status or ("ok" if reply.get("status") == "ok" else "error")
    collector = run.collector
    return ExecutionResult(
        status=status,
        outputs=collector.outputs,
        stdout=collector.stdout_text(),
        stderr=collector.stderr_text(),
        error=collector.error,
        execution_count=reply.get("execution_count"),
        user_expressions=reply.get("user_expressions") or {},
        started=started,
        finished=datetime.now(UTC),
        duration=duration,
        interrupted=run.interrupted,
        restarted=run.restarted,
        fault=run.fault,
    )
