"""The ipykernel and jupyter_client releases kernel_env was tested with.

The forkserver's kernel template (:mod:`.fork.template`) and the per-cell tuning
(:mod:`kernel_env.inkernel.tuning`) reach into ipykernel's internals, which any release may
change. A new release must never make kernels fail: with a version outside :data:`TESTED`,
the zygote does not start (kernels start cold, and the log says why once) and the tuning
stays off; cold kernels and kernel_env's extension use only what ipykernel documents, or
check what they touch first. ``make test-lowest`` runs the kernel tests against the lowest
releases here (CI runs them against the newest, pinned by ``constraints.txt``).

Standard library only: the host, the zygote and the kernel each import it.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping

__all__ = ["TESTED", "installed", "untested", "welcomes_subscribers"]

Version = tuple[int, ...]

# package -> (lowest, highest) major.minor tested, both included. ipykernel 6.29 runs cold
# kernels (pyproject admits it), but a kernel forked from it differs from a cold one (sys.path,
# top-level await, the debugger: make test-lowest), so 6.x starts every kernel cold.
TESTED: dict[str, tuple[Version, Version]] = {
    "ipykernel": ((7, 0), (7, 4)),
    "jupyter_client": ((8, 6), (8, 10)),
}


def _parse(text: str) -> Version:
    """``"7.4.0rc1"`` -> ``(7, 4, 0)``: the leading release numbers."""
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(p) for p in match.group().split(".")) if match else ()


def installed(name: str) -> Version | None:
    """The version of ``name`` this process runs (its loaded module's, else its
    distribution's), or None when it has none."""
    module = sys.modules.get(name)
    info = getattr(module, "version_info", None)
    if isinstance(info, tuple) and info and all(isinstance(p, int) for p in info[:2]):
        return tuple(p for p in info if isinstance(p, int))
    import importlib.metadata  # only here: a kernel that imports this module seldom needs it

    try:
        return _parse(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def untested(
    tested: Mapping[str, tuple[Version, Version]] | None = None,
    found: Mapping[str, Version | None] | None = None,
) -> str | None:
    """Why the installed releases (``found``, by default this process's) are not ones
    kernel_env was tested with (``tested``, by default :data:`TESTED`), or None."""
    tested = TESTED if tested is None else tested
    for name, (low, high) in tested.items():
        version = found[name] if found is not None and name in found else installed(name)
        if version is None:
            return f"{name} is not installed"
        if not tuple(low) <= version[:2] <= tuple(high):
            shown = ".".join(map(str, version))
            span = f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}"
            return f"{name} {shown} is not a release kernel_env was tested with ({span})"
    return None


@functools.cache
def welcomes_subscribers() -> bool:
    """Whether this environment's ipykernel welcomes each iopub subscriber (7 and later)."""
    version = installed("ipykernel")
    return version is not None and version[:1] >= (7,)
