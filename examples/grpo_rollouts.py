"""GRPO-style rollouts against a ``kernel-env serve`` server, through OpenEnv's own client.

    kernel-env serve --port 8000                                   # in another terminal
    python examples/grpo_rollouts.py --url http://127.0.0.1:8000 --group-size 4

For every task of the batch (a "prompt" in GRPO's terms) it runs G rollouts in parallel, each in
its own WebSocket session (one session = one fresh kernel), turns the policy's text into
``REPLAction`` steps, sums each rollout's rewards, and computes group-relative advantages:
``(reward - mean of the group) / std of the group``. A trainer would scale the log-probabilities
of each rollout's completion tokens by its advantage; this script stops before that and prints
the numbers.

The policy is scripted (a function that writes replies, code blocks included) so the script runs
offline with no model. Replace :func:`scripted_policy` with one that samples from your model:
it gets the chat messages so far and returns (or, if async, awaits) the model's next reply.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from openenv.core.generic_client import GenericEnvClient

from kernel_env.agent import (
    extract_code_blocks,
    first_messages,
    format_observation,
    text_final,
    turn_feedback,
)
from kernel_env.models import CodeBlockResult, REPLAction

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Task:
    """One prompt of the batch: a context, a question about it, and the answer that scores 1."""

    name: str
    context: str
    question: str
    expected: str
    max_iterations: int = 4  # cells per episode; the env ends the episode after the last one


def _fruit_context() -> str:
    words = ["apple", "banana", "pineapple", "cherry", "apple", "kiwi"] * 5 + ["apple"]
    return " ".join(words)


def _ledger_context() -> str:
    return "\n".join(f"item {i}: {(i * 37) % 101}" for i in range(1, 41))


TASKS = [
    Task(
        name="count-apples",
        context=_fruit_context(),
        question="How many times does the word 'apple' occur in context?",
        expected=str(_fruit_context().split().count("apple")),
    ),
    Task(
        name="sum-ledger",
        context=_ledger_context(),
        question="What is the total of the values after the colons in context?",
        expected=str(sum(int(line.split(":")[1]) for line in _ledger_context().splitlines())),
    ),
]

# What the scripted policy "knows" per task: a right solution and a plausible wrong one. Both
# leave their answer in `result`.
SOLUTIONS = {
    "count-apples": (
        "result = context.split().count('apple')",
        "result = context.count('apple ')  # counts 'pineapple ' too, and misses the last word",
    ),
    "sum-ledger": (
        "result = sum(int(line.split(':')[1]) for line in context.splitlines())",
        "result = sum(int(ch) for ch in context if ch.isdigit())  # adds digits, not numbers",
    ),
}

# Four behaviours, one per rollout of a group (cycled when G > 4), as sampling might produce.
STYLES = ("solves", "answers wrong", "fails then fixes", "never answers")

# (task, messages so far, rollout index) -> the policy's next reply, as text. An async policy
# (one that awaits an inference server) lets the rollouts of a batch wait for it concurrently.
Policy = Callable[[Task, Messages, int], str | Awaitable[str]]


def _block(code: str) -> str:
    return f"```repl\n{code}\n```\n"


def scripted_policy(task: Task, messages: Messages, rollout: int) -> str:
    """A stand-in for a sampled model reply, with the behaviour of ``STYLES[rollout % 4]``."""
    right, wrong = SOLUTIONS[task.name]
    style = STYLES[rollout % len(STYLES)]
    turn = sum(1 for m in messages if m["role"] == "assistant")
    if style == "solves":
        return "Let me compute it.\n" + _block(f"{right}\nprint(result)") + _block("FINAL(result)")
    if style == "answers wrong":
        return "Quick count.\n" + _block(f"{wrong}\nFINAL(result)")
    if style == "fails then fixes":
        if turn == 0:
            return _block(right.replace("context", "ctx"))  # a NameError
        if "NameError" in messages[-1]["content"]:  # it reads the observation it got back
            return "The variable is `context`.\n" + _block(right) + _block("FINAL(result)")
    return _block("print(context[:40])")  # looks around, never answers


def actions_from_text(text: str) -> list[REPLAction]:
    """The steps a reply asks for: each ```repl / ```python block is one code step; with no
    code, a ``FINAL(answer)`` line is a final answer (``FINAL_VAR(name)`` becomes a step that
    calls it); a reply with neither asks for nothing."""
    blocks = extract_code_blocks(text)
    if blocks:
        return [REPLAction(code=code) for code in blocks]
    found = text_final(text)
    if found is None:
        return []
    kind, value = found
    if kind == "variable":
        return [REPLAction(code=f"FINAL_VAR({value!r})")]
    return [REPLAction(is_final=True, final_answer=value)]


@dataclass
class Rollout:
    """One episode of one task: the conversation, the rewards of its steps, how it ended."""

    task: str
    index: int
    session_id: str | None = None
    messages: Messages = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    final_answer: str | None = None
    done: bool = False

    @property
    def reward(self) -> float:
        """The rollout's return: the sum of its step rewards."""
        return sum(self.step_rewards)


@dataclass
class Group:
    """The G rollouts of one task and their group-relative advantages."""

    task: str
    rollouts: list[Rollout]
    advantages: list[float]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's advantages: each reward minus the group's mean, over the group's (population)
    standard deviation; all zeros when every rollout scored the same (nothing to learn)."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if std < 1e-8:
        return [0.0 for _ in rewards]
    return [(r - mean) / std for r in rewards]


async def run_rollout(url: str, task: Task, index: int, policy: Policy) -> Rollout:
    """One episode in its own session: reply, run the reply's steps, show the outputs, repeat."""
    rollout = Rollout(task.name, index)
    rollout.messages = first_messages(
        task.question, task.context, max_iterations=task.max_iterations
    )
    async with GenericEnvClient(base_url=url) as env:
        reset = await env.reset(
            context=task.context,
            task_prompt=task.question,
            expected_answer=task.expected,
            max_iterations=task.max_iterations,
        )
        rollout.session_id = reset.observation["metadata"].get("session_id")
        for turn in range(1, task.max_iterations + 1):
            reply = policy(task, rollout.messages, index)
            if inspect.isawaitable(reply):
                reply = await reply
            rollout.messages.append({"role": "assistant", "content": reply})
            outputs = []
            for action in actions_from_text(reply):
                result = await env.step(action.model_dump(exclude_defaults=True))
                rollout.step_rewards.append(result.reward or 0.0)
                outputs.append(_observation_text(result.observation))
                if result.done:
                    rollout.done = True
                    rollout.final_answer = result.observation["metadata"].get("final_answer")
                    return rollout
            feedback = turn_feedback(outputs, turn, task.max_iterations)
            rollout.messages.append({"role": "user", "content": feedback})
    return rollout


def _observation_text(observation: dict) -> str:
    return format_observation(CodeBlockResult.model_validate(observation["result"]), 2000)


async def run_groups(
    url: str,
    tasks: list[Task],
    policy: Policy = scripted_policy,
    *,
    group_size: int = 4,
    parallel: int = 8,
) -> list[Group]:
    """Every task's ``group_size`` rollouts, at most ``parallel`` sessions at a time."""
    limit = asyncio.Semaphore(parallel)

    async def one(task: Task, index: int) -> Rollout:
        async with limit:
            return await run_rollout(url, task, index, policy)

    groups = []
    runs = [[one(task, i) for i in range(group_size)] for task in tasks]
    results = await asyncio.gather(*(asyncio.gather(*group) for group in runs))
    for task, rollouts in zip(tasks, results, strict=True):
        advantages = group_advantages([r.reward for r in rollouts])
        groups.append(Group(task.name, list(rollouts), advantages))
    return groups


def print_groups(groups: list[Group]) -> None:
    for group in groups:
        print(f"\n{group.task}  (mean reward {statistics.fmean(group.rewards):+.3f})")
        print(
            f"  {'rollout':>7}  {'style':<17} {'steps':>5}  {'reward':>7}  {'advantage':>9}  answer"
        )
        for rollout, advantage in zip(group.rollouts, group.advantages, strict=True):
            style = STYLES[rollout.index % len(STYLES)]
            print(
                f"  {rollout.index:>7}  {style:<17} {len(rollout.step_rewards):>5}  "
                f"{rollout.reward:>+7.3f}  {advantage:>+9.3f}  {rollout.final_answer}"
            )


def main(argv: list[str] | None = None) -> list[Group]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the kernel-env server")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task (G)")
    parser.add_argument("--parallel", type=int, default=8, help="sessions open at once")
    args = parser.parse_args(argv)
    groups = asyncio.run(
        run_groups(args.url, TASKS, group_size=args.group_size, parallel=args.parallel)
    )
    print_groups(groups)
    return groups


if __name__ == "__main__":
    main()
