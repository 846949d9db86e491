"""Whether this run's unsandboxed kernels get uids of their own, as kernel/local.py decides: a
server running as root gives each kernel a uid of its own wherever that uid can reach the
interpreter (a system Python, or a venv of one); where it cannot (a Python under /root), the
kernel runs as root. A kernel with a uid of its own is never copied live (its copies would share
that uid), so its episode forks by replay."""

from __future__ import annotations

import functools

from kernel_env.kernel.local import kernels_get_own_uids


@functools.cache
def unsandboxed_kernels_get_own_uids() -> bool:
    return kernels_get_own_uids()


def unsandboxed_fork_method() -> str:
    """How an unsandboxed episode forks here: "live", or "replay" where its kernel has a uid
    of its own."""
    return "replay" if unsandboxed_kernels_get_own_uids() else "live"


OWN_UIDS_REASON = (
    "as root with a Python every uid can reach, unsandboxed kernels run as uids of their own "
    "and fork by replay, never live"
)
