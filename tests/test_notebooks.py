"""The teaching notebooks in ``notebooks/``: each one runs top to bottom, offline, with nbclient.

Every notebook is executed in memory (the committed files are never rewritten), in a scratch
working directory, with a per-cell timeout; a cell that raises fails the test. Each notebook
tags its key cell ``answer``, and the test checks that cell's output for the value it must show,
so a section that silently skipped its work fails too. ``05-gateway`` runs against a real
Jupyter Kernel Gateway on loopback (``tests/gateway.py``), so the gateway path is proven.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from gateway import TOKEN, GatewayProcess
from nbclient import NotebookClient
from nbformat import NotebookNode

pytestmark = pytest.mark.integration  # kernels, servers or other processes

NOTEBOOKS_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 180  # seconds a cell may run; every notebook takes well under a minute in all
KEY_TAG = "answer"

# What the cell tagged "answer" must print, per notebook.
EXPECTED = {
    "01-quickstart": ["done: True | reward: 1.0", "final answer: 9"],
    "02-rlm-long-context": ["reward: 1.0", "stopped: final", "sub-model calls: 30"],
    "03-serve-and-connect": ["context_length: 11", "done: True | reward: 1.0"],
    "04-notebook-native": ["the longest word is 'interactively'"],
    "05-gateway": ["reward", "1.0", "you sent me 12 words", "steps: 5, LLM calls: 1"],
    "06-fork": ["best: len(set(words)) -> 8", "  8  reward 1.0"],
    "07-r": ["done: True | reward: 1.0", "final answer: 9", "exported kernelspec: ir"],
    "08-bash": ["done: True | reward: 1.0", "final answer: 9", "exported kernelspec: bash"],
    "09-deno": ["done: True | reward: 1.0", "final answer: 9", "exported kernelspec: deno"],
}

# Settings a developer's shell may hold that would change what the notebooks do.
_OUTSIDE_SETTINGS = (
    "KERNEL_ENV_LLM_BASE_URL",
    "KERNEL_ENV_LLM_MODEL",
    "KERNEL_ENV_LLM_API_KEY",
    "KERNEL_ENV_GATEWAY_URL",
    "KERNEL_ENV_GATEWAY_TOKEN",
    "KERNEL_ENV_GATEWAY_KERNEL_NAME",
)


def _execute(path: Path, workdir: Path) -> NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    return nb


def _text(cell: NotebookNode) -> str:
    """A cell's outputs as text: streams and the text/plain of results and displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        else:
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def _key_cells(nb: NotebookNode) -> list[NotebookNode]:
    return [c for c in nb.cells if KEY_TAG in c.get("metadata", {}).get("tags", [])]


def test_every_notebook_has_expectations() -> None:
    """A new notebook gets an expected value here too (and a tagged key cell)."""
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"
    assert {p.stem for p in NOTEBOOKS} == set(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_readable_as_is(path: Path) -> None:
    """Committed with outputs, a plain python3 kernel spec, no error, token or machine path."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "run it before committing"
    assert len(_key_cells(nb)) == 1
    for expected in EXPECTED[path.stem]:
        assert expected in _text(_key_cells(nb)[0])
    text = "".join(_text(c) for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert TOKEN not in text
    assert "/tmp/" not in text and str(Path.home()) + "/" not in text


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_offline(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The notebook executes top to bottom, and its key cell shows the expected values."""
    for name in _OUTSIDE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    # The notebook's kernel inherits this environment: it must find this venv's tools.
    bindir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ.get("PATH", ""))
    if path.stem == "05-gateway":
        gw: GatewayProcess = request.getfixturevalue("gateway")
        monkeypatch.setenv("KERNEL_ENV_GATEWAY_URL", gw.url)
        monkeypatch.setenv("KERNEL_ENV_GATEWAY_TOKEN", gw.token)

    nb = _execute(path, tmp_path)

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    (key,) = _key_cells(nb)
    shown = _text(key)
    for expected in EXPECTED[path.stem]:
        assert expected in shown, f"{expected!r} not in the key cell's output:\n{shown}"
    assert TOKEN not in "".join(_text(c) for c in code)
    # Run from notebooks/ in JupyterLab, a demo writes its files to a temporary directory.
    assert not list(tmp_path.iterdir()), "the notebook wrote into its working directory"
