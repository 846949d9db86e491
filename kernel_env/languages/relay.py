"""A relay that serves a TCP-only kernel on the IPC sockets kernel_env's host connects to.

Run by path, ``python -I -S relay.py <connection file> -- <kernel command>``: the standard
library alone. Deno's kernel binds TCP only, while kernel_env's local kernels talk over IPC
sockets in a private directory (in the sandbox: in its own ``/tmp``, which the host reaches
through ``/proc/<pid>/root``; a TCP port there would be in the sandbox's own network
namespace, out of the host's reach). ZMTP is the same over both transports, so the relay
copies bytes: it writes a TCP connection file (same key, free loopback ports) for the kernel,
starts the kernel command with it in place of ``{tcp_connection_file}``, listens on each IPC
endpoint of ``<connection file>`` and pipes every connection to the kernel's TCP port.

The relay lives as long as the kernel: it forwards SIGINT and SIGTERM, exits with the kernel's
status, and the kernel dies with the relay (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
PLACEHOLDER = "{tcp_connection_file}"
_CONNECT_RETRY = 0.005  # seconds between tries while the kernel has not bound its port yet
_CONNECT_WAIT = 60.0
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tcp_connection(info: dict[str, object]) -> dict[str, object]:
    """The kernel's TCP connection info: ``info``'s key and scheme, free loopback ports."""
    tcp = {k: v for k, v in info.items() if not k.endswith("_port")}
    tcp.update(transport="tcp", ip="127.0.0.1")
    tcp.update({f"{name}_port": _free_port() for name in CHANNELS})
    return tcp


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _CONNECT_WAIT
    while True:
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(_CONNECT_RETRY)


def _relay_to(port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kernel_reader, kernel_writer = await _connect(port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, kernel_writer), _pipe(kernel_reader, writer))

    return relay


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def run(connection_file: str, command: list[str]) -> int:
    with open(connection_file) as f:
        info = json.load(f)
    tcp = tcp_connection(info)
    with tempfile.TemporaryDirectory(prefix="kernel-env-relay-") as private:
        tcp_file = os.path.join(private, "kernel-tcp.json")
        with open(os.open(tcp_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(tcp, f)
        servers = [
            await asyncio.start_unix_server(
                _relay_to(int(tcp[f"{name}_port"])),  # type: ignore[call-overload]
                path=f"{info['ip']}-{info[f'{name}_port']}",
            )
            for name in CHANNELS
        ]
        kernel = await asyncio.create_subprocess_exec(
            *[tcp_file if arg == PLACEHOLDER else arg for arg in command],
            preexec_fn=_die_with_parent,
        )
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, kernel.send_signal, signum)
        status = await kernel.wait()
        for server in servers:
            server.close()
        return status


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: relay.py <connection file> -- <kernel command>", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run(argv[0], argv[2:]))
    return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
