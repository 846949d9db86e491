"""Sessions: one WebSocket (or one HTTP session id) = one session = one ``KernelEnvironment``.

The manager enforces ``max_sessions`` when a session opens, reaps sessions idle longer than the
TTL (their kernel is shut down; later calls get a clear "session expired"), and on shutdown
drains: in-flight requests get ``drain_timeout`` to finish and answer, the rest are cancelled
and answered with an error, then every kernel is shut down.

A session is *claimed* once a request names it (``X-Session-Id``), or from the start for a
WebSocket. OpenEnv's HTTP clients are stateless and never send the id back, so each of their
``POST /reset`` opens a session nobody will use: an unclaimed session is reaped after
``claim_ttl`` idle seconds, and when the server is full the oldest idle unclaimed session is
closed to make room instead of refusing the reset.

Every session has an owner, the tenant that opened it (:mod:`kernel_env.server.auth`; a fork's
copies belong to the forked session's owner). A lookup names the tenant asking: a client finds
only its own sessions, and another's id, open or closed, is answered as an id no session ever
had (``UnknownSession``), so ids cannot be probed. ``max_sessions_per_tenant`` caps what one
client tenant holds; its own unclaimed sessions make room first, as at ``max_sessions``.

A :class:`Session` is the core every front door speaks to (OpenEnv's routes and ``/ws``,
E2B's sandboxes, Jupyter's kernels, the web view): an episode's reset, step and state, an
export of its record, a call in its kernel outside the episode, an interrupt, the wait for its
end. No door holds the kernel or the environment behind it (``tests/test_layers.py``); what
a door needs is added here, for all.

Session exceptions (all ``KernelEnvError``)::

    SessionError        the session cannot serve requests any more  -> SESSION_ERROR / HTTP 410
    ├── SessionExpired  reaped after its idle TTL
    └── SessionClosed   closed by its owner, or the server is shutting down
    UnknownSession      no session has this id (that the caller may see) -> HTTP 404
    CapacityReached     max_sessions are open                       -> CAPACITY_REACHED / 503
    └── TenantAtCapacity  a client tenant holds max_sessions_per_tenant
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, Literal, TypeVar

from kernel_env.environment import Counters, KernelEnvironment
from kernel_env.errors import (
    CapacityReached,
    ForkRefused,
    InvalidInput,
    KernelCallError,
    KernelEnvError,
    ResetNeeded,
    SessionClosed,
    SessionError,
    SessionExpired,
    UnknownSession,
)
from kernel_env.kernel import Kernel
from kernel_env.kernel.commands import CommandRun
from kernel_env.models import REPLAction, REPLObservation, REPLState
from kernel_env.record import AGENT, EpisodeRecord
from kernel_env.server.auth import Tenant
from kernel_env.server.feed import EpisodeFeed
from kernel_env.server.store import EpisodeStore
from kernel_env.text import shorten

__all__ = [
    "COMMAND_OUTPUT",
    "MAX_STREAMS",
    "CapacityReached",
    "CommandRun",
    "Session",
    "SessionClosed",
    "SessionError",
    "SessionExpired",
    "SessionManager",
    "TenantAtCapacity",
    "UnknownSession",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Kind = Literal["ws", "http", "jupyter"]  # "jupyter": a kernel of Jupyter's API

_SHUTTING_DOWN = "the server is shutting down; the session was closed"
_REMEMBER_GONE = 10_000  # ids of closed sessions kept, to answer "expired" rather than "unknown"
_CLOSE_TIMEOUT = 5.0  # far longer than a kernel's shutdown takes
_UNCLAIMED = "session expired: it was never claimed (no request carried its id) and was "
MAX_STREAMS = 16  # streams one session follows at once (E2B's command streams)
COMMAND_OUTPUT = 1 << 20  # bytes of a command's output kept, per stream (run_command)


class TenantAtCapacity(CapacityReached):
    """A client tenant holds ``max_sessions_per_tenant`` sessions (its frame's
    ``active_sessions`` and ``max_sessions`` count that tenant's)."""

    def __init__(self, tenant: str, held: int, limit: int) -> None:
        KernelEnvError.__init__(
            self,
            f"tenant {tenant} holds {held} session(s), its limit "
            f"(--max-sessions-per-tenant {limit}); close one first",
        )
        self.active_sessions = held
        self.max_sessions = limit


def _kernel_counters(kernel: Kernel) -> Counters:
    late = kernel.late_output_count
    return Counters(
        late_outputs=late,
        lost_outputs=max(0, late - len(kernel.late_outputs)),
        oversize_messages=kernel.oversize_messages,
    )


def _env_counters(env: KernelEnvironment) -> Counters:
    return replace(env.stats)  # a copy: the sums below must not change the episode's own


class Session:
    """One client's episodes, served one request at a time."""

    def __init__(
        self,
        manager: SessionManager,
        session_id: str,
        kind: Kind,
        env: KernelEnvironment,
        owner: Tenant,
    ) -> None:
        self.id = session_id
        self.kind = kind
        self.env = env
        self.owner = owner  # the tenant that opened it (a name and a role, never a token)
        self._manager = manager
        self._lock = asyncio.Lock()  # the environment takes one call at a time
        self._ops: set[asyncio.Task[Any]] = set()
        self.busy = 0
        self.streams = 0  # open streams (:meth:`SessionManager.stream`)
        # A socket is its own claim, as is a kernel started by name; HTTP: once a request names it
        self.claimed = kind != "http"
        self.last_active = asyncio.get_running_loop().time()
        self.closed: SessionError | None = None
        self.done_kernels = Counters()  # counters of kernels this session already discarded
        self.feed = EpisodeFeed()  # what /web shows of this session, live
        self.attached = kind != "http"  # a WebSocket (/ws, Jupyter's) owns it: no /ws may take it
        self.seq = 0  # the how-manieth session its manager opened: GET /sessions pages by it
        self._ended = asyncio.Event()  # set once it is closed (by its owner, the reaper, a drain)
        self.kept: int | None = None  # its current episode's key in the episode store

    async def reset(self, kwargs: dict[str, Any]) -> REPLObservation:
        old = self.env.kernel

        async def run() -> REPLObservation:
            previous = self.env.record
            observation = await self.env.reset(**kwargs)
            await self._keep_new(previous)
            return observation

        try:
            observation = await self._run(run)
        finally:
            if old is not None and self.env.kernel is not old:
                self.done_kernels.add(_kernel_counters(old))
        record = self.env.record
        if record is not None:
            self.feed.episode_started(record.episode_id, record.task_prompt, record.max_iterations)
        observation.metadata["kernel_id"] = self.kernel_id
        return observation

    @property
    def kernel_id(self) -> str:
        """The id Jupyter's kernel API knows the session's kernel by: the session's id written
        as a UUID (Jupyter Server's routes take only that form), whichever door opened it."""
        try:
            return str(uuid.UUID(hex=self.id))
        except ValueError:  # not 32 hex digits (a session id of another making): as it is
            return self.id

    async def _keep_new(self, previous: EpisodeRecord | None) -> None:
        """The episode store: the episode a reset ended, and the one it began."""
        store, record = self._manager.store, self.env.record
        if store is None or record is None or record is previous:
            return
        store.end(self.kept, previous, "another episode began in its session")
        self.kept = await store.begin(record, session_id=self.id, tenant=self.owner.name)

    async def step(
        self,
        action: REPLAction,
        on_output: Callable[[dict[str, Any]], None] | None = None,
        *,
        author: str = AGENT,
    ) -> REPLObservation:
        """One step; its output goes to the session's feed (the web view) and to ``on_output``
        (a client that asked for output frames) as it happens. ``author``: the agent, or a
        person attached to the kernel (:mod:`kernel_env.record`): a step of either waits for
        the one running, behind the session's lock, as a kernel queues its executes."""

        def tell(event: dict[str, Any]) -> None:
            self.feed.output(event)
            if on_output is not None:
                on_output(event)

        async def run() -> REPLObservation:
            self.feed.step_started(action.code, action.is_final, author)
            try:
                observation = await self.env.step(action, on_output=tell, author=author)
            except BaseException as exc:
                self.feed.step_failed(f"{type(exc).__name__}: {exc}")
                raise
            record = self.env.record
            calls = record.steps[-1].llm_calls if record is not None and record.steps else []
            self.feed.step_ended(observation, calls)
            if self._manager.store is not None and record is not None:
                self._manager.store.save(self.kept, record)  # in its journal before the answer
            return observation

        return await self._run(run)

    async def run_exclusive(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` under the session's lock, as its steps run."""
        return await self._run(call)

    async def kernel_call(
        self, expression: str, *, timeout: float, activity: bool = True
    ) -> dict[str, Any]:
        """Evaluate ``expression`` in the session's kernel between its cells (under the
        session's lock), outside its episode: one silent request, of which nothing enters the
        record or the notebook. The answer is Jupyter's ``user_expressions`` entry for it
        (``status``, ``data`` or ``ename`` / ``evalue``). ``activity=False``: the call does
        not keep the session from its idle TTL (a stream's polls, which no client asked for
        one by one)."""

        async def run() -> dict[str, Any]:
            kernel = self.env.kernel
            if kernel is None:
                raise KernelCallError("unavailable", "the session has no kernel")
            execution = await kernel.execute(
                "", silent=True, timeout=timeout, user_expressions={"r": expression}
            )
            return dict(execution.user_expressions.get("r") or {})

        return await self._run(run, touch=activity)

    async def silent_cell(self, code: str, *, timeout: float) -> None:
        """Run ``code`` in the session's kernel between its cells, outside its episode, as
        :meth:`kernel_call` does (nothing of it enters the record or the notebook); raises
        :class:`KernelCallError` if it fails."""

        async def run() -> None:
            kernel = self.env.kernel
            if kernel is None:
                raise KernelCallError("unavailable", "the session has no kernel")
            execution = await kernel.execute(code, silent=True, timeout=timeout)
            if not execution.success:
                error = execution.error or {}
                message = f"{error.get('ename', execution.status)}: {error.get('evalue', '')}"
                raise KernelCallError("internal", message)

        await self._run(run)

    async def run_command(
        self, command: str, *, timeout: float, max_output: int = COMMAND_OUTPUT
    ) -> CommandRun:
        """Run the shell ``command`` beside the session's kernel, between its cells (under the
        session's lock), outside its episode: a process of its own in the kernel's sandbox, as
        its uid, in its workspace, that no cell can reach into (:meth:`Kernel.run_command`)."""

        async def run() -> CommandRun:
            kernel = self.env.kernel
            if kernel is None:
                raise KernelCallError("unavailable", "the session has no kernel")
            return await kernel.run_command(command, timeout=timeout, max_output=max_output)

        return await self._run(run)

    async def finish(self, answer: str, reward: float | None = None) -> REPLObservation:
        """End the episode with ``answer`` (a final-answer step); ``reward``, when given, is
        the episode's instead of its rubric's (a door that scores the episode itself)."""
        observation = await self.step(REPLAction(is_final=True, final_answer=answer))
        record = self.env.record
        if reward is not None and record is not None:
            observation.reward = record.reward = reward
            if record.steps:
                record.steps[-1].reward = reward
        return observation

    async def interrupt(self) -> None:
        """Interrupt the step's cell the session's kernel runs, if any (its client went away,
        or asked; a person attached from Jupyter); not behind the lock, which that cell holds.
        Between steps nothing is sent: no cell runs, and the next must not be cut short. A
        kernel that cannot be reached is left to the step's own timeout ladder."""
        with contextlib.suppress(Exception):
            await self.env.interrupt()

    @property
    def record(self) -> EpisodeRecord | None:
        """The current (or last) episode's record; None before the first reset."""
        return self.env.record

    @property
    def kernel_name(self) -> str | None:
        """The kernelspec name of the current (or last) episode's kernel; None before the
        first reset."""
        record = self.env.record
        return record.kernel_name if record is not None else None

    @property
    def holds_kernel(self) -> bool:
        """Whether a kernel is the session's now (between a reset and its close)."""
        return self.env.kernel is not None

    async def export(self, export: Callable[[EpisodeRecord], T]) -> T:
        """``export(record)`` of the current (or last) episode, in a thread, between steps."""

        async def run() -> T:
            record = self.env.record
            if record is None:
                raise ResetNeeded("no episode to export: call reset first")
            return await asyncio.to_thread(export, record)

        return await self._run(run)

    async def wait_closed(self) -> None:
        """Return once the session is closed, however that happened (a door that holds a
        connection to it then ends that connection)."""
        await self._ended.wait()

    def state(self) -> REPLState:
        # Not serialized behind a running step: the state is a snapshot, read at once.
        self._check_open()
        self.touch()
        try:
            return self.env.state
        except ResetNeeded:
            # A served session answers an empty state before its first reset (clients probe a
            # new connection with it); a local environment raises, as upstream's does.
            return REPLState()

    def summary(self) -> dict[str, Any]:
        """What an operator sees of this session (``GET /sessions``): never the context or
        a secret; the task shortened."""
        now = asyncio.get_running_loop().time()
        record = self.env.record
        episode: dict[str, Any] | None = None
        if record is not None:
            state = self.env.state
            episode = {
                "episode_id": state.episode_id,
                "task": shorten(state.task_prompt or "", 200, one_line=True),
                "steps": state.step_count,
                "max_iterations": state.max_iterations,
                "elapsed_s": round(time.time() - record.started, 3),
                "done": state.done,
                "reward": state.reward,
                "llm_calls": state.llm_calls,
                "llm_tokens": state.llm_usage.get("total_tokens", 0),
            }
        busy = "busy" if self.busy else None
        return {
            "session_id": self.id,
            "kernel_id": self.kernel_id,
            "tenant": self.owner.name,
            "kind": self.kind,
            "claimed": self.claimed,
            "state": busy or ("done" if episode and episode["done"] else "idle"),
            "idle_s": round(now - self.last_active, 3),
            "episode": episode,
        }

    def touch(self) -> None:
        self.last_active = asyncio.get_running_loop().time()

    def counters(self) -> Counters:
        total = _env_counters(self.env)
        total.add(self.done_kernels)
        if self.env.kernel is not None:
            total.add(_kernel_counters(self.env.kernel))
        return total

    def _check_open(self) -> None:
        if self.closed is not None or self._manager.draining:
            raise self._closed_error()

    def _closed_error(self) -> SessionError:
        # A fresh instance each time: re-raising one instance would grow its traceback.
        if self.closed is None:
            return SessionClosed(_SHUTTING_DOWN)
        return type(self.closed)(str(self.closed))

    async def _run(self, call: Callable[[], Awaitable[T]], *, touch: bool = True) -> T:
        """Run ``call`` in its own task, so that closing the session or a drain that ran out
        of time can cancel it while the caller still answers (with a SESSION_ERROR); ``touch``:
        it counts as the session's activity."""
        self._check_open()
        async with self._lock:
            self._check_open()
            task = asyncio.ensure_future(call())
            self._ops.add(task)
            self._manager.ops.add(task)
            try:
                return await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and current is not None and not current.cancelling():
                    raise self._closed_error() from None
                raise
            finally:
                self._ops.discard(task)
                self._manager.ops.discard(task)
                if touch:
                    self.touch()

    async def _cancel_ops(self) -> None:
        ops = list(self._ops)
        for task in ops:
            task.cancel()
        await asyncio.gather(*ops, return_exceptions=True)


class SessionManager:
    """Opens, finds, reaps and closes sessions."""

    def __init__(
        self,
        env_factory: Callable[[Tenant], KernelEnvironment],  # a new session's, by its owner
        *,
        max_sessions: int,
        idle_ttl: float = 0.0,
        claim_ttl: float = 0.0,
        max_sessions_per_tenant: int | None = None,
    ) -> None:
        self._env_factory = env_factory
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant  # client tenants only
        self.idle_ttl = idle_ttl
        self.claim_ttl = claim_ttl
        self._sessions: dict[str, Session] = {}
        self._held: Counter[str] = Counter()  # open sessions, by owner
        self._gone: OrderedDict[str, tuple[str, SessionError]] = OrderedDict()  # owner, why
        self.ops: set[asyncio.Task[Any]] = set()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._stuck: set[asyncio.Future[None]] = set()  # shutdowns that outlived the timeout
        self.draining = False
        self.store: EpisodeStore | None = None  # keeps every episode, when the server has one
        self.opened_total = 0
        self.reaped_total = 0
        self.closed_counters = Counters()
        self._shutting: set[Session] = set()  # removed from _sessions, kernel still closing

    @property
    def active(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def visible_to(self, tenant: Tenant) -> list[Session]:
        """The open sessions ``tenant`` may see: a client's own, every one for an operator."""
        return [s for s in self._sessions.values() if tenant.may_use(s.owner.name)]

    def visible_count(self, tenant: Tenant) -> int:
        """How many open sessions ``tenant`` may see."""
        return len(self._sessions) if tenant.is_operator else self._held.get(tenant.name, 0)

    def page(self, tenant: Tenant, *, after: int, limit: int) -> tuple[list[Session], int | None]:
        """Up to ``limit`` of the open sessions ``tenant`` may see, in the order they opened,
        from the first opened after the one numbered ``after`` (:attr:`Session.seq`); and the
        ``after`` of the next page (None: none is left). A session closed between pages
        shifts nothing: the next page starts after a number, not at a position."""
        found: list[Session] = []
        for session in self._sessions.values():  # in the order they opened: seq ascending
            if session.seq > after and tenant.may_use(session.owner.name):
                if len(found) == limit:
                    return found, found[-1].seq
                found.append(session)
        return found, None

    async def start(self) -> None:
        if (self.idle_ttl > 0 or self.claim_ttl > 0) and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="session-reaper")

    def open(
        self,
        kind: Kind,
        owner: Tenant,
        env: KernelEnvironment | None = None,
        *,
        claimed: bool = False,
    ) -> Session:
        """A new session of ``owner`` (around ``env``, else a new environment), or
        :class:`CapacityReached` (when no unclaimed session can go). ``claimed``: asked for
        by name (a fork's copy, a sandbox), so never evicted as an unclaimed reset."""
        if self.draining:
            raise SessionClosed(_SHUTTING_DOWN)
        self._make_room(owner, 1)
        session = Session(self, secrets.token_hex(16), kind, env or self._env_factory(owner), owner)
        session.claimed = session.claimed or claimed
        self._sessions[session.id] = session
        self._held[owner.name] += 1
        self.opened_total += 1
        session.seq = self.opened_total
        return session

    async def fork(self, session: Session, n: int, *, own_budget: bool) -> list[Session]:
        """``n`` new HTTP sessions whose episodes are forks of ``session``'s. They count toward
        ``max_sessions`` like any session (checked before the fork's kernels start)."""
        if session.env.stepping:
            raise ForkRefused("a step is running: fork between steps")
        self._make_room(session.owner, n)
        envs = await session.run_exclusive(lambda: session.env.fork(n, own_budget=own_budget))
        children: list[Session] = []
        try:
            for env in envs:
                child = self.open("http", session.owner, env, claimed=True)
                children.append(child)
                record = env.record
                if record is not None:
                    child.feed.episode_started(
                        record.episode_id, record.task_prompt, record.max_iterations
                    )
                    await self._keep_fork(session, child, record)
        except BaseException:
            await asyncio.gather(*(e.close() for e in envs[len(children) :]))
            raise
        return children

    async def _keep_fork(self, parent: Session, child: Session, record: EpisodeRecord) -> None:
        if self.store is not None:
            child.kept = await self.store.begin(
                record,
                session_id=child.id,
                tenant=child.owner.name,
                parent=parent.kept,
                relation="fork",
            )

    def _make_room(self, owner: Tenant, n: int) -> None:
        """Room for ``n`` more sessions of ``owner``: unclaimed sessions are closed to make
        it (the owner's own, at its cap), or :class:`CapacityReached` is raised."""
        cap = None if owner.is_operator else self.max_sessions_per_tenant
        if cap is not None:
            while self._held_by(owner) + n > cap and self._evict_unclaimed(owner):
                pass
            if (held := self._held_by(owner)) + n > cap:
                log.info("tenant %s: refused a session at its limit of %d", owner.name, cap)
                raise TenantAtCapacity(owner.name, held, cap)
        while len(self._sessions) + n > self.max_sessions and self._evict_unclaimed():
            pass
        if len(self._sessions) + n > self.max_sessions:
            raise CapacityReached(len(self._sessions), self.max_sessions)

    def _held_by(self, owner: Tenant) -> int:
        return self._held.get(owner.name, 0)

    def take(self, session_id: str, tenant: Tenant) -> Session:
        """An open session for a WebSocket to own (``/ws?session=``): one socket at a time."""
        session = self.get(session_id, tenant)
        if session.attached:
            raise SessionClosed("another WebSocket already holds this session")
        session.attached = True
        session.kind = "ws"
        return session

    def share(self, session_id: str, tenant: Tenant) -> Session:
        """An open session for a WebSocket to share with the HTTP requests that name it
        (OpenEnv's ``/ws?session_id=``): one socket at a time, and the session outlives it
        (:meth:`unshare`); its owner closes it, or the idle TTL does."""
        session = self.get(session_id, tenant)
        if session.attached:
            raise SessionClosed("another WebSocket already holds this session")
        session.attached = True
        return session

    def unshare(self, session: Session) -> None:
        """The socket that :meth:`share` gave ``session`` to has gone: another may attach."""
        session.attached = False

    def peek(self, session_id: str, tenant: Tenant) -> Session | None:
        """The open session with this id that ``tenant`` may see, if any, without claiming
        it (the web view watches sessions it does not use)."""
        session = self._sessions.get(session_id)
        return session if session is not None and tenant.may_use(session.owner.name) else None

    def get(self, session_id: str, tenant: Tenant) -> Session:
        """The open session with this id; raises if it expired, was closed, or never existed.
        Another tenant's session (a client asking) is one that never existed, open or not."""
        session = self.peek(session_id, tenant)
        if session is not None:
            session.claimed = True
            return session
        owner, gone = self._gone.get(session_id, (None, None))
        if owner is not None and gone is not None and tenant.may_use(owner):
            raise type(gone)(str(gone))
        raise UnknownSession("unknown session id: call POST /reset to open a session")

    def resolve(self, key: str, tenant: Tenant) -> Session:
        """The session with the id ``key`` (as :meth:`get`), or else the open one whose
        current (or last) episode has the id ``key``, among the sessions ``tenant`` may use:
        the notebook routes take either id, since ``state().episode_id`` and the web view show
        the episode's. Another tenant's episode id is one that names nothing."""
        try:
            return self.get(key, tenant)
        except UnknownSession:
            pass
        running = [
            s
            for s in self.visible_to(tenant)
            if s.env.record is not None and s.env.record.episode_id == key
        ]
        if len(running) > 1:
            raise InvalidInput(
                f"{len(running)} sessions run an episode with this id: name one by its "
                "session id (`kernel-env ps` lists them)"
            )
        if not running:
            raise UnknownSession(
                "no open session and no episode of one has this id: `kernel-env ps` lists "
                "the sessions with their episode ids"
            )
        running[0].claimed = True
        return running[0]

    @contextlib.asynccontextmanager
    async def request(self, session: Session) -> AsyncIterator[None]:
        """Marks one request in flight, reply included: the reaper skips the session and a
        drain waits for the reply to be sent."""
        self._busy += 1
        session.busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            session.busy -= 1
            session.touch()
            if self._busy == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def stream(self, session: Session) -> AsyncIterator[None]:
        """Marks one stream open (a command's output, followed until it ends): at most
        :data:`MAX_STREAMS` a session. Unlike :meth:`request` it is not activity, nor in
        flight: a stream its client forgot must not keep the session from its idle TTL, or a
        drain waiting."""
        session._check_open()
        if session.streams >= MAX_STREAMS:
            raise KernelCallError(
                "resource_exhausted",
                f"the session follows {MAX_STREAMS} command streams already, its limit; "
                "close one (or wait for its command to end) first",
            )
        session.streams += 1
        try:
            yield
        finally:
            session.streams -= 1

    def close_soon(self, session: Session, error: SessionError | None = None) -> asyncio.Task[None]:
        """Close ``session`` in a task of its own: a caller that is itself being cancelled (a
        handler torn down with its connection) can shield it, and the kernel still goes.
        :meth:`close` waits for these tasks."""
        task = asyncio.ensure_future(self.close_session(session, error))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    def _evict_unclaimed(self, owner: Tenant | None = None) -> bool:
        """Close the oldest idle unclaimed session (of ``owner``, if given) to make room;
        False if there is none.

        It leaves the count at once; its kernel shuts down in the background."""
        unclaimed = [
            s
            for s in self._sessions.values()
            if not s.claimed and s.busy == 0 and (owner is None or s.owner.name == owner.name)
        ]
        if not unclaimed:
            return False
        victim = min(unclaimed, key=lambda s: s.last_active)
        log.info("session %s: never claimed; closed to make room", victim.id[:8])
        self.reaped_total += 1
        error = SessionExpired(_UNCLAIMED + "closed to make room for a new session")
        if self._detach(victim, error):
            task = asyncio.ensure_future(self._shut(victim))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return True

    def _detach(self, session: Session, error: SessionError | None) -> bool:
        """Take ``session`` out of the open ones (False if it already was)."""
        if session.closed is None:
            session.closed = error or SessionClosed("the session was closed")
        session.feed.close()
        session._ended.set()
        if self._sessions.pop(session.id, None) is None:
            return False
        self._held[session.owner.name] -= 1
        if not self._held[session.owner.name]:
            del self._held[session.owner.name]
        self._shutting.add(session)  # counted in counters() until its own are added by _shut
        self._gone[session.id] = (session.owner.name, session.closed)
        while len(self._gone) > _REMEMBER_GONE:
            self._gone.popitem(last=False)
        return True

    async def close_session(self, session: Session, error: SessionError | None = None) -> None:
        """Close ``session`` and shut its kernel down; idempotent."""
        if self._detach(session, error):
            await self._shut(session)

    async def _shut(self, session: Session) -> None:
        await session._cancel_ops()
        kernel = session.env.kernel  # its counters outlive it
        # Bounded: a kernel that will not shut down must not hold up a drain or the reaper.
        # (asyncio.wait, not wait_for: wait_for also waits for the cancellation to finish.)
        closing = asyncio.ensure_future(session.env.close())
        done, _ = await asyncio.wait({closing}, timeout=_CLOSE_TIMEOUT)
        if not done:
            self._stuck.add(closing)
            closing.add_done_callback(self._stuck.discard)
            log.error(
                "session %s: its kernel did not shut down within %.0f s",
                session.id[:8],
                _CLOSE_TIMEOUT,
            )
        elif (exc := closing.exception()) is not None:
            log.error("closing session %s failed: %r", session.id[:8], exc)
        if kernel is not None and session.env.kernel is None:
            session.done_kernels.add(_kernel_counters(kernel))
        if self.store is not None:
            self.store.end(session.kept, session.env.record, str(session.closed))
        self.closed_counters.add(session.counters())
        self._shutting.discard(session)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give in-flight ones ``timeout`` s to answer, cancel the rest
        (they answer with an error), then close every session."""
        self.draining = True
        if self._busy:
            log.info("draining %d in-flight request(s) for up to %.0f s", self._busy, timeout)
            await _wait(self._idle, timeout)
        if self._busy:
            log.warning("cancelling %d request(s) still running after the drain", self._busy)
            for session in self.sessions():
                session.closed = SessionClosed(_SHUTTING_DOWN + " before the step finished")
            for task in list(self.ops):
                task.cancel()
            await _wait(self._idle, 1.0)  # let the handlers send their error replies
        await self.close()

    async def close(self) -> None:
        """Close every session (kernels shut down); idempotent."""
        self.draining = True
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
        await asyncio.gather(
            *(self.close_session(s, SessionClosed(_SHUTTING_DOWN)) for s in self.sessions())
        )
        await asyncio.gather(*self._closing, return_exceptions=True)

    def counters(self) -> Counters:
        total = Counters()
        total.add(self.closed_counters)
        for session in [*self.sessions(), *self._shutting]:
            total.add(session.counters())
        return total

    async def _reap_forever(self) -> None:
        shortest = min(t for t in (self.idle_ttl, self.claim_ttl) if t > 0)
        interval = min(5.0, max(0.05, shortest / 10))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            idle = [
                s for s in self.sessions() if s.busy == 0 and now - s.last_active > self._ttl(s)
            ]
            if not idle:
                continue
            await asyncio.gather(*(self.close_session(s, self._expired(s)) for s in idle))
            self.reaped_total += len(idle)
            log.info("reaped %d idle session(s)", len(idle))

    def _ttl(self, session: Session) -> float:
        ttls = [t for t in (self.idle_ttl, 0 if session.claimed else self.claim_ttl) if t > 0]
        return min(ttls) if ttls else float("inf")

    def _expired(self, session: Session) -> SessionExpired:
        if not session.claimed and 0 < self.claim_ttl <= (self.idle_ttl or self.claim_ttl):
            return SessionExpired(
                _UNCLAIMED + f"reaped after {self.claim_ttl:g} s; send the X-Session-Id "
                "header of POST /reset's response with every later request"
            )
        return SessionExpired(
            f"session expired: it was idle for more than {self.idle_ttl:g} s and its kernel "
            "was shut down; open a new session (reconnect, or POST /reset without a "
            "session id)"
        )


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
