"""What the Ray tests do inside the cluster's namespace (run by ``raynet``'s driver).

Each function takes the :class:`raynet.Driver` and keywords, runs as a Ray driver of the test
cluster, and returns what the test checks, as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray
from fake_openai import FakeOpenAI
from procs import alive

from kernel_env.errors import CapacityReached, RemoteError
from kernel_env.models import REPLAction
from kernel_env.ray import HostLost, KernelEnvCluster, start_hosts
from kernel_env.ray.hosts import NAMESPACE, host_name

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-host-model-key-never-in-a-kernel"
_FAKE: list[FakeOpenAI] = []  # the hosts' model, for as long as the driver runs


def hosts(driver: Any) -> dict[str, Any]:
    """Start the hosts (their model: a fake OpenAI server on the namespace's loopback); each
    one's load, by node."""
    fake = FakeOpenAI(lambda request: "host model says hi")
    fake.__enter__()
    _FAKE.append(fake)
    settings = {
        "step_timeout": 10.0,
        "pool_size": 1,
        "llm_base_url": fake.url,
        "llm_model": "fake-model",
        "llm_api_key": API_KEY,
        # Each node's store a directory of its own, as on machines of their own.
        "episodes": os.path.join(os.environ["RAY_TMPDIR"], "episodes", "{node_id}"),
    }
    start_hosts(settings)
    return asyncio.run(KernelEnvCluster().load())


def placement(driver: Any, episodes: int) -> dict[str, Any]:
    """``episodes`` at once, each setting its own ``x`` and reading it back; then a new one
    looks for ``x``."""

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=30)
        envs = await asyncio.gather(*(cluster.episode() for _ in range(episodes)))
        try:
            await asyncio.gather(*(env.reset() for env in envs))
            await asyncio.gather(*(env.run(f"x = {i}") for i, env in enumerate(envs)))
            seen = await asyncio.gather(*(env.run("print(x)") for env in envs))
            load = await cluster.load()
        finally:
            await asyncio.gather(*(env.close() for env in envs))
        async with await cluster.episode() as fresh:
            await fresh.reset()
            after = (await fresh.run("print(x)")).stderr
        return {
            "nodes": [env.node_id for env in envs],
            "seen": [r.stdout.strip() for r in seen],
            "fresh": after,
            "load": load,
        }

    return asyncio.run(run())


def features(driver: Any, export_dir: str) -> dict[str, Any]:
    """One episode through every call a KernelEnv episode has, with the host's model and with
    the caller's; and where the secrets are not."""

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=30)
        out: dict[str, Any] = {}
        async with await cluster.episode() as env:
            await env.reset(context="a b a", task_prompt="How many a?", expected_answer="2")
            out["host_llm"] = (await env.run("print(llm_query('hello'))")).stdout.strip()
            events: list[dict[str, Any]] = []
            await env.step(REPLAction(code="x = 41\nprint('streamed')"), on_output=events.append)
            out["streamed"] = "".join(e.get("text", "") for e in events)
            (copy,) = await env.fork(1)
            async with copy:
                out["fork_node_same"] = copy.node_id == env.node_id
                out["fork_x"] = (await copy.run("x += 1; print(x)")).stdout.strip()
            out["x_after_fork"] = (await env.run("print(x)")).stdout.strip()
            out["kernel_env"] = (await env.run("import os; print(dict(os.environ))")).stdout
            out["sandbox_fds"] = (await env.run(_DESCRIPTORS)).stdout
            ray_dir = os.environ["RAY_TMPDIR"]
            out["ray_dir"] = ray_dir
            out["sees_ray_dir"] = (await env.run(f"print(os.path.exists({ray_dir!r}))")).stdout
            final = await env.step(REPLAction(code="FINAL(context.split().count('a'))"))
            out["reward"], out["done"] = final.reward, final.done
            out["state"] = (await env.state()).model_dump_json()
            path = await env.export_notebook(Path(export_dir) / "episode.ipynb")
            out["notebook"] = path.read_text()
        async with await cluster.episode(llm=lambda prompt: f"caller:{prompt}") as env:
            await env.reset()
            out["caller_llm"] = (await env.run("print(llm_query('hello'))")).stdout.strip()
        endpoint = ray.get(_host(next(iter(cluster.placed))).endpoint.remote())
        out["token"] = endpoint["token"]
        out["api_key"] = API_KEY
        out["ray_logs_with_a_secret"] = _files_holding(
            os.environ["RAY_TMPDIR"], (endpoint["token"], API_KEY)
        )
        return out

    return asyncio.run(run())


def capacity(driver: Any, wait: float) -> dict[str, Any]:
    """Every slot taken, two more episodes asked (each waits ``wait`` s, then fails); then one
    waits while a slot frees."""

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=wait)
        slots = sum(load["slots"] for load in (await cluster.load()).values())
        held = await asyncio.gather(*(cluster.episode() for _ in range(slots)))
        await asyncio.gather(*(env.reset() for env in held))
        t0 = time.monotonic()
        refused = await asyncio.gather(cluster.episode(), cluster.episode(), return_exceptions=True)
        waited = time.monotonic() - t0
        load = await cluster.load()
        patient = KernelEnvCluster(capacity_timeout=30)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(patient.episode())
        await asyncio.sleep(1.0)
        await held[0].close()
        got_in = await waiter
        await got_in.reset()
        late = time.monotonic() - t0
        await asyncio.gather(got_in.close(), *(env.close() for env in held[1:]))
        moved = await _stale_view_moves(slots)
        return {
            "moved": moved,
            "slots": slots,
            "held": len(held),
            "refused": [
                {
                    "capacity": isinstance(e, CapacityReached),
                    "remote": isinstance(e, RemoteError) and e.code == "CAPACITY_REACHED",
                    "message": str(e),
                }
                for e in refused
            ],
            "waited": waited,
            "load": load,
            "late_wait": late,
        }

    return asyncio.run(run())


async def _stale_view_moves(slots: int) -> dict[str, Any]:
    """A client whose look at the hosts is stale places an episode on a host another client
    filled since: the host refuses it at its first call, and it moves to the host with room."""
    from kernel_env.ray.placement import HostLoad

    other = KernelEnvCluster(capacity_timeout=10)
    held = await asyncio.gather(*(other.episode() for _ in range(slots - 1)))
    await asyncio.gather(*(env.reset() for env in held))
    counts: dict[str, int] = {}
    for env in held:
        counts[env.node_id] = counts.get(env.node_id, 0) + 1
    full = max(counts, key=lambda node: counts[node])
    stale = KernelEnvCluster(capacity_timeout=10)
    await stale.load()  # hosts and endpoints known; then a view from before the others came
    stale._loads = {full: HostLoad(full, 0, slots // 2)}
    stale._looked = time.monotonic()
    env = await stale.episode()
    placed_on = env.node_id
    await env.reset()
    ran = (await env.run("print('moved')")).stdout.strip()
    result = {"full": full, "placed_on": placed_on, "ran_on": env.node_id, "ran": ran}
    await asyncio.gather(env.close(), *(e.close() for e in held))
    return result


def host_restart(driver: Any) -> dict[str, Any]:
    """An episode's host process is killed (Ray restarts it): the episode's next step fails
    with HostLost at once; the restarted host serves new episodes."""

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=30)
        env = await cluster.episode()
        await env.reset()
        await env.run("x = 1")
        node = env.node_id
        host = _host(node)
        before = ray.get(host.endpoint.remote())["pid"]
        ray.kill(host, no_restart=False)
        # ray.kill only asks: the next step must find its host gone, not race the kill (on a
        # loaded machine it ran on the old host, and answered).
        deadline = time.monotonic() + 30
        while alive(before) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        try:
            await env.run("print(x)")
            error = None
        except HostLost as exc:
            error = str(exc)
        failed_in = time.monotonic() - t0
        await env.close()
        # New episodes: the other host fills up, and the restarted one takes them again.
        held, back = [], None
        deadline = time.monotonic() + 60
        while back is None and time.monotonic() < deadline:
            episode = await cluster.episode()
            if episode.node_id == node:
                back = episode
            else:
                held.append(episode)
        assert back is not None, "the restarted host took no episode in 60 s"
        await back.reset()
        ran = (await back.run("print('served again')")).stdout.strip()
        after = ray.get(_host(node).endpoint.remote())["pid"]
        await asyncio.gather(back.close(), *(e.close() for e in held))
        return {"error": error, "failed_in": failed_in, "ran": ran, "pids": [before, after]}

    return asyncio.run(run())


def stored(driver: Any, episodes: int) -> dict[str, Any]:
    """``episodes`` run to their final answer at once (so spread over the hosts), then listed
    and fetched through the cluster client, across the hosts' stores."""

    async def one(cluster: KernelEnvCluster, i: int) -> dict[str, Any]:
        async with await cluster.episode() as env:
            await env.reset(context="a b a", task_prompt=f"stored {i}", expected_answer="2")
            answer = "2" if i % 2 == 0 else "3"
            final = await env.step(REPLAction(code=f"print('episode {i}')\nFINAL({answer})"))
            state = await env.state()
            return {"node_id": env.node_id, "episode_id": state.episode_id, "reward": final.reward}

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=30)
        ran = await asyncio.gather(*(one(cluster, i) for i in range(episodes)))
        listed = await cluster.episodes(task="stored ")
        solved = await cluster.episodes(task="stored ", reward_min=1)
        notebooks = {
            r["episode_id"]: (await cluster.notebook(r["episode_id"])).decode() for r in listed
        }
        try:
            await cluster.notebook("no-such-episode")
            unknown = None
        except RemoteError as exc:
            unknown = f"{type(exc).__name__}: {exc}"
        stores = sorted(os.listdir(os.path.join(os.environ["RAY_TMPDIR"], "episodes")))
        return {"ran": ran, "listed": listed, "solved": solved, "notebooks": notebooks,
                "unknown": unknown, "stores": stores}  # fmt: skip

    return asyncio.run(run())


def example(driver: Any, args: list[str], seconds: float) -> dict[str, Any]:
    """``examples/ray_rollouts.py`` as a driver of its own; its last line, and the hosts'
    loads after it."""
    t0 = time.monotonic()
    script = str(ROOT / "examples" / "ray_rollouts.py")
    done = subprocess.run(
        [sys.executable, script, "--address", driver.address, *args],
        capture_output=True,
        text=True,
        timeout=seconds,
    )
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    try:
        summary = json.loads(last)
    except ValueError:
        raise AssertionError(f"the last line is not JSON:\n{done.stdout[-3000:]}") from None
    return {"summary": summary, "seconds": took, "stderr": done.stderr[-3000:]}


# What every process a cell can see holds open, as {pid: {fd: target}} (a host's Ray worker
# must pass nothing of its own: its log files, its sockets to the raylet).
_DESCRIPTORS = """
import json, os
held, unreadable = {}, []
for pid in (p for p in os.listdir('/proc') if p.isdigit()):
    held[pid] = {}
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        unreadable.append(pid)
        continue
    for fd in fds:
        try:
            held[pid][fd] = os.readlink(f'/proc/{pid}/fd/{fd}')
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
print(json.dumps({"held": held, "unreadable": unreadable, "me": str(os.getpid())}))
"""


def loads(driver: Any) -> dict[str, Any]:
    return asyncio.run(KernelEnvCluster().load())


def _host(node: str) -> Any:
    return ray.get_actor(host_name(node), namespace=NAMESPACE)


def _files_holding(root: str, secrets: tuple[str, ...]) -> list[str]:
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    data = f.read(50 << 20)
            except OSError:
                continue
            if any(secret.encode() in data for secret in secrets):
                found.append(path)
    return found


def priority(driver: Any) -> dict[str, Any]:
    """With an episode on each host: the niceness of each host's threads, of every process
    under it (forkserver, kernels) and of its raylet; and that of a plain Ray task's worker."""
    from procs import comm, descendants, parent

    from kernel_env.ray.hosts import kernel_nodes

    def niceness(pid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, pid)

    def look() -> dict[str, Any]:
        found: dict[str, Any] = {}
        for node in kernel_nodes():
            pid = int(ray.get(_host(node).endpoint.remote(), timeout=60)["pid"])
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            below = descendants(pid)
            found[node] = {
                "threads": sorted({niceness(t) for t in threads}),
                "below": sorted({niceness(p) for p in below}),
                "kernels": sum(comm(p) == "ke-kernel" for p in below),
                "raylet": niceness(parent(pid)),
            }
        return found

    async def run() -> dict[str, Any]:
        cluster = KernelEnvCluster(capacity_timeout=30)
        envs = await asyncio.gather(*(cluster.episode() for _ in kernel_nodes()))
        try:
            await asyncio.gather(*(env.reset() for env in envs))
            return look()
        finally:
            await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)

    task = ray.remote(num_cpus=1)(lambda: os.getpriority(os.PRIO_PROCESS, 0))
    return {"hosts": asyncio.run(run()), "task": ray.get(task.remote(), timeout=60)}
