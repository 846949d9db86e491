"""Episodes in kernels other than Python's: R (IRkernel), Bash (bash_kernel) and
JavaScript/TypeScript (Deno), or any other installed Jupyter kernelspec for plain steps.

- ``catalog``: which kernels are installed, what each language's shim offers, and a kernel
  source per kernel name (local, sandboxed where bubblewrap works);
- ``relay``: serves a TCP-only kernel (Deno's) on the IPC sockets the host connects to; its
  own process beside the kernel, run by path, not code in the kernel.

What runs in those kernels lives in ``kernel_env.inkernel``: each language's helpers
(``shims/``, sent to the kernel as its episode's setup cell), the bash kernel with kernel_env's
stdin bridge (``bash_kernel``), and the requests they send the host, defined once for every
language with Python's (``contract``). Names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel_env.languages.catalog import (
        DEFAULT_KERNEL,
        PYTHON,
        KernelMenu,
        Language,
        installed_kernels,
        language_for,
    )

__all__ = [
    "DEFAULT_KERNEL",
    "PYTHON",
    "KernelMenu",
    "Language",
    "installed_kernels",
    "language_for",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("kernel_env.languages.catalog"), name)
