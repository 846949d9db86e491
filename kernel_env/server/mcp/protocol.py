"""MCP's JSON-RPC messages, as plain data (no I/O): what a POST body holds, and the answers.

A body is one JSON-RPC message (a batch is refused: the protocol revisions since 2025-06-18
have none). A request has an ``id`` and wants a response; a notification or a client's
response does not, and is answered ``202 Accepted`` with no body. The handshake revisions are
served (``initialize``, then ``Mcp-Session-Id`` on every later request); the 2026 revision's
stateless envelope is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kernel_env import __version__

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "PROTOCOL_VERSIONS",
    "RESET_EXTENSION",
    "SESSION_HEADER",
    "SETUP_FAILED",
    "VERSION_HEADER",
    "Message",
    "RpcError",
    "error",
    "initialize_result",
    "negotiate",
    "parse",
    "result",
    "shown",
    "tool_call",
]

SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"
# The handshake revisions, oldest first; a client asking for another gets the newest.
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
# The client capability (an MCP extension) whose settings are the episode's reset options.
RESET_EXTENSION = "io.github.kernel-env/episode"

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
INTERNAL_ERROR = -32603
SETUP_FAILED = -32000  # a server error of JSON-RPC's range: the reset's setup command failed
_SHOWN = 80  # characters of a method name an error quotes


class RpcError(Exception):
    """A JSON-RPC error to answer with (``code``, ``message``), and its HTTP status."""

    def __init__(self, code: int, message: str, status: int = 200) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Message:
    """One JSON-RPC message of a client: a request (``id`` set), or a notification or a
    response (``id`` None: nothing to answer)."""

    method: str | None
    params: dict[str, Any]
    id: str | int | None

    @property
    def is_request(self) -> bool:
        return self.id is not None and self.method is not None


def parse(body: bytes) -> Message:
    """The message ``body`` holds, or :class:`RpcError` (parse error, invalid request)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise RpcError(PARSE_ERROR, "Parse error: the body is not JSON", 400) from None
    if isinstance(payload, list):
        raise RpcError(INVALID_REQUEST, "Invalid Request: batches are not served", 400)
    if not isinstance(payload, dict) or payload.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'Invalid Request: not a JSON-RPC 2.0 object ("jsonrpc")')
    method, params, ident = payload.get("method"), payload.get("params", {}), payload.get("id")
    if method is None:  # a client's response (to a request the server never sends)
        if "result" in payload or "error" in payload:
            return Message(None, {}, None)
        raise RpcError(INVALID_REQUEST, "Invalid Request: no method")
    if not isinstance(method, str):
        raise RpcError(INVALID_REQUEST, "Invalid Request: the method is not a string")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        raise RpcError(INVALID_REQUEST, "Invalid Request: the id is not a string or a number")
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "Invalid params: params must be an object")
    return Message(method, params, ident)


def shown(method: str) -> str:
    return method if len(method) <= _SHOWN else method[:_SHOWN] + "..."


def tool_call(message: Message) -> tuple[str, Any]:
    """A ``tools/call``'s tool name and arguments; RpcError for another method, or for a
    tool name that is not a string."""
    if message.method != "tools/call":
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {shown(str(message.method))}")
    name, arguments = message.params.get("name"), message.params.get("arguments", {})
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "Invalid params: the tool name is not a string")
    return name, arguments


def negotiate(asked: Any) -> str:
    """The revision to speak: the client's, if served; else the newest."""
    return asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]


def initialize_result(version: str, instructions: str) -> dict[str, Any]:
    return {
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": {"name": "kernel_env", "version": __version__},
        "instructions": instructions,
    }


def result(ident: str | int | None, value: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "result": value}


def error(ident: str | int | None, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}
