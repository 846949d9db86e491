"""Kernels never run with the server's privilege: each gets a host uid of its own.

When the process starting kernels is root, every kernel launcher first drops to an unprivileged
uid leased from :data:`KERNEL_UIDS` (``KERNEL_ENV_KERNEL_UIDS``, ``first-last``), one uid per
live kernel. Its gid is the same number. Then:

- bubblewrap's user namespace maps the sandbox's "nobody" to that uid, not to host root: no
  write to ``/proc/sys``, no setuid file the host would honour, no root-owned file to open;
- without the sandbox, the kernel still cannot read the server's ``/proc/<pid>/environ`` (or
  pid 1's, in a container), nor another kernel's files, nor signal another kernel;
- when the kernel closes, every process running as its uid is killed: nothing it started
  survives, ``setsid`` children included.

A lease is an exclusive ``flock`` on ``/run/kernel-env/uids/<uid>.lock``, held for the kernel's
life, so servers on one host never share a uid and a dead server's uids are free again. The
file says ``clean`` while no process runs as its uid: a release leaves it so, once the uid's
processes are gone. A lease of a uid whose file exists and does not say so (a server died
holding it) kills whatever still runs as it first.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import logging
import os
import random
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KERNEL_UIDS",
    "UidLease",
    "drop_command",
    "kill_uid",
    "lease_uid",
    "privileged",
    "reachable",
]

log = logging.getLogger(__name__)

_LOCK_DIR = Path("/run/kernel-env/uids")
_CLEAN = b"clean"  # a lock file's content while no process runs as its uid
_IN_USE = b"in use"
# The environment of the helper processes run as a kernel's uid: nothing of the server's.
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
# Above systemd's container uid ranges (up to 1879048191) and below 2**31.
_DEFAULT_UIDS = (1_900_000_000, 1_900_065_535)


def _uid_range() -> tuple[int, int]:
    raw = os.environ.get("KERNEL_ENV_KERNEL_UIDS", "").strip()
    if not raw:
        return _DEFAULT_UIDS
    try:
        first, last = (int(part) for part in raw.split("-", 1))
    except ValueError:
        raise ValueError(f"KERNEL_ENV_KERNEL_UIDS: expected 'first-last', got {raw!r}") from None
    if not 0 < first <= last < 2**31:
        raise ValueError(f"KERNEL_ENV_KERNEL_UIDS: {raw!r} is not a range of non-root uids")
    return first, last


KERNEL_UIDS = _uid_range()


def privileged() -> bool:
    """Whether kernels started by this process must drop privilege (it runs as root)."""
    return os.geteuid() == 0


@dataclass
class UidLease:
    """A uid (and gid of the same number) held for one kernel until :meth:`release`."""

    uid: int
    _fd: int

    @property
    def gid(self) -> int:
        return self.uid

    def release(self, *, emptied: bool = False) -> None:
        """Free the uid, after killing every process that runs as it; ``emptied``: the
        caller saw them all end already (the kernel's cgroup held every one, and is empty)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            if not emptied:
                kill_uid(self.uid)
            _mark(fd, _CLEAN)
            os.close(fd)
            with _lease_lock:
                _released.append(self.uid)


_lease_lock = threading.Lock()
# The uids this process released, clean: leased again first (their lock files exist, and
# making one costs a disk write where /run is on a disk), the latest first.
_released: collections.deque[int] = collections.deque(maxlen=1024)


def lease_uid(uids: tuple[int, int] | None = None) -> UidLease:
    """An unused kernel uid from ``uids`` (default :data:`KERNEL_UIDS`), locked for the caller.
    Whatever may still run as that uid (a kernel of a server that died) is killed first."""
    first, last = uids or KERNEL_UIDS
    _LOCK_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _lease_lock:
        for uid in _candidates(first, last):
            fd, created = _open_lock(_LOCK_DIR / f"{uid}.lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if not created and os.pread(fd, len(_CLEAN) + 1, 0) != _CLEAN:
                kill_uid(uid)
            _mark(fd, _IN_USE)
            return UidLease(uid, fd)
    raise RuntimeError(f"no free kernel uid in {first}-{last}")


def _candidates(first: int, last: int) -> Iterator[int]:
    """The uids to try, in order: those this process released (each taken off that list as it
    is tried), then up to 4096 from a random start in the range (another server may share
    it)."""
    while _released:
        uid = _released.pop()
        if first <= uid <= last:
            yield uid
    count = last - first + 1
    start = random.randrange(count)
    for i in range(min(count, 4096)):
        yield first + (start + i) % count


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this call made it (then the uid was never
    leased: nothing runs as it)."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        return os.open(path, flags), False


def _mark(fd: int, state: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, state, 0)


def drop_command(uid: int, gid: int) -> list[str]:
    """A command prefix that runs the rest as ``uid``/``gid`` with no supplementary groups,
    asking for SIGKILL when its parent dies (a credential change clears the earlier request)."""
    return [
        _setpriv(), f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
        "--pdeathsig", "KILL", "--",
    ]  # fmt: skip


def kill_uid(uid: int, rounds: int = 3) -> None:
    """SIGKILL every process running as ``uid`` (``kill -KILL -1`` as that uid, which reaches
    exactly its processes; repeated, so a process forked during a round goes in the next)."""
    if uid == 0 or not privileged():
        raise PermissionError(f"refusing to kill every process of uid {uid}")
    script = "; ".join(["kill -KILL -1 2>/dev/null"] * rounds) + "; exit 0"
    cmd = [_setpriv(), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/bin/sh", "-c"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([*cmd, script], timeout=10, check=False, close_fds=True, env=CLEAN_ENV)


@functools.cache
def _setpriv() -> str:
    path = shutil.which("setpriv")
    if path is None:
        raise RuntimeError("setpriv (util-linux) is needed to run kernels as their own uid")
    return path


def reachable(path: str, *, list_dir: bool = True) -> bool:
    """Whether a uid that is neither the owner nor in the group of anything on the way can
    reach ``path``: every directory above it searchable by "others", and the path itself
    readable by them (a directory: searchable, and listable unless ``list_dir`` is false)."""
    try:
        real = Path(os.path.realpath(path))
        for parent in reversed(real.parents):
            if not parent.stat().st_mode & stat.S_IXOTH:
                return False
        mode = real.stat().st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        needed = stat.S_IXOTH | (stat.S_IROTH if list_dir else 0)
    else:
        needed = stat.S_IROTH
    return mode & needed == needed
