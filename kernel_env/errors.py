"""Exceptions kernel_env raises for infrastructure failures.

Errors in the *agent's* code are not exceptions: they are data in the observation
(``success=False``, ``exception``, the traceback in ``stderr``). These are for everything else::

    KernelEnvError
    ├── KernelError              a kernel could not be started, reached, or restarted
    │   └── KernelStartError
    ├── EpisodeError             misuse of an episode
    │   ├── ResetNeeded          step() or state before reset() (also a RuntimeError)
    │   │   └── ClientClosed     a call after close(), or in flight when close() ran
    │   └── EpisodeFinished      step() after the episode is done
    ├── LLMError                 a model call failed after its retries
    │   └── BudgetExceeded       the episode's LLM budget is spent (enforced on the host)
    └── RemoteError              the server answered with an error frame
"""

from __future__ import annotations

__all__ = [
    "BudgetExceeded",
    "ClientClosed",
    "EpisodeError",
    "EpisodeFinished",
    "KernelEnvError",
    "KernelError",
    "KernelStartError",
    "LLMError",
    "RemoteError",
    "ResetNeeded",
]


class KernelEnvError(Exception):
    """Root of kernel_env's exceptions; carries optional context ids."""

    def __init__(
        self, message: str, *, kernel_id: str | None = None, episode_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.kernel_id = kernel_id
        self.episode_id = episode_id


class KernelError(KernelEnvError):
    """A kernel could not be started, reached, or restarted."""


class KernelStartError(KernelError):
    """A kernel did not become ready."""


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


class LLMError(KernelEnvError):
    """A model call failed (after its retries) or its answer could not be read."""


class BudgetExceeded(LLMError):
    """The episode's LLM budget (calls or tokens) is spent; enforced on the host."""


class RemoteError(KernelEnvError):
    """The server answered a request with an error frame."""

    def __init__(self, message: str, *, code: str, data: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.data = data or {}
