"""kernel_env's kernels in a plain Jupyter: a kernel provisioner and the kernelspec that names it.

``kernel-env kernelspec install`` writes a kernelspec whose ``metadata.kernel_provisioner``
names ``kernel-env`` (this module's :class:`KernelEnvProvisioner`, registered under
jupyter_client's ``jupyter_client.kernel_provisioners`` entry point). Any jupyter_client
frontend that starts it (JupyterLab, ``jupyter execute``, ``jupyter console``, VS Code) then
gets an episode kernel as ``kernel-env serve`` runs them: in the bubblewrap sandbox, as a uid of
its own when Jupyter runs as root, with no network and the sandbox's limits, with kernel_env's
helpers loaded.

The frontend talks to the kernel itself, over the IPC sockets in the sandbox; kernel_env's host
is only this provisioner. The helpers' calls (``llm_query`` & co.) cannot go over stdin, which
is the frontend's (``input()`` stays the person's), so they go to a socket in the sandbox that
this process answers (:mod:`.callsocket`), with the model the kernelspec's config or Jupyter's
environment names (``KERNEL_ENV_LLM_BASE_URL``, ``KERNEL_ENV_LLM_MODEL``, and the key in
``KERNEL_ENV_LLM_API_KEY``). The kernel gets none of Jupyter's environment, the key least of
all.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.provisioning import KernelProvisionerBase
from traitlets import Float, Integer, Unicode

from kernel_env.errors import KernelStartError
from kernel_env.hostcalls import HostCalls
from kernel_env.inkernel.contract import CALL_SOCKET_ENV
from kernel_env.integrations.callsocket import CallSocket
from kernel_env.kernel.isolation.sandbox import SandboxLimits, sandbox_problem
from kernel_env.kernel.sandboxed import SandboxedKernel
from kernel_env.llm import OpenAIBackend

__all__ = ["PROVISIONER_NAME", "KernelEnvProvisioner", "install_kernelspec", "kernelspec"]

PROVISIONER_NAME = "kernel-env"
DEFAULT_NAME = "kernel-env"
DEFAULT_DISPLAY_NAME = "Python 3 (kernel_env, sandboxed)"
_CALL_SOCKET = "calls"
_CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
_POLL = 0.05  # seconds between looks at a kernel that is asked to end
_MiB = 1 << 20
_NO_MODEL = (
    "name a model for the kernels: KERNEL_ENV_LLM_BASE_URL and KERNEL_ENV_LLM_MODEL in "
    "Jupyter's environment, or kernel-env kernelspec install --llm-base-url ... --llm-model ..."
)


class KernelEnvProvisioner(KernelProvisionerBase):
    """Starts a sandboxed kernel_env kernel for a jupyter_client ``KernelManager``.

    Configured by the kernelspec's ``metadata.kernel_provisioner.config`` (or Jupyter's own
    config, ``c.KernelEnvProvisioner.llm_model = ...``); never with a key."""

    memory_mb = Integer(4096, config=True, help="memory of the whole kernel, in MiB")
    cpus = Float(1.0, config=True, help="CPU bandwidth of the whole kernel, in CPUs")
    processes = Integer(256, config=True, help="tasks (threads too) of the whole kernel")
    llm_base_url = Unicode(
        "", config=True, help="the OpenAI-compatible endpoint that answers llm_query "
        "(default: $KERNEL_ENV_LLM_BASE_URL)"
    )  # fmt: skip
    llm_model = Unicode("", config=True, help="its model (default: $KERNEL_ENV_LLM_MODEL)")
    llm_api_key_env = Unicode(
        "KERNEL_ENV_LLM_API_KEY", config=True,
        help="the variable of Jupyter's environment that holds the endpoint's key",
    )  # fmt: skip

    _kernel: SandboxedKernel | None = None
    _calls: CallSocket | None = None
    _links: Path | None = None  # see _connection
    _ports: dict[str, int]

    @property
    def has_process(self) -> bool:
        return self._kernel is not None

    @property
    def kernel(self) -> SandboxedKernel | None:
        """The kernel this provisioner started (None before its launch and after its end)."""
        return self._kernel

    @property
    def call_socket(self) -> CallSocket | None:
        """Where the kernel's helper calls are answered."""
        return self._calls

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        problem = sandbox_problem()
        if problem is not None:
            raise KernelStartError(f"kernel_env's kernels run sandboxed; here: {problem}")
        kwargs = await super().pre_launch(**kwargs)
        kwargs.pop("env", None)  # Jupyter's environment, secrets and all: never the kernel's
        kwargs["cmd"] = list(self.kernel_spec.argv)  # only its interpreter is used
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel, or (after a restart's shutdown) its next process: the same
        connection info, so that the frontend's clients reach it as they did."""
        if self._kernel is None:
            await self._start(self._python(cmd))
        else:
            await self._kernel.restart()
            await self._kernel.release_channels()
        assert self._kernel is not None
        return self._connection(self._kernel)

    async def _start(self, python: str) -> None:
        kernel = SandboxedKernel(
            python=python,
            limits=SandboxLimits(
                memory_bytes=self.memory_mb * _MiB, cpus=self.cpus, processes=self.processes
            ),
        )
        # In the kernel's runtime dir, which only the kernel and this process reach.
        kernel.set_env(CALL_SOCKET_ENV, kernel.runtime_path(_CALL_SOCKET))
        await kernel.start()
        self._kernel = kernel
        try:
            calls = CallSocket(kernel.runtime_path(_CALL_SOCKET), self._host_calls())
            await asyncio.to_thread(calls.open)
            self._calls = calls
            await kernel.release_channels()
        except BaseException:
            await self._end()
            raise

    async def poll(self) -> int | None:
        kernel = self._kernel
        if kernel is not None and await kernel.is_alive():
            return None
        status = kernel.exit_status() if kernel is not None else None
        return 0 if status is None else status

    async def wait(self) -> int | None:
        while (status := await self.poll()) is None:
            await asyncio.sleep(_POLL)
        return status

    async def send_signal(self, signum: int) -> None:
        """SIGINT interrupts the cell (through the control channel: a signal to the sandbox's
        process would end the sandbox); SIGTERM and SIGKILL end the kernel's process."""
        if self._kernel is None:
            return
        if signum == signal.SIGINT:
            await self._kernel.interrupt()
        elif signum in (signal.SIGTERM, signal.SIGKILL):
            await self._stop_process()
        else:
            self.log.warning("kernel_env: signal %d is not sent into the sandbox", signum)

    # The process alone: jupyter_client's shutdown of a kernel that is slow to exit sends
    # SIGTERM with no word of a restart to come. Only cleanup ends the kernel for good.

    async def kill(self, restart: bool = False) -> None:
        await self._stop_process()

    async def terminate(self, restart: bool = False) -> None:
        await self._stop_process()

    async def cleanup(self, restart: bool = False) -> None:
        """After a restart's shutdown, keep the kernel's directory, key, uid and call socket
        for its next process; else end it all."""
        if not restart:
            await self._end()

    async def _stop_process(self) -> None:
        if self._kernel is not None and await self._kernel.is_alive():
            await self._kernel.stop_process()

    # -- the parts ----------------------------------------------------------------------

    def _python(self, cmd: list[str]) -> str:
        """The kernelspec's interpreter (``argv[0]``): it must have kernel_env installed."""
        python = cmd[0] if cmd else sys.executable
        return shutil.which(python) or python

    def _host_calls(self) -> HostCalls:
        base_url = self.llm_base_url or os.environ.get("KERNEL_ENV_LLM_BASE_URL", "")
        model = self.llm_model or os.environ.get("KERNEL_ENV_LLM_MODEL", "")
        if not (base_url and model):
            return HostCalls(no_model_hint=_NO_MODEL)
        key = os.environ.get(self.llm_api_key_env) if self.llm_api_key_env else None
        backend = OpenAIBackend(base_url, model, api_key=key)
        return HostCalls(backend=backend, default_model=model, no_model_hint=_NO_MODEL)

    def _connection(self, kernel: SandboxedKernel) -> KernelConnectionInfo:
        """The kernel's connection info for the frontend: its sockets reached through links
        in a directory of this provisioner's, the same from one restart to the next (the
        sandbox's own path names its init, new each time, and another process once the
        sandbox is gone; jupyter_client removes the IPC files it was given at cleanup)."""
        info = kernel.frontend_connection()
        if self._links is None:
            self._links = Path(tempfile.mkdtemp(prefix="kernel-env-"))
            self._ports = {channel: info[f"{channel}_port"] for channel in _CHANNELS}
        for channel, port in self._ports.items():
            link = self._links / f"kernel-{port}"
            link.unlink(missing_ok=True)
            link.symlink_to(f"{info['ip']}-{info[f'{channel}_port']}")
        info.update({f"{channel}_port": port for channel, port in self._ports.items()})
        info["ip"] = str(self._links / "kernel")
        return info  # type: ignore[return-value]

    async def _end(self) -> None:
        kernel, self._kernel = self._kernel, None
        calls, self._calls = self._calls, None
        links, self._links = self._links, None
        if calls is not None:
            await asyncio.to_thread(calls.close)
        if kernel is not None:
            await kernel.shutdown()
        if links is not None:
            shutil.rmtree(links, ignore_errors=True)


# -- the kernelspec ----------------------------------------------------------------------


def kernelspec(
    *,
    display_name: str = DEFAULT_DISPLAY_NAME,
    python: str = sys.executable,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``kernel.json`` of a kernel_env kernel: ``argv`` names the kernel's interpreter (the
    provisioner starts it, sandboxed); ``config`` is the provisioner's (no key belongs here: a
    kernelspec is a file anyone on the machine may read)."""
    return {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "kernel_provisioner": {
                "provisioner_name": PROVISIONER_NAME,
                "config": dict(config or {}),
            },
            "kernel_env": {"sandboxed": True},
        },
    }


def install_kernelspec(
    name: str = DEFAULT_NAME,
    *,
    user: bool = False,
    prefix: str | None = None,
    display_name: str = DEFAULT_DISPLAY_NAME,
    config: dict[str, Any] | None = None,
) -> str:
    """Install the kernelspec for this interpreter (for the user, or under ``prefix``, as
    ``jupyter kernelspec install`` does); returns the directory it went to."""
    unknown = set(config or {}) - set(KernelEnvProvisioner.class_own_traits(config=True))
    if unknown:
        raise ValueError(f"unknown provisioner settings: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as source:
        spec = kernelspec(display_name=display_name, config=config)
        (Path(source) / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
        logo = Path(__file__).parent.parent / "server" / "jupyter" / "resources" / "logo-svg.svg"
        if logo.exists():
            shutil.copy(logo, Path(source) / "logo-svg.svg")
        return str(KernelSpecManager().install_kernel_spec(source, name, user=user, prefix=prefix))
