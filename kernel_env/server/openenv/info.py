"""OpenEnv's info routes, public (providers and ``openenv validate`` poll them): ``/health``,
``/metadata``, ``/schema``. (``/mcp`` is MCP's door, :mod:`kernel_env.server.mcp`.)"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from kernel_env import __version__
from kernel_env.models import REPLAction, REPLObservation, REPLState
from kernel_env.server.openenv.protocol import SESSION_HEADER
from kernel_env.server.runtime import describe_kernels

__all__ = ["SESSIONS_DOC", "health", "metadata", "schema"]

SESSIONS_DOC = f"""
**Sessions over HTTP.** Unlike OpenEnv's stateless HTTP routes, kernel_env keeps a session
(one kernel) per client. `POST /reset` without an `{SESSION_HEADER}` header opens a new session
and returns its id in the `{SESSION_HEADER}` response header and in
`observation.metadata.session_id`. Send it back in the `{SESSION_HEADER}` request header to
`POST /step`, `GET /state`, or `POST /reset` (a new episode in the same session). A session idle
longer than the server's TTL is reaped: later calls get 410 "session expired". Close a session
with `DELETE /sessions/{{id}}`. The WebSocket `/ws` needs none of this: one socket is one
session.
"""


async def health(request: Request) -> dict[str, Any]:
    return {"status": "healthy", "kernels": describe_kernels(request.app.state)}


async def metadata(request: Request) -> dict[str, Any]:
    return {
        "name": "kernel_env",
        "description": "A REPL environment for language-model agents in which every "
        "episode runs in a real IPython kernel (OpenEnv repl_env compatible).",
        "readme_content": SESSIONS_DOC.strip(),
        "version": __version__,
        "author": "kernel_env contributors",
        "documentation_url": "https://github.com/kernel-env/kernel-env#readme",
        "kernels": describe_kernels(request.app.state),
        "kernel_names": request.app.state.runtime.kernels.describe(),
    }


async def schema() -> dict[str, Any]:
    return {
        "action": REPLAction.model_json_schema(),
        "observation": REPLObservation.model_json_schema(),
        "state": REPLState.model_json_schema(),
    }
