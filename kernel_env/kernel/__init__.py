"""Kernel backends: one kernel process each, driven by the shared logic in ``base``.

The gateway backend loads on first use: it needs httpx and websockets, which a local episode
never does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kernel_env.kernel.base import ExecutionResult, Kernel, KernelSource, StdinHandler
from kernel_env.kernel.local import LocalKernel

if TYPE_CHECKING:
    from kernel_env.kernel.gateway import GatewayConfig, GatewayKernel

__all__ = [
    "ExecutionResult",
    "GatewayConfig",
    "GatewayKernel",
    "Kernel",
    "KernelSource",
    "LocalKernel",
    "StdinHandler",
]

_LAZY = {"GatewayConfig": "kernel_env.kernel.gateway", "GatewayKernel": "kernel_env.kernel.gateway"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
