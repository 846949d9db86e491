"""OpenEnv's episode routes, ``POST /reset``, ``POST /step`` and ``GET /state``, and
kernel_env's session routes beside them (close, fork).

Unlike OpenEnv's stateless HTTP, ``/reset`` opens a *session*: its id comes back in the
``X-Session-Id`` response header (and in ``observation.metadata.session_id``); ``/step`` and
``/state`` take it in the ``X-Session-Id`` request header. Handlers are thin: each names a
session and calls one of its operations; what fails is answered by :mod:`.failures`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import Body, Header, HTTPException, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kernel_env.errors import InvalidInput
from kernel_env.models import REPLAction, REPLObservation, ResetOptions
from kernel_env.server import tools
from kernel_env.server.auth import tenant_of
from kernel_env.server.openenv.protocol import (
    SESSION_HEADER,
    StepAction,
    fork_payload,
    observation_payload,
)
from kernel_env.server.openenv.tool_steps import ToolSteps
from kernel_env.server.runtime import Runtime
from kernel_env.server.sessions import Session, SessionError

__all__ = [
    "ForkRequest",
    "ResetBody",
    "SessionHeader",
    "StepRequest",
    "StepResponse",
    "close_session",
    "fork",
    "reset",
    "state",
    "step",
]


class StepRequest(BaseModel):
    """The body of ``POST /step`` (OpenEnv's shape; extra keys are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    action: StepAction = Field(
        description="Code (`code`, `is_final`, `final_answer`), or OpenEnv's tool-calling "
        'actions: `{"type": "list_tools"}`, `{"type": "call_tool", "tool_name": ..., '
        '"arguments": {...}}`.'
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Accepted for compatibility; the server's step timeout "
        "applies (it is kept below OpenEnv clients' 60 s wait).",
    )
    request_id: str | None = Field(default=None, max_length=255)


Commands = str | list[str] | None


class ResetBody(ResetOptions):
    """The body of ``POST /reset``: the reset's options, and the shell commands of the tool
    steps: ``setup`` run after the reset, ``verify`` run by ``final_answer`` to score it."""

    setup: Commands = None
    setup_scripts: Commands = None
    verify: Commands = None
    verify_scripts: Commands = None


class ForkRequest(BaseModel):
    """The body of ``POST /sessions/{id}/fork``."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1, le=64, description="How many copies.")
    own_budget: bool = Field(
        default=False, description="Each copy gets its own LLM budget (default: the parent's)."
    )


class StepResponse(BaseModel):
    observation: dict[str, Any]
    reward: float | None = None
    done: bool = False


SessionHeader = Annotated[
    str | None,
    Header(
        alias=SESSION_HEADER,
        description="The session id that `POST /reset` returned in its `X-Session-Id` header.",
    ),
]


async def reset(
    request: Request,
    options: Annotated[ResetBody | None, Body()] = None,
    session_id: SessionHeader = None,
) -> Response:
    runtime = runtime_of(request)
    # Every field the caller set, hf_token included (ResetOptions never dumps it).
    given = (
        {name: getattr(options, name) for name in options.model_fields_set}
        if options is not None
        else {}
    )
    kwargs, setup, verify = tools.split_reset(given)
    _require_text(kwargs)
    tenant = tenant_of(request)
    session = runtime.sessions.get(session_id, tenant) if session_id else None
    new = session is None
    session = session or runtime.sessions.open("http", tenant)
    try:
        async with runtime.sessions.request(session):
            obs = await session.reset(kwargs)
            timeout = runtime.settings.step_timeout
            await _tool_steps(request).reset(session, tuple(setup), tuple(verify), timeout)
        # Built here, inside the try: a reply that cannot be built is a failed reset too.
        return _observation_response(obs, session)
    except BaseException:
        if new:  # a session whose first reset failed is of no use to anyone
            await asyncio.shield(runtime.sessions.close_soon(session))
        raise


async def step(request: Request, body: StepRequest, session_id: SessionHeader = None) -> Response:
    session = _require_session(request, session_id)
    runtime = runtime_of(request)
    async with runtime.sessions.request(session):
        if isinstance(body.action, REPLAction):
            obs = await session.step(body.action)
        else:
            timeout = runtime.settings.step_timeout
            payload = await _tool_steps(request).step(
                session, body.action, timeout, session_id=session.id
            )
            del payload["metadata"]  # as for code: OpenEnv's three keys
            return JSONResponse(payload, headers={SESSION_HEADER: session.id})
    return _observation_response(obs, session)


async def state(request: Request, session_id: SessionHeader = None) -> Response:
    session = _require_session(request, session_id)
    current = session.state()
    big = len(current.context or "") > 1 << 20
    body = await asyncio.to_thread(current.model_dump_json) if big else current.model_dump_json()
    return Response(body, media_type="application/json")


async def close_session(request: Request, session_id: str) -> Response:
    sessions = runtime_of(request).sessions
    try:
        session = sessions.get(session_id, tenant_of(request))
    except SessionError:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    await sessions.close_session(session)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


async def fork(
    request: Request, session_id: str, body: ForkRequest | None = None
) -> dict[str, Any]:
    sessions = runtime_of(request).sessions
    wanted = body or ForkRequest()
    session = sessions.get(session_id, tenant_of(request))
    children = await sessions.fork(session, wanted.n, own_budget=wanted.own_budget)
    return fork_payload(children)


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _tool_steps(request: Request) -> ToolSteps:
    steps: ToolSteps = request.app.state.openenv_tools
    return steps


def _require_text(kwargs: dict[str, Any]) -> None:
    """Refuse strings that are not text (lone surrogates such as "\\ud800", which JSON allows
    but UTF-8 cannot carry) before a session opens: they would fail later, half-way."""
    for key, value in kwargs.items():
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInput(
                    f"{key} is not valid Unicode text (a lone surrogate at position {exc.start})"
                ) from None


def _require_session(request: Request, session_id: str | None) -> Session:
    """The session the header names, if the request's tenant may use it (else: unknown)."""
    if not session_id:
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST,
            f"missing {SESSION_HEADER} header: call POST /reset first; it returns the session "
            f"id in its {SESSION_HEADER} response header",
        )
    return runtime_of(request).sessions.get(session_id, tenant_of(request))


def _observation_response(obs: REPLObservation, session: Session) -> JSONResponse:
    payload = observation_payload(obs, session_id=session.id)
    del payload["metadata"]  # HTTP keeps OpenEnv's three keys; metadata is in the observation
    return JSONResponse(payload, headers={SESSION_HEADER: session.id})
