"""Shell commands beside a kernel: a process of their own in the kernel's sandbox, as its uid.

A command started here is not a child of the kernel and runs none of its code: the host starts
it (a sandboxed kernel's: in the sandbox's namespaces, entered with ``nsenter``, under its
seccomp filter, rlimits and cgroups), with the kernel's minimal environment, and reads its
exit status itself. So nothing a cell does to the kernel's own process (rebinding
``subprocess``, editing ``os.environ``) changes what the command runs or what it reports; what
a cell left in the workspace, the command sees, as any process there would.

Its output is kept up to ``max_output`` bytes a stream (the rest is read and dropped), and a
command past its ``timeout`` is killed with its whole process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

__all__ = ["CommandRun", "run_argv"]

_CHUNK = 65536
_GRACE = 1.0  # seconds the output may still take once the command has gone


@dataclass(frozen=True)
class CommandRun:
    """How a command ended and what it wrote (decoded as UTF-8, bad bytes replaced)."""

    exit_code: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    timed_out: bool = False
    dropped: int = 0  # output bytes past ``max_output``, read and not kept

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


async def _drain(stream: asyncio.StreamReader | None, limit: int) -> tuple[bytes, int]:
    kept, dropped = bytearray(), 0
    if stream is None:
        return b"", 0
    while chunk := await stream.read(_CHUNK):
        room = max(0, limit - len(kept))
        kept += chunk[:room]
        dropped += len(chunk) - min(room, len(chunk))
    return bytes(kept), dropped


async def run_argv(
    argv: list[str], *, env: dict[str, str], cwd: str | None, timeout: float, max_output: int
) -> CommandRun:
    """Run ``argv`` (its own session and process group, stdin closed) to its end or its
    ``timeout``."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    readers = [
        asyncio.ensure_future(_drain(process.stdout, max_output)),
        asyncio.ensure_future(_drain(process.stderr, max_output)),
    ]
    waiting = asyncio.ensure_future(process.wait())
    timed_out = False
    try:
        done, _ = await asyncio.wait([*readers, waiting], timeout=timeout)
        timed_out = waiting not in done or len(done) < len(readers) + 1
    finally:
        # A command past its time, or a caller gone: its group goes. A process that left
        # the group still holding the pipes would keep them open: the readers stop anyway.
        if process.returncode is None or timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.shield(waiting)
        _, pending = await asyncio.wait(readers, timeout=_GRACE)
        for reader in pending:
            reader.cancel()
    (out, lost_out), (err, lost_err) = (
        r.result() if r.done() and not r.cancelled() else (b"", 0) for r in readers
    )
    code = None if timed_out else process.returncode
    return CommandRun(
        exit_code=code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        timed_out=timed_out,
        dropped=lost_out + lost_err,
    )
