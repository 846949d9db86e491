"""How many live episodes one server holds, and what each costs: N sandboxed episodes over
``/ws``, each holding its own state, beside N kernels started by hand with jupyter_client.

    python benchmarks/bench_density.py                      # N = 16, 128, 512, 1000; ~15 min
    python benchmarks/bench_density.py --counts 16,128      # a quicker look
    python benchmarks/bench_density.py --causes             # also one kernel's pages by cause:
                                                            # fresh, after 1 step, after 10
    python benchmarks/bench_density.py --merge-pages        # each kernel's pages offered to
                                                            # the Linux kernel's KSM (ksmd on)

Run as root: the kernels run as uids of their own, and only root reads their ``smaps``. One
``kernel-env serve`` subprocess (forkserver, bubblewrap) on loopback; episodes open 8 at a
time, each a WebSocket held open, and set ``mine = i`` and a 1 MiB ``bytearray``. At each N:
the PSS of the whole server tree (the server, the forkserver and every kernel's processes)
divided by N, and its growth since the previous N per episode added (marginal); the time to
open the episodes added; a step's p50 (``mine`` read back by 64 episodes picked at random,
each idle until then) and that of each one's next step, against the same steps with one
episode live, measured first (once the warm pool is full and, merging, ksmd has settled); a
reset's p50 (a spare
episode's kernel replaced, 16 times); the server process's RSS. At the largest N every
episode is asked for its own ``mine``: each must answer its own. The hand-started kernels
(``KernelManager``, unsandboxed, no helpers) are measured alone first, as the floor a kernel
costs without a forkserver.

``--merge-pages``: the server runs with ``--merge-pages`` (each kernel marks its memory for
KSM as it starts; each episode's first cell checks that its own is), ksmd runs for the
benchmark (``run`` = 1, ``pages_to_scan`` = 4000; the previous values restored after), and
each N is measured once ksmd has settled: two full scans at least since its episodes opened,
the last adding under 1 % to the pages merged; the step p50 is measured again with ksmd
paused (merged pages stay merged), which tells ksmd's CPU from the rest. The ``bytearray``
is then random bytes, not zeros: KSM would merge zeros away, and an agent's state is not
zeros.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from jupyter_client.manager import KernelManager
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from procs import descendants, pss_bytes
from serverkit import ServeProcess, serve_process

MiB = 1 << 20
AT_ONCE = 8  # episodes opened at a time: the 2-core machine starts kernels, it does not queue
STEP_SAMPLES = 64
RESET_SAMPLES = 16
POOL = 8  # the server's warm kernels
KSM = Path("/sys/kernel/mm/ksm")
# A merging kernel's first cell: whether all its memory is marked (the server's --merge-pages).
MARKED_CELL = "print(open('/proc/self/ksm_stat').read().split('ksm_merge_any:')[1].split()[0])"


def tree_pss(root: int) -> int:
    return sum(pss_bytes(pid) for pid in {root, *descendants(root)})


def private(pid: int) -> int:
    """Pages only this process maps (dirty and clean), bytes."""
    found = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                found += int(line.split()[1]) * 1024
    except OSError:
        pass
    return found


def by_process(root: int) -> dict[str, tuple[int, int]]:
    """The server tree's processes by command name: how many, and their private pages."""
    found: dict[str, tuple[int, int]] = {}
    for pid in {root, *descendants(root)}:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        count, size = found.get(name, (0, 0))
        found[name] = (count + 1, size + private(pid))
    return found


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- kernels started by hand ---------------------------------------------------------------


def by_hand(n: int) -> dict[str, float]:
    """``n`` kernels started with jupyter_client's ``KernelManager``, each holding the same
    state: the PSS of their processes per kernel."""
    managers = []
    try:
        for i in range(n):
            km = KernelManager(kernel_name="python3")
            km.start_kernel()
            managers.append(km)
            client = km.client()
            client.start_channels()
            client.wait_for_ready(timeout=60)
            client.execute_interactive(f"mine = {i}; blob = bytearray({MiB})", timeout=60)
            client.stop_channels()
        pids = [km.provisioner.pid for km in managers]  # type: ignore[union-attr]
        total = sum(pss_bytes(pid) + sum(pss_bytes(c) for c in descendants(pid)) for pid in pids)
        return {"kernels": n, "pss_per_kernel_mib": total / n / MiB}
    finally:
        for km in managers:
            km.shutdown_kernel(now=True)


# -- episodes over /ws ---------------------------------------------------------------------


async def request(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    reply: dict[str, Any] = json.loads(await ws.recv())
    if reply.get("type") == "error":
        raise RuntimeError(f"{frame['type']} failed: {reply}")
    return reply


async def step(ws: ClientConnection, code: str) -> dict[str, Any]:
    reply = await request(ws, {"type": "step", "data": {"code": code}})
    result: dict[str, Any] = reply["data"]["observation"]["result"]
    if not result["success"]:
        raise RuntimeError(f"step failed: {result}")
    return result


async def open_episode(url: str, i: int, merge: bool = False) -> ClientConnection:
    ws = await connect(url, max_size=None, open_timeout=120, ping_interval=None)
    await request(ws, {"type": "reset", "data": {"max_iterations": 100_000}})
    if merge:
        said = (await step(ws, MARKED_CELL))["stdout"].strip()
        if said != "yes":
            raise RuntimeError(f"episode {i}'s kernel is not marked mergeable: {said!r}")
        await step(ws, f"mine = {i}; blob = bytearray(__import__('os').urandom({MiB}))")
    else:
        await step(ws, f"mine = {i}; blob = bytearray({MiB})")
    return ws


async def open_many(url: str, first: int, last: int, merge: bool = False) -> list[ClientConnection]:
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> ClientConnection:
        async with gate:
            return await open_episode(url, i, merge)

    return list(await asyncio.gather(*(one(i) for i in range(first, last))))


async def asks_back(ws: ClientConnection, i: int) -> float:
    """Seconds for a step that reads the episode's own ``mine`` (which must be ``i``)."""
    start = time.perf_counter()
    result = await step(ws, "print(mine)")
    took = time.perf_counter() - start
    if result["stdout"].strip() != str(i):
        raise AssertionError(f"episode {i} answered {result['stdout']!r}")
    return took


async def step_p50(live: list[ClientConnection], samples: int) -> tuple[float, float]:
    """The p50 (ms) of a step of an idle episode, and of the same episode's next step."""
    first, again = [], []
    for i in random.sample(range(len(live)), min(samples, len(live))):
        first.append(await asks_back(live[i], i))
        again.append(await asks_back(live[i], i))
    return statistics.median(first) * 1000, statistics.median(again) * 1000


async def reset_p50(url: str, samples: int) -> float:
    async with connect(url, max_size=None, open_timeout=120, ping_interval=None) as ws:
        took = []
        for _ in range(samples):
            start = time.perf_counter()
            await request(ws, {"type": "reset", "data": {}})
            took.append(time.perf_counter() - start)
    return statistics.median(took) * 1000


async def pool_warm(base_url: str, size: int, limit: float = 120.0) -> None:
    """Waits until the server's warm pool holds ``size`` kernels (its ``/metrics``)."""
    deadline = time.monotonic() + limit
    async with httpx.AsyncClient(base_url=base_url, trust_env=False) as http:
        while (await http.get("/metrics")).json()["pool_warm"] < size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm pool did not reach {size} kernels in {limit} s")
            await asyncio.sleep(0.5)


async def every_one_answers(live: list[ClientConnection]) -> int:
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> float:
        async with gate:
            return await asks_back(live[i], i)

    await asyncio.gather(*(one(i) for i in range(len(live))))
    return len(live)


@contextlib.contextmanager
def ksmd_running(pages_to_scan: int = 4000) -> Iterator[None]:
    """ksmd on for the block (its previous settings restored after)."""
    names = ("run", "pages_to_scan")
    before = {name: (KSM / name).read_text().strip() for name in names}
    (KSM / "pages_to_scan").write_text(str(pages_to_scan))
    (KSM / "run").write_text("1")
    try:
        yield
    finally:
        for name in reversed(names):
            (KSM / name).write_text(before[name])


@contextlib.contextmanager
def ksmd_paused() -> Iterator[None]:
    """ksmd stopped for the block (``run`` = 0 keeps merged pages merged), then on again."""
    (KSM / "run").write_text("0")
    try:
        yield
    finally:
        (KSM / "run").write_text("1")


def ksm(name: str) -> int:
    return int((KSM / name).read_text())


async def ksm_scanned(least: int = 2, settled: float = 0.01, limit: float = 900.0) -> str:
    """Waits until ksmd has merged what it will: at least ``least`` more full scans, and the
    last of them added under ``settled`` of the pages merged (a page whose merged copy is
    shared by ``max_page_sharing`` others already pairs up again through ksmd's unstable
    tree, which takes scans more); at most ``limit`` s. What it merged."""
    first, start = ksm("full_scans"), time.perf_counter()
    scans, sharing = first, ksm("pages_sharing")
    while time.perf_counter() - start < limit:
        await asyncio.sleep(1)
        if (now := ksm("full_scans")) == scans:
            continue
        before, scans, sharing = sharing, now, ksm("pages_sharing")
        if scans - first >= least and sharing - before <= settled * sharing:
            break
    shared, sharing = (ksm(name) * 4096 / MiB for name in ("pages_shared", "pages_sharing"))
    return (
        f"ksm: {ksm('full_scans') - first} scans in {time.perf_counter() - start:.0f} s; "
        f"{shared:.0f} MiB of merged pages stand for {sharing:.0f} MiB more"
    )


async def density(
    server: ServeProcess, counts: list[int], merge: bool = False
) -> list[dict[str, float]]:
    url = server.url.replace("http", "ws", 1) + "/ws"
    pid = server.process.pid
    live: list[ClientConnection] = []
    rows: list[dict[str, float]] = []
    try:
        live += await open_many(url, 0, 1, merge)
        await pool_warm(server.url, POOL)  # no kernel starting beside the steps alone
        if merge:  # and the one episode's kernel merged with the pool's, as later ones are
            print(await ksm_scanned(), flush=True)
        alone, alone_again = await step_p50(live, 32)
        base_pss = tree_pss(pid)
        previous_n, previous_pss = 1, base_pss
        for n in counts:
            start = time.perf_counter()
            live += await open_many(url, len(live), n, merge)
            opened = time.perf_counter() - start
            await asyncio.sleep(2)  # the pool refills
            if merge:
                print(await ksm_scanned(), flush=True)
            total = tree_pss(pid)
            step, step_again = await step_p50(live, STEP_SAMPLES)
            row = {
                "n": n,
                "open_s": opened,
                "pss_per_episode_mib": total / n / MiB,
                "marginal_mib": (total - previous_pss) / (n - previous_n) / MiB,
                "step_p50_ms": step,
                "step_alone_ms": alone,
                "step_again_p50_ms": step_again,
                "step_again_alone_ms": alone_again,
                "reset_p50_ms": await reset_p50(url, RESET_SAMPLES),
                "server_rss_mib": rss(pid) / MiB,
            }
            if merge:  # the same step with ksmd paused: merged pages stay merged
                with ksmd_paused():
                    row["step_paused_p50_ms"] = (await step_p50(live, STEP_SAMPLES))[0]
            rows.append(row)
            print(_row_text(row), flush=True)
            previous_n, previous_pss = n, total
        answered = await every_one_answers(live)
        print(f"every one of {answered} live episodes answered its own state", flush=True)
        print(f"the server tree at N={len(live)}, private pages by process:")
        for name, (count, size) in sorted(by_process(pid).items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:16} x{count:5}  {size / MiB:9.1f} MiB  ({size / count / MiB:.2f} each)")
    finally:
        await asyncio.gather(*(ws.close() for ws in live), return_exceptions=True)
    return rows


def _row_text(row: dict[str, float]) -> str:
    alone = row["step_alone_ms"]
    paused = row.get("step_paused_p50_ms")
    return (
        f"N={row['n']:5.0f}  PSS/episode {row['pss_per_episode_mib']:5.1f} MiB  "
        f"marginal {row['marginal_mib']:5.1f} MiB  opened in {row['open_s']:6.1f} s  "
        f"step p50 {row['step_p50_ms']:5.1f} ms ({row['step_p50_ms'] / alone:.2f}"
        f"x alone's {alone:.1f})"
        + ("" if paused is None else f" ({paused:.1f} ms, {paused / alone:.2f}x, ksmd paused)")
        + f"; its next step {row['step_again_p50_ms']:5.1f} ms "
        f"({row['step_again_p50_ms'] / row['step_again_alone_ms']:.2f}x alone's "
        f"{row['step_again_alone_ms']:.1f})"
        + f"  reset p50 {row['reset_p50_ms']:5.1f} ms  server RSS {row['server_rss_mib']:5.0f} MiB"
    )


# -- one kernel's pages by cause -------------------------------------------------------------


def causes(pid: int) -> Counter[str]:
    """A process's private pages (dirty and clean, bytes) by what they back: the heap,
    anonymous mappings (the interpreter's arenas, threads' stacks, zmq's buffers), stacks,
    and each file-backed library or module."""
    found: Counter[str] = Counter()
    name = "?"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            name = _cause(head[5] if len(head) > 5 else "")
        elif head[0] in ("Private_Dirty:", "Private_Clean:"):
            found[name] += int(head[1]) * 1024
    return found


def _cause(path: str) -> str:
    if not path:
        return "anonymous (arenas, thread stacks, buffers)"
    if path in ("[heap]", "[stack]"):
        return path
    if path.startswith("["):
        return "kernel mappings"
    return "file: " + os.path.basename(path).split(".cpython")[0]


def forked_kernels(server_pid: int) -> dict[int, str]:
    """The server tree's forked kernels (``ke-kernel``), each with its start time (clock ticks
    since boot, the same inside a sandbox's PID namespace as outside)."""
    found = {}
    for pid in descendants(server_pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "ke-kernel":
                found[pid] = _started(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            continue
    return found


def _started(stat: str) -> str:
    return stat.rsplit(")", 1)[1].split()[19]


_ITS_START = "print(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])"


async def cause_table(server: ServeProcess) -> None:
    """One forked kernel's private pages by cause: a fresh one from the pool (it ran no cell),
    the episode's after its reset and first step, and after 10 steps."""
    url = server.url.replace("http", "ws", 1) + "/ws"
    ws = await open_episode(url, 0)
    try:
        kernels = forked_kernels(server.process.pid)
        now = {pid: causes(pid) for pid in kernels}  # before a step that tells which is ours
        started = (await step(ws, _ITS_START))["stdout"].strip()
        ours = next((pid for pid, start in kernels.items() if start == started), None)
        fresh = max((pid for pid in kernels if pid != ours), default=None)
        if ours is None or fresh is None:
            print("no forked kernel found")
            return
        tables = {"fresh": now[fresh], "1 step": now[ours]}
        for _ in range(8):  # and the step that asked for its start: 10 in all
            await step(ws, "print(mine)")
        tables["10 steps"] = causes(ours)
        print(f"one forked kernel's private pages by cause, MiB (pid {fresh} fresh, {ours}):")
        print(f"  {'':44} " + " ".join(f"{name:>9}" for name in tables))
        every = sum(tables.values(), Counter[str]())
        for cause, _ in every.most_common(10):
            print(f"  {cause:44} " + " ".join(f"{t[cause] / MiB:9.2f}" for t in tables.values()))
        totals = (sum(t.values()) / MiB for t in tables.values())
        print(f"  {'in all':44} " + " ".join(f"{total:9.2f}" for total in totals))
    finally:
        await ws.close()


# -- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="16,128,512,1000")
    parser.add_argument("--hand", type=int, default=16, help="kernels started by hand")
    parser.add_argument("--causes", action="store_true")
    parser.add_argument("--merge-pages", action="store_true", help="KSM: see the docstring")
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.counts.split(","))
    if os.geteuid() != 0:
        sys.exit("bench_density: run as root (the kernels' smaps belong to their own uids)")
    hand = by_hand(args.hand)
    print(f"by hand: {hand['kernels']} kernels, PSS {hand['pss_per_kernel_mib']:.1f} MiB each")
    if args.merge_pages and not (KSM / "run").exists():
        sys.exit("bench_density: --merge-pages needs KSM (/sys/kernel/mm/ksm)")
    serve = ("--pool-size", str(POOL), "--max-sessions", str(max(counts) + 20), "--idle-ttl", "0")
    serve += ("--episodes", "none", "--step-timeout", "120", "--log-level", "warning")
    if args.merge_pages:
        serve += ("--merge-pages", "true")
    with (
        ksmd_running() if args.merge_pages else contextlib.nullcontext(),
        serve_process(*serve) as server,
    ):
        if args.causes:
            asyncio.run(cause_table(server))
        asyncio.run(density(server, counts, args.merge_pages))


if __name__ == "__main__":
    main()
