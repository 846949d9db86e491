"""One Ctrl-C stops a starting ``kernel-env serve``, whenever it arrives.

Servers are interrupted at many points of their start-up: once their port listens (the socket
is bound before the app is made), at their first line of output, at the last line of their
start-up banner (just before uvicorn runs: its event loop, then its signal handlers, the app,
the lifespan), and while serving. Half of them start with SIGINT ignored, as a job started in
the background inherits it (CI's ``make test``, ``cmd &`` in a script): a server that honoured
SIGINT only once uvicorn's handlers are in would lose that SIGINT and keep listening, with no
one left to stop it. Five start at once, so that the start-ups race on a loaded machine.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from gateway import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KERNEL_ENV = str(Path(sys.executable).with_name("kernel-env"))
LISTENING, FIRST_LINE, BANNER = "its port listens", "its first line", "its banner's last line"
# When the SIGINT is sent: so many seconds after one of those.
POINTS = (
    [(LISTENING, delay) for delay in (0.0, 0.05, 0.2)]
    + [(FIRST_LINE, delay) for delay in (0.0, 0.002)]
    + [(BANNER, delay) for delay in (0.0, 0.002, 0.02, 0.3, 1.0)]
)
STARTS = 2 * len(POINTS)  # each point with SIGINT at its default, then with it ignored
AT_ONCE = 5
REACH_WITHIN = 90.0  # s from the start to its point: a start that fails, or never gets there
STOP_WITHIN = 20.0  # s from the SIGINT to the end of the server's process group


@dataclass
class Stop:
    point: str
    ignored: bool
    said: str  # the last line the server wrote
    status: int | None  # None: still running STOP_WITHIN s after the SIGINT

    def __str__(self) -> str:
        start = "SIGINT ignored at start" if self.ignored else "SIGINT default"
        end = "STILL RUNNING" if self.status is None else f"exit {self.status}"
        return f"{self.point} ({start}; last said {self.said!r}): {end}"


def _listens(port: int) -> bool:
    """Whether a socket listens on 127.0.0.1:``port`` (state 0A in /proc/net/tcp)."""
    wanted = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        return any(
            fields[1] == wanted and fields[3] == "0A"
            for fields in (line.split() for line in table)
            if len(fields) > 3
        )


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


class _Start:
    """One server: its output, and the SIGINT it gets once its point of ``POINTS`` is due."""

    def __init__(self, n: int) -> None:
        self.n, self.port = n, free_port()
        self.trigger, self.delay = POINTS[n % len(POINTS)]
        self.ignored = n >= len(POINTS)
        disposition = signal.SIG_IGN if self.ignored else signal.SIG_DFL
        self.process = subprocess.Popen(
            [KERNEL_ENV, "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--pool-size", "0", "--sandbox", "none", "--forkserver", "false"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,  # a group of its own, as a terminal's foreground job
            preexec_fn=lambda: signal.signal(signal.SIGINT, disposition),
        )  # fmt: skip
        self.output = b""
        self.started = time.monotonic()
        self.sigint_at: float | None = None
        self.sent: float | None = None
        self.stop: Stop | None = None

    def read(self) -> None:
        assert self.process.stderr is not None
        chunk = os.read(self.process.stderr.fileno(), 65536)
        self.output += chunk
        if not chunk:
            self.process.stderr.close()

    def step(self, now: float) -> None:
        """Note the point when it comes; send the SIGINT when due (to the group, as Ctrl-C
        does); judge the end."""
        if self.sigint_at is None and self._reached():
            self.sigint_at = now + self.delay
        if self.sent is None and self.sigint_at is not None and now >= self.sigint_at:
            os.killpg(self.process.pid, signal.SIGINT)
            self.sent = now
        if self.sent is None:
            if self.process.poll() is not None or now - self.started > REACH_WITHIN:
                self.stop = self._verdict(self.process.poll(), f"never reached {self.trigger}")
                self._kill()
            return
        if self.process.poll() is not None and _group_gone(self.process.pid):
            self.stop = self._verdict(self.process.returncode)
        elif now - self.sent > STOP_WITHIN:
            self.stop = self._verdict(None)
            self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _reached(self) -> bool:
        if self.trigger == LISTENING:
            return _listens(self.port)
        if self.trigger == FIRST_LINE:
            return b"\n" in self.output
        return b"kernel-env:   leftovers:" in self.output

    def _verdict(self, status: int | None, point: str = "") -> Stop:
        said = [line for line in self.output.decode(errors="replace").splitlines() if line]
        point = point or f"{self.delay:.3f} s after {self.trigger}"
        return Stop(point, self.ignored, (said or [""])[-1][-90:], status)


def _wave(numbers: range) -> list[Stop]:
    """Servers ``numbers``, started at once, each interrupted at its point. One thread
    watches them all, so that no SIGINT waits for another thread to give up the GIL."""
    starts = [_Start(n) for n in numbers]
    with selectors.DefaultSelector() as selector:
        for start in starts:
            assert start.process.stderr is not None
            selector.register(start.process.stderr, selectors.EVENT_READ, start)
        while any(start.stop is None for start in starts):
            for key, _ in selector.select(timeout=0.002):
                key.data.read()
                if key.data.process.stderr.closed:
                    selector.unregister(key.fileobj)
            now = time.monotonic()
            for start in starts:
                if start.stop is None:
                    start.step(now)
    for start in starts:
        assert start.process.stderr is not None
        start.process.stderr.close()
    return [start.stop for start in starts if start.stop is not None]


@pytest.mark.timeout(300)  # a server that outlives its SIGINT costs STOP_WITHIN
def test_one_sigint_stops_a_starting_server_at_any_point() -> None:
    stops = [
        stop
        for first in range(0, STARTS, AT_ONCE)
        for stop in _wave(range(first, min(first + AT_ONCE, STARTS)))
    ]
    unreached = [stop for stop in stops if stop.point.startswith("never")]
    assert not unreached, "servers that did not start:\n" + "\n".join(map(str, unreached))
    kept = [stop for stop in stops if stop.status is None]
    assert not kept, "servers a SIGINT did not stop:\n" + "\n".join(map(str, kept))
    # Stopped, not crashed: "stopped" (0) once serving began, "interrupted" (130) before.
    assert {stop.status for stop in stops} <= {0, 130}, "\n".join(map(str, stops))
