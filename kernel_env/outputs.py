"""Turn the iopub messages of one cell execution into notebook outputs and model-readable text.

This module is pure: it never touches sockets, kernels or event loops. A caller that has
already filtered iopub traffic down to one execution (by parent ``msg_id``) feeds each message
to an :class:`OutputCollector`, then reads back

* ``outputs`` -- nbformat v4 output nodes, built the way nbclient builds them, so they can be
  written into a ``.ipynb`` unchanged;
* ``stdout_text()`` / ``stderr_text()`` -- plain text for a language model, ANSI codes removed;
* ``error`` -- the exception the cell raised, if any.

:func:`truncate` keeps the head and tail of long text so a model sees both how output started
and how it ended.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import nbformat
from nbformat import NotebookNode
from nbformat.v4 import output_from_msg

__all__ = [
    "MAX_STEP_OUTPUTS",
    "MAX_STEP_OUTPUT_CHARS",
    "OutputBudget",
    "OutputCollector",
    "output_size",
    "strip_ansi",
    "truncate",
]

# What one cell's outputs may hold on the host, whatever the kernel sends (the kernel caps
# itself first, but a cell can write to the iopub socket directly).
MAX_STEP_OUTPUTS = 250
MAX_STEP_OUTPUT_CHARS = 12_000_000

# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks) ended by BEL or ST,
# and the remaining two-byte ESC sequences. IPython tracebacks are full of the first kind.
_ANSI_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"
    r"|\x1b[@-Z\\-_]"
)

# nbformat allows any JSON value under application/json and application/*+json; every other
# mime type must hold a string or a list of strings.
_JSON_MIME_RE = re.compile(r"^application/(.*\+)?json$")

_OUTPUT_TYPES = frozenset({"stream", "display_data", "execute_result", "error"})
_DISPLAY_TYPES = frozenset({"display_data", "execute_result"})


def strip_ansi(text: str) -> str:
    """Remove ANSI escape sequences (colours, cursor control, OSC) from ``text``."""
    return _ANSI_RE.sub("", text)


def truncate(text: str, limit: int, *, printed: int | None = None) -> tuple[str, int]:
    """Shorten ``text`` to about ``limit`` chars, keeping its head and tail around a marker.

    ``printed``: how many chars the cell printed, when ``text`` holds only part of them (the
    kernel sends at most its cap); the marker and the count cut then say that size.

    Returns ``(text, cut)``: ``cut`` is 0 when nothing was cut (``limit <= 0`` means no limit)
    and nothing was left unsent. The shortened text is exactly ``limit`` chars of ``text`` plus
    the marker line ``"\\n... (truncated: {cut} of {printed} chars cut) ...\\n"``.
    """
    total = len(text)
    printed = total if printed is None else max(printed, total)
    if limit <= 0 or total <= limit:
        return text, printed - total
    head = (limit + 1) // 2
    tail = limit - head
    cut = printed - limit
    marker = f"\n... (truncated: {cut} of {printed} chars cut) ...\n"
    # Slice the tail by start index: text[-0:] would be the whole string when tail == 0.
    return text[:head] + marker + text[total - tail :], cut


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "" if value is None else str(value)


def _is_multiline_string(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


def _multiline_to_str(value: Any) -> str:
    # nbformat stores text either as one string or as a list of lines that already end in "\n".
    if isinstance(value, list):
        return "".join(_as_str(item) for item in value)
    return _as_str(value)


def _clean_mimebundle(value: Any) -> dict[str, Any]:
    """Copy a mime bundle, dropping entries nbformat's schema would reject."""
    return {
        key: copy.deepcopy(data)
        for key, data in _as_dict(value).items()
        if isinstance(key, str) and (_JSON_MIME_RE.match(key) or _is_multiline_string(data))
    }


def _clean_execution_count(value: Any) -> int | None:
    # bool is an int subclass but not a prompt number.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _clean_content(msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    """Fill in and coerce the fields ``output_from_msg`` needs, so it neither raises a KeyError
    on a sparse message nor a ValidationError on a sloppy one. Copies, never aliases, the
    caller's data: later updates mutate our outputs, not their messages."""
    if msg_type == "stream":
        return {
            "name": _as_str(content.get("name")) or "stdout",
            "text": _as_str(content.get("text")),
        }
    if msg_type == "error":
        traceback = content.get("traceback")
        return {
            "ename": _as_str(content.get("ename")),
            "evalue": _as_str(content.get("evalue")),
            "traceback": [_as_str(line) for line in traceback]
            if isinstance(traceback, list)
            else [],
        }
    return {
        "data": _clean_mimebundle(content.get("data")),
        "metadata": copy.deepcopy(_as_dict(content.get("metadata"))),
        "execution_count": _clean_execution_count(content.get("execution_count")),
    }


def _build_output(msg_type: str, content: dict[str, Any]) -> NotebookNode | None:
    fields = _clean_content(msg_type, content)
    if msg_type in ("stream", "error"):
        # Cleaned, these are valid by construction (strings, a list of strings): the node is
        # what output_from_msg makes, without its schema check (nearly all the time it takes),
        # which the rich outputs below still get.
        return NotebookNode(output_type=msg_type, **fields)
    clean = {"header": {"msg_type": msg_type}, "content": fields}
    try:
        out = output_from_msg(clean)
    except (ValueError, nbformat.ValidationError):
        # Cleaning should make this unreachable; dropping one output beats crashing an episode.
        return None
    # output_from_msg leaves nested dicts plain; make the whole node attribute-accessible.
    return nbformat.from_dict(out)


def _display_id(content: dict[str, Any]) -> str | None:
    # transient may be present but null, so .get("transient", {}) is not enough.
    display_id = _as_dict(content.get("transient")).get("display_id")
    return display_id if isinstance(display_id, str) and display_id else None


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _display_text(output: NotebookNode) -> str:
    """What a model should read for a rich output: its text/plain, else a list of its mimes."""
    data = output.get("data", {})
    if "text/plain" in data:
        return _with_newline(_multiline_to_str(data["text/plain"]))
    mimes = ", ".join(data) or "no data"
    return f"<{output['output_type']}: {mimes}>\n"


def _error_text(output: NotebookNode) -> str:
    traceback = output.get("traceback") or []
    text = "\n".join(traceback) if traceback else f"{output.get('ename')}: {output.get('evalue')}"
    return _with_newline(text)


def output_size(output: dict[str, Any]) -> int:
    """Chars an output holds: its text, or the sum of its mime bundle's values."""
    kind = output.get("output_type")
    if kind == "stream":
        return len(_multiline_to_str(output.get("text")))
    if kind == "error":
        return sum(len(_as_str(line)) for line in output.get("traceback") or []) + len(
            _as_str(output.get("evalue"))
        )
    return sum(
        len(_multiline_to_str(v)) if _is_multiline_string(v) else len(str(v))
        for v in _as_dict(output.get("data")).values()
    )


class OutputBudget:
    """At most ``max_outputs`` outputs and ``max_chars`` chars of them; what does not fit is
    counted, and :meth:`marker` is the output that says so (None when nothing was dropped).
    Used per step (here, and by the kernel for itself) and per episode (the environment)."""

    def __init__(self, max_outputs: int, max_chars: int, scope: str = "step") -> None:
        self.max_outputs = max_outputs
        self.max_chars = max_chars
        self.scope = scope
        self.outputs = self.chars = self.dropped = self.dropped_chars = 0

    def admit(self, size: int, *, new_output: bool = True) -> bool:
        if self.outputs + new_output <= self.max_outputs and self.chars + size <= self.max_chars:
            self.outputs += new_output
            self.chars += size
            return True
        self.dropped += 1
        self.dropped_chars += size
        return False

    def keep(self, outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The outputs that fit, then a marker for those of this call that did not."""
        dropped, dropped_chars = self.dropped, self.dropped_chars
        kept = [o for o in outputs if self.admit(output_size(o))]
        if self.dropped == dropped:
            return kept
        marker = self._marker(self.dropped - dropped, self.dropped_chars - dropped_chars)
        return [*kept, dict(marker)]

    def marker(self) -> NotebookNode | None:
        return self._marker(self.dropped, self.dropped_chars) if self.dropped else None

    def _marker(self, dropped: int, chars: int) -> NotebookNode:
        text = (
            f"[kernel_env: {dropped} output(s) ({chars:,} chars) dropped: over the "
            f"{self.scope}'s limit of {self.max_outputs} outputs and {self.max_chars:,} chars]\n"
        )
        return nbformat.from_dict({"output_type": "stream", "name": "stderr", "text": text})


class OutputCollector:
    """Collects one execution's iopub messages (already filtered to its parent msg_id).

    Mirrors nbclient's handling of outputs, display ids and ``clear_output``, and additionally
    merges consecutive same-name stream outputs as Jupyter front ends do, so a loop of
    ``print`` calls yields one stdout output instead of hundreds.
    """

    def __init__(
        self, max_outputs: int = MAX_STEP_OUTPUTS, max_chars: int = MAX_STEP_OUTPUT_CHARS
    ) -> None:
        self.budget = OutputBudget(max_outputs, max_chars)
        self._outputs: list[NotebookNode] = []
        # display_id -> indices into self._outputs of the outputs that carry it.
        self._display_ids: dict[str, list[int]] = {}
        self._clear_before_next_output = False

    def feed(self, msg: dict[str, Any]) -> None:
        """Apply one iopub message. Unknown, irrelevant or malformed messages are ignored."""
        if not isinstance(msg, dict):
            return
        msg_type = _as_dict(msg.get("header")).get("msg_type")
        if not isinstance(msg_type, str):
            return
        content = _as_dict(msg.get("content"))
        if msg_type == "clear_output":
            self._clear_output(wait=bool(content.get("wait")))
        elif msg_type == "update_display_data":
            self._update_display(content)
        elif msg_type in _OUTPUT_TYPES:
            self._add_output(msg_type, content)

    @property
    def outputs(self) -> list[NotebookNode]:
        """The nbformat v4 outputs so far, in order (a new list; the nodes themselves are live),
        ending with a marker when some did not fit in the step's budget."""
        marker = self.budget.marker()
        return [*self._outputs, marker] if marker is not None else list(self._outputs)

    @property
    def error(self) -> dict[str, Any] | None:
        """``{"ename", "evalue", "traceback"}`` of the last error output, or None."""
        for output in reversed(self._outputs):
            if output.get("output_type") == "error":
                return {
                    "ename": output.get("ename", ""),
                    "evalue": output.get("evalue", ""),
                    "traceback": list(output.get("traceback", [])),
                }
        return None

    def stdout_text(self) -> str:
        """stdout streams, execute_result text and display_data text (or a mime-type
        placeholder) in output order, ANSI-stripped: what a person would have seen."""
        pieces: list[str] = []
        for output in self.outputs:
            output_type = output.get("output_type")
            if output_type == "stream" and output.get("name") == "stdout":
                pieces.append(_multiline_to_str(output.get("text")))
            elif output_type in _DISPLAY_TYPES:
                pieces.append(_display_text(output))
        return strip_ansi("".join(pieces))

    def stderr_text(self) -> str:
        """stderr streams and error tracebacks in output order, ANSI-stripped."""
        pieces: list[str] = []
        for output in self.outputs:
            output_type = output.get("output_type")
            if output_type == "stream" and output.get("name") == "stderr":
                pieces.append(_multiline_to_str(output.get("text")))
            elif output_type == "error":
                pieces.append(_error_text(output))
        return strip_ansi("".join(pieces))

    def _clear_output(self, *, wait: bool) -> None:
        if wait:
            # clear_output(wait=True) is how progress bars avoid flicker: the old output stays
            # until its replacement arrives, and stays for good if none does.
            self._clear_before_next_output = True
        else:
            self._clear_now()

    def _clear_now(self) -> None:
        # What was cleared no longer takes room: a progress bar may redraw forever.
        self.budget.outputs = self.budget.chars = 0
        self._outputs.clear()
        self._display_ids.clear()
        self._clear_before_next_output = False

    def _add_output(self, msg_type: str, content: dict[str, Any]) -> None:
        output = _build_output(msg_type, content)
        if output is None:
            return
        merges = msg_type == "stream" and self._mergeable(output)
        if not self.budget.admit(output_size(output), new_output=not merges):
            return
        display_id = _display_id(content) if msg_type in _DISPLAY_TYPES else None
        if display_id is not None:
            # As in nbclient, re-displaying with a known display_id also refreshes the earlier
            # outputs that share it (before any deferred clear can remove them).
            self._refresh_display(display_id, output)
        if self._clear_before_next_output:
            self._clear_now()
        if msg_type == "stream" and self._merge_stream(output):
            return
        if display_id is not None:
            self._display_ids.setdefault(display_id, []).append(len(self._outputs))
        self._outputs.append(output)

    def _mergeable(self, output: NotebookNode) -> bool:
        if not self._outputs or self._clear_before_next_output:
            return False
        last = self._outputs[-1]
        return last.get("output_type") == "stream" and last.get("name") == output.name

    def _merge_stream(self, output: NotebookNode) -> bool:
        """Append ``output``'s text to the last output if that is the same stream."""
        if not self._mergeable(output):
            return False
        last = self._outputs[-1]
        last.text = _multiline_to_str(last.get("text")) + output.text
        return True

    def _update_display(self, content: dict[str, Any]) -> None:
        display_id = _display_id(content)
        if display_id is None or display_id not in self._display_ids:
            return
        # Build through output_from_msg so the update gets the same cleaning as a new output.
        update = _build_output("display_data", content)
        # An update replaces data in place: it is charged like a new output (without taking
        # a place), so a loop of updates cannot grow the step without bound.
        if update is not None and self.budget.admit(output_size(update), new_output=False):
            self._refresh_display(display_id, update)

    def _refresh_display(self, display_id: str, source: NotebookNode) -> None:
        for index in self._display_ids.get(display_id, []):
            # Separate copies so that mutating one output never silently changes another.
            self._outputs[index].data = copy.deepcopy(source.data)
            self._outputs[index].metadata = copy.deepcopy(source.metadata)
