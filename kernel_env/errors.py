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
    ├── CapacityReached          the server's ``max_sessions`` sessions are open
    └── RemoteError              the server answered with an error frame

The server answers ``InvalidInput`` (and request validation) with 422 / ``VALIDATION_ERROR``;
any other exception it did not expect is its own fault, a 500 / ``EXECUTION_ERROR``.
"""

from __future__ import annotations

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
    "KernelCapacity",
    "KernelDied",
    "KernelEnvError",
    "KernelError",
    "KernelStartError",
    "LLMError",
    "LimitExceeded",
    "LiveForkUnavailable",
    "RemoteError",
    "RequestError",
    "ResetNeeded",
    "RubricError",
    "SessionClosed",
    "SessionError",
    "SessionExpired",
    "UnknownSession",
]


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
    initialized. Call reset() first." is."""


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


class CapacityReached(KernelEnvError):
    """``max_sessions`` sessions are open."""

    def __init__(self, active_sessions: int, max_sessions: int) -> None:
        super().__init__(
            f"Server at capacity: {active_sessions}/{max_sessions} sessions are open; "
            "retry later or close another session"
        )
        self.active_sessions = active_sessions
        self.max_sessions = max_sessions


class RemoteError(KernelEnvError):
    """The server answered a request with an error frame."""

    def __init__(self, message: str, *, code: str, data: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.data = data or {}
