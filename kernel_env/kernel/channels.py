"""The host's channel client of a local kernel: its shell, iopub and stdin sockets, read
through the event loop and handed, message by message, to the driver (:mod:`.base`).

jupyter_client's manager and provisioners supervise a local kernel (:mod:`.manager`); this
client, not jupyter_client's, speaks to it. jupyter_client's asyncio client made channel
objects and asyncio sockets for every kernel, and its recv registered and dropped each
socket's descriptor with the loop for every message; its ``Session.send`` made a new shadow
socket for every message. Here: one blocking socket per channel on one zmq context for the
whole process, read by the event loop's own readers (``benchmarks/README.md`` has the
figures). Host side.

A kernel's messages are bounded before the host holds them: zmq drops the connection of a
kernel that sends a frame over :data:`MAX_KERNEL_MESSAGE_BYTES` (``ZMQ_MAXMSGSIZE``, on every
host socket to a kernel, control included; zmq never connects that socket again), which a
monitor of each socket notices, and a message whose frames add up to more is dropped before
it is deserialized. Either fails the channels with :class:`~kernel_env.errors.MessageTooLarge`:
the driver restarts the kernel.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.session import Session
from zmq.utils.monitor import recv_monitor_message

from kernel_env.errors import MessageTooLarge

__all__ = ["MAX_KERNEL_MESSAGE_BYTES", "HostChannels", "host_context"]

log = logging.getLogger(__name__)

_RECV_REARM = 0.25  # seconds; see HostChannels._drain
_CHANNELS = {"shell": zmq.DEALER, "iopub": zmq.SUB, "stdin": zmq.DEALER}  # and socket types
_DRAIN_BATCH = 64  # messages read from a channel in one turn of the event loop

# The largest message a kernel may send the host: a cell's whole output allowance (12 M chars,
# kernel_env.outputs) or a helper call's request (16 M chars, kernel_env.hostcalls) with the
# state reply, UTF-8 and JSON-escaped, with room to spare.
MAX_KERNEL_MESSAGE_BYTES = 64 << 20

# The host's sockets may connect before the kernel binds its own; zmq then retries every
# 100 ms by default, which a forked kernel (ready in tens of ms) would wait out. No backing
# off either: a kernel that binds late under load was reached only at the next doubled
# interval. (Trying a unix socket path costs one failed connect(2); a dead kernel's sockets
# are closed by its restart or shutdown.) Set on each socket: a context's defaults reach only
# the sockets made through that very context object, not through a shadow of it. No frame
# over MAX_KERNEL_MESSAGE_BYTES: zmq drops the kernel's connection instead.
_HOST_SOCKET_OPTIONS = {
    zmq.RECONNECT_IVL: 5,
    zmq.RECONNECT_IVL_MAX: 0,
    zmq.MAXMSGSIZE: MAX_KERNEL_MESSAGE_BYTES,
}

# A connection that drops tries again within RECONNECT_IVL: a kernel that exited is retried
# (and connected again, should it come back). One that zmq dropped for a frame over
# MAXMSGSIZE is never retried: no retry within _DROP_GRACE seconds tells it.
_WATCHED = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
)
_DROP_GRACE = 0.25

_shared_context: tuple[int, zmq.asyncio.Context] | None = None  # (the pid that made it, it)


def host_context() -> zmq.asyncio.Context:
    """The zmq context of every local kernel's host sockets in this process.

    jupyter_client gives each kernel manager a context of its own: two threads (zmq's I/O
    thread and its reaper) started and joined for every kernel. Kernels' sockets are closed
    one by one instead (:meth:`HostChannels.close`). A process forked from this one (never
    the server itself) makes its own."""
    global _shared_context
    if _shared_context is None or _shared_context[0] != os.getpid():
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))  # not 1023
        for option, value in _HOST_SOCKET_OPTIONS.items():  # for the sockets it makes
            context.setsockopt(option, value)
        _shared_context = (os.getpid(), context)
    return _shared_context[1]


class HostChannels:
    """One kernel's shell, iopub and stdin sockets, connected at ``address(channel)`` and
    read by the running event loop: each message goes to ``deliver(channel, msg)``; a
    reader that fails (a message that fails its signature, a socket gone) stops reading
    and calls ``failed(exc)``."""

    def __init__(
        self,
        context: zmq.Context[Any],
        session: Session,
        address: Callable[[str], str],
        deliver: Callable[[str, dict[str, Any]], None],
        failed: Callable[[BaseException], None],
        kernel_id: str = "",
    ) -> None:
        self.session = session
        self._deliver = deliver
        self._failed = failed
        self._kernel_id = kernel_id
        # Every socket and its monitor, until close.
        self._channels: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []
        self._sockets: dict[str, zmq.Socket[bytes]] = {}  # those read, by channel: see _drain
        self._monitors: dict[str, zmq.Socket[bytes]] = {}  # each one's connection events
        self._dropped: dict[str, float] = {}  # connections dropped (when), not retried since
        self._rearm: asyncio.TimerHandle | None = None
        self._draining: set[str] = set()  # channels with a next turn of _drain scheduled
        shadow: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        for name, kind in _CHANNELS.items():
            self._open(shadow, name, kind, address(name))
        self._recheck()

    def _open(self, shadow: zmq.Context[zmq.Socket[bytes]], name: str, kind: int, to: str) -> None:
        """Connect channel ``name`` and its monitor, read by the event loop."""
        sock = shadow.socket(kind)
        sock.linger = 0
        for option, value in _HOST_SOCKET_OPTIONS.items():
            sock.setsockopt(option, value)
        sock.identity = self.session.bsession
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(_WATCHED)
        sock.connect(to)
        self._channels.append((sock, monitor))
        self._sockets[name] = sock
        self._monitors[name] = monitor
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.FD, self._drain, name)
        loop.add_reader(monitor.FD, self._watch, name)

    def send(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        parent: dict | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str | None:
        """Send a message on ``channel``; its msg_id, or None when the channel is closed."""
        sock = self._sockets.get(channel)
        if sock is None:  # the channels failed (see _drain) or were closed
            return None
        msg = self.session.msg(msg_type, content, parent=parent, metadata=metadata)
        self.session.send(sock, msg)
        self._drain(channel)  # what arrived before the send, whose signal the send may take
        return str(msg["header"]["msg_id"])

    def _drain(self, name: str) -> None:
        """Hand every message waiting on a channel to ``deliver``.

        A zmq socket's descriptor only signals that its events changed, and a send on the
        socket can take that signal: so a channel is read until its EVENTS say nothing is
        left, again after each send on it (``send``), and every ``_RECV_REARM`` seconds
        (``_recheck``), which bounds any stall instead of hanging a step. At most
        ``_DRAIN_BATCH`` messages a turn of the event loop: the rest in the next turn, so a
        cell that floods its channels cannot keep the host from its other sessions."""
        sock = self._sockets.get(name)
        if sock is None:
            return
        session = self.session
        try:
            for _ in range(_DRAIN_BATCH):
                if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if sum(len(frame) for frame in frames) > MAX_KERNEL_MESSAGE_BYTES:
                    raise self._too_large(name)
                _, parts = session.feed_identities(frames)
                msg = session.deserialize(parts)
                log.debug(
                    "%s %s <- %s %s",
                    self._kernel_id,
                    name,
                    msg["header"]["msg_type"],
                    msg.get("parent_header", {}).get("msg_id"),
                )
                self._deliver(name, msg)
        except Exception as exc:  # a message that fails its signature, a socket gone
            self._fail(exc)
            return
        if name not in self._draining:  # one continuation a channel, however often it fired
            self._draining.add(name)
            asyncio.get_running_loop().call_soon(self._continue_draining, name)

    def _watch(self, name: str) -> None:
        """A connection to the kernel that dropped and is not tried again: zmq drops a kernel
        that sent a frame over the limit, the message lost, and never connects that socket
        again. A kernel that exited is retried at once (``_WATCHED``); the driver's liveness
        watcher notices that it is gone."""
        monitor = self._monitors.get(name)
        if monitor is None:
            return
        try:
            while int(monitor.get(zmq.EVENTS)) & zmq.POLLIN:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                self._dropped.pop(name, None)  # any event after a drop: zmq connects again
                if event == zmq.EVENT_DISCONNECTED:
                    loop = asyncio.get_running_loop()
                    self._dropped[name] = loop.time()
                    loop.call_later(_DROP_GRACE, self._gone, name)
        except zmq.ZMQError as exc:
            self._fail(exc)

    def _gone(self, name: str) -> None:
        """``_DROP_GRACE`` after a drop: fail, unless zmq tried to connect again."""
        self._watch(name)  # the events that came meanwhile
        dropped = self._dropped.get(name)
        # Not a later drop's (whose own call comes); the loop may call a little early.
        if dropped is not None and asyncio.get_running_loop().time() - dropped > _DROP_GRACE / 2:
            self._fail(self._too_large(name))

    def _too_large(self, name: str) -> MessageTooLarge:
        return MessageTooLarge(
            f"the kernel sent the host a message over the host's limit of "
            f"{MAX_KERNEL_MESSAGE_BYTES} bytes on {name}; it was dropped unread",
            kernel_id=self._kernel_id or None,
        )

    def _fail(self, exc: BaseException) -> None:
        self._stop_reading()
        self._failed(exc)

    def _continue_draining(self, name: str) -> None:
        self._draining.discard(name)
        self._drain(name)

    def _recheck(self) -> None:
        for name in list(self._sockets):
            self._watch(name)
            self._drain(name)
        if self._sockets:
            self._rearm = asyncio.get_running_loop().call_later(_RECV_REARM, self._recheck)

    def _stop_reading(self) -> None:
        loop = asyncio.get_running_loop()
        sockets, self._sockets = self._sockets, {}
        monitors, self._monitors = self._monitors, {}
        for sock in [*sockets.values(), *monitors.values()]:  # closed by close
            loop.remove_reader(sock.FD)
        if self._rearm is not None:
            self._rearm.cancel()
            self._rearm = None
        self._dropped = {}

    def close(self) -> None:
        """Stop reading and close every socket (idempotent)."""
        self._stop_reading()
        channels, self._channels = self._channels, []
        for sock, monitor in channels:
            sock.disable_monitor()  # before its socket closes: no event waits for a reader
            monitor.close(linger=0)
            sock.close(linger=0)
