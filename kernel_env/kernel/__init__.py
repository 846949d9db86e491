"""Kernel backends: one kernel process each, driven by the shared logic in ``base``.

Names load on first use: ``kernel_env.kernel.modes`` (the CLI's vocabulary) costs nothing, and
the gateway backend, which needs httpx and websockets, loads only when chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel_env.kernel.base import ExecutionResult, Kernel, KernelSource, StdinHandler
    from kernel_env.kernel.gateway import GatewayConfig, GatewayKernel
    from kernel_env.kernel.local import LocalKernel

__all__ = [
    "ExecutionResult",
    "GatewayConfig",
    "GatewayKernel",
    "Kernel",
    "KernelSource",
    "LocalKernel",
    "StdinHandler",
]

_HOMES = {
    "ExecutionResult": "base",
    "Kernel": "base",
    "KernelSource": "base",
    "StdinHandler": "base",
    "GatewayConfig": "gateway",
    "GatewayKernel": "gateway",
    "LocalKernel": "local",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"kernel_env.kernel.{home}"), name)
