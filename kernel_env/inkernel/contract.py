"""What the host and the code in a kernel agree on, defined once: the contract between them.

Both sides import this module, and nothing else of each other: the host (the driver, the
episode, the doors) reaches in-kernel code only through the names here, and the kernel's
code (:mod:`kernel_env.inkernel`) takes its tags and keys from here. Standard library only,
with no import of kernel_env: a gateway's kernel that lacks the package is sent this source
with the extension's (:mod:`kernel_env.kernel.gateway`).

**Where in-kernel code lives**, by module name (the host names them in flags, argv and
expressions; the kernel imports them): :data:`EXTENSION_MODULE` and :data:`TUNING_MODULE`
(an episode kernel's two IPython extensions), :data:`ENVD_MODULE` (E2B's file and process
operations), :data:`DSPY_MODULE` (DSPy's tools and ``SUBMIT``), :data:`BASH_KERNEL_MODULE`
(the bash kernel), :data:`LIVE_FORK_MODULE` (a live fork, from inside the kernel), and the
folder of other languages' helpers, :data:`SHIMS`.

**Python's helpers.** ``llm_query`` & co. ask the host over the Jupyter stdin channel: an
``input_request`` whose prompt is :data:`REQUEST_TAG` followed by a JSON request ``{"op":
..., "args": {...}}``; the host (:class:`kernel_env.hostcalls.HostCalls`) answers with the
JSON reply ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``. The host's
readiness probe of stdin answers :data:`PROBE_REPLY`, never a reply to a request: a helper
that reads it asks again. A kernel no kernel_env host drives over stdin (one a plain Jupyter
frontend started through kernel_env's provisioner) asks over the UNIX socket its environment
names in :data:`CALL_SOCKET_ENV` instead: one connection a request, the same request text and
a newline one way, the reply and a newline back. An episode's setup rides on an
``execute_request``'s metadata under :data:`SETUP_METADATA`; after each cell the host reads
the episode's state through the request's ``user_expressions``: :data:`STATE_EXPRESSION`.

**Other languages' helpers** (the shims) use the same requests under
:data:`LANGUAGE_REQUEST_TAG` and :data:`LANGUAGE_PROBE_REPLY`, which have no NUL (neither an
R nor a Bash string can hold one). A final answer is a display: ``FINAL(x)`` publishes
``{"answer": "<x as text>"}`` under :data:`FINAL_MIME`; the host finds it with
:func:`final_from_outputs`.

**DSPy's tools** ask with :data:`DSPY_TOOL_TAG` followed by JSON ``{"name", "args",
"kwargs"}``; the host replies ``{"ok": true, "value": ...}`` or ``{"ok": false, "error":
...}``. After each cell the host reads :data:`DSPY_OUTCOME_EXPRESSION`.

**Replay.** An exported notebook's recorded ``llm_query`` answers are matched to prompts by
:func:`take_recorded`, in the kernel and on the host alike; a step that timed out or killed
its kernel is exported under the cell magic :data:`RECORDED_MAGIC`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "BASH_KERNEL_MODULE",
    "CALL_SOCKET_ENV",
    "DEFAULT_DISPLAY_CHARS",
    "DEFAULT_DISPLAY_COUNT",
    "DEFAULT_OUTPUT_CAP",
    "DSPY_MODULE",
    "DSPY_MODULE_EXPRESSION",
    "DSPY_OUTCOME_EXPRESSION",
    "DSPY_TOOL_TAG",
    "ENVD_MODULE",
    "EXTENSION",
    "EXTENSION_MODULE",
    "FINAL_MIME",
    "LANGUAGE_PROBE_REPLY",
    "LANGUAGE_REQUEST_TAG",
    "LIVE_FORK_MODULE",
    "MERGE_PAGES_ENV",
    "PROBE_REPLY",
    "RECORDED_MAGIC",
    "REQUEST_TAG",
    "SETUP_METADATA",
    "SHIMS",
    "STATE_EXPRESSION",
    "TUNING_MODULE",
    "failure_text",
    "final_from_outputs",
    "recorded_failure",
    "recorded_pair",
    "take_recorded",
    "unsent_marker",
]

# -- where in-kernel code lives ------------------------------------------------------------

EXTENSION_MODULE = "kernel_env.inkernel.extension"
TUNING_MODULE = "kernel_env.inkernel.tuning"
ENVD_MODULE = "kernel_env.inkernel.envd"
DSPY_MODULE = "kernel_env.inkernel.dspy"
BASH_KERNEL_MODULE = "kernel_env.inkernel.bash_kernel"
LIVE_FORK_MODULE = "kernel_env.kernel.fork.live"
SHIMS = Path(__file__).with_name("shims")  # each language's helpers, sent or sourced

# -- Python's helpers ----------------------------------------------------------------------

REQUEST_TAG = "\x00kernel_env/1:"
PROBE_REPLY = "\x00kernel_env/probe"
SETUP_METADATA = "kernel_env.setup"
CALL_SOCKET_ENV = "KERNEL_ENV_CALL_SOCKET"  # the socket a provisioned kernel's helpers ask on
# "1" in a kernel's environment: it offers its memory to the Linux kernel's same-page merging
# (KSM) as it starts (kernel_env.inkernel.tuning; a server's --merge-pages).
MERGE_PAGES_ENV = "KERNEL_ENV_MERGE_PAGES"
# The extension in the kernel, and the episode's state after every cell.
EXTENSION = f"__import__('sys').modules[{EXTENSION_MODULE!r}]"
STATE_EXPRESSION = f"{EXTENSION}.state()"

DEFAULT_OUTPUT_CAP = 1_000_000  # chars per stream per cell that cross the wire
# Rich outputs (display(), publish_display_data) a cell may send: how many, and their chars.
DEFAULT_DISPLAY_COUNT = 200
DEFAULT_DISPLAY_CHARS = 8_000_000


def unsent_marker(count: int) -> str:
    """The line an over-cap stream carries where ``count`` chars were not sent (the host
    reads it back to report the printed size)."""
    return f"\n... (kernel_env: {count} chars not sent from the kernel) ...\n"


# -- other languages' helpers --------------------------------------------------------------

LANGUAGE_REQUEST_TAG = "kernel_env/1:"
LANGUAGE_PROBE_REPLY = "kernel_env/probe"
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


# -- DSPy's tools --------------------------------------------------------------------------

DSPY_TOOL_TAG = "\x00kernel_env/dspy-tool:"
# The module in the kernel, imported again if a cell removed it from sys.modules.
DSPY_MODULE_EXPRESSION = f"__import__('importlib').import_module({DSPY_MODULE!r})"
# Whether SUBMIT ran, and with what; else the value of the cell's bare last expression.
DSPY_OUTCOME_EXPRESSION = f"{DSPY_MODULE_EXPRESSION}.outcome()"

# -- replay --------------------------------------------------------------------------------

RECORDED_MAGIC = "%%kernel_env_recorded"


def take_recorded(pairs: list[Any], prompt: str) -> Any:
    """The response recorded for ``prompt``, taken out of ``pairs`` (``(prompt, response)``
    pairs, as tuples or JSON lists, in call order), or None. Matched by prompt, first unused
    first: a batch's calls completed in any order. A failed call's response is its failure
    (:func:`recorded_failure`)."""
    for i, (recorded_prompt, response) in enumerate(pairs):
        if recorded_prompt == prompt:
            del pairs[i]
            return response
    return None


def recorded_pair(prompt: str, response: str, *, error: bool) -> list[Any]:
    """A recorded call as a replay takes it: ``[prompt, response]``, or for a call that
    failed ``[prompt, {"error": message}]``, so that its replay fails the same way."""
    return [prompt, {"error": response} if error else response]


def recorded_failure(response: Any) -> str | None:
    """The message of a recorded failed call (see :func:`recorded_pair`), or None."""
    if isinstance(response, dict):
        return str(response.get("error"))
    return None


def failure_text(message: str, *, batched: bool) -> str:
    """What a failed call shows the kernel: a batch's answer in the failed prompt's place,
    or the error a single call raises (the host's ``RuntimeError``)."""
    return f"Error: {message}" if batched else f"RuntimeError: {message}"
