"""A real ``kernel-env serve`` run by an ordinary user: a fresh uid, with Debian's own python3.

The test process is root; the server it starts here is not. Its interpreter is a virtualenv of
``/usr/bin/python3.11`` (reachable by any uid, unlike an interpreter under ``/root``) that finds
kernel_env and this environment's packages through a ``.pth`` file, so the server's zygote and
its kernels import them too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from serverkit import ServeProcess, serve_args, serving

SYSTEM_PYTHON = Path("/usr/bin/python3.11")
REPO = Path(__file__).resolve().parent.parent


def problem() -> str | None:
    """Why an unprivileged server cannot be run here, or None."""
    if os.geteuid() != 0:
        return "needs root, to become another uid"
    if not SYSTEM_PYTHON.exists() or sys.version_info[:2] != (3, 11):
        return "needs a system python3.11 beside ours"
    return None


@contextlib.contextmanager
def fresh_user(offset: int = 0) -> Iterator[tuple[int, Path]]:
    """A uid nobody uses, and a home of its own (0700), removed at exit."""
    uid = 1_900_300_000 + (os.getpid() * 8 + offset) % 100_000
    home = Path(tempfile.mkdtemp(prefix="ke-unpriv-"))
    os.chown(home, uid, uid)
    try:
        yield uid, home
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            subprocess.run(["pkill", "-KILL", "-U", str(uid)], check=False)
        shutil.rmtree(home, ignore_errors=True)


def _interpreter(home: Path) -> Path:
    """A virtualenv of the system python in ``home`` that imports what this one does."""
    venv = home / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(p for p in sys.path if p.endswith("site-packages") and ".venv" in p)
    (venv / "lib" / "python3.11" / "site-packages" / "kernel_env_tests.pth").write_text(
        f"{REPO}\n{site}\n"
    )
    return venv / "bin" / "python"


@contextlib.contextmanager
def serve_unprivileged(
    *args: str, env: dict[str, str] | None = None, user: tuple[int, Path] | None = None
) -> Iterator[ServeProcess]:
    """``kernel-env serve ARGS`` as a fresh uid on a free loopback port, healthy; killed at
    exit. ``env`` adds variables to its small environment."""
    with contextlib.ExitStack() as stack:
        uid, home = user or stack.enter_context(fresh_user())
        python = _interpreter(home)
        become = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        environ = {"PATH": "/usr/bin:/bin", "HOME": str(home), **(env or {})}
        command = [*become, str(python), *serve_args(*args)]
        with serving(command, home / "serve.log", env=environ, cwd=str(home)) as served:
            yield served
