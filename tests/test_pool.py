"""KernelPool with real ipykernel processes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kernel_env.errors import KernelError, KernelStartError
from kernel_env.kernel import Kernel, LocalKernel
from kernel_env.kernel.pool import KernelPool

pytestmark = pytest.mark.integration  # kernels, servers or other processes


async def start_kernel() -> Kernel:
    kernel = LocalKernel()
    await kernel.start()
    return kernel


async def shut(*kernels: Kernel) -> None:
    """Shut kernels down, failing (not hanging) if a shutdown does not finish in 10 s."""
    tasks = {asyncio.ensure_future(k.shutdown()) for k in kernels}
    if tasks:
        _, stuck = await asyncio.wait(tasks, timeout=10)
        assert not stuck, "a kernel shutdown hung"


async def until(predicate: object, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


async def test_acquire_hands_out_a_warm_ready_kernel() -> None:
    """A warm pool hands out a started kernel that runs code."""
    pool = KernelPool(start_kernel, size=1)
    await pool.start()
    try:
        await until(lambda: pool.warm == 1)
        kernel = await pool.acquire()
        try:
            assert pool.warm_hits == 1
            result = await kernel.execute("print(6 * 7)", timeout=10)
            assert result.stdout == "42\n"
        finally:
            await shut(kernel)
    finally:
        await pool.close()


async def test_pool_refills_in_the_background() -> None:
    """After a kernel is taken, the pool starts another until it is full again."""
    pool = KernelPool(start_kernel, size=2)
    await pool.start()
    try:
        await until(lambda: pool.warm == 2)
        kernel = await pool.acquire()
        await until(lambda: pool.starting == 1)
        await until(lambda: pool.warm == 2)
        assert pool.warm == 2 and pool.starting == 0
        await shut(kernel)
    finally:
        await pool.close()


async def test_empty_pool_starts_a_kernel_on_demand() -> None:
    """With nothing warm, acquire starts a kernel itself."""
    pool = KernelPool(start_kernel, size=0)
    await pool.start()
    try:
        kernel = await pool.acquire()
        assert await kernel.is_alive()
        assert pool.warm_hits == 0
        await shut(kernel)
    finally:
        await pool.close()


async def test_a_kernel_is_never_handed_out_twice() -> None:
    """Every acquire returns a different kernel process."""
    pool = KernelPool(start_kernel, size=2)
    await pool.start()
    kernels: list[Kernel] = []
    try:
        await until(lambda: pool.warm == 2)
        kernels = [await pool.acquire() for _ in range(3)]
        assert len({k.kernel_id for k in kernels}) == 3
        assert len({k.pid for k in kernels if isinstance(k, LocalKernel)}) == 3
    finally:
        await shut(*kernels)
        await pool.close()


async def test_a_warm_kernel_that_died_is_not_handed_out() -> None:
    """A warm kernel killed while waiting is discarded; acquire returns a live one."""
    pool = KernelPool(start_kernel, size=1)
    await pool.start()
    try:
        await until(lambda: pool.warm == 1)
        victim = pool._warm[0]
        assert isinstance(victim, LocalKernel) and victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        for _ in range(200):  # until the kernel layer sees it dead
            if not await victim.is_alive():
                break
            await asyncio.sleep(0.05)
        kernel = await pool.acquire()
        try:
            assert kernel is not victim
            assert (await kernel.execute("1", timeout=10)).success
        finally:
            await shut(kernel)
    finally:
        await pool.close()


async def test_close_shuts_every_warm_kernel() -> None:
    """close() leaves no warm kernel running and refuses later acquires."""
    pool = KernelPool(start_kernel, size=2)
    await pool.start()
    await until(lambda: pool.warm == 2)
    warm = list(pool._warm)
    await pool.close()
    assert pool.warm == 0 and pool.starting == 0
    for kernel in warm:
        assert not await kernel.is_alive()
    with pytest.raises(KernelError):
        await pool.acquire()
    await pool.close()  # idempotent


async def test_close_while_kernels_are_starting_leaves_none_behind() -> None:
    """Kernels still starting when the pool closes are shut down as soon as they are up."""
    started: list[Kernel] = []

    async def tracked() -> Kernel:
        kernel = await start_kernel()
        started.append(kernel)
        return kernel

    pool = KernelPool(tracked, size=2, start_concurrency=2)
    await pool.start()
    await until(lambda: pool.starting == 2)
    await pool.close()
    assert len(started) == 2
    for kernel in started:
        assert not await kernel.is_alive()


async def test_background_starts_respect_the_concurrency_limit() -> None:
    """At most start_concurrency kernels boot at once while the pool fills."""
    pool = KernelPool(start_kernel, size=3, start_concurrency=1)
    await pool.start()
    try:
        most = 0
        while pool.warm < 3:
            most = max(most, pool.starting)
            await asyncio.sleep(0.01)
        assert most == 1
    finally:
        await pool.close()


async def test_acquires_and_refills_start_at_most_max_starts_kernels_at_once() -> None:
    """Acquires that find the pool empty wait for a start to end past max_starts (starts
    piling up on a loaded machine made each one dearer), then take a kernel a refill placed
    or start their own; each gets a kernel of its own."""
    in_flight = most = 0

    async def counted() -> Kernel:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await start_kernel()
        finally:
            in_flight -= 1

    pool = KernelPool(counted, size=1, start_concurrency=1, max_starts=2)
    await pool.start()
    kernels: list[Kernel] = []
    try:
        kernels = list(await asyncio.gather(*(pool.acquire() for _ in range(5))))
        assert most == 2
        assert len(set(map(id, kernels))) == 5
        assert all([await k.is_alive() for k in kernels])
    finally:
        await shut(*kernels)
        await pool.close()


async def test_failing_starts_back_off_and_surface_on_acquire() -> None:
    """A factory that cannot start kernels is retried with backoff, and acquire raises."""

    async def broken() -> Kernel:
        kernel = LocalKernel(python="/nonexistent/python")
        await kernel.start()
        return kernel

    pool = KernelPool(broken, size=2)
    await pool.start()
    try:
        await until(lambda: pool.start_failures >= 2)
        await asyncio.sleep(0.3)
        assert pool.start_failures <= 4  # backing off, not spinning
        with pytest.raises(KernelStartError):
            await pool.acquire()
    finally:
        await pool.close()
