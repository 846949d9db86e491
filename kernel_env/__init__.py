"""kernel_env: a REPL environment for language-model agents, in real IPython kernels.

Importing the package does nothing but define names; the heavier modules load on first use, so
a kernel that loads the ``kernel_env`` extension starts as fast as a plain one. Its log records
go where the application's logging sends them, and nowhere when it configures none (what an
episode's observation already says is not repeated on a script's stderr); ``kernel-env serve``
configures its own.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "1.0.0"

# public name -> module that defines it
_EXPORTS = {
    "AgentResult": "kernel_env.agent",
    "AsyncKernelEnv": "kernel_env.client",
    "Budget": "kernel_env.llm",
    "BudgetExceeded": "kernel_env.errors",
    "CallableBackend": "kernel_env.llm",
    "ClientClosed": "kernel_env.errors",
    "CodeBlockResult": "kernel_env.models",
    "EnvConfig": "kernel_env.environment",
    "EpisodeError": "kernel_env.errors",
    "EpisodeFinished": "kernel_env.errors",
    "ExactMatch": "kernel_env.rubric",
    "FuzzyMatch": "kernel_env.rubric",
    "InvalidInput": "kernel_env.errors",
    "KernelDied": "kernel_env.errors",
    "KernelEnv": "kernel_env.client",
    "KernelEnvError": "kernel_env.errors",
    "KernelEnvironment": "kernel_env.environment",
    "KernelError": "kernel_env.errors",
    "LLMError": "kernel_env.errors",
    "LimitExceeded": "kernel_env.errors",
    "LocalKernel": "kernel_env.kernel",
    "OpenAIBackend": "kernel_env.llm",
    "REPLAction": "kernel_env.models",
    "REPLObservation": "kernel_env.models",
    "REPLState": "kernel_env.models",
    "RemoteError": "kernel_env.errors",
    "ResetNeeded": "kernel_env.errors",
    "Rewards": "kernel_env.rubric",
    "RubricError": "kernel_env.errors",
    "ScriptedBackend": "kernel_env.llm",
    "StepResult": "kernel_env.models",
    "Usage": "kernel_env.llm",
    "check_env": "kernel_env.checker",
    "replay_notebook": "kernel_env.replay",
    "run_agent": "kernel_env.agent",
}

__all__ = [
    "AgentResult",
    "AsyncKernelEnv",
    "Budget",
    "BudgetExceeded",
    "CallableBackend",
    "ClientClosed",
    "CodeBlockResult",
    "EnvConfig",
    "EpisodeError",
    "EpisodeFinished",
    "ExactMatch",
    "FuzzyMatch",
    "InvalidInput",
    "KernelDied",
    "KernelEnv",
    "KernelEnvError",
    "KernelEnvironment",
    "KernelError",
    "LLMError",
    "LimitExceeded",
    "LocalKernel",
    "OpenAIBackend",
    "REPLAction",
    "REPLObservation",
    "REPLState",
    "RemoteError",
    "ResetNeeded",
    "Rewards",
    "RubricError",
    "ScriptedBackend",
    "StepResult",
    "Usage",
    "check_env",
    "load_ipython_extension",
    "replay_notebook",
    "run_agent",
    "unload_ipython_extension",
]

if TYPE_CHECKING:
    from kernel_env.agent import AgentResult, run_agent
    from kernel_env.checker import check_env
    from kernel_env.client import AsyncKernelEnv, KernelEnv
    from kernel_env.environment import EnvConfig, KernelEnvironment
    from kernel_env.errors import (
        BudgetExceeded,
        ClientClosed,
        EpisodeError,
        EpisodeFinished,
        InvalidInput,
        KernelDied,
        KernelEnvError,
        KernelError,
        LimitExceeded,
        LLMError,
        RemoteError,
        ResetNeeded,
        RubricError,
    )
    from kernel_env.kernel import LocalKernel
    from kernel_env.llm import Budget, CallableBackend, OpenAIBackend, ScriptedBackend, Usage
    from kernel_env.models import (
        CodeBlockResult,
        REPLAction,
        REPLObservation,
        REPLState,
        StepResult,
    )
    from kernel_env.replay import replay_notebook
    from kernel_env.rubric import ExactMatch, FuzzyMatch, Rewards


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernel_env' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def load_ipython_extension(shell: Any) -> None:
    """``%load_ext kernel_env``: the agent helpers in your own notebook (and the per-cell
    tuning of ipykernel, :mod:`kernel_env.inkernel.tuning`)."""
    from kernel_env.inkernel import extension, tuning

    extension.install(shell)
    tuning.tune(shell)


def unload_ipython_extension(shell: Any) -> None:
    """Nothing to undo: the helpers stay defined until the kernel restarts."""
