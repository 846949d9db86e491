"""Per-kernel cgroups: memory (tmpfs pages included), process count and CPU for a whole kernel.

rlimits count per process: five forked children of 1.5 GiB each pass a 4 GiB ``RLIMIT_AS``.
A cgroup counts the kernel and everything it starts, and the memory controller also charges
the pages of the sandbox's tmpfs mounts (``/tmp``, the workspace, ``/dev/shm``) to it.

Layout: ``<controller>/kernel_env/<server pid>/<kernel id>`` on cgroup v1 (one tree per
controller: ``memory``, ``pids``, ``cpu``), ``/sys/fs/cgroup/kernel_env/<server pid>/<kernel
id>`` on cgroup v2. Each server has its own parent, so servers on one host never see each
other's kernels. A server killed with SIGKILL leaves its parent behind; the next server sweeps
the parents whose process is gone. A pid alone cannot say so across PID namespaces (a server
in a container or a Ray node's namespace sees no process of another with that number), so
each server also holds a shared ``flock`` on its parent directories for its whole life, and a
parent is swept only once its lock can be taken: servers in other namespaces that share the
cgroup tree leave each other's kernels alone.

It needs a writable cgroup tree: root on the host, or a delegated subtree (cgroup v2). Without
one, :func:`available_controllers` is empty, the limits fall back to rlimits, and the server
says so at start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "CLOSE_PATIENCE",
    "SWEPT_PATIENCE",
    "KernelCgroup",
    "available_controllers",
    "cgroup_version",
    "sweep_dead_servers",
]

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_TREE = "kernel_env"
CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD = 100_000  # microseconds
# How long a kernel's removal waits for its killed processes to exit (and its cgroup to
# accept rmdir): at close, and once more after its uid was swept (what a fork bomb on a
# loaded host needs, measured: a few seconds; the removal runs in a thread of its own).
CLOSE_PATIENCE = 2.0
SWEPT_PATIENCE = 15.0
_FIRST_PAUSE, _LAST_PAUSE = 0.005, 0.1  # seconds between kill rounds, doubling


@functools.cache
def cgroup_version() -> int | None:
    """2 for a unified hierarchy, 1 for per-controller trees, None when neither is usable."""
    if (_ROOT / "cgroup.controllers").exists():
        return 2
    if (_ROOT / "pids").is_dir() or (_ROOT / "memory").is_dir():
        return 1
    return None


@functools.cache
def available_controllers() -> tuple[str, ...]:
    """The controllers this process can create kernel cgroups with."""
    version = cgroup_version()
    if version == 1:
        return tuple(c for c in CONTROLLERS if _writable_v1(c))
    if version == 2:
        return _enable_v2()
    return ()


def _writable_v1(controller: str) -> bool:
    base = _ROOT / controller
    try:
        (base / _TREE).mkdir(exist_ok=True)
    except OSError:
        return False
    return os.access(base / _TREE, os.W_OK)


def _enable_v2() -> tuple[str, ...]:
    """Make ``kernel_env`` under the root and pass every controller we need down to it."""
    tree = _ROOT / _TREE
    try:
        tree.mkdir(exist_ok=True)
        offered = set((_ROOT / "cgroup.controllers").read_text().split())
        wanted = [c for c in CONTROLLERS if c in offered]
        for parent in (_ROOT, tree):
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        return tuple(c for c in wanted if c in (tree / "cgroup.controllers").read_text().split())
    except OSError as exc:
        log.debug("cgroup v2 unusable: %r", exc)
        return ()


def _server_trees() -> list[Path]:
    if cgroup_version() == 1:
        return [_ROOT / c / _TREE for c in CONTROLLERS]
    return [_ROOT / _TREE]


class KernelCgroup:
    """One kernel's cgroup (one directory per controller on v1) with its limits written."""

    def __init__(
        self,
        kernel_id: str,
        *,
        memory_bytes: int | None,
        processes: int | None,
        cpus: float | None,
    ) -> None:
        self.paths: list[Path] = []
        wanted = {"memory": memory_bytes, "pids": processes, "cpu": cpus}
        # pids always, limit or not: it is how closing the kernel finds all its processes.
        controllers = [c for c in available_controllers() if wanted[c] is not None or c == "pids"]
        self.controllers = tuple(controllers)
        if not controllers:
            return
        _sweep_once()
        _remove_left_behind()
        if cgroup_version() == 1:
            for c in controllers:
                server = _claim(_ROOT / c / _TREE / str(os.getpid()))
                self.paths.append(_make(server / kernel_id))
        else:
            server = _ROOT / _TREE / str(os.getpid())
            if not server.is_dir():
                server.mkdir(exist_ok=True)
                _write(server / "cgroup.subtree_control", " ".join(f"+{c}" for c in controllers))
            self.paths.append(_make(_claim(server) / kernel_id))
        for c in controllers:
            if wanted[c] is not None:
                self._limit(c, wanted[c])

    def _file(self, controller: str, v1: str, v2: str) -> Path:
        if cgroup_version() == 1:
            path = next(p for p in self.paths if p.parts[len(_ROOT.parts)] == controller)
            return path / v1
        return self.paths[0] / v2

    def _limit(self, controller: str, value: float | int | None) -> None:
        if controller == "memory":
            _write(self._file("memory", "memory.limit_in_bytes", "memory.max"), str(value))
            with contextlib.suppress(OSError):  # v2: no swapping around the limit
                if cgroup_version() == 2:
                    _write(self.paths[0] / "memory.swap.max", "0")
        elif controller == "pids":
            _write(self._file("pids", "pids.max", "pids.max"), str(value))
        elif controller == "cpu":
            quota = max(1000, int(float(value or 0) * _CPU_PERIOD))
            if cgroup_version() == 1:
                _write(self._file("cpu", "cpu.cfs_period_us", ""), str(_CPU_PERIOD))
                _write(self._file("cpu", "cpu.cfs_quota_us", ""), str(quota))
            else:
                _write(self.paths[0] / "cpu.max", f"{quota} {_CPU_PERIOD}")

    @property
    def join_files(self) -> list[Path]:
        """The files a launcher writes ``0`` to, to move itself into every controller.

        On v1 that is ``tasks``: it moves the calling thread alone, which for a launcher
        (one thread) is the whole process, and Linux then skips the lock that every
        whole-process move takes: waiting for an RCU grace period, every start. On v2
        it is ``cgroup.procs``."""
        name = "tasks" if cgroup_version() == 1 else "cgroup.procs"
        return [p / name for p in self.paths]

    def limits_hit(self) -> list[str]:
        """The limits the kernel's processes ran into, in words: its memory limit (processes
        killed for it) or its process limit (forks refused); empty when neither or unknown."""
        hit = []
        memory = _events(self._file_or_none("memory", "memory.oom_control", "memory.events"))
        if memory.get("oom_kill", 0):
            hit.append(f"its memory limit ({memory['oom_kill']} process(es) killed for it)")
        pids = _events(self._file_or_none("pids", "pids.events", "pids.events"))
        if pids.get("max", 0):
            hit.append(f"its process limit ({pids['max']} fork(s) refused)")
        return hit

    def _file_or_none(self, controller: str, v1: str, v2: str) -> Path | None:
        if controller not in self.controllers:
            return None
        return self._file(controller, v1, v2)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (the cgroup stays)."""
        for path in self.paths[:1]:  # on v1 every controller's directory holds the same
            _kill_all(path)

    def remove(self, patience: float = CLOSE_PATIENCE) -> bool:
        """Kill whatever is still inside (a process that escaped the namespace teardown),
        then remove the directories, waiting up to ``patience`` seconds for each; whether
        every process of the kernel is gone (False without a cgroup: nothing was counted). A
        directory that a process still holds stays in ``paths`` for a later call (after its
        uid's processes were killed, with :data:`SWEPT_PATIENCE`), and is retried whenever a
        kernel cgroup is made or removed, until it goes."""
        deadline = time.monotonic() + patience
        emptied = [
            _empty_and_remove(path, max(0.0, deadline - time.monotonic())) for path in self.paths
        ]
        self.paths = [path for path in self.paths if path.exists()]
        with _left_lock:
            _left.update(self.paths)
        if self.paths and patience >= SWEPT_PATIENCE:
            log.error("cgroups %s outlived their kernel; retried later", self.paths)
        _remove_left_behind()
        return bool(emptied) and all(emptied)


def _events(path: Path | None) -> dict[str, int]:
    """A cgroup's ``name value`` lines (``memory.events``, ``pids.events``), {} if unread."""
    found: dict[str, int] = {}
    if path is None:
        return found
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                found[name] = int(value)
    return found


# Kernel cgroups whose removal failed (a process outlived the kill loop): retried later.
_left: set[Path] = set()
_left_lock = threading.Lock()


def _remove_left_behind() -> None:
    """One more try at each kernel cgroup left behind (without waiting for its processes)."""
    with _left_lock:
        left = list(_left)
    for path in left:
        if _empty_and_remove(path, patience=0) and not path.exists():
            with _left_lock:
                _left.discard(path)


# This process's parent directories, each held open with a shared flock: the sign that their
# server lives, whatever PID namespace looks at them.
_claimed: dict[Path, int] = {}
_claim_lock = threading.Lock()


def _claim(server: Path) -> Path:
    """``server`` (this process's parent directory), made if need be and locked (shared)."""
    with _claim_lock:
        if server in _claimed:
            return server
        while True:
            server.mkdir(parents=True, exist_ok=True)
            fd = os.open(server, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            # A sweep that locked it first may have removed it meanwhile: then make it again.
            if _same_file(fd, server):
                _claimed[server] = fd
                return server
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _unclaimed(server: Path) -> int | None:
    """An fd holding ``server``'s exclusive lock when no live server holds it, else None."""
    try:
        fd = os.open(server, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _make(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, text: str) -> None:
    path.write_text(text)


_swept = False


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        if removed := sweep_dead_servers():
            log.info("removed %d kernel cgroup(s) left by servers that died", removed)


def sweep_dead_servers() -> int:
    """Remove the cgroups of servers that died (killing anything still in them)."""
    removed = 0
    for tree in _server_trees():
        with contextlib.suppress(OSError):
            for server in [p for p in tree.iterdir() if p.is_dir() and p.name.isdigit()]:
                if _alive(int(server.name)):
                    continue
                removed += _sweep(server)
    return removed


def _sweep(server: Path) -> int:
    """Remove a dead server's kernel cgroups and its parent, unless a server holds its lock."""
    fd = _unclaimed(server)
    if fd is None:
        return 0
    removed = 0
    try:
        for kernel in [p for p in server.iterdir() if p.is_dir()]:
            _empty_and_remove(kernel)
            removed += 1
        with contextlib.suppress(OSError):
            server.rmdir()
    finally:
        os.close(fd)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all(cgroup: Path, patience: float = 1.0) -> bool:
    """Kill the cgroup's processes until none is left, for up to ``patience`` seconds (one
    round at 0); whether it got there."""
    return _retried(lambda: _kill_round(cgroup), patience)


def _retried(attempt: Callable[[], bool], patience: float) -> bool:
    """``attempt()`` until it is true, for up to ``patience`` seconds (once at 0), with a
    growing pause between tries; whether it got there."""
    deadline = time.monotonic() + patience
    pause = _FIRST_PAUSE
    while not attempt():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(_LAST_PAUSE, pause * 2)
    return True


def _kill_round(cgroup: Path) -> bool:
    """SIGKILL each process the cgroup lists; whether it listed none."""
    try:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ValueError):
        return True
    for pid in pids:
        if pid <= 0:  # never a process group (kill(0) is the caller's own)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not pids


def _empty_and_remove(cgroup: Path, patience: float = 1.0) -> bool:
    """Kill the cgroup's processes and remove it, trying for up to ``patience`` seconds;
    whether no process was left in it (the directory may stay, refused, for a later try).

    Killed processes take a while to exit on a loaded host (a fork bomb's hundreds), and a
    cgroup refuses rmdir with EBUSY while one of them is still exiting although
    ``cgroup.procs`` no longer lists it: both are waited for, with a growing pause."""
    empty = False

    def emptied_and_removed() -> bool:
        nonlocal empty
        empty = _kill_round(cgroup)
        return empty and _rmdir(cgroup)

    return _retried(emptied_and_removed, patience) or empty


def _rmdir(cgroup: Path) -> bool:
    """Remove an empty cgroup; False while the kernel still refuses (EBUSY)."""
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return False
        log.warning("cannot remove cgroup %s: %r", cgroup, exc)
    return True
