"""What one machine can hold: the kernels a server runs when not told how many.

A server started without ``--max-sessions`` derives its limit from the machine, at start: each
resource a live kernel takes (memory, the server's descriptors, process ids, kernel uids) is
divided by what one kernel holds of it, and the smallest quotient wins. The per-kernel figures
are measured (benchmarks/README.md, "Density"), with headroom for the state an episode builds:
a kernel forked from the forkserver shares its interpreter's pages copy-on-write, one started
as a new interpreter does not. A gateway's kernels take the server's descriptors alone.

The status line names the figure and the resource that set it (:func:`describe`); the Ray host
declares no more slots than its node can hold; ``kernel-env capacity`` prints the figure, for
``ray start --resources`` and for deployments sizing a node.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DESCRIPTORS_PER_KERNEL",
    "MEMORY_PER_KERNEL",
    "MIN_CONNECTIONS",
    "RESERVED_DESCRIPTORS",
    "TASKS_PER_KERNEL",
    "Capacity",
    "available_memory",
    "describe",
    "machine_capacity",
]

_MiB = 1 << 20

# A live kernel's descriptors in the server, 8 measured (benchmarks/README.md, "The figures
# behind the code's choices"): its shell, iopub and stdin sockets, each a connection and
# zmq's mailbox (an eventfd); the pidfd of a forked kernel's launch; the lock of its uid
# lease (a root server). Two more once an interrupt or a shutdown request connects its
# control socket.
DESCRIPTORS_PER_KERNEL = 10
# The server's own: the listening socket, logs, the forkserver's pipes, the files a kernel's
# start opens for a moment (cgroup files, lock files), an export's temporary files.
RESERVED_DESCRIPTORS = 256
MIN_CONNECTIONS = 64  # past one a session, however few descriptors the kernels leave

# Memory one live kernel holds, with its episode's state: forked from the forkserver (its
# marginal PSS, ~12 MiB measured with a 1 MiB value), or started as a new interpreter
# (~37 MiB measured for a bare ipykernel).
MEMORY_PER_KERNEL = {"forked": 16 * _MiB, "started": 48 * _MiB}
MEMORY_SHARE = 0.8  # of what is available at start: the rest for the server, the page cache
SERVER_MEMORY = 256 * _MiB  # the server's own, before any kernel
# Tasks (processes and threads) one sandboxed kernel holds: bubblewrap's two, ipykernel's
# main, iopub, heartbeat and control threads, and room for a cell's.
TASKS_PER_KERNEL = 12


@dataclass(frozen=True)
class Capacity:
    """How many kernels each resource allows (``None``: that resource sets no bound here),
    and the smallest of them."""

    memory: int | None
    descriptors: int
    tasks: int | None
    uids: int | None

    @property
    def bounds(self) -> dict[str, int]:
        named = {
            "memory": self.memory,
            "open files": self.descriptors,
            "process ids": self.tasks,
            "kernel uids": self.uids,
        }
        return {name: n for name, n in named.items() if n is not None}

    @property
    def kernels(self) -> int:
        return max(1, min(self.bounds.values()))

    @property
    def limited_by(self) -> str:
        return min(self.bounds, key=lambda name: self.bounds[name])


def machine_capacity(*, local: bool = True, forked: bool = True) -> Capacity:
    """The kernels this machine can hold now: ``local`` kernels (else a gateway's, which take
    only descriptors here), ``forked`` from the forkserver (else new interpreters)."""
    if not local:
        return Capacity(memory=None, descriptors=_descriptor_bound(), tasks=None, uids=None)
    per_kernel = MEMORY_PER_KERNEL["forked" if forked else "started"]
    usable = max(0, int(available_memory() * MEMORY_SHARE) - SERVER_MEMORY)
    return Capacity(
        memory=usable // per_kernel,
        descriptors=_descriptor_bound(),
        tasks=_task_bound(),
        uids=_uid_bound(),
    )


def available_memory() -> int:
    """Bytes a new process may still use: ``MemAvailable``, or less where this process's
    cgroup (a container's) has a lower limit."""
    found = [_meminfo_available()]
    if (cgroup := _cgroup_memory_left()) is not None:
        found.append(cgroup)
    return min(found)


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _cgroup_memory_left() -> int | None:
    """The limit of this process's memory cgroup less its usage (v2, then v1), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                left = _left(Path(root + path), "memory.max", "memory.current")
                if left is not None:
                    return left
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory" + path)
            return _left(base, "memory.limit_in_bytes", "memory.usage_in_bytes")
    return None


def _left(cgroup: Path, limit: str, usage: str) -> int | None:
    try:
        raw = (cgroup / limit).read_text().strip()
        if raw == "max" or int(raw) >= 1 << 60:  # v1's "no limit" is a huge number
            return None
        return max(0, int(raw) - int((cgroup / usage).read_text()))
    except (OSError, ValueError):
        return None


def _descriptor_bound() -> int:
    """Kernels the hard open files limit (the server raises its soft one to it) holds, each
    with its descriptors and one connection (a session's WebSocket)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    spare = hard - RESERVED_DESCRIPTORS - MIN_CONNECTIONS
    return max(0, spare) // (DESCRIPTORS_PER_KERNEL + 1)


def _task_bound() -> int | None:
    """Kernels the machine's free process ids hold, and this uid's process limit where the
    kernels run as the server's uid (root's kernels get uids of their own, and root's
    processes are not counted against ``RLIMIT_NPROC``)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        threads_max = int(Path("/proc/sys/kernel/threads-max").read_text())
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None
    free = min(pid_max, threads_max) - running
    if os.geteuid() != 0:  # every running task counted as this uid's: a bound from below
        nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if nproc != resource.RLIM_INFINITY:
            free = min(free, nproc - running)
    return max(0, free) // TASKS_PER_KERNEL


def _uid_bound() -> int | None:
    """A root server's kernels each lease a uid of their own from the kernel uid range."""
    from kernel_env.kernel.isolation import privilege

    if not privilege.privileged():
        return None
    first, last = privilege.KERNEL_UIDS
    return last - first + 1


def describe(capacity: Capacity) -> str:
    """The status line's words: the kernels this machine holds, and what bounds the figure."""
    bounds = ", ".join(f"{name} {n}" for name, n in capacity.bounds.items())
    return f"capacity: {capacity.kernels} kernels, bound by {capacity.limited_by} ({bounds})"
