"""``KernelEnvHost``: one node's ``kernel-env serve``, run inside a Ray actor on that node.

The actor holds what a server holds on one machine (the forkserver, the warm pool, the sandbox
and the limits) and serves the same HTTP + ``/ws`` protocol on the node's address, so a kernel
starts there as fast as on one machine and an episode's steps travel the way a single server's
do: over its own ``/ws``. Ray carries only what placement needs: where the server listens, its
token, its load, and the opening of a session (with the caller's own model, when it lends one).

The server's token is made here, per actor, and travels only in Ray's replies to callers on the
cluster; the server keeps it from kernels, logs and exports as it does any token.

Each host keeps the episodes it runs in a store of its own machine's (:func:`node_store`):
by default ``<state dir>/kernel_env/episodes/<hostname>``, so that nodes whose home
directory is shared (NFS) never write one SQLite index together. The cluster client lists
and fetches them across the hosts (``KernelEnvCluster.episodes``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import ray

from kernel_env.errors import CapacityReached
from kernel_env.llm import CallableBackend, LLMBackend
from kernel_env.server.app import create_app
from kernel_env.server.auth import DEFAULT_TENANT, Tenant
from kernel_env.server.capacity import machine_capacity
from kernel_env.server.runner import DrainingServer, build_server
from kernel_env.server.runtime import Runtime
from kernel_env.server.settings import ServerSettings, default_episodes

__all__ = ["LLM", "KernelEnvHost", "node_store"]

# What a caller may lend for its episode's llm_query: a backend, or fn(prompt) -> str.
LLM = LLMBackend | Callable[[str], str] | Callable[[str], Awaitable[str]]

log = logging.getLogger(__name__)

_OWNER = Tenant(DEFAULT_TENANT, "operator")  # the token's tenant (KERNEL_ENV_TOKEN's)
_RATE_WINDOW = 10.0  # seconds over which episodes/s is measured
_TICK = 0.5  # seconds between load samples (and looks at the raylet)
_START_TIMEOUT = 60.0


class KernelEnvHost:
    """A kernel_env server on this node with ``slots`` sessions (one kernel each) at most.

    ``settings``: :class:`ServerSettings` fields (``step_timeout``, ``pool_size``,
    ``sandbox``, ...); the node's ``KERNEL_ENV_*`` variables apply beneath them, as for
    ``kernel-env serve`` (its model for ``llm_query`` and that model's key, say)."""

    def __init__(self, slots: int, settings: dict[str, Any] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a host needs at least one kernel slot, got {slots}")
        self.slots = slots
        self._overrides = dict(settings or {})
        self._token = secrets.token_urlsafe(32)
        self._start_lock: asyncio.Lock | None = None
        self._server: DrainingServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._settings: ServerSettings | None = None
        self._runtime: Runtime | None = None
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._sampler: asyncio.Task[None] | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        self._raylet = os.getppid()  # a worker's parent: its node's raylet

    # -- the server ---------------------------------------------------------------------------

    async def _started(self) -> Runtime:
        if self._runtime is not None:
            return self._runtime
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._runtime is None:
                await self._start()
        assert self._runtime is not None
        return self._runtime

    async def _start(self) -> None:
        _take_the_nodes_priority(self._raylet)  # before any thread or process of the server
        pool = int(self._overrides.pop("pool_size", min(4, self.slots)))
        settings = ServerSettings.from_env(
            **{
                "log_level": "warning",
                **self._overrides,
                "host": ray.util.get_node_ip_address(),
                "port": 0,
                "token": self._token,
                "max_sessions": self.slots,
                "max_kernels": self.slots,
                "pool_size": min(pool, self.slots),
            }
        )
        settings = self._within_capacity(settings)
        if settings.episodes is not None:
            episodes = node_store(settings.episodes, self.node_id)
            settings = replace(settings, episodes=episodes)
        app = create_app(settings)
        server, sock, settings = build_server(settings, app)
        self._server, self._settings = server, settings
        self._serving = asyncio.create_task(server.serve(sockets=[sock]), name="kernel-env-host")
        deadline = time.monotonic() + _START_TIMEOUT
        while not server.started:
            if self._serving.done():
                self._serving.result()  # raises why it stopped
                raise RuntimeError("the kernel_env server stopped as it started")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel_env server did not start in {_START_TIMEOUT} s")
            await asyncio.sleep(0.01)
        self._runtime = app.state.runtime
        self._sampler = asyncio.create_task(self._sample_forever(), name="kernel-env-host-load")

    def _within_capacity(self, settings: ServerSettings) -> ServerSettings:
        """The settings with no more slots than this machine holds (``server/capacity``): a
        node that declares more ``kernel_env`` than it holds gets a warning and its capacity."""
        held = machine_capacity(
            local=settings.gateway_url is None, forked=settings.forkserver
        ).kernels
        if held >= self.slots:
            return settings
        log.warning(
            "node %s declares %d kernel_env slots but holds %d kernels: serving %d "
            "(kernel-env capacity prints the figure)",
            self.node_id,
            self.slots,
            held,
            held,
        )
        self.slots = held
        return replace(
            settings,
            max_sessions=held,
            max_kernels=held,
            pool_size=min(settings.pool_size, held),
        )

    # -- what callers ask through Ray ---------------------------------------------------------

    async def endpoint(self) -> dict[str, Any]:
        """Where this host's server listens, its token, and its step timeout."""
        await self._started()
        settings = self._settings
        assert settings is not None
        return {
            "node_id": self.node_id,
            "url": settings.url,
            "token": self._token,
            "step_timeout": settings.step_timeout,
            "slots": self.slots,
            "pid": os.getpid(),
        }

    async def open_session(self, llm: LLM | None = None) -> str | None:
        """A new session for a caller that attaches to it over ``/ws?session=``; None when
        every slot is taken. ``llm`` answers that episode's ``llm_query`` instead of the
        host's model."""
        runtime = await self._started()
        env = runtime.new_environment(_backend(llm)) if llm is not None else None
        try:
            session = runtime.sessions.open("http", _OWNER, env)
        except CapacityReached:
            if env is not None:
                await env.close()
            return None
        # Named by its caller already: never evicted as an unused HTTP session to make room.
        session.claimed = True
        return session.id

    async def load(self) -> dict[str, Any]:
        """This host's load: sessions, kernels, episodes/s (over the last 10 s), and the
        server's counters."""
        runtime = await self._started()
        from kernel_env.server import metrics

        snapshot = metrics.collect(runtime.sessions, runtime.pool, runtime.started)
        return {
            "node_id": self.node_id,
            "slots": self.slots,
            "sessions": snapshot["sessions_active"],
            "kernels": snapshot["kernels"],
            "max_kernels": snapshot["max_kernels"],
            "warm": snapshot["pool_warm"],
            "episodes_total": snapshot["sessions_total"],
            "episodes_per_s": round(self._rate(runtime), 3),
            "steps": snapshot["steps"],
            "kernels_refused": snapshot["kernels_refused"],
            "rss_bytes": snapshot["rss_bytes"],
        }

    async def ping(self) -> str:
        return self.node_id

    async def close(self) -> None:
        """Drain the server (steps in flight answer) and stop it; the actor can then go."""
        server, self._server = self._server, None
        if self._sampler is not None:
            self._sampler.cancel()
        if server is not None:
            server.should_exit = True
            if self._serving is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._serving, 30)
        self._runtime = None

    def _end_with_the_node(self) -> None:
        """A host outlives its raylet otherwise (Ray's workers notice late, or not at all),
        and would go on serving episodes on a node Ray counts as dead: it ends at once, and
        its episodes see their sockets close (kernels end with it)."""
        if os.getppid() != self._raylet:
            log.error("the raylet of node %s is gone: this kernel_env host ends", self.node_id)
            os._exit(1)

    # -- load over time -----------------------------------------------------------------------

    def _rate(self, runtime: Runtime) -> float:
        now, total = time.monotonic(), runtime.sessions.opened_total
        if not self._samples:
            return 0.0
        then, before = self._samples[0]
        return (total - before) / (now - then) if now > then else 0.0

    async def _sample_forever(self) -> None:
        gauges = _gauges()
        while (runtime := self._runtime) is not None:
            self._end_with_the_node()
            now = time.monotonic()
            self._samples.append((now, runtime.sessions.opened_total))
            while self._samples and now - self._samples[0][0] > _RATE_WINDOW:
                self._samples.popleft()
            if gauges is not None:
                tags = {"node_id": self.node_id}
                gauges[0].set(runtime.sessions.active, tags=tags)
                gauges[1].set(runtime.pool.live, tags=tags)
                gauges[2].set(self._rate(runtime), tags=tags)
            await asyncio.sleep(_TICK)


def _take_the_nodes_priority(raylet: int) -> None:
    """Ray starts its workers at niceness 15 (its ``worker_niceness``), and a host's server,
    forkserver and kernels would inherit it: on a busy node every other process (the
    trainer's, the raylet's) then takes the CPU first, and a host's steps were several times a
    server's beside it (``benchmarks/README.md``). Every thread of this process takes the
    raylet's niceness instead (what it forks later inherits it), where this process may lower
    its own (root, or ``CAP_SYS_NICE``); elsewhere it says how to start the node instead."""
    try:
        wanted, now = os.getpriority(os.PRIO_PROCESS, raylet), os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:  # the raylet gone: _end_with_the_node ends this host
        return
    if now <= wanted:
        return
    try:
        for thread in os.listdir("/proc/self/task"):  # Linux: a niceness is a thread's
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(thread), wanted)
    except PermissionError:
        log.warning(
            "this kernel_env host runs at niceness %d (Ray's worker niceness), its raylet at "
            "%d: on a busy node its kernels get the CPU last; start the node with "
            "RAY_worker_niceness=%d in its environment (or run it as root)",
            now,
            wanted,
            wanted,
        )


def node_store(episodes: str, node_id: str) -> str:
    """Where a host on node ``node_id`` keeps its episodes, given the ``episodes`` setting:
    the setting's ``{node_id}`` and ``{hostname}`` filled in, if it names either; else, for
    the default store, its ``<hostname>`` subdirectory; else the setting as it is."""
    hostname = socket.gethostname() or "localhost"
    if "{node_id}" in episodes or "{hostname}" in episodes:
        return episodes.replace("{node_id}", node_id).replace("{hostname}", hostname)
    if episodes == default_episodes(os.environ):
        return os.path.join(episodes, hostname)
    return episodes


def _backend(llm: LLM) -> LLMBackend:
    if callable(getattr(llm, "complete", None)):
        return cast(LLMBackend, llm)
    return CallableBackend(cast(Callable[[str], str], llm))


def _gauges() -> tuple[Any, Any, Any] | None:
    """Ray's own metrics (its dashboard and Prometheus endpoint show them), where available."""
    try:
        from ray.util.metrics import Gauge

        keys = ("node_id",)
        return (
            Gauge("kernel_env_sessions", "open kernel_env sessions on the node", tag_keys=keys),
            Gauge("kernel_env_kernels", "kernel_env kernels on the node", tag_keys=keys),
            Gauge("kernel_env_episodes_per_s", "episodes opened per second", tag_keys=keys),
        )
    except Exception:  # metrics are a convenience: never a reason for a host not to serve
        return None
