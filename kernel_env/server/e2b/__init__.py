"""E2B's sandbox protocol on ``kernel-env serve``: the E2B SDK, unchanged, on kernel_env.

Point the SDK at the server (``E2B_API_URL`` and ``E2B_SANDBOX_URL`` = the server's URL,
``E2B_API_KEY`` = its token) and a sandbox is a kernel_env session: the same pool, sandbox,
limits and tenants as OpenEnv's front door. The modules, by concept:

- :mod:`.door`: the middleware that routes E2B's traffic (a sandbox's, by its headers; the
  control plane's, by its paths) ahead of kernel_env's own auth;
- :mod:`.sandboxes`: sandboxes over sessions: templates, timeouts, tokens, pause;
- :mod:`.control`: E2B's REST API (create, list, get, connect, timeout, kill, pause, resume);
- :mod:`.interpreter`: the code interpreter (``/execute``, contexts);
- :mod:`.envd`: the sandbox daemon's ``/health`` (and its Connect RPC services);
- :mod:`.kernelcalls`: envd's file and process operations, as kernel calls of the session;
- :mod:`.failures`: exceptions -> E2B's answers (its JSON errors, Connect codes, error
  lines), in one place.

Like every door, it speaks to sessions only through the session core's public methods
(:class:`~kernel_env.server.sessions.Session`), never to a kernel.

``add_e2b(app)`` mounts it all; docs/e2b.md is the user's guide.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["EXTRA_MODULES", "add_e2b", "available"]

log = logging.getLogger(__name__)

# What the ``e2b`` extra installs (``pip install 'kernel-env[e2b]'``), by import name.
EXTRA_MODULES = ("connectrpc", "protobuf", "multipart")


def available() -> bool:
    """Whether the ``e2b`` extra is installed."""
    return all(importlib.util.find_spec(name) is not None for name in EXTRA_MODULES)


def add_e2b(app: FastAPI) -> None:
    """Add the E2B front door to ``app`` (call it where middleware is added: the door sits
    inside the browser guard and ahead of the token check, which it does itself). Without
    the ``e2b`` extra there is no door, and E2B's paths are kernel_env's: 401 or 404."""
    if not available():
        log.debug("E2B's protocol is off: pip install 'kernel-env[e2b]' to serve it")
        return
    from kernel_env.server.e2b.mount import mount

    mount(app)
