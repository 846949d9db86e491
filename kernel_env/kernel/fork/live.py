"""A live fork of a running kernel, from inside it: copies of the process, copy-on-write.

Run in the kernel by the host (:meth:`kernel_env.kernel.local.LocalKernel.live_fork`), as a
silent cell between steps. :func:`fork_copies` refuses an ipykernel or jupyter_client
release kernel_env was not tested with (the host then replays), and checks that the kernel
is quiescent: the only threads are ipykernel's own (iopub, heartbeat, control, shell
channel, output capture), idle because no step runs, and the kernel has no child process.
It then forks one copy per request. A copy holds the whole interpreter state (variables,
imports, the shell, the execution count) and none of the parent's channels:

- it abandons every inherited ipykernel and zmq object without touching it (they share
  sockets, an epoll set and capture pipes with the parent; closing or collecting them could
  act on the parent's), and keeps them referenced so no finalizer runs;
- it points its stdout and stderr descriptors back where they pointed before ipykernel
  captured them (the parent's capture threads read those pipes);
- it leaves the parent's session and process group, takes its own working directory and
  environment, reseeds its random generators (unless the episode's reset gave a seed), and
  ends when the server does;
- it makes new sockets, threads, session id and event loop
  (:meth:`kernel_env.kernel.fork.template.KernelTemplate.connect`) and serves its own connection
  file. The cell that forked it never returns in the copy.

ipykernel's threads do not survive a fork (ipykernel#1261, jupyter_client#1031); a copy never
uses them or anything they may hold, and builds its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import select
import signal
import sys
import threading
from typing import Any

from kernel_env.inkernel import extension, tuning
from kernel_env.kernel import versions
from kernel_env.kernel.fork.spawner import join_cgroups
from kernel_env.kernel.fork.template import KernelTemplate, grow_descriptor_table, reseed

__all__ = ["fork_copies", "restore_random"]

# Inherited objects a copy must neither use nor let the collector finalize.
_abandoned: list[Any] = []
# A copy's thread that ends it with the server (a copy's copies inherit none).
_server_watch: threading.Thread | None = None
# A seeded episode's random state at the fork, for restore_random().
_random_state: Any = None
# This kernel's copies (its children, reaped at its next fork; the host ends them).
_copies: set[int] = set()


class NotQuiescent(RuntimeError):
    """The kernel runs something a fork would cut in half (a thread, a child process)."""


class UntestedRelease(RuntimeError):
    """This kernel's ipykernel or jupyter_client is not a release a live fork was tested
    with (:data:`kernel_env.kernel.versions.TESTED`): its copy would rely on internals that
    release may not have."""


def fork_copies(requests: list[dict[str, Any]]) -> list[int]:
    """Fork one copy of this kernel per request; their pids, in order (in the parent only).

    A request gives the copy's ``connection_file``, ``cwd`` (holding a copy of the files of
    the parent's, ``parent_cwd``), ``env`` (its whole environment), ``cgroup_join`` (the
    files that move it into its own cgroups), ``server_pid`` (the copy ends with it) and
    ``reseed`` (fresh random state, or the parent's when the episode was seeded)."""
    from ipykernel.kernelapp import IPKernelApp

    why = versions.untested()
    if why is not None:
        raise UntestedRelease(why)
    app = IPKernelApp.instance()
    _check_quiescent(app)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Python reseeds ``random`` in every fork's child; a seeded episode's copies restore this.
    request_state = random.getstate()
    requests = [{**request, "random_state": request_state} for request in requests]
    pids: list[int] = []
    # The collector of a copy would walk (and so write to) every object the parent holds,
    # copying all its pages: what exists now stays out of its reach there (the parent's
    # own collector gets them back below).
    gc.freeze()
    try:
        for request in requests:
            pid = os.fork()
            if pid == 0:
                _become_copy(app, request)  # never returns
            pids.append(pid)
            _copies.add(pid)
    except BaseException:
        for pid in pids:  # all copies or none
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise
    finally:
        gc.unfreeze()
    return pids


def restore_random() -> None:
    """In a seeded episode's copy, once ready: the parent's random state at the fork (the
    readiness handshake draws, and every fork's child is reseeded by Python)."""
    global _random_state
    state, _random_state = _random_state, None
    if state is not None:
        random.setstate(state)


def _check_quiescent(app: Any) -> None:
    ours = {id(t) for t in _kernel_threads(app)}
    others = [t.name for t in threading.enumerate() if id(t) not in ours and t.is_alive()]
    others = [name for name in others if name != threading.main_thread().name]
    if others:
        raise NotQuiescent(f"the kernel runs threads of its own ({', '.join(others)})")
    _reap_copies()
    children = [pid for pid in _children() if pid not in _copies]
    if children:
        raise NotQuiescent(f"the kernel has child processes (pids {children})")


def _kernel_threads(app: Any) -> list[threading.Thread]:
    """ipykernel's own threads: the channels' and the output capture's."""
    threads = [
        getattr(app.iopub_thread, "thread", None),
        app.heartbeat,
        app.control_thread,
        app.shell_channel_thread,
        app.poller,
        _server_watch,
    ]
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream = getattr(stream, "_inner", stream)  # kernel_env's cap around ipykernel's
        threads.append(getattr(stream, "watch_fd_thread", None))
    return [t for t in threads if isinstance(t, threading.Thread)]


def _reap_copies() -> None:
    for pid in list(_copies):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (a cell's os.wait())
            done = pid
        if done:
            _copies.discard(pid)


def _children() -> list[int]:
    me = os.getpid()
    with contextlib.suppress(OSError), open(f"/proc/{me}/task/{me}/children") as f:
        return [int(pid) for pid in f.read().split()]
    return []


# -- in the copy ---------------------------------------------------------------------------------


def _become_copy(app: Any, request: dict[str, Any]) -> None:
    global _random_state
    try:
        grow_descriptor_table()  # first, while this copy has one thread
        _copies.clear()  # the parent's, not this copy's children
        join_cgroups(request["cgroup_join"])  # one thread yet
        os.setsid()  # out of the parent's process group: its end is not the copy's
        _abandon_channels(app)
        _reopen_workspace_files(request["parent_cwd"], request["cwd"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], PWD=request["cwd"])
        _end_with(request["server_pid"])
        template = KernelTemplate(app)
        template.identify(request["connection_file"])
        template.connect()
        template.own_directory()
        extension.after_fork()
        tuning.after_fork(getattr(app, "kernel", None))
        if request["reseed"]:
            reseed()
        else:  # restored once the host has its kernel_info (IPython's banner draws a tip)
            _random_state = request["random_state"]
        app.start()
    except BaseException as exc:  # the copy must never return into the parent's cell
        message = f"kernel_env: a live fork's copy failed: {type(exc).__name__}: {exc}\n"
        with contextlib.suppress(OSError):
            os.write(2, message.encode())
        os._exit(1)
    os._exit(0)


def _abandon_channels(app: Any) -> None:
    """Drop every reference the app and kernel hold to the parent's channels, loop and
    streams, keeping the objects alive (never finalized) in :data:`_abandoned`."""
    kernel = app.kernel
    names = (
        "context", "heartbeat", "iopub_thread", "iopub_socket", "shell_socket", "stdin_socket",
        "control_socket", "debugpy_socket", "debug_shell_socket", "control_thread",
        "shell_channel_thread", "poller", "displayhook",
    )  # fmt: skip
    _abandoned.append({name: getattr(app, name, None) for name in names})
    _abandoned.append(
        {
            name: getattr(kernel, name, None)
            for name in ("shell_stream", "control_stream", "debugpy_stream", "io_loop")
        }
    )
    _abandoned.append((sys.stdout, sys.stderr, sys.displayhook))
    _restore_std_descriptors()
    sys.stdout, sys.stderr, sys.displayhook = sys.__stdout__, sys.__stderr__, sys.__displayhook__
    for name in names:
        with contextlib.suppress(Exception):
            setattr(app, name, None)
    # The parent's event loop is running this very cell: the copy runs a loop of its own
    # and never returns into that one (it shares its epoll set with the parent).
    loop = asyncio.get_event_loop_policy().get_event_loop()
    _abandoned.append(loop)
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(asyncio.new_event_loop())
    kernel._main_asyncio_lock = asyncio.Lock()  # held by the parent's cell in the old loop


def _reopen_workspace_files(theirs: str, mine: str) -> None:
    """Files the episode holds open in the parent's working directory (a fork shares them,
    offsets and all): the same descriptors, at the same offsets, on the copy's files."""
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith(theirs + "/"):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as info:
                fields = dict(line.split(":", 1) for line in info if ":" in line)
            flags = int(fields["flags"], 8) & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
            mine_fd = os.open(mine + target[len(theirs) :], flags)
        except (OSError, ValueError, KeyError):
            continue  # the listing's own descriptor, or a file the copy does not have
        os.lseek(mine_fd, int(fields["pos"]), os.SEEK_SET)
        os.dup2(mine_fd, fd, inheritable=not flags & os.O_CLOEXEC)
        os.close(mine_fd)


def _restore_std_descriptors() -> None:
    """Point fds 1 and 2 back at what they were before ipykernel captured them into pipes
    that the parent's threads read."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        stream = getattr(stream, "_inner", stream)
        original = getattr(stream, "_original_stdstream_copy", None)
        if original is not None:
            os.dup2(original, fd)
        pipe = getattr(stream, "_fid", None)
        if pipe is not None:
            with contextlib.suppress(OSError):
                os.close(pipe)


def _end_with(server_pid: int) -> None:
    """A copy's parent is a kernel, not the server: watch the server and end with it."""
    global _server_watch
    try:
        server = os.pidfd_open(server_pid)
    except OSError:
        os._exit(1)  # already gone

    def watch() -> None:
        ended = select.poll()  # not select(2): no FD_SETSIZE ceiling on the descriptor
        ended.register(server, select.POLLIN)
        ended.poll()
        os._exit(1)

    _server_watch = threading.Thread(target=watch, name="kernel-env-server-watch", daemon=True)
    _server_watch.start()
