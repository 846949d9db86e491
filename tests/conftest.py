"""Shared fixtures: real kernels, small timeouts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway import GatewayProcess

from kernel_env import KernelEnv

STEP_TIMEOUT = 5.0  # "T" of the fault tests in docs/acceptance


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
