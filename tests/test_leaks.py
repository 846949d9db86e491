"""The run's leak check (tests/leaks.py) on small pytest runs of its own: a run whose tests
leave processes running (a child, an orphan that went to init, and one that also left the
run's environment and PID namespace, as a sandbox's init cut loose does) fails, lists them
and kills them, with xdist's workers as without; a run that leaves none passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import alive

pytestmark = pytest.mark.integration  # pytest runs of their own

TESTS = Path(__file__).resolve().parent

LEAKY = """\
import os
import signal
import subprocess
import time
from pathlib import Path

PIDS = Path(__file__).with_name("pids")


def test_leaves_a_child():
    child = subprocess.Popen(["sleep", "300"])
    with PIDS.open("a") as pids:
        pids.write(f"{child.pid}\\n")
    child.returncode = 0  # no "still running" warning: the leak is the point


def test_leaves_an_orphan():
    said = subprocess.run(["sh", "-c", "sleep 301 >/dev/null 2>&1 & echo $!"],
                          capture_output=True, text=True, check=True)
    with PIDS.open("a") as pids:
        pids.write(said.stdout)


def test_leaves_a_namespaces_init():
    # A PID namespace's init with an empty environment, whose parent is killed: init's now.
    command = "env -i unshare --user --pid --fork sleep 302 >/dev/null 2>&1 & echo $!"
    said = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    outer = int(said.stdout)
    children = Path(f"/proc/{outer}/task/{outer}/children")
    init = None
    for _ in range(500):
        found = children.read_text().split()
        if found and Path(f"/proc/{found[0]}/cmdline").read_bytes().startswith(b"sleep"):
            init = int(found[0])
            break
        time.sleep(0.01)
    os.kill(outer, signal.SIGKILL)
    with PIDS.open("a") as pids:
        pids.write(f"{init}\\n")
"""

CLEAN = """\
import subprocess


def test_waits_for_what_it_starts():
    subprocess.run(["sleep", "0.1"], check=True)
"""


def run_pytest(folder: Path, test_file: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pytest test_file`` in ``folder`` with the leak check as its only plugin of ours."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    environ = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "leaks", "-p", "no:cacheprovider", "-q",
         test_file, *args],
        cwd=folder, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_run_that_leaves_processes_running_fails_and_kills_them(
    tmp_path: Path, workers: list[str]
) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    done = run_pytest(tmp_path, "test_leaky.py", *workers)
    said = done.stdout + done.stderr
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3
    assert "3 passed" in said, said  # the tests pass; the run does not
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, said
    assert "processes the tests left running (killed)" in said
    # Under xdist the tests run at once, so any may write its pid first.
    listed = dict(re.findall(r"pid (\d+): (sleep 30[012])", said))
    assert sorted(listed.values()) == ["sleep 300", "sleep 301", "sleep 302"], said
    assert sorted(map(int, listed)) == sorted(pids), said
    for pid in pids:
        assert not alive(pid), f"{listed[str(pid)]} (pid {pid}) still runs"
    assert "the run fails: 3 process(es) outlived it" in said


def test_a_run_that_leaves_nothing_running_passes(tmp_path: Path) -> None:
    (tmp_path / "test_clean.py").write_text(textwrap.dedent(CLEAN))
    done = run_pytest(tmp_path, "test_clean.py", "-n", "2")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "1 passed" in said and "left running" not in said, said
