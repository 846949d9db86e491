"""The kernel forkserver's process: import what a kernel needs once, then fork fresh kernels.

Run by :class:`kernel_env.kernel.fork.server.ForkServer` as
``python -m kernel_env.kernel.fork.zygote FD CONFIG_JSON``, FD being its end of a socket pair
and the config giving the operator's preload list, the kernels' ipykernel flags and the
releases the host tested (:mod:`kernel_env.kernel.versions`). It imports ipykernel, IPython, zmq and
kernel_env's in-kernel module (and the preloads), builds the kernel every fork starts from
(:mod:`kernel_env.kernel.fork.template`: the kernel object and its shell, no socket yet), checks
that no thread was started (forking a threaded process copies locks held by threads that do
not exist in the child), starts its spawner, says ``ready`` and serves fork requests, one JSON
line each, answered by id as each kernel is forked (requests overlap). For each request:

1. the spawner (:mod:`kernel_env.kernel.fork.spawner`, a small process of its own) starts what a
   cold kernel's launch command would, with a placeholder process (``sleep``) in the kernel's
   place: in the kernel's cgroups, with the paths the kernel's uid cannot reach bound in a
   private mount namespace, as the kernel's uid, with its rlimits, and for a sandboxed kernel
   through bubblewrap;
2. the zygote forks the kernel, once it has checked that the spawner's answer names a launch
   the spawner made for this request (:meth:`_Zygote._launch_problem`: whoever may have
   written to the spawner's socket cannot make the zygote fork a kernel outside its sandbox,
   nor kill a process it names). For a sandboxed kernel the fork lands in the sandbox's PID
   namespace (the zygote points ``pid_for_children`` at it with ``setns(2)`` for that one
   fork, then back at its own), as soon as that namespace exists (the spawner relays
   bubblewrap's ``--info-fd``), while bubblewrap still makes the sandbox's mounts. The kernel,
   holding nothing of the zygote's but what its next steps need (:func:`_fork`), joins the
   kernel's cgroups, waits until the placeholder runs (the zygote tells it), drops to the
   kernel's uid and joins the sandbox's other namespaces (user first, then mount, network,
   IPC, UTS and cgroup), so it gets exactly the sandbox's filesystem view, no network, its
   own ``/proc`` and private ``/tmp``. A zygote without ``CAP_SYS_ADMIN`` (a server that is
   not root) cannot point its own forks into another PID namespace: once the placeholder
   runs, a short-lived child of it joins the sandbox and forks the kernel there instead;
3. the zygote watches the kernel and the placeholder (pidfds): when one ends it kills the
   other, so the host, which holds the launch, sees the kernel end, and ending the launch
   ends the kernel.

The kernel then drops every capability, sets no-new-privileges, installs the seccomp filter
(a sandboxed kernel: :mod:`kernel_env.kernel.isolation.seccomp`), applies its rlimits, closes every
descriptor it still holds, takes its minimal environment, reseeds its random generators, and
finishes the template into its own ipykernel: sockets, threads, connection info and session
id are all made after the fork.

The zygote never runs user code and never holds a secret: it starts with the kernels' minimal
environment, and requests carry only paths, ids, limits and that environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from kernel_env.kernel import versions
from kernel_env.kernel.fork import spawner as spawning
from kernel_env.kernel.fork.template import (
    KernelTemplate,
    grow_descriptor_table,
    missing_internals,
    reseed,
)
from kernel_env.kernel.isolation import seccomp

# The modules every kernel imports while it starts: loaded once here, shared copy-on-write.
KERNEL_MODULES = (
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipykernel.zmqshell",
    "ipykernel.iostream",
    "ipykernel.debugger",
    "IPython",
    "IPython.core.completerlib",
    "IPython.core.debugger",
    "IPython.core.logger",
    "IPython.core.oinspect",
    "IPython.extensions.storemagic",
    "IPython.utils.wildcard",
    "jupyter_client.session",
    "tornado.platform.asyncio",
    "zmq",
    "bdb",
    "cmd",
    "faulthandler",
    "pdb",
    "kernel_env.inkernel.extension",
    "kernel_env.inkernel.tuning",
)

# The processes' names (``ps -o comm``, /proc/<pid>/comm): a forked kernel keeps the zygote's
# command line, so the name is what tells it apart.
KERNEL_NAME = "ke-kernel"

# setns(2) order: the user namespace first (it grants the capabilities the others need).
_NAMESPACES = ("user", "mnt", "net", "ipc", "uts", "cgroup")

_REAP_EVERY = 0.5  # seconds: an orphan is collected this soon, even when nothing else happens
_CLONE_NEWPID = 0x20000000
_NS_GET_PARENT = 0xB702  # ioctl_ns(2): _IO(0xb7, 0x2)
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522

_libc = spawning.libc
_prctl = spawning.prctl


def main() -> None:
    started_with = dict(os.environ)
    if sys.path and sys.path[0] == os.getcwd():
        del sys.path[0]  # what ``-m`` added, as ipykernel_launcher does: kernels add their own
    control = socket.socket(fileno=int(sys.argv[1]))
    config = json.loads(sys.argv[2])
    problem = (
        _preload_kernel_modules() or _untested(config.get("tested")) or _preload(config["preload"])
    )
    if problem is None and "numpy" in sys.modules:
        problem = _preload(["numpy.random"])  # what reseed() draws on in every kernel
    if problem is None and (threads := len(os.listdir("/proc/self/task"))) > 1:
        problem = f"the preloaded modules started {threads - 1} thread(s): forking is unsafe"
    template = spawner = None
    program, problem = _seccomp_program() if problem is None else (None, problem)
    if problem is None:
        template, problem = _build_template(config["flags"])
    if template is not None:
        spawner, problem = _start_spawner()
    # What importing and building set in the environment (ipykernel's debugger, the shell's
    # TERM and PAGER): a kernel started cold sets the same in its own.
    imported = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    spawning.send_line(control, {"ready": problem is None, "problem": problem})
    if template is None or spawner is None:
        return
    # A kernel forked through a short-lived child (see _fork_kernel) becomes the zygote's.
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _Zygote(control, template, imported, spawner, program).serve()


def _seccomp_program() -> tuple[bytes | None, str | None]:
    """The seccomp program sandboxed kernels install on themselves (None on a machine that
    has none: cold kernels run without one too), or why it cannot be read."""
    path = seccomp.program_path()
    try:
        return (seccomp.load(path) if path is not None else None), None
    except (OSError, ValueError) as exc:
        return None, f"its seccomp program is unreadable: {exc}"


def _preload_kernel_modules() -> str | None:
    """Import :data:`KERNEL_MODULES` without debugpy: forked kernels have no debugger
    (``template._without_debugger``), and ipykernel's debugger module imports debugpy and
    its pydevd when it can, ~8 MB that the zygote would hold and every fork would map. A
    cell, or an operator's preload, may still import debugpy."""
    blocked = "debugpy" not in sys.modules
    if blocked:
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # importing it fails
    try:
        return _preload(list(KERNEL_MODULES))
    finally:
        if blocked:
            del sys.modules["debugpy"]


def _untested(tested: dict[str, Any] | None) -> str | None:
    """Why this zygote must not build kernels from ipykernel's internals: a release the host
    did not test (``tested``, :data:`kernel_env.kernel.versions.TESTED`), or an internal the
    template needs that is gone. Kernels then start cold."""
    why = versions.untested(tested) or missing_internals()
    return f"was not used: {why}" if why is not None else None


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; the first failure, in words, or None."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a preload may raise anything, SystemExit included
            return f"preloading {name} failed: {type(exc).__name__}: {exc}"
    return None


def _build_template(flags: list[str]) -> tuple[KernelTemplate | None, str | None]:
    """The kernel every fork starts from, or why it could not be built."""
    scratch = tempfile.mkdtemp(prefix="kernel-env-zygote-")  # IPython's profile, while building
    try:
        return KernelTemplate.build(flags, scratch), None
    except BaseException as exc:
        return None, f"building the kernel failed: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _Spawner:
    """The zygote's end of its spawner (:mod:`kernel_env.kernel.fork.spawner`): launch requests
    out, and their answers (by ``id``, in the order the launches come to run) back."""

    def __init__(self, process: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.process, self.control = process, control
        self._lines = spawning.Lines()

    def launch(self, request: dict[str, Any]) -> None:
        """Ask for ``request``'s launch (OSError when the spawner is gone)."""
        spawning.send_line(self.control, request)

    def answers(self) -> list[dict[str, Any]]:
        """The answers the spawner has sent (call when its socket is readable): each the
        launch's pids, or an ``error``; a line that is not one is skipped (said in the log).
        OSError when the spawner is gone."""
        data = self.control.recv(65536)
        if not data:
            raise OSError("it exited")
        answers = []
        for line in self._lines.feed(data):
            try:
                answer = json.loads(line)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                answers.append(answer)
            else:
                _say("kernel_env: the forkserver skipped a malformed answer of its spawner")
        return answers


class _Stopped(Exception):
    """The zygote cannot fork kernels any more."""


def _start_spawner() -> tuple[_Spawner | None, str | None]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    script = Path(spawning.__file__)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(script), str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd="/",
        )  # fmt: skip
    except OSError as exc:
        ours.close()
        return None, f"its spawner could not start: {exc}"
    finally:
        theirs.close()
    return _Spawner(process, ours), None


class _Zygote:
    """The zygote's loop: fork requests from the host, the spawner's answers to the launches
    they need, and the ends of the kernels it forked and of their placeholders. Requests
    overlap: each is answered (by its ``id``) once its launch runs and its kernel is forked."""

    def __init__(
        self,
        control: socket.socket,
        template: KernelTemplate,
        imported: dict[str, str],
        spawner: _Spawner,
        program: bytes | None,
    ) -> None:
        self.control, self.template, self.imported, self.spawner = (
            control, template, imported, spawner,
        )  # fmt: skip
        self.program = program  # the seccomp filter of sandboxed kernels
        self.selector = selectors.DefaultSelector()
        self.own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.can_point_forks = True  # whether setns(CLONE_NEWPID) works here (see _fork_kernel)
        self.launching: dict[Any, dict[str, Any]] = {}  # requests by id, until launched
        self.waiting: dict[Any, _Waiting] = {}  # kernels forked early (see _fork_early), by id

    def serve(self) -> None:
        self.selector.register(self.control, selectors.EVENT_READ)
        self.selector.register(self.spawner.control, selectors.EVENT_READ)
        lines = spawning.Lines()
        try:
            while True:
                for key, _ in self.selector.select(timeout=_REAP_EVERY):
                    if self.selector.get_map().get(key.fd) is not key:
                        continue  # closed while handling an earlier event of this batch
                    if key.fileobj is self.spawner.control:
                        self._launched()
                    elif isinstance(key.data, _Said):
                        self._relay(key.fd, key.data)
                    elif key.fileobj is not self.control:
                        self._ended(key.fd, key.data)
                    else:
                        data = self.control.recv(65536)
                        if not data:
                            return  # the host closed its end: done
                        for line in lines.feed(data):
                            self._launch(json.loads(line))
                _reap()
        except _Stopped as exc:  # said without an id: the host starts kernels cold
            self._answer({"error": str(exc)})

    def _launch(self, request: dict[str, Any]) -> None:
        request["env"] = request["env"] | self.imported
        # The kernel's own request also carries its seccomp program (the spawner's does not).
        program = self.program if request.get("sandboxed") else None
        self.launching[request.get("id")] = {**request, "seccomp": program}
        try:
            self.spawner.launch(request)
        except OSError as exc:
            raise _Stopped(f"its spawner is gone ({exc})") from exc

    def _launched(self) -> None:
        try:
            answers = self.spawner.answers()
        except OSError as exc:
            raise _Stopped(f"its spawner is gone ({exc})") from exc
        for launched in answers:
            rid = launched.pop("id", None)
            if not isinstance(rid, int) or rid not in self.launching:
                continue  # no launch waits for this answer
            request = self.launching[rid]
            if "sandbox_init" in launched:
                if rid not in self.waiting:
                    self._fork_early(rid, request, launched["sandbox_init"])
                continue
            del self.launching[rid]
            self._answer({"id": rid, **self._fork_into(request, launched)})

    def _fork_early(self, rid: Any, request: dict[str, Any], init: int) -> None:
        """Fork ``request``'s kernel into its sandbox's PID namespace as soon as that exists,
        while bubblewrap still makes the sandbox's mounts (a few milliseconds): the fork and
        the kernel's first steps (its cgroups, its own process, its connection file) overlap
        them. The kernel then waits for its placeholder's pid (see _kernel_in_waiting). When
        this cannot fork, the kernel is forked once the placeholder runs."""
        if not self.can_point_forks:
            return  # a short-lived child joins the whole sandbox instead (see _fork_kernel)
        try:
            with _Process(init) as process:
                if self._init_problem(request, process) is not None:
                    return  # not this request's sandbox: its launch's answer is refused too
                namespace = process.open("ns/pid")
        except (OSError, TypeError, ValueError):
            return  # the sandbox ended already: its launch's answer says why
        try:
            _set_namespace(namespace, _CLONE_NEWPID)
        except PermissionError:
            self.can_point_forks = False
            return
        finally:
            os.close(namespace)
        told, tell = os.pipe()
        try:
            child = partial(_kernel_in_waiting, request, self.template, told)
            kernel = self._relayed(*_fork(child, keep=(told,)))
            self.waiting[rid] = _Waiting(kernel, tell)
        except OSError:  # no fork, or the kernel was gone at once (its sandbox failed)
            os.close(tell)
        finally:
            self._own_pid_namespace_again()
            os.close(told)

    def _fork_into(self, request: dict[str, Any], launched: dict[str, Any]) -> dict[str, Any]:
        """Fork ``request``'s kernel into its launch (or tell the kernel forked early that its
        sandbox is whole): its pid and the launch's pids, or why not."""
        waiting = self.waiting.pop(request.get("id"), None)
        if "error" in launched:
            if waiting is not None:
                waiting.cancel()
            return {"pid": None, "error": str(launched["error"])}
        try:
            placeholder, problem = self._hold_placeholder(request, launched)
        except (OSError, TypeError, ValueError) as exc:
            placeholder, problem = -1, f"the launch ended at once ({exc})"
        if problem is not None:
            if waiting is not None:
                waiting.cancel()
            if placeholder >= 0:
                os.close(placeholder)  # never killed: it may be anyone's
            return {"pid": None, "error": problem}
        if waiting is not None:
            if not waiting.go(launched["placeholder"]):
                _kill(placeholder)
                os.close(placeholder)
                return {"pid": None, "error": "the kernel forked into the sandbox ended"}
            self._watch(waiting.pidfd, placeholder)
            return {"pid": waiting.pid, **_pids(launched)}
        try:
            sandbox = _Sandbox(launched["placeholder"]) if launched["init"] else None
            try:
                kernel = self._fork_kernel(request, sandbox)
            finally:
                if sandbox is not None:
                    sandbox.close()
        except Exception as exc:
            _kill(placeholder)
            os.close(placeholder)
            return {"pid": None, "error": f"forking the kernel failed: {type(exc).__name__}: {exc}"}
        self._watch(os.pidfd_open(kernel), placeholder)
        return {"pid": kernel, **_pids(launched)}

    def _hold_placeholder(
        self, request: dict[str, Any], launched: dict[str, Any]
    ) -> tuple[int, str | None]:
        """A pidfd of the launch's placeholder, and why the answer is refused (None when it
        is not). The checks read each process's /proc entry through a descriptor opened
        before the pidfd: a pid reused meanwhile fails them instead of passing."""
        init = launched.get("init")
        with contextlib.ExitStack() as stack:
            placeholder = stack.enter_context(_Process(launched["placeholder"]))
            launcher = stack.enter_context(_Process(launched["launcher"]))
            sandbox = stack.enter_context(_Process(init)) if init is not None else None
            pidfd = os.pidfd_open(placeholder.pid)
            try:
                return pidfd, self._launch_problem(request, placeholder, launcher, sandbox)
            except BaseException:
                os.close(pidfd)
                raise

    def _launch_problem(
        self,
        request: dict[str, Any],
        placeholder: _Process,
        launcher: _Process,
        init: _Process | None,
    ) -> str | None:
        """Why these processes are not a launch the spawner made for ``request``, or None: the
        launcher is the spawner's child; a sandboxed launch has an init (the launcher's child,
        in a PID namespace of its own), whose child is the placeholder; an unsandboxed launch
        is the placeholder itself; and each runs as the request's uid, in its cgroups."""
        if launcher.parent() != self.spawner.process.pid:
            return f"process {launcher.pid} is not a launch of this forkserver"
        if not request.get("sandboxed"):
            if init is not None or placeholder.pid != launcher.pid:
                return "an unsandboxed launch names other processes"
            return _foreign(request, [launcher])
        if init is None:
            return "a sandboxed launch has no sandbox"
        if init.parent() != launcher.pid or placeholder.parent() != init.pid:
            return f"processes {init.pid} and {placeholder.pid} are not that launch's sandbox"
        return self._not_a_sandbox(init) or _foreign(request, [launcher, init, placeholder])

    def _init_problem(self, request: dict[str, Any], init: _Process) -> str | None:
        """Why ``init`` is not the init of the sandbox the spawner is making for ``request``
        (None when it is): the child of a launch of the spawner's, in a PID namespace of its
        own, as the request's uid, in its cgroups."""
        if init.grandparent() != self.spawner.process.pid:
            return f"process {init.pid} is not of a launch of this forkserver"
        return self._not_a_sandbox(init) or _foreign(request, [init])

    def _not_a_sandbox(self, init: _Process) -> str | None:
        if init.pid_namespace() == os.fstat(self.own_pid_namespace).st_ino:
            return f"process {init.pid} is not in a sandbox"
        return None

    def _answer(self, reply: dict[str, Any]) -> None:
        spawning.send_line(self.control, reply)

    def _fork_kernel(self, request: dict[str, Any], sandbox: _Sandbox | None) -> int:
        """Fork the kernel (into ``sandbox``); its pid."""
        if sandbox is None:
            child = partial(_kernel, request, self.template, None, tied_to=os.getpid())
            return self._relayed(*_fork(child))
        if self.can_point_forks:
            try:
                _set_namespace(sandbox.pid, _CLONE_NEWPID)
            except PermissionError:
                self.can_point_forks = False
            else:
                try:
                    child = partial(_kernel, request, self.template, sandbox, tied_to=None)
                    return self._relayed(*_fork(child, keep=sandbox.descriptors))
                finally:
                    self._own_pid_namespace_again()
        return self._relayed(*_fork_through(request, self.template, sandbox))

    def _relayed(self, pid: int, said: int) -> int:
        """Relay what a forked process writes to its stderr pipe ``said`` to the zygote's own
        (the server's log) until it closes it (the kernel does, before it runs a cell)."""
        self.selector.register(said, selectors.EVENT_READ, _Said())
        return pid

    def _own_pid_namespace_again(self) -> None:
        try:
            _set_namespace(self.own_pid_namespace, _CLONE_NEWPID)
        except OSError as exc:  # every later fork would land in that sandbox: stop here
            _say(f"kernel_env: the forkserver cannot return to its PID namespace: {exc}")
            os._exit(1)

    def _watch(self, kernel: int, placeholder: int) -> None:
        pair = _Pair(kernel, placeholder)
        self.selector.register(kernel, selectors.EVENT_READ, pair)
        self.selector.register(placeholder, selectors.EVENT_READ, pair)

    def _relay(self, fd: int, said: _Said) -> None:
        data = b""
        with contextlib.suppress(OSError):
            data = os.read(fd, 4096)
        if data:
            said.relay(data)
        else:
            self._forget(fd)

    def _ended(self, pidfd: int, pair: _Pair) -> None:
        """A kernel or its placeholder ended: end the other (a shutdown often ends both). A
        kernel is watched until it has ended, then collected."""
        if pidfd == pair.kernel:
            with contextlib.suppress(ChildProcessError):  # unless _reap collected it first
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            if pair.placeholder is not None:
                _kill(pair.placeholder)
                self._forget(pair.placeholder)
            self._forget(pair.kernel)
        else:
            _kill(pair.kernel)
            self._forget(pidfd)
            pair.placeholder = None

    def _forget(self, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)


class _Process:
    """A process's /proc entry, held open: what is read through it is that process's, and
    reading fails once it has ended (its pid may then name another)."""

    def __init__(self, pid: object) -> None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"not a pid: {pid!r}")
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self) -> _Process:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def open(self, name: str) -> int:
        return os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)

    def read(self, name: str) -> str:
        fd = self.open(name)
        with os.fdopen(fd) as f:
            return f.read()

    def parent(self) -> int:
        # The fields after the command name (which may hold spaces and ")"): state, ppid.
        return int(self.read("stat").rsplit(")", 1)[1].split()[1])

    def grandparent(self) -> int | None:
        try:
            with _Process(self.parent()) as parent:
                return parent.parent()
        except (OSError, ValueError):
            return None

    def uid(self) -> int:
        line = next(x for x in self.read("status").splitlines() if x.startswith("Uid:"))
        return int(line.split()[1])  # the real uid

    def cgroups(self) -> list[str]:
        """The process's cgroup paths (one per hierarchy), as this process sees them."""
        return [line.split(":", 2)[2] for line in self.read("cgroup").splitlines() if line]

    def pid_namespace(self) -> int:
        return os.stat("ns/pid", dir_fd=self.fd).st_ino


def _pids(launched: dict[str, Any]) -> dict[str, Any]:
    """The launch's pids, as the host is told them."""
    return {name: launched.get(name) for name in ("launcher", "init", "placeholder")}


def _foreign(request: dict[str, Any], processes: list[_Process]) -> str | None:
    """Which of ``processes`` does not run as the request's uid or in its cgroups (its
    cgroup directories are those of the join files), in words; None if all do."""
    uid = request.get("uid")
    joins = [os.path.split(path) for path in request.get("cgroup_join", [])]
    wanted = [cgroup for cgroup, name in joins if name in ("tasks", "cgroup.procs")]
    for process in processes:
        if uid is not None and process.uid() != uid:
            return f"process {process.pid} does not run as the kernel's uid"
        held = [p for p in process.cgroups() if p != "/"]
        if not all(any(d.endswith(p) for p in held) for d in wanted):
            return f"process {process.pid} is not in the kernel's cgroups"
    return None


class _Waiting:
    """A kernel forked into its sandbox's PID namespace before the sandbox was whole, waiting
    to be told its placeholder's pid (on the pipe the zygote writes to with ``tell``)."""

    def __init__(self, pid: int, tell: int) -> None:
        self.pid, self.tell = pid, tell
        self.pidfd = os.pidfd_open(pid)

    def go(self, placeholder: int) -> bool:
        """Tell the kernel its placeholder runs; False when the kernel has ended."""
        try:
            os.write(self.tell, str(placeholder).encode())
        except OSError:
            self.cancel()
            return False
        os.close(self.tell)
        return True

    def cancel(self) -> None:
        """The launch failed: end the kernel (it would also see its pipe close)."""
        _kill(self.pidfd)
        os.close(self.pidfd)
        os.close(self.tell)


class _Said:
    """What one forked process wrote to its stderr before it closed it, relayed to the
    zygote's stderr up to :attr:`LIMIT` bytes (a line it cut is ended with a newline)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self.left = self.LIMIT

    def relay(self, data: bytes) -> None:
        if self.left > 0:
            chunk = data[: self.left]
            self.left -= len(chunk)
            with contextlib.suppress(OSError):
                os.write(2, chunk if chunk.endswith(b"\n") else chunk + b"\n")


class _Pair:
    """The pidfds of a forked kernel and of its placeholder (None once it has ended)."""

    def __init__(self, kernel: int, placeholder: int) -> None:
        self.kernel: int = kernel
        self.placeholder: int | None = placeholder


def _fork(child: Callable[[], NoReturn], keep: tuple[int, ...] = ()) -> tuple[int, int]:
    """Fork ``child`` with nothing of this process's but ``keep``: its stdin and stdout on
    /dev/null, its stderr a pipe of its own (why it could not start, if so); its pid, and the
    pipe's end to read."""
    said, saying = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(said)
        os.close(saying)
        raise
    if pid == 0:
        spawning.own_descriptors(stderr=saying, keep=keep)
        child()
    os.close(saying)
    return pid, said


def _fork_through(
    request: dict[str, Any], template: KernelTemplate, sandbox: _Sandbox
) -> tuple[int, int]:
    """Fork the kernel from a child that joins ``sandbox`` (its PID namespace included) and
    ends once it has forked; the kernel's pid (its parent is then this process, a subreaper),
    and the end of its stderr to read (the joiner's, which it inherits)."""
    report, reporting = os.pipe()

    def join() -> NoReturn:
        try:
            _enter(request, sandbox, pid=True)
            kernel = os.fork()
            if kernel == 0:
                spawning.own_descriptors(stderr=2)  # not the report, nor the sandbox's
                _become_kernel(request, template)
            os.write(reporting, str(kernel).encode())
        except BaseException as exc:
            _say(f"kernel_env: a forked kernel could not join its sandbox: {exc}")
        finally:
            os._exit(0)

    try:
        joiner, said = _fork(join, keep=(reporting, *sandbox.descriptors))
    finally:
        os.close(reporting)
    with os.fdopen(report, "rb") as pipe:
        kernel = pipe.read()
    os.waitpid(joiner, 0)
    if not kernel:
        os.close(said)
        raise OSError("the kernel could not join its sandbox")
    return int(kernel), said


def _reap() -> None:
    """Collect the kernels that ended, and the orphans that came to the zygote (a subreaper):
    a sandbox's init whose launch was killed first, what an unsandboxed kernel left running."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _kill(pidfd: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _set_namespace(fd: int, kind: int = 0) -> None:
    if _libc.setns(fd, kind) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


class _Sandbox:
    """Descriptors of a sandbox's namespaces and root directory, opened from outside it (from
    its placeholder's /proc entry, while this process may still read it).

    bubblewrap nests a second user namespace inside the one that owns the sandbox's other
    namespaces (to forbid making more), so the joining order is: the outer user namespaces
    (only the outermost's owner, the kernel's uid, holds the capabilities joining needs), the
    mount, network, IPC, UTS (and PID) namespaces they own, and the innermost user namespace
    last."""

    def __init__(self, placeholder: int) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC
        # Everything from one process: a pid reused meanwhile fails the lookups instead.
        process = os.open(f"/proc/{placeholder}", flags | os.O_DIRECTORY)
        opened: list[int] = []  # closed again if the placeholder is gone half-way
        try:
            for name in (*_NAMESPACES, "pid"):
                opened.append(os.open(f"ns/{name}", flags, dir_fd=process))
            opened.append(os.open("root", flags | os.O_DIRECTORY, dir_fd=process))
            self.outer = _outer_user_namespaces(opened[0])
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        finally:
            os.close(process)
        self.inner, *self.others, self.pid, self.root = opened

    def holds_this_process(self) -> bool:
        """Whether this process is in the sandbox's PID namespace (a kernel forked into it)."""
        theirs, ours = os.fstat(self.pid), os.stat("/proc/self/ns/pid")
        return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)

    def join(self, *, pid: bool) -> None:
        """Join the namespaces (the PID namespace too, for this process's children, when
        ``pid``), then take the sandbox's root as this process's (the mount namespace's own
        root mount is detached under bubblewrap's pivot)."""
        for fd in [*self.outer, *self.others, *([self.pid] if pid else []), self.inner]:
            _set_namespace(fd)
        os.fchdir(self.root)
        os.chroot(".")

    @property
    def descriptors(self) -> tuple[int, ...]:
        return (*self.outer, *self.others, self.pid, self.inner, self.root)

    def close(self) -> None:
        for fd in self.descriptors:
            os.close(fd)


def _outer_user_namespaces(user_ns: int) -> list[int]:
    """The user namespaces between this process's and ``user_ns``, outermost first."""
    ours = os.stat("/proc/self/ns/user").st_ino
    outer: list[int] = []
    fd = user_ns
    while True:
        try:
            parent = fcntl.ioctl(fd, _NS_GET_PARENT)
        except OSError:  # the parent is outside what this process may see: ours or above
            break
        if os.fstat(parent).st_ino == ours:
            os.close(parent)
            break
        outer.insert(0, parent)
        fd = parent
    return outer


# -- the kernel ---------------------------------------------------------------------------------


def _kernel(
    request: dict[str, Any],
    template: KernelTemplate,
    sandbox: _Sandbox | None,
    *,
    tied_to: int | None,
) -> NoReturn:
    """A forked kernel's first steps, while it has one thread and the zygote's privileges:
    the kernel's cgroups, its uid, the sandbox's namespaces; then it becomes the kernel.
    ``tied_to``: the zygote, whose end ends this process. A sandboxed kernel ends with its
    sandbox instead, which ends with the spawner, which ends with the zygote."""
    try:
        _enter(request, sandbox, pid=False)  # in its PID namespace already: the fork put it there
        if tied_to is not None:
            _prctl(spawning.PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change
            if os.getppid() != tied_to:
                os._exit(1)  # the zygote died before the line above took effect
    except BaseException as exc:
        _say(f"kernel_env: a forked kernel could not start: {type(exc).__name__}: {exc}")
        os._exit(1)
    _become_kernel(request, template)


def _kernel_in_waiting(request: dict[str, Any], template: KernelTemplate, told: int) -> NoReturn:
    """A kernel forked into its sandbox's PID namespace while bubblewrap still makes the
    sandbox's mounts (see ``_Zygote._fork_early``). It joins its cgroups and takes its own
    process, then waits on ``told`` for the placeholder's pid: the sandbox is whole once the
    placeholder runs (an end of file means the launch failed). It then opens the sandbox's
    namespaces as root from the placeholder's /proc entry, takes its uid and joins them, as
    ``_kernel`` does."""
    try:
        spawning.join_cgroups(request.get("cgroup_join", []))
        _take_own_process(request, template)
        said = os.read(told, 64)
        if not said:
            os._exit(1)
        sandbox = _Sandbox(int(said))
        if not sandbox.holds_this_process():  # that pid is another process's now
            raise OSError("the placeholder is not in this kernel's sandbox")
        spawning.set_ids(request)
        sandbox.join(pid=False)
    except BaseException as exc:
        _say(f"kernel_env: a forked kernel could not join its sandbox: {type(exc).__name__}: {exc}")
        os._exit(1)
    _become_kernel(request, template, own=True)


def _enter(request: dict[str, Any], sandbox: _Sandbox | None, *, pid: bool) -> None:
    """Join the kernel's cgroups, take its uid, join ``sandbox`` (see ``_Sandbox.join``),
    while this process has one thread."""
    spawning.join_cgroups(request.get("cgroup_join", []))
    spawning.set_ids(request)
    if sandbox is not None:
        sandbox.join(pid=pid)


def _become_kernel(
    request: dict[str, Any], template: KernelTemplate, *, own: bool = False
) -> NoReturn:
    """The kernel's last steps before it runs (``own``: ``_take_own_process`` is done)."""
    try:
        if not own:
            _take_own_process(request, template)
        _drop_capabilities()
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if request.get("seccomp"):  # after the namespaces it joined, before anything of a cell
            seccomp.apply(request["seccomp"])
        spawning.set_rlimits(request)
        spawning.set_rlimits(request, "namespace_rlimits")  # in its sandbox's namespaces now
        os.chdir(request["cwd"])
        _fresh_descriptors()  # before it is dumpable: its sandbox could then take them
        _prctl(_PR_SET_DUMPABLE, 1)  # its own /proc/self, as a started kernel has
        template.run()
    except BaseException as exc:  # whatever it was, this process must not return
        _say(f"kernel_env: a forked kernel failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def _take_own_process(request: dict[str, Any], template: KernelTemplate) -> None:
    """What makes the kernel's process its own and needs nothing of its sandbox: its session
    and name, room for descriptors, its environment, random state, command line and the
    identities its connection file gives (``KernelTemplate.identify``)."""
    os.setsid()  # its own process group: ipykernel's interrupt signals the kernel's group
    spawning.set_name(KERNEL_NAME)
    grow_descriptor_table()
    os.environ.clear()
    os.environ.update(request["env"], PWD=request["cwd"])  # as the launch's shell exports
    tempfile.tempdir = None  # the zygote's is cached; the kernel's comes from its TMPDIR
    reseed(request.get("seed"))
    sys.argv = ["ipykernel_launcher", "-f", request["connection_file"]]
    template.identify(request["connection_file"])


def _say(message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())


def _drop_capabilities() -> None:
    """No capability left in any set: the bounding set (while CAP_SETPCAP allows it), the
    ambient set, then effective, permitted and inheritable."""
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            error = ctypes.get_errno()
            if error == errno.EINVAL:  # past the last capability this kernel knows
                break
            if error == errno.EPERM:  # none to drop: started without capabilities
                break
            raise OSError(error, f"dropping capability {cap}: {os.strerror(error)}")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if _libc.capset(header, data) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"capset: {os.strerror(error)}")


def _fresh_descriptors() -> None:
    """stdin, stdout and stderr on /dev/null (the kernel's output goes over iopub), and no
    other descriptor inherited from the zygote."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


if __name__ == "__main__":
    main()
