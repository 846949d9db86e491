"""jupyter_client's supervision of a local kernel process, with kernel_env's departures.

``jupyter_client``'s ``AsyncKernelManager`` and its provisioners start, watch, interrupt,
restart and kill each local kernel; its channel client is not used (:mod:`.channels` speaks
to the kernel). The subclasses here change what was measured or found to matter: no
inherited stdio, no control socket until one is needed, a kill without the interrupt before
it, a quicker check that a killed kernel is gone, and provisioners for a process the host
did not start as its child (a forked kernel's launch, a live fork's copy), held by a pidfd.
Host side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_client import AsyncKernelManager
from jupyter_client.provisioning import KernelProvisionerBase

__all__ = ["CopyProcess", "ForkedLaunch", "KernelManager", "kill_process"]

_EXIT_POLL = 0.005  # seconds between checks that a killed kernel has exited


class KernelManager(AsyncKernelManager):
    """A kernel manager given its kernelspec before each launch (cold, forked or a copy's),
    never whatever ``python3`` resolves to: it has no kernel name to look one up by."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(kernel_name="", **kwargs)

    def _connect_control_socket(self) -> None:
        # An interrupt goes over this socket (for message-mode kernels); to a kernel already
        # dead the message would wait here, and jupyter_client's 100 ms linger delivered it to
        # the kernel a restart binds at the same address: its first cell was interrupted.
        # Closing now drops what is undelivered.
        super()._connect_control_socket()
        if self._control_socket is not None:
            self._control_socket.linger = 0

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        # Nothing of the server's: jupyter_client's kernel inherits its stdout and stderr (the
        # server's log), which a cell could write to, or take from the sandbox's init.
        null = subprocess.DEVNULL
        await super()._async_launch_kernel(kernel_cmd, **kw, stdin=null, stdout=null, stderr=null)

    async def _async_post_start_kernel(self, **kw: Any) -> None:
        # jupyter_client's, without connecting the control socket: an interrupt or a
        # shutdown request connects it when it needs it, and most kernels never do.
        self.start_restarter()
        assert self.provisioner is not None
        await self.provisioner.post_launch(**kw)

    async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:  # type: ignore[override]
        """A kill (``now``) without the interrupt jupyter_client sends first. The kill takes
        the kernel's whole sandbox, and its cgroup and uid are emptied after, so the interrupt
        bought nothing but work: a control socket here, and a message the kernel woke to
        handle a moment before its SIGKILL."""
        if not now or not self.owns_kernel:
            await super().shutdown_kernel(now=now, restart=restart)
            return
        self.shutting_down = True  # jupyter_client's restarter checks this
        self.stop_restarter()
        await self._async_kill_kernel(restart=restart)
        await self._async_cleanup_resources(restart=restart)

    async def _async_wait(self, pollinterval: float = 0.1) -> None:
        # After a kill, jupyter_client checks every 100 ms whether the kernel is gone: every
        # shutdown and restart waited that long for a process that ends within a few ms.
        await super()._async_wait(pollinterval=min(pollinterval, _EXIT_POLL))


class _PidfdProcess(KernelProvisionerBase):
    """jupyter_client's handle on a kernel process this one did not start as its child,
    watched and ended through a pidfd: a forkserver launch (its spawner started it) or a live
    fork's copy (the parent kernel forked it)."""

    pid: int | None = None
    _pidfd: int | None = None
    _leads_group = False  # the process leads its own process group (a launch, a copy)

    def _hold(self, pid: int) -> None:
        self.pid, self._pidfd = pid, os.pidfd_open(pid)
        with contextlib.suppress(OSError):
            self._leads_group = os.getpgid(pid) == pid

    @property
    def has_process(self) -> bool:
        return self._pidfd is not None

    async def poll(self) -> int | None:
        if self._pidfd is None:
            return 0
        # poll(2), not select(2): a server holding a thousand kernels has descriptors past
        # select's FD_SETSIZE (1024), which select refuses.
        watch = select.poll()
        watch.register(self._pidfd, select.POLLIN)
        return 0 if watch.poll(0) else None

    async def wait(self) -> int | None:
        while await self.poll() is None:
            await asyncio.sleep(_EXIT_POLL)
        return 0

    async def send_signal(self, signum: int) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    async def kill(self, restart: bool = False) -> None:
        """SIGKILL to the process and to its process group, as jupyter_client kills a kernel
        it started: a process of the group that would outlive it dies with it (bubblewrap's
        init, when the launch was killed before the init asked to die with its parent:
        bubblewrap's issue 633). The group is the process's own: it led it when taken, and
        runs still (a group's id outlives its leader only while a process is in it, and a
        free id may be given again)."""
        if self._leads_group and self.pid is not None and await self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        await self.send_signal(signal.SIGKILL)

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        # The manager takes a command line from here; the launch needs none.
        return await super().pre_launch(cmd=[], **kwargs)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        raise RuntimeError(f"{type(self).__name__} does not launch kernels")

    async def cleanup(self, restart: bool = False) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            os.close(fd)


class CopyProcess(_PidfdProcess):
    """A live fork's copy, adopted. A restart starts a kernel the usual way (the manager
    makes its usual provisioner)."""

    def __init__(self, pid: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hold(pid)


class ForkedLaunch(_PidfdProcess):
    """A kernel the forkserver launches and forks (:mod:`kernel_env.kernel.fork.zygote`); the
    process held is the launch (bubblewrap, or the placeholder), which the kernel ends with."""

    def __init__(self, launch: Callable[[], Awaitable[dict[str, Any]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._launch = launch
        self.sandbox_init: int | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        launched = await self._launch()
        self._hold(launched["launcher"])
        self.sandbox_init = launched["init"]
        assert self.parent is not None
        return self.parent.get_connection_info()


async def kill_process(km: AsyncKernelManager) -> None:
    """Kill and reap a kernel process that ``shutdown_kernel`` could not stop.

    A start that failed half-way leaves a process but no control socket, and shutdown's
    interrupt fails before it reaches the kill.
    """
    provisioner = km.provisioner
    if provisioner is None or not provisioner.has_process:
        return
    with contextlib.suppress(Exception):
        await provisioner.kill()
    with contextlib.suppress(Exception):
        await provisioner.wait()
