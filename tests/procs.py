"""The tests' one reader of /proc: parents, children, descendants, whether a pid runs,
which processes carry a variable in their environment, and how much memory one holds."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and ")"):
    state first, then the parent pid."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parents() -> dict[int, int]:
    """Every visible process's parent pid."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                found[int(entry)] = int(_stat_fields(entry)[1])
    return found


def child_pids(pid: int) -> set[int]:
    """Processes whose parent is ``pid``."""
    return {child for child, parent in parents().items() if parent == pid}


def descendants(pid: int) -> set[int]:
    """Processes whose parent chain leads to ``pid``."""
    table = parents()
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = {p for p, pp in table.items() if pp == parent} - found
        found |= children
        frontier += children
    return found


def alive(pid: int) -> bool:
    """Running (a zombie has exited: it only waits to be reaped by its parent)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int | str) -> bytes:
    """The process's command line (NUL-separated), or b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def running(command_line: bytes) -> set[int]:
    """The processes whose command line (NUL-separated) starts with ``command_line``."""
    return {
        int(p) for p in os.listdir("/proc") if p.isdigit() and cmdline(p).startswith(command_line)
    }


def kernel_pids(pid: int) -> set[int]:
    """The kernels that ``pid`` started: the processes it launched for cold kernels (their
    command line runs ipykernel_launcher; the zygote's names ipykernel too, in its settings),
    and its forkserver's kernels (named ``ke-kernel``)."""
    cold = {child for child in child_pids(pid) if b"ipykernel_launcher" in cmdline(child)}
    return cold | {p for p in descendants(pid) if comm(p) == "ke-kernel"}


def comm(pid: int) -> str:
    """The process's name, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parent(pid: int | str) -> int:
    """The process's parent pid."""
    return int(_stat_fields(pid)[1])


def started(pid: int | str) -> int:
    """When the process started, in clock ticks since boot (to compare with another's)."""
    return int(_stat_fields(pid)[19])


def pid_namespace(pid: int | str) -> str:
    """The process's PID namespace (``pid:[inode]``)."""
    return os.readlink(f"/proc/{pid}/ns/pid")


def environ_has(pid: int | str, entry: bytes) -> bool:
    """Whether the environment ``pid`` started with holds ``entry`` (``NAME=value``); False
    once it is gone or where it cannot be read (another uid's, for a non-root reader)."""
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def carrying(entry: bytes) -> set[int]:
    """This uid's processes whose starting environment holds ``entry`` (``NAME=value``)."""
    uid = os.getuid()
    found = set()
    for p in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid and environ_has(p, entry):
                found.add(int(p))
    return found


def _status_kib(pid: int, field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    assert match is not None, f"no {field} for {pid}"
    return int(match.group(1))


def pss_bytes(pid: int) -> int:
    """Proportional set size, bytes: shared pages counted by the share each process has
    (0 for a process gone, or one whose smaps this user may not read)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_kib(pid: int) -> int:
    """The process's resident memory now, in KiB."""
    return _status_kib(pid, "VmRSS")


def peak_kib(pid: int) -> int:
    """The process's peak resident memory (since start, or since :func:`reset_peak`), in KiB."""
    return _status_kib(pid, "VmHWM")


def reset_peak(pid: int) -> bool:
    """Start the peak again from the current RSS; False where this user may not (an
    unprivileged server is not dumpable, so its ``clear_refs`` is root's)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except PermissionError:
        return False
    return True


@contextlib.contextmanager
def peak_growth(pid: int) -> Iterator[list[float]]:
    """How much the process's peak RSS grew while the block ran, in MiB (the list's one item,
    there after the block). From VmHWM where it can be reset, else from RSS sampled every
    5 ms (what a request that takes longer than that makes the process hold)."""
    grown: list[float] = []
    hwm = reset_peak(pid)
    before = peak_kib(pid) if hwm else rss_kib(pid)
    samples = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            with contextlib.suppress(OSError, AssertionError):
                samples.append(rss_kib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    if not hwm:
        sampler.start()
    try:
        yield grown
    finally:
        done.set()
        if not hwm:
            sampler.join(timeout=5)
        peak = peak_kib(pid) if hwm else max(samples)
        grown.append((peak - before) / 1024)
