"""The host's channel client of a local kernel: its shell, iopub and stdin sockets, read
through the event loop and handed, message by message, to the driver (:mod:`.base`).

jupyter_client's manager and provisioners supervise a local kernel (:mod:`.manager`); this
client, not jupyter_client's, speaks to it. jupyter_client's asyncio client made channel
objects and asyncio sockets for every kernel, and its recv registered and dropped each
socket's descriptor with the loop for every message; its ``Session.send`` made a new shadow
socket for every message. Here: one blocking socket per channel on one zmq context for the
whole process, read by the event loop's own readers (``benchmarks/README.md`` has the
figures). Host side.
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

__all__ = ["HostChannels", "host_context"]

log = logging.getLogger(__name__)

_RECV_REARM = 0.25  # seconds; see HostChannels._drain
_CHANNELS = {"shell": zmq.DEALER, "iopub": zmq.SUB, "stdin": zmq.DEALER}  # and socket types
_DRAIN_BATCH = 64  # messages read from a channel in one turn of the event loop

# The host's sockets may connect before the kernel binds its own; zmq then retries every
# 100 ms by default, which a forked kernel (ready in tens of ms) would wait out. No backing
# off either: a kernel that binds late under load was reached only at the next doubled
# interval. (Trying a unix socket path costs one failed connect(2); a dead kernel's sockets
# are closed by its restart or shutdown.) Set on each socket: a context's defaults reach only
# the sockets made through that very context object, not through a shadow of it.
_HOST_SOCKET_OPTIONS = {zmq.RECONNECT_IVL: 5, zmq.RECONNECT_IVL_MAX: 0}

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
        self._channels: list[zmq.Socket[bytes]] = []  # every socket, until close
        self._sockets: dict[str, zmq.Socket[bytes]] = {}  # those read, by channel: see _drain
        self._rearm: asyncio.TimerHandle | None = None
        self._draining: set[str] = set()  # channels with a next turn of _drain scheduled
        shadow: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        loop = asyncio.get_running_loop()
        for name, kind in _CHANNELS.items():
            sock = shadow.socket(kind)
            sock.linger = 0
            for option, value in _HOST_SOCKET_OPTIONS.items():
                sock.setsockopt(option, value)
            sock.identity = session.bsession
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(address(name))
            self._channels.append(sock)
            self._sockets[name] = sock
            loop.add_reader(sock.FD, self._drain, name)
        self._recheck()

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
            self._stop_reading()
            self._failed(exc)
            return
        if name not in self._draining:  # one continuation a channel, however often it fired
            self._draining.add(name)
            asyncio.get_running_loop().call_soon(self._continue_draining, name)

    def _continue_draining(self, name: str) -> None:
        self._draining.discard(name)
        self._drain(name)

    def _recheck(self) -> None:
        for name in list(self._sockets):
            self._drain(name)
        if self._sockets:
            self._rearm = asyncio.get_running_loop().call_later(_RECV_REARM, self._recheck)

    def _stop_reading(self) -> None:
        loop = asyncio.get_running_loop()
        sockets, self._sockets = self._sockets, {}
        for sock in sockets.values():  # closed by close
            loop.remove_reader(sock.FD)
        if self._rearm is not None:
            self._rearm.cancel()
            self._rearm = None

    def close(self) -> None:
        """Stop reading and close every socket (idempotent)."""
        self._stop_reading()
        channels, self._channels = self._channels, []
        for sock in channels:
            sock.close(linger=0)
