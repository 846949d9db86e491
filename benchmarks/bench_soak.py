"""A soak: many sessions churning episodes for half an hour beside hostile neighbours, on a
loaded machine, and what the server holds as it goes.

    python benchmarks/bench_soak.py                     # 64 sessions, 30 minutes, 2 CPU hogs
    python benchmarks/bench_soak.py --minutes 3 --sessions 16   # a quick look

One ``kernel-env serve`` subprocess (forkserver, bubblewrap) on loopback. Each of the
``--sessions`` clients loops: a WebSocket, a reset, 1-8 steps that set and read back its
own state, then (at random) a proper close, an abrupt drop of the connection mid-episode, or
another reset on the same socket. Three neighbours loop a fork bomb, a memory bomb and an
output flood (``tests/attacks.py``), each in its own episode; ``stress-ng --cpu`` loads the
machine. Counted: failed resets (with the reason the server gave, and those with none),
lost replies (a step unanswered within its timeout, or answered with another episode's state),
and every 30 s what the server holds: its descriptors, the kernel uids in use, the kernels'
cgroups, the runtime directories, its kernels. The report compares the first sample after
the warm-up (minute 5, or a sixth of the run) with the last.

Run as root for the uid and cgroup figures (a non-root server's kernels share its uid).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from attacks import FORK_BOMB, MEMORY_BOMB, OUTPUT_FLOOD
from procs import descendants
from serverkit import ServeProcess, serve_process

from kernel_env.kernel.isolation.privilege import KERNEL_UIDS

STEP_TIMEOUT = 20.0  # the server's --step-timeout
REPLY_TIMEOUT = STEP_TIMEOUT + 60  # a reply later than this is lost
SAMPLE_EVERY = 30.0


class Tally:
    def __init__(self) -> None:
        self.episodes = 0
        self.steps = 0
        self.drops = 0
        self.failed_starts: Counter[str] = Counter()
        self.lost: list[str] = []
        self.hostile: Counter[str] = Counter()


async def request(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT))
    return reply


async def reset(ws: ClientConnection, tally: Tally) -> bool:
    reply = await request(ws, {"type": "reset", "data": {"max_iterations": 1000}})
    if reply["type"] == "observation":
        tally.episodes += 1
        return True
    reason = str(reply.get("data", {}).get("message", "")).strip()
    tally.failed_starts[reason[:120] or "(no reason)"] += 1
    return False


async def churner(url: str, n: int, tally: Tally, stop: float) -> None:
    """One client: episodes of a few steps each, ended at random."""
    rng = random.Random(n)
    while time.monotonic() < stop:
        try:
            ws = await connect(url, max_size=None, open_timeout=120, ping_interval=None)
        except (OSError, TimeoutError) as exc:
            tally.failed_starts[f"connect: {exc}"[:120]] += 1
            await asyncio.sleep(1)
            continue
        try:
            await episodes_on(ws, n, rng, tally, stop)
        except TimeoutError:
            tally.lost.append(f"client {n}: a reply never came")
        except Exception as exc:  # the connection closed under us: counted, never fatal
            tally.lost.append(f"client {n}: {type(exc).__name__}: {exc}"[:200])
        finally:
            with contextlib.suppress(Exception):
                await ws.close()


async def episodes_on(
    ws: ClientConnection, n: int, rng: random.Random, tally: Tally, stop: float
) -> None:
    while time.monotonic() < stop:
        if not await reset(ws, tally):
            await asyncio.sleep(1)
            return
        token = rng.randrange(1 << 30)
        for k in range(rng.randint(1, 8)):
            code = f"mine = {token + k}" if k % 2 == 0 else "print(mine)"
            reply = await request(ws, {"type": "step", "data": {"code": code}})
            tally.steps += 1
            result = reply.get("data", {}).get("observation", {}).get("result", {})
            if k % 2 and result.get("stdout", "").strip() != str(token + k - 1):
                tally.lost.append(f"client {n}: read {result.get('stdout')!r}, not its own")
        ending = rng.random()
        if ending < 0.2:  # an abrupt drop: the TCP connection cut, no close frame
            tally.drops += 1
            ws.transport.abort()
            return
        if ending < 0.7:
            return  # a proper close (the caller's)
        # else: another reset on the same socket


async def neighbour(url: str, name: str, code: str, tally: Tally, stop: float) -> None:
    while time.monotonic() < stop:
        try:
            async with connect(url, max_size=None, open_timeout=120, ping_interval=None) as ws:
                if await reset(ws, tally):
                    reply = await request(ws, {"type": "step", "data": {"code": code}})
                    tally.hostile[f"{name}: {reply['type']}"] += 1
        except Exception as exc:
            tally.hostile[f"{name}: {type(exc).__name__}"] += 1
            await asyncio.sleep(1)


# -- what the server holds -----------------------------------------------------------------


def held(server_pid: int) -> dict[str, int]:
    tree = descendants(server_pid)
    first, last = KERNEL_UIDS
    uids = set()
    for pid in tree:
        with contextlib.suppress(OSError):
            uid = os.stat(f"/proc/{pid}").st_uid
            if first <= uid <= last:
                uids.add(uid)
    return {
        "descriptors": len(os.listdir(f"/proc/{server_pid}/fd")),
        "kernel uids": len(uids),
        "cgroups": _cgroups(server_pid),
        "runtime dirs": _runtime_dirs(server_pid),
        "processes": len(tree),
    }


def _cgroups(server_pid: int) -> int:
    """Kernel cgroups under the server's own cgroup directories (each held open by it)."""
    found = 0
    for target in _open_paths(server_pid):
        if target.startswith("/sys/fs/cgroup/") and "/kernel_env/" in target:
            found += sum(1 for child in Path(target).iterdir() if child.is_dir())
    return found


def _runtime_dirs(server_pid: int) -> int:
    """Kernel runtime directories in the server's runtime parent (its lock file held open)."""
    found = 0
    for target in _open_paths(server_pid):
        if "/kernel-env-" in target and target.endswith("/.lock"):
            parent = Path(target).parent
            found += sum(1 for child in parent.iterdir() if child.is_dir())
    return found


def _open_paths(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


async def sampler(server: ServeProcess, stop: float, rows: list[dict[str, float]]) -> None:
    start = time.monotonic()
    while time.monotonic() < stop:
        row: dict[str, float] = {"minute": (time.monotonic() - start) / 60}
        row.update(held(server.process.pid))
        rows.append(row)
        print("  ".join(f"{k} {v:.1f}" if k == "minute" else f"{k} {v}" for k, v in row.items()))
        await asyncio.sleep(SAMPLE_EVERY)


async def soak(server: ServeProcess, args: argparse.Namespace) -> tuple[Tally, list[Any]]:
    url = server.url.replace("http", "ws", 1) + "/ws"
    tally = Tally()
    rows: list[dict[str, float]] = []
    stop = time.monotonic() + args.minutes * 60
    hostile = {"fork bomb": FORK_BOMB, "memory bomb": MEMORY_BOMB, "output flood": OUTPUT_FLOOD}
    await asyncio.gather(
        sampler(server, stop, rows),
        *(churner(url, n, tally, stop) for n in range(args.sessions)),
        *(neighbour(url, name, code, tally, stop) for name, code in hostile.items()),
    )
    return tally, rows


def report(tally: Tally, rows: list[dict[str, float]], minutes: float) -> None:
    print(f"\nepisodes {tally.episodes}, steps {tally.steps}, abrupt drops {tally.drops}")
    print(f"failed starts: {sum(tally.failed_starts.values())}")
    for reason, count in tally.failed_starts.most_common():
        print(f"  {count:5}  {reason}")
    print(f"lost replies: {len(tally.lost)}")
    for line in tally.lost[:20]:
        print(f"  {line}")
    print(f"hostile neighbours: {dict(tally.hostile)}")
    warm = min(5.0, minutes / 6)
    after = [row for row in rows if row["minute"] >= warm]
    if len(after) >= 2:
        first, last = after[0], after[-1]
        print(f"held at minute {first['minute']:.1f} -> {last['minute']:.1f}:")
        for key in first:
            if key != "minute":
                print(f"  {key:14} {first[key]:6.0f} -> {last[key]:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--hogs", type=int, default=2, help="stress-ng CPU hogs (0: none)")
    args = parser.parse_args()
    hogs = None
    if args.hogs:
        hogs = subprocess.Popen(["stress-ng", "--cpu", str(args.hogs), "--quiet"])
    try:
        serve = ("--pool-size", "8", "--max-sessions", str(args.sessions + 8))
        with serve_process(
            *serve, "--step-timeout", str(STEP_TIMEOUT), "--idle-ttl", "120",
            "--log-level", "warning",
        ) as server:  # fmt: skip
            tally, rows = asyncio.run(soak(server, args))
    finally:
        if hogs is not None:
            hogs.terminate()
            hogs.wait(timeout=30)
    report(tally, rows, args.minutes)


if __name__ == "__main__":
    main()
