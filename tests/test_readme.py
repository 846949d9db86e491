"""The README's promises, as written: its ten-line example runs, and `make serve` serves."""

from __future__ import annotations

import os
import re
import shutil
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


def _blocks(section: str) -> list[str]:
    """Every ```python block under the heading ``section`` (up to the next heading)."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def _python_version(python: str) -> tuple[int, ...] | None:
    """``python``'s version, if it runs and can make a venv (Debian splits venv out)."""
    try:
        done = subprocess.run(
            [python, "-c", "import ensurepip, sys, venv; print(*sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    return tuple(map(int, done.stdout.split())) if done.returncode == 0 else None


# The README's `make serve` with the `python3` on PATH, and with the distribution's own (Debian
# 12's is 3.11.2: older than some pins of the tools `make test` installs, see test_install.py).
@pytest.mark.slow
@pytest.mark.parametrize("python", [None, "/usr/bin/python3"], ids=["python3", "system-python3"])
def test_getting_started_from_a_fresh_clone(tmp_path: Path, python: str | None) -> None:
    """The README's way in, as a newcomer takes it: a fresh clone, `make serve` (which makes
    the venv and says so), then in a second process the ten lines, `kernel-env --version` in the
    activated venv, and the async example against that server."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    on_path = shutil.which("python3")
    if python and on_path and os.path.realpath(on_path) == os.path.realpath(python):
        pytest.skip(f"the python3 on PATH is {python}: the first case ran it")
    version = _python_version(python or "python3")
    if version is None or version < (3, 11):
        pytest.skip(f"{python or 'python3'} is not a Python 3.11+ that can make a venv here")
    clone = tmp_path / "kernel_env"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    port = free_port()
    log = tmp_path / "serve.log"
    command = ["make", "--no-print-directory", "serve", f"PORT={port}"]
    with log.open("wb") as sink:
        make = subprocess.Popen(
            [*command, f"PYTHON={python}"] if python else command,
            cwd=clone,
            # make reads PYTHON from the environment too: the first case is make's default
            env={k: v for k, v in os.environ.items() if k != "PYTHON"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a fresh venv: pip installs everything
        while time.monotonic() < deadline and make.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        said = log.read_text()
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "healthy", said
        assert "installing kernel_env" in said and f"kernel-env: serving {url}" in said

        ten, async_example = _blocks("Ten lines")
        (clone / "ten.py").write_text(ten)
        (clone / "ten_async.py").write_text(async_example.replace("http://127.0.0.1:8000", url))
        second = subprocess.run(
            [
                "bash",
                "-c",
                ". .venv/bin/activate && python ten.py && kernel-env --version "
                "&& python ten_async.py",
            ],
            cwd=clone,
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        )
        assert second.returncode == 0, second.stderr
        lines = second.stdout.splitlines()
        assert lines[:5] == ["11", "", '"a model\'s answer"', "", "True 1.0"]
        assert lines[5].startswith("kernel-env ") and lines[6] == "11", lines
        made = _python_version(str(clone / ".venv" / "bin" / "python"))
        assert made == version, f"the venv runs Python {made}, not {python}'s {version}"
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the terminal
        try:
            make.wait(timeout=60)
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGKILL)
    said = log.read_text()
    assert "kernel-env serve: stopped" in said and "make: ***" not in said, said[-2000:]
