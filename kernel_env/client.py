"""``KernelEnv`` and ``AsyncKernelEnv``: the client interface of OpenEnv's ``REPLEnv``.

With no ``base_url`` an episode runs locally, in a kernel this process starts (no server);
with one, it runs on a ``kernel-env serve`` server over its ``/ws`` WebSocket. Both give the
same results. ``AsyncKernelEnv`` is the implementation; ``KernelEnv`` is a thin synchronous
facade that runs it on one background event-loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import ValidationError

from kernel_env.agent import solve_child
from kernel_env.archive import extract_export
from kernel_env.environment import EnvConfig, ForkMethod, KernelEnvironment, KernelSource
from kernel_env.errors import (
    ClientClosed,
    EpisodeError,
    InvalidInput,
    RemoteError,
    ResetNeeded,
    invalid_call,
)
from kernel_env.hostcalls import LLMBatchFn, LLMQueryFn
from kernel_env.llm import LLMBackend
from kernel_env.models import (
    CodeBlockResult,
    REPLAction,
    REPLObservation,
    REPLState,
    ResetOptions,
    StepResult,
)
from kernel_env.notebook import write_notebook
from kernel_env.rubric import Rewards
from kernel_env.streaming import OutputCallback, streamed

if TYPE_CHECKING:
    from kernel_env.agent import AgentResult

__all__ = ["AsyncKernelEnv", "KernelEnv"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_GRACE = 10.0  # seconds close() waits for cancelled in-flight calls to unwind
# Seconds a step whose caller gave up (Ctrl-C) may take to return once its cell is
# interrupted; past them it is abandoned (a cell that ignores SIGINT: the step's own timeout
# ladder restarts its kernel).
_INTERRUPT_GRACE = 10.0
_CLOSED = "this client is closed; create a new one"
# The sync clients whose call is in progress in this context: the loop's task and the threads
# it hands host callables to (an llm_query_fn) inherit it, so a call back into the same
# client, which could only wait for the call it is part of, fails at once.
_CALLING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "kernel_env_calling", default=frozenset()
)
_RECURSIVE = "a KernelEnv cannot be called recursively from inside one of its own calls"
TOKEN_VARIABLE = "KERNEL_ENV_TOKEN"  # a remote client's token when none is passed


class _Session(Protocol):
    """Where episodes run: in this process, or on a server."""

    async def reset(self, **kwargs: Any) -> StepResult[REPLObservation]: ...
    async def step(
        self, action: REPLAction, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]: ...
    async def state(self) -> REPLState: ...
    async def interrupt(self) -> None: ...
    async def close(self) -> None: ...


class _LocalSession:
    """Episodes in a kernel started by this process."""

    def __init__(self, env: KernelEnvironment) -> None:
        self.env = env

    async def reset(self, **kwargs: Any) -> StepResult[REPLObservation]:
        try:  # refused in the words, and as the class, a server's refusal has
            ResetOptions.model_validate(kwargs)
        except ValidationError as exc:
            problems = exc.errors(include_url=False, include_context=False, include_input=False)
            raise InvalidInput(invalid_call("reset", problems)) from None
        return _wrap(await self.env.reset(**kwargs))

    def require_episode(self) -> None:
        """Before any reset: :class:`ResetNeeded`, in the one wording (the server's too)."""
        if self.env.record is None:
            raise ResetNeeded()

    async def step(
        self, action: REPLAction, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        self.require_episode()
        if on_output is None:
            return _wrap(await self.env.step(action))
        run = lambda push: self.env.step(action, on_output=push)  # noqa: E731
        return _wrap(await streamed(run, on_output))

    async def state(self) -> REPLState:
        return self.env.state

    async def interrupt(self) -> None:
        await self.env.interrupt()

    async def close(self) -> None:
        await self.env.close()


def _wrap(obs: REPLObservation) -> StepResult[REPLObservation]:
    return StepResult(observation=obs, reward=obs.reward, done=obs.done)


class AsyncKernelEnv:
    """An episode client: local when ``base_url`` is None, else remote (``kernel-env serve``).

    Example::

        async with AsyncKernelEnv() as env:
            await env.reset(context="Hello World", task_prompt="Count chars")
            result = await env.execute("len(context)")
            print(result.observation.result.stdout)   # 11

    Local or remote, a call raises the same exceptions in the same situations
    (:mod:`kernel_env.errors`); a remote client's are also ``RemoteError``s.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        llm_query_fn: LLMQueryFn | None = None,
        llm_batch_fn: LLMBatchFn | None = None,
        max_output_length: int = 8192,
        context_preview_length: int = 500,
        reward_on_success: float = 1.0,
        reward_on_iteration: float = 0.0,
        reward_on_failure: float = -0.1,
        reward_on_error: float = -0.05,
        step_timeout: float = 30.0,
        rubric: Any = None,
        config: EnvConfig | None = None,
        kernel_source: KernelSource | None = None,
        llm_backend: LLMBackend | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        token: str | None = None,
    ) -> None:
        """Local-only options: ``llm_backend`` (a :mod:`kernel_env.llm` backend) or the simpler
        ``llm_query_fn`` / ``llm_batch_fn`` callables, output and reward settings,
        ``step_timeout``, ``rubric`` (``"exact"``, ``"fuzzy"``, ``fn(answer, expected)``, or an
        OpenEnv rubric such as upstream's ``REPLRubric``, which then gives every step's reward),
        or a whole ``config`` (which then wins over those keywords), and
        ``kernel_source`` (where kernels come from: a pool, a gateway; default a new local
        kernel per episode).
        Remote-only: ``connect_timeout_s``, ``message_timeout_s``, ``token`` (default: the
        ``KERNEL_ENV_TOKEN`` variable)."""
        self.base_url = base_url
        self._session: _Session | None = None
        self._closed = False
        self._inflight: set[asyncio.Task[Any]] = set()
        if base_url is None:
            config = config or EnvConfig(
                step_timeout=step_timeout,
                rubric=rubric,
                max_output_length=max_output_length,
                context_preview_length=context_preview_length,
                success_reward=reward_on_success,
                rewards=Rewards(
                    step_ok=reward_on_iteration,
                    step_failed=reward_on_error,
                    budget_exhausted=reward_on_failure,
                ),
            )
            self.environment: KernelEnvironment | None = KernelEnvironment(
                config,
                kernel_source=kernel_source,
                llm_backend=llm_backend,
                llm_query_fn=llm_query_fn,
                llm_batch_fn=llm_batch_fn,
                child_solver=solve_child,
            )
            self._session = _LocalSession(self.environment)
        else:
            if llm_query_fn is not None or llm_batch_fn is not None or llm_backend is not None:
                raise ValueError(
                    "llm_query_fn/llm_batch_fn run on the host that runs the kernels; with a "
                    "base_url, configure the LLM on the server"
                )
            if rubric is not None:
                raise ValueError("the server scores episodes: a rubric applies to local clients")
            self.environment = None
            token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
            self._remote = (base_url, connect_timeout_s, message_timeout_s, token)

    async def _connect(self) -> _Session:
        if self._closed:
            raise ClientClosed(_CLOSED)
        if self._session is None:
            from kernel_env.remote import RemoteSession

            base_url, connect_timeout, message_timeout, token = self._remote
            self._session = await RemoteSession.connect(
                base_url,
                connect_timeout_s=connect_timeout,
                message_timeout_s=message_timeout,
                token=token,
            )
        return self._session

    async def reset(
        self,
        *,
        context: str = "",
        task_prompt: str = "",
        max_iterations: int = 30,
        seed: int | None = None,
        episode_id: str | None = None,
        hf_token: str | None = None,
        llm_model: str | None = None,
        expected_answer: str | None = None,
        rlm_max_depth: int | None = None,
        rlm_max_iterations: int | None = None,
        agent_max_turns: int | None = None,
        kernel_name: str | None = None,
    ) -> StepResult[REPLObservation]:
        """Start a new episode in a fresh kernel; ``context`` is loaded as a variable.

        The keywords are :class:`~kernel_env.models.ResetOptions`'s fields (a test keeps the two
        in step); None means "the episode's default"."""
        given = locals()
        kwargs = {k: given[k] for k in ResetOptions.model_fields if given[k] is not None}
        return await self._call(lambda session: session.reset(**kwargs))

    async def step(
        self, action: REPLAction, *, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        """Run one action. ``on_output(event)`` (a function or a coroutine function) gets the
        cell's output while it runs (see :mod:`kernel_env.streaming`), all of it before this
        returns; a slow callback never slows the kernel (text is merged, overflow dropped with
        a ``dropped`` event).

        A caller cancelled while the step runs (Ctrl-C under ``asyncio.run``) interrupts the
        step's cell and waits for the step to return before it is cancelled: the episode's
        next step then runs at once, never behind an abandoned cell."""
        return await self._call(lambda session: session.step(action, on_output), step=True)

    async def interrupt(self) -> None:
        """Interrupt the episode's running cell, called from another task (or, for a
        ``KernelEnv``, another thread): the step running returns at once, failed with a
        ``KeyboardInterrupt`` in its output, the episode's variables kept. Between steps it
        does nothing. On a server it is ``POST /api/kernels/{id}/interrupt``."""
        if self._closed:
            raise ClientClosed(_CLOSED)
        session = self._session
        if session is not None:  # else a remote client never connected: nothing runs
            await session.interrupt()

    async def _call(self, op: Callable[[_Session], Awaitable[T]], *, step: bool = False) -> T:
        """Runs ``op`` as its own task, so that ``close()`` can end it (ClientClosed) without
        cancelling the caller's task; ``step``: a caller that gives up interrupts it first."""

        async def run() -> T:
            return await op(await self._connect())

        task = asyncio.ensure_future(run())
        self._inflight.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._closed:
                raise ClientClosed(f"{_CLOSED} (it was closed during this call)") from None
            if step and not self._closed:
                await self._let_return(task)
            task.cancel()
            raise
        finally:
            self._inflight.discard(task)

    async def _let_return(self, task: asyncio.Future[Any]) -> None:
        """Interrupt the cell of a step whose caller gave up, and wait (a bounded time) for
        the step to return; its result, or failure, is nobody's."""
        task.add_done_callback(_discard_outcome)
        try:
            await asyncio.wait_for(asyncio.shield(self.interrupt()), _INTERRUPT_GRACE)
        except (Exception, asyncio.CancelledError) as exc:  # abandoned as before, but said
            log.warning("could not interrupt the step's cell: %r", exc)
            return
        await asyncio.wait({task}, timeout=_INTERRUPT_GRACE)

    async def execute(
        self, code: str, *, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        """Run ``code`` as one step (``on_output``: as for :meth:`step`)."""
        return await self.step(REPLAction(code=code), on_output=on_output)

    async def run(self, code: str, *, on_output: OutputCallback | None = None) -> CodeBlockResult:
        """Run ``code`` as a step and return just what it printed and raised: the short way to
        ``(await execute(code)).observation.result``."""
        return (await self.execute(code, on_output=on_output)).observation.result

    async def fork(
        self, n: int = 1, *, own_budget: bool = False, method: ForkMethod = "auto"
    ) -> list[AsyncKernelEnv]:
        """``n`` independent copies of the running episode, taken between steps: clients
        whose episodes hold this one's state and record so far and then step on their own
        (see :meth:`KernelEnvironment.fork`: a live copy of the kernel's process where it
        runs unsandboxed on this host, else a replay in a fresh kernel; ``method`` forces
        one; ``own_budget`` gives each its own LLM budget instead of this episode's).

        On a server the copies are new sessions there (its ``fork`` frame), and each client
        returned is attached to one; closing it ends that session. The server chooses how
        to copy (``method="auto"`` only)."""
        environment = self.environment
        if environment is None:
            return await self._fork_remote(n, own_budget, method)

        async def fork(session: _Session) -> list[KernelEnvironment]:
            assert isinstance(session, _LocalSession)
            session.require_episode()
            return await environment.fork(n, own_budget=own_budget, method=method)

        children = await self._call(fork)
        return [AsyncKernelEnv._around(_LocalSession(child), child, None) for child in children]

    async def _fork_remote(
        self, n: int, own_budget: bool, method: ForkMethod
    ) -> list[AsyncKernelEnv]:
        if method != "auto":
            raise InvalidInput(
                f"method={method!r} applies to local episodes: a server forks live where it "
                "can and replays elsewhere (method='auto')"
            )

        async def fork(session: _Session) -> list[AsyncKernelEnv]:
            from kernel_env.remote import RemoteSession

            assert isinstance(session, RemoteSession)  # a client without an environment
            copies = await session.fork(n, own_budget=own_budget)
            return await self._attach([str(copy["session_id"]) for copy in copies])

        return await self._call(fork)

    async def _attach(self, session_ids: list[str]) -> list[AsyncKernelEnv]:
        """Clients attached to these open sessions of this client's server (all, or none:
        those attached are closed again if one fails)."""
        from kernel_env.remote import RemoteSession

        base_url, connect_timeout, message_timeout, token = self._remote
        attached = await asyncio.gather(
            *(
                RemoteSession.connect(
                    base_url,
                    connect_timeout_s=connect_timeout,
                    message_timeout_s=message_timeout,
                    token=token,
                    session_id=session_id,
                )
                for session_id in session_ids
            ),
            return_exceptions=True,
        )
        sessions = [s for s in attached if isinstance(s, RemoteSession)]
        failed = [e for e in attached if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
            raise failed[0]
        return [AsyncKernelEnv._around(s, None, self._remote) for s in sessions]

    @classmethod
    def _around(
        cls,
        session: _Session,
        environment: KernelEnvironment | None,
        remote: tuple[str, float, float, str | None] | None,
    ) -> AsyncKernelEnv:
        """A client of a session that already runs an episode (a fork's copy)."""
        client = cls.__new__(cls)
        client.base_url = None if remote is None else remote[0]
        client._closed = False
        client._inflight = set()
        client.environment = environment
        client._session = session
        if remote is not None:
            client._remote = remote
        return client

    async def submit_final_answer(self, answer: str) -> StepResult[REPLObservation]:
        """End the episode with ``answer`` (no code runs)."""
        return await self.step(REPLAction(is_final=True, final_answer=answer))

    async def get_variable(self, name: str) -> StepResult[REPLObservation]:
        """Print ``repr(name)`` as one step (as OpenEnv's REPLEnv does)."""
        return await self.execute(f"print(repr({name}))")

    async def state(self) -> REPLState:
        """The episode's state."""
        return await self._call(lambda session: session.state())

    async def list_variables(self) -> list[str]:
        """Names defined in the episode's namespace."""
        return (await self.state()).namespace_keys

    async def export_notebook(
        self, path: str | os.PathLike[str], *, overwrite: bool = False
    ) -> Path:
        """Write the current (or last) episode as a notebook at ``path``; returns the path.

        A large ``context`` goes to a ``<name>.context.txt`` file next to it, and child
        episodes of ``rlm_query`` to ``<name>.child-<step>-<n>.ipynb``. A remote episode is
        downloaded from the server (``GET /sessions/{id}/export.zip``) and unpacked with
        care (only those files, no dotfiles, bounded size; an existing file is replaced only
        with ``overwrite=True``)."""
        target = Path(path)
        if not target.name.endswith(".ipynb"):
            target = target.with_name(target.name + ".ipynb")
        if self.environment is None:
            await self._download_export(target, overwrite)
            return target.resolve()
        record = self.environment.record
        if record is None:
            raise ResetNeeded()
        target.parent.mkdir(parents=True, exist_ok=True)
        return await asyncio.to_thread(write_notebook, record, target.parent, target.name)

    async def _download_export(self, target: Path, overwrite: bool) -> None:
        from kernel_env.remote import RemoteSession

        session = await self._connect()
        assert isinstance(session, RemoteSession)  # a client without an environment is remote
        data = await session.export_zip(target.name)
        await asyncio.to_thread(
            extract_export, data, target.parent, stem=target.stem, overwrite=overwrite
        )

    async def episodes(
        self,
        *,
        task: str | None = None,
        reward_min: float | None = None,
        reward_max: float | None = None,
        done: bool | None = None,
        state: str | None = None,
        kernel: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The episodes the server kept (``GET /episodes``: this token's own, every one for an
        operator's), newest first: ``episode_id``, ``session_id``, ``task``, ``steps``,
        ``reward``, ``done``, ``state`` (``running``, ``done``, ``interrupted``), ``started``
        and ``ended`` (seconds since 1970), ``parent``... ``task``: text in the task;
        ``since`` / ``until``: started in that span; ``limit``: that many at most."""
        from kernel_env.remote import list_episodes

        if self.environment is not None:
            raise InvalidInput("episodes() lists a server's stored episodes: pass base_url")
        filters = {
            "task": task,
            "reward_min": reward_min,
            "reward_max": reward_max,
            "done": done,
            "state": state,
            "kernel": kernel,
            "since": since,
            "until": until,
        }
        base_url, _, _, token = self._remote
        return await list_episodes(base_url, token=token, filters=filters, limit=limit)

    async def close(self) -> None:
        """End the episode and release its kernel (or connection); idempotent.

        Calls in flight (from other tasks, or threads of a ``KernelEnv``) end at once with
        :class:`ClientClosed`; close() waits for them to unwind (at most 10 s)."""
        self._closed = True
        inflight = list(self._inflight)
        for task in inflight:
            task.cancel()
        if inflight:
            await asyncio.wait(inflight, timeout=_CLOSE_GRACE)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> AsyncKernelEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _discard_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a step nobody waits for fails quietly


class _LoopThread:
    """One event loop on a daemon thread; ``run`` submits a coroutine and waits for it.

    After ``stop()`` nothing waits forever: ``run`` raises :class:`ClientClosed`, and a call
    submitted just before the stop is cancelled (its caller gets ClientClosed too).
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kernel-env-loop", daemon=True
        )
        self._thread.start()
        self.users = 1  # clients on this loop (a client's forks share it); the last stops it

    def share(self) -> _LoopThread:
        with self._lock:
            if self._stopped:
                raise ClientClosed(_CLOSED)
            self.users += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            last = self.users <= 0
        if last:
            self.stop()

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        on_interrupt: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> T:
        """``coro``'s result; ``on_interrupt``: what stops it when a KeyboardInterrupt (Ctrl-C)
        comes while it runs, before the interrupt is raised: run, then ``coro`` has a
        bounded time to return (a second Ctrl-C gives up at once)."""
        with self._lock:
            if self._stopped:
                coro.close()
                raise ClientClosed(_CLOSED)
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            if on_interrupt is not None:
                self._stop(future, on_interrupt)
            raise
        except concurrent.futures.CancelledError:
            raise ClientClosed(f"{_CLOSED} (it was closed during this call)") from None
        except (ConnectionError, RemoteError) as exc:
            # Said in one line: the frames inside the loop thread tell a user nothing.
            raise exc.with_traceback(None) from None

    def _stop(
        self, future: concurrent.futures.Future[Any], stop: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(_INTERRUPT_GRACE)
            future.result(_INTERRUPT_GRACE)
        except KeyboardInterrupt:
            future.cancel()
            raise
        except BaseException:  # the call's outcome is nobody's: Ctrl-C wins
            future.cancel()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if self.loop.is_running():
            return  # a call that ignores cancellation holds the loop: leave it to the daemon
        # Calls submitted before the stop but not finished: cancel them so no caller waits.
        pending = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=_CLOSE_GRACE))
        self.loop.close()


class KernelEnv:
    """The synchronous client, with OpenEnv ``REPLEnv``'s interface.

    Example::

        with KernelEnv() as env:
            env.reset(context="Hello World", task_prompt="Count chars")
            result = env.execute("len(context)")
            print(result.observation.result.stdout)   # 11

    Takes the keyword arguments of :class:`AsyncKernelEnv` (the same names, defaults and
    meanings; a test keeps them in step).
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        llm_query_fn: LLMQueryFn | None = None,
        llm_batch_fn: LLMBatchFn | None = None,
        max_output_length: int = 8192,
        context_preview_length: int = 500,
        reward_on_success: float = 1.0,
        reward_on_iteration: float = 0.0,
        reward_on_failure: float = -0.1,
        reward_on_error: float = -0.05,
        step_timeout: float = 30.0,
        rubric: Any = None,
        config: EnvConfig | None = None,
        kernel_source: KernelSource | None = None,
        llm_backend: LLMBackend | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        token: str | None = None,
    ) -> None:
        """Local-only options: ``llm_backend`` (a :mod:`kernel_env.llm` backend) or the simpler
        ``llm_query_fn`` / ``llm_batch_fn`` callables, output and reward settings,
        ``step_timeout``, ``rubric`` (``"exact"``, ``"fuzzy"``, ``fn(answer, expected)``, or an
        OpenEnv rubric such as upstream's ``REPLRubric``, which then gives every step's reward),
        or a whole ``config`` (which then wins over those keywords), and
        ``kernel_source`` (where kernels come from: a pool, a gateway; default a new local
        kernel per episode).
        Remote-only: ``connect_timeout_s``, ``message_timeout_s``, ``token`` (default: the
        ``KERNEL_ENV_TOKEN`` variable)."""
        self._async = AsyncKernelEnv(
            base_url,
            llm_query_fn=llm_query_fn,
            llm_batch_fn=llm_batch_fn,
            max_output_length=max_output_length,
            context_preview_length=context_preview_length,
            reward_on_success=reward_on_success,
            reward_on_iteration=reward_on_iteration,
            reward_on_failure=reward_on_failure,
            reward_on_error=reward_on_error,
            step_timeout=step_timeout,
            rubric=rubric,
            config=config,
            kernel_source=kernel_source,
            llm_backend=llm_backend,
            connect_timeout_s=connect_timeout_s,
            message_timeout_s=message_timeout_s,
            token=token,
        )
        self._loop: _LoopThread | None = _LoopThread()
        self._provider: Any = None

    @classmethod
    def from_docker_image(cls, image: str, **kwargs: Any) -> KernelEnv:
        """Start ``image`` (a ``kernel-env serve`` image) in Docker and connect to it.

        Uses OpenEnv's ``LocalDockerProvider`` (``pip install openenv-core``); ``kwargs`` go to
        its ``start_container``. ``close()`` stops the container.
        """
        # Imported here: openenv-core is needed only for this constructor.
        from openenv.core.containers.runtime import LocalDockerProvider

        provider = LocalDockerProvider()
        base_url = provider.start_container(image, **kwargs)
        try:
            provider.wait_for_ready(base_url)
            env = cls(base_url=base_url)
        except BaseException:
            provider.stop_container()
            raise
        env._provider = provider
        return env

    @property
    def environment(self) -> KernelEnvironment | None:
        """The local episode engine (None for a remote client)."""
        return self._async.environment

    def _run(self, coro: Coroutine[Any, Any, T], *, step: bool = False) -> T:
        """``coro`` on the client's loop; ``step``: Ctrl-C while it runs interrupts the
        episode's cell and lets the step return before the KeyboardInterrupt is raised."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise ClientClosed(_CLOSED)
        calling = _CALLING.get()
        if id(self) in calling:
            coro.close()
            raise EpisodeError(f"{_RECURSIVE} (an llm_query_fn that calls it, say)")
        token = _CALLING.set(calling | {id(self)})
        try:
            return loop.run(coro, self._async.interrupt if step else None)
        finally:
            _CALLING.reset(token)

    def reset(
        self,
        *,
        context: str = "",
        task_prompt: str = "",
        max_iterations: int = 30,
        seed: int | None = None,
        episode_id: str | None = None,
        hf_token: str | None = None,
        llm_model: str | None = None,
        expected_answer: str | None = None,
        rlm_max_depth: int | None = None,
        rlm_max_iterations: int | None = None,
        agent_max_turns: int | None = None,
        kernel_name: str | None = None,
    ) -> StepResult[REPLObservation]:
        """Start a new episode in a fresh kernel; ``context`` is loaded as a variable.

        The keywords are :class:`~kernel_env.models.ResetOptions`'s fields, as
        :meth:`AsyncKernelEnv.reset`'s; None means "the episode's default"."""
        given = locals()
        kwargs = {name: given[name] for name in ResetOptions.model_fields}
        return self._run(self._async.reset(**kwargs))

    def step(
        self, action: REPLAction, *, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        """Run one action; ``on_output`` as :meth:`AsyncKernelEnv.step` (a plain function runs
        in a worker thread).

        Ctrl-C (a KeyboardInterrupt, JupyterLab's stop button) while it runs interrupts the
        episode's cell and waits for the step to return, then raises: the next step runs at
        once, in the same kernel, its state kept."""
        return self._run(self._async.step(action, on_output=on_output), step=True)

    def execute(
        self, code: str, *, on_output: OutputCallback | None = None
    ) -> StepResult[REPLObservation]:
        """Run ``code`` as one step (as :meth:`step`, Ctrl-C included)."""
        return self._run(self._async.execute(code, on_output=on_output), step=True)

    def run(self, code: str, *, on_output: OutputCallback | None = None) -> CodeBlockResult:
        """Run ``code`` as a step; its result (``.stdout``, ``.stderr``, ``.success``...)."""
        return self._run(self._async.run(code, on_output=on_output), step=True)

    def interrupt(self) -> None:
        """Interrupt the episode's running cell, from another thread or from the step's own
        ``on_output`` callback (as :meth:`AsyncKernelEnv.interrupt`)."""
        loop = self._loop
        if loop is None:
            raise ClientClosed(_CLOSED)
        # Not behind the re-entry guard of _run: it waits on no step, so a callback of the
        # step it stops may call it.
        loop.run(self._async.interrupt())

    def fork(
        self, n: int = 1, *, own_budget: bool = False, method: ForkMethod = "auto"
    ) -> list[KernelEnv]:
        """``n`` independent copies of the running episode; see :meth:`AsyncKernelEnv.fork`.
        The copies share this client's event-loop thread (it stops when the last closes)."""
        loop = self._loop
        if loop is None:
            raise ClientClosed(_CLOSED)
        children = loop.run(self._async.fork(n, own_budget=own_budget, method=method))
        return [KernelEnv._on(loop.share(), child) for child in children]

    @classmethod
    def _on(cls, loop: _LoopThread, client: AsyncKernelEnv) -> KernelEnv:
        env = cls.__new__(cls)
        env._async, env._loop, env._provider = client, loop, None
        return env

    def submit_final_answer(self, answer: str) -> StepResult[REPLObservation]:
        return self._run(self._async.submit_final_answer(answer))

    def get_variable(self, name: str) -> StepResult[REPLObservation]:
        return self._run(self._async.get_variable(name))

    def state(self) -> REPLState:
        return self._run(self._async.state())

    def list_variables(self) -> list[str]:
        return self._run(self._async.list_variables())

    def run_agent(self, backend: LLMBackend, **kwargs: Any) -> AgentResult:
        """Let ``backend`` solve a task in this env with the RLM loop (see
        :func:`kernel_env.agent.run_agent` for the keywords). Runs on this client's loop."""
        from kernel_env.agent import run_agent

        return self._run(run_agent(self._async, backend, **kwargs))

    def export_notebook(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the current (or last) episode as a notebook; see AsyncKernelEnv."""
        return self._run(self._async.export_notebook(path, overwrite=overwrite))

    def episodes(self, **filters: Any) -> list[dict[str, Any]]:
        """The episodes the server kept, newest first; see AsyncKernelEnv.episodes."""
        return self._run(self._async.episodes(**filters))

    def close(self) -> None:
        """Release the kernel (or connection) and the loop thread; idempotent. A call in
        flight on another thread ends with :class:`ClientClosed`."""
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                loop.run(self._async.close())
            finally:
                loop.release()
        provider, self._provider = self._provider, None
        if provider is not None:
            provider.stop_container()

    def __enter__(self) -> KernelEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
