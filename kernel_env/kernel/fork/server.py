"""A kernel forkserver: fresh local kernels in milliseconds instead of a cold start.

A cold kernel start spends most of its CPU importing ipykernel, IPython, zmq and jupyter_client.
The forkserver imports them once, in a process that starts no thread (the *zygote*,
:mod:`kernel_env.kernel.fork.zygote`), and forks a child per kernel; the child makes its sockets,
threads and connection info after the fork.

Isolation is unchanged. The zygote's *spawner* (:mod:`kernel_env.kernel.fork.spawner`, a small
process) launches what a cold kernel's launch command starts: in the kernel's cgroups, as its
own uid, with its rlimits and, when sandboxed, the same bubblewrap sandbox; only the process
inside is a placeholder (``sleep``). The zygote forks the kernel into the sandbox's PID
namespace as soon as it exists; the kernel joins its cgroups, waits for the placeholder (the
sandbox's mounts are made by then), drops to its uid, joins the sandbox's other namespaces and
drops every capability. A kernel and its placeholder live and die together,
and the host holds the launch (a pidfd, :class:`kernel_env.kernel.local.LocalKernel`), so
jupyter_client's process tracking, the liveness watcher, restarts and shutdown work as for a
cold kernel.
docs/security.md gives the design and its threat model.

Lifecycle: ``await ForkServer(preload=...).start()``, then ``close()``. A forkserver that could
not start (a preload failed or started a thread, no fork on this platform, an ipykernel or
jupyter_client release it was not tested with: :mod:`kernel_env.kernel.versions`) says why in
``status`` and, once, in the log; kernels then start cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kernel_env.kernel import versions
from kernel_env.kernel.fork.spawner import Lines, send_line
from kernel_env.kernel.launch import forked_kernel_flags, minimal_environ

__all__ = ["ForkServer", "ForkServerError"]

log = logging.getLogger(__name__)

_START_TIMEOUT = 120.0  # the zygote imports ipykernel & co. (and the preloads) once
_REQUEST_TIMEOUT = 10.0


class ForkServerError(RuntimeError):
    """The forkserver cannot fork a kernel (it is not running, or it died)."""


class ForkServer:
    """One zygote process serving fork requests for this process's local kernels."""

    def __init__(self, *, preload: Sequence[str] = (), python: str = sys.executable) -> None:
        self.preload = tuple(preload)
        self.python = python
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()  # the socket's writes, the waiting requests, _problem
        self._start_lock = threading.Lock()
        self._problem: str | None = "not started"
        self._waiting: dict[int, _Answer] = {}  # requests sent, by id, until answered
        self._last_id = 0
        self._reader: threading.Thread | None = None
        self.forks = 0

    @property
    def ready(self) -> bool:
        return self._problem is None

    @property
    def status(self) -> str:
        """How local kernels start, in words (the status line, /health, /metadata)."""
        if self._problem is None:
            extra = f", preloaded {', '.join(self.preload)}" if self.preload else ""
            return f"forked from a preloaded forkserver (pid {self._pid()}{extra})"
        return f"cold start (forkserver: {self._problem})"

    def _pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> ForkServer:
        """Start the zygote, if it is not running yet, and wait until it has imported
        everything; on failure, the reason is in ``status`` and kernels start cold. The
        first kernel that needs it starts it, so a server that starts no kernel pays nothing."""
        if self._problem == "not started":
            await asyncio.to_thread(self._start_once)
        return self

    def _start_once(self) -> None:
        with self._start_lock:
            if self._problem != "not started":
                return
            self._start()
            if self._problem is None:
                log.info("kernels start: %s", self.status)
            else:
                log.warning("kernels start cold: the forkserver %s", self._problem)

    def _start(self) -> None:
        if not hasattr(os, "fork") or not hasattr(os, "pidfd_open"):
            self._problem = "this platform has no fork() or pidfd_open()"
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen(
                [*_tied_to_this_process(), self.python, "-m", "kernel_env.kernel.fork.zygote",
                 str(theirs.fileno()), json.dumps(self._config())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=_zygote_environ(self.python),
                cwd="/",
                start_new_session=True,  # a terminal's Ctrl-C is the server's to handle
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            self._problem = f"could not start: {exc}"
            return
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        ours.settimeout(_START_TIMEOUT)
        try:
            with ours.makefile("rb") as hello_line:  # the only line before any request
                hello = json.loads(hello_line.readline() or b"{}")
        except (OSError, ValueError) as exc:
            hello = {"problem": f"did not start: {exc}"}
        if not hello.get("ready"):
            self._problem = hello.get("problem") or "exited while starting"
            self._stop()
            return
        ours.settimeout(_REQUEST_TIMEOUT)  # bounds each write of a request
        self._problem = None
        self._reader = threading.Thread(
            target=self._read_answers, args=(ours,), name="forkserver-answers", daemon=True
        )
        self._reader.start()

    def _config(self) -> dict[str, Any]:
        """What the zygote prepares: the preloads, and the kernel its forks start from."""
        return {
            "preload": list(self.preload),
            "flags": forked_kernel_flags(),
            "tested": versions.TESTED,
        }

    async def fork(self, request: dict[str, Any]) -> dict[str, Any]:
        """Launch and fork a kernel as ``request`` says (see :mod:`kernel_env.kernel.fork.zygote`);
        the pids of the kernel (``pid``), its launch (``launcher``: ending it ends the kernel),
        its sandbox's init (``init``, or None) and its placeholder. Requests overlap: the
        zygote answers each once its launch runs, and no thread waits for the answer."""
        answer = _Answer(asyncio.get_running_loop())
        problem = self._send(request, answer)
        if problem is None:
            try:
                reply = await asyncio.wait_for(answer.future, _REQUEST_TIMEOUT)
            except TimeoutError:
                problem = f"stopped (no answer in {_REQUEST_TIMEOUT:.0f} s)"
        if problem is not None:
            await asyncio.to_thread(self._failed, problem)
            raise ForkServerError(self._problem or problem)
        if "pid" not in reply:  # the zygote stopped
            raise ForkServerError(self._problem or "stopped")
        if "error" in reply:  # this launch failed; the zygote serves the next
            raise ForkServerError(f"the launch failed: {reply['error']}")
        self.forks += 1
        return reply

    def _send(self, request: dict[str, Any], answer: _Answer) -> str | None:
        """Send ``request`` under an id of its own, for ``answer``; what went wrong, or None."""
        with self._lock:
            if self._problem is not None or self._control is None:
                raise ForkServerError(f"the forkserver is not running ({self._problem})")
            self._last_id += 1
            self._waiting[self._last_id] = answer
            try:  # a small write, with a timeout
                send_line(self._control, {**request, "id": self._last_id})
            except OSError as exc:
                return f"stopped ({exc})"
        return None

    def _read_answers(self, control: socket.socket) -> None:
        """The reader thread: hands each answer to the request with its id, until the
        zygote stops (end of file, or an error that answers no request)."""
        lines = Lines()
        why = None
        while why is None:
            try:
                data = control.recv(65536)
            except TimeoutError:
                continue  # nothing to say for a while
            except OSError as exc:
                why = str(exc)
                break
            if not data:
                why = "it exited"
                break
            for line in lines.feed(data):
                why = why or self._hand_out(line)
        self._failed(f"stopped ({why})")

    def _hand_out(self, line: bytes) -> str | None:
        """Give an answer to its request; why the zygote stopped, if it says so."""
        try:
            answer = json.loads(line)
        except ValueError:
            return f"it answered {line[:80]!r}"
        if answer.get("id") is None:
            return str(answer.get("error") or "it stopped")
        with self._lock:
            waiting = self._waiting.pop(answer["id"], None)
        if waiting is not None:
            waiting.give(answer)
        return None

    def _failed(self, problem: str) -> None:
        """The zygote stopped answering: kernels start cold from now on, and every request
        still waiting fails."""
        with self._lock:
            if self._problem is None:
                self._problem = problem
                log.warning("kernels start cold from now on: the forkserver %s", problem)
            waiting, self._waiting = self._waiting, {}
        for answer in waiting.values():
            answer.give({"error": self._problem})
        self._stop()

    async def close(self) -> None:
        with self._lock:
            if self._problem is None:
                self._problem = "closed"
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        with self._lock:
            control, self._control = self._control, None
        if control is not None:
            with contextlib.suppress(OSError):
                control.shutdown(socket.SHUT_RDWR)  # the zygote's loop ends at end of file
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)  # it ends at that end of file too
        if control is not None:
            control.close()
        process, self._process = self._process, None
        if process is not None:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    async def __aenter__(self) -> ForkServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Answer:
    """The zygote's answer to one request: a future of the event loop that asked, given
    from the reader thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.future = loop, loop.create_future()

    def give(self, answer: dict[str, Any]) -> None:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._set, answer)

    def _set(self, answer: dict[str, Any]) -> None:
        if not self.future.done():
            self.future.set_result(answer)


def _tied_to_this_process() -> list[str]:
    """The zygote is killed if this process dies (it would otherwise outlive a SIGKILLed
    server, holding nothing but memory)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _zygote_environ(python: str) -> dict[str, str]:
    """The kernels' minimal environment (the zygote holds no secret), with native thread
    pools kept at one thread so that a preloaded numpy starts none."""
    env = minimal_environ("/", python)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env
