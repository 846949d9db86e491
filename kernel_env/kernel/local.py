"""A kernel on this host: an ipykernel process that jupyter_client's manager supervises
(:mod:`.manager`) and kernel_env's own channel client speaks to (:mod:`.channels`).

It runs on IPC transport in a private runtime dir (mode 0700), so no other local process can
reach its sockets the way any same-uid process can reach a TCP kernel's; and it gets an explicit,
minimal environment: never the server's ``os.environ``, where tokens live (:mod:`.launch`).

Started by root, it runs as a uid of its own (:mod:`kernel_env.kernel.isolation.privilege`)
where that uid can reach the interpreter, in a cgroup that lets closing it kill every process
it started (:mod:`kernel_env.kernel.isolation.cgroups`). Without the sandbox it still shares
the host's filesystem, processes and network: see docs/security.md.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec
from jupyter_client.session import Session

from kernel_env.errors import KernelError, KernelStartError, LiveForkUnavailable
from kernel_env.inkernel.contract import LIVE_FORK_MODULE
from kernel_env.kernel import versions
from kernel_env.kernel.base import STDIN_PROBE_CODE as _STDIN_PROBE_CODE
from kernel_env.kernel.base import Kernel, probe_request
from kernel_env.kernel.channels import HostChannels, host_context
from kernel_env.kernel.commands import CommandRun, run_argv
from kernel_env.kernel.fork.server import ForkServer, ForkServerError
from kernel_env.kernel.isolation import privilege
from kernel_env.kernel.isolation.cgroups import SWEPT_PATIENCE, KernelCgroup
from kernel_env.kernel.isolation.runtime import runtime_parent, write_file
from kernel_env.kernel.launch import (
    check_socket_path,
    kernel_argv,
    launch_guard,
    minimal_environ,
    placeholder_argv,
    reachable_by_kernel_uid,
)
from kernel_env.kernel.manager import CopyProcess, ForkedLaunch, KernelManager, kill_process
from kernel_env.kernel.messages import HostSession

__all__ = ["LocalKernel", "describe_isolation"]

log = logging.getLogger(__name__)

# A command beside the kernel starts in its workspace ($HOME), then runs through a shell.
_IN_HOME = 'cd "$HOME" && exec /bin/sh -c "$1"'


class LocalKernel(Kernel):
    """An ipykernel process on this host, over IPC in a private runtime dir."""

    _manager_class = KernelManager

    def __init__(
        self,
        *,
        python: str = sys.executable,
        argv: Sequence[str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        runtime_root: str | None = None,
        forkserver: ForkServer | None = None,
        kernel_name: str = "python3",
        language: str = "python",
        interrupt_mode: str = "signal",
        ipykernel_app: bool = True,
        stdin_probe: str | None = _STDIN_PROBE_CODE,
        idle_grace: float = 0.0,
        **kwargs: Any,
    ) -> None:
        """``forkserver``: fork the kernel from this preloaded process instead of starting
        a new interpreter (when it runs the same ``python`` and no custom ``argv`` is given;
        kernels start cold while it is not ready).

        Another language's kernel (``argv`` from its kernelspec, see
        :mod:`kernel_env.languages`): its ``kernel_name`` and ``language``, how it is
        interrupted, whether ``argv`` starts an ipykernel app (which takes its flags), the
        silent cell that probes its stdin channel (None: it has none to probe), and how long
        a cell's output may come after its idle."""
        super().__init__(**kwargs)
        self.idle_grace = idle_grace
        self.kernel_name = kernel_name
        self.language = language
        self._interrupt_mode = interrupt_mode
        self._ipykernel_app = ipykernel_app
        if stdin_probe != _STDIN_PROBE_CODE:
            self._stdin_probe = None if stdin_probe is None else probe_request(stdin_probe)
        self.kernel_id = uuid.uuid4().hex[:12]
        self._argv = list(argv) if argv is not None else kernel_argv(python)
        self._python = python
        self._extra_env = dict(extra_env or {})
        self._runtime_root = runtime_root
        self._dir: Path | None = None
        self._km: KernelManager | None = None
        self._client: HostChannels | None = None  # its channels, until _stop_client
        self._last_session: Session | None = None  # the last client's (see _start_client)
        self._lease: privilege.UidLease | None = None
        self._cgroup: KernelCgroup | None = None
        self._forkserver = forkserver if argv is None else None
        # Its own command line loads kernel_env's extension, which makes stdin wait for us.
        self._stdin_waits_for_the_host = argv is None
        # Its ipykernel is this environment's (forked, or started with this interpreter).
        self._welcomes_subscribers = (
            argv is None and python == sys.executable and versions.welcomes_subscribers()
        )
        self.quiet_iopub = argv is None  # an episode kernel: kernel_env's extension is loaded
        self.forked = False  # whether the running kernel came from the forkserver
        self.forked_pid: int | None = None  # the forked kernel's own process (a host pid)
        self.copied = False  # whether the running kernel is a live fork's copy of another
        self._options = dict(
            python=python, argv=argv, extra_env=extra_env, runtime_root=runtime_root,
            forkserver=forkserver, kernel_name=kernel_name, language=language,
            interrupt_mode=interrupt_mode, ipykernel_app=ipykernel_app,
            stdin_probe=stdin_probe, idle_grace=idle_grace, **kwargs,
        )  # fmt: skip

    @property
    def runtime_dir(self) -> Path | None:
        """The kernel's private directory (connection file, sockets, working directory)."""
        return self._dir

    def runtime_path(self, name: str) -> str:
        """Where ``name`` in the kernel's runtime dir is, known before the kernel starts; the
        kernel sees it at the same path (a sandbox binds the directory, read-only)."""
        return str(runtime_parent(self._runtime_root).kernel_dir(self.kernel_id) / name)

    def set_env(self, name: str, value: str) -> None:
        """One more variable of the kernel's environment, from its next launch on."""
        self._extra_env[name] = value

    @property
    def workdir(self) -> Path:
        if self._dir is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        return self._dir / "work"

    @property
    def kernel_cwd(self) -> str:
        """The kernel's working directory and ``$HOME``, as the kernel names it: its workdir
        (a sandbox's is a path of its own)."""
        return str(self.workdir)

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
            language=self.language,
            display_name="kernel_env",
            interrupt_mode="message" if forked else self._interrupt_mode,
        )

    def _command(self) -> list[str]:
        """The command that launches the kernel cold (a sandbox wraps it)."""
        joins = self._cgroup_joins()
        if not joins and self._lease is None:
            return list(self._argv)
        return [*launch_guard(joins), *self._drop(), *self._argv]

    def _environ(self) -> dict[str, str]:
        return minimal_environ(self.kernel_cwd, self._python)

    def _drop(self) -> list[str]:
        lease = self._lease
        return privilege.drop_command(lease.uid, lease.gid) if lease is not None else []

    async def run_command(self, command: str, *, timeout: float, max_output: int) -> CommandRun:
        if self._dir is None or self._km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        argv = [*self._beside(), "/bin/sh", "-c", _IN_HOME, "kernel-env-command", command]
        return await run_argv(
            argv, env=self._environ(), cwd=None, timeout=timeout, max_output=max_output
        )

    def _beside(self) -> list[str]:
        """The prefix that puts a command beside the kernel: its cgroups and its uid."""
        return [*launch_guard(self._cgroup_joins()), *self._drop()]

    def _cgroup_joins(self) -> list[Path]:
        return self._cgroup.join_files if self._cgroup is not None else []

    def _lease_uid(self) -> privilege.UidLease | None:
        """A uid of the kernel's own when this process is root (None otherwise, or when such
        a uid could not reach the interpreter: then the kernel runs as root, said once)."""
        if not kernels_get_own_uids(self._python, self._runtime_root):
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
        check_socket_path(self._ipc_prefix(), self.kernel_id)
        self._prepare_dirs()
        self._cgroup = self._make_cgroup()
        self._km = self._manager_class(
            transport="ipc",
            ip=self._ipc_prefix(),
            connection_file=str(self._dir / "kernel.json"),
            context=host_context(),
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
        km.provisioner = ForkedLaunch(self._fork, parent=km, kernel_spec=km._kernel_spec)
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
                "cwd": self.kernel_cwd,
                "rlimits": self._rlimits(),
                "namespace_rlimits": self._namespace_rlimits(),
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

    def _namespace_rlimits(self) -> dict[str, int]:
        """Limits a forked kernel sets on itself once in its sandbox's user namespace."""
        return {}

    def _launch_env(self) -> dict[str, str]:
        return self._environ() | self._extra_env

    async def stop_process(self) -> None:
        """End the kernel's process and what it started, and keep the rest (its directory,
        key, cgroup and uid): :meth:`restart` starts it again."""
        await self._stop_client()
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        await km.shutdown_kernel(now=True, restart=True)
        await asyncio.to_thread(self._kill_leftovers)

    async def _relaunch(self) -> None:
        await self.stop_process()
        self.copied = False  # a copy's state is gone: a kernel starts the usual way
        await self._start_process()
        self._start_client()

    # -- live fork ------------------------------------------------------------------------

    def _live_fork_problem(self) -> str | None:
        """Why this kernel cannot be copied live, or None."""
        if self._km is None or not self.started:
            return "the kernel is not running"
        if not self._stdin_waits_for_the_host:
            return "only kernel_env's own Python kernels can be copied live"
        if self._lease is not None:
            return (
                "the kernel runs as a uid of its own, which its copies would share "
                "(kernel_env gives every kernel its own)"
            )
        return None

    async def live_fork(self, n: int, *, reseed: bool = True) -> list[Kernel]:
        """``n`` copies of this kernel's process (see :mod:`kernel_env.kernel.fork.live`),
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
            f"__import__({LIVE_FORK_MODULE!r}, fromlist=['_']).fork_copies("
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
        km.provisioner = CopyProcess(pid, parent=km, kernel_spec=km._kernel_spec)
        km._attempted_start = True  # as if started here (its shutdown and restart expect it)
        self._start_client()
        await self._wait_ready()
        if not reseed:
            restore = f"__import__({LIVE_FORK_MODULE!r}, fromlist=['_']).restore_random()"
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
                await kill_process(km)
            await km.cleanup_resources()  # closes its control socket, if it made one
        cgroup, self._cgroup = self._cgroup, None
        lease, self._lease = self._lease, None
        emptied = cgroup is not None and await asyncio.to_thread(cgroup.remove)
        if lease is not None:
            # Every process of a kernel runs in its cgroup, and only a kernel runs as its uid:
            # with the cgroup empty, nothing does; otherwise the uid's processes are killed.
            await asyncio.to_thread(lease.release, emptied=emptied)
        if cgroup is not None and cgroup.paths:  # what held it may be gone with the uid's
            await asyncio.to_thread(cgroup.remove, SWEPT_PATIENCE)
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
        client = self._client
        msg_id = client.send(channel, msg_type, content, parent, metadata) if client else None
        if msg_id is None:  # the channels failed (see HostChannels) or were closed
            raise KernelError(f"the kernel's {channel} channel is closed", kernel_id=self.kernel_id)
        return msg_id

    async def is_alive(self) -> bool:
        return self._km is not None and await self._km.is_alive()

    def exit_status(self) -> int | None:
        """The exit status of the process the host holds, once it ended (negative: the
        signal that ended it); None while it runs, or when this process did not start it."""
        process = getattr(self._km.provisioner, "process", None) if self._km else None
        return getattr(process, "returncode", None)

    def exit_reasons(self) -> list[str]:
        reasons = []
        status = self.exit_status()  # a kernel this process started
        if status is not None and status < 0:
            reasons.append(f"killed by signal {_signal_name(-status)}")
        elif status:
            reasons.append(f"exit status {status}")
        if self._cgroup is not None:
            reasons += self._cgroup.limits_hit()
        return reasons

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

    def frontend_connection(self) -> dict[str, Any]:
        """jupyter_client's connection info for another client on this host (a frontend
        that drives the kernel itself): the kernel's key, and its sockets as this host
        reaches them."""
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        return dict(km.get_connection_info())

    async def release_channels(self) -> None:
        """Close this host's own channels: a frontend drives the kernel from now on (and
        nothing here keeps what the kernel sends)."""
        await self._stop_client()

    def _start_client(self) -> None:
        km = self._km
        if km is None:
            raise KernelStartError("kernel not started", kernel_id=self.kernel_id)
        # The manager's session (it wrote the key) serves the first client; every later one
        # (after a restart) gets a new session: a new socket identity and fresh msg ids.
        # Reusing one client's session for the next repeated both, and a reply was now and
        # then lost.
        session: Session = km.session
        if session is self._last_session or not isinstance(session, HostSession):
            session = HostSession(key=session.key, signature_scheme=session.signature_scheme)
        self._last_session = session
        self._client = HostChannels(
            km.context,
            session,
            lambda name: f"{km.transport}://{km.ip}-{getattr(km, f'{name}_port')}",
            self._deliver,
            self._transport_failed,
            self.kernel_id,
        )

    async def _stop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def kernels_get_own_uids(python: str = sys.executable, runtime_root: str | None = None) -> bool:
    """Whether unsandboxed kernels of ``python`` run as uids of their own: this process is
    root and such a uid can reach the interpreter and the runtime dir (else they keep root)."""
    if not privilege.privileged():
        return False
    return reachable_by_kernel_uid(python, str(runtime_parent(runtime_root).path))


def describe_isolation(python: str = sys.executable) -> dict[str, str]:
    """What separates an unsandboxed local kernel from the server, in words."""
    from kernel_env.kernel.isolation.cgroups import available_controllers

    if not privilege.privileged():
        uid = f"the server's uid ({os.getuid()}): it can read what the server can"
    elif kernels_get_own_uids(python):
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


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:  # a real-time signal, unnamed
        return str(number)
