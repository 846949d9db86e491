"""Stored episodes as a Hugging Face dataset (``kernel-env episodes dataset OUT``).

A dataset is a directory that ``datasets.load_dataset`` reads as it is, or as JSON::

    OUT/episodes.jsonl    a row per episode, a line of JSON each, in the listing's order
    OUT/notebooks/        each row's notebook, the row's ``notebook`` its path from OUT
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
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import nbformat
from nbformat import NotebookNode

from kernel_env.inkernel.contract import RECORDED_MAGIC
from kernel_env.notebook import notebook_name, recorded_steps

__all__ = ["CARD_NAME", "DATA_NAME", "NOTEBOOKS_NAME", "DatasetWriter", "episode_row", "step_row"]

DATA_NAME = "episodes.jsonl"
CARD_NAME = "README.md"
NOTEBOOKS_NAME = "notebooks"

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
`ended` (seconds since 1970), `context_length`, `notebook` (the episode's notebook, a
path from this directory: open it in Jupyter, or replay it with `kernel-env replay`), and
`steps`: each step's `step`, `code`,
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
    """Writes a dataset directory a row at a time; the rows file and the notebooks appear
    whole when the writer closes without an error (temporary names until then), and not at
    all otherwise::

        with DatasetWriter(Path("out")) as dataset:
            dataset.write(episode_row(listed, notebook), notebook)
    """

    def __init__(self, directory: Path, *, overwrite: bool = False) -> None:
        self.directory = directory
        self.path = directory / DATA_NAME
        self.notebooks = directory / NOTEBOOKS_NAME
        there = [p for p in (self.path, directory / CARD_NAME, self.notebooks) if p.exists()]
        if there and not overwrite:
            raise FileExistsError(f"{there[0]} exists; add --overwrite to replace it")
        self.rows = 0
        suffix = secrets.token_hex(4)
        self._temporary = directory / f".{DATA_NAME}.{suffix}.tmp"
        self._temporary_notebooks = directory / f".{NOTEBOOKS_NAME}.{suffix}.tmp"
        self._file: IO[str] | None = None

    def __enter__(self) -> DatasetWriter:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = self._temporary.open("x", encoding="utf-8")
        return self

    def write(self, row: Mapping[str, Any], notebook: bytes | None = None) -> None:
        """One row; with ``notebook`` (the episode's), the notebook beside it, which the
        row's ``notebook`` names."""
        if self._file is None:
            raise RuntimeError("DatasetWriter.write outside its with block")
        if notebook is not None:
            row = {**row, "notebook": self._keep(str(row["episode_id"]), notebook)}
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.rows += 1

    def _keep(self, episode_id: str, notebook: bytes) -> str:
        """``notebook`` written among the dataset's notebooks; its path from the directory."""
        self._temporary_notebooks.mkdir(exist_ok=True)
        name = notebook_name(episode_id)
        n = 1
        while (self._temporary_notebooks / name).exists():  # two ids made safe alike
            n += 1
            name = f"{notebook_name(episode_id).removesuffix('.ipynb')}-{n}.ipynb"
        (self._temporary_notebooks / name).write_bytes(notebook)
        return f"{NOTEBOOKS_NAME}/{name}"

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
                self._publish_notebooks()
                os.replace(self._temporary, self.path)
        finally:
            self._temporary.unlink(missing_ok=True)  # after a failure; gone after the rename
            shutil.rmtree(self._temporary_notebooks, ignore_errors=True)
        if exc_type is None:
            (self.directory / CARD_NAME).write_text(_CARD.format(data=DATA_NAME), "utf-8")

    def _publish_notebooks(self) -> None:
        """The written notebooks in place of those of an earlier dataset here, if any."""
        if self.notebooks.exists():
            shutil.rmtree(self.notebooks)
        if self._temporary_notebooks.exists():
            os.replace(self._temporary_notebooks, self.notebooks)
