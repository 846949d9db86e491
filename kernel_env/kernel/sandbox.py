"""A local kernel inside a bubblewrap sandbox, with per-kernel limits.

Each kernel runs through ``bwrap`` in its own PID, mount, network, IPC, UTS and user
namespaces, as an unprivileged uid, over a read-only root with a private ``/tmp`` and a size-
capped workspace, and no network unless asked for. Limits: address space, open files, file
size and CPU time through rlimits (``prlimit``); the process count through a cgroup ``pids``
controller, because ``RLIMIT_NPROC`` does nothing for root. Tearing the kernel down kills the
namespace's init, which takes every process of the episode with it, ``setsid`` ones included;
whatever is still in the kernel's cgroup is killed too.

It is not a VM: the kernel shares the host's Linux kernel. For hostile multi-tenant use, run
kernels through Enterprise Gateway on gVisor or Kata nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec

from kernel_env.kernel.local import LocalKernel

__all__ = ["SandboxLimits", "SandboxedKernel", "launch_guard", "sandbox_problem"]

log = logging.getLogger(__name__)

_CGROUP_ROOT = Path("/sys/fs/cgroup/pids")
_NOBODY = "65534"
GiB = 1024**3

# Credentials that commonly sit in the (otherwise readable) host filesystem: masked inside.
# Inside the sandbox the kernel's files are checked against the server's own uid (the user
# namespace maps "nobody" inside to it), so what that user can read, the kernel could read too.
# Hidden: every home directory (credentials, shell history, other projects) and the password
# hashes; what the interpreter needs from a hidden directory is bound back read-only.
_HIDDEN_DIRS = ("/tmp", "~", "/root", "/home")
_HIDDEN_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-kernel limits; ``None`` leaves one unset."""

    memory_bytes: int | None = 4 * GiB  # RLIMIT_AS: an allocation past it raises MemoryError
    cpu_seconds: int | None = None  # RLIMIT_CPU over the kernel's life (SIGXCPU ends it)
    open_files: int | None = 1024
    file_size_bytes: int | None = 1 * GiB
    processes: int | None = 256  # cgroup pids.max
    workspace_bytes: int = 1 * GiB  # size of the writable workspace and of /tmp
    network: bool = False
    extra_ro_binds: tuple[str, ...] = field(default_factory=tuple)


@functools.cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot be used here, or None when it can."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    probe = [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--unshare-all",
        "--unshare-user",
        "--uid",
        _NOBODY,
        "--gid",
        _NOBODY,
        "--die-with-parent",
        # What every kernel's launch mounts: a container may allow namespaces but not these.
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "true",
    ]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if result.returncode != 0:
        return f"bwrap cannot create namespaces here: {result.stderr.strip()[:200]}"
    return None


def _cgroup_usable() -> bool:
    return _CGROUP_ROOT.is_dir() and os.access(_CGROUP_ROOT, os.W_OK)


class SandboxedKernel(LocalKernel):
    """A :class:`LocalKernel` launched through bubblewrap, with limits."""

    def __init__(self, *, limits: SandboxLimits | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limits = limits or SandboxLimits()
        self._cgroup: Path | None = None

    # -- launch command -----------------------------------------------------------------

    def _kernel_spec(self) -> KernelSpec:
        # Interrupt through the control channel: a signal to the process group would reach
        # bwrap itself and end the sandbox instead of the cell.
        return KernelSpec(
            argv=self._command(),
            language="python",
            display_name="kernel_env",
            interrupt_mode="message",
        )

    def _environ(self) -> dict[str, str]:
        env = super()._environ()
        env["TMPDIR"] = "/tmp"
        return env

    def _command(self) -> list[str]:
        # ipykernel exits when its parent pid changes; inside the PID namespace its parent is
        # bwrap's reaper, pid 1, which the kernel app treats as "no parent to watch".
        # --die-with-parent ends the sandbox with the server instead.
        kernel = [*self._argv, "--IPKernelApp.parent_handle=1"]
        cgroup = self._cgroup if self.limits.processes is not None else None
        return [*launch_guard(cgroup), *self._prlimit(), *self._bwrap(), *kernel]

    def _bwrap(self) -> list[str]:
        runtime, work = str(self.runtime_dir), str(self.workdir)
        size = str(self.limits.workspace_bytes)
        args = [
            shutil.which("bwrap") or "bwrap",
            "--die-with-parent",
            "--unshare-all",
            *(["--share-net"] if self.limits.network else []),
            "--unshare-user", "--uid", _NOBODY, "--gid", _NOBODY,
            "--ro-bind", "/", "/",
            "--dev", "/dev",
            "--proc", "/proc",  # this namespace's processes only
            "--size", size, "--tmpfs", "/tmp",  # hides every other kernel's runtime dir
            *_hide(),  # homes and password hashes
            *_keep_visible(),  # the interpreter and packages, if they live in a hidden place
            "--bind", runtime, runtime,  # the connection file and IPC sockets
            "--size", size, "--tmpfs", work,  # the capped, private workspace
            "--chdir", work,
        ]  # fmt: skip
        for path in self.limits.extra_ro_binds:
            args += ["--ro-bind", path, path]
        return [*args, "--"]

    def _prlimit(self) -> list[str]:
        limits = self.limits
        pairs = [
            ("--as", limits.memory_bytes),
            ("--cpu", limits.cpu_seconds),
            ("--nofile", limits.open_files),
            ("--fsize", limits.file_size_bytes),
        ]
        args = [f"{flag}={value}" for flag, value in pairs if value is not None]
        return [shutil.which("prlimit") or "prlimit", *args, "--"] if args else []

    # -- lifecycle ----------------------------------------------------------------------

    async def _launch(self) -> None:
        problem = sandbox_problem()
        if problem is not None:
            raise RuntimeError(f"sandbox unavailable: {problem}")
        self._cgroup = self._make_cgroup()
        await super()._launch()

    def _make_cgroup(self) -> Path | None:
        if self.limits.processes is None:
            return None
        if not _cgroup_usable():
            log.warning(
                "no writable pids cgroup at %s: the process count is not capped", _CGROUP_ROOT
            )
            return None
        _sweep_stale_cgroups()
        path = _CGROUP_ROOT / "kernel_env" / self.kernel_id
        path.mkdir(parents=True, exist_ok=True)
        (path / "pids.max").write_text(str(self.limits.processes))
        return path

    async def stage_file(self, name: str, data: bytes) -> str:
        # The workspace is a tmpfs inside the sandbox; the runtime dir is shared with it.
        if self.runtime_dir is None:
            raise RuntimeError("kernel not started")
        path = self.runtime_dir / name
        await asyncio.to_thread(path.write_bytes, data)
        return str(path)

    async def _terminate(self) -> None:
        await super()._terminate()
        cgroup, self._cgroup = self._cgroup, None
        if cgroup is not None:
            await asyncio.to_thread(_empty_and_remove, cgroup)


def launch_guard(cgroup: Path | None = None, parent: int | None = None) -> list[str]:
    """A prefix for the kernel's command that ties it to this process (``parent``).

    bwrap's ``--die-with-parent`` only takes effect once bwrap runs: a server killed in the
    milliseconds before would leave the kernel behind. So ``setpriv`` asks for SIGKILL on the
    parent's death first, then a shell checks that the parent is still this process (and joins
    the kernel's pids cgroup), then execs the rest."""
    steps = []
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
    if setpriv:
        steps.append(f'[ "$PPID" = "{parent or os.getpid()}" ]')
    if cgroup is not None:
        steps.append(f'echo $$ > "{cgroup / "cgroup.procs"}"')
    if not steps:
        return []
    script = " && ".join([*steps, 'exec "$@"'])
    return [*prefix, "/bin/sh", "-c", script, "kernel-env-launch"]


def _hidden_dirs() -> list[str]:
    dirs = {os.path.realpath(os.path.expanduser(d)) for d in _HIDDEN_DIRS}
    return sorted(d for d in dirs if d != "/" and os.path.isdir(d))


def _hide() -> list[str]:
    """tmpfs over the hidden directories (/tmp is already one) and /dev/null over the files."""
    args = [a for d in _hidden_dirs() if d != "/tmp" for a in ("--tmpfs", d)]
    for file in _HIDDEN_FILES:
        if os.path.exists(file):
            args += ["--ro-bind", "/dev/null", file]
    return args


def _keep_visible() -> list[str]:
    """Read-only binds for what the kernel needs from a hidden directory (an interpreter under
    ~/.pyenv, a virtualenv or a checkout in /tmp or a home), which would otherwise vanish."""
    import sys

    import kernel_env

    needed = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        str(Path(kernel_env.__file__).resolve().parent.parent),
        *sys.path,
    }
    hidden = _hidden_dirs()
    tops = sorted(
        p
        for p in {os.path.realpath(p) for p in needed if p}
        if any(p.startswith(d + "/") for d in hidden) and os.path.exists(p)
    )
    kept: list[str] = []
    for path in tops:
        if not any(path.startswith(k + "/") for k in kept):  # a parent is already bound
            kept.append(path)
    return [arg for path in kept for arg in ("--ro-bind", path, path)]


_STALE_CGROUP_AGE = 60.0  # seconds: younger ones may belong to a kernel still being launched


def _sweep_stale_cgroups() -> None:
    """Remove the empty cgroups a server killed with SIGKILL left behind (its kernels died
    with it, but nobody removed their cgroups). A cgroup with a process in it stays."""
    import time

    parent = _CGROUP_ROOT / "kernel_env"
    if not parent.is_dir():
        return
    now = time.time()
    for cgroup in parent.iterdir():
        with contextlib.suppress(OSError):  # gone meanwhile, or busy: rmdir refuses
            old = cgroup.is_dir() and now - cgroup.stat().st_mtime > _STALE_CGROUP_AGE
            if old and not (cgroup / "cgroup.procs").read_text().split():
                cgroup.rmdir()


def _empty_and_remove(cgroup: Path, attempts: int = 50) -> None:
    """Kill whatever is left in the cgroup (a process that escaped the namespace teardown)."""
    import time

    for _ in range(attempts):
        try:
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        if not pids:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    log.error("processes survive in %s after teardown", cgroup)
