"""The forkserver's spawner: starts each forked kernel's launch, from a process small enough to
fork cheaply.

A forked kernel's *launch* is what a cold kernel's launch command starts (bubblewrap, or for an
unsandboxed kernel the process alone), with a placeholder process (``sleep``) in the kernel's
place; :mod:`kernel_env.kernel.zygote` then forks the kernel into it. Forking each launch from
the zygote would copy the zygote's page tables (tens of megabytes of imported modules) for a
process that execs at once, and unmap them again: ~5 ms of CPU per kernel. The zygote instead
runs this file once, as a fresh interpreter that imports only the standard library, and asks it
for each launch over a socket pair, one JSON line each way.

Run by path, as ``python -I -S spawner.py FD ZYGOTE_PID`` (importing the kernel_env package
would make it as large as the zygote). It ends with the zygote, and every launch it started
ends with it (``PR_SET_PDEATHSIG``): server, zygote, spawner, launches and kernels end together.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from typing import Any

SPAWNER_NAME = "ke-spawner"  # its name in ``ps`` (/proc/<pid>/comm)

PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_IN_OPEN = 0x20
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[2]):
        return  # the zygote ended before the line above took effect
    set_name(SPAWNER_NAME)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launches are reaped by the system
    for line in control.makefile("rb"):
        try:
            reply = launch(json.loads(line))
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        control.sendall((json.dumps(reply) + "\n").encode())


def launch(request: dict[str, Any]) -> dict[str, Any]:
    """Start ``request["launch"]`` as a cold kernel's launch would start the kernel: in the
    kernel's cgroups, with the staged paths bound in a private mount namespace, in its working
    directory, as its uid, with its rlimits, ending when this process ends. Its pids once it
    runs: ``launcher`` (the process the host holds: ending it ends the kernel), ``init`` (the
    sandbox's, or None) and ``placeholder``."""
    me = os.getpid()
    failed, failing = os.pipe()  # close-on-exec: end of file once the exec succeeded
    launcher = os.fork()
    if launcher == 0:
        os.close(failed)
        try:
            _prepare(request, me)
            argv = request["launch"]
            os.execve(argv[0], argv, request["env"])
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.write(failing, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(127)
    os.close(failing)
    with os.fdopen(failed, "rb") as pipe:
        why = pipe.read().decode(errors="replace")
    if why:
        raise OSError(f"the launch could not run: {why}")
    if not request.get("sandboxed"):
        return {"launcher": launcher, "init": None, "placeholder": launcher}
    init, placeholder = _sandbox_pids(launcher, _exec_watch(request["placeholder"]))
    return {"launcher": launcher, "init": init, "placeholder": placeholder}


def _prepare(request: dict[str, Any], spawner: int) -> None:
    """In the launch, before its exec: what the cold launch guard and its helpers do."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored signal would survive the exec
    join_cgroups(request.get("cgroup_join", []))
    if request.get("staged"):
        _bind_staged(request["staged"])
    os.chdir(request["cwd"])  # before the uid change: the kernel's uid may not traverse the way
    set_ids(request)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    if os.getppid() != spawner:
        os._exit(1)
    set_rlimits(request)


def join_cgroups(files: list[str]) -> None:
    """Move this process into a kernel's cgroups: ``0`` written to each of the kernel's join
    files (:attr:`kernel_env.kernel.cgroups.KernelCgroup.join_files`), while it has one thread
    (a forkserver's launch or kernel, a live fork's copy)."""
    for path in files:
        with open(path, "w") as f:
            f.write("0")


def set_ids(request: dict[str, Any]) -> None:
    """Take the kernel's uid and gid, and no supplementary group (a root server's kernels
    run as a uid of their own)."""
    if request.get("uid") is not None:
        os.setgroups([])
        os.setresgid(request["gid"], request["gid"], request["gid"])
        os.setresuid(request["uid"], request["uid"], request["uid"])


def set_rlimits(request: dict[str, Any]) -> None:
    for name, value in request.get("rlimits", {}).items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _bind_staged(staged: list[list[str]]) -> None:
    """Bind each ``(host path, mount point)`` in a private mount namespace of this process
    (and so of the launch), as root: what the kernel's uid cannot reach otherwise."""
    if libc.unshare(_CLONE_NEWNS) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare: {os.strerror(error)}")
    _mount(None, "/", _MS_REC | _MS_PRIVATE)
    for source, target in staged:
        _mount(source, target, _MS_BIND)


def _mount(source: str | None, target: str, flags: int) -> None:
    encoded = source.encode() if source is not None else None
    if libc.mount(encoded, target.encode(), None, flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source} on {target}: {os.strerror(error)}")


def _sandbox_pids(launcher: int, watch: _ExecWatch, timeout: float = 8.0) -> tuple[int, int]:
    """bubblewrap's init (the launcher's child) and the command it runs once the sandbox is
    complete (the init's child, once it has exec'd). The zygote waits on this, and the host on
    the zygote for 10 s: past ``timeout`` the kernel starts cold instead.

    Looked for again each time ``watch`` sees the command's program opened, soon after (its
    exec may still be under way then), and every 5 ms in any case: not every millisecond of
    the sandbox's setup, which took ~2 ms of this process's CPU per launch under load."""
    deadline = time.monotonic() + timeout
    init = None
    woken = False
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{launcher}/task/{launcher}/children"):
            raise OSError(f"the sandbox exited at launch (pid {launcher})")
        with contextlib.suppress(OSError, ValueError):
            if init is None:
                init = next(iter(_children(launcher, "bwrap")), None)
            if init is not None:
                command = next(iter(_children(init, None)), None)
                if command is not None:
                    return init, command
        woken = watch.wait(0.0005 if woken else 0.005)
    with contextlib.suppress(ProcessLookupError):
        os.kill(launcher, signal.SIGKILL)
    raise OSError("the sandbox did not start its command in time")


class _ExecWatch:
    """Says when a program was opened (inotify's ``IN_OPEN`` on its file, which an exec of it
    raises, in any mount namespace the file is bound into); without inotify, every 1 ms."""

    def __init__(self, path: str) -> None:
        self.fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd >= 0 and libc.inotify_add_watch(self.fd, path.encode(), _IN_OPEN) < 0:
            os.close(self.fd)
            self.fd = -1

    def wait(self, timeout: float) -> bool:
        """Whether the program was opened (by anyone) since the last call, waiting at most
        ``timeout`` seconds for it."""
        if self.fd < 0:
            time.sleep(min(timeout, 0.001))
            return False
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass
        return True


@functools.cache
def _exec_watch(path: str) -> _ExecWatch:
    return _ExecWatch(path)


def _children(pid: int, comm: str | None) -> list[int]:
    """``pid``'s children named ``comm`` (None: named anything but bwrap)."""
    found = []
    for child in _read(f"/proc/{pid}/task/{pid}/children").split():
        name = _read(f"/proc/{child}/comm").strip()
        if (name == comm) if comm is not None else (name != "bwrap"):
            found.append(int(child))
    return found


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def prctl(option: int, arg: int) -> int:
    result = int(libc.prctl(option, arg, 0, 0, 0))
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}): {os.strerror(error)}")
    return result


def set_name(name: str) -> None:
    """This process's name in ``ps`` (a forked process keeps its parent's command line)."""
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)


if __name__ == "__main__":
    main()
