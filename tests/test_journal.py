"""A running episode's journal (kernel_env.server.journal): the lines read back give the
same record, and so the same notebook; a torn or corrupt line is skipped and counted, never
raised."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kernel_env import KernelEnv
from kernel_env.errors import StoredEpisodeError
from kernel_env.hostcalls import LLMCall
from kernel_env.notebook import notebook_text
from kernel_env.record import EpisodeRecord, StepRecord
from kernel_env.server.journal import (
    Journal,
    decode_record,
    encode_record,
    header_line,
    journal_path,
    outcome_line,
    read_journal,
    step_line,
)

T0 = datetime(2026, 12, 2, 1, 2, 3, 456789, tzinfo=UTC)


def _step(index: int, code: str, **more: object) -> StepRecord:
    fields: dict[str, object] = {
        "index": index,
        "code": code,
        "outputs": [{"output_type": "stream", "name": "stdout", "text": f"{index} é\n"}],
        "execution_count": index,
        "started": T0 + timedelta(seconds=index),
        "finished": T0 + timedelta(seconds=index, milliseconds=3),
        "duration": 0.003,
        "status": "ok",
    }
    return StepRecord(**(fields | more))  # type: ignore[arg-type]


def _record() -> EpisodeRecord:
    child = EpisodeRecord("child-1", "six times seven?", "", 4, depth=1)
    child.steps.append(_step(1, "FINAL(6 * 7)", status="final", final_answer="42"))
    child.final_answer, child.reward, child.done = "42", None, True
    call = LLMCall("rlm_query", "six times seven?", "42", "m", 0.5, children=[child])
    record = EpisodeRecord("ep-1", "the task", "the context", 10, expected_answer="42")
    record.language_info = {"name": "python", "version": "3.11"}
    record.steps += [_step(1, "x = 1"), _step(2, "rlm_query('...')", llm_calls=[call])]
    record.llm_usage = {"calls": 1, "input_tokens": 10}
    return record


def _notebook(record: EpisodeRecord) -> dict[str, object]:
    """Its notebook, but the cells' ids (random, each time one is built)."""
    nb: dict[str, object] = json.loads(notebook_text(record, "ep-1.ipynb"))
    for cell in nb["cells"]:  # type: ignore[attr-defined]
        del cell["id"]
    return nb


def _journal(tmp_path: Path, record: EpisodeRecord) -> Path:
    path = journal_path(tmp_path / "ep-1.ipynb")
    start = EpisodeRecord(**{**vars(record), "steps": []})
    journal = Journal(path, header_line(start))
    for n in range(1, len(record.steps) + 1):
        upto = EpisodeRecord(**{**vars(record), "steps": record.steps[:n]})
        journal.append(step_line(record.steps[n - 1], upto))
    journal.close()
    return path


def test_a_record_read_back_from_its_journal_is_the_same_record(tmp_path: Path) -> None:
    """Steps, timestamps, LLM calls and rlm_query children survive JSON: the record read
    back equals the one written, and so does its notebook."""
    record = _record()
    assert decode_record(json.loads(json.dumps(encode_record(record)))) == record
    replayed = read_journal(_journal(tmp_path, record))
    assert replayed.unreadable == 0
    assert replayed.record == record
    assert _notebook(replayed.record) == _notebook(record)


def test_the_last_outcome_line_wins(tmp_path: Path) -> None:
    """The outcome as the episode ended (a fork made after its last step) is read back."""
    record = _record()
    path = _journal(tmp_path, record)
    record.forks.append("fork-1")
    record.done, record.reward = True, 1.0
    with open(path, "ab") as f:
        f.write(outcome_line(record))
    assert read_journal(path).record == record


def test_a_torn_last_line_and_a_corrupt_one_are_skipped_and_counted(tmp_path: Path) -> None:
    """A kill in the middle of a write leaves half a line: the steps before it are read, the
    half line counted; so is a line of garbage among them. No first line: no episode."""
    record = _record()
    path = _journal(tmp_path, record)
    lines = path.read_bytes().splitlines(keepends=True)
    half = step_line(_step(3, "print('three')"), record)[:40]
    path.write_bytes(lines[0] + lines[1] + b"\x00garbage{\n" + lines[2] + half)
    replayed = read_journal(path)
    assert replayed.unreadable == 2
    assert replayed.record == record
    path.write_bytes(half)
    with pytest.raises(StoredEpisodeError, match="has no episode"):
        read_journal(path)
    path.write_bytes(b"")
    with pytest.raises(StoredEpisodeError, match="has no episode"):
        read_journal(path)


def test_an_append_after_a_failed_one_starts_a_line_of_its_own(tmp_path: Path) -> None:
    """A write that failed part way (a full disk) leaves half a line: the next append begins
    on a new line, so only the failed one is lost, and is counted."""
    record = _record()
    path = journal_path(tmp_path / "ep-1.ipynb")
    first = EpisodeRecord(**{**vars(record), "steps": record.steps[:1]})
    journal = Journal(path, header_line(first) + step_line(record.steps[0], first))
    os.close(journal._fd)
    journal._fd = os.open(path, os.O_RDONLY)  # every write now fails, as on a full disk
    with pytest.raises(OSError):
        journal.append(step_line(record.steps[1], record))
    os.close(journal._fd)
    journal._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    with open(path, "ab") as f:
        f.write(step_line(record.steps[1], record)[:25])  # what the failed write got out
    journal.append(step_line(record.steps[1], record))
    journal.close()
    replayed = read_journal(path)
    assert (replayed.record, replayed.unreadable) == (record, 1)


@pytest.mark.integration
def test_a_real_episode_renders_the_same_notebook_from_its_journal(tmp_path: Path) -> None:
    """A kernel's outputs (a stream, an error, an image, a display, a final answer) and its
    llm_query calls, journaled step by step as the store does: the same notebook."""
    env = KernelEnv(llm_query_fn=lambda p: f"answer to {p!r}")
    try:
        env.reset(context="one two three", task_prompt="count", expected_answer="3")
        assert env.environment is not None and env.environment.record is not None
        record = env.environment.record
        journal = Journal(journal_path(tmp_path / "e.ipynb"), header_line(record))
        for code in [
            "print(len(context.split()))",
            "1 / 0",
            "from IPython.display import HTML, display\ndisplay(HTML('<b>x</b>'))\n{'a': 1}",
            "print(llm_query('hi'))",
            "FINAL(3)",
        ]:
            env.execute(code)
            journal.append(step_line(record.steps[-1], record))
        journal.append(outcome_line(record))
        journal.close()
        replayed = read_journal(journal.path)
        assert replayed.unreadable == 0 and replayed.record.done
        assert _notebook(replayed.record) == _notebook(record)
    finally:
        env.close()
