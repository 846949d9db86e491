"""The hosts of a Ray cluster: one :class:`KernelEnvHost` actor per node that opts in.

A node opts in by declaring the custom resource ``kernel_env`` (``ray start --resources
'{"kernel_env": 16}'``): its value is the node's kernel slots. Its host is a detached, named
actor (``kernel_env_host:<node id>`` in the namespace ``kernel_env``) pinned to that node and
holding all of those units, so no second host lands there and the cluster's kernels are bounded
by what the nodes declare. Ray restarts a host that dies while its node lives; a node that
joins later (the autoscaler's) gets its host when a client next looks.
"""

from __future__ import annotations

from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kernel_env.ray.host import KernelEnvHost

__all__ = ["NAMESPACE", "RESOURCE", "host_name", "kernel_nodes", "start_hosts", "stop_hosts"]

RESOURCE = "kernel_env"
NAMESPACE = "kernel_env"

_HostActor = ray.remote(KernelEnvHost)


def host_name(node_id: str) -> str:
    return f"kernel_env_host:{node_id}"


def kernel_nodes() -> dict[str, int]:
    """The live nodes that declare ``kernel_env``, and their slots (whole units)."""
    return {
        node["NodeID"]: int(node["Resources"][RESOURCE])
        for node in ray.nodes()
        if node.get("Alive") and node.get("Resources", {}).get(RESOURCE, 0) >= 1
    }


def host_for(node_id: str, slots: int, settings: dict[str, Any] | None = None) -> ActorHandle:
    """The node's host: the one running, or a new one (the first caller's ``settings`` win)."""
    options = _HostActor.options(
        name=host_name(node_id),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",  # shared by every driver, and outlives the one that started it
        num_cpus=0,
        resources={RESOURCE: slots},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_restarts=-1,
        max_concurrency=1000,
    )
    return cast(ActorHandle, options.remote(slots, settings))


def start_hosts(settings: dict[str, Any] | None = None) -> dict[str, ActorHandle]:
    """A host on every node that declares ``kernel_env`` (the running ones kept), by node id;
    each is serving once this returns."""
    hosts = {node: host_for(node, slots, settings) for node, slots in kernel_nodes().items()}
    ray.get([host.ping.remote() for host in hosts.values()])
    return hosts


def stop_hosts(timeout: float = 30.0) -> int:
    """Drain and end every host (their episodes end); returns how many were found."""
    found = []
    for node in kernel_nodes():
        try:
            found.append(ray.get_actor(host_name(node), namespace=NAMESPACE))
        except ValueError:  # this node has no host
            continue
    ray.wait([host.close.remote() for host in found], num_returns=len(found), timeout=timeout)
    for host in found:
        ray.kill(host, no_restart=True)
    return len(found)
