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
DOCKER_KERNELSPEC = DEPLOY_KERNELSPEC.parent / "docker" / "kernel.json"


def eg_python() -> Path:
    """The ``python`` of Enterprise Gateway's own venv (made once, cached)."""
    return cached_venv("enterprise-gateway", [f"jupyter_enterprise_gateway=={EG_VERSION}"])


class EnterpriseGatewayProcess(GatewayProcess):
    """A real Jupyter Enterprise Gateway (its own venv: it pins jupyter_client 6), with its
    default settings (root may not start kernels: ``unauthorized_users``), on 127.0.0.1.
    Kernels run locally (EG's LocalProcessProxy) with this venv's ipykernel, as above."""

    def argv(self) -> list[str]:
        return [
            str(eg_python()),
            "-m",
            "enterprise_gateway",
            "--EnterpriseGatewayApp.ip=127.0.0.1",
            f"--EnterpriseGatewayApp.port={self.port}",
            "--EnterpriseGatewayApp.port_retries=0",
            f"--EnterpriseGatewayApp.auth_token={self.token}",
            "--KernelRestarter.time_to_dead=1.0",
            *self.args,
        ]


def docker_bridge_gateway() -> str:
    """The host's address on the Docker daemon's default bridge network (its IPAM gateway,
    which the default bridge leaves out, or the address of its interface)."""
    inspect = ["docker", "network", "inspect", "bridge", "--format"]
    template = (
        "{{range .IPAM.Config}}{{.Gateway}} {{end}}"
        '|{{index .Options "com.docker.network.bridge.name"}}'
    )
    out = subprocess.run(
        [*inspect, template], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    gateways, _, interface = out.partition("|")
    if gateways.split():
        return gateways.split()[0]
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", interface],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    if "inet" not in shown:
        raise RuntimeError(f"the Docker bridge {interface!r} has no IPv4 address")
    return shown[shown.index("inet") + 1].split("/")[0]


class DockerEnterpriseGateway(EnterpriseGatewayProcess):
    """Enterprise Gateway whose ``kernel_env_docker`` kernels are containers of ``image`` on
    the Docker daemon ``docker`` reaches (``DOCKER_HOST``), started by EG's DockerProcessProxy
    with its own ``launch_docker.py`` (from ``launchers``, EG's release) and the kernelspec of
    ``deploy/gateway/docker/kernel.json``. Each kernel container sits on the daemon's default
    bridge network: the starting kernel sends its (encrypted) connection details to the
    gateway's response address, the bridge's host side, and the gateway then reaches the
    kernel at its container's address. The gateway's HTTP port stays on loopback, out of the
    containers' reach."""

    KERNEL_NAME = "kernel_env_docker"

    def __init__(self, workdir: Path, image: str, launchers: Path, *args: str) -> None:
        super().__init__(workdir, *args)
        spec = json.loads(DOCKER_KERNELSPEC.read_text())
        spec["metadata"]["process_proxy"]["config"]["image_name"] = image
        spec["argv"][:2] = [str(eg_python()), str(launchers / "docker/scripts/launch_docker.py")]
        spec["env"]["PATH"] = "/usr/bin:/bin"  # launch_docker.py needs one; docker-py, not PATH
        _write_spec(workdir / "share", self.KERNEL_NAME, spec)
        self.image = image
        self.env.update(
            EG_RESPONSE_IP=docker_bridge_gateway(),
            EG_RESPONSE_PORT=str(free_port()),
            EG_DOCKER_NETWORK="bridge",
        )

    def argv(self) -> list[str]:
        # launch_docker.py must reach the same daemon: only DOCKER_HOST goes to it.
        inherited = ["--EnterpriseGatewayApp.inherited_envs=DOCKER_HOST"]
        return [*super().argv(), *(inherited if "DOCKER_HOST" in self.env else [])]

    def containers(self) -> list[str]:
        """Names of this image's containers on the daemon (running or not)."""
        out = subprocess.run(
            ["docker", "ps", "--all", "--filter", f"ancestor={self.image}",
             "--format", "{{.Names}}"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return out.split()

    def stop(self) -> None:
        """Stop the gateway, then remove any kernel container it left behind."""
        super().stop()
        left = self.containers()
        if left:
            subprocess.run(["docker", "rm", "--force", *left], capture_output=True, timeout=60)
