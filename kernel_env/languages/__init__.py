"""Episodes in kernels other than Python's: R (IRkernel), Bash (bash_kernel) and
JavaScript/TypeScript (Deno), or any other installed Jupyter kernelspec for plain steps.

- ``protocol``: the host <-> kernel helper protocol, defined once for every language
  (tagged stdin requests, a MIME type for final answers);
- ``catalog``: which kernels are installed, what each language's shim offers, and a kernel
  source per kernel name (local, sandboxed where bubblewrap works);
- ``shims/``: the helpers in each language (``context``, ``llm_query``, ``FINAL`` ...), sent to
  the kernel as its episode's setup cell;
- ``bash_kernel``: bash_kernel with kernel_env's stdin bridge; it runs in the bash kernel's own
  process (bash_kernel has no stdin requests of its own).

Python episodes keep ``kernel_env.kernel_side`` and the forkserver. Names load on first use.
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
