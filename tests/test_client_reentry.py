"""A KernelEnv called again from inside one of its own calls (an ``llm_query_fn`` that calls
``env.execute()``) fails at once instead of waiting for the step's timeout."""

from __future__ import annotations

import time

import pytest

from kernel_env import KernelEnv
from kernel_env.errors import EpisodeError
from kernel_env.kernel.factory import local_source

pytestmark = pytest.mark.integration  # kernels, servers or other processes


def test_an_llm_query_fn_that_calls_its_own_env_fails_at_once() -> None:
    seen: list[BaseException] = []
    holder: dict[str, KernelEnv] = {}

    def llm_query_fn(prompt: str, model: str | None = None) -> str:
        try:
            holder["env"].execute("1 + 1")
        except EpisodeError as exc:
            seen.append(exc)
            raise
        return "not reached"

    with KernelEnv(
        llm_query_fn=llm_query_fn, step_timeout=20, kernel_source=local_source("none")
    ) as env:
        holder["env"] = env
        env.reset(context="x")
        start = time.monotonic()
        result = env.execute("llm_query('hi')").observation.result
        elapsed = time.monotonic() - start
        after = env.execute("print('alive')").observation.result
    assert elapsed < 5, elapsed
    assert len(seen) == 1 and "recursively" in str(seen[0])
    assert not result.success and "recursively" in (result.stderr + str(result.exception))
    assert after.stdout == "alive\n"


def test_two_envs_may_nest() -> None:
    """Another KernelEnv may run inside a call: only a call into the same one is refused."""
    inner = KernelEnv(kernel_source=local_source("none"))

    def llm_query_fn(prompt: str, model: str | None = None) -> str:
        return inner.execute("print(6 * 7)").observation.result.stdout.strip()

    with inner, KernelEnv(llm_query_fn=llm_query_fn, kernel_source=local_source("none")) as env:
        inner.reset()
        env.reset()
        assert env.execute("print(llm_query('q'))").observation.result.stdout == "42\n"
