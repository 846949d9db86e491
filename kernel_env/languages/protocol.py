"""The host <-> kernel helper protocol of every non-Python kernel, defined once.

Requests travel on the Jupyter stdin channel, as Python's do (``kernel_env.kernel_side``):
the kernel's shim asks for a line of input whose prompt is :data:`REQUEST_TAG` followed by a
JSON request ``{"op": "llm_query" | "llm_query_batched", "args": {...}}``; the host
(:class:`kernel_env.hostcalls.HostCalls`) answers with the JSON reply ``{"ok": true,
"result": ...}`` or ``{"ok": false, "error": "..."}``. The tag has no NUL (Python's has one):
neither an R nor a Bash string can hold one.

A final answer is a display: ``FINAL(x)`` publishes ``{"answer": "<x as text>"}`` under
:data:`FINAL_MIME` (with a ``text/plain`` line the model reads), so any kernel that can send
a ``display_data`` can end its episode; the host finds it with :func:`final_from_outputs`.

Readiness: the host's stdin probe answers with :data:`PROBE_REPLY`; a shim that reads it
asks again (a spare probe answer may still be queued when the first cell asks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["FINAL_MIME", "PROBE_REPLY", "REQUEST_TAG", "final_from_outputs"]

REQUEST_TAG = "kernel_env/1:"
PROBE_REPLY = "kernel_env/probe"
FINAL_MIME = "application/vnd.kernel-env.final+json"


def final_from_outputs(outputs: Iterable[Any]) -> str | None:
    """The answer of the first final-answer display among a cell's nbformat outputs."""
    for output in outputs:
        if output.get("output_type") not in ("display_data", "execute_result"):
            continue
        data = (output.get("data") or {}).get(FINAL_MIME)
        if isinstance(data, dict) and "answer" in data:
            answer = data["answer"]
            if isinstance(answer, list):  # R's jsonlite may box a scalar
                answer = answer[0] if len(answer) == 1 else answer
            return answer if isinstance(answer, str) else str(answer)
    return None
