"""A Ray cluster of several nodes on this machine, in a network namespace that has only ``lo``.

Ray binds the machine's interface address even when told ``127.0.0.1``, and tests send traffic
to loopback only; in a namespace whose only interface is ``lo``, Ray binds 127.0.0.1. The
cluster and its driver both live there: :class:`RayNetns` starts the namespace's first process
(this file, run as a script, under ``unshare --net --pid --mount-proc``), which brings ``lo``
up, starts the nodes with ``ray.cluster_utils.Cluster`` (each a raylet with its own node id),
connects as the cluster's driver, and then runs the functions of ``ray_scenarios`` that a test
names, one at a time, each answered with one JSON line. Closing it ends that first process, and
with it every process of the namespace: Ray's, the hosts', their kernels'.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Node death is noticed in ~3 s instead of Ray's default ~15-30 s (the failure tests' time).
_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def start_cluster(nodes: list[dict[str, Any]], *, tries: int = 2) -> RayNetns:
    """A :class:`RayNetns`, tried again once if a node did not come up: Ray gives a raylet
    30 s to register, which a loaded 2-core machine (a whole test suite beside it) can miss."""
    for attempt in range(1, tries + 1):
        try:
            return RayNetns(nodes)
        except RuntimeError as exc:
            if attempt == tries or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")


class RayNetns:
    """``nodes``: each node's ``ray.cluster_utils.Cluster.add_node`` arguments, the head's
    first (``resources``, ``num_cpus``)."""

    def __init__(self, nodes: list[dict[str, Any]], *, start_timeout: float = 180.0) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kray-", dir="/tmp"))  # short: socket paths
        self.log = self.tmp / "driver.log"
        spec = json.dumps({"nodes": nodes, "tmp": str(self.tmp)})
        command = [
            "unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child",
            sys.executable, str(Path(__file__).resolve()), spec,
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=HERE.parent
            )
        try:
            ready = self._reply(start_timeout)
        except BaseException:
            self.close()
            raise
        self.address: str = ready["address"]
        self.node_ids: list[str] = ready["node_ids"]  # in the order of ``nodes``

    def call(self, name: str, *, timeout: float = 60.0, **kwargs: Any) -> Any:
        """Run ``ray_scenarios.<name>(cluster, **kwargs)`` in the namespace's driver; its
        result (JSON), or AssertionError with the driver's traceback."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"fn": name, "kwargs": kwargs}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def _reply(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"no answer in {timeout:g} s; driver log:\n{self.tail()}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the namespace's driver ended; its log:\n{self.tail()}")
            line += chunk
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"in the namespace's driver:\n{reply['error']}")
        return reply["ok"]

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        """End the namespace (all of its processes) and remove its files."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the driver exits; the namespace ends with it
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # --kill-child: unshare's end kills the namespace's first process
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        _sweep_cgroups()


def _sweep_cgroups() -> None:
    """The kernel cgroups of hosts that ended without shutting down (killed with their node, or
    by Ray): named by a pid of the namespace, which the usual sweep (by pid, in this one) may
    take for a live process; any server's that no live process holds the lock of goes."""
    from kernel_env.kernel.isolation import cgroups

    for tree in cgroups._server_trees():
        for server in [p for p in tree.iterdir() if p.is_dir() and p.name.isdigit()]:
            cgroups._sweep(server)


class Driver:
    """What a scenario gets: the cluster, its nodes (the head first) and their ids."""

    def __init__(self, cluster: Any, nodes: list[Any]) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.node_ids: list[str] = [node.node_id for node in nodes]
        self.address: str = cluster.address


def _serve(spec: dict[str, Any]) -> None:
    """The namespace's first process: the cluster, then one scenario per line of stdin."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what Ray or a scenario prints goes to the log, never into the answers
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["RAY_TMPDIR"] = spec["tmp"]  # Ray's files (its address file too): the test's
    os.makedirs(os.path.join(spec["tmp"], "ray"), exist_ok=True)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    sys.path.insert(0, str(HERE))
    import ray_scenarios

    common = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024 * 1024}
    head, *others = spec["nodes"]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common,
            **head,
            "temp_dir": spec["tmp"],
            "include_dashboard": False,
            "include_log_monitor": False,  # no driver reads workers' logs: ~4 s less start
            "_system_config": _SYSTEM_CONFIG,
        },
    )
    nodes = [cluster.head_node] + [cluster.add_node(**common, **node) for node in others]
    ray.init(address=cluster.address, log_to_driver=False, logging_level="warning")
    cluster.wait_for_nodes()
    driver = Driver(cluster, nodes)
    answer.write(json.dumps({"ok": {"address": driver.address, "node_ids": driver.node_ids}}))
    answer.write("\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = getattr(ray_scenarios, request["fn"])(driver, **request["kwargs"])
            reply = {"ok": result}
        except BaseException:
            reply = {"error": traceback.format_exc()}
        answer.write(json.dumps(reply) + "\n")
    try:  # the hosts shut their kernels down (and remove their cgroups) before all ends
        from kernel_env.ray import stop_hosts

        stop_hosts(timeout=15)
    finally:
        os._exit(0)  # the namespace's first process: its end ends every process in it


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
