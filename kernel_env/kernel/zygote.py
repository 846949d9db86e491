"""The kernel forkserver's process: import what a kernel needs once, then fork fresh kernels.

Run by :class:`kernel_env.kernel.forkserver.ForkServer` as ``python -m kernel_env.kernel.zygote
FD CONFIG_JSON``, FD being its end of a socket pair and the config giving the operator's
preload list and the kernels' ipykernel flags. It imports ipykernel, IPython, zmq and
kernel_env's in-kernel module (and the preloads), builds the kernel every fork starts from
(:mod:`kernel_env.kernel.template`: the kernel object and its shell, no socket yet), checks
that no thread was started (forking a threaded process copies locks held by threads that do
not exist in the child), says ``ready`` and serves fork requests, one JSON line each.

Each request goes to a *keeper*, forked before the request came (the zygote keeps one spare:
its fork is then off the start's path), which:

1. joins the kernel's cgroups and launches what a cold kernel's launch command would, with a
   placeholder process (``sleep``) in the kernel's place (:func:`_launch`: the paths the
   kernel's uid cannot reach bound in a private mount namespace, the kernel's uid and
   rlimits, and for a sandboxed kernel bubblewrap), and reports the launch's pids to the
   zygote, which answers the request with them;
2. drops to the kernel's uid (when the server is root) and, for a sandboxed kernel, joins the
   sandbox's namespaces (``setns(2)``: user first, then mount, network, IPC, UTS and PID), so
   the kernel gets exactly the sandbox's filesystem view, no network, its own ``/proc`` and
   private ``/tmp``;
3. forks the kernel (the fork that lands it in the PID namespace), then watches both: when the
   kernel exits it kills the placeholder (the host sees the kernel end), and when the
   placeholder is killed (the host shuts the kernel down) it kills the kernel.

The kernel then drops every capability, sets no-new-privileges, applies its rlimits, closes
every inherited descriptor, takes its minimal environment, reseeds its random generators, and
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
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

from kernel_env.kernel import cgroups
from kernel_env.kernel.template import KernelTemplate, grow_descriptor_table, reseed

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
    "kernel_env.kernel_side",
)

# setns(2) order: the user namespace first (it grants the capabilities the others need), PID
# last (it applies to the children made after it).
_NAMESPACES = ("user", "mnt", "net", "ipc", "uts", "pid")

# The processes' names (``ps -o comm``, /proc/<pid>/comm): a forked kernel keeps the zygote's
# command line, so the name is what tells them apart.
KERNEL_NAME = "ke-kernel"
KEEPER_NAME = "ke-keeper"

_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_PR_SET_NAME = 15
_NS_GET_PARENT = 0xB702  # ioctl_ns(2): _IO(0xb7, 0x2)
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    started_with = dict(os.environ)
    if sys.path and sys.path[0] == os.getcwd():
        del sys.path[0]  # what ``-m`` added, as ipykernel_launcher does: kernels add their own
    control = socket.socket(fileno=int(sys.argv[1]))
    config = json.loads(sys.argv[2])
    problem = _preload([*KERNEL_MODULES, *config["preload"]])
    if problem is None and (threads := len(os.listdir("/proc/self/task"))) > 1:
        problem = f"the preloaded modules started {threads - 1} thread(s): forking is unsafe"
    template = None
    if problem is None:
        template, problem = _build_template(config["flags"])
    # What importing and building set in the environment (ipykernel's debugger, the shell's
    # TERM and PAGER): a kernel started cold sets the same in its own.
    imported = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    control.sendall((json.dumps({"ready": problem is None, "problem": problem}) + "\n").encode())
    if template is None:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the system
    lines = control.makefile("rb")
    # Each request goes to a keeper forked before it came (Android's zygote keeps such
    # unspecialized processes too): the fork and the keeper's own start are off the path.
    spare = _fork_keeper(template, imported, owned=(lines, control))
    for line in lines:
        keeper = spare
        keeper.give(line)
        spare = _fork_keeper(template, imported, owned=(lines, control), others=keeper.report)
        with os.fdopen(keeper.report, "rb") as reports:  # the launch's pids, once it is up
            launched = json.loads(reports.readline() or b'{"error": "the keeper exited"}')
        control.sendall((json.dumps({"pid": keeper.pid, **launched}) + "\n").encode())


class _Spare:
    """In the zygote: a keeper forked ahead, waiting for its request."""

    def __init__(self, pid: int, request: int, report: int) -> None:
        self.pid, self.request, self.report = pid, request, report

    def give(self, line: bytes) -> None:
        """Hand the keeper its request. A keeper that died takes none: its report then ends
        with nothing, and that kernel starts cold."""
        try:
            rest = memoryview(line)
            while rest:
                rest = rest[os.write(self.request, rest) :]
        except OSError:
            pass
        finally:
            os.close(self.request)


def _fork_keeper(
    template: KernelTemplate, imported: dict[str, str], *, owned: tuple[Any, ...], others: int = -1
) -> _Spare:
    """Fork a keeper that waits for a request, then serves it (:func:`_keeper`). ``owned``:
    the zygote's files and sockets, and ``others`` another keeper's report pipe, which the
    keeper closes."""
    request_end, request = os.pipe()
    report, report_end = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        for owner in owned:
            owner.close()
        for fd in (request, report, others):
            if fd >= 0:
                os.close(fd)
        _serve_one(zygote, request_end, report_end, template, imported)  # never returns
    os.close(request_end)
    os.close(report_end)
    return _Spare(pid, request, report)


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


# -- the keeper: joins the sandbox, forks the kernel, ties the two lifetimes together ---------


def _serve_one(
    zygote: int, request_end: int, report: int, template: KernelTemplate, imported: dict[str, str]
) -> None:
    """A keeper, until its request comes: tied to the zygote, then waiting on ``request_end``
    (end of file: the zygote ended, with no request for it)."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote gone: nothing to keep
        _name(KEEPER_NAME)
        if os.getppid() != zygote:
            os._exit(1)
        with os.fdopen(request_end, "rb") as requests:
            line = requests.read()
        if not line:
            os._exit(0)
        request = json.loads(line)
        request["env"] = request["env"] | imported
    except BaseException as exc:
        _say(f"kernel_env: a forkserver keeper failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    _keeper(request, template, report, zygote)


def _keeper(request: dict[str, Any], template: KernelTemplate, report: int, zygote: int) -> None:
    status = 1
    try:
        cgroups.join(request.get("cgroup_join", []))
        try:
            launched = _launch(request)
        except BaseException as exc:
            _tell(report, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        _tell(report, launched)
        placeholder = os.pidfd_open(launched["placeholder"])
        namespaces = _open_namespaces(launched["placeholder"] if launched["init"] else None)
        if request.get("uid") is not None:
            os.setgroups([])
            os.setresgid(request["gid"], request["gid"], request["gid"])
            os.setresuid(request["uid"], request["uid"], request["uid"])
        if namespaces:
            _join(namespaces)
        # A change of uid or user namespace cleared the request above: without it the keeper,
        # and the launch it holds, would outlive a server killed with SIGKILL.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != zygote:
            raise ProcessLookupError("the forkserver ended while the kernel started")
        # The kernel's view of its keeper: outside its PID namespace (0), or this pid.
        keeper = 0 if namespaces else os.getpid()
        kernel = os.fork()
        if kernel == 0:
            os.close(placeholder)
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # its keeper gone (killed with the server)
            if os.getppid() != keeper:
                os._exit(1)  # the keeper died before the line above took effect
            _become_kernel(request, template)  # never returns
        status = _watch(kernel, placeholder)
    except BaseException as exc:  # said on the zygote's stderr (the server's log)
        _say(f"kernel_env: the forkserver could not start a kernel: {type(exc).__name__}: {exc}")
    finally:
        os._exit(status)


def _tell(report: int, what: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(report, (json.dumps(what) + "\n").encode())
    with contextlib.suppress(OSError):
        os.close(report)


# -- the launch: what a cold kernel's launch command does, without a process per step ---------


def _launch(request: dict[str, Any]) -> dict[str, Any]:
    """Start the placeholder as a cold kernel's launch would start the kernel: in this
    process's cgroups (joined already), with the staged paths bound in a private mount
    namespace, as the kernel's uid, with its rlimits, through its sandbox when ``argv`` is
    bubblewrap's. Its pids once it runs: ``launcher`` (the process the host ends to end the
    kernel), ``init`` (the sandbox's, or None) and ``placeholder``."""
    if request.get("staged"):
        _bind_staged(request["staged"])
    me = os.getpid()
    failed, failing = os.pipe()  # close-on-exec: end of file once the exec succeeded
    launcher = os.fork()
    if launcher == 0:
        os.close(failed)
        try:
            os.chdir(request["cwd"])  # first: the kernel's uid may not traverse the way there
            if request.get("uid") is not None:
                os.setgroups([])
                os.setresgid(request["gid"], request["gid"], request["gid"])
                os.setresuid(request["uid"], request["uid"], request["uid"])
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
            if os.getppid() != me:
                os._exit(1)
            for name, value in request.get("rlimits", {}).items():
                limit = getattr(resource, name)
                resource.setrlimit(limit, (value, value))
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
        os.waitpid(launcher, 0)
        raise OSError(f"the launch could not run: {why}")
    if not request.get("sandboxed"):
        return {"launcher": launcher, "init": None, "placeholder": launcher}
    init, placeholder = _sandbox_pids(launcher)
    return {"launcher": launcher, "init": init, "placeholder": placeholder}


def _bind_staged(staged: list[list[str]]) -> None:
    """Bind each ``(host path, mount point)`` in a private mount namespace of this process
    (and so of the launch), as root: what the kernel's uid cannot reach otherwise."""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare: {os.strerror(error)}")
    _mount(None, "/", _MS_REC | _MS_PRIVATE)
    for source, target in staged:
        _mount(source, target, _MS_BIND)


def _mount(source: str | None, target: str, flags: int) -> None:
    encoded = source.encode() if source is not None else None
    if _libc.mount(encoded, target.encode(), None, flags, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source} on {target}: {os.strerror(error)}")


def _sandbox_pids(launcher: int, timeout: float = 8.0) -> tuple[int, int]:
    """bubblewrap's init (the launcher's child) and the command it runs once the sandbox is
    complete (the init's child, once it has exec'd). The zygote waits on this, and the host on
    the zygote for 10 s: past ``timeout`` the kernel starts cold instead."""
    deadline = time.monotonic() + timeout
    init = None
    while time.monotonic() < deadline:
        if os.waitpid(launcher, os.WNOHANG)[0]:
            raise OSError(f"the sandbox exited at launch (pid {launcher})")
        with contextlib.suppress(OSError, ValueError):
            if init is None:
                init = next(iter(_children(launcher, "bwrap")), None)
            if init is not None:
                command = next(iter(_children(init, None)), None)
                if command is not None:
                    return init, command
        time.sleep(0.001)
    raise OSError("the sandbox did not start its command in time")


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


def _open_namespaces(pid: int | None) -> list[int]:
    """Descriptors of ``pid``'s namespaces in the order to join them, then of its root
    directory; opened while this process may still read them.

    bubblewrap nests a second user namespace inside the one that owns the sandbox's other
    namespaces (to forbid making more), so the order is: the outer user namespaces (only the
    outermost's owner, this uid, holds the capabilities joining needs), the mount, network,
    IPC, UTS and PID namespaces they own, and the innermost user namespace last."""
    if pid is None:
        return []
    flags = os.O_RDONLY | os.O_CLOEXEC
    fds = {name: os.open(f"/proc/{pid}/ns/{name}", flags) for name in _NAMESPACES}
    root = os.open(f"/proc/{pid}/root", flags | os.O_DIRECTORY)
    others = [fds[name] for name in _NAMESPACES if name != "user"]
    return [*_outer_user_namespaces(fds["user"]), *others, fds["user"], root]


def _join(fds: list[int]) -> None:
    """Join the namespaces ``_open_namespaces`` opened, then take the sandbox's root as this
    process's (the mount namespace's own root mount is detached under bubblewrap's pivot)."""
    *namespaces, root = fds
    for fd in namespaces:
        if _libc.setns(fd, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns: {os.strerror(error)}")
        os.close(fd)
    os.fchdir(root)
    os.chroot(".")
    os.close(root)


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


def _watch(kernel: int, placeholder: int) -> int:
    """Wait for the kernel or the placeholder to end, then end the other (the launch, this
    process's child, is reaped by init once this process exits)."""
    kernel_fd = os.pidfd_open(kernel)
    readable, _, _ = select.select([kernel_fd, placeholder], [], [])
    other = placeholder if kernel_fd in readable else kernel_fd
    # A shutdown often ends both at once: the other one may be gone already.
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(other, signal.SIGKILL)
    os.waitpid(kernel, 0)
    return 0


def _prctl(option: int, arg: int) -> int:
    result = int(_libc.prctl(option, arg, 0, 0, 0))
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}): {os.strerror(error)}")
    return result


# -- the kernel ---------------------------------------------------------------------------------


def _become_kernel(request: dict[str, Any], template: KernelTemplate) -> None:
    try:
        os.setsid()  # its own process group: ipykernel's interrupt signals the kernel's group
        _name(KERNEL_NAME)
        _drop_capabilities()
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _prctl(_PR_SET_DUMPABLE, 1)  # its own /proc/self, as a started kernel has
        for name, value in request.get("rlimits", {}).items():
            limit = getattr(resource, name)
            resource.setrlimit(limit, (value, value))
        os.chdir(request["cwd"])
        _fresh_descriptors()
        grow_descriptor_table()
        os.environ.clear()
        os.environ.update(request["env"], PWD=request["cwd"])  # as the launch's shell exports
        reseed(request.get("seed"))
        sys.argv = ["ipykernel_launcher", "-f", request["connection_file"]]
        template.run(request["connection_file"])
    except BaseException as exc:  # whatever it was, this process must not return
        _say(f"kernel_env: a forked kernel failed: {type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def _name(name: str) -> None:
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0)


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
    other descriptor inherited from the zygote or the keeper."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


if __name__ == "__main__":
    main()
