"""The forkserver's spawner: starts each forked kernel's launch, from a process small enough to
fork cheaply.

A forked kernel's *launch* is what a cold kernel's launch command starts (bubblewrap, or for an
unsandboxed kernel the process alone), with a placeholder process (``sleep``) in the kernel's
place; :mod:`kernel_env.kernel.fork.zygote` then forks the kernel into it. Forking each launch from
the zygote would copy the zygote's page tables (tens of megabytes of imported modules) for a
process that execs at once, and unmap them again, for every kernel. The zygote instead
runs this file once, as a fresh interpreter that imports only the standard library, and asks it
for each launch over a socket pair, one JSON line each way, tagged with the request's id: a
launch is answered once it runs, and launches overlap (a sandbox's setup is mostly waiting). A
sandboxed launch also says which process is its sandbox's init as soon as bubblewrap names it,
before the sandbox's mounts are made: the zygote forks the kernel into its PID namespace then.

Run by path, as ``python -I -S spawner.py FD ZYGOTE_PID`` (importing the kernel_env package
would make it as large as the zygote). It ends with the zygote, and every launch it started
ends with it (``PR_SET_PDEATHSIG``): server, zygote, spawner, launches and kernels end together.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
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


class Lines:
    """What one end of a socket receives, cut into lines (a line may come in pieces, or
    several in one read): the forkserver's messages, one JSON line each, every way."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self._pending = (self._pending + data).split(b"\n")
        return lines


def send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send ``message`` as one JSON line."""
    sock.sendall((json.dumps(message) + "\n").encode())


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    control.set_inheritable(False)  # passed to this process; never to a launch
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[2]):
        return  # the zygote ended before the line above took effect
    set_name(SPAWNER_NAME)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launches are reaped by the system
    _Spawner(control).serve()


class _Spawner:
    """The spawner's loop: launch requests from the zygote, each answered (by its ``id``) once
    its launch runs, so that launches whose sandboxes are being set up overlap (bubblewrap's
    setup is mostly waiting, which one launch at a time made every kernel's start wait for
    the kernels' before it)."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ)
        self.setting_up: list[_Launch] = []  # sandboxed launches whose command has not run
        self.watch: _ExecWatch | None = None

    def serve(self) -> None:
        lines = Lines()
        woken = False
        while True:
            events = self.selector.select(self._patience(woken))
            woken = False
            for key, _ in events:
                if key.fileobj is self.control:
                    data = self.control.recv(65536)
                    if not data:
                        return  # the zygote closed its end: done
                    for line in lines.feed(data):
                        self._begin(line)
                elif isinstance(key.data, _ExecWatch):
                    woken = key.data.taken()
                elif isinstance(key.data, _InitInfo):
                    self._init_known(key.data)
                else:
                    self._execed(key.data)
            self._look_for_commands()

    def _patience(self, woken: bool) -> float | None:
        """How long to wait for an event: for ever with no sandbox being set up; else 0.5 ms
        just after the placeholder's program was opened (its exec may still be under way),
        5 ms otherwise (1 ms without inotify)."""
        if not self.setting_up:
            return None
        if woken:
            return 0.0005
        return 0.005 if self.watch is not None and self.watch.fd >= 0 else 0.001

    def _begin(self, line: bytes) -> None:
        try:
            request = json.loads(line)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            say("kernel_env: the forkserver's spawner skipped a malformed request")
            return
        try:
            launch = _Launch(request)
        except Exception as exc:
            self._reply(request.get("id"), {"error": f"{type(exc).__name__}: {exc}"})
            return
        self.selector.register(launch.failed, selectors.EVENT_READ, launch)
        if launch.info is not None:
            self.selector.register(launch.info.fd, selectors.EVENT_READ, launch.info)

    def _init_known(self, info: _InitInfo) -> None:
        """bubblewrap said which process is its sandbox's init (its PID namespace exists; its
        mounts are still being made): the zygote may fork the kernel into it now."""
        init = info.read()
        if init is None:
            return  # more to come
        self.selector.unregister(info.fd)
        os.close(info.fd)
        if init > 0 and not info.launch.answered:
            self._reply(info.launch.id, {"sandbox_init": init})

    def _execed(self, launch: _Launch) -> None:
        """The launch exec'd (its close-on-exec pipe ended) or said why it could not."""
        self.selector.unregister(launch.failed)
        with os.fdopen(launch.failed, "rb") as pipe:
            why = pipe.read().decode(errors="replace")
        if why:
            self._answer(launch, {"error": f"OSError: the launch could not run: {why}"})
        elif not launch.request.get("sandboxed"):
            self._answer(launch, launch.pids(None, launch.launcher))
        else:
            self.setting_up.append(launch)
            if self.watch is None:
                self.watch = _ExecWatch(launch.request["placeholder"])
                if self.watch.fd >= 0:
                    self.selector.register(self.watch.fd, selectors.EVENT_READ, self.watch)

    def _look_for_commands(self) -> None:
        for launch in list(self.setting_up):
            try:
                found = launch.sandbox_pids()
            except OSError as exc:
                found = {"error": f"OSError: {exc}"}
            if found is not None:
                self.setting_up.remove(launch)
                self._answer(launch, found)

    def _answer(self, launch: _Launch, reply: dict[str, Any]) -> None:
        """A launch's answer: its pids, or why it failed (with what it wrote to stderr)."""
        launch.answered = True
        if "error" in reply:
            reply = {"error": reply["error"] + launch.said()}
        launch.stop_listening()
        self._reply(launch.id, reply)

    def _reply(self, rid: Any, reply: dict[str, Any]) -> None:
        send_line(self.control, {"id": rid, **reply})


class _Launch:
    """One kernel's launch: ``request["launch"]`` started as a cold kernel's launch would start
    the kernel, in the kernel's cgroups, with the staged paths bound in a private mount
    namespace, in its working directory, as its uid, with its rlimits, ending when the spawner
    ends. ``failed`` ends at its exec, or says why it failed.

    The launch holds nothing of the host's: its stdin and stdout are ``/dev/null``, its stderr
    a pipe the spawner reads (at most :attr:`_SAID` bytes) only to say why a launch failed,
    and closes once it answered; every other descriptor is closed before the exec, but
    bubblewrap's ``--info-fd``."""

    _TIMEOUT = 8.0  # seconds for a sandbox to start its command (the host waits 10 s)
    _SAID = 4096  # bytes of a failed launch's stderr put in its error

    def __init__(self, request: dict[str, Any]) -> None:
        self.request, self.id = request, request.get("id")
        me = os.getpid()
        failed, failing = os.pipe()  # close-on-exec: end of file once the exec succeeded
        stderr, erring = os.pipe()
        info, telling = os.pipe() if request.get("sandboxed") else (-1, -1)
        try:
            launcher = os.fork()
        except OSError:
            for fd in (failed, failing, stderr, erring, info, telling):
                if fd >= 0:
                    os.close(fd)
            raise
        if launcher == 0:
            os.close(failed)
            try:
                _prepare(request, me)
                argv = request["launch"]
                if telling >= 0:  # bubblewrap writes its init's pid there once it exists
                    os.set_inheritable(telling, True)
                    argv = [argv[0], "--info-fd", str(telling), *argv[1:]]
                own_descriptors(stderr=erring, keep=(failing, telling))
                os.execve(argv[0], argv, request["env"])
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.write(failing, f"{type(exc).__name__}: {exc}".encode())
            finally:
                os._exit(127)
        os.close(failing)
        os.close(erring)
        if telling >= 0:
            os.close(telling)
        os.set_blocking(stderr, False)
        self.launcher, self.failed, self.stderr = launcher, failed, stderr
        self.info = _InitInfo(self, info) if info >= 0 else None
        self.deadline = time.monotonic() + self._TIMEOUT
        self.init: int | None = None
        self.answered = False

    def said(self) -> str:
        """What the launch wrote to its stderr so far (bubblewrap says there why it failed),
        as the end of an error message."""
        if self.stderr < 0:
            return ""
        try:
            text = os.read(self.stderr, self._SAID).decode(errors="replace").strip()
        except OSError:
            return ""
        return f" ({text})" if text else ""

    def stop_listening(self) -> None:
        """The launch was answered: its stderr is read no more (what it writes later fails)."""
        if self.stderr >= 0:
            os.close(self.stderr)
            self.stderr = -1

    def pids(self, init: int | None, placeholder: int) -> dict[str, Any]:
        """What the zygote is told: ``launcher`` (the process the host holds: ending it ends
        the kernel), ``init`` (the sandbox's, or None) and ``placeholder``."""
        return {"launcher": self.launcher, "init": init, "placeholder": placeholder}

    def sandbox_pids(self) -> dict[str, Any] | None:
        """The pids once the sandbox runs its command: bubblewrap's init (the launcher's
        child) and the command (the init's child, once it has exec'd); None until then.
        OSError when the sandbox ended, or did not start its command in time (it is killed:
        the kernel starts cold instead)."""
        launcher = self.launcher
        if not os.path.exists(f"/proc/{launcher}/task/{launcher}/children"):
            raise OSError(f"the sandbox exited at launch (pid {launcher})")
        with contextlib.suppress(OSError, ValueError):
            if self.init is None:
                self.init = next(iter(_children(launcher, "bwrap")), None)
            if self.init is not None:
                command = next(iter(_children(self.init, None)), None)
                if command is not None:
                    return self.pids(self.init, command)
        if time.monotonic() < self.deadline:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher, signal.SIGKILL)
        raise OSError("the sandbox did not start its command in time")


def _prepare(request: dict[str, Any], spawner: int) -> None:
    """In the launch, before its exec: what the cold launch guard and its helpers do."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored signal would survive the exec
    # A process group of its own, which the host kills with the launch: bubblewrap's init,
    # cloned just before its parent was killed, may not yet have asked to die with it.
    os.setpgid(0, 0)
    join_cgroups(request.get("cgroup_join", []))
    if request.get("staged"):
        _bind_staged(request["staged"])
    # Before the uid change: the kernel's uid may not traverse the way. A sandbox's cwd is a
    # path inside it, where bubblewrap's --chdir puts the launch.
    os.chdir("/" if request.get("sandboxed") else request["cwd"])
    set_ids(request)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    if os.getppid() != spawner:
        os._exit(1)
    set_rlimits(request)


def own_descriptors(*, stderr: int, keep: tuple[int, ...] = ()) -> None:
    """This process's stdin and stdout on ``/dev/null``, its stderr on ``stderr``, and no
    other descriptor it inherited but ``keep`` (negative numbers are ignored)."""
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(stderr, 2)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.close(fd)


def say(message: str) -> None:
    """A line on this process's stderr (the server's log)."""
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())


def join_cgroups(files: list[str]) -> None:
    """Move this process into a kernel's cgroups: ``0`` written to each of the kernel's join
    files (:attr:`kernel_env.kernel.isolation.cgroups.KernelCgroup.join_files`), while it has
    one thread (a forkserver's launch or kernel, a live fork's copy)."""
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


def set_rlimits(request: dict[str, Any], key: str = "rlimits") -> None:
    """The rlimits the request names under ``key`` (``namespace_rlimits``: those a forked
    kernel sets once it is in its sandbox's user namespace)."""
    for name, value in request.get(key, {}).items():
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


class _InitInfo:
    """What bubblewrap writes to its ``--info-fd`` (JSON, then end of file) as soon as its
    sandbox's init runs, before it makes the sandbox's mounts: the init's ``child-pid``."""

    def __init__(self, launch: _Launch, fd: int) -> None:
        self.launch, self.fd = launch, fd
        self._data = b""

    def read(self) -> int | None:
        """The init's pid once everything was read (0 when bubblewrap wrote none: it failed
        first); None while more may come."""
        with contextlib.suppress(OSError):
            chunk = os.read(self.fd, 4096)
            if chunk:
                self._data += chunk
                return None
        try:
            return int(json.loads(self._data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            return 0


class _ExecWatch:
    """Says when a program was opened (inotify's ``IN_OPEN`` on its file, which an exec of it
    raises, in any mount namespace the file is bound into). ``fd`` is -1 without inotify."""

    def __init__(self, path: str) -> None:
        self.fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd >= 0 and libc.inotify_add_watch(self.fd, path.encode(), _IN_OPEN) < 0:
            os.close(self.fd)
            self.fd = -1

    def taken(self) -> bool:
        """Whether the program was opened (by anyone) since the last call."""
        opened = False
        if self.fd >= 0:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.fd, 4096):
                    opened = True
        return opened


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
