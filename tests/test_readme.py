"""The README's promises, as written: every command and snippet in it is one a test here runs
(the ten lines and the async example, `make serve` from a fresh clone, what `make test` and
`make check` run, and `make check` from a fresh clone), and it stays a five-minute read."""

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

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# The blocks of the README, by section and language, and the tests below that run each.
BLOCKS = [
    ("Two commands", "bash"),  # test_each_make_command_runs_what_its_comment_says
    ("Ten lines", "python"),  # test_ten_line_example_runs_as_written, ..._from_a_fresh_clone
    ("Ten lines", "python"),  # the async example: test_getting_started_from_a_fresh_clone
    ("Development", "bash"),  # ..._runs_what_its_comment_says, test_make_check_from_a_fresh_clone
]
TEN_LINES_SAY = ["11", "a model's answer", "True 1.0"]


def _sections() -> dict[str, str]:
    """The README's ``## `` sections, by heading."""
    parts = re.split(r"^## (.+)$", README, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _fenced() -> list[tuple[str, str, str]]:
    """Every fenced block: (its section, its language, its text)."""
    return [
        (heading, lang, body)
        for heading, text in _sections().items()
        for lang, body in FENCE.findall(text)
    ]


def _blocks(section: str, lang: str = "python") -> list[str]:
    return [body for heading, kind, body in _fenced() if (heading, kind) == (section, lang)]


def _block(section: str) -> str:
    """The first ```python block under the heading ``section``."""
    return _blocks(section)[0]


def _make_lines() -> list[tuple[str, str]]:
    """The README's `make TARGET  # what it does` lines, from its bash blocks."""
    lines = [line for _, lang, body in _fenced() if lang == "bash" for line in body.splitlines()]
    found = [re.fullmatch(r"make (\S+)\s+# (.+)", line.strip()) for line in lines if line.strip()]
    assert all(found), lines  # a bash block holds make lines alone: a new command needs a test
    return [(m.group(1), m.group(2)) for m in found if m is not None]


def test_the_readme_is_a_five_minute_read() -> None:
    assert len(README.splitlines()) <= 200


def test_every_block_is_one_a_test_here_runs() -> None:
    """A new code block in the README needs a test here (and a line in BLOCKS)."""
    assert [(heading, lang) for heading, lang, _ in _fenced()] == BLOCKS
    assert [target for target, _ in _make_lines()] == ["serve", "test", "check"]


def test_every_make_target_the_readme_names_exists() -> None:
    """`make X`, in a block or in the prose, is a target of the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([\w-]+)", README)) | {t for t, _ in _make_lines()}
    assert named and named <= targets, named - targets


# What each target's dry run (make -n, in a venv not made yet) must show, beyond its comment.
DRY_RUN = {
    "serve": ["-m venv", "pip install -e .", "kernel-env serve"],
    "test": ["-m venv", "-c constraints.txt -e '.[dev]'", "install_kernelspecs.py",
             "chromium", "python3-seccomp", "-m pytest -n"],
    "check": ["-m venv", "-c constraints.txt -e '.[test]'", "ruff check", "ruff format --check",
              "mypy kernel_env", 'pytest -q -m "not integration and not slow and not soak"'],
}  # fmt: skip


@pytest.mark.integration  # make -n: a process
@pytest.mark.parametrize("target", ["serve", "test", "check"])
def test_each_make_command_runs_what_its_comment_says(target: str, tmp_path: Path) -> None:
    """`make -n TARGET` from scratch (a venv that does not exist): it makes the venv, installs
    what its comment says, and runs it; `make check` installs the test extra, not dev."""
    comment = dict(_make_lines())[target]
    venv = tmp_path / "venv"
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    for expected in DRY_RUN[target]:
        assert expected in dry.stdout, f"make {target}: no {expected!r} in\n{dry.stdout}"
    if target == "serve":  # "runs `kernel-env serve` on 127.0.0.1:8000"
        host, port = re.search(r"on ([\d.]+):(\d+)", comment).groups()  # type: ignore[union-attr]
        assert f"kernel-env serve --host {host} --port {port}" in dry.stdout
    if target == "check":
        assert "[dev]" not in dry.stdout and "apt-get install" not in dry.stdout
    if target == "test":
        assert " -m " not in dry.stdout.split("pytest -n", 1)[1].splitlines()[0]  # the whole suite


@pytest.mark.integration  # kernels
def test_ten_line_example_runs_as_written(tmp_path: Path) -> None:
    code = _block("Ten lines")
    assert len(code.strip().splitlines()) <= 10
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == TEN_LINES_SAY  # what its comments say, no blank line
    said = [line.split("# ", 1)[1] for line in code.splitlines() if "print(" in line]
    assert all(c.startswith(out) for c, out in zip(said, TEN_LINES_SAY, strict=True)), said


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
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1200)  # its own waits: a clone, a venv made, the examples run
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
        assert lines[:3] == TEN_LINES_SAY, lines
        assert lines[3].startswith("kernel-env ") and lines[4:] == ["11"], lines
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


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_check_from_a_fresh_clone(tmp_path: Path) -> None:
    """`make check` in a fresh clone, the distribution's python3 if it can make a venv: it
    installs the test extra alone (none of dev's packages), lint and types pass, and the quick
    tests pass, the server's in-process door tests among them. It prints how long it took."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    python = next(
        (p for p in ("/usr/bin/python3", "python3") if (_python_version(p) or ()) >= (3, 11)), None
    )
    if python is None:
        pytest.skip("no Python 3.11+ that can make a venv here")
    clone = tmp_path / "kernel_env"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    started = time.monotonic()
    done = subprocess.run(
        ["make", "--no-print-directory", "check", f"PYTHON={python}", "PYTEST_ARGS=-p no:randomly"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=840,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")},
    )
    took = time.monotonic() - started
    said = done.stdout + done.stderr
    print(f"make check from a fresh clone: {took:.0f} s")
    assert done.returncode == 0, said[-3000:]
    assert "installing kernel_env and the quick tier's tools" in said and "[dev]" not in said
    assert re.search(r"^\d+ passed, \d+ skipped, \d+ deselected", said, re.M), said[-2000:]
    missing = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-c",
         "import importlib.util as u; print(*[m for m in ('ray', 'dspy', 'e2b', 'selenium', "
         "'openenv', 'xdist') if u.find_spec(m)], sep=',')"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert missing.stdout.strip() == "", f"dev's packages in make check's venv: {missing.stdout}"
