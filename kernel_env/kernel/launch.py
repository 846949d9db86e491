"""How a local kernel is launched: its command line and flags, its environment, the guard
that ties its launch to the host, and the checks made before it runs.

Shared by the cold launch (:mod:`kernel_env.kernel.local`, :mod:`kernel_env.kernel.sandboxed`)
and the forkserver's (:mod:`kernel_env.kernel.fork.server`), which builds every forked kernel
with the same flags and environment. Host side: it runs in the process that owns the kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

from kernel_env.errors import KernelStartError
from kernel_env.inkernel.contract import EXTENSION_MODULE, TUNING_MODULE
from kernel_env.kernel.isolation import privilege

__all__ = [
    "SECCOMP_FD",
    "check_socket_path",
    "forked_kernel_flags",
    "kernel_argv",
    "launch_guard",
    "minimal_environ",
    "placeholder_argv",
    "reachable_by_kernel_uid",
]

log = logging.getLogger(__name__)

# Settings measured to matter: no ANSI colours in tracebacks (the model reads them), no
# history database (an sqlite file per kernel, and a lock shared between kernels). Two
# extensions: the helpers an episode needs, and the per-cell tuning of ipykernel
# (kernel_env.inkernel.tuning), which KERNEL_ENV_TUNING=off in the kernel's environment turns
# off.
_KERNEL_FLAGS = (
    f"--ext={EXTENSION_MODULE}",
    f"--ext={TUNING_MODULE}",
    "--colors=nocolor",
    "--HistoryManager.enabled=False",
)

SECCOMP_FD = 9  # where a cold launch's command finds its seccomp program (see launch_guard)

# A unix socket path holds at most 107 bytes on Linux. jupyter_client names the IPC sockets
# "<ip>-<n>", n = 1..5 in a fresh dir; allow two digits.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = "-99"


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


def check_socket_path(ipc_prefix: str, kernel_id: str) -> None:
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
def reachable_by_kernel_uid(python: str, runtime_parent: str) -> bool:
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
