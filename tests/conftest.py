"""Shared fixtures: real kernels, small timeouts; and the guard that keeps the quick tier quick.

Tiers: a test that starts a process (a kernel, a server, a gateway, the CLI) is marked
``integration``; ``make check`` runs the others (``-m "not integration and not slow"``). The
guard below fails an unmarked test that starts a process, so the quick tier stays quick.
And no process a test started may outlive the run (tests/leaks.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from gateway import EnterpriseGatewayProcess, GatewayProcess
from leaks import (  # noqa: F401  (the run fails if a process a test started outlives it)
    pytest_configure,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
)

from kernel_env import KernelEnv

# `kernel-env serve` keeps every episode under the user's state dir unless told otherwise; the
# servers the tests start keep none (tests/test_episode_store.py names a directory of its own).
os.environ.setdefault("KERNEL_ENV_EPISODES", "none")

STEP_TIMEOUT = 5.0  # "T" of the fault tests in docs/acceptance.md


_KERNEL_FIXTURES = {"env", "gateway"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use a kernel fixture are integration tests whatever their marks say (a
    module-scoped gateway starts before the guard below could see it)."""
    for item in items:
        if _KERNEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _processes_need_the_integration_mark(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unmarked test may not start a process (kernels and servers are started through
    ``subprocess.Popen``, asyncio's subprocesses included)."""
    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def env() -> Iterator[KernelEnv]:
    """A local client with an echoing LLM and a 5 s step timeout."""
    with KernelEnv(llm_query_fn=lambda p: f"echo:{p}", step_timeout=STEP_TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A real Jupyter Kernel Gateway on a free loopback port, one per test module."""
    gw = GatewayProcess(tmp_path_factory.mktemp("gateway"))
    gw.start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def enterprise_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A real Jupyter Enterprise Gateway, default settings, one per test module."""
    gw = EnterpriseGatewayProcess(tmp_path_factory.mktemp("enterprise-gateway"))
    gw.start()
    yield gw
    gw.stop()
