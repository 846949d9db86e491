"""The ``/ws`` frames of the OpenEnv contract, as plain data in and out (no I/O here).

``parse_frame`` turns a received frame into a request or an error frame; the ``*_frame``
functions build what the server sends (which exception is which error frame is
:mod:`.failures`'). ``mcp_response`` answers JSON-RPC for both ``POST /mcp`` and ``mcp``
frames. See ``docs/openenv-wire.md`` for the contract these follow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from kernel_env.errors import InvalidInput
from kernel_env.models import REPLAction, REPLObservation, REPLState, ResetOptions
from kernel_env.server import tools
from kernel_env.server.sessions import Session
from kernel_env.text import shorten

__all__ = [
    "SESSION_HEADER",
    "CallToolAction",
    "ErrorCode",
    "Frame",
    "ListToolsAction",
    "Request",
    "StepAction",
    "error_frame",
    "fork_payload",
    "invalid_frame",
    "mcp_response",
    "observation_frame",
    "observation_payload",
    "parse_frame",
    "problem",
    "state_frame",
    "tool_payload",
    "validation_errors",
]

Frame = dict[str, Any]

# The header that names an HTTP session: POST /reset answers with it, later requests send it.
SESSION_HEADER = "X-Session-Id"

# WebSocket close codes (RFC 6455): a normal end, a refused attach, a frame over the limit, a
# server that is going away, one that is full.
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG = 1000, 1008, 1009
CLOSE_RESTART, CLOSE_TRY_LATER = 1012, 1013


class ErrorCode(StrEnum):
    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


# -- client -> server --------------------------------------------------------------------


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the contract: unknown top-level keys rejected


class _ResetFrame(_Frame):
    type: Literal["reset"]
    data: dict[str, Any] = Field(default_factory=dict)
    # kernel_env's opt-in: stream every following step's output as "output" frames.
    stream: bool | None = None


class _StepFrame(_Frame):
    type: Literal["step"]
    data: dict[str, Any]
    stream: bool | None = None  # this step's output as "output" frames (None: the reset's)


class _StateFrame(_Frame):
    type: Literal["state"]


class _CloseFrame(_Frame):
    type: Literal["close"]


class _ForkFrame(_Frame):
    type: Literal["fork"]
    data: dict[str, Any] = Field(default_factory=dict)


class _McpFrame(_Frame):
    type: Literal["mcp"]
    data: dict[str, Any]


_FRAMES: dict[str, type[_Frame]] = {
    "reset": _ResetFrame,
    "step": _StepFrame,
    "state": _StateFrame,
    "close": _CloseFrame,
    "fork": _ForkFrame,
    "mcp": _McpFrame,
}


class ListToolsAction(BaseModel):
    """OpenEnv's ``list_tools`` step action: the tools, with their input schemas."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["list_tools"] = "list_tools"
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallToolAction(BaseModel):
    """OpenEnv's ``call_tool`` step action: one of the tools (:mod:`kernel_env.server.tools`)
    on the session's episode."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["call_tool"] = "call_tool"
    tool_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


def _action_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("list_tools", "call_tool") else "code"


# A step's action: code (REPLAction, which has no "type"), or a tool-calling action.
StepAction = Annotated[
    Annotated[REPLAction, Tag("code")]
    | Annotated[ListToolsAction, Tag("list_tools")]
    | Annotated[CallToolAction, Tag("call_tool")],
    Discriminator(_action_kind),
]
_STEP_ACTION: TypeAdapter[REPLAction | ListToolsAction | CallToolAction] = TypeAdapter(StepAction)


@dataclass(frozen=True)
class Request:
    """One parsed request. ``reset`` keeps its raw keywords (validated already) because
    ``ResetOptions`` drops ``hf_token`` on dump, and the episode needs it."""

    kind: Literal["reset", "step", "state", "close", "mcp", "fork"]
    reset: dict[str, Any] | None = None
    action: REPLAction | ListToolsAction | CallToolAction | None = None
    rpc: dict[str, Any] | None = None
    stream: bool | None = None  # asked for output frames (reset: for the session's steps)
    fork: ForkOptions | None = None
    setup: tuple[str, ...] = ()  # a reset's shell commands, run after it (the tools')
    verify: tuple[str, ...] = ()  # ... and those final_answer runs to score the episode


def parse_frame(raw: str | bytes) -> Request | Frame:
    """A request, or the error frame that answers a bad frame."""
    if isinstance(raw, bytes):
        return error_frame(
            ErrorCode.INVALID_JSON, "binary frames are not supported: send JSON as a text frame"
        )
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than ~1000
        return error_frame(ErrorCode.INVALID_JSON, f"Invalid JSON: {_short(exc)}")
    if not isinstance(message, dict):
        return invalid_frame([problem("model_type", (), "a frame must be a JSON object")])
    kind = message.get("type")
    model = _FRAMES.get(kind) if isinstance(kind, str) else None
    if model is None:
        return error_frame(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {_short(kind)}")
    try:
        frame = model.model_validate(message)
        if isinstance(frame, _ResetFrame):
            return _reset_request(frame)
        if isinstance(frame, _StepFrame):
            action = _STEP_ACTION.validate_python(frame.data)
            return Request("step", action=action, stream=frame.stream)
        if isinstance(frame, _McpFrame):
            return Request("mcp", rpc=frame.data)
        if isinstance(frame, _ForkFrame):
            return Request("fork", fork=ForkOptions.model_validate(frame.data))
    except ValidationError as exc:
        return invalid_frame(validation_errors(exc))
    return Request("close" if isinstance(frame, _CloseFrame) else "state")


def _reset_request(frame: _ResetFrame) -> Request | Frame:
    """A reset, its setup and verify commands apart (a wrong one: its error frame)."""
    try:
        options, setup, verify = tools.split_reset(frame.data)
    except InvalidInput as exc:
        return invalid_frame([problem("value_error", ("data",), str(exc))])
    ResetOptions.model_validate(options)
    return Request(
        "reset", reset=options, stream=frame.stream, setup=tuple(setup), verify=tuple(verify)
    )


# -- server -> client --------------------------------------------------------------------


class ForkOptions(BaseModel):
    """A ``fork`` frame's data (kernel_env's extension): how many copies, whose budget."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1, le=64)
    own_budget: bool = False


def fork_payload(children: list[Session]) -> dict[str, Any]:
    """What a fork answers: each copy's session id and episode id, and how it was made."""
    forks = []
    for child in children:
        record = child.record  # a fork's copy holds its episode from the start
        origin = (record.forked_from if record is not None else None) or {}
        forks.append(
            {
                "session_id": child.id,
                "episode_id": record.episode_id if record is not None else None,
                "method": origin.get("method"),
                "live_fork": origin.get("live_fork"),
                "outputs_matched": origin.get("outputs_matched"),
            }
        )
    return {"sessions": forks}


def output_frame(event: dict[str, Any]) -> Frame:
    """One event of a running cell's output (:mod:`kernel_env.streaming`), for a client that
    asked for them; always before that step's observation frame."""
    return {"type": "output", "data": event}


def observation_payload(obs: REPLObservation, **metadata: Any) -> dict[str, Any]:
    """``{"observation": O, "reward", "done", "metadata"}``; ``O`` carries the metadata too,
    for clients that read it there (OpenEnv's REPLEnv does), while newer ones read
    ``data.metadata``; ``reward``/``done`` live at the top, as OpenEnv serializes them."""
    meta = {**obs.metadata, **metadata}
    body = obs.model_dump(mode="json", exclude={"reward", "done", "metadata"})
    body["metadata"] = meta
    return {"observation": body, "reward": obs.reward, "done": obs.done, "metadata": meta}


def tool_payload(
    observation: dict[str, Any], reward: float | None, done: bool, **metadata: Any
) -> dict[str, Any]:
    """A tool step's answer, shaped as :func:`observation_payload`: OpenEnv's
    ``ListToolsObservation`` (``tools``) or ``CallToolObservation`` (``tool_name``,
    ``result``, ``error``) as ``observation``, ``reward`` and ``done`` at the top."""
    body = {**observation, "metadata": dict(metadata)}
    return {"observation": body, "reward": reward, "done": done, "metadata": dict(metadata)}


def observation_frame(obs: REPLObservation, **metadata: Any) -> Frame:
    return {"type": "observation", "data": observation_payload(obs, **metadata)}


def state_frame(state: REPLState) -> Frame:
    return {"type": "state", "data": state.model_dump(mode="json")}


def error_frame(code: ErrorCode, message: str, **extra: Any) -> Frame:
    return {"type": "error", "data": {"message": message, "code": code.value, **extra}}


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors without the offending input (it may be a token, or 100 MB)."""
    return [
        {"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]}
        for e in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


def invalid_frame(errors: list[dict[str, Any]]) -> Frame:
    """The frame that answers a request whose input failed validation (``errors``)."""
    return error_frame(ErrorCode.VALIDATION_ERROR, "Invalid message", errors=errors)


def _short(value: Any) -> str:
    """A value echoed in an error message: one line, 120 chars at most."""
    return shorten(str(value), 120, one_line=True)


def problem(kind: str, loc: tuple[Any, ...], msg: str) -> dict[str, Any]:
    """One validation problem, in pydantic's shape (``type``, ``loc``, ``msg``)."""
    return {"type": kind, "loc": list(loc), "msg": msg}


# -- JSON-RPC (MCP) ----------------------------------------------------------------------

_PARSE_ERROR, _INVALID_REQUEST, _METHOD_NOT_FOUND, _INTERNAL_ERROR = -32700, -32600, -32601, -32603


class _RpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jsonrpc: Literal["2.0"]
    method: str
    params: dict[str, Any] = Field(default_factory=dict)
    id: str | int | None = None


def mcp_response(payload: Any) -> dict[str, Any]:
    """A JSON-RPC 2.0 response. kernel_env exposes no MCP tools, so every well-formed call is
    answered with an error; what matters to OpenEnv clients is that it is valid JSON-RPC."""
    if isinstance(payload, (bytes, str)):
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError):
            return _rpc_error(None, _PARSE_ERROR, "Parse error")
    try:
        request = _RpcRequest.model_validate(payload)
    except ValidationError as exc:
        return _rpc_error(None, _INVALID_REQUEST, f"Invalid Request: {exc.error_count()} error(s)")
    if request.method.startswith("tools/"):
        return _rpc_error(
            request.id,
            _INTERNAL_ERROR,
            "Environment does not support MCP: kernel_env has no tools; use reset/step",
        )
    return _rpc_error(request.id, _METHOD_NOT_FOUND, f"Method not found: {_short(request.method)}")


def _rpc_error(request_id: str | int | None, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
