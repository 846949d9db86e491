"""Where local kernels' runtime directories live, and how the host writes into them.

Every process that starts local kernels gets one *runtime parent*,
``<runtime root>/kernel-env-<random>/``, holding a lock file that the process keeps locked for
its whole life (no pid in the name: a kernel sees its runtime dir's path). Each kernel's
runtime directory (connection file, staged files) lives inside it. A parent whose lock can be
taken belongs to a process that died, SIGKILL included: :func:`sweep_dead_parents` removes it,
so no runtime directory outlives its server.

The host writes a kernel's files with :func:`write_file`: into a fresh temporary name
(``O_EXCL | O_NOFOLLOW``), then renamed over the target. A link or file the kernel planted at
that name is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["RuntimeParent", "runtime_parent", "sweep_dead_parents", "write_file"]

log = logging.getLogger(__name__)

_PREFIX = "kernel-env-"
_LOCK = ".lock"


class RuntimeParent:
    """This process's directory of kernel runtime dirs, locked while the process lives."""

    def __init__(self, root: str | None = None) -> None:
        self.root = Path(root or tempfile.gettempdir())
        self.path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=self.root))
        # Kernels running as their own uid must traverse it to reach their own dir (0750,
        # group = the kernel's), and nothing more: no listing, no writing.
        os.chmod(self.path, 0o711)
        self._lock_fd = os.open(self.path / _LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def kernel_dir(self, kernel_id: str) -> Path:
        """Where a kernel's runtime dir is (made or not)."""
        return self.path / kernel_id  # unique (random), in a directory only we can write

    def make_kernel_dir(self, kernel_id: str, gid: int | None = None) -> Path:
        """A kernel's runtime dir: 0700, or 0750 with group ``gid`` (a kernel's own uid)."""
        path = self.kernel_dir(kernel_id)
        path.mkdir(mode=0o700)
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o750)
        return path


_parents: dict[tuple[str | None, int], RuntimeParent] = {}
_parents_lock = threading.Lock()


def runtime_parent(root: str | None = None) -> RuntimeParent:
    """This process's runtime parent under ``root`` (default: the temp dir), made on first use;
    the first use also sweeps the parents of processes that died."""
    key = (root, os.getpid())  # a forked child gets its own
    with _parents_lock:
        parent = _parents.get(key)
        if parent is None:
            sweep_dead_parents(root)
            parent = _parents[key] = RuntimeParent(root)
        return parent


def sweep_dead_parents(root: str | None = None) -> list[Path]:
    """Remove the runtime parents under ``root`` whose process is gone; return them."""
    base = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(_PREFIX)]
    except OSError:
        return removed
    for path in candidates:
        if _owner_is_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d runtime dir(s) left by processes that died", len(removed))
    return removed


def _owner_is_gone(path: Path) -> bool:
    """Whether ``path``'s lock can be taken: then the process that held it has died."""
    try:
        if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.geteuid():
            return False  # not ours to judge
        fd = os.open(path / _LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its process lives
    finally:
        os.close(fd)
    return True


def write_file(directory: Path, name: str, data: bytes, *, gid: int | None = None) -> Path:
    """Write ``directory/name`` so that nothing planted at that name can redirect the write:
    a new file under a temporary name (never following a link), then an atomic rename over
    ``name`` (which replaces a planted link instead of writing through it). Mode 0600, or
    0640 with group ``gid``."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"not a plain file name: {name!r}")
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                if gid is not None:
                    os.fchown(f.fileno(), -1, gid)
                    os.fchmod(f.fileno(), 0o640)
                f.write(data)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
    return directory / name
