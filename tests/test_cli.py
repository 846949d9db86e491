"""`kernel-env run`: a real RLM episode from the command line, against a loopback
OpenAI-compatible server with scripted answers (the model is outside kernel_env)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from fake_openai import FakeOpenAI

from kernel_env.notebook import recorded_steps

pytestmark = pytest.mark.integration  # kernels, servers or other processes

KEY = "sk-run-secret-5150"
ROOT_TURNS = [
    "Let me count in chunks.\n```repl\n"
    "lines = context.splitlines()\n"
    "chunks = ['\\n'.join(lines[i:i + 5]) for i in range(0, len(lines), 5)]\n"
    "counts = llm_query_batched([f'How many times does needle occur? {c}' for c in chunks])\n"
    "total = sum(int(n) for n in counts)\nprint(len(chunks), total)\n```",
    "```repl\nFINAL_VAR('total')\n```",
]


def _model(body: dict[str, Any]) -> str:
    if body["model"] == "sub":
        return str(body["messages"][-1]["content"].count("needle") - 1)  # minus the question's
    turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
    return ROOT_TURNS[turns]


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernel_env", "run", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_run_solves_a_task_and_exports_it(tmp_path: Path) -> None:
    context = tmp_path / "haystack.txt"
    context.write_text(("hay " * 300 + "needle\n") * 17)
    with FakeOpenAI(_model) as fake:
        run = _run(
            "--context",
            str(context),
            "--task",
            "How many needles?",
            "--model",
            "root",
            "--sub-model",
            "sub",
            "--model-url",
            fake.url,
            "--output",
            str(tmp_path),
            "--name",
            "needles",
            "--expected-answer",
            "17",
            env={**os.environ, "KERNEL_ENV_LLM_API_KEY": KEY},
        )
    assert run.returncode == 0, run.stderr
    notebook, trajectory = tmp_path / "needles.ipynb", tmp_path / "needles.trajectory.jsonl"
    assert run.stdout.splitlines() == [
        "answer: 17",
        f"notebook: {notebook}",
        f"trajectory: {trajectory}",
    ]
    assert "iteration 1/20: 1 cell(s); root model 1 call(s)" in run.stderr
    assert "stopped: final after 2 iteration(s)" in run.stderr and "reward 1" in run.stderr

    sub_calls = [r for r in fake.requests if r.body["model"] == "sub"]
    assert len(sub_calls) == 4  # 17 lines, 5 a chunk
    assert {r.headers["authorization"] for r in fake.requests} == {f"Bearer {KEY}"}
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    assert recorded_steps(nb)[0].outputs[0]["text"] == "4 17\n"
    assert len(recorded_steps(nb)[0].metadata["kernel_env"]["llm_calls"]) == 4
    lines = [json.loads(line) for line in trajectory.read_text().splitlines()]
    assert [line["final_answer"] for line in lines] == [None, "17"]
    for text in [run.stdout, run.stderr, notebook.read_text(), trajectory.read_text()]:
        assert KEY not in text


def test_run_reports_a_model_failure_and_keeps_the_notebook(tmp_path: Path) -> None:
    """The endpoint refuses: the error is said plainly, the exit status is 1, and no empty
    notebook or trajectory is left behind (nothing ran)."""
    context = tmp_path / "c.txt"
    context.write_text("data")
    env = {**os.environ, "KERNEL_ENV_LLM_API_KEY": KEY}
    run = _run(
        "--context",
        str(context),
        "--task",
        "t",
        "--model",
        "m",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--output",
        str(tmp_path),
        "--name",
        "x",
        env=env,
    )
    assert run.returncode == 1
    failed = "the run failed: cannot reach the model endpoint at http://127.0.0.1:9/v1 ("
    assert failed in run.stderr and "--model-url" in run.stderr, run.stderr
    assert KEY not in run.stderr
    assert not (tmp_path / "x.ipynb").exists()
    assert not (tmp_path / "x.trajectory.jsonl").exists()
    assert "notebook:" not in run.stdout


def test_run_rejects_bad_input(tmp_path: Path) -> None:
    env = dict(os.environ)
    missing = _run("--context", str(tmp_path / "nope.txt"), "--task", "t", "--model", "m", env=env)
    assert missing.returncode == 2 and "nope.txt" in missing.stderr
    (tmp_path / "c.txt").write_text("x")
    outside = _run(
        "--context",
        str(tmp_path / "c.txt"),
        "--task",
        "t",
        "--model",
        "m",
        "--output",
        str(tmp_path),
        "--name",
        "../escape",
        env=env,
    )
    assert outside.returncode == 2 and "outside" in outside.stderr
