"""Warm gateway kernels per tenant, each started as its tenant's user.

Enterprise Gateway starts a kernel for the ``KERNEL_USERNAME`` its request names and fixes
everything user-bound then: its per-user limits (``max_kernels_per_user``), the users it
refuses, and on Docker or Kubernetes the container's or pod's name (and namespace). The
server's warm pool starts kernels before anyone asks for one, so a shared pool cannot know
whose they will be, and a kernel started for one user cannot be handed to another.

So, with tenants (``--tokens-file``) and a gateway, each tenant gets a pool of its own, made at
its first session and kept warm from then on, whose kernels start as that tenant's name. A
tenant's resets after its first take a warm kernel (the container or pod start stays hidden),
and the gateway counts each tenant's kernels, warm ones included, against that tenant alone.
Two alternatives were weighed: no pool for tenants' gateway kernels (every reset would wait
for a container or a pod) and a username handed to an already started kernel (no gateway can
change a kernel's user once it runs).

The cost: ``size`` warm kernels on the gateway for every tenant that has opened a session,
bounded by the gateway's own limits, which are what govern a cluster's kernels; each pool's
``max_kernels`` bounds one tenant's kernels on this server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kernel_env.errors import KernelError
from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.kernel.pool import KernelPool

__all__ = ["TenantPools"]


class TenantPools:
    """A :class:`KernelPool` per tenant, made at the tenant's first acquire."""

    def __init__(
        self,
        source_for: Callable[[str], KernelSource],
        *,
        size: int,
        max_kernels: int | None = None,
    ) -> None:
        self._source_for = source_for  # a tenant's name -> kernels started as that user
        self.size = size
        self.max_kernels = max_kernels
        self._pools: dict[str, KernelPool] = {}
        self._closed = False

    def source(self, tenant: str) -> KernelSource:
        """A kernel source that takes ``tenant``'s kernels from its own pool."""

        async def acquire_for_tenant() -> Kernel:
            pool = await self._pool(tenant)
            return await pool.acquire()

        return acquire_for_tenant

    async def _pool(self, tenant: str) -> KernelPool:
        if self._closed:
            raise KernelError("the kernel pools are closed")
        pool = self._pools.get(tenant)
        if pool is None:
            # A reset that finds the pool empty waits for the start under way rather than
            # starting one more: a tenant never holds more than its sessions' kernels and
            # ``size`` warm ones, against a per-user limit that counts pending starts too.
            starts = max(1, self.size)
            pool = KernelPool(
                self._source_for(tenant),
                size=self.size,
                start_concurrency=1,
                max_starts=starts,
                max_kernels=self.max_kernels,
            )
            self._pools[tenant] = pool
            await pool.start()  # schedules the filler; returns at once
        return pool

    async def close(self, *, start_grace: float | None = None) -> None:
        """Close every tenant's pool (shutting its warm kernels down; ``start_grace`` as
        :meth:`KernelPool.close`); idempotent."""
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        await asyncio.gather(*(pool.close(start_grace=start_grace) for pool in pools))
