"""GRPO-style rollouts spread over a Ray cluster's kernel_env hosts.

    ray start --head                                         # a trainer node: no kernels
    ray start --address HEAD:6379 --resources '{"kernel_env": 16}'   # each node with kernels
    python examples/ray_rollouts.py --address HEAD:6379 --episodes 64 --concurrency 16

Groups of ``--group-size`` scripted rollouts per task (the policy of ``grpo_rollouts.py``: it
solves, answers wrong, fails then fixes, or never answers), each rollout an episode that
:class:`kernel_env.ray.KernelEnvCluster` places on a host with room; group-relative
advantages over each group's completed rollouts. With ``--kill-node-after S`` it ends one
host's node S seconds in (a task on that node kills its raylet), to watch the episodes there
fail with ``HostLost`` while the others complete on the remaining hosts.

The last line printed is one JSON object: ``{"episodes": N, "completed": n, "failed": f,
"per_node": {node_id: episodes placed there}, "episodes_per_s": x, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kernel_env.agent import first_messages, format_observation, turn_feedback
from kernel_env.ray import KernelEnvCluster
from kernel_env.ray.hosts import kernel_nodes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_rollouts import (  # the sibling example's tasks and policy
    TASKS,
    Rollout,
    Task,
    actions_from_text,
    group_advantages,
    scripted_policy,
)


async def run_rollout(cluster: KernelEnvCluster, task: Task, index: int) -> tuple[Rollout, str]:
    """One episode on some host: reply, run the reply's steps, show the outputs, repeat."""
    rollout = Rollout(task.name, index)
    rollout.messages = first_messages(
        task.question, task.context, max_iterations=task.max_iterations
    )
    env = await cluster.episode()
    node = env.node_id
    async with env:
        reset = await env.reset(
            context=task.context,
            task_prompt=task.question,
            expected_answer=task.expected,
            max_iterations=task.max_iterations,
        )
        rollout.session_id = reset.observation.metadata.get("session_id")
        for turn in range(1, task.max_iterations + 1):
            reply = scripted_policy(task, rollout.messages, index)
            rollout.messages.append({"role": "assistant", "content": reply})
            outputs = []
            for action in actions_from_text(reply):
                result = await env.step(action)
                rollout.step_rewards.append(result.reward or 0.0)
                outputs.append(format_observation(result.observation.result, 2000))
                if result.done:
                    rollout.done = True
                    rollout.final_answer = result.observation.metadata.get("final_answer")
                    return rollout, node
            rollout.messages.append(
                {"role": "user", "content": turn_feedback(outputs, turn, task.max_iterations)}
            )
    return rollout, node


@ray.remote(num_cpus=0)
class NodeEnder:
    """Placed on a node ahead of time (a worker starts in seconds on a busy machine); ends it
    on request: an actor's parent process is its node's raylet."""

    def end(self) -> None:
        os.kill(os.getppid(), signal.SIGKILL)


async def node_enders() -> dict[str, Any]:
    """A :class:`NodeEnder` on every host node but the head (ending it ends the cluster),
    ready."""
    heads = {n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]}
    enders = {
        node: NodeEnder.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in kernel_nodes()
        if node not in heads
    }
    await asyncio.gather(*(ender.__ray_ready__.remote() for ender in enders.values()))
    return enders


async def end_a_host_node(
    cluster: KernelEnvCluster, enders: dict[str, Any], after: float, ended_at: list[float]
) -> str | None:
    """``after`` seconds after the first episode is placed, end the host node with the most
    episodes placed; the time it was ended goes into ``ended_at``."""
    while not any(node in enders for node in cluster.placed):
        await asyncio.sleep(0.05)
    await asyncio.sleep(after)
    candidates = [node for node in cluster.placed if node in enders]
    if not candidates:
        return None
    victim = max(candidates, key=lambda node: cluster.placed[node])
    ended_at.append(time.perf_counter())
    with contextlib.suppress(ray.exceptions.RayError):  # it may end with its node first
        await enders[victim].end.remote()
    return victim


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = KernelEnvCluster(args.address, capacity_timeout=args.capacity_timeout)
    limit = asyncio.Semaphore(args.concurrency)
    nodes: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    failed_at: list[float] = []
    ended_at: list[float] = []

    async def one(task: Task, index: int) -> Rollout | None:
        async with limit:
            try:
                rollout, node = await run_rollout(cluster, task, index)
            except Exception as exc:
                failures[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
                failed_at.append(time.perf_counter())
                return None
            nodes[node] += 1
            return rollout

    killer = None
    if args.kill_node_after is not None:
        enders = await node_enders()  # placed before the clock starts
        killer = asyncio.create_task(
            end_a_host_node(cluster, enders, args.kill_node_after, ended_at)
        )
    started = time.perf_counter()
    groups = []
    for first in range(0, args.episodes, args.group_size):
        task = TASKS[(first // args.group_size) % len(TASKS)]
        size = min(args.group_size, args.episodes - first)
        groups.append([one(task, i) for i in range(size)])
    results = await asyncio.gather(*(asyncio.gather(*group) for group in groups))
    took = time.perf_counter() - started
    killed = None
    if killer is not None:
        killer.cancel()  # done already, unless the run ended before a node could be
        with contextlib.suppress(asyncio.CancelledError):
            killed = await killer
    completed = [[r for r in group if r is not None] for group in results]
    for rollouts in completed:
        if len(rollouts) > 1:  # a group's advantages, over the rollouts that completed
            advantages = group_advantages([r.reward for r in rollouts])
            print(
                f"{rollouts[0].task:<14} rewards {[round(r.reward, 3) for r in rollouts]} "
                f"advantages {[round(a, 3) for a in advantages]}"
            )
    done = sum(len(group) for group in completed)
    placed = dict(cluster.placed)
    return {
        "episodes": args.episodes,
        "completed": done,
        "failed": args.episodes - done,
        "per_node": placed,
        "episodes_per_s": round(done / took, 2) if took > 0 else 0.0,
        "seconds": round(took, 2),
        "mean_reward": round(statistics.fmean(r.reward for g in completed for r in g), 3)
        if done
        else None,
        "killed_node": killed,
        "failures": dict(failures),
        # the last failure, in seconds after the node was ended: how fast its episodes knew
        "last_failure_after_end_s": round(max(failed_at) - ended_at[0], 2)
        if failed_at and ended_at
        else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="the Ray cluster (default: ray.init's)")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="episodes open at once")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task (G)")
    parser.add_argument("--capacity-timeout", type=float, default=60.0)
    parser.add_argument(
        "--kill-node-after", type=float, default=None, metavar="S", help="end a host's node"
    )
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    sys.stdout.flush()
    ray.shutdown()  # Ray prints what it hears (a dead node's log) until then: the JSON is last
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
