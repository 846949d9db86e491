"""Stored episodes as a Hugging Face dataset (``kernel-env episodes dataset OUT``).

A dataset is a directory that ``datasets.load_dataset`` reads as it is, or as JSON::

    OUT/episodes.jsonl    a row per episode, a line of JSON each, in the listing's order
    OUT/README.md         its dataset card: what a row holds (the Hub reads its YAML header)

A row is built from what the store answers for an episode, a store directory's or a
server's alike: its listing row (``GET /episodes``) and its notebook (``GET
/episodes/{id}/notebook``), whose metadata has the whole task and whose code cells are the
steps. A row has no tenant, session id or store path, and no secret reaches it: the index
and the notebook keep none (``hf_token`` is not part of an episode's record).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import nbformat
from nbformat import NotebookNode

from kernel_env.inkernel.contract import RECORDED_MAGIC
from kernel_env.notebook import recorded_steps

__all__ = ["CARD_NAME", "DATA_NAME", "DatasetWriter", "episode_row", "step_row"]

DATA_NAME = "episodes.jsonl"
CARD_NAME = "README.md"

_CARD = """\
---
configs:
- config_name: default
  data_files: {data}
---

# kernel_env episodes

Episodes a kernel_env server kept, a row per episode (`{data}`, JSON Lines), written by
`kernel-env episodes dataset`. Load them with:

```python
from datasets import load_dataset

episodes = load_dataset("json", data_files="{data}", split="train")
solved = episodes.filter(lambda row: (row["reward"] or 0) > 0)
```

A row: `episode_id`, `parent` and `relation` (an rlm_query `child` or a `fork` of that
episode), `task_prompt`, `kernel`, `llm_model`, `expected_answer`, `final_answer`, `reward`,
`done`, `status` (`done`, `interrupted`, `running`), `reason`, `iterations`, `started` and
`ended` (seconds since 1970), `context_length`, and `steps`: each step's `step`, `code`,
`stdout`, `stderr`, `error` (`Name: value`, or empty), `status` (`ok`, `error`, `timeout`,
`died`), `success`, `author` (`agent`, or `jupyter` for a person's cell) and `llm_calls`
(`op`, `prompt`, `response`).
"""


def step_row(cell: NotebookNode) -> dict[str, Any]:
    """One step of a row: a code cell of the episode's notebook, its outputs as text."""
    meta = cell.metadata.get("kernel_env", {})
    code = cell.source
    if code.startswith(RECORDED_MAGIC):
        code = code.partition("\n")[2]  # the export's mark of a cell not to re-run
    streams = {"stdout": "", "stderr": ""}
    errors = []
    for output in cell.outputs:
        if output.output_type == "stream" and output.name in streams:
            streams[output.name] += output.text
        elif output.output_type == "error":
            errors.append(f"{output.ename}: {output.evalue}")
    status = meta.get("status", "error" if errors else "ok")
    return {
        "step": meta.get("step"),
        "code": code,
        **streams,
        "error": "\n".join(errors),
        "status": status,
        "success": status == "ok",
        "author": meta.get("author", "agent"),
        "llm_calls": [
            {"op": c.get("op"), "prompt": c.get("prompt"), "response": c.get("response")}
            for c in meta.get("llm_calls", [])
        ],
    }


def episode_row(listed: Mapping[str, Any], notebook: bytes | str) -> dict[str, Any]:
    """The dataset's row of an episode: ``listed``, its row in a listing, and the bytes of
    its stored notebook."""
    nb = nbformat.reads(notebook, as_version=4)
    meta = nb.metadata.get("kernel_env", {})
    steps = [step_row(cell) for cell in recorded_steps(nb)]
    return {
        "episode_id": listed["episode_id"],
        "parent": listed.get("parent"),
        "relation": listed.get("relation"),
        "task_prompt": meta.get("task_prompt", listed.get("task")),
        "kernel": listed.get("kernel") or meta.get("kernel_name"),
        "llm_model": meta.get("llm_model"),
        "expected_answer": meta.get("expected_answer"),
        "final_answer": listed.get("final_answer"),
        "reward": None if listed.get("reward") is None else float(listed["reward"]),
        "done": bool(listed.get("done")),
        "status": listed.get("state"),
        "reason": listed.get("reason"),
        "iterations": sum(step["author"] == "agent" for step in steps),
        "started": listed.get("started"),
        "ended": listed.get("ended"),
        "context_length": meta.get("context_length"),
        "steps": steps,
    }


class DatasetWriter:
    """Writes a dataset directory a row at a time; the rows file appears whole when the
    writer closes without an error (a temporary file until then), and not at all otherwise::

        with DatasetWriter(Path("out")) as dataset:
            dataset.write(episode_row(listed, notebook))
    """

    def __init__(self, directory: Path, *, overwrite: bool = False) -> None:
        self.directory = directory
        self.path = directory / DATA_NAME
        there = [p for p in (self.path, directory / CARD_NAME) if p.exists()]
        if there and not overwrite:
            raise FileExistsError(f"{there[0]} exists; add --overwrite to replace it")
        self.rows = 0
        self._temporary = directory / f".{DATA_NAME}.{secrets.token_hex(4)}.tmp"
        self._file: IO[str] | None = None

    def __enter__(self) -> DatasetWriter:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = self._temporary.open("x", encoding="utf-8")
        return self

    def write(self, row: Mapping[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError("DatasetWriter.write outside its with block")
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        try:
            with file:
                file.flush()
                os.fsync(file.fileno())
            if exc_type is None:
                os.replace(self._temporary, self.path)
        finally:
            self._temporary.unlink(missing_ok=True)  # after a failure; gone after the rename
        if exc_type is None:
            (self.directory / CARD_NAME).write_text(_CARD.format(data=DATA_NAME), "utf-8")
