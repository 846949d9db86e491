"""kernel_env on a real Ray cluster: three raylets on this machine (a head that declares no
``kernel_env`` resource, and two nodes with three kernel slots each), in a network namespace of
their own with only loopback (``raynet``). What runs inside is in ``ray_scenarios``."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from raynet import RayNetns, start_cluster

from kernel_env.ray.placement import HostLoad, choose

SLOTS = 3


def _can_run_a_cluster() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'kernel-env[ray]')"
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return "the test cluster's network namespace needs root, unshare and ip"
    return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayNetns]:
    problem = _can_run_a_cluster()
    if problem:
        pytest.skip(problem)
    nodes = [
        {"num_cpus": 1},  # the head, a trainer's node: no kernel_env resource
        {"num_cpus": 0, "resources": {"kernel_env": SLOTS}},
        {"num_cpus": 0, "resources": {"kernel_env": SLOTS}},
    ]
    net = start_cluster(nodes)
    try:
        loads = net.call("hosts", timeout=90)
        assert sorted(loads) == sorted(net.node_ids[1:]), loads
        yield net
    finally:
        net.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_episodes_land_on_every_host_node_and_none_elsewhere(cluster: RayNetns) -> None:
    """Four episodes spread over both hosts (least loaded first: two each), none on the head;
    each episode's variables are its own, and a new episode sees none of them."""
    head, *host_nodes = cluster.node_ids
    got = cluster.call("placement", episodes=4)
    assert sorted(got["nodes"]) == sorted(host_nodes * 2)
    assert head not in got["nodes"]
    assert got["seen"] == ["0", "1", "2", "3"]
    assert "NameError" in got["fresh"]
    assert sorted(got["load"]) == sorted(host_nodes)
    for node, load in got["load"].items():
        assert load["alive"] and load["node_id"] == node
        assert load["sessions"] == 2 and load["slots"] == SLOTS
        assert load["kernels"] <= SLOTS and load["episodes_per_s"] > 0


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_episode_does_what_a_kernel_env_episode_does(cluster: RayNetns, tmp_path: Path) -> None:
    """reset, step, streaming, fork, state, export; llm_query answered by the host's model and
    by the caller's own; the host's token and model key reach no kernel, state, export or log."""
    tmp_path.chmod(0o777)
    got = cluster.call("features", export_dir=str(tmp_path))
    assert got["host_llm"] == "host model says hi"
    assert got["caller_llm"] == "caller:hello"
    assert "streamed" in got["streamed"]
    assert got["fork_node_same"] and got["fork_x"] == "42" and got["x_after_fork"] == "41"
    assert got["reward"] == 1.0 and got["done"]
    notebook = json.loads(got["notebook"])
    assert any("FINAL" in "".join(cell["source"]) for cell in notebook["cells"])
    for secret in (got["token"], got["api_key"]):
        for place in ("kernel_env", "state", "notebook"):
            assert secret not in got[place], place
    assert got["ray_logs_with_a_secret"] == []
    # Nothing of the host's Ray worker inside the sandbox: no descriptor of its files (logs,
    # session dir), and its session dir is not even visible.
    audit = json.loads(got["sandbox_fds"])
    held = audit["held"]
    assert audit["unreadable"] == [] and len(held[audit["me"]]) > 3  # the kernel's own too
    targets = [t for fds in held.values() for t in fds.values()]
    assert not [t for t in targets if got["ray_dir"] in t or "/ray/" in t], targets
    stdio = [fds[n] for fds in held.values() for n in "012" if n in fds]
    assert all(t == "/dev/null" or t.startswith("pipe:") for t in stdio), stdio
    assert got["sees_ray_dir"].strip() == "False"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_host_and_its_kernels_run_at_the_raylets_priority_not_rays_workers(
    cluster: RayNetns,
) -> None:
    """Ray starts its workers at niceness 15; a host takes its raylet's back, for every thread
    and everything it starts (its forkserver and kernels), so that its kernels do not get the
    node's CPU last on a busy node."""
    got = cluster.call("priority")
    assert got["task"] == 15  # what Ray gives a worker (its worker_niceness)
    assert sorted(got["hosts"]) == sorted(cluster.node_ids[1:])
    for node, seen in got["hosts"].items():
        assert seen["raylet"] == 0, (node, seen)
        assert seen["threads"] == [0], (node, seen)
        assert seen["kernels"] >= 1 and seen["below"] == [0], (node, seen)  # forkserver, kernels


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_capacity_bound_holds_and_an_episode_waits_for_room(cluster: RayNetns) -> None:
    """Six slots held: two more episodes wait 2 s, then fail as a full server does; no host
    goes past its slots; an episode asked while full gets in when a slot frees; one placed on
    a host that filled since its client looked goes to the host with room."""
    got = cluster.call("capacity", wait=2.0)
    assert got["slots"] == 2 * SLOTS and got["held"] == 2 * SLOTS
    for refused in got["refused"]:
        assert refused["capacity"] and refused["remote"], refused
        assert "no kernel_env host had a free slot for 2 s" in refused["message"]
    assert got["waited"] >= 2.0
    for load in got["load"].values():
        assert load["sessions"] == SLOTS and load["kernels"] <= SLOTS
    assert got["late_wait"] >= 1.0
    moved = got["moved"]  # placed from a stale view on a host that filled: moved, then ran
    assert moved["placed_on"] == moved["full"] and moved["ran_on"] != moved["full"]
    assert moved["ran"] == "moved"


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_a_host_restarted_by_ray_fails_its_episodes_then_serves_again(cluster: RayNetns) -> None:
    got = cluster.call("host_restart", timeout=120)
    assert got["error"] is not None and "start a new episode" in got["error"]
    assert got["failed_in"] < 5.0  # its socket closed: no waiting out the step timeout
    assert got["ran"] == "served again"
    assert got["pids"][0] != got["pids"][1]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_the_cluster_lists_and_fetches_the_episodes_each_host_kept(cluster: RayNetns) -> None:
    """Each host keeps its episodes in its node's store; the cluster client lists them
    across the hosts (newest first, filtered, each with its host's node) and fetches each
    notebook from the host that keeps it; an unknown id is the unknown-episode error."""
    got = cluster.call("stored", episodes=4, timeout=120)
    ran = {r["episode_id"]: r for r in got["ran"]}
    listed = got["listed"]
    assert sorted(r["episode_id"] for r in listed) == sorted(ran)
    assert {r["node_id"] for r in got["ran"]} == set(cluster.node_ids[1:])  # both hosts
    assert [r["started"] for r in listed] == sorted((r["started"] for r in listed), reverse=True)
    for row in listed:
        assert row["node_id"] == ran[row["episode_id"]]["node_id"]
        assert (row["state"], row["done"], row["steps"]) == ("done", True, 1)
        assert row["reward"] == ran[row["episode_id"]]["reward"]
        nb = nbformat.reads(got["notebooks"][row["episode_id"]], as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernel_env"]["episode_id"] == row["episode_id"]
    assert sorted(r["episode_id"] for r in got["solved"]) == sorted(
        e for e, r in ran.items() if r["reward"] == 1.0
    )
    assert got["unknown"] is not None and got["unknown"].startswith("UnknownEpisode"), got
    assert set(cluster.node_ids[1:]) <= set(got["stores"])  # a store per node


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_killed_node_fails_its_episodes_fast_while_the_rest_complete(cluster: RayNetns) -> None:
    """The example's run with one host's node ended mid-run (kept last: the node stays dead)."""
    head, *host_nodes = cluster.node_ids
    args = ["--episodes", "96", "--concurrency", "6", "--kill-node-after", "1.0"]
    args += ["--capacity-timeout", "20"]
    got = cluster.call("example", args=args, seconds=150, timeout=180)
    summary = got["summary"]
    assert summary["episodes"] == 96
    assert summary["completed"] + summary["failed"] == 96
    assert summary["killed_node"] in host_nodes
    assert summary["failed"] >= 1 and summary["completed"] > summary["failed"], summary
    assert set(summary["per_node"]) <= set(host_nodes) and head not in summary["per_node"]
    # Each failure's kind and text, whole: a long summary is cut short in the report.
    assert all(kind.startswith("HostLost") for kind in summary["failures"]), summary["failures"]
    # Fast: the host ends with its raylet and its sockets close with it, so every episode
    # there fails at once, far inside a step's timeout (the example's steps are quick).
    assert summary["last_failure_after_end_s"] < 10.0, summary
    loads = cluster.call("loads")
    assert summary["killed_node"] not in [n for n, load in loads.items() if load["alive"]]


def test_placement_prefers_the_callers_node_then_the_least_loaded() -> None:
    loads = [HostLoad("a", 1, 4), HostLoad("b", 3, 4), HostLoad("c", 0, 2)]
    assert choose(loads, own_node="b").node_id == "b"  # type: ignore[union-attr]
    assert choose(loads).node_id == "c"  # type: ignore[union-attr]  # all of it free
    assert choose(loads, own_node="z").node_id == "c"  # type: ignore[union-attr]
    full = [HostLoad("a", 4, 4), HostLoad("b", 5, 4)]
    assert choose(full) is None and choose(full, own_node="a") is None
    tied = [HostLoad("a", 0, 2), HostLoad("b", 0, 2)]
    picks = {choose(tied, rng=random.Random(seed)).node_id for seed in range(20)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}  # ties spread


def test_a_hosts_store_is_its_machines_own() -> None:
    """A host's store: the setting's {node_id} and {hostname} filled in; the default store's
    subdirectory for this machine; any other directory as given."""
    pytest.importorskip("ray")
    import socket

    from kernel_env.ray.host import node_store
    from kernel_env.server.settings import default_episodes

    host = socket.gethostname()
    assert node_store("/data/{hostname}/{node_id}", "n1") == f"/data/{host}/n1"
    default = default_episodes(os.environ)
    assert node_store(default, "n1") == os.path.join(default, host)
    assert node_store("/data/episodes", "n1") == "/data/episodes"
