"""Episodes exported as notebooks: valid, readable, re-runnable offline, replayable."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kernel_env import KernelEnv
from kernel_env.notebook import (
    RECORDED_MAGIC,
    ExportPathError,
    cells_match,
    recorded_steps,
    safe_path,
    write_html,
)
from kernel_env.replay import replay_notebook

pytestmark = pytest.mark.integration  # kernels, servers or other processes

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)

STEPS = [
    "words = context.split()\nprint(len(words), 'words')",
    "import sys\nprint('warning!', file=sys.stderr)\nwords[:3]",
    "from IPython.display import Image, display\n"
    f"display(Image(data=bytes.fromhex('{PNG.hex()}')))",
    "1 / 0",
    "summary = llm_query('summarize: ' + context[:20])\n"
    "parts = llm_query_batched(['a', 'b', 'c'])\nprint(summary, parts)",
    "while True: pass",  # times out, interrupted, state kept
    "import os; os._exit(1)",  # kills the kernel: restarted, state lost
    "print('after restart', 'words' in globals())",
    "FINAL(len(context.split()))",
]


def _episode(context: str) -> KernelEnv:
    # The loop cell takes the whole timeout; every other cell must fit in it on a loaded machine.
    env = KernelEnv(llm_query_fn=lambda p: f"answer to {p!r}", step_timeout=6)
    env.reset(context=context, task_prompt="Count the words.", expected_answer="6")
    for code in STEPS:
        env.execute(code)
    return env


@pytest.mark.parametrize(
    "context", ["one two three four five six", "one two three four five six" + " " * 20_000]
)
def test_export_rerun_and_replay(tmp_path: Path, context: str) -> None:
    """Streams, an image, an error, a timeout, a restart and LLM calls: the exported notebook
    validates, re-executes offline in nbclient with matching outputs, and replays cell by cell."""
    env = _episode(context)
    try:
        path = env.export_notebook(tmp_path / "episode.ipynb")
    finally:
        env.close()
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(cell.get("id") for cell in nb.cells)
    sidecar = tmp_path / "episode.context.txt"
    assert sidecar.exists() == (len(context) > 10_000)

    steps = recorded_steps(nb)
    assert [c.source.split("\n")[0].startswith(RECORDED_MAGIC) for c in steps][5:7] == [True, True]
    image_cell = steps[2]
    assert base64.b64decode(image_cell.outputs[0]["data"]["image/png"]) == PNG
    assert "shell.execute_reply" in steps[0].metadata["execution"]
    calls = steps[4].metadata["kernel_env"]["llm_calls"]
    assert [c["prompt"] for c in calls] == ["summarize: one two three four f", "a", "b", "c"]
    assert any("LLM call" in c.source for c in nb.cells if c.cell_type == "markdown")
    assert "reward | 1.0" in nb.cells[-1].source

    # Offline re-execution in a plain kernel: llm_query answers from the recording.
    rerun = nbformat.read(path, as_version=4)
    NotebookClient(rerun, timeout=60, resources={"metadata": {"path": str(tmp_path)}}).execute()
    for recorded, actual in zip(steps, recorded_steps(rerun), strict=True):
        if not recorded.source.startswith(RECORDED_MAGIC):
            assert cells_match(recorded.outputs, actual.outputs), recorded.source

    html = write_html(path)
    assert "Count the words." in html.read_text()

    # `kernel-env replay`: the cells as a fresh episode, reported cell by cell.
    replay = subprocess.run(
        [sys.executable, "-m", "kernel_env", "replay", str(path), "--step-timeout", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "all cells match: 7 match, 2 recorded" in replay.stdout
    assert "final answer: 6" in replay.stdout
    assert len(re.findall(r"^  cell +\d+  (match|recorded) ", replay.stdout, re.M)) == 9


def test_replay_reports_a_mismatch(tmp_path: Path) -> None:
    """A notebook whose recorded output differs from what its code prints: the replay says
    which cell, and `kernel-env replay` exits 1."""
    env = KernelEnv(step_timeout=5)
    try:
        env.reset(context="abc")
        env.execute("print(len(context))")
        env.execute("print('same')")
        path = env.export_notebook(tmp_path / "edited.ipynb")
    finally:
        env.close()
    nb = nbformat.read(path, as_version=4)
    recorded_steps(nb)[0].outputs[0]["text"] = "4\n"  # the episode printed 3
    nbformat.write(nb, path)
    report = replay_notebook(path, step_timeout=10)
    assert [c.verdict for c in report.cells] == ["mismatch", "match"]
    replay = subprocess.run(
        [sys.executable, "-m", "kernel_env", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.returncode == 1 and "MISMATCH: 1 match, 1 mismatch" in replay.stdout


FAILING_STEPS = [
    "print(llm_query('good'))",
    "try:\n    llm_query('bad one')\nexcept Exception as e:\n    print(type(e).__name__, e)",
    "print(llm_query_batched(['good 2', 'bad 2']))",
]


def _failing_model(prompt: str) -> str:
    if prompt.startswith("bad"):
        raise ConnectionError(f"the model is down for {prompt!r}")
    return f"ok {prompt}"


@pytest.mark.parametrize("model", [None, _failing_model], ids=["no model", "failing model"])
def test_a_failed_llm_query_replays_as_the_same_failure(tmp_path: Path, model: object) -> None:
    """A recorded failed call ("no model configured", a model that raised) answers a replay
    with the same failure, whichever way the episode is replayed: ``kernel-env replay``,
    nbclient's offline re-run of the export, and a fork by replay."""
    with KernelEnv(llm_query_fn=model, step_timeout=10) as env:  # type: ignore[arg-type]
        env.reset(context="ctx")
        for code in FAILING_STEPS:
            env.execute(code)
        recorded = env._async.environment.record  # type: ignore[union-attr]
        assert [c.error for s in recorded.steps for c in s.llm_calls] == (
            [True] * 4 if model is None else [False, True, False, True]
        )
        (copy,) = env.fork(method="replay")
        with copy:
            forked = copy._async.environment.record.forked_from  # type: ignore[union-attr]
            assert forked["outputs_matched"] is True, forked
        path = env.export_notebook(tmp_path / "failed.ipynb")
    report = replay_notebook(path, step_timeout=10)
    assert [c.verdict for c in report.cells] == ["match"] * 3, [c.diff for c in report.cells]

    rerun = nbformat.read(path, as_version=4)
    NotebookClient(rerun, timeout=60, resources={"metadata": {"path": str(tmp_path)}}).execute()
    steps = recorded_steps(nbformat.read(path, as_version=4))
    for recorded_cell, actual in zip(steps, recorded_steps(rerun), strict=True):
        assert cells_match(recorded_cell.outputs, actual.outputs), (
            recorded_cell.outputs,
            actual.outputs,
        )


def test_live_llm_in_own_notebook(tmp_path: Path) -> None:
    """%load_ext kernel_env in a plain notebook: llm_query uses a callable registered in-kernel."""
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "%load_ext kernel_env\n"
                "import kernel_env.inkernel.extension as ks\n"
                "ks.register_llm(lambda prompt: prompt[::-1])"
            ),
            nbformat.v4.new_code_cell("llm_query('abc'), llm_query_batched(['xy', 'z'])"),
        ]
    )
    NotebookClient(nb, timeout=60, resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == "('cba', ['yx', 'z'])"


@pytest.mark.parametrize(
    "name", ["../x.ipynb", "/etc/x.ipynb", "a\x00b.ipynb", "..", "sub/../../x"]
)
def test_export_paths_stay_inside_the_directory(tmp_path: Path, name: str) -> None:
    """B3: traversal, absolute paths and NUL bytes are rejected."""
    with pytest.raises(ExportPathError):
        safe_path(tmp_path, name)


def test_symlink_out_of_directory_is_rejected(tmp_path: Path) -> None:
    """B3: a symlink inside the export directory that points outside is not followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "link")
    with pytest.raises(ExportPathError):
        safe_path(root, "link/x.ipynb")
    assert safe_path(root, "ok.ipynb") == (root / "ok.ipynb").resolve()
