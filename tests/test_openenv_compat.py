"""OpenEnv's own tools against a real ``kernel-env serve`` process on a free loopback port."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from serverkit import ServeProcess, serve_process

pytest.importorskip("openenv")

from openenv.core.generic_client import GenericEnvClient

pytestmark = pytest.mark.integration  # kernels, servers or other processes


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serve_process("--pool-size", "2") as process:
        yield process


def test_openenv_validate_passes_all_criteria(server: ServeProcess) -> None:
    """`openenv validate --url` reports 6/6 criteria passed (simulation mode)."""
    done = subprocess.run(
        [sys.executable, "-m", "openenv.cli", "validate", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0, report
    assert report["passed"] is True
    assert report["summary"]["passed_count"] == report["summary"]["total_count"] == 6
    assert report["mode"] == "simulation"
    assert report["standard_profile"] == "openenv-http/1.x"


async def test_generic_env_client_reset_step_state_final(server: ServeProcess) -> None:
    """OpenEnv's GenericEnvClient runs reset -> step -> state -> final answer unchanged."""
    async with GenericEnvClient(base_url=server.url) as env:
        reset = await env.reset(
            context="Hello World", task_prompt="Count the characters", expected_answer="11"
        )
        assert reset.done is False
        assert reset.observation["context_length"] == 11

        step = await env.step({"code": "count = len(context)\nprint(count)"})
        assert step.observation["result"]["stdout"] == "11\n"
        assert step.observation["result"]["success"] is True
        assert step.done is False and step.reward == 0.0

        state = await env.state()
        assert state["step_count"] == 1 and "count" in state["namespace_keys"]

        final = await env.step({"code": "print(f'FINAL({count})')"})
        assert final.done is True and final.reward == 1.0
        assert final.observation["metadata"]["final_answer"] == "11"
        assert (await env.state())["final_answer"] == "11"


async def test_generic_env_client_sees_server_errors(server: ServeProcess) -> None:
    """OpenEnv's client turns an error frame into its RuntimeError with our code."""
    async with GenericEnvClient(base_url=server.url) as env:
        with pytest.raises(RuntimeError, match="EXECUTION_ERROR"):
            await env.step({"code": "1"})
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            await env.step({"code": "1", "not_a_field": 2})
        assert (await env.reset()).done is False
