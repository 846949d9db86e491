"""The runnable examples in ``examples/``, run against a real ``kernel-env serve`` on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from serverkit import small_settings, thread_server

pytest.importorskip("openenv")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


grpo = _load("grpo_rollouts")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with thread_server(small_settings(pool_size=2, max_sessions=8)) as url:
        yield url


@pytest.mark.integration
def test_grpo_rollouts_rewards_and_advantages(
    server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each group's rewards follow the scripted styles (right 1.0, wrong 0.0, a failed step then
    right 0.95, no answer -0.1), and the advantages are zero-mean, unit-spread and ranked alike."""
    groups = grpo.main(["--url", server_url, "--group-size", "4", "--parallel", "8"])

    assert [g.task for g in groups] == [t.name for t in grpo.TASKS]
    for group, task in zip(groups, grpo.TASKS, strict=True):
        assert group.rewards == pytest.approx([1.0, 0.0, 0.95, -0.1])
        assert [len(r.step_rewards) for r in group.rollouts] == [2, 1, 3, 4]
        answers = [r.final_answer for r in group.rollouts]
        assert answers[0] == answers[2] == task.expected
        assert answers[1] not in (None, task.expected)
        assert answers[3] is None
        assert all(r.done for r in group.rollouts)

        advantages = group.advantages
        assert statistics.fmean(advantages) == pytest.approx(0.0, abs=1e-9)
        assert statistics.pstdev(advantages) == pytest.approx(1.0)
        mean = statistics.fmean(group.rewards)
        assert advantages[0] == pytest.approx((1.0 - mean) / statistics.pstdev(group.rewards))
        assert advantages[0] > advantages[2] > 0 > advantages[1] > advantages[3]

    sessions = [r.session_id for g in groups for r in g.rollouts]
    assert None not in sessions and len(set(sessions)) == 8  # one session per rollout
    assert "count-apples" in capsys.readouterr().out


def test_actions_from_text_turns_a_reply_into_steps() -> None:
    """Code blocks become code steps in order; a FINAL(...) line alone becomes a final answer;
    prose alone asks for nothing."""
    reply = "Look first.\n```repl\nx = 1\n```\nthen\n```python\nprint(x)\n```\n```text\nno\n```"
    assert [a.code for a in grpo.actions_from_text(reply)] == ["x = 1\n", "print(x)\n"]

    (final,) = grpo.actions_from_text("I am sure now.\nFINAL(42)")
    assert final.is_final and final.final_answer == "42"
    (variable,) = grpo.actions_from_text("FINAL_VAR(total)")
    assert variable.code == "FINAL_VAR('total')" and not variable.is_final
    assert grpo.actions_from_text("Still thinking.") == []


def test_group_advantages_without_spread_are_zero() -> None:
    """A group whose rollouts all scored the same teaches nothing: every advantage is 0."""
    assert grpo.group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert grpo.group_advantages([1.0, 0.0]) == [1.0, -1.0]


@pytest.mark.integration
async def test_grpo_rollouts_take_an_async_policy(server_url: str) -> None:
    """A policy that awaits (as one calling an inference server would) gives the same rewards."""

    async def policy(task: object, messages: list[dict[str, str]], rollout: int) -> str:
        await asyncio.sleep(0)
        return grpo.scripted_policy(task, messages, rollout)

    (group,) = await grpo.run_groups(server_url, grpo.TASKS[:1], policy, group_size=2)
    assert group.rewards == pytest.approx([1.0, 0.0])
    assert group.advantages == pytest.approx([1.0, -1.0])
