"""TenantPools: a warm pool per tenant, made at its first acquire, whose kernels start as that
tenant (scripted kernels, in-process; the same through a real Enterprise Gateway is in
test_gateway.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from kernel_env.errors import KernelError
from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.kernel.scripted import ScriptedKernel
from kernel_env.server.tenant_pools import TenantPools


class Starts:
    """Kernel sources by tenant that remember, per kernel, whose it was started as."""

    def __init__(self) -> None:
        self.started: Counter[str] = Counter()
        self.user_of: dict[str, str] = {}

    def source_for(self, tenant: str) -> KernelSource:
        async def start() -> Kernel:
            kernel = ScriptedKernel()
            await kernel.start()
            self.started[tenant] += 1
            self.user_of[kernel.kernel_id] = tenant
            return kernel

        return start


async def _until(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_each_tenant_gets_kernels_started_as_itself_and_warm_ones_after() -> None:
    starts = Starts()
    pools = TenantPools(starts.source_for, size=1)
    try:
        alice = await pools.source("alice")()
        await _until(lambda: starts.started["alice"] == 2)  # hers, and a warm one
        assert starts.started["bob"] == 0  # no pool before a tenant's first session
        again = await pools.source("alice")()  # the warm one
        bob = await pools.source("bob")()
        assert [starts.user_of[k.kernel_id] for k in (alice, again, bob)] == [
            "alice",
            "alice",
            "bob",
        ]
        for kernel in (alice, again, bob):
            await kernel.shutdown()
    finally:
        await pools.close()
    with pytest.raises(KernelError, match="closed"):
        await pools.source("carol")()
