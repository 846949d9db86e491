"""kernel_env on Ray against a single ``kernel-env serve``, side by side in one run.

    python benchmarks/bench_ray.py            # ~5 minutes on 2 cores (root: a network namespace)
    python benchmarks/bench_ray.py --quick    # fewer samples, for a smoke run

Everything runs in a network namespace of its own with only ``lo`` (Ray binds the machine's
interface address otherwise): a Ray cluster of raylets on this machine (a head without the
``kernel_env`` resource, then one host node, then three) and, beside it, a ``kernel-env serve``
with the host's settings. Each host declares a third of this machine's capacity as its slots
(``kernel-env capacity``: what a node of its own would declare). Measured, rounds interleaved:

1. step p50/p95 (``x = 1``, one episode each): the server's ``/ws``; the cluster, steps over
   the host's ``/ws``; the cluster, steps as Ray calls to the host actor (the same sessions);
2. episodes/s (open, reset, two steps, close; 8 at a time) for the same three, one host;
3. episodes/s with three host nodes on this one machine (8 and 24 at a time), the server again
   beside them; episodes placed per host.

Rates are the median of rounds run in turn, so that what else the machine does weighs on all.

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

_INSIDE = "KERNEL_ENV_BENCH_NETNS"
_NOT_UP = 75  # the inner run's exit code when a Ray node did not start
POOL = 4
HOSTS = 3  # host nodes at most on this one machine: each gets a third of what it holds


def host_slots(given: int | None = None) -> int:
    """Each host's slots: ``given`` (``--slots``), or this machine's capacity (``kernel-env
    capacity``, what a node would declare) shared by the hosts this run puts on it."""
    from kernel_env.server.capacity import machine_capacity

    return given or max(1, machine_capacity().kernels // HOSTS)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- the Ray-call transport: the same host, its sessions driven by actor calls -------------------


def ray_call_host() -> Any:
    """A host whose sessions also take reset/step/close as Ray calls (for this comparison)."""
    import ray

    from kernel_env.models import REPLAction
    from kernel_env.ray.host import KernelEnvHost
    from kernel_env.server.auth import DEFAULT_TENANT, Tenant
    from kernel_env.server.openenv import protocol

    owner = Tenant(DEFAULT_TENANT, "operator")

    class RayCallHost(KernelEnvHost):
        async def ray_reset(self, session_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
            runtime = await self._started()
            session = runtime.sessions.get(session_id, owner)
            async with runtime.sessions.request(session):
                obs = await session.reset(kwargs)
            return protocol.observation_payload(obs, session_id=session_id)

        async def ray_step(self, session_id: str, action: dict[str, Any]) -> dict[str, Any]:
            runtime = await self._started()
            session = runtime.sessions.get(session_id, owner)
            async with runtime.sessions.request(session):
                obs = await session.step(REPLAction.model_validate(action))
            return protocol.observation_payload(obs, session_id=session_id)

        async def ray_close(self, session_id: str) -> None:
            runtime = await self._started()
            await runtime.sessions.close_session(runtime.sessions.get(session_id, owner))

    return ray.remote(RayCallHost)


class RayCallEpisode:
    """reset / step / close of one session, each one Ray call (observations parsed as the
    ``/ws`` client parses them)."""

    def __init__(self, host: Any, session_id: str) -> None:
        self.host, self.session_id = host, session_id

    async def reset(self, **kwargs: Any) -> Any:
        from kernel_env.remote import _step_result

        return _step_result(await self.host.ray_reset.remote(self.session_id, kwargs))

    async def step(self, action: Any) -> Any:
        from kernel_env.remote import _step_result

        data = action.model_dump(exclude_defaults=True)
        return _step_result(await self.host.ray_step.remote(self.session_id, data))

    async def close(self) -> None:
        await self.host.ray_close.remote(self.session_id)


# -- measuring ---------------------------------------------------------------------------------


async def step_times(episodes: dict[str, Any], n: int) -> dict[str, list[float]]:
    """``n`` rounds; each round one ``x = 1`` step per transport, in turn."""
    from kernel_env.models import REPLAction

    action = REPLAction(code="x = 1")
    times: dict[str, list[float]] = {name: [] for name in episodes}
    for _ in range(n):
        for name, env in episodes.items():
            t0 = time.perf_counter()
            result = await env.step(action)
            times[name].append(time.perf_counter() - t0)
            assert result.observation.result.success, result
    return times


async def throughput(
    open_episode: Callable[[], Awaitable[Any]], concurrency: int, seconds: float
) -> dict[str, float]:
    """Episodes (open, reset, ``x = 1``, ``FINAL(x)``, close) back to back, ``concurrency`` at
    a time, for ``seconds``: episodes/s and this driver's CPU ms an episode."""
    from kernel_env.models import REPLAction

    first, final = REPLAction(code="x = 1"), REPLAction(code="FINAL(x)")
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            env = await open_episode()
            try:
                await env.reset()
                await env.step(first)
                result = await env.step(final)
                assert result.done, result
            finally:
                await env.close()
            done += 1

    cpu, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu
    return {"episodes_per_s": done / took, "driver_cpu_ms": 1000 * cpu / max(done, 1)}


# -- the run -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_serve(token: str, slots: int) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = free_port()
    env = {**os.environ, "KERNEL_ENV_TOKEN": token}
    command = [sys.executable, "-m", "kernel_env", "serve", "--port", str(port)]
    command += ["--pool-size", str(POOL), "--max-sessions", str(slots)]
    command += ["--log-level", "warning"]
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(trust_env=False) as http:
        for _ in range(600):
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("kernel-env serve did not start")


async def run(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kernel_env import AsyncKernelEnv
    from kernel_env.ray import KernelEnvCluster
    from kernel_env.ray.hosts import NAMESPACE, host_name

    settings = {"pool_size": POOL}
    slots = host_slots(args.slots)
    said = "--slots" if args.slots else f"this machine's capacity / {HOSTS}"
    print(f"each host's slots: {slots} ({said})", flush=True)
    node = cluster.add_node(num_cpus=0, resources={"kernel_env": slots}).node_id
    # The one host, under the name every client looks for: it serves /ws and Ray calls alike.
    host = (
        ray_call_host()
        .options(
            name=host_name(node),
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            resources={"kernel_env": slots},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            max_concurrency=1000,
        )
        .remote(slots, settings)
    )
    await host.ping.remote()
    token = "bench-" + os.urandom(8).hex()
    serve, url = await start_serve(token, slots)
    places = KernelEnvCluster(capacity_timeout=60)
    try:
        await asyncio.sleep(3)  # both pools warm

        async def ray_episode() -> RayCallEpisode:
            return RayCallEpisode(host, await host.open_session.remote())

        openers: dict[str, Callable[[], Awaitable[Any]]] = {
            "serve /ws": lambda: _ready(AsyncKernelEnv(url, token=token)),
            "cluster /ws": places.episode,
            "cluster Ray calls": ray_episode,
        }
        # 1. step latency
        episodes = {name: await opener() for name, opener in openers.items()}
        for env in episodes.values():
            await env.reset(max_iterations=args.steps + 100)
        await step_times(episodes, 20)  # warm-up
        times = await step_times(episodes, args.steps)
        for env in episodes.values():
            await env.close()
        steps = {
            name: {"p50_ms": 1000 * pct(t, 0.5), "p95_ms": 1000 * pct(t, 0.95)}
            for name, t in times.items()
        }
        print_table("step x = 1 (one episode each, interleaved)", steps)
        # 2. episodes/s, one host
        one_host = await interleaved_rates(openers, args)
        print_table(f"episodes/s, {args.concurrency} at a time, one host", one_host)
        # 3. three host nodes on this machine (the serve beside them again, for reference)
        for _ in range(HOSTS - 1):
            cluster.add_node(num_cpus=0, resources={"kernel_env": slots})
        three = KernelEnvCluster(capacity_timeout=60, settings=settings)
        await three.load()
        await asyncio.sleep(3)
        wide = f"cluster /ws, 3 hosts, {3 * args.concurrency} at a time"
        three_hosts = await interleaved_rates(
            {
                "serve /ws": openers["serve /ws"],
                "cluster /ws, 3 hosts": three.episode,
                wide: three.episode,
            },
            args,
            concurrency={wide: 3 * args.concurrency},
        )
        print_table(f"episodes/s, {args.concurrency} at a time, three host nodes", three_hosts)
        loads = await three.load()
        per_node = {node[:8]: count for node, count in three.placed.items()}
        print(f"episodes placed per node (three hosts): {per_node}")
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    return {
        "load_average": os.getloadavg(),  # what else ran on the machine meanwhile
        "steps": steps,
        "one_host": one_host,
        "three_hosts": three_hosts,
        "per_node": per_node,
        "host_episodes_per_s": {n[:8]: load.get("episodes_per_s") for n, load in loads.items()},
        "ratios": {
            "step_p50_cluster_ws_vs_serve": steps["cluster /ws"]["p50_ms"]
            / steps["serve /ws"]["p50_ms"],
            "step_p50_ray_calls_vs_ws": steps["cluster Ray calls"]["p50_ms"]
            / steps["cluster /ws"]["p50_ms"],
            "episodes_cluster_ws_vs_serve": one_host["cluster /ws"]["episodes_per_s"]
            / one_host["serve /ws"]["episodes_per_s"],
            "episodes_ray_calls_vs_ws": one_host["cluster Ray calls"]["episodes_per_s"]
            / one_host["cluster /ws"]["episodes_per_s"],
            "episodes_three_hosts_vs_serve": three_hosts["cluster /ws, 3 hosts"]["episodes_per_s"]
            / three_hosts["serve /ws"]["episodes_per_s"],
        },
    }


async def interleaved_rates(
    openers: dict[str, Callable[[], Awaitable[Any]]],
    args: argparse.Namespace,
    concurrency: dict[str, int] | None = None,
) -> dict[str, dict[str, float]]:
    """Each opener's episodes/s, ``args.rounds`` rounds of ``args.seconds`` each, in turn (so
    that what else the machine does weighs on all alike); the median of the rounds."""
    rates: dict[str, list[dict[str, float]]] = {name: [] for name in openers}
    for _ in range(args.rounds):
        for name, opener in openers.items():
            wanted = (concurrency or {}).get(name, args.concurrency)
            rates[name].append(await throughput(opener, wanted, args.seconds))
            await asyncio.sleep(1.5)  # pools refill
    return {name: _median(runs) for name, runs in rates.items()}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


async def _ready(env: Any) -> Any:
    return env


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    for name, figures in rows.items():
        print(f"  {name:<28} " + "  ".join(f"{k} {v:8.2f}" for k, v in figures.items()))


def inside(args: argparse.Namespace) -> None:
    """In the namespace: loopback up, the cluster's head, then the measurements."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    tmp = tempfile.mkdtemp(prefix="kray-bench-", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    os.environ.update(RAY_TMPDIR=tmp, RAY_USAGE_STATS_ENABLED="0")
    code = 1
    try:
        import ray
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "node_ip_address": "127.0.0.1",
                "object_store_memory": 80 * 1024 * 1024,
                "temp_dir": tmp,
                "include_dashboard": False,
            },
        )
        ray.init(address=cluster.address, log_to_driver=False, logging_level="warning")
        figures = asyncio.run(run(args, cluster))
        sys.stdout.flush()
        from kernel_env.ray import stop_hosts

        stop_hosts(timeout=15)  # kernels shut down (their cgroups removed) before all ends
        ray.shutdown()
        print(json.dumps(figures), flush=True)
        code = 0
    except BaseException as exc:
        traceback.print_exc()
        if "timed out during startup" in str(exc):
            code = _NOT_UP
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os._exit(code)  # the namespace's first process: every process in it ends with it


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument(
        "--slots", type=int, default=None, help="each host's slots (default: the derived share)"
    )
    args = parser.parse_args(argv)
    args.steps = 100 if args.quick else 400
    args.rounds = 1 if args.quick else 5
    args.seconds = 5.0 if args.quick else 6.0
    args.concurrency = 8
    return args


def main() -> None:
    args = parse()
    if os.environ.get(_INSIDE) == "1":
        inside(args)
    command = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
    command += [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    for _ in range(2):  # Ray gives a raylet 30 s to register: a loaded machine can miss it
        code = subprocess.run(command, env={**os.environ, _INSIDE: "1"}).returncode
        if code != _NOT_UP:
            break
        print("a Ray node did not come up in time; starting again", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
