"""E2B sandboxes: each one a kernel_env session, with E2B's lifetime, metadata and tokens.

A sandbox is created from a *template*, which names the kernel its session runs
(``TEMPLATES``); it lives until its timeout (``set_timeout`` and ``connect`` move it), its
owner kills it, or the server reaps its session. Its id is its session's id, so the
server's own routes (``GET /sessions/{id}/notebook``) reach it too; its access token is the
capability E2B's SDK sends with every request to the sandbox (``X-Access-Token``), since
those carry no API key.

Pausing keeps the kernel as it is and stops the clock: kernel_env has no snapshot of a
process to put aside, so a paused sandbox still holds its kernel (and still counts toward
the server's sessions) until it is resumed or killed, or ``paused_ttl`` passes
(``--paused-ttl``): a bound of its own, since the E2B timeout no longer runs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from kernel_env.errors import SandboxError
from kernel_env.models import MAX_ITERATIONS
from kernel_env.server.auth import Tenant
from kernel_env.server.e2b.kernelcalls import set_envs
from kernel_env.server.sessions import Session, SessionManager

__all__ = [
    "DEFAULT_TEMPLATE",
    "ENVD_VERSION",
    "KERNELS",
    "TEMPLATES",
    "UNLIMITED_EPISODE",
    "Sandbox",
    "SandboxError",
    "Sandboxes",
]

log = logging.getLogger(__name__)

# The kernels a sandbox may run, by kernel name (those the server does not offer, --kernels,
# are refused at create with the names it does).
KERNELS = ("python3", "ir", "bash", "deno")
# E2B's template names (and kernel names themselves) -> the kernel a sandbox runs.
TEMPLATES: dict[str, str] = {
    "code-interpreter-v1": "python3",
    "code-interpreter": "python3",
    "base": "python3",
    "python": "python3",
    **{name: name for name in KERNELS},
}
DEFAULT_TEMPLATE = "code-interpreter-v1"
# The envd release whose behaviour the sandbox routes give (the SDK picks its code paths by it).
ENVD_VERSION = "0.5.7"
CLIENT_ID = "kernel-env"
MAX_TIMEOUT = 24 * 3600  # seconds, as E2B's longest
DEFAULT_PAUSED_TTL = float(MAX_TIMEOUT)
# An episode as long as E2B code runs: no iteration budget in practice.
UNLIMITED_EPISODE: dict[str, Any] = {"max_iterations": MAX_ITERATIONS}

State = Literal["running", "paused"]
OnTimeout = Literal["kill", "pause"]


MAX_FORKS = 64  # copies one fork() makes at most


def check_fork_count(count: object) -> None:
    """A fork's ``count`` as E2B's API checks it, before it looks for the sandbox: 400."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise SandboxError(400, "count must be an integer")
    if not 1 <= count <= MAX_FORKS:
        raise SandboxError(400, f"count must be between 1 and {MAX_FORKS}")


@dataclass(eq=False)
class Sandbox:
    """One E2B sandbox: its session and what E2B says about it."""

    session: Session
    template: str
    kernel_name: str
    metadata: dict[str, str]
    envs: dict[str, str]
    started: float  # wall clock, for startedAt
    end: float  # wall clock, for endAt
    access_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    state: State = "running"
    # E2B's lifecycle: what its timeout does ("kill", or "pause" it), whether a request to
    # it while paused resumes it, and the timeout it then runs for again.
    on_timeout: OnTimeout = "kill"
    auto_resume: bool = False
    timeout: float = 0.0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # What goes with the sandbox (its extra contexts' sessions), called once it is gone.
    on_kill: list[Callable[[], object]] = field(default_factory=list, repr=False)

    @property
    def id(self) -> str:
        return self.session.id

    @property
    def owner(self) -> Tenant:
        return self.session.owner

    @property
    def alive(self) -> bool:
        return self.session.closed is None

    def admits(self, token: str | None) -> bool:
        """Whether ``token`` is this sandbox's access token (constant time)."""
        return token is not None and hmac.compare_digest(token.encode(), self.access_token.encode())

    def created(self) -> dict[str, Any]:
        """E2B's ``Sandbox`` (the answer to create and connect)."""
        return {
            "templateID": self.template,
            "sandboxID": self.id,
            "clientID": CLIENT_ID,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token,
            "trafficAccessToken": self.access_token,
            "domain": None,
        }

    def detail(self) -> dict[str, Any]:
        """E2B's ``SandboxDetail`` / ``ListedSandbox``."""
        return {
            "templateID": self.template,
            "alias": self.kernel_name,
            "sandboxID": self.id,
            "clientID": CLIENT_ID,
            "startedAt": _iso(self.started),
            "endAt": _iso(self.end),
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token,
            "cpuCount": 1,
            "memoryMB": 0,
            "diskSizeMB": 0,
            "metadata": dict(self.metadata),
            "state": self.state,
            "lifecycle": {"onTimeout": self.on_timeout, "autoResume": self.auto_resume},
        }


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat().replace("+00:00", "Z")


class Sandboxes:
    """The server's E2B sandboxes, over its session manager."""

    def __init__(self, sessions: SessionManager, *, paused_ttl: float = DEFAULT_PAUSED_TTL) -> None:
        self.sessions = sessions
        self.paused_ttl = paused_ttl  # seconds a sandbox may stay paused; 0: no bound
        self._all: dict[str, Sandbox] = {}

    async def create(
        self,
        owner: Tenant,
        template: str,
        timeout: float,
        metadata: dict[str, str],
        envs: dict[str, str],
        *,
        on_timeout: OnTimeout = "kill",
        auto_resume: bool = False,
    ) -> Sandbox:
        """A new sandbox of ``owner`` whose session has started its episode, with E2B's
        ``envs`` as its kernel's variables (and so its commands'); at its timeout it is
        killed, or paused (``on_timeout="pause"``), and then resumed by a request to it if
        ``auto_resume``."""
        kernel_name = TEMPLATES.get(template)
        if kernel_name is None:
            known = ", ".join(sorted(TEMPLATES))
            raise SandboxError(
                400,
                f"template {template!r} is not served here: kernel_env runs kernels, not "
                f"images built from Dockerfiles; choose one of {known}",
            )
        session = await self.start_session(owner, kernel_name, envs)
        now = time.time()
        sandbox = Sandbox(
            session, template, kernel_name, metadata, envs, now, now,
            on_timeout=on_timeout, auto_resume=auto_resume, timeout=timeout,
        )  # fmt: skip
        self._all[sandbox.id] = sandbox
        self.set_timeout(sandbox, timeout)
        return sandbox

    async def start_session(
        self, owner: Tenant, kernel_name: str, envs: dict[str, str] | None = None
    ) -> Session:
        """A new session of ``owner`` (claimed: it is asked for by id) whose episode runs
        ``kernel_name`` with no iteration budget; closed again if it cannot start."""
        session = self.sessions.open("http", owner, claimed=True)
        try:
            async with self.sessions.request(session):
                await session.reset({**UNLIMITED_EPISODE, "kernel_name": kernel_name})
                if envs:
                    await set_envs(session, kernel_name, envs)
        except BaseException:
            await asyncio.shield(self.sessions.close_soon(session))
            raise
        return session

    async def fork(self, parent: Sandbox, count: int, timeout: float) -> list[Sandbox]:
        """``count`` copies of ``parent``, each a sandbox of its own (kernel_env's fork: live
        where the kernel can be copied, else a replay of the episode's cells)."""
        check_fork_count(count)
        children = await self.sessions.fork(parent.session, count, own_budget=False)
        now = time.time()
        copies = []
        for session in children:
            child = Sandbox(
                session,
                parent.template,
                parent.kernel_name,
                dict(parent.metadata),
                dict(parent.envs),
                now,
                now,
                on_timeout=parent.on_timeout,
                auto_resume=parent.auto_resume,
                timeout=timeout,
            )
            self._all[child.id] = child
            self.set_timeout(child, timeout)
            copies.append(child)
        return copies

    def get(self, sandbox_id: str, tenant: Tenant | None = None) -> Sandbox:
        """The live sandbox with this id (that ``tenant`` may see, if given); else 404."""
        sandbox = self._all.get(sandbox_id)
        if sandbox is not None and not sandbox.alive:
            self._forget(sandbox)
            sandbox = None
        if sandbox is None or (tenant is not None and not tenant.may_use(sandbox.owner.name)):
            raise SandboxError(404, f"sandbox {sandbox_id!r} not found")
        return sandbox

    def live(self) -> list[Sandbox]:
        """Every live sandbox, whoever owns it (a signed link names none: its signature does)."""
        for sandbox in list(self._all.values()):
            if not sandbox.alive:
                self._forget(sandbox)
        return list(self._all.values())

    def visible_to(self, tenant: Tenant) -> list[Sandbox]:
        return [s for s in self.live() if tenant.may_use(s.owner.name)]

    def set_timeout(self, sandbox: Sandbox, timeout: float) -> None:
        """The sandbox ends ``timeout`` seconds from now (E2B's ``set_timeout``); its owner
        asked, so it is the session's activity too."""
        if not 0 <= timeout <= MAX_TIMEOUT:
            raise SandboxError(400, f"timeout must be between 0 and {MAX_TIMEOUT} seconds")
        sandbox.end = time.time() + timeout
        sandbox.session.touch()
        self._end_in(sandbox, timeout, self._timed_out)

    def pause(self, sandbox: Sandbox) -> None:
        """Stop the sandbox's clock: it ends ``paused_ttl`` from now unless resumed."""
        if sandbox.state == "paused":
            raise SandboxError(409, f"sandbox {sandbox.id!r} is already paused")
        sandbox.state = "paused"
        if sandbox.timer is not None:
            sandbox.timer.cancel()
            sandbox.timer = None
        if self.paused_ttl > 0:
            sandbox.end = time.time() + self.paused_ttl
            why = f"paused for {self.paused_ttl:g} s"
            self._end_in(sandbox, self.paused_ttl, lambda s: self._expire(s, why))

    def resume(self, sandbox: Sandbox, timeout: float) -> None:
        sandbox.state = "running"
        self.set_timeout(sandbox, timeout)

    async def kill(self, sandbox: Sandbox) -> None:
        self._forget(sandbox)
        await self.sessions.close_session(sandbox.session)

    def _end_in(self, sandbox: Sandbox, seconds: float, end: Callable[[Sandbox], None]) -> None:
        if sandbox.timer is not None:
            sandbox.timer.cancel()
        loop = asyncio.get_running_loop()
        sandbox.timer = loop.call_later(seconds, end, sandbox)

    def _timed_out(self, sandbox: Sandbox) -> None:
        """The sandbox's E2B timeout has passed: it is paused (its lifecycle says so) or
        killed."""
        sandbox.timer = None
        if sandbox.on_timeout == "pause" and sandbox.alive and sandbox.state == "running":
            log.info("sandbox %s: past its timeout; paused", sandbox.id[:8])
            self.pause(sandbox)
            return
        self._expire(sandbox, "past its timeout")

    def _expire(self, sandbox: Sandbox, why: str) -> None:
        log.info("sandbox %s: %s; killed", sandbox.id[:8], why)
        self._forget(sandbox)
        self.sessions.close_soon(sandbox.session)

    def _forget(self, sandbox: Sandbox) -> None:
        if sandbox.timer is not None:
            sandbox.timer.cancel()
            sandbox.timer = None
        if self._all.pop(sandbox.id, None) is not None:
            for release in sandbox.on_kill:
                release()
