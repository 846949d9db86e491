"""The words for how local kernels run, shared by the factory, the server's settings and the
CLI (a module of its own, light to import: ``kernel-env --help`` loads no kernel machinery)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["SANDBOX_MODES", "SandboxMode"]

# bwrap: the sandbox is required (a host where it cannot run is refused);
# auto: the sandbox where it runs, else unsandboxed kernels (said once); none: never sandboxed.
SandboxMode = Literal["auto", "bwrap", "none"]
SANDBOX_MODES: tuple[str, ...] = get_args(SandboxMode)
