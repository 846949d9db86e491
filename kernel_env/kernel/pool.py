"""``KernelPool``: kernels started ahead of time, so that a reset does not wait for one.

A kernel start takes a cold kernel's import of ipykernel and more; taking a warm kernel costs a
deque pop. The pool keeps ``size`` kernels warm or starting, refilling in the background after
each ``acquire``. A kernel leaves the pool for good: the episode that took it shuts it down,
so no state ever crosses from one episode to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque

from kernel_env.errors import KernelCapacity, KernelError
from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.text import shorten

__all__ = ["KernelCapacity", "KernelPool"]

log = logging.getLogger(__name__)

# Starts a kernel and returns it once it is ready.

_MAX_BACKOFF = 30.0  # seconds between refill attempts while kernels keep failing to start
_CAPPED_RECHECK = 0.5  # seconds between refill checks while max_kernels holds the pool back


class KernelPool:
    """Up to ``size`` ready kernels; ``acquire`` hands one out, or starts one if none is warm.

    Example::

        pool = KernelPool(start_local_kernel, size=4)
        await pool.start()
        kernel = await pool.acquire()   # ready at once when the pool is warm
        ...
        await kernel.shutdown()         # the caller owns it now
        await pool.close()              # shuts every warm kernel
    """

    def __init__(
        self,
        kernel_factory: KernelSource,
        *,
        size: int = 4,
        start_concurrency: int | None = None,
        max_starts: int | None = None,
        close_timeout: float = 15.0,
        max_kernels: int | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        if max_kernels is not None and max_kernels < 1:
            raise ValueError(f"max_kernels must be >= 1, got {max_kernels}")
        self.size = size
        # One budget for every kernel that comes from this pool: warm ones, starting ones, and
        # those handed out (sessions' and rlm_query children's) until they shut down.
        self.max_kernels = max_kernels
        self._out: set[Kernel] = set()
        self._acquiring = 0
        self.refused = 0  # acquires refused at max_kernels
        # One boot per two cores keeps a core free for the server and the episodes, at nearly
        # the same refill throughput: more refills at once made the resets that triggered
        # them slower, cold or forked, for no more episodes/s under load (an acquire that
        # finds the pool empty starts its own kernel, within max_starts). Figures:
        # benchmarks/README.md, "The figures behind the code's choices".
        self.start_concurrency = start_concurrency or max(1, (os.cpu_count() or 2) // 2)
        # Kernel starts in flight at most, refills and acquires that found the pool empty
        # together; an acquire past it waits for a start to end, and takes the kernel a
        # refill placed, if one did. Under sustained load (8 sessions resetting back to back
        # on 2 cores) the acquires' own starts piled up and every start took more of the
        # machine's CPU; a bound of cores + 1 gave more episodes/s (one at a time left the
        # CPUs idle). See benchmarks/README.md.
        self.max_starts = max_starts or max((os.cpu_count() or 2) + 1, self.start_concurrency)
        if self.max_starts < self.start_concurrency:
            raise ValueError(
                f"max_starts ({self.max_starts}) must be >= start_concurrency "
                f"({self.start_concurrency})"
            )
        self.close_timeout = close_timeout
        self._factory = kernel_factory
        self._warm: deque[Kernel] = deque()
        self._starts: set[asyncio.Task[None]] = set()
        self._need = asyncio.Event()
        self._placed = asyncio.Event()  # a start ended (its kernel placed, or it failed)
        self._start_ended = asyncio.Event()  # any start ended, an acquire's own included
        self._filler: asyncio.Task[None] | None = None
        self._closed = False
        self._first_fill = 0.0
        self.acquired = 0  # kernels handed out
        self.warm_hits = 0  # ... of which were warm
        self.start_failures = 0
        self._fail_streak = 0
        self.last_failure: str | None = None  # why the latest start failed, while they fail

    @property
    def warm(self) -> int:
        """Kernels ready to be handed out."""
        return len(self._warm)

    @property
    def starting(self) -> int:
        """Kernels being started in the background."""
        return len(self._starts)

    @property
    def live(self) -> int:
        """Kernels running or starting that came from this pool, handed out ones included."""
        self._out = {k for k in self._out if k.started}  # shut down: no longer counted
        return len(self._warm) + len(self._starts) + len(self._out) + self._acquiring

    def _room(self) -> int:
        return self.max_kernels - self.live if self.max_kernels is not None else 1 << 30

    async def start(self) -> None:
        """Begin filling the pool in the background; returns at once."""
        if self._closed:
            raise KernelError("the kernel pool is closed")
        if self._filler is None:
            self._first_fill = time.perf_counter()
            self._filler = asyncio.create_task(self._fill_forever(), name="kernel-pool-filler")
            self._need.set()

    async def acquire(self) -> Kernel:
        """A ready kernel, now owned by the caller (who must shut it down)."""
        if self._closed:
            raise KernelError("the kernel pool is closed")
        self.acquired += 1
        if not self._warm and self._room() <= 0 and self._starts:
            # The budget is spent, but part of it is a pool kernel on its way: wait for it.
            await self._wait_for_placed()
            if self._closed:
                raise KernelError("the kernel pool is closed")
        while True:
            while self._warm:
                kernel = self._warm.popleft()
                self._need.set()
                if await kernel.is_alive():
                    self.warm_hits += 1
                    self._out.add(kernel)
                    return kernel
                # Died while waiting (OOM killer, a stray signal): never hand out a dead one.
                log.warning("warm kernel %s died in the pool; discarding it", kernel.kernel_id)
                await kernel.shutdown()
            if self._closed:
                raise KernelError("the kernel pool is closed")
            if len(self._starts) + self._acquiring < self.max_starts:
                break
            self._start_ended.clear()
            await self._start_ended.wait()  # then a warm kernel, or room for a start
        self._need.set()
        if self._room() <= 0:
            await self._wait_for_room()
        if self._room() <= 0:
            self.refused += 1
            raise KernelCapacity(
                f"no kernel available: all {self.max_kernels} kernels of this server are in "
                "use (sessions, warm pool and rlm_query children count alike); retry later"
            )
        self._acquiring += 1
        try:
            kernel = await self._factory()
        finally:
            self._acquiring -= 1
            self._start_ended.set()
            self._need.set()  # a refill it held back may start now
        self._out.add(kernel)
        return kernel

    async def _wait_for_room(self, grace: float = 2.0) -> None:
        """A kernel handed out may be on its way down (a session just closed to make room
        for this one): it stops counting once its shutdown begins. Wait a moment for that."""
        deadline = asyncio.get_running_loop().time() + grace
        while self._room() <= 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    async def _wait_for_placed(self) -> None:
        while not self._warm and self._starts and not self._closed:
            self._placed.clear()
            await self._placed.wait()

    async def close(self, *, start_grace: float | None = None) -> None:
        """Shut down every warm kernel and stop refilling; idempotent. ``start_grace``:
        seconds a kernel start in flight may take to finish (then, seeing the pool closed,
        it shuts its kernel down itself) before it is cancelled, which shuts the kernel
        down too; ``close_timeout`` by default. A server that is stopping passes a short one:
        a start that is slow to come up must not hold its shutdown up."""
        self._closed = True
        self._start_ended.set()  # an acquire waiting for a start raises
        filler, self._filler = self._filler, None
        if filler is not None:
            filler.cancel()
            await asyncio.gather(filler, return_exceptions=True)
        if self._starts:
            # Let a start finish rather than cancel it at once: a remote kernel (a gateway's)
            # whose creation is cancelled half-way may be left running where this host does
            # not know its id.
            grace = self.close_timeout if start_grace is None else start_grace
            _, pending = await asyncio.wait(set(self._starts), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        warm, self._warm = list(self._warm), deque()
        if warm:
            shutdowns = {asyncio.ensure_future(k.shutdown()) for k in warm}
            _, stuck = await asyncio.wait(shutdowns, timeout=self.close_timeout)
            if stuck:
                log.error(
                    "%d warm kernel(s) did not shut down in %.0f s", len(stuck), self.close_timeout
                )

    # -- refilling ------------------------------------------------------------------------

    async def _fill_forever(self) -> None:
        # Woken whenever a kernel leaves the pool or a start ends; starts are not awaited
        # here, so a refill begins the moment a kernel is taken and a start slot is free.
        while True:
            if self.max_kernels is not None and self.size > len(self._warm) + len(self._starts):
                # Held back by max_kernels: a handed-out kernel's shutdown frees room without
                # telling the pool, so look again shortly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._need.wait(), _CAPPED_RECHECK)
            else:
                await self._need.wait()
            self._need.clear()
            if self._fail_streak:
                await asyncio.sleep(self._backoff())
            missing = min(self.size - len(self._warm) - len(self._starts), self._room())
            slots = min(
                self.start_concurrency - len(self._starts),
                self.max_starts - len(self._starts) - self._acquiring,
            )
            for _ in range(min(missing, slots)):
                task = asyncio.create_task(self._start_one(), name="kernel-pool-start")
                self._starts.add(task)
                task.add_done_callback(self._starts.discard)

    @property
    def can_start(self) -> bool:
        """Readiness: False while kernel starts keep failing and no warm kernel is left."""
        return self._fail_streak == 0 or bool(self._warm)

    def _backoff(self) -> float:
        """Seconds before the next start while starts keep failing: 0.5 s, doubling, to 30 s."""
        return min(_MAX_BACKOFF, 0.5 * 2 ** (self._fail_streak - 1)) if self._fail_streak else 0.0

    async def _start_one(self) -> None:
        try:
            await self._start_and_place()
        finally:
            # The slot is free only now, after the kernel is placed or shut down: close()
            # waits for the tasks in _starts, so none may be running a shutdown unseen.
            self._starts.discard(asyncio.current_task())
            self._need.set()
            self._placed.set()
            self._start_ended.set()

    async def _start_and_place(self) -> None:
        try:
            kernel = await self._factory()
        except Exception as exc:
            self.start_failures += 1
            self._fail_streak += 1
            self.last_failure = shorten(f"{type(exc).__name__}: {exc}", 300, one_line=True)
            # One line a failure (a traceback only at debug level): an unreachable gateway
            # fails every start, and the backoff below spaces them out.
            log.warning(
                "a pool kernel failed to start (%d in a row; next try in %.1f s): %s",
                self._fail_streak,
                self._backoff(),
                self.last_failure,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            return
        self._fail_streak, self.last_failure = 0, None
        if self._closed:
            await asyncio.shield(kernel.shutdown())
            return
        self._warm.append(kernel)
        if self._first_fill and len(self._warm) >= self.size:
            took = time.perf_counter() - self._first_fill
            log.info("kernel pool warm: %d kernel(s) ready after %.1f s", self.size, took)
            self._first_fill = 0.0
