"""E2B's Connect protocol as a raw client sees it: envelopes, and a command's stream held
open (or dropped unread) by the test."""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx

ENVD = "49983"


def envelope(message: dict[str, Any]) -> bytes:
    """``message`` as one Connect envelope (JSON, no flags)."""
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def frames(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    """The Connect envelopes in ``data`` (flags, message), complete ones only."""
    found = []
    while len(data) >= 5:
        flags, size = struct.unpack(">BI", data[:5])
        if len(data) < 5 + size:
            break
        found.append((flags, json.loads(data[5 : 5 + size])))
        data = data[5 + size :]
    return found


@contextlib.contextmanager
def command_stream(
    client: httpx.Client, url: str, sandbox: dict[str, Any], command: str
) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    """``process.Process/Start`` of ``bash -c command``, open, once its first event (the start,
    or a refusal) came; the frames read so far. Leaving closes the connection unread."""
    headers = {
        "E2b-Sandbox-Id": sandbox["sandboxID"],
        "E2b-Sandbox-Port": ENVD,
        "X-Access-Token": sandbox["envdAccessToken"],
        "Content-Type": "application/connect+json",
    }
    body = envelope({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}})
    with client.stream(
        "POST", f"{url}/process.Process/Start", content=body, headers=headers
    ) as response:
        assert response.status_code == 200, response.read()
        # One iterator, kept: leaving a loop over iter_raw() would close the connection.
        chunks, read = response.iter_raw(), b""
        while not frames(read):
            read += next(chunks)
        yield frames(read)
