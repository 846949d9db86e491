"""No process a test started outlives the run: a pytest plugin (tests/conftest.py loads it).

At its start, each pytest process (the one of ``-n 0``, or xdist's controller and each of its
workers) puts a mark of its own in its environment, ``PYTEST_KERNEL_ENV_RUN=<pid>-<random>``,
which every process it starts inherits, and the processes those start, unless one is given an
environment of its own. At its end (after the session's fixtures are torn down), the processes
still running that it started are: its descendants (a kernel gets a minimal environment, but
stays the child of what started it), and the processes anywhere that carry its mark (a
daemon that double-forked away, to init). The controller adds the run's orphans: processes
that started after it, as its uid (or, for root, a kernel's uid), whose parent ended (init's
children now), and that run in a PID namespace of their own (a sandbox's init cut loose before
it asked to die with its parent: a minimal environment, no mark) or name the checkout on their
command line. Those still alive after a grace period are killed and listed, and the run fails
(exit status 1): a worker hands its list to the controller.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from procs import alive, carrying, cmdline, descendants, parent, pid_namespace, started

from kernel_env.kernel.isolation.privilege import KERNEL_UIDS

MARK = "PYTEST_KERNEL_ENV_RUN"  # not KERNEL_ENV_*: the settings' names, which tests list
GRACE = 5.0  # s for a process on its way out (a server draining) to end by itself
_LEAKED = "kernel_env_leaked_processes"


def _mark() -> bytes:
    return f"{MARK}={os.environ[MARK]}".encode()


_leaked_key = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    os.environ[MARK] = f"{os.getpid()}-{secrets.token_hex(4)}"
    config.stash[_leaked_key] = []


def leftovers() -> set[int]:
    """The running processes this pytest process started (itself excluded)."""
    found = descendants(os.getpid()) | carrying(_mark())
    found.discard(os.getpid())
    return {pid for pid in found if alive(pid)}


def orphans(root: Path) -> set[int]:
    """The run's orphans (see the module's docstring), once its own processes have ended."""
    me, own = os.getpid(), pid_namespace("self")
    since, checkout = started(me), bytes(root)
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            uid = os.stat(f"/proc/{entry}").st_uid
            kernels = os.getuid() == 0 and KERNEL_UIDS[0] <= uid <= KERNEL_UIDS[1]
            run = (uid == os.getuid() or kernels) and started(entry) >= since
            orphaned = run and parent(entry) == 1
            if orphaned and (pid_namespace(entry) != own or checkout in cmdline(entry)):
                found.add(int(entry))
    return found


def _describe(pid: int) -> str:
    command = cmdline(pid).replace(b"\0", b" ").decode(errors="replace").strip()
    return f"pid {pid}: {command[:200] or '(gone)'}"


def _reap(pids: set[int]) -> list[str]:
    """The processes of ``pids`` still alive after GRACE s, described, then killed."""
    deadline = time.monotonic() + GRACE
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = {pid for pid in pids if alive(pid)}
    described = [_describe(pid) for pid in sorted(pids)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return described


@pytest.hookimpl(trylast=True)  # after the session's fixtures and xdist's workers are gone
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports it
        workeroutput[_LEAKED] = _reap(leftovers())
        return
    leaked = _reap(leftovers())
    leaked += _reap(orphans(session.config.rootpath))  # once the rest has ended
    leaked = session.config.stash[_leaked_key] + leaked
    session.config.stash[_leaked_key] = leaked
    if leaked:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_testnodedown(node: Any) -> None:
    """A worker's list, in the controller."""
    leaked = getattr(node, "workeroutput", {}).get(_LEAKED, [])
    node.config.stash[_leaked_key].extend(f"{node.gateway.id}: {line}" for line in leaked)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    leaked = terminalreporter.config.stash.get(_leaked_key, [])
    if leaked:
        terminalreporter.section("processes the tests left running (killed)", red=True)
        for line in leaked:
            terminalreporter.line(line)
        terminalreporter.line(f"the run fails: {len(leaked)} process(es) outlived it")
        terminalreporter.stats.setdefault("leaked", []).extend(leaked)  # "N leaked" below
