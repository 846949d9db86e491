"""Replay a notebook as an episode: its code cells become the steps of a fresh episode, and each
re-run cell is compared with the outputs stored in the notebook.

``llm_query`` calls are answered from the responses recorded in the cells' metadata (a notebook
exported by kernel_env), so a replay needs no model.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from kernel_env.client import KernelEnv
from kernel_env.environment import KernelSource
from kernel_env.inkernel.contract import (
    RECORDED_MAGIC,
    recorded_failure,
    recorded_pair,
    take_recorded,
)
from kernel_env.notebook import cells_match, normalize_outputs, recorded_steps

__all__ = ["CellReport", "ReplayReport", "output_diff", "read_notebook", "replay_notebook"]


@dataclass
class CellReport:
    """One code cell's replay: ``match``, ``mismatch``, ``recorded`` (not re-runnable: it timed
    out or killed its kernel in the episode), or ``not-run`` (the episode ended before it)."""

    index: int
    verdict: str
    source_head: str
    diff: str = ""  # for a mismatch: recorded vs replayed outputs, as a unified diff


@dataclass
class ReplayReport:
    path: str
    cells: list[CellReport] = field(default_factory=list)
    final_answer: str | None = None
    exported_by_kernel_env: bool = True  # else llm_query has no recorded answers

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "all_match": self.all_match, "counts": self.counts()}

    @property
    def all_match(self) -> bool:
        return all(c.verdict in ("match", "recorded") for c in self.cells)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cell in self.cells:
            out[cell.verdict] = out.get(cell.verdict, 0) + 1
        return out


def _recorded_llm(nb: Any) -> Callable[[str], str]:
    """Answers prompts with the notebook's recorded responses (same prompt, first unused);
    a recorded failure is raised again, with its message, so the cell sees what it saw."""
    pairs = [
        recorded_pair(call["prompt"], call["response"], error=bool(call.get("error")))
        for cell in nb.cells
        for call in cell.metadata.get("kernel_env", {}).get("llm_calls", [])
    ]

    def answer(prompt: str) -> str:
        response = take_recorded(pairs, prompt)
        if response is None:
            raise LookupError(f"no recorded response for prompt {prompt[:80]!r}")
        if (failure := recorded_failure(response)) is not None:
            raise RuntimeError(failure)
        return str(response)

    return answer


def _context(nb: Any, path: Path) -> str:
    meta = nb.metadata.get("kernel_env", {})
    if meta.get("context_file"):
        return (path.parent / Path(meta["context_file"]).name).read_text(encoding="utf-8")
    return str(meta.get("context") or "")


def read_notebook(path: Path) -> Any:
    """``path`` as an nbformat v4 notebook; ``ValueError`` naming the problem when the file
    is not one (not JSON, or JSON of another shape)."""
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except nbformat.reader.NotJSONError:
        raise ValueError(f"{path} is not a Jupyter notebook (not JSON)") from None
    except (nbformat.ValidationError, KeyError, AttributeError, TypeError) as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path} is not a Jupyter notebook ({problem[:200]})") from None
    return nb


def output_diff(recorded: list[dict[str, Any]], actual: list[dict[str, Any]]) -> str:
    """The compared parts of two cells' outputs (see ``normalize_outputs``) as a unified diff."""

    def lines(outputs: list[dict[str, Any]]) -> list[str]:
        out: list[str] = []
        for item in normalize_outputs(outputs):
            kind, *rest = item
            if kind == "stream":
                out += [f"[{rest[0]}] {line}" for line in str(rest[1]).splitlines()]
            elif kind == "data":
                out += [f"[data] {line}" for line in str(rest[0]).splitlines()]
                out.append(f"[data types] {', '.join(rest[1])}")
            else:
                out.append(f"[error] {rest[0]}: {rest[1]}")
        return out

    diff = difflib.unified_diff(
        lines(recorded), lines(actual), "recorded", "replayed", n=2, lineterm=""
    )
    return "\n".join(diff)


def replay_notebook(
    path: str | Path,
    *,
    step_timeout: float = 30.0,
    kernel_source: KernelSource | None = None,
    on_cell: Callable[[CellReport], Any] | None = None,
) -> ReplayReport:
    """Run ``path``'s code cells as a fresh episode and compare each cell's outputs.

    ``kernel_source``: where the kernel comes from (default: a local one, sandboxed where
    available); ``on_cell`` is called with each cell's report as soon as it is known."""
    path = Path(path)
    nb = read_notebook(path)
    meta = nb.metadata.get("kernel_env", {})
    steps = recorded_steps(nb)
    report = ReplayReport(str(path), exported_by_kernel_env="kernel_env" in nb.metadata)
    with KernelEnv(
        llm_query_fn=_recorded_llm(nb), step_timeout=step_timeout, kernel_source=kernel_source
    ) as env:
        env.reset(
            context=_context(nb, path),
            task_prompt=str(meta.get("task_prompt") or ""),
            max_iterations=len(steps) + 1,
            kernel_name=str(
                meta.get("kernel_name") or nb.metadata.get("kernelspec", {}).get("name") or ""
            )
            or None,
        )
        done = False
        for index, cell in enumerate(steps, 1):
            head = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
            diff = ""
            if done:
                verdict = "not-run"
            elif cell.source.startswith(RECORDED_MAGIC):
                verdict = "recorded"
                env.execute(cell.source)  # keeps the namespace as the episode had it
            else:
                result = env.execute(cell.source)
                replayed = result.observation.result.outputs
                ok = cells_match(cell.outputs, replayed)
                verdict = "match" if ok else "mismatch"
                if not ok:
                    diff = output_diff(cell.outputs, replayed)
                done = result.done
                report.final_answer = result.observation.metadata.get("final_answer")
            report.cells.append(CellReport(index, verdict, head, diff))
            if on_cell is not None:
                on_cell(report.cells[-1])
    return report
