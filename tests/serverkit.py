"""Helpers for the server tests: a real server in a thread or a subprocess, on a free loopback
port, and process bookkeeping (which kernels a server started, and whether they are gone)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
from fastapi.testclient import TestClient
from procs import alive, child_pids, kernel_pids

from kernel_env.server import create_app
from kernel_env.server.runner import build_server
from kernel_env.server.settings import ServerSettings

__all__ = ["alive", "child_pids", "kernel_pids"]  # re-exported from procs, for the tests

_URL = re.compile(r"serving (http://127\.0\.0\.1:\d+)")


def small_settings(**overrides: object) -> ServerSettings:
    """Settings for tests: loopback, port 0, a small pool, quiet logs."""
    values: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "pool_size": 1,
        "max_sessions": 8,
        "step_timeout": 10.0,
        "log_level": "warning",
    }
    values.update(overrides)
    return ServerSettings(**values)  # type: ignore[arg-type]


class LoopbackClient(TestClient):
    """A ``TestClient`` that names the server ``127.0.0.1`` (one of the Host names the server
    accepts by default) rather than Starlette's ``testserver``, over HTTP and WebSocket."""

    def __init__(self, app: Any, **kwargs: Any) -> None:
        super().__init__(app, base_url="http://127.0.0.1", **kwargs)

    def websocket_connect(self, url: str, *args: Any, **kwargs: Any) -> Any:
        return super().websocket_connect(urljoin("ws://127.0.0.1", url), *args, **kwargs)


def make_client(**overrides: object) -> TestClient:
    """An in-process client of the app (no port); its lifespan runs on entering ``with``."""
    return LoopbackClient(create_app(small_settings(**overrides)))


@contextlib.contextmanager
def thread_server(settings: ServerSettings, app: Any = None) -> Iterator[str]:
    """A real uvicorn server (our runner; of ``app``, else the settings' own) on its own loop
    thread; yields its base URL."""
    server, sock, settings = build_server(settings, app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield settings.url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@dataclass
class ServeProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    """``python -m kernel_env serve --port 0 ARGS`` as a subprocess, healthy; killed at exit.
    The python is this one, or ``$KERNEL_ENV_TEST_SERVER_PYTHON`` (a client's venv that
    cannot hold the server's dependencies, tests/test_e2b_versions.py)."""
    python = os.environ.get("KERNEL_ENV_TEST_SERVER_PYTHON") or sys.executable
    log = Path(tempfile.mkstemp(prefix="kernel-env-serve-", suffix=".log")[1])
    try:
        with serving([python, *serve_args(*args)], log, env=env) as served:
            yield served
    finally:
        log.unlink(missing_ok=True)


def serve_args(*args: str) -> list[str]:
    """``-m kernel_env serve`` on a free loopback port, logging at info, then ``args``."""
    return ["-m", "kernel_env", "serve", "--host", "127.0.0.1", "--port", "0",
            "--log-level", "info", *args]  # fmt: skip


@contextlib.contextmanager
def serving(
    command: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: str | None = None
) -> Iterator[ServeProcess]:
    """``command`` (a server) with its output in ``log``, once healthy; killed at exit."""
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink, env=env, cwd=cwd)
    try:
        url = _wait_for_url(process, log)
        _wait_healthy(url)
        yield ServeProcess(process, url, log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def _wait_for_url(process: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 60  # imports alone take seconds on a loaded 2-core box
    while time.monotonic() < deadline:
        if (match := _URL.search(log.read_text(errors="replace"))) is not None:
            return match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"kernel-env serve did not start:\n{log.read_text(errors='replace')}")


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url}/health never answered")


def wait_until(predicate: object, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` s pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def metrics(url: str, token: str | None = None) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data: dict[str, object] = httpx.get(f"{url}/metrics", headers=headers, timeout=5).json()
    return data


def terminate(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, sig)
