"""Kernel backends: one kernel process each, driven by the shared logic in ``base``."""

from kernel_env.kernel.base import ExecutionResult, Kernel, StdinHandler
from kernel_env.kernel.gateway import GatewayConfig, GatewayKernel
from kernel_env.kernel.local import LocalKernel

__all__ = [
    "ExecutionResult",
    "GatewayConfig",
    "GatewayKernel",
    "Kernel",
    "LocalKernel",
    "StdinHandler",
]
