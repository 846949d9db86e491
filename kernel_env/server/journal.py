"""A running episode's journal: one JSON line per completed step, appended as the step ends.

The episode store (:mod:`.store`) keeps a running episode as its journal, not as a notebook:
a step costs one ``write`` of one line to a file opened ``O_APPEND`` (rebuilding and
rewriting the whole notebook after each step cost more the longer the episode ran). The
notebook is rendered from the journal when it is read, and written once, when the episode
ends. There is no fsync: what the store promises is that a server killed (``kill -9``) loses
no completed step, and a killed process's writes are in the page cache, which outlives it.

Its lines, each a JSON object on one line:

- ``{"episode": {...}}``, the first: the record's fields but its steps, as its reset (or a
  fork's copy) left them;
- ``{"step": {...}, "outcome": {...}}``: a completed step, and the episode's outcome after it
  (reward, final answer, done, usage, forks);
- ``{"outcome": {...}}``: the outcome as the episode ended (a fork made after its last step).

A line that cannot be read (the last one, torn by a kill in the middle of its ``write``) is
skipped and counted in :attr:`Replayed.unreadable`, never raised; only a journal whose first
line cannot be read has no episode to give (:class:`~kernel_env.errors.StoredEpisodeError`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from kernel_env.errors import StoredEpisodeError
from kernel_env.hostcalls import LLMCall
from kernel_env.record import EpisodeRecord, StepRecord

__all__ = [
    "Journal",
    "Replayed",
    "decode_record",
    "encode_record",
    "header_line",
    "journal_path",
    "outcome_line",
    "read_journal",
    "step_line",
]

_OUTCOME = ("final_answer", "reward", "done", "llm_usage", "forks", "language_info")
_RECORD_FIELDS = tuple(f.name for f in fields(EpisodeRecord) if f.name != "steps")
_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
_CALL_FIELDS = tuple(f.name for f in fields(LLMCall))


def journal_path(notebook: Path) -> Path:
    """The journal beside the notebook it renders to."""
    return notebook.with_name(f"{notebook.stem}.journal.jsonl")


# -- records as plain JSON data ------------------------------------------------------------


def encode_record(record: EpisodeRecord) -> dict[str, Any]:
    """The whole record, steps and ``rlm_query`` children included, as JSON data."""
    data = {name: getattr(record, name) for name in _RECORD_FIELDS}
    data["steps"] = [_encode_step(step) for step in record.steps]
    return data


def decode_record(data: dict[str, Any]) -> EpisodeRecord:
    """The record :func:`encode_record` gave; a TypeError or ValueError if it is not one."""
    steps = [_decode_step(step) for step in data.get("steps", [])]
    return EpisodeRecord(**{k: v for k, v in data.items() if k != "steps"}, steps=steps)


def _encode_step(step: StepRecord) -> dict[str, Any]:
    data = {name: getattr(step, name) for name in _STEP_FIELDS}
    data["started"] = step.started.isoformat()
    data["finished"] = step.finished.isoformat()
    data["llm_calls"] = [_encode_call(call) for call in step.llm_calls]
    return data


def _encode_call(call: LLMCall) -> dict[str, Any]:
    data = {name: getattr(call, name) for name in _CALL_FIELDS}
    data["children"] = [encode_record(child) for child in call.children]
    return data


def _decode_step(data: dict[str, Any]) -> StepRecord:
    calls = [
        LLMCall(**{**c, "children": [decode_record(r) for r in c.get("children", [])]})
        for c in data.get("llm_calls", [])
    ]
    return StepRecord(
        **{
            **data,
            "started": datetime.fromisoformat(data["started"]),
            "finished": datetime.fromisoformat(data["finished"]),
            "llm_calls": calls,
        }
    )


# -- lines -----------------------------------------------------------------------------------


def _line(data: dict[str, Any]) -> bytes:
    # ensure_ascii: a line is then pure ASCII, and no character of it is ever cut in two.
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def header_line(record: EpisodeRecord) -> bytes:
    return _line({"episode": {name: getattr(record, name) for name in _RECORD_FIELDS}})


def step_line(step: StepRecord, record: EpisodeRecord) -> bytes:
    return _line({"step": _encode_step(step), "outcome": _outcome(record)})


def outcome_line(record: EpisodeRecord) -> bytes:
    return _line({"outcome": _outcome(record)})


def _outcome(record: EpisodeRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in _OUTCOME}


# -- writing and reading -------------------------------------------------------------------


class Journal:
    """A journal open for appending (owner-only: a store holds every tenant's episodes)."""

    def __init__(self, path: Path, first: bytes) -> None:
        self.path = path
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600)
        self._torn = False  # the last append failed: part of it may be in the file
        self.append(first)

    def append(self, data: bytes) -> None:
        """``data``, whole lines; after a failed append, on a line of their own (the part of
        the failed one stays behind, a line that is skipped when read)."""
        view = memoryview(b"\n" + data if self._torn else data)
        self._torn = True
        while view:  # a regular file writes it whole but for a full disk or a signal
            view = view[os.write(self._fd, view) :]
        self._torn = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class Replayed:
    """A journal read back: the episode as of its last readable line."""

    record: EpisodeRecord
    unreadable: int  # lines skipped: a torn last line, or a corrupt one


def read_journal(path: Path) -> Replayed:
    """The episode a journal holds; OSError if it cannot be read, StoredEpisodeError if its
    first line is not an episode's."""
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the newline that ends the last whole line
    try:
        record = EpisodeRecord(**json.loads(lines[0])["episode"])
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise StoredEpisodeError(f"the journal {path.name} has no episode: {exc}") from None
    unreadable = 0
    for line in lines[1:]:
        if not line:
            continue  # an append after a failed one begins with a newline
        try:
            entry = json.loads(line)
            step = _decode_step(entry["step"]) if "step" in entry else None
            outcome = {k: entry["outcome"][k] for k in _OUTCOME}
        except (KeyError, TypeError, ValueError):
            unreadable += 1
            continue
        if step is not None:
            record.steps.append(step)
        for name, value in outcome.items():
            setattr(record, name, value)
    return Replayed(record, unreadable)
