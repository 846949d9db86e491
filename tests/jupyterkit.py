"""Jupyter's own servers as clients of kernel_env's Jupyter door: ``jupyter server`` or
``jupyter lab`` with ``--gateway-url`` at a kernel_env server, Jupyter dirs of their own."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from serverkit import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def gateway_client(
    module: str, gateway: str, token: str, tmp: Path, *, own_token: str, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """``python -m module`` (``jupyter_server``, ``jupyterlab``) on a free loopback port with
    ``--gateway-url=gateway`` and ``token`` for it, its own ``own_token``, its root dir ``tmp``
    and its Jupyter dirs under it; its URL, once it answers; stopped at exit."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")}
    env |= {"JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_DATA_DIR": str(tmp / "data"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "KERNEL_PROBE_VALUE": "from-the-jupyter-server"}  # fmt: skip
    command = [sys.executable, "-m", module, "--no-browser", f"--port={port}",
               "--ip=127.0.0.1", f"--IdentityProvider.token={own_token}", "--allow-root",
               f"--ServerApp.root_dir={tmp}", f"--gateway-url={gateway}",
               f"--GatewayClient.auth_token={token}",
               "--GatewayClient.request_timeout=60", *extra]  # fmt: skip
    log = tmp / f"{module}.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        status = f"{url}/api/status"
        up = wait_until(lambda: process.poll() is not None or _answers(status, own_token), 90)
        up = up and process.poll() is None
        assert up, f"{module} did not start:\n{log.read_text(errors='replace')}"
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def _answers(url: str, token: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, params={"token": token}, timeout=2).status_code == 200
    return False
