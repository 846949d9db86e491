"""``KernelEnvCluster``: episodes placed across the kernel_env hosts of a Ray cluster.

From any Ray driver or worker::

    cluster = KernelEnvCluster()                 # ray.init() first, or address=
    async with await cluster.episode() as env:   # an AsyncKernelEnv on some host
        await env.reset(context="a b a", expected_answer="2")
        await env.step(REPLAction(code="FINAL(context.count('a'))"))
    print(await cluster.load())                  # {node_id: {"sessions": ..., ...}}
    rows = await cluster.episodes(reward_min=1)  # what the hosts' stores keep, newest first
    notebook = await cluster.notebook(rows[0]["episode_id"])

An episode is opened on a host with a free slot (:mod:`kernel_env.ray.placement`: the caller's
own node first, else the least loaded) by connecting to that host's own ``/ws``, over which its
steps then travel, as with a single ``kernel-env serve`` (measured against Ray calls in
benchmarks/README.md); a Ray call opens the session first only to lend the caller's model for
``llm_query``. Ray carries the look at the hosts' loads, once a second. When no host
has room, ``episode()`` waits up to ``capacity_timeout`` and then raises ``CapacityReached``,
as a full server does. A host that dies (its node, or its process) ends its episodes with
:class:`HostLost` at their next call, at once when its sockets close and at the latest after
the host's step timeout and a grace; new episodes go to the hosts that answer, and a host Ray
restarted, or a node that joined, takes episodes again from the next look (every second).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError

from kernel_env.client import AsyncKernelEnv
from kernel_env.errors import CapacityReached, RemoteError, UnknownEpisode, remote_error
from kernel_env.ray.host import LLM
from kernel_env.ray.hosts import host_for, kernel_nodes
from kernel_env.ray.placement import HostLoad, choose
from kernel_env.remote import RemoteSession, http_get, list_episodes

__all__ = ["ClusterEpisode", "HostLost", "KernelEnvCluster"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_REFRESH_S = 1.0  # how old the hosts' loads may be when placing
_PROBE_TIMEOUT = 10.0  # a host that answers no load query in this long is left out
_START_WAIT = 1.0  # how long a look waits for a host that is still starting
_OPEN_TIMEOUT = 10.0
_WAIT_STEP = 0.2  # seconds between looks for room while the cluster is full
_STEP_GRACE = 10.0  # past the step timeout: the timeout ladder's interrupt and restart
_LOST = ("CONNECTION_CLOSED", "TIMEOUT")
# GET /episodes's filters, as AsyncKernelEnv.episodes takes them
_EPISODE_FILTERS = ("task", "reward_min", "reward_max", "done", "state", "kernel", "since", "until")


class HostLost(RemoteError):
    """The host that ran this episode is gone (its node died, or its process did and Ray is
    restarting it): the kernel and its state are lost. Start a new episode."""


class ClusterEpisode(AsyncKernelEnv):
    """An :class:`AsyncKernelEnv` attached to a session on one host (``node_id``)."""

    node_id: str
    # Set while the session has answered nothing: a host that refuses it for want of room
    # (another client filled it since the last look) sends it to another host.
    _placer: KernelEnvCluster | None = None
    _counted: KernelEnvCluster | None = None  # the client that counts this session as open

    async def close(self) -> None:
        counted, self._counted = self._counted, None
        if counted is not None:  # its slot is free again before the next look says so
            counted._released(self.node_id)
        await super().close()

    async def _call(self, op: Callable[[Any], Awaitable[T]], *, step: bool = False) -> T:
        try:
            result = await super()._call(op, step=step)
        except CapacityReached:
            placer, self._placer = self._placer, None
            if placer is None:
                raise
            await self._move(placer)
            return await self._call(op, step=step)
        except RemoteError as exc:
            if exc.code not in _LOST or isinstance(exc, HostLost):
                raise
            raise _lost(self.node_id, str(exc)) from None
        except ConnectionError as exc:
            raise _lost(self.node_id, str(exc)) from None
        self._placer = None
        return result

    async def _move(self, placer: KernelEnvCluster) -> None:
        """To a session on another host (this one is full, and closed it)."""
        counted, self._counted = self._counted, None
        if counted is not None:
            counted._released(self.node_id)
        placer._mark_full(self.node_id)
        other = await placer.episode()
        old, self._session = self._session, other._session
        self._remote, self.node_id, self._placer = other._remote, other.node_id, other._placer
        self._counted, other._counted = other._counted, None
        if old is not None:
            await old.close()

    async def _attach(self, session_ids: list[str]) -> list[AsyncKernelEnv]:
        copies = await super()._attach(session_ids)  # a fork's copies live on this host too
        return [_adopt(copy, self.node_id) for copy in copies]


def _lost(node_id: str, why: str) -> HostLost:
    return HostLost(
        f"the kernel_env host on node {node_id[:12]} is gone ({why}): this episode's kernel "
        "and its state are lost; start a new episode",
        code="HOST_LOST",
        data={"node_id": node_id},
    )


def _adopt(client: AsyncKernelEnv, node_id: str) -> ClusterEpisode:
    session = client._session
    assert isinstance(session, RemoteSession)
    return _episode(session, client._remote, node_id)


def _episode(
    session: RemoteSession, remote: tuple[str, float, float, str | None], node_id: str
) -> ClusterEpisode:
    episode = ClusterEpisode._around(session, None, remote)
    assert isinstance(episode, ClusterEpisode)
    episode.node_id = node_id
    return episode


class KernelEnvCluster:
    """Places episodes on the cluster's kernel_env hosts (see the module's docs).

    ``address``: the Ray cluster to join when this process has not (``ray.init`` is called
    with it); ``settings``: the hosts' :class:`~kernel_env.server.ServerSettings` fields, used
    by the hosts this client starts (running ones keep theirs); ``capacity_timeout``: how long
    ``episode()`` waits for a free slot; ``prefer_own_node``: place on the caller's own node
    first when it hosts kernels."""

    def __init__(
        self,
        address: str | None = None,
        *,
        settings: dict[str, Any] | None = None,
        capacity_timeout: float = 60.0,
        prefer_own_node: bool = True,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.settings = settings
        self.capacity_timeout = capacity_timeout
        self.connect_timeout_s = connect_timeout_s
        own = ray.get_runtime_context().get_node_id()
        self._own = own if prefer_own_node else None
        self._hosts: dict[str, ActorHandle] = {}
        self._endpoints: dict[str, dict[str, Any]] = {}
        self._starting: dict[str, asyncio.Future[Any]] = {}  # endpoints asked, not answered
        self._loads: dict[str, HostLoad] = {}
        self._looked = 0.0
        self._lock = asyncio.Lock()
        self.placed: dict[str, int] = {}  # episodes this client opened, by node

    # -- placing ------------------------------------------------------------------------------

    async def episode(self, *, llm: LLM | None = None) -> ClusterEpisode:
        """A new episode's client, attached to a session on a host with room. ``llm``: a
        backend or ``fn(prompt) -> str`` (picklable: it runs on the host) answering this
        episode's ``llm_query`` instead of the host's model."""
        deadline = time.monotonic() + self.capacity_timeout
        while True:
            await self._look(force=False)
            pick = choose(self._loads.values(), own_node=self._own)
            if pick is not None:
                episode = await self._open_on(pick, llm)
                if episode is not None:
                    self.placed[pick.node_id] = self.placed.get(pick.node_id, 0) + 1
                    return episode
                continue
            if time.monotonic() >= deadline:
                raise self._full()
            await asyncio.sleep(_WAIT_STEP)
            await self._look(force=True)

    async def _open_on(self, load: HostLoad, llm: LLM | None) -> ClusterEpisode | None:
        """A session on this host: opened by the ``/ws`` connection itself (as with one server;
        a refusal for room moves the episode at its first call), or, to lend the caller's
        model, by a Ray call first."""
        node = load.node_id
        if node not in self._hosts or node not in self._endpoints:
            self._loads.pop(node, None)  # forgotten meanwhile: not a candidate until looked at
            return None
        host, endpoint = self._hosts[node], self._endpoints[node]
        # Counted at once, so that episodes placed together spread over the hosts.
        self._loads[node] = HostLoad(node, load.sessions + 1, load.slots)
        session_id = None
        if llm is not None:
            try:
                opening = _ref(host.open_session.remote(llm))
                session_id = await asyncio.wait_for(opening, _OPEN_TIMEOUT)
            except (RayError, TimeoutError) as exc:
                self._forget(node, exc)
                return None
            if session_id is None:  # full since the last look
                self._mark_full(node)
                return None
        remote = (
            endpoint["url"],
            self.connect_timeout_s,
            float(endpoint["step_timeout"]) + _STEP_GRACE,
            endpoint["token"],
        )
        try:
            session = await RemoteSession.connect(
                remote[0],
                connect_timeout_s=remote[1],
                message_timeout_s=remote[2],
                token=remote[3],
                session_id=session_id,
            )
        except (ConnectionError, RemoteError) as exc:  # restarted since: a new port and token
            self._forget(node, exc)
            return None
        episode = _episode(session, remote, node)
        episode._counted = self
        if session_id is None:
            episode._placer = self
        return episode

    def _released(self, node: str) -> None:
        if (load := self._loads.get(node)) is not None and load.sessions > 0:
            self._loads[node] = HostLoad(node, load.sessions - 1, load.slots)

    def _mark_full(self, node: str) -> None:
        if (load := self._loads.get(node)) is not None:
            self._loads[node] = HostLoad(node, load.slots, load.slots)

    def _full(self) -> RemoteError:
        slots = sum(load.slots for load in self._loads.values())
        hosts = len(self._loads)
        message = (
            f"no kernel_env host had a free slot for {self.capacity_timeout:g} s: "
            f"{hosts} host(s) answer, with {slots} slot(s) in all, every one in use; close "
            "episodes, add nodes that declare the kernel_env resource, or wait longer "
            "(capacity_timeout)"
        )
        data = {"hosts": hosts, "max_sessions": slots, "active_sessions": slots}
        return remote_error("CapacityReached", message, code="CAPACITY_REACHED", data=data)

    # -- looking at the hosts -----------------------------------------------------------------

    async def _look(self, *, force: bool) -> None:
        """Refresh the hosts and their loads if they are older than a second (or ``force``)."""
        async with self._lock:
            if not force and time.monotonic() - self._looked < _REFRESH_S:
                return
            nodes = await asyncio.to_thread(kernel_nodes)
            for node in set(self._hosts) - set(nodes):
                self._hosts.pop(node, None)
                self._endpoints.pop(node, None)
                if (starting := self._starting.pop(node, None)) is not None:
                    starting.cancel()
            for node, slots in nodes.items():
                if node not in self._hosts:
                    self._hosts[node] = await asyncio.to_thread(
                        host_for, node, slots, self.settings
                    )
            answers = await asyncio.gather(*(self._probe(node) for node in nodes))
            self._loads = {load.node_id: load for load in answers if load is not None}
            self._looked = time.monotonic()

    async def _probe(self, node: str) -> HostLoad | None:
        host = self._hosts[node]
        try:
            if node not in self._endpoints and not await self._started(node, host):
                return None  # still starting (a new node's): placement goes on without it
            load = await asyncio.wait_for(_ref(host.load.remote()), _PROBE_TIMEOUT)
        except (RayError, TimeoutError) as exc:
            self._forget(node, exc)
            return None
        return HostLoad(node, int(load["sessions"]), int(load["slots"]))

    async def _started(self, node: str, host: ActorHandle) -> bool:
        """Whether the host's server serves (its endpoint then known); a host still starting
        is waited for a moment only, its start going on between looks."""
        starting = self._starting.get(node)
        if starting is None:
            starting = asyncio.ensure_future(_ref(host.endpoint.remote()))
            self._starting[node] = starting
        await asyncio.wait({starting}, timeout=_START_WAIT)
        if not starting.done():
            return False
        del self._starting[node]
        self._endpoints[node] = starting.result()  # raises what the host's start raised
        return True

    def _forget(self, node: str, why: BaseException) -> None:
        """A host that did not answer: no episodes until it does again; its endpoint is asked
        anew (a restarted host listens on a new port, with a new token)."""
        log.warning("kernel_env host on node %s unavailable: %s", node[:12], _short(why))
        self._loads.pop(node, None)
        self._endpoints.pop(node, None)
        self._hosts.pop(node, None)
        if (starting := self._starting.pop(node, None)) is not None:
            starting.cancel()

    async def load(self) -> dict[str, dict[str, Any]]:
        """Every host's load, by node id, in one call: sessions, slots, kernels, warm kernels,
        episodes/s (last 10 s), episodes and steps so far; ``{"alive": False, "error": ...}``
        for a host that does not answer."""
        await self._look(force=True)
        nodes = list(self._hosts)
        refs = [_ref(self._hosts[node].load.remote()) for node in nodes]
        answers = await asyncio.gather(
            *(asyncio.wait_for(ref, _PROBE_TIMEOUT) for ref in refs), return_exceptions=True
        )
        loads: dict[str, dict[str, Any]] = {}
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, BaseException):
                loads[node] = {"alive": False, "error": _short(answer)}
            else:
                loads[node] = {"alive": True, **answer}
        return loads

    # -- the episodes the hosts keep ------------------------------------------------------------

    async def episodes(self, *, limit: int | None = 100, **filters: Any) -> list[dict[str, Any]]:
        """The episodes the hosts' stores keep, newest first, ``limit`` at most: each host's
        ``GET /episodes`` with ``filters`` (those of :meth:`AsyncKernelEnv.episodes`), each
        row with the ``node_id`` of a host that keeps it. A host that does not answer is
        left out, and logged."""
        unknown = set(filters) - set(_EPISODE_FILTERS)
        if unknown:
            raise TypeError(f"unknown episode filter(s): {', '.join(sorted(unknown))}")
        endpoints = await self._live_endpoints()
        answers = await asyncio.gather(
            *(
                list_episodes(e["url"], token=e["token"], filters=filters, limit=limit)
                for e in endpoints.values()
            ),
            return_exceptions=True,
        )
        rows: dict[str, dict[str, Any]] = {}
        for node, answer in zip(endpoints, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning(
                    "kernel_env host on node %s lists no episodes: %s", node[:12], _short(answer)
                )
                continue
            for row in answer:  # hosts on one machine may share its store: each row once
                rows.setdefault(row["episode_id"], {**row, "node_id": node})
        newest = sorted(rows.values(), key=lambda row: row["started"], reverse=True)
        return newest if limit is None else newest[:limit]

    async def notebook(self, episode_id: str) -> bytes:
        """A stored episode's notebook (``.ipynb``), from the host that keeps it; the
        unknown-episode error when no live host does."""
        from urllib.parse import quote

        path = f"/episodes/{quote(episode_id, safe='')}/notebook"
        unknown: Exception | None = None
        for node, endpoint in (await self._live_endpoints()).items():
            try:
                return await http_get(endpoint["url"], path, token=endpoint["token"])
            except UnknownEpisode as exc:
                unknown = exc
            except (ConnectionError, RemoteError) as exc:
                log.warning("kernel_env host on node %s: %s", node[:12], _short(exc))
        if unknown is not None:
            raise unknown
        raise ConnectionError("no kernel_env host answered for the stored episode")

    async def _live_endpoints(self) -> dict[str, dict[str, Any]]:
        """Every answering host's endpoint (its URL and token), by node."""
        await self._look(force=True)
        return {node: self._endpoints[node] for node in self._loads if node in self._endpoints}


async def _ref(ref: Any) -> Any:
    return await ref


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
