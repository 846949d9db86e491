"""The README's promises, as written: its ten-line example runs, and `make serve` serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gateway import free_port

pytestmark = pytest.mark.integration  # kernels, servers or other processes

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _block(section: str) -> str:
    """The first ```python block after the heading ``section``."""
    after = README.split(f"\n## {section}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match is not None, f"no python block under {section!r}"
    return match.group(1)


def test_ten_line_example_runs_as_written(tmp_path: Path) -> None:
    code = _block("Ten lines")
    assert len(code.strip().splitlines()) <= 10
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["11", "", '"a model\'s answer"', "", "True 1.0"]


@pytest.mark.slow
def test_make_serve_serves(tmp_path: Path) -> None:
    """`make serve` (the first of the two commands) brings up a healthy server."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        make = subprocess.Popen(
            ["make", "--no-print-directory", "serve", f"PORT={port}"],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300  # the first run may install the package
        while time.monotonic() < deadline and make.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.json()["status"] == "healthy", log.read_text()
        assert f"kernel-env: serving http://127.0.0.1:{port}" in log.read_text()
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=30)
