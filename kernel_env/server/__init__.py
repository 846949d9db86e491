"""``kernel-env serve``: an OpenEnv-compatible HTTP + WebSocket server backed by real kernels."""

from kernel_env.server.app import create_app
from kernel_env.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
