"""Where episode kernels come from: a local ipykernel by default, a gateway when one is named.

A *kernel source* is what ``KernelEnvironment(kernel_source=...)``, ``KernelEnv(kernel_source=...)``
and ``KernelPool`` take: an async callable returning a started, ready kernel. ::

    source = kernel_source_from(settings)       # anything with gateway_url / gateway_token
    source = gateway_source(GatewayConfig(url="https://eg.example:8888", token="..."))
    env = KernelEnv(kernel_source=source)
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.isolation import privilege
from kernel_env.kernel.isolation.sandbox import SandboxLimits, sandbox_problem
from kernel_env.kernel.isolation.sandbox import describe_limits as sandbox_limits
from kernel_env.kernel.local import LocalKernel
from kernel_env.kernel.local import describe_isolation as unsandboxed_limits
from kernel_env.kernel.merging import merge_environ, merge_problem
from kernel_env.kernel.modes import SANDBOX_MODES, SandboxMode
from kernel_env.kernel.sandboxed import SandboxedKernel

if TYPE_CHECKING:  # the gateway backend (httpx, websockets) loads only when it is chosen
    from kernel_env.kernel.gateway import GatewayConfig

__all__ = [
    "BackendSettings",
    "describe_backend",
    "describe_limits",
    "gateway_source",
    "kernel_source_from",
    "local_kernel_class",
    "local_source",
]

log = logging.getLogger(__name__)


class BackendSettings(Protocol):
    """What :func:`kernel_source_from` reads (``ServerSettings`` has these fields)."""

    @property
    def gateway_url(self) -> str | None: ...

    @property
    def gateway_token(self) -> str | None: ...


def local_source(sandbox: SandboxMode | str = "auto", **kernel_options: Any) -> KernelSource:
    """A new local kernel per call; ``kernel_options`` go to the kernel class.

    ``sandbox``: ``"auto"`` (bubblewrap where it works, else a plain kernel, said once in the
    log), ``"bwrap"`` (required: fail if it can't be used) or ``"none"``.
    """
    kind = _local_kind(sandbox)

    async def start_local_kernel() -> Kernel:
        kernel = kind(**kernel_options)
        await kernel.start()
        return kernel

    return start_local_kernel


def local_kernel_class(sandbox: SandboxMode | str = "auto") -> type[LocalKernel]:
    """The class of a local kernel under ``sandbox`` (see :func:`local_source`)."""
    return _local_kind(sandbox)


def _local_kind(sandbox: str) -> type[LocalKernel]:
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be 'auto', 'bwrap' or 'none', not {sandbox!r}")
    if sandbox == "none":
        return LocalKernel
    problem = sandbox_problem()
    if problem is None:
        return SandboxedKernel
    if sandbox == "bwrap":
        # As root, an unsandboxed kernel drops to a uid of its own only if that uid can reach
        # this Python (see LocalKernel._lease_uid): else no other mode is a fix.
        python = (sys.executable, sys.prefix, sys.base_prefix, str(Path(__file__).parents[1]))
        if privilege.privileged() and not all(privilege.reachable(p) for p in python):
            raise RuntimeError(
                f"the kernels' sandbox cannot run here: {problem}. Fix that: --sandbox none "
                "would run kernels without it, and as ROOT here (their own uid cannot reach "
                "this Python)"
            )
        raise RuntimeError(
            f"the kernels' sandbox cannot run here: {problem}. Fix that, or choose "
            "--sandbox none (KERNEL_ENV_SANDBOX=none) to run kernels unsandboxed, or "
            "--sandbox auto to fall back to that where the sandbox cannot run"
        )
    _warn_unsandboxed(problem)
    return LocalKernel


@functools.cache
def _warn_unsandboxed(problem: str) -> None:
    log.warning(
        "kernels run WITHOUT the sandbox: %s (install bubblewrap, or pass "
        "sandbox='none' / --sandbox none to silence this)",
        problem,
    )


def describe_limits(settings: BackendSettings | None = None) -> dict[str, str]:
    """What isolates local kernels here, and which limits are in force (for the status
    line, ``/health`` and ``/metadata``); for gateway kernels, that kernel_env isolates none
    of them."""
    url = getattr(settings, "gateway_url", None) if settings is not None else None
    if url:
        return dict(GATEWAY_ISOLATION)
    sandbox = getattr(settings, "sandbox", "auto") or "auto"
    if sandbox != "none" and sandbox_problem() is None:
        return {"sandbox": "bubblewrap", **sandbox_limits()}
    why = "sandbox=none" if sandbox == "none" else sandbox_problem() or ""
    return {"sandbox": f"none ({why})", **unsandboxed_limits()}


# A gateway starts its kernels where and as whom it runs them (Kernel Gateway: as its own
# processes, its own uid, root included); its API reports nothing of how it isolates them.
GATEWAY_ISOLATION = {
    "sandbox": "none from kernel_env: the gateway starts and runs these kernels, and "
    "kernel_env neither sandboxes nor limits them",
    "gateway_isolation": "unknown: the gateway's API does not report how it isolates its "
    "kernels (Kernel Gateway runs them as its own processes, as its own uid, root included)",
}


def gateway_source(config: GatewayConfig, **kernel_options: Any) -> KernelSource:
    """A new gateway kernel per call; ``kernel_options`` go to :class:`GatewayKernel`."""

    from kernel_env.kernel.gateway import GatewayKernel

    async def start_gateway_kernel() -> Kernel:
        kernel = GatewayKernel(config, **kernel_options)
        await kernel.start()
        return kernel

    return start_gateway_kernel


def kernel_source_from(
    settings: BackendSettings | None = None,
    *,
    forkserver: ForkServer | None = None,
    username: str | None = None,
) -> KernelSource:
    """Local kernels (sandboxed per ``settings.sandbox``, default ``"auto"``), or gateway
    kernels when ``settings.gateway_url`` is set. Local kernels fork from ``forkserver``
    when one is given and ready, and mark their memory mergeable when
    ``settings.merge_pages`` (a RuntimeError where the host cannot merge). ``username``: the
    ``KERNEL_USERNAME`` gateway kernels start as, over the settings' own (a tenant's; local
    kernels ignore it).

    Optional attributes: ``gateway_kernel_name`` (default ``python3``), and any other
    :class:`GatewayConfig` field prefixed ``gateway_`` (``gateway_start_timeout``, ...).
    An empty token counts as none.
    """
    url = getattr(settings, "gateway_url", None) if settings is not None else None
    if not url:
        sandbox = getattr(settings, "sandbox", "auto") or "auto"
        options: dict[str, Any] = {"forkserver": forkserver} if forkserver is not None else {}
        hidden = tuple(getattr(settings, "secret_files", ()))
        if hidden and _local_kind(sandbox) is SandboxedKernel:
            options["limits"] = SandboxLimits(hidden_paths=hidden)
        if getattr(settings, "merge_pages", False):
            if (problem := merge_problem()) is not None:
                raise RuntimeError(f"--merge-pages cannot work here: {problem}")
            options["extra_env"] = merge_environ()
        return local_source(sandbox, **options)
    from kernel_env.kernel.gateway import GatewayConfig

    options = {}
    for name in GatewayConfig.__dataclass_fields__:
        value = getattr(settings, f"gateway_{name}", None)
        if value is not None and value != "":
            options[name] = value
    entries = options.get("env")
    if entries is not None and not isinstance(entries, Mapping):  # a server's "KERNEL_X=v"s
        options["env"] = dict(entry.split("=", 1) for entry in entries)
    user = {"env": {"KERNEL_USERNAME": username}} if username else {}
    return gateway_source(GatewayConfig(**options), **user)


def describe_backend(settings: BackendSettings | None = None) -> str:
    """Where :func:`kernel_source_from` would run kernels, in words (for a status line)."""
    url = getattr(settings, "gateway_url", None) if settings is not None else None
    if url:
        name = getattr(settings, "gateway_kernel_name", None) or "python3"
        return f"kernels on the gateway {url} (kernel spec {name!r}), NOT sandboxed by kernel_env"
    sandbox = getattr(settings, "sandbox", "auto") or "auto"
    if sandbox == "none":
        return "local kernels, NOT sandboxed (sandbox=none)"
    problem = sandbox_problem()
    if problem is None:
        return "local kernels, sandboxed (bubblewrap)"
    if sandbox == "bwrap":
        return f"local kernels: the required sandbox is unavailable ({problem})"
    return f"local kernels, NOT sandboxed: {problem}"
