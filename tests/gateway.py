"""A real Jupyter Kernel Gateway (or Enterprise Gateway) in a subprocess, on a free loopback
port, with a token.

Its Jupyter dirs are private (no writes to ``~/.local``) and hold four kernel specs:
``python3`` (this venv's ipykernel, no ``--ext``: kernel_env is importable but not loaded),
``kernel_env`` (``deploy/gateway/kernelspec/kernel.json``: the extension loaded at start) and
``python3-bare`` (a kernel that cannot import kernel_env: the helpers must be shipped) and
``broken`` (its command fails at once).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from procs import descendants
from venvs import cached_venv

DEPLOY_KERNELSPEC = Path(__file__).parent.parent / "deploy" / "gateway" / "kernelspec"
TOKEN = "test-gateway-token"
SECRET_VAR = "KERNEL_ENV_TEST_GATEWAY_SECRET"  # in the gateway's environment, never a kernel's

_QUIET = {"PYDEVD_DISABLE_FILE_VALIDATION": "1"}  # else ipykernel prints debugger warnings
_BARE = (
    # kernel_env is importable from this venv: a None entry in sys.modules makes it not.
    "import sys; sys.modules['kernel_env'] = None; "
    "from ipykernel import kernelapp; kernelapp.launch_new_instance()"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_spec(root: Path, name: str, spec: dict) -> None:
    folder = root / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.json").write_text(json.dumps(spec))


def _kernelspecs(root: Path) -> None:
    python = sys.executable
    flags = ["--colors=nocolor", "--HistoryManager.enabled=False"]
    _write_spec(
        root,
        "python3",
        {
            "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", *flags],
            "display_name": "Python 3",
            "language": "python",
            "env": _QUIET,
        },
    )
    _write_spec(
        root,
        "python3-bare",
        {
            "argv": [python, "-c", _BARE, "-f", "{connection_file}", *flags],
            "display_name": "Python 3 without kernel_env",
            "language": "python",
            "env": _QUIET,
        },
    )
    _write_spec(
        root,
        "broken",
        {
            "argv": [python, "-c", "raise SystemExit('no kernel here')", "{connection_file}"],
            "display_name": "A kernel spec whose command fails",
            "language": "python",
        },
    )
    folder = root / "kernels" / "kernel_env"
    shutil.copytree(DEPLOY_KERNELSPEC, folder, dirs_exist_ok=True)
    # Its "python" is the gateway's own interpreter: this venv's, whatever venv the gateway
    # runs in (Enterprise Gateway has its own).
    spec = json.loads((folder / "kernel.json").read_text())
    spec["argv"][0] = python
    (folder / "kernel.json").write_text(json.dumps(spec))


class GatewayProcess:
    """``jupyter kernelgateway`` on 127.0.0.1; ``start`` waits until ``/api`` answers."""

    def __init__(self, workdir: Path, *args: str, token: str = TOKEN) -> None:
        self.workdir = workdir
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        self._kernels: set[int] = set()
        share = workdir / "share"
        _kernelspecs(share)
        self.env = {
            **os.environ,
            "JUPYTER_PATH": str(share),
            "JUPYTER_DATA_DIR": str(workdir / "data"),
            "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
            "JUPYTER_CONFIG_DIR": str(workdir / "config"),
            SECRET_VAR: "gateway-only",
        }

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kernel_gateway",
            "--KernelGatewayApp.ip=127.0.0.1",
            f"--KernelGatewayApp.port={self.port}",
            "--KernelGatewayApp.port_retries=0",
            f"--KernelGatewayApp.auth_token={self.token}",
            # Notice a dead kernel within 1 s (the default polls every 3 s): see deploy/.
            "--KernelRestarter.time_to_dead=1.0",
            # A kernel now and then ignores the shutdown request; the default waits 2.5 s
            # before SIGTERM, which every reset then waits for.
            "--KernelManager.shutdown_wait_time=1.0",
            *self.args,
        ]

    def start(self, timeout: float = 60.0) -> None:
        argv = self.argv()
        log = (self.workdir / "gateway.log").open("ab")
        self.process = subprocess.Popen(
            argv,
            cwd=self.workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited at start:\n{self.log_tail()}")
            try:
                response = httpx.get(
                    f"{self.url}/api", headers={"Authorization": f"token {self.token}"}, timeout=2
                )
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the gateway did not answer within {timeout:g} s:\n{self.log_tail()}")

    def kernel_pids(self) -> set[int]:
        return descendants(self.process.pid) if self.process else set()

    def kill(self) -> None:
        """SIGKILL the gateway (its kernels are reaped by ``stop``)."""
        if self.process is not None:
            self._kernels.update(self.kernel_pids())
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the gateway and every kernel it started; idempotent."""
        if self.process is not None:
            self._kernels.update(self.kernel_pids())
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10)
            self.process = None
        for pid in self._kernels:
            # Only a process that still is one of ours (its connection file is in workdir).
            try:
                if str(self.workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        self._kernels.clear()

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / "gateway.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


EG_VERSION = "3.3.0"


class EnterpriseGatewayProcess(GatewayProcess):
    """A real Jupyter Enterprise Gateway (its own venv: it pins jupyter_client 6), with its
    default settings (root may not start kernels: ``unauthorized_users``), on 127.0.0.1.
    Kernels run locally (EG's LocalProcessProxy) with this venv's ipykernel, as above."""

    def argv(self) -> list[str]:
        python = cached_venv("enterprise-gateway", [f"jupyter_enterprise_gateway=={EG_VERSION}"])
        return [
            str(python),
            "-m",
            "enterprise_gateway",
            "--EnterpriseGatewayApp.ip=127.0.0.1",
            f"--EnterpriseGatewayApp.port={self.port}",
            "--EnterpriseGatewayApp.port_retries=0",
            f"--EnterpriseGatewayApp.auth_token={self.token}",
            "--KernelRestarter.time_to_dead=1.0",
            *self.args,
        ]
