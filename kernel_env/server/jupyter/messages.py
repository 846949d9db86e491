"""Jupyter's kernel messages, as its WebSocket carries them (JSON, a ``channel`` field), as
plain data: reading a client's message, building the kernel's, and turning a step's output
events (:mod:`kernel_env.streaming`) into iopub messages. No I/O here.

The legacy JSON form is the one served (no ``v1.kernel.websocket.jupyter.org`` binary
frames): Jupyter Server's gateway client asks for no subprotocol, and JupyterLab falls back
to JSON when the server picks none.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "CHANNELS",
    "PROTOCOL_VERSION",
    "ClientMessage",
    "iopub_for_event",
    "kernel_info",
    "message",
    "parse",
    "status",
]

PROTOCOL_VERSION = "5.3"
CHANNELS = frozenset({"shell", "control", "stdin", "iopub"})
_USERNAME = "kernel_env"

# language_info of the languages kernel_env serves, as their own kernels report it.
_LANGUAGE_INFO: dict[str, dict[str, Any]] = {
    "python": {
        "name": "python",
        "mimetype": "text/x-python",
        "file_extension": ".py",
        "pygments_lexer": "ipython3",
        "codemirror_mode": {"name": "ipython", "version": 3},
        "nbconvert_exporter": "python",
    },
    "R": {"name": "R", "mimetype": "text/x-r-source", "file_extension": ".r"},
    "bash": {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh"},
    "typescript": {"name": "typescript", "mimetype": "text/typescript", "file_extension": ".ts"},
}


@dataclass(frozen=True)
class ClientMessage:
    """One message a client sent: its channel, type, header and content."""

    channel: str
    msg_type: str
    header: dict[str, Any]
    content: dict[str, Any]

    @property
    def msg_id(self) -> str:
        return str(self.header.get("msg_id", ""))


def parse(data: Any) -> ClientMessage | str:
    """The message in a decoded frame, or why it is not one (the frame is then dropped, as
    Jupyter Server drops what it cannot read)."""
    if not isinstance(data, dict):
        return "a message is a JSON object"
    header, content = data.get("header"), data.get("content", {})
    channel = data.get("channel")
    if not isinstance(header, dict) or not isinstance(content, dict):
        return "a message needs a header and a content object"
    msg_type = header.get("msg_type")
    if not isinstance(msg_type, str) or not isinstance(header.get("msg_id"), str):
        return "a message's header needs a msg_id and a msg_type"
    if channel not in CHANNELS:
        return f"unknown channel {channel!r}"
    return ClientMessage(str(channel), msg_type, header, content)


def message(
    channel: str,
    msg_type: str,
    content: dict[str, Any],
    *,
    parent: dict[str, Any] | None,
    session: str,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A message of the kernel's, in reply to the one whose header is ``parent``."""
    header = {
        "msg_id": uuid.uuid4().hex,
        "msg_type": msg_type,
        "username": _USERNAME,
        "session": session,
        "date": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "version": PROTOCOL_VERSION,
    }
    return {
        "header": header,
        "msg_id": header["msg_id"],
        "msg_type": msg_type,
        "parent_header": parent or {},
        "metadata": metadata or {},
        "content": content,
        "buffers": [],
        "channel": channel,
    }


def status(state: str, *, parent: dict[str, Any] | None, session: str) -> dict[str, Any]:
    """The iopub ``status`` message: ``busy``, ``idle``, ``starting``, ``restarting``."""
    return message("iopub", "status", {"execution_state": state}, parent=parent, session=session)


def iopub_for_event(
    event: dict[str, Any], *, parent: dict[str, Any], session: str
) -> dict[str, Any] | None:
    """The iopub message for one output event of a step; None for an event that has none."""
    kind = event.get("output_type")
    if kind == "dropped":
        text = f"\n[kernel_env: {event.get('bytes', 0)} bytes of output dropped: read faster]\n"
        content: dict[str, Any] = {"name": "stderr", "text": text}
        return message("iopub", "stream", content, parent=parent, session=session)
    if kind not in _OUTPUT_KEYS:
        return None
    content = {key: event[key] for key in _OUTPUT_KEYS[kind] if key in event}
    if kind in ("display_data", "update_display_data", "execute_result"):
        content.setdefault("metadata", {})
        content.setdefault("data", {})
    if kind in ("display_data", "update_display_data"):
        content.setdefault("transient", {})
    return message("iopub", kind, content, parent=parent, session=session)


_OUTPUT_KEYS: dict[str, tuple[str, ...]] = {
    "stream": ("name", "text"),
    "display_data": ("data", "metadata", "transient"),
    "update_display_data": ("data", "metadata", "transient"),
    "execute_result": ("data", "metadata", "execution_count"),
    "error": ("ename", "evalue", "traceback"),
    "clear_output": ("wait",),
}


def kernel_info(language: str, version: str) -> dict[str, Any]:
    """The ``kernel_info_reply`` content of a kernel_env kernel of ``language``."""
    info = _LANGUAGE_INFO.get(language, {"name": language})
    return {
        "status": "ok",
        "protocol_version": PROTOCOL_VERSION,
        "implementation": "kernel_env",
        "implementation_version": version,
        "language_info": dict(info),
        "banner": f"kernel_env {version}: a sandboxed {language} episode kernel",
        "help_links": [],
    }
