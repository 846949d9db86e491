"""One table of what can go wrong, run on a local client and on a remote one (a real server on
loopback): each situation raises the same kernel_env exception class on both sides, with the
same message, and the message says what to do. Situations that only a server has (its session
cap, its token, a session id) run on the remote client alone.

A remote client's exceptions are also :class:`RemoteError`s (with the server's ``code`` and
``data``), so code that catches ``RemoteError`` keeps working."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverkit import small_settings, thread_server, wait_until

from kernel_env import AsyncKernelEnv, EnvConfig, errors
from kernel_env.errors import (
    CapacityReached,
    ClientClosed,
    EpisodeFinished,
    ForkRefused,
    InvalidInput,
    KernelCapacity,
    LimitExceeded,
    RemoteError,
    ResetNeeded,
    UnknownSession,
)
from kernel_env.kernel.factory import local_source
from kernel_env.kernel.pool import KernelPool
from kernel_env.remote import fetch_export

pytestmark = pytest.mark.integration  # kernels and a server

TOKEN = "parity-token-7f3a9c21"
STEP_TIMEOUT = 1.0
MAX_CODE = 200
MAX_KERNELS = 2
MAX_SESSIONS = 4


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    settings = small_settings(
        sandbox="none",
        pool_size=0,
        max_sessions=MAX_SESSIONS,
        max_kernels=MAX_KERNELS,
        step_timeout=STEP_TIMEOUT,
        max_code_chars=MAX_CODE,
        token=TOKEN,
    )
    with thread_server(settings) as base:
        yield base


@dataclass
class Clients:
    """New clients of one side (``url`` None: local), all closed at the end of a situation."""

    url: str | None
    tmp: Path
    made: list[AsyncKernelEnv] = field(default_factory=list)
    pool: KernelPool | None = None

    async def new(self, **options: Any) -> AsyncKernelEnv:
        if self.url is None:
            assert self.pool is not None
            config = EnvConfig(step_timeout=STEP_TIMEOUT, max_code_chars=MAX_CODE)
            env = AsyncKernelEnv(config=config, kernel_source=self.pool.acquire, **options)
        else:
            env = AsyncKernelEnv(self.url, **{"token": TOKEN, **options})
        self.made.append(env)
        return env


@contextlib.asynccontextmanager
async def clients(url: str | None, tmp: Path) -> AsyncIterator[Clients]:
    made = Clients(url, tmp)
    if url is None:  # the local side's kernel budget, as the server's --max-kernels
        made.pool = KernelPool(local_source("none"), size=0, max_kernels=MAX_KERNELS)
        await made.pool.start()
    try:
        yield made
    finally:
        for env in made.made:
            await env.close()
        if made.pool is not None:
            await made.pool.close()
        if url is not None:  # the next situation starts on an empty server
            assert wait_until(lambda: _open_sessions(url) == 0, timeout=15)


def _open_sessions(url: str) -> int:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    return len(httpx.get(f"{url}/sessions", headers=auth, timeout=10).json()["sessions"])


# -- the situations ----------------------------------------------------------------------


async def step_before_reset(c: Clients) -> None:
    await (await c.new()).execute("1")


async def step_after_the_end(c: Clients) -> None:
    env = await c.new()
    await env.reset()
    await env.execute("FINAL(1)")
    await env.execute("2")


async def fork_before_reset(c: Clients) -> None:
    await (await c.new()).fork()


async def fork_of_a_finished_episode(c: Clients) -> None:
    env = await c.new()
    await env.reset()
    await env.submit_final_answer("done")
    await env.fork()


async def export_before_reset(c: Clients) -> None:
    await (await c.new()).export_notebook(c.tmp / "nothing.ipynb")


async def reset_with_a_bad_value(c: Clients) -> None:
    await (await c.new()).reset(max_iterations=0)


async def code_over_the_limit(c: Clients) -> None:
    env = await c.new()
    await env.reset()
    await env.execute("x = 1  # " + "x" * MAX_CODE)


async def cell_past_the_step_timeout(c: Clients) -> None:
    env = await c.new()
    await env.reset()
    result = await env.run("import time\ntime.sleep(30)")
    assert result.timed_out and not result.success  # an observation, not an exception


async def every_kernel_in_use(c: Clients) -> None:
    for _ in range(MAX_KERNELS + 1):
        await (await c.new()).reset()


async def call_after_close(c: Clients) -> None:
    env = await c.new()
    await env.reset()
    await env.close()
    await env.execute("1")


async def every_session_open(c: Clients) -> None:
    for _ in range(MAX_SESSIONS + 1):
        await (await c.new()).state()  # the first call connects


async def a_wrong_token(c: Clients) -> None:
    await (await c.new(token="not-the-servers-token")).reset()


async def no_token(c: Clients) -> None:
    await (await c.new(token="")).reset()


async def an_unknown_session(c: Clients) -> None:
    assert c.url is not None
    await fetch_export(c.url, "no-such-session", "x.ipynb", token=TOKEN)


@dataclass(frozen=True)
class Situation:
    act: Callable[[Clients], Awaitable[None]]
    raises: type[BaseException] | None  # None: no exception (the observation says it)
    says: str  # what the message tells the user to do (or names)
    remote_only: bool = False
    client_side: bool = False  # raised by the client itself: not a server's RemoteError


TABLE = [
    Situation(step_before_reset, ResetNeeded, "Call reset() first"),
    Situation(step_after_the_end, EpisodeFinished, "call reset() to start another"),
    Situation(fork_before_reset, ResetNeeded, "Call reset() first"),
    Situation(fork_of_a_finished_episode, ForkRefused, "the episode is over"),
    Situation(export_before_reset, ResetNeeded, "Call reset() first"),
    Situation(reset_with_a_bad_value, InvalidInput, "max_iterations"),
    Situation(code_over_the_limit, LimitExceeded, f"exceeds the limit of {MAX_CODE}"),
    Situation(cell_past_the_step_timeout, None, ""),
    Situation(every_kernel_in_use, KernelCapacity, "retry later"),
    Situation(call_after_close, ClientClosed, "create a new one", client_side=True),
    Situation(every_session_open, CapacityReached, "retry later or close another session", True),
    Situation(a_wrong_token, RemoteError, "refused the token", True),
    Situation(no_token, RemoteError, "set KERNEL_ENV_TOKEN", True),
    Situation(an_unknown_session, UnknownSession, "kernel-env ps", True),
]


def kind(exc: BaseException | None) -> type[BaseException] | None:
    """The public class an exception is raised as: the first of ``kernel_env.errors`` in its
    MRO (a remote client's are also RemoteErrors), else its own."""
    if exc is None:
        return None
    public = [c for c in type(exc).__mro__ if c.__name__ in errors.__all__]
    named = [c for c in public if getattr(errors, c.__name__) is c]
    return named[0] if named else type(exc)


async def outcome(situation: Situation, url: str | None, tmp: Path) -> BaseException | None:
    async with clients(url, tmp) as made:
        try:
            await situation.act(made)
        except Exception as exc:
            return exc
    return None


@pytest.mark.parametrize("situation", TABLE, ids=[s.act.__name__ for s in TABLE])
async def test_local_and_remote_clients_raise_the_same(
    situation: Situation, url: str, tmp_path: Path
) -> None:
    remote = await outcome(situation, url, tmp_path)
    assert kind(remote) is situation.raises, repr(remote)
    if remote is not None:
        assert situation.says in str(remote)
        # What code written for RemoteError (the server's error frames) still catches:
        assert isinstance(remote, RemoteError) is not situation.client_side
    if situation.remote_only:
        return
    local = await outcome(situation, None, tmp_path)
    assert kind(local) is situation.raises, repr(local)
    assert str(local) == str(remote)


def test_the_table_names_every_situation_once() -> None:
    names = [s.act.__name__ for s in TABLE]
    assert len(names) == len(set(names)) and all(s.says or s.raises is None for s in TABLE)
