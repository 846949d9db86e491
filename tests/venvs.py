"""Virtualenvs for tools that cannot share the test venv (their pins conflict with it), made
once and kept in the user's cache for later runs, like pip's own cache.

``cached_venv("openenv", ["openenv==0.10.0"])`` is the path of a venv's ``python`` with those
requirements installed, under ``$XDG_CACHE_HOME/kernel-env/test-venvs/`` (``~/.cache`` by
default), named by the requirements and the interpreter, so a change of either makes a new
one. It is made under a lock (two test runs at once make it once) and used only once its
stamp is written (a run killed halfway leaves nothing that looks finished).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["cached_venv"]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kernel-env" / "test-venvs"


def cached_venv(name: str, requirements: list[str], *, timeout: float = 900) -> Path:
    """The ``python`` of a venv holding ``requirements``; made on first use (pip's output
    in the failure when it cannot be)."""
    key = "\n".join([sys.version, *sorted(requirements)]).encode()
    venv = _cache_root() / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            done = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", *requirements],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if done.returncode != 0:
                raise RuntimeError(f"pip could not make {venv}:\n{done.stdout}{done.stderr}")
            stamp.touch()
    return python
