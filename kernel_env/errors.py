"""Exceptions kernel_env raises for infrastructure failures, in one tree.

Errors in the *agent's* code are not exceptions: they are data in the observation
(``success=False``, ``exception``, the traceback in ``stderr``). These are for everything else::

    KernelEnvError
    ├── KernelError              a kernel could not be started, reached, or restarted
    │   ├── KernelStartError     it did not become ready
    │   ├── KernelDied           its process exited while a request was in flight
    │   ├── KernelCapacity       every kernel the server may run is in use
    │   └── LiveForkUnavailable  this kernel cannot be copied live (a fork then replays)
    ├── EpisodeError             misuse of an episode
    │   ├── ResetNeeded          step() or state before reset() (also a RuntimeError)
    │   │   └── ClientClosed     a call after close(), or in flight when close() ran
    │   └── EpisodeFinished      step() after the episode is done
    ├── InvalidInput             input refused (also a ValueError): the caller's fault
    │   ├── LimitExceeded        over a limit of the episode (code, context size)
    │   ├── RequestError         a kernel's host call is malformed
    │   ├── LanguageRefused      a language no kernel of this server runs
    │   └── ExportPathError      an export path would leave the export directory
    │       └── ArchiveError     an export archive holds what the client will not write
    ├── RubricError              a user's rubric raised, or returned no number
    ├── ConformanceError         an environment broke the REPL interface (check_env)
    ├── LLMError                 a model call failed after its retries
    │   └── BudgetExceeded       the episode's LLM budget is spent (enforced on the host)
    ├── SessionError             a server session cannot serve requests any more
    │   ├── SessionExpired       idle past the server's TTL, and reaped
    │   └── SessionClosed        closed by its owner, or by the server's shutdown
    ├── UnknownSession           no server session has this id
    ├── UnknownEpisode           no stored episode has this id (that the caller may see)
    ├── StoredEpisodeError       a stored episode's notebook is missing or unreadable
    ├── CapacityReached          the server's ``max_sessions`` sessions are open
    ├── KernelCallError          an operation run in a session's kernel, outside its episode,
    │                            was refused (``code``: a Connect status name)
    ├── SandboxError             E2B's control plane refused a request (``status``: HTTP's)
    └── RemoteError              the server refused, or answered with an error

The server answers ``InvalidInput`` (and request validation) with 422 / ``VALIDATION_ERROR``;
any other exception it did not expect is its own fault, a 500 / ``EXECUTION_ERROR``.

A remote client raises the class a local client raises in the same situation (a step after
the end: ``EpisodeFinished``; before a reset: ``ResetNeeded``; ...): the server names it in its
error (``"exception"``), and :func:`remote_error` makes it. Each such exception is *also* a
:class:`RemoteError`, with the server's ``code`` and ``data``, so ``except RemoteError`` catches
what it always caught. A plain ``RemoteError`` is left for what only a remote client meets: a
refused token, no reply in time, a closed connection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ArchiveError",
    "BudgetExceeded",
    "CapacityReached",
    "ClientClosed",
    "ConformanceError",
    "EpisodeError",
    "EpisodeFinished",
    "ExportPathError",
    "ForkRefused",
    "InvalidInput",
    "KernelCallError",
    "KernelCapacity",
    "KernelDied",
    "KernelEnvError",
    "KernelError",
    "KernelStartError",
    "LLMError",
    "LanguageRefused",
    "LimitExceeded",
    "LiveForkUnavailable",
    "MessageTooLarge",
    "RemoteError",
    "RequestError",
    "ResetNeeded",
    "RubricError",
    "SandboxError",
    "SessionClosed",
    "SessionError",
    "SessionExpired",
    "StoredEpisodeError",
    "UnknownEpisode",
    "UnknownSession",
]

# The words for a call that needs an episode, before any reset: OpenEnv's, which clients match.
NOT_INITIALIZED = "Environment not initialized. Call reset() first."
# The words for a step after the episode ended, for a caller of step() (local or remote).
EPISODE_OVER = "the episode is over; call reset() to start another"


def invalid_call(call: str, problems: Iterable[Mapping[str, Any]]) -> str:
    """Validation errors (pydantic's, or an error frame's ``errors``) as one line naming the
    call and each field: ``invalid reset(): max_iterations: Input should be ...``; the same
    words locally and from a server."""
    said = [
        f"{'.'.join(str(part) for part in p.get('loc') or ()) or 'input'}: {p.get('msg')}"
        for p in problems
    ]
    return f"invalid {call}(): {'; '.join(said) or 'refused'}"


class KernelEnvError(Exception):
    """Root of kernel_env's exceptions; carries optional context ids."""

    def __init__(
        self, message: str, *, kernel_id: str | None = None, episode_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.kernel_id = kernel_id
        self.episode_id = episode_id


# -- kernels ------------------------------------------------------------------------------


class KernelError(KernelEnvError):
    """A kernel could not be started, reached, or restarted."""


class KernelStartError(KernelError):
    """A kernel did not become ready."""


class KernelDied(KernelError):
    """The kernel process exited while a request was in flight."""


class MessageTooLarge(KernelDied):
    """The kernel sent the host a message over the host's limit: the host dropped it unread
    and restarts the kernel, as it does one that died."""


class KernelCapacity(KernelError):
    """Every kernel the server may run (``max_kernels``) is in use."""


class LiveForkUnavailable(KernelError):
    """This kernel cannot be copied live (a gateway's, a sandboxed one, one running a thread
    or a child process of its own): an episode's fork replays its steps instead."""


# -- episodes -----------------------------------------------------------------------------


class EpisodeError(KernelEnvError):
    """The episode was used in a way its lifecycle does not allow."""


class ResetNeeded(EpisodeError, RuntimeError):
    """step() or state before reset(). A ``RuntimeError``, as upstream's "Environment not
    initialized. Call reset() first." is (the default message)."""

    def __init__(self, message: str = NOT_INITIALIZED, **ids: str | None) -> None:
        super().__init__(message, **ids)


class ClientClosed(ResetNeeded):
    """The client was closed: a call made after ``close()``, or one in flight when ``close()``
    ran (it ends at once instead of waiting for a kernel that is gone)."""


class EpisodeFinished(EpisodeError):
    """step() after the episode ended; call reset() to start another."""


# -- input refused ------------------------------------------------------------------------


class ForkRefused(EpisodeError):
    """fork() while a step runs, before a reset, or after the episode ended."""


class InvalidInput(KernelEnvError, ValueError):
    """Input was refused: the caller's fault (the server's 422). A ``ValueError`` too."""


class LimitExceeded(InvalidInput):
    """Code, context or another input is over a limit of the episode."""


class RequestError(InvalidInput):
    """A kernel's request is malformed; the kernel gets the message back as an error."""


class LanguageRefused(InvalidInput):
    """A language (E2B's name for one, or a kernel's) that no kernel of this server runs."""


class ExportPathError(InvalidInput):
    """An export path would leave the export directory."""


class ArchiveError(ExportPathError):
    """An export archive holds something the client will not write."""


# -- scoring and conformance --------------------------------------------------------------


class RubricError(KernelEnvError):
    """A user-supplied rubric raised or returned something that is not a number."""


class ConformanceError(KernelEnvError):
    """An environment broke an expectation of the REPL interface."""


# -- models -------------------------------------------------------------------------------


class LLMError(KernelEnvError):
    """A model call failed (after its retries) or its answer could not be read."""


class BudgetExceeded(LLMError):
    """The episode's LLM budget (calls or tokens) is spent; enforced on the host."""


# -- server sessions and the remote client ------------------------------------------------


class SessionError(KernelEnvError):
    """The session cannot serve requests any more."""


class SessionExpired(SessionError):
    """The session was idle longer than the server's TTL and was reaped."""


class SessionClosed(SessionError):
    """The session was closed (by its owner, or because the server is shutting down)."""


class UnknownSession(KernelEnvError):
    """No session has this id (it never existed, or was forgotten long ago)."""


class UnknownEpisode(KernelEnvError):
    """No stored episode has this id, among those the caller may see (another tenant's is
    one that does not exist)."""


class StoredEpisodeError(KernelEnvError):
    """A stored episode's notebook is missing or unreadable (its index row is kept)."""


class CapacityReached(KernelEnvError):
    """``max_sessions`` sessions are open."""

    def __init__(self, active_sessions: int, max_sessions: int) -> None:
        super().__init__(
            f"Server at capacity: {active_sessions}/{max_sessions} sessions are open; "
            "retry later or close another session"
        )
        self.active_sessions = active_sessions
        self.max_sessions = max_sessions


class KernelCallError(KernelEnvError):
    """An operation run in a session's kernel between its cells, outside its episode (E2B's
    file and process calls), was refused: ``code`` is a Connect status name (``not_found``,
    ``unavailable``, ``internal``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SandboxError(KernelEnvError):
    """E2B's control plane refused a request: ``status`` is the HTTP status its answer
    carries, in E2B's shape ``{"code": status, "message": ...}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RemoteError(KernelEnvError):
    """The server refused a request or answered it with an error (``code``: its error code,
    ``data``: the rest of what it said)."""

    def __init__(self, message: str, *, code: str, data: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.data = data or {}


_REMOTE_KINDS: dict[type[KernelEnvError], type[RemoteError]] = {}


def remote_error(
    name: str | None, message: str, *, code: str, data: dict | None = None
) -> RemoteError:
    """The exception for a server's error that names the class ``name`` (one of this module's,
    as a local client would raise it): an instance of that class and of :class:`RemoteError`,
    whose message is the server's ``message``. An unknown or missing name gives a plain
    RemoteError (``"CODE: message"``)."""
    cls = globals().get(name or "")
    if (
        name not in __all__
        or not isinstance(cls, type)
        or not issubclass(cls, KernelEnvError)
        or issubclass(cls, RemoteError)
    ):
        return RemoteError(message, code=code, data=data)
    return _remote_kind(cls)(message, code=code, data=data)


def _remote_kind(cls: type[KernelEnvError]) -> type[RemoteError]:
    """``cls`` as raised by a remote client: a subclass of it and of RemoteError, with its
    name, made once."""
    kind = _REMOTE_KINDS.get(cls)
    if kind is None:
        body = {
            "__module__": __name__,
            "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__}, as a remote client raises it (also a RemoteError).",
            "__init__": _init_remote,
            "__reduce__": _reduce_remote,
        }
        kind = _REMOTE_KINDS[cls] = type(cls.__name__, (cls, RemoteError), body)
    return kind


def _init_remote(self: RemoteError, message: str, *, code: str, data: dict | None = None) -> None:
    KernelEnvError.__init__(self, message)
    self.code, self.data = code, data or {}
    if isinstance(self, CapacityReached):
        self.active_sessions = int(self.data.get("active_sessions") or 0)
        self.max_sessions = int(self.data.get("max_sessions") or 0)


def _reduce_remote(self: RemoteError) -> tuple[object, tuple[object, ...]]:
    # Pickled by the public name it stands for (the class itself is made at run time).
    name = next(c.__name__ for c in type(self).__mro__[1:] if c.__name__ in __all__)
    return _unpickle_remote, (name, str(self), self.code, self.data)


def _unpickle_remote(name: str, message: str, code: str, data: dict) -> RemoteError:
    return remote_error(name, message, code=code, data=data)
