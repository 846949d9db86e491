"""A kernel on this host, started and driven through ``jupyter_client``'s async API.

It runs on IPC transport in a private runtime dir (mode 0700), so no other local process can
reach its sockets the way any same-uid process can reach a TCP kernel's; and it gets an explicit,
minimal environment: never the server's ``os.environ``, where tokens live.

Started by root, it runs as a uid of its own (:mod:`kernel_env.kernel.privilege`) where that
uid can reach the interpreter, in a cgroup that lets closing it kill every process it started
(:mod:`kernel_env.kernel.cgroups`). Without the sandbox it still shares the host's filesystem,
processes and network: see docs/security.md.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec
from jupyter_client.provisioning import KernelProvisionerBase
from jupyter_client.session import Session

from kernel_env.errors import KernelError, KernelStartError, LiveForkUnavailable
from kernel_env.kernel import privilege
from kernel_env.kernel.base import Kernel
from kernel_env.kernel.cgroups import KernelCgroup
from kernel_env.kernel.forkserver import ForkServer, ForkServerError
from kernel_env.kernel.messages import HostSession
from kernel_env.kernel.runtime import runtime_parent, write_file

__all__ = [
    "LocalKernel",
    "describe_isolation",
    "forked_kernel_flags",
    "kernel_argv",
    "launch_guard",
    "minimal_environ",
    "placeholder_argv",
]

log = logging.getLogger(__name__)

_RECV_REARM = 0.25  # seconds; see LocalKernel._drain
_CHANNELS = {"shell": zmq.DEALER, "iopub": zmq.SUB, "stdin": zmq.DEALER}  # and socket types
_DRAIN_BATCH = 64  # messages read from a channel in one turn of the event loop

# A unix socket path holds at most 107 bytes on Linux. jupyter_client names the IPC sockets
# "<ip>-<n>", n = 1..5 in a fresh dir; allow two digits.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = "-99"

# Settings measured to matter: no ANSI colours in tracebacks (the model reads them), no
# history database (an sqlite file per kernel, and a lock shared between kernels).
_KERNEL_FLAGS = (
    "--ext=kernel_env.kernel_side",
    "--colors=nocolor",
    "--HistoryManager.enabled=False",
)


def kernel_argv(python: str = sys.executable) -> list[str]:
    """The command line of an episode kernel (``{connection_file}`` filled in at launch)."""
    return [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", *_KERNEL_FLAGS]


def forked_kernel_flags() -> list[str]:
    """The flags of a kernel forked from the forkserver (the zygote watches it, not
    ipykernel's parent poller); the zygote builds the kernel with them once."""
    return [*_KERNEL_FLAGS, "--IPKernelApp.parent_handle=1"]


def placeholder_argv() -> list[str]:
    """The process a forked kernel's launch runs in its place: it holds the launch's uid,
    cgroups and sandbox until the kernel joins them, and lives exactly as long as the kernel."""
    return [_program("sleep"), "infinity"]


@functools.cache
def _ipykernel_welcomes() -> bool:
    """Whether this environment's ipykernel welcomes each iopub subscriber (7 and later)."""
    try:
        return int(importlib.metadata.version("ipykernel").split(".")[0]) >= 7
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


@functools.cache
def _program(name: str) -> str:
    """Where ``name`` is on this process's PATH (looked up once: every launch runs it)."""
    return shutil.which(name) or f"/bin/{name}"


def minimal_environ(home: str, python: str = sys.executable) -> dict[str, str]:
    """The whole environment an episode kernel gets: nothing inherited, nothing secret."""
    bin_dir = str(Path(python).parent)
    return {
        "PATH": os.pathsep.join([bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


_EXIT_POLL = 0.005  # seconds between checks that a killed kernel has exited
SECCOMP_FD = 9  # where a cold launch's command finds its seccomp program (see launch_guard)

# The host's sockets may connect before the kernel binds its own; zmq then retries every
# 100 ms by default, which a forked kernel (ready in tens of ms) would wait out. No backing
# off either: a kernel that binds late under load was reached only at the next doubled
# interval. (Trying a unix socket path costs one failed connect(2); a dead kernel's sockets
# are closed by its restart or shutdown.) Set on each socket: a context's defaults reach only
# the sockets made through that very context object, not through a shadow of it.
_HOST_SOCKET_OPTIONS = {zmq.RECONNECT_IVL: 5, zmq.RECONNECT_IVL_MAX: 0}

_shared_context: tuple[int, zmq.asyncio.Context] | None = None  # (the pid that made it, it)


def _host_context() -> zmq.asyncio.Context:
    """The zmq context of every local kernel's host sockets in this process.

    jupyter_client gives each kernel manager a context of its own: two threads (zmq's I/O
    thread and its reaper) started and joined for every kernel, ~1.7 ms of a server's CPU per
    episode. Kernels' sockets are closed one by one instead (``LocalKernel._stop_client``).
    A process forked from this one (never the server itself) makes its own."""
    global _shared_context
    if _shared_context is None or _shared_context[0] != os.getpid():
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))  # not 1023
        for option, value in _HOST_SOCKET_OPTIONS.items():  # for the sockets it makes
            context.setsockopt(option, value)
        _shared_context = (os.getpid(), context)
    return _shared_context[1]


class _KernelManager(AsyncKernelManager):
    """A kernel manager given its kernelspec before each launch (cold, forked or a copy's),
    never whatever ``python3`` resolves to: it has no kernel name to look one up by."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(kernel_name="", **kwargs)

    def _connect_control_socket(self) -> None:
        # An interrupt goes over this socket (for message-mode kernels); to a kernel already
        # dead the message would wait here, and jupyter_client's 100 ms linger delivered it to
        # the kernel a restart binds at the same address: its first cell was interrupted.
        # Closing now drops what is undelivered.
        super()._connect_control_socket()
        if self._control_socket is not None:
            self._control_socket.linger = 0

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        # Nothing of the server's: jupyter_client's kernel inherits its stdout and stderr (the
        # server's log), which a cell could write to, or take from the sandbox's init.
        null = subprocess.DEVNULL
        await super()._async_launch_kernel(kernel_cmd, **kw, stdin=null, stdout=null, stderr=null)

    async def _async_post_start_kernel(self, **kw: Any) -> None:
        # jupyter_client's, without connecting the control socket: an interrupt or a
        # shutdown request connects it when it needs it, and most kernels never do.
        self.start_restarter()
        assert self.provisioner is not None
        await self.provisioner.post_launch(**kw)

    async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:  # type: ignore[override]
        """A kill (``now``) without the interrupt jupyter_client sends first. The kill takes
        the kernel's whole sandbox, and its cgroup and uid are emptied after, so the interrupt
        bought nothing but work: a control socket here, and a message the kernel woke to
        handle a moment before its SIGKILL."""
        if not now or not self.owns_kernel:
            await super().shutdown_kernel(now=now, restart=restart)
            return
        self.shutting_down = True  # jupyter_client's restarter checks this
        self.stop_restarter()
        await self._async_kill_kernel(restart=restart)
        await self._async_cleanup_resources(restart=restart)

    async def _async_wait(self, pollinterval: float = 0.1) -> None:
        # After a kill, jupyter_client checks every 100 ms whether the kernel is gone: every
        # shutdown and restart waited ~100 ms for a process that ends within a few.
        await super()._async_wait(pollinterval=min(pollinterval, _EXIT_POLL))


class _PidfdProcess(KernelProvisionerBase):
    """jupyter_client's handle on a kernel process this one did not start as its child,
    watched and ended through a pidfd: a forkserver launch (its spawner started it) or a live
    fork's copy (the parent kernel forked it)."""

    pid: int | None = None
    _pidfd: int | None = None

    def _hold(self, pid: int) -> None:
        self.pid, self._pidfd = pid, os.pidfd_open(pid)

    @property
    def has_process(self) -> bool:
        return self._pidfd is not None

    async def poll(self) -> int | None:
        if self._pidfd is None:
            return 0
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return 0 if readable else None

    async def wait(self) -> int | None:
        while await self.poll() is None:
            await asyncio.sleep(_EXIT_POLL)
        return 0

    async def send_signal(self, signum: int) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    async def kill(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        # The manager takes a command line from here; the launch needs none.
        return await super().pre_launch(cmd=[], **kwargs)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        raise RuntimeError(f"{type(self).__name__} does not launch kernels")

    async def cleanup(self, restart: bool = False) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)


class _CopyProcess(_PidfdProcess):
    """A live fork's copy, adopted. A restart starts a kernel the usual way (the manager
    makes its usual provisioner)."""

    def __init__(self, pid: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hold(pid)


class _ForkedLaunch(_PidfdProcess):
    """A kernel the forkserver launches and forks (:mod:`kernel_env.kernel.zygote`); the
    process held is the launch (bubblewrap, or the placeholder), which the kernel ends with."""

    def __init__(self, launch: Callable[[], Awaitable[dict[str, Any]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._launch = launch
        self.sandbox_init: int | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        launched = await self._launch()
        self._hold(launched["launcher"])
        self.sandbox_init = launched["init"]
        assert self.parent is not None
        return self.parent.get_connection_info()


class LocalKernel(Kernel):
    """An ipykernel process on this host, over IPC in a private runtime dir."""

    _manager_class = _KernelManager

    def __init__(
        self,
        *,
        python: str = sys.executable,
        argv: Sequence[str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        runtime_root: str | None = None,
        forkserver: ForkServer | None = None,
        **kwargs: Any,
    ) -> None:
        """``forkserver``: fork the kernel from this preloaded process instead of starting
        a new interpreter (when it runs the same ``python`` and no custom ``argv`` is given;
        kernels start cold while it is not ready)."""
        super().__init__(**kwargs)
        self.kernel_id = uuid.uuid4().hex[:12]
        self._argv = list(argv) if argv is not None else kernel_argv(python)
        self._python = python
        self._extra_env = dict(extra_env or {})
        self._runtime_root = runtime_root
        self._dir: Path | None = None
        self._km: _KernelManager | None = None
        self._session: Session  # the client's, made with its sockets: see _start_client
        self._channels: list[zmq.Socket[bytes]] = []  # its sockets, until _stop_client
        self._sockets: dict[str, zmq.Socket[bytes]] = {}  # those read, by channel: see _drain
        self._rearm: asyncio.TimerHandle | None = None
        self._draining: set[str] = set()  # channels with a next turn of _drain scheduled
        self._lease: privilege.UidLease | None = None
        self._cgroup: KernelCgroup | None = None
        self._forkserver = forkserver if argv is None else None
        # Its own command line loads kernel_env's extension, which makes stdin wait for us.
        self._stdin_waits_for_the_host = argv is None
        # Its ipykernel is this environment's (forked, or started with this interpreter).
        self._welcomes_subscribers = (
            argv is None and python == sys.executable and _ipykernel_welcomes()
        )
        self.quiet_iopub = argv is None  # an episode kernel: kernel_env's extension is loaded
        self.forked = False  # whether the running kernel came from the forkserver
        self.forked_pid: int | None = None  # the forked kernel's own process (a host pid)
        self.copied = False  # whether the running kernel is a live fork's copy of another
        self._options = dict(
            python=python, argv=argv, extra_env=extra_env, runtime_root=runtime_root,
            forkserver=forkserver, **kwargs,
        )  # fmt: skip

    @property
    def runtime_dir(self) -> Path | None:
        """The kernel's private directory (connection file, sockets, working directory)."""
        return self._dir

    @property
    def workdir(self) -> Path:
        if self._dir is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        return self._dir / "work"

    @property
    def pid(self) -> int | None:
        """The process the host holds: the kernel, or the launch it runs under (a sandbox's
        bubblewrap, a forked kernel's placeholder)."""
        provisioner = self._km.provisioner if self._km else None
        return getattr(provisioner, "pid", None)

    def _kernel_spec(self) -> KernelSpec:
        # A forked kernel is interrupted through its control channel: a signal would reach
        # the placeholder process instead.
        forked = self.forked or self.copied
        return KernelSpec(
            argv=[] if forked else self._command(),  # a forked kernel's launch is the spawner's
            language="python",
            display_name="kernel_env",
            interrupt_mode="message" if forked else "signal",
        )

    def _command(self) -> list[str]:
        """The command that launches the kernel cold (a sandbox wraps it)."""
        joins = self._cgroup_joins()
        if not joins and self._lease is None:
            return list(self._argv)
        return [*launch_guard(joins), *self._drop(), *self._argv]

    def _environ(self) -> dict[str, str]:
        return minimal_environ(str(self.workdir), self._python)

    def _drop(self) -> list[str]:
        lease = self._lease
        return privilege.drop_command(lease.uid, lease.gid) if lease is not None else []

    def _cgroup_joins(self) -> list[Path]:
        return self._cgroup.join_files if self._cgroup is not None else []

    def _lease_uid(self) -> privilege.UidLease | None:
        """A uid of the kernel's own when this process is root (None otherwise, or when such
        a uid could not reach the interpreter: then the kernel runs as root, said once)."""
        if not privilege.privileged():
            return None
        parent = runtime_parent(self._runtime_root).path
        if not _reachable_by_kernel_uid(self._python, str(parent)):
            return None
        return privilege.lease_uid()

    def _make_cgroup(self) -> KernelCgroup:
        # No limits: the cgroup lets closing the kernel find every process it started.
        return KernelCgroup(self.kernel_id, memory_bytes=None, processes=None, cpus=None)

    def _prepare_dirs(self) -> None:
        """The working directory, and (as its own uid) a directory for its sockets."""
        self.workdir.mkdir()
        if self._lease is not None:
            ipc = self.workdir.parent / "ipc"
            ipc.mkdir(mode=0o700)
            for path in (self.workdir, ipc):
                os.chown(path, self._lease.uid, self._lease.gid)
                os.chmod(path, 0o700)

    def _ipc_prefix(self) -> str:
        """Where the kernel binds its sockets (jupyter_client appends "-<n>")."""
        assert self._dir is not None
        return str(self._dir / ("ipc" if self._lease is not None else "") / "kernel-ipc")

    # -- transport hooks ------------------------------------------------------------------

    async def _launch(self) -> None:
        await self._prepare()
        try:
            await self._start_process()
        except Exception as exc:
            raise KernelStartError(
                f"kernel failed to launch: {exc}", kernel_id=self.kernel_id
            ) from exc
        self._start_client()

    async def _prepare(self) -> None:
        """Everything a kernel process needs before it runs: its uid, directories, cgroup,
        manager and connection file."""
        self._lease = await asyncio.to_thread(self._lease_uid)
        gid = self._lease.gid if self._lease is not None else None
        parent = runtime_parent(self._runtime_root)
        # Mode 0700 (0750 with the kernel's own group: it reads its connection file and
        # staged files, and writes nothing there).
        self._dir = parent.make_kernel_dir(self.kernel_id, gid)
        _check_socket_path(self._ipc_prefix(), self.kernel_id)
        self._prepare_dirs()
        self._cgroup = self._make_cgroup()
        self._km = self._manager_class(
            transport="ipc",
            ip=self._ipc_prefix(),
            connection_file=str(self._dir / "kernel.json"),
            context=_host_context(),
            session=HostSession(),  # the first client's too (see _start_client)
        )
        self._km.write_connection_file()
        if gid is not None:
            os.chown(self._km.connection_file, -1, gid)
            os.chmod(self._km.connection_file, 0o640)

    async def _start_process(self) -> None:
        """Launch the kernel: forked by the forkserver, or cold. A fork that fails starts
        this kernel cold (and the forkserver says why, when it stopped)."""
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        if self._forkserver is not None:
            await self._forkserver.start()
        self.forked = self._forkserver is not None and self._forkserver.ready
        if not self.forked:
            await self._start_cold()
            return
        km._kernel_spec = self._kernel_spec()
        km.provisioner = _ForkedLaunch(self._fork, parent=km, kernel_spec=km._kernel_spec)
        try:
            await km.start_kernel(env=self._launch_env(), cwd=str(self.workdir))
        except (ForkServerError, OSError) as exc:
            log.warning("kernel %s: fork failed (%s); starting it cold", self.kernel_id, exc)
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True, restart=True)  # keeps the connection file
            self.forked = False
            await self._start_cold()

    async def _start_cold(self) -> None:
        km = self._km
        assert km is not None
        km.provisioner = None  # the manager makes its usual one
        km._kernel_spec = self._kernel_spec()
        await km.start_kernel(env=self._launch_env(), cwd=str(self.workdir))

    async def _fork(self) -> dict[str, Any]:
        """Ask the forkserver to launch this kernel's placeholder and fork the kernel into it."""
        km, forkserver = self._km, self._forkserver
        if km is None or forkserver is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        launched = await forkserver.fork(
            {
                **self._launch_spec(),
                "cgroup_join": [str(p) for p in self._cgroup_joins()],
                "uid": self._lease.uid if self._lease is not None else None,
                "gid": self._lease.gid if self._lease is not None else None,
                "connection_file": km.connection_file,
                "env": self._launch_env(),
                "cwd": str(self.workdir),
                "rlimits": self._rlimits(),
            }
        )
        self.forked_pid = launched["pid"]
        return launched

    def _launch_spec(self) -> dict[str, Any]:
        """What the forkserver's spawner runs in the kernel's place (see ``spawner.launch``)."""
        return {"launch": placeholder_argv(), "sandboxed": False, "staged": []}

    def _rlimits(self) -> dict[str, int]:
        """Per-process limits a forked kernel sets on itself (``resource`` names)."""
        return {}

    def _launch_env(self) -> dict[str, str]:
        return self._environ() | self._extra_env

    async def _relaunch(self) -> None:
        await self._stop_client()
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        await km.shutdown_kernel(now=True, restart=True)
        await asyncio.to_thread(self._kill_leftovers)
        self.copied = False  # a copy's state is gone: a kernel starts the usual way
        await self._start_process()
        self._start_client()

    # -- live fork ------------------------------------------------------------------------

    def _live_fork_problem(self) -> str | None:
        """Why this kernel cannot be copied live, or None."""
        if self._km is None or not self.started:
            return "the kernel is not running"
        if self._lease is not None:
            return (
                "the kernel runs as a uid of its own, which its copies would share "
                "(kernel_env gives every kernel its own)"
            )
        return None

    async def live_fork(self, n: int, *, reseed: bool = True) -> list[Kernel]:
        """``n`` copies of this kernel's process (see :mod:`kernel_env.kernel.livefork`),
        each with its own runtime dir, a copy of the working directory, its own cgroup and
        connection file, started and ready."""
        problem = self._live_fork_problem()
        if problem is not None:
            raise LiveForkUnavailable(f"no live fork: {problem}", kernel_id=self.kernel_id)
        copies = [type(self)(**self._options) for _ in range(n)]
        try:
            await asyncio.gather(*(copy._prepare_copy(self) for copy in copies))
            requests = [copy._copy_request(self, reseed) for copy in copies]
            pids = await self._fork_copies(requests)
            adopting = zip(copies, pids, strict=True)
            await asyncio.gather(*(copy._adopt(pid, reseed) for copy, pid in adopting))
        except BaseException:
            await asyncio.shield(asyncio.gather(*(c.shutdown() for c in copies)))
            raise
        return list(copies)

    async def _fork_copies(self, requests: list[dict[str, Any]]) -> list[int]:
        """Ask the kernel to fork itself (a silent execute); the copies' pids."""
        expression = (
            "__import__('kernel_env.kernel.livefork', fromlist=['_']).fork_copies("
            f"__import__('json').loads({json.dumps(json.dumps(requests))}))"
        )
        result = await self.execute("", user_expressions={"pids": expression}, silent=True)
        reply = result.user_expressions.get("pids") or {}
        if reply.get("status") != "ok":
            why = f"{reply.get('ename', result.status)}: {reply.get('evalue', '')}"
            raise LiveForkUnavailable(f"no live fork: {why}", kernel_id=self.kernel_id)
        pids = ast.literal_eval(reply["data"]["text/plain"])
        return [int(pid) for pid in pids]

    async def _prepare_copy(self, parent: LocalKernel) -> None:
        """A new kernel's directories, cgroup and connection file, and a copy of the
        parent's working directory (its files: the copy's own from now on)."""
        self._reset_queues()
        await self._prepare()
        await asyncio.to_thread(
            shutil.copytree, parent.workdir, self.workdir, symlinks=True, dirs_exist_ok=True
        )

    def _copy_request(self, parent: LocalKernel, reseed: bool) -> dict[str, Any]:
        assert self._km is not None
        return {
            "connection_file": self._km.connection_file,
            "cwd": str(self.workdir),
            "parent_cwd": str(parent.workdir),
            "env": self._launch_env(),
            "server_pid": os.getpid(),
            "reseed": reseed,
            "cgroup_join": [str(p) for p in self._cgroup_joins()],
        }

    async def _adopt(self, pid: int, reseed: bool) -> None:
        """Take the copy's process as this kernel's, then wait until it is ready (with the
        parent's random state, unless ``reseed``)."""
        km = self._km
        assert km is not None
        self.copied = True
        km._kernel_spec = self._kernel_spec()
        km.provisioner = _CopyProcess(pid, parent=km, kernel_spec=km._kernel_spec)
        km._attempted_start = True  # as if started here (its shutdown and restart expect it)
        self._start_client()
        await self._wait_ready()
        if not reseed:
            restore = "__import__('kernel_env.kernel.livefork', fromlist=['_']).restore_random()"
            await self.execute(restore, silent=True, store_history=False)
        self.started = True

    def _kill_leftovers(self) -> None:
        """Whatever the last kernel process started and left running."""
        if self._cgroup is not None:
            self._cgroup.kill()
        if self._lease is not None:
            privilege.kill_uid(self._lease.uid)

    async def _terminate(self) -> None:
        await self._stop_client()
        km, self._km = self._km, None
        if km is not None:
            try:
                await km.shutdown_kernel(now=True)
            except Exception as exc:  # already dead is fine: we only want it gone
                log.debug("kernel %s: shutdown: %r", self.kernel_id, exc)
                await _kill_process(km)
            await km.cleanup_resources()  # closes its control socket, if it made one
        cgroup, self._cgroup = self._cgroup, None
        lease, self._lease = self._lease, None
        emptied = cgroup is not None and await asyncio.to_thread(cgroup.remove)
        if lease is not None:
            # Every process of a kernel runs in its cgroup, and only a kernel runs as its uid:
            # with the cgroup empty, nothing does; otherwise the uid's processes are killed.
            await asyncio.to_thread(lease.release, emptied=emptied)
        if cgroup is not None and cgroup.paths:  # what held it may be gone with the uid's
            await asyncio.to_thread(cgroup.remove)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _send(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        parent: dict | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        sock = self._sockets.get(channel)
        if sock is None:  # the channels failed (see _drain) or were closed
            raise KernelError(f"the kernel's {channel} channel is closed", kernel_id=self.kernel_id)
        msg = self._session.msg(msg_type, content, parent=parent, metadata=metadata)
        self._session.send(sock, msg)
        self._drain(channel)  # what arrived before the send, whose signal the send may take
        return str(msg["header"]["msg_id"])

    async def is_alive(self) -> bool:
        return self._km is not None and await self._km.is_alive()

    async def interrupt(self) -> None:
        if self._km is not None:
            await self._km.interrupt_kernel()

    async def stage_file(self, name: str, data: bytes) -> str:
        # In the runtime dir, which the kernel can read but not write: a file or link it
        # plants there cannot redirect this write (nor a re-stage after a restart).
        if self._dir is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        gid = self._lease.gid if self._lease is not None else None
        path = await asyncio.to_thread(write_file, self._dir, name, data, gid=gid)
        return str(path)

    # -- channels -------------------------------------------------------------------------

    def _start_client(self) -> None:
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        # The manager's session (it wrote the key) serves the first client; every later one
        # (after a restart) gets a new session: a new socket identity and fresh msg ids.
        # Reusing one client's session for the next repeated both, and a reply was now and
        # then lost.
        session: Session = km.session
        if session is getattr(self, "_session", None) or not isinstance(session, HostSession):
            session = HostSession(key=session.key, signature_scheme=session.signature_scheme)
        self._session = session
        # One blocking socket per channel, on the manager's zmq context, read through the event
        # loop's own readers (see _drain). jupyter_client's asyncio client made channel objects
        # and asyncio sockets for every kernel, and its recv registered and dropped each
        # socket's descriptor with the loop for every message (an eighth of a busy server's
        # CPU); its Session.send made a new shadow socket for every message.
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(km.context.underlying)
        loop = asyncio.get_running_loop()
        for name, kind in _CHANNELS.items():
            sock = context.socket(kind)
            sock.linger = 0
            for option, value in _HOST_SOCKET_OPTIONS.items():
                sock.setsockopt(option, value)
            sock.identity = self._session.bsession
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"{km.transport}://{km.ip}-{getattr(km, f'{name}_port')}")
            self._channels.append(sock)
            self._sockets[name] = sock
            loop.add_reader(sock.FD, self._drain, name)
        self._recheck()

    def _drain(self, name: str) -> None:
        """Hand every message waiting on a channel to the driver's queue.

        A zmq socket's descriptor only signals that its events changed, and a send on the
        socket can take that signal: so a channel is read until its EVENTS say nothing is
        left, again after each send on it (``_send``), and every ``_RECV_REARM`` seconds
        (``_recheck``), which bounds any stall instead of hanging a step. At most
        ``_DRAIN_BATCH`` messages a turn of the event loop: the rest in the next turn, so a
        cell that floods its channels cannot keep the host from its other sessions."""
        sock = self._sockets.get(name)
        if sock is None:
            return
        session = self._session
        try:
            for _ in range(_DRAIN_BATCH):
                if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
                _, parts = session.feed_identities(frames)
                msg = session.deserialize(parts)
                log.debug(
                    "%s %s <- %s %s",
                    self.kernel_id,
                    name,
                    msg["header"]["msg_type"],
                    msg.get("parent_header", {}).get("msg_id"),
                )
                self._deliver(name, msg)
        except Exception as exc:  # a message that fails its signature, a socket gone
            self._stop_reading()
            self._transport_failed(exc)
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
        for sock in sockets.values():  # closed by _stop_client
            loop.remove_reader(sock.FD)
        if self._rearm is not None:
            self._rearm.cancel()
            self._rearm = None

    async def _stop_client(self) -> None:
        self._stop_reading()
        channels, self._channels = self._channels, []
        for sock in channels:
            sock.close(linger=0)


def launch_guard(
    cgroup_joins: list[Path] | Path | None = None,
    parent: int | None = None,
    *,
    staged: list[tuple[str, str]] | None = None,
    seccomp: Path | None = None,
) -> list[str]:
    """A prefix for the kernel's command that ties it to this process (``parent``).

    bwrap's ``--die-with-parent`` only takes effect once bwrap runs: a server killed in the
    milliseconds before would leave the kernel behind. So ``setpriv`` asks for SIGKILL on the
    parent's death first, then a shell checks that the parent is still this process, joins
    the kernel's cgroups (``0`` written to each of ``cgroup_joins``: see
    :attr:`KernelCgroup.join_files`), and execs the rest.

    ``staged``: ``(host path, mount point)`` pairs bind-mounted first, in a private mount
    namespace, so that a kernel running as an unprivileged uid can reach paths it could not
    (these run as root: only a privileged server passes any).

    ``seccomp``: a seccomp program opened on descriptor :data:`SECCOMP_FD` for the command
    (bubblewrap's ``--seccomp``, which closes it once read)."""
    if isinstance(cgroup_joins, Path):
        cgroup_joins = [cgroup_joins]
    steps = []
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
    if setpriv:
        steps.append(f'[ "$PPID" = "{parent or os.getpid()}" ]')
    for join in cgroup_joins or []:
        steps.append(f'echo 0 > "{join}"')
    if staged:
        unshare = shutil.which("unshare") or "unshare"
        prefix += [unshare, "--mount", "--propagation", "private", "--"]
        steps += [f'mount --bind "{source}" "{target}"' for source, target in staged]
    if seccomp is not None:
        steps.append(f'exec {SECCOMP_FD}<"{seccomp}"')
    if not steps:
        return []
    script = " && ".join([*steps, 'exec "$@"'])
    return [*prefix, "/bin/sh", "-c", script, "kernel-env-launch"]


def _check_socket_path(ipc_prefix: str, kernel_id: str) -> None:
    """Refuse a runtime dir whose socket paths would not fit a unix socket address
    (the failed start's shutdown removes the dir)."""
    longest = len(os.fsencode(ipc_prefix)) + len(_SOCKET_SUFFIX)
    if longest > _SOCKET_PATH_MAX:
        raise KernelStartError(
            f"runtime dir {str(Path(ipc_prefix).parent)!r} is too long for the kernel's IPC "
            f"sockets ({longest} > {_SOCKET_PATH_MAX} bytes): choose a shorter runtime_root",
            kernel_id=kernel_id,
        )


@functools.cache
def _reachable_by_kernel_uid(python: str, runtime_parent: str) -> bool:
    """Whether a kernel's own uid can run ``python``, import kernel_env and read its runtime
    dir; if not, a root server's unsandboxed kernels keep root, and the log says so once."""
    import kernel_env

    needed = [
        python,
        os.path.realpath(python),
        sys.prefix,
        sys.base_prefix,
        str(Path(kernel_env.__file__).parent),
    ]
    missing = [path for path in needed if not privilege.reachable(path)]
    if not privilege.reachable(runtime_parent, list_dir=False):  # traversed, never listed
        missing.append(runtime_parent)
    if missing:
        log.warning(
            "unsandboxed kernels run as ROOT: a kernel's own uid cannot reach %s (a directory "
            "above it is private); install Python where other users can read it, or use the "
            "sandbox",
            missing[0],
        )
    return not missing


async def _kill_process(km: AsyncKernelManager) -> None:
    """Kill and reap a kernel process that ``shutdown_kernel`` could not stop.

    A start that failed half-way leaves a process but no control socket, and shutdown's
    interrupt fails before it reaches the kill.
    """
    provisioner = km.provisioner
    if provisioner is None or not provisioner.has_process:
        return
    with contextlib.suppress(Exception):
        await provisioner.kill()
    with contextlib.suppress(Exception):
        await provisioner.wait()


def describe_isolation(python: str = sys.executable) -> dict[str, str]:
    """What separates an unsandboxed local kernel from the server, in words."""
    from kernel_env.kernel.cgroups import available_controllers

    if not privilege.privileged():
        uid = f"the server's uid ({os.getuid()}): it can read what the server can"
    elif _reachable_by_kernel_uid(python, str(runtime_parent().path)):
        first, last = privilege.KERNEL_UIDS
        uid = f"one uid per kernel from {first}-{last}"
    else:
        uid = "ROOT: a kernel's own uid cannot reach the interpreter"
    tracked = "pids" in available_controllers() or privilege.privileged()
    return {
        "kernel_uid": uid,
        "memory": "not capped (no sandbox)",
        "processes": "not capped (no sandbox)",
        "cpu": "not capped (no sandbox)",
        "disk": "not capped (no sandbox)",
        "network": "shared with the host",
        "syscalls": "not filtered (no sandbox)",
        "leftovers": "killed at close"
        if tracked
        else "a process that leaves the kernel's session may survive it",
    }
