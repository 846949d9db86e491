"""Kernel backends: one kernel process each, driven by the shared logic in ``base``.

By role, and by the process the code runs in:

- the driver and the backends, in the host: ``base`` (readiness, execute, the timeout
  ladder), ``local`` (a kernel on this host), ``sandboxed`` (the same in bubblewrap),
  ``gateway`` (a Kernel Gateway's kernel), ``scripted`` (an in-process kernel that answers
  from a table, for tests), ``factory`` (kernel sources), ``pool`` (warm kernels);
- the host's plumbing of a local kernel: ``launch`` (command line, environment, launch
  guard), ``manager`` (jupyter_client's supervision), ``channels`` (the host's channel
  client), ``messages`` (the host's message reader), ``versions`` (the releases tested);
- ``isolation/``: sandbox, cgroups, uids, runtime dirs, seccomp (its ``__init__`` says its rule);
- ``fork/``: the forkserver, its zygote and spawner, and live forks, which run outside the
  host process (its ``__init__`` says their rules).

What runs *inside* a kernel lives beside this package, in ``kernel_env.inkernel`` (the
episode's helpers, the per-cell tuning of ipykernel, ...); the host reaches it only through
``kernel_env.inkernel.contract``.

Import rule (``tests/test_layers.py``): modules here import the foundation layer and each
other, never an episode, a client or the server; ``isolation/`` and ``fork/`` are stricter.

Names load on first use: ``kernel_env.kernel.modes`` (the CLI's vocabulary) costs nothing, and
the gateway backend, which needs httpx and websockets, loads only when chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel_env.kernel.base import ExecutionResult, Kernel, KernelSource, StdinHandler
    from kernel_env.kernel.fork.server import ForkServer
    from kernel_env.kernel.gateway import GatewayConfig, GatewayKernel
    from kernel_env.kernel.isolation.sandbox import SandboxLimits
    from kernel_env.kernel.local import LocalKernel
    from kernel_env.kernel.pool import KernelPool
    from kernel_env.kernel.sandboxed import SandboxedKernel
    from kernel_env.kernel.scripted import Cell, ScriptedKernel, ScriptedSource

__all__ = [
    "Cell",
    "ExecutionResult",
    "ForkServer",
    "GatewayConfig",
    "GatewayKernel",
    "Kernel",
    "KernelPool",
    "KernelSource",
    "LocalKernel",
    "SandboxLimits",
    "SandboxedKernel",
    "ScriptedKernel",
    "ScriptedSource",
    "StdinHandler",
]

_HOMES = {
    "Cell": "scripted",
    "ExecutionResult": "base",
    "ForkServer": "fork.server",
    "GatewayConfig": "gateway",
    "GatewayKernel": "gateway",
    "Kernel": "base",
    "KernelPool": "pool",
    "KernelSource": "base",
    "LocalKernel": "local",
    "SandboxLimits": "isolation.sandbox",
    "SandboxedKernel": "sandboxed",
    "ScriptedKernel": "scripted",
    "ScriptedSource": "scripted",
    "StdinHandler": "base",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"kernel_env.kernel.{home}"), name)
