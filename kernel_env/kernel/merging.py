"""Same-page merging of local kernels' memory (the Linux kernel's KSM), which a server's
``--merge-pages`` turns on: whether this host can merge, whether it does, and what a kernel's
environment carries to ask for it.

A forked kernel's private pages are mostly the forkserver's, copied on write when a refcount
changed, and many of those copies are byte for byte the same in every kernel. A kernel whose
environment holds :data:`~kernel_env.inkernel.contract.MERGE_PAGES_ENV` = ``1`` marks all its
memory mergeable as it starts (``prctl(PR_SET_MEMORY_MERGE, 1)``, Linux 6.4+:
:func:`kernel_env.inkernel.tuning.merge_pages`); ksmd, the Linux kernel's scanner, then
merges identical pages into one, copy-on-write (figures: ``benchmarks/README.md``).

Merging is the operator's choice, twice over: the server marks its kernels only when asked,
and ksmd runs only when the host's root turns it on (``echo 1 > /sys/kernel/mm/ksm/run``):
a host-wide setting kernel_env leaves alone, like the rest of the host's memory policy. It
costs ksmd's CPU and opens a timing side channel between kernels, a write to a merged page
being slower (``docs/security.md``). Host side.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from kernel_env.inkernel.contract import MERGE_PAGES_ENV

__all__ = ["KSM", "describe_merging", "merge_environ", "merge_problem"]

KSM = Path("/sys/kernel/mm/ksm")
_PR_GET_MEMORY_MERGE = 68  # prctl(2), Linux 6.4+: whether this process's memory is marked


def merge_environ() -> dict[str, str]:
    """What a kernel's environment holds to mark its memory mergeable as it starts."""
    return {MERGE_PAGES_ENV: "1"}


def merge_problem() -> str | None:
    """Why this host cannot merge kernels' pages, or None when it can."""
    if not (KSM / "run").exists():
        return f"this Linux kernel has no KSM ({KSM} is missing: CONFIG_KSM)"
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)  # prctl is variadic: whole longs, as the kernel reads them
    if libc.prctl(_PR_GET_MEMORY_MERGE, zero, zero, zero, zero) < 0:
        code = ctypes.get_errno()
        if code == errno.EINVAL:
            release = os.uname().release
            return f"prctl(PR_SET_MEMORY_MERGE) needs Linux 6.4 or later (this is {release})"
        return f"prctl(PR_GET_MEMORY_MERGE) failed: {os.strerror(code)}"
    return None


def describe_merging() -> str:
    """The status line's words for a server whose kernels offer their pages."""
    said = "memory merging (KSM): every kernel offers its pages"
    if _ksm("run") == "1":
        pages, sleep = _ksm("pages_to_scan"), _ksm("sleep_millisecs")
        return f"{said}; ksmd scans {pages} pages every {sleep} ms"
    return (
        f"{said}, but ksmd is OFF here: nothing merges until the host's root starts it "
        f"(echo 1 > {KSM / 'run'})"
    )


def _ksm(name: str) -> str:
    try:
        return (KSM / name).read_text().strip()
    except OSError:
        return "?"
