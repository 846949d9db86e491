"""kernel_env on a Ray cluster (``pip install 'kernel-env[ray]'``).

- :mod:`~kernel_env.ray.host`: ``KernelEnvHost``, one node's ``kernel-env serve`` in an actor;
- :mod:`~kernel_env.ray.hosts`: one host per node that declares the ``kernel_env`` resource;
- :mod:`~kernel_env.ray.placement`: which host a new episode goes to (pure);
- :mod:`~kernel_env.ray.cluster`: ``KernelEnvCluster``, the client that places episodes.

docs/rl-training.md#on-a-ray-cluster says how to deploy it, how it fails and what it costs.
Nothing else in kernel_env imports Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel_env.ray.cluster import ClusterEpisode, HostLost, KernelEnvCluster
    from kernel_env.ray.hosts import start_hosts, stop_hosts

__all__ = ["ClusterEpisode", "HostLost", "KernelEnvCluster", "start_hosts", "stop_hosts"]

_WHERE = {
    "ClusterEpisode": "cluster",
    "HostLost": "cluster",
    "KernelEnvCluster": "cluster",
    "start_hosts": "hosts",
    "stop_hosts": "hosts",
}


def __getattr__(name: str) -> Any:
    """Loaded on first use: Ray's import takes a second."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"kernel_env.ray.{module}"), name)
