"""The words for how kernels run, shared by the factory, the gateway backend, the server's
settings and the CLI (a module of its own, light to import: ``kernel-env --help`` loads no
kernel machinery)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DEFAULT_KERNEL_USERNAME", "SANDBOX_MODES", "SandboxMode"]

# bwrap: the sandbox is required (a host where it cannot run is refused);
# auto: the sandbox where it runs, else unsandboxed kernels (said once); none: never sandboxed.
SandboxMode = Literal["auto", "bwrap", "none"]
SANDBOX_MODES: tuple[str, ...] = get_args(SandboxMode)

# The KERNEL_USERNAME gateway kernels start with unless one is given: Enterprise Gateway
# refuses a kernel for root, and takes the server's own user when none is sent.
DEFAULT_KERNEL_USERNAME = "kernel-env"
