"""A local kernel inside a bubblewrap sandbox, with limits for the whole kernel.

The sandbox itself (what it hides, binds and caps, and whether it works on this host) is
:mod:`kernel_env.kernel.isolation.sandbox`; docs/security.md gives its design. Host side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec

from kernel_env.errors import KernelStartError
from kernel_env.kernel.isolation import privilege, seccomp, userns
from kernel_env.kernel.isolation.cgroups import KernelCgroup
from kernel_env.kernel.isolation.runtime import runtime_parent
from kernel_env.kernel.isolation.sandbox import (
    INSIDE_HOME,
    INSIDE_IPC_DIR,
    SandboxLimits,
    bwrap_command,
    keep_root,
    keep_visible,
    limit_values,
    namespace_limit_values,
    sandbox_problem,
)
from kernel_env.kernel.launch import SECCOMP_FD, launch_guard, placeholder_argv
from kernel_env.kernel.local import LocalKernel
from kernel_env.kernel.manager import KernelManager

__all__ = ["SandboxedKernel"]

_NOBODY = "65534"  # the uid and gid the sandbox maps the kernel's own to


class _SandboxManager(KernelManager):
    """The kernel binds its sockets in its own ``/tmp``; the host reaches them through
    ``/proc/<sandbox init>/root``, found after each launch."""

    inside_ip = f"{INSIDE_IPC_DIR}/kernel-ipc"
    sandbox_init: int | None = None  # the host pid of the sandbox's init, once launched

    async def _async_pre_start_kernel(self, **kw: Any) -> Any:
        self.ip = self.inside_ip  # what the connection file (the kernel's view) says
        return await super()._async_pre_start_kernel(**kw)

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        # independent: no JPY_PARENT_PID (the server's pid) in the kernel's environment; the
        # kernel watches no parent (parent_handle=1), --die-with-parent ties it to the server.
        await super()._async_launch_kernel(kernel_cmd, **kw, independent=True)
        # A forkserver launch knows its init; a cold launch is looked up.
        init = getattr(self.provisioner, "sandbox_init", None)
        if init is None:
            init = await _sandbox_init(self.provisioner.process)  # type: ignore[union-attr]
        self.sandbox_init = init
        self.ip = f"/proc/{init}/root{self.inside_ip}"

    def cleanup_ipc_files(self) -> None:
        """The sockets vanish with the sandbox's tmpfs; the /proc path may name another
        process by now."""


async def _sandbox_init(process: Any, timeout: float = 20.0) -> int:
    """The host pid of the sandbox's init: bwrap's child (the launcher execs into bwrap)."""
    pid = process.pid
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if process.poll() is not None:
            raise KernelStartError(f"the sandbox exited at launch (status {process.returncode})")
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            for child in children:
                if Path(f"/proc/{child}/comm").read_text().strip() == "bwrap":
                    return int(child)
        except OSError:
            pass
        await asyncio.sleep(0.002)
    raise KernelStartError("the sandbox did not start its init in time")


class SandboxedKernel(LocalKernel):
    """A :class:`LocalKernel` launched through bubblewrap, with limits."""

    _manager_class = _SandboxManager

    def __init__(self, *, limits: SandboxLimits | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits = limits or SandboxLimits()
        self._staging: dict[int, str] | None = None  # see _staged

    # -- launch command -----------------------------------------------------------------

    def _kernel_spec(self) -> KernelSpec:
        # Interrupt through the control channel: a signal to the process group would reach
        # bwrap itself and end the sandbox instead of the cell.
        return KernelSpec(
            argv=[] if self.forked else self._command(),  # a forked kernel's: the spawner's
            language=self.language,
            display_name="kernel_env",
            interrupt_mode="message",
        )

    @property
    def kernel_cwd(self) -> str:
        return INSIDE_HOME  # its workspace, a tmpfs inside the sandbox

    def _environ(self) -> dict[str, str]:
        env = super()._environ()
        env["TMPDIR"] = "/tmp"
        return env

    def _command(self) -> list[str]:
        # ipykernel exits when its parent pid changes; inside the PID namespace its parent is
        # bwrap's reaper, pid 1, which the kernel app treats as "no parent to watch".
        # --die-with-parent ends the sandbox with the server instead.
        kernel = [*self._argv, *(["--IPKernelApp.parent_handle=1"] if self._ipykernel_app else [])]
        binds = self._binds()
        staged = self._staged(binds)
        program = seccomp.program_path()
        guard = launch_guard(
            self._cgroup_joins(),
            staged=[(binds[i][0], keep) for i, keep in staged.items()],
            seccomp=program,
        )
        bwrap = self._bwrap(binds, staged, filtered=program is not None)
        inside = self._prlimit(namespace_limit_values(self.limits), inside=True)
        return [*guard, *self._drop(), *self._prlimit(), *bwrap, *inside, *kernel]

    def _beside(self) -> list[str]:
        """A command beside the kernel enters its sandbox: into the namespaces of the
        sandbox's init (its root, workspace, processes, network), then becomes the sandbox's
        "nobody" (the kernel's uid) before it runs anything, under the kernel's rlimits and
        seccomp filter, in its cgroups. ``nsenter`` enters with the server's credentials:
        the sandbox's namespaces hang below two user namespaces (bubblewrap's
        ``--disable-userns`` nests one), which a root server enters in one go; any other
        enters the outer one first (``isolation/userns.py``)."""
        init = getattr(self._km, "sandbox_init", None)
        if init is None:
            raise KernelStartError("the kernel's sandbox is not running", kernel_id=self.kernel_id)
        nsenter = shutil.which("nsenter") or "nsenter"
        enter = [
            nsenter, f"--target={init}", "--user", "--mount", "--pid", "--net", "--ipc",
            "--uts", "--root", f"--setuid={_NOBODY}", f"--setgid={_NOBODY}", "--",
        ]  # fmt: skip
        if not privilege.privileged():
            # The server's own uid is the kernel's: nsenter keeps it (setgroups is denied in
            # the sandbox), and it holds no capability there once it runs the command.
            kept = [arg for arg in enter if not arg.startswith(("--setuid=", "--setgid="))]
            kept.insert(-1, "--preserve-credentials")
            enter = [self._python, "-I", "-S", userns.__file__, str(init), "--", *kept]
        program = seccomp.program_path()
        loader = [self._python, "-I", "-S", seccomp.__file__]
        filtered = [] if program is None else [*loader, str(program)]
        inside = self._prlimit(namespace_limit_values(self.limits), inside=True)
        guard = launch_guard(self._cgroup_joins())
        return [*guard, *self._prlimit(), *enter, *inside, *filtered]

    def _binds(self) -> list[tuple[str, str]]:
        """Read-only binds ``(host path, path inside)``: what the kernel needs from hidden or
        private places, then its runtime dir (the connection file and staged files)."""
        paths = [*keep_visible(), *self.limits.extra_ro_binds, str(self.runtime_dir)]
        return [(path, path) for path in paths]

    def _staged(self, binds: list[tuple[str, str]]) -> dict[int, str]:
        """The binds whose host path the kernel's own uid cannot reach, each with the mount
        point (under a directory it can reach) the launch guard binds it on first, as root;
        found once for the kernel's launches, and its shutdown removes those mount points."""
        if self._lease is None:
            return {}
        if self._staging is None:
            keep = runtime_parent(str(keep_root())).path
            self._staging = {
                i: str(keep / f"{self.kernel_id}-{i}")
                for i, (source, _) in enumerate(binds)
                if not privilege.reachable(source)
            }
        return self._staging

    def _bwrap(
        self, binds: list[tuple[str, str]], staged: dict[int, str], *, filtered: bool = False
    ) -> list[str]:
        """bubblewrap's command line; ``filtered``: the kernel's seccomp program is on
        :data:`SECCOMP_FD` (a forked kernel installs it on itself instead)."""
        fd = SECCOMP_FD if filtered else None
        return bwrap_command(self.limits, binds, staged, seccomp_fd=fd)

    def _limit_values(self) -> dict[str, int | None]:
        return limit_values(self.limits)

    def _prlimit(self, values: dict[str, int] | None = None, *, inside: bool = False) -> list[str]:
        """``prlimit`` with ``values`` (default: those set before the sandbox is made);
        ``inside``: run in the sandbox, by its real path (a link on PATH may be in a directory
        the sandbox hides, such as /tmp)."""
        chosen = self._limit_values() if values is None else values
        args = [f"--{name}={value}" for name, value in chosen.items() if value]
        found = shutil.which("prlimit") or "prlimit"
        program = os.path.realpath(found) if inside else found
        return [program, *args, "--"] if args else []

    def _rlimits(self) -> dict[str, int]:
        # Set by the forkserver's launch on the placeholder, and by the forked kernel on itself.
        return {f"RLIMIT_{name.upper()}": v for name, v in self._limit_values().items() if v}

    def _namespace_rlimits(self) -> dict[str, int]:
        # RLIMIT_NPROC: inside the user namespace only (see namespace_limit_values).
        return {f"RLIMIT_{n.upper()}": v for n, v in namespace_limit_values(self.limits).items()}

    def _launch_spec(self) -> dict[str, Any]:
        """The forkserver's spawner runs the placeholder in this kernel's sandbox, after
        binding what its uid cannot reach, as the cold launch guard does."""
        binds = self._binds()
        staged = self._staged(binds)
        placeholder = placeholder_argv()
        return {
            "launch": [*self._bwrap(binds, staged), *placeholder],
            "sandboxed": True,
            "placeholder": placeholder[0],  # the program the spawner watches for (see spawner)
            "staged": [[binds[i][0], keep] for i, keep in staged.items()],
        }

    def _live_fork_problem(self) -> str | None:
        return (
            "a copy of a sandboxed kernel would stay in its parent's namespaces (its /tmp, "
            "workspace, processes and IPC), and leaving them needs a user namespace of its "
            "own, which the sandbox forbids; Landlock here does not keep a copy from its "
            "parent's UNIX sockets (docs/security.md)"
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def _launch(self) -> None:
        problem = sandbox_problem()
        if problem is not None:
            raise RuntimeError(f"sandbox unavailable: {problem}")
        await super()._launch()

    def _lease_uid(self) -> privilege.UidLease | None:
        # Always, when root: what the uid cannot reach is bound in by the launch guard.
        return privilege.lease_uid() if privilege.privileged() else None

    def _make_cgroup(self) -> KernelCgroup:
        return KernelCgroup(
            self.kernel_id,
            memory_bytes=self.limits.memory_bytes,
            processes=self.limits.processes,
            cpus=self.limits.cpus,
        )

    def _prepare_dirs(self) -> None:
        # The workspace is a tmpfs inside (INSIDE_HOME); the host's workdir is only where
        # the launch starts. The mount points of the staged binds are empty directories the
        # kernel cannot write (the runtime dir is bound read-only).
        self.workdir.mkdir()
        for keep in self._staged(self._binds()).values():
            Path(keep).mkdir(parents=True)

    async def _terminate(self) -> None:
        runtime = self.runtime_dir
        keeps = list(self._staged(self._binds()).values()) if runtime is not None else []
        self._staging = None
        await super()._terminate()
        for keep in keeps:  # empty mount points: the binds lived in the launch's namespace
            with contextlib.suppress(OSError):
                os.rmdir(keep)

    def _ipc_prefix(self) -> str:
        return _SandboxManager.inside_ip
