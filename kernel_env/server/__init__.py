"""``kernel-env serve``: an OpenEnv-compatible HTTP + WebSocket server backed by real kernels.

``create_app`` loads FastAPI on first use, so that reading the settings (``kernel-env --help``
builds its flags from them) costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernel_env.server.settings import ServerSettings

if TYPE_CHECKING:
    from kernel_env.server.app import create_app

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kernel_env.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
