"""OpenEnv's routes, as a table: each path, its handler and what ``/docs`` says of it.

The handlers are :mod:`.info`'s (public), :mod:`.episodes`' and :mod:`.exports`' (behind the
token), and ``/ws``'s loop (:mod:`.websocket`). :func:`add_openenv` puts them on the app, with
the door's one mapping of exceptions to answers (:mod:`.failures`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Response, status
from fastapi.routing import APIRoute, APIWebSocketRoute

from kernel_env.models import REPLState
from kernel_env.server.openenv import episodes, exports, info
from kernel_env.server.openenv.failures import HANDLERS
from kernel_env.server.openenv.tool_steps import ToolSteps
from kernel_env.server.openenv.websocket import websocket_endpoint

__all__ = ["PUBLIC", "ROUTES", "add_openenv"]

# Reachable without a token: providers and `openenv validate` poll them.
PUBLIC = ("/health", "/metadata", "/schema")

_FORK_DOC = (
    "Each copy is a new HTTP session (an `X-Session-Id`, or `/ws?session=`) whose episode "
    "holds this one's state and record so far, re-run in a fresh kernel with `llm_query` "
    "answered from the record. Copies count toward `max_sessions`; a fork while a step runs "
    "gets 409."
)
_NOTEBOOK_DOC = (
    "A context larger than 10,000 characters is not inlined: the notebook reads it from "
    "`<name>.context.txt` beside it, and child episodes are separate notebooks; "
    "`GET /sessions/{id}/export.zip` has them all."
)
_NOTEBOOK_TYPE: dict[int | str, dict[str, Any]] = {
    200: {"content": {exports.NOTEBOOK_MEDIA_TYPE: {}}}
}
_ZIP_TYPE: dict[int | str, dict[str, Any]] = {200: {"content": {"application/zip": {}}}}

ROUTES = [
    APIRoute("/health", info.health, methods=["GET"], tags=["Health"], summary="Health check"),
    APIRoute(
        "/metadata",
        info.metadata,
        methods=["GET"],
        tags=["Environment Info"],
        summary="Environment metadata",
    ),
    APIRoute(
        "/schema",
        info.schema,
        methods=["GET"],
        tags=["Schema"],
        summary="JSON schemas of action, observation, state",
    ),
    APIRoute(
        "/reset",
        episodes.reset,
        methods=["POST"],
        tags=["Environment Control"],
        response_model=episodes.StepResponse,
        summary="Start an episode (opens a session if none is named)",
        description=info.SESSIONS_DOC,
    ),
    APIRoute(
        "/step",
        episodes.step,
        methods=["POST"],
        tags=["Environment Control"],
        response_model=episodes.StepResponse,
        summary="Run one action in the session's episode",
        description="Requires the `X-Session-Id` header from `POST /reset`; without it, "
        "400. An invalid action is 422.\n" + info.SESSIONS_DOC,
    ),
    APIRoute(
        "/state",
        episodes.state,
        methods=["GET"],
        tags=["State Management"],
        response_model=REPLState,
        summary="The session's episode state",
        description="Requires the `X-Session-Id` header from `POST /reset`.",
    ),
    APIRoute(
        "/sessions/{session_id}",
        episodes.close_session,
        methods=["DELETE"],
        tags=["Sessions"],
        status_code=status.HTTP_204_NO_CONTENT,
        summary="Close a session (idempotent)",
    ),
    APIRoute(
        "/sessions/{session_id}/fork",
        episodes.fork,
        methods=["POST"],
        tags=["Sessions"],
        summary="Fork the session's episode into new sessions (between steps)",
        description=_FORK_DOC,
    ),
    APIRoute(
        "/sessions/{session_id}/notebook",
        exports.notebook,
        methods=["GET"],
        tags=["Sessions"],
        summary="The session's current (or last) episode as a Jupyter notebook",
        description=_NOTEBOOK_DOC,
        response_class=Response,
        responses=_NOTEBOOK_TYPE,
    ),
    APIRoute(
        "/sessions/{session_id}/export.zip",
        exports.export,
        methods=["GET"],
        tags=["Sessions"],
        summary="The episode's notebook, context file and child episodes, zipped",
        response_class=Response,
        responses=_ZIP_TYPE,
    ),
    APIWebSocketRoute("/ws", websocket_endpoint),
]


def add_openenv(app: FastAPI) -> None:
    """OpenEnv's routes on ``app``, and their answers to failures (the app's exception
    handlers, which the operator's routes share)."""
    app.state.openenv_tools = ToolSteps()
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.include_router(APIRouter(routes=list(ROUTES)))
