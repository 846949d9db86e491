"""Where an episode's CPU goes under the P11 load: the machine's CPU an episode, by process role.

    python benchmarks/bench_episode_cpu.py             # ~2 minutes on 2 cores; needs perf, root
    python benchmarks/bench_episode_cpu.py --rounds 1  # one server of each kind

A forkserver server serves 8 `/ws` sessions of back-to-back episodes (reset + 3 trivial steps,
as P11 of docs/acceptance.md does) while `perf record -a` samples every CPU. Each sample is
put to the role of its process: the kernels (every thread of a forked kernel, from its fork to
its exit), the server, the zygote, the spawner and the launches it forks before their exec,
bubblewrap, the sandbox's placeholder, this load's clients, and the Linux kernel's own threads.
Dividing by the episodes served in the same window gives milliseconds of CPU an episode, user
and system apart. The same load runs against a server whose forked kernels are not sandboxed
(``--sandbox none``), alternated, so the sandbox's share is measured side by side.

Then, one kernel at a time on a quiet machine, a forked kernel's own CPU by phase (its threads'
schedstat): its start up to the reply to a first empty cell, then each of the episode's three
steps; and the floor under any forked kernel, a fork of a process holding the zygote's modules
and kernel template that exits at once (the page tables copied, then unmapped).

The machine's CPU is the ceiling of P11: on 2 cores, an episode that costs C ms of CPU allows
at most 2000 / C episodes a second however it is scheduled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench_forkserver import _kernel_pid, machine_busy_seconds, task_cpu_seconds
from bench_server import Server, descendants, ws_request
from websockets.asyncio.client import connect

from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.sandboxed import SandboxedKernel

FREQUENCY = 997  # samples a second on each CPU (a prime: no lockstep with periodic work)
STEPS = ("x = 1", "y = x + 1", "print(y)")
ROLES = (
    "kernels", "server", "zygote", "spawner", "launches", "bubblewrap", "placeholder",
    "clients", "Linux kernel threads", "other",
)  # fmt: skip


class Load:
    """8 sessions of back-to-back episodes against ``server``, counting finished episodes."""

    def __init__(self, server: Server, sessions: int = 8) -> None:
        self.server, self.sessions = server, sessions
        self.done = 0
        self.stop = False

    async def run(self) -> None:
        await asyncio.gather(*(self._lane() for _ in range(self.sessions)))

    async def _lane(self) -> None:
        async with connect(self.server.ws, max_size=None) as ws:
            while not self.stop:
                await ws_request(ws, {"type": "reset"})
                for code in STEPS:
                    await ws_request(ws, {"type": "step", "data": {"code": code}})
                self.done += 1


async def measure(label: str, flags: list[str], seconds: float) -> dict[str, object]:
    """One server under the load: episodes/s, the machine's CPU an episode, and the perf
    samples put to roles."""
    server = Server("--pool-size", "4", "--max-sessions", "16", *flags)
    data = Path(tempfile.mkstemp(prefix="bench-episode-cpu-", suffix=".perf")[1])
    try:
        await server.wait_pool_full(4)
        load = Load(server)
        running = asyncio.create_task(load.run())
        await asyncio.sleep(3)  # the pool's refills and the lanes settle
        known = _long_lived(server)
        perf = subprocess.Popen(
            ["perf", "record", "-a", "-F", str(FREQUENCY), "-o", str(data), "-q"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.sleep(0.5)  # perf's start
        done0, busy0, t0 = load.done, machine_busy_seconds(), time.perf_counter()
        await asyncio.sleep(seconds)
        done, busy = load.done - done0, machine_busy_seconds() - busy0
        elapsed = time.perf_counter() - t0
        perf.send_signal(2)
        perf.wait(30)
        if data.stat().st_size == 0:
            raise SystemExit("perf recorded nothing: run as root (or lower perf_event_paranoid)")
        load.stop = True
        await running
        samples = _samples(data, known)
    finally:
        server.stop()
        data.unlink(missing_ok=True)
    return {
        "label": label,
        "eps": done / elapsed,
        "episodes": done,
        "machine_ms": 1000 * busy / done,
        "samples": samples,
        "window": elapsed,
    }


def _long_lived(server: Server) -> dict[int, str]:
    """The roles of the processes that live through the run: this process, the server, its
    zygote and the zygote's spawner."""
    roles = {os.getpid(): "clients", server.process.pid: "server"}
    below = descendants(server.process.pid)
    for pid in below:
        with contextlib.suppress(OSError):
            if b"kernel_env.kernel.fork.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes():
                roles[pid] = "zygote"
                # the spawner is the zygote's child (a launch, the spawner's)
                for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                    if Path(f"/proc/{child}/comm").read_text().strip() == "ke-spawner":
                        roles[int(child)] = "spawner"
    return roles


def _samples(data: Path, known: dict[int, str]) -> Counter[tuple[str, str]]:
    """(role, "user" or "system") -> samples, from ``perf script``."""
    out = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "pid,tid,comm,ip,dso"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    threads: dict[int, set[str]] = defaultdict(set)  # a process's thread names
    rows = []
    for line in out.splitlines():
        fields = line.split()
        ids = next((f for f in fields if "/" in f and f.replace("/", "").isdigit()), None)
        if ids is None:
            continue
        tgid = int(ids.split("/")[0])
        comm = line.split(ids)[0].strip()
        mode = "system" if "[kernel.kallsyms]" in line or "[unknown]" in line else "user"
        threads[tgid].add(comm)
        rows.append((tgid, comm, mode))
    counts: Counter[tuple[str, str]] = Counter()
    for tgid, comm, mode in rows:
        counts[(_role(tgid, comm, threads[tgid], known), mode)] += 1
    return counts


def _role(tgid: int, comm: str, names: set[str], known: dict[int, str]) -> str:
    if tgid in known:
        return known[tgid]
    if tgid == 0 or comm.startswith(("kworker", "ksoftirqd", "rcu", "migration", "kthreadd")):
        return "Linux kernel threads"
    if "ke-kernel" in names or comm.startswith("ZMQbg") or comm == "python":
        return "kernels"  # a forked kernel is named python until it names itself
    if comm == "ke-spawner":
        return "launches"  # a launch forked by the spawner, before its exec
    if comm == "bwrap":
        return "bubblewrap"
    if comm == "sleep":
        return "placeholder"
    return "other"


def report(result: dict[str, object]) -> None:
    samples = result["samples"]
    assert isinstance(samples, Counter)
    episodes = result["episodes"]
    assert isinstance(episodes, int)
    per = 1000 / FREQUENCY / episodes  # ms of CPU an episode per sample
    total = sum(samples.values()) * per
    print(
        f"{result['label']}: {result['eps']:.1f} episodes/s; the machine's CPU an episode "
        f"{result['machine_ms']:.1f} ms (/proc/stat), {total:.1f} ms sampled"
    )
    for role in ROLES:
        user, system = samples[(role, "user")] * per, samples[(role, "system")] * per
        if user + system >= 0.05:
            print(
                f"    {role:<22} {user + system:5.1f} ms  (user {user:4.1f}, system "
                f"{system:4.1f})  {100 * (user + system) / total:4.1f} %"
            )


async def phases(n: int) -> dict[str, list[float]]:
    """A forked sandboxed kernel's own CPU (ms): to its first reply, then each step."""
    out: dict[str, list[float]] = defaultdict(list)
    async with ForkServer() as forkserver:
        for i in range(n + 2):
            kernel = SandboxedKernel(forkserver=forkserver)
            await kernel.start()
            await kernel.execute("")
            pid = _kernel_pid(kernel)
            before = task_cpu_seconds(pid)
            cells = []
            for code in STEPS:
                await kernel.execute(code)
                now = task_cpu_seconds(pid)
                cells.append(now - before)
                before = now
            await kernel.shutdown()
            if i >= 2:  # the first ones warm caches
                out["start"].append(1000 * (before - sum(cells)))
                out["steps"].append(1000 * sum(cells))
    return out


FORK_FLOOR = """
import os, time
from kernel_env.kernel.fork import zygote
from kernel_env.kernel.fork.template import KernelTemplate
from kernel_env.kernel.launch import forked_kernel_flags
import tempfile
zygote._preload_kernel_modules()
KernelTemplate.build(forked_kernel_flags(), tempfile.mkdtemp())
def busy():
    f = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")
b0 = busy()
for _ in range({n}):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(1000 * (busy() - b0) / {n})
"""


def fork_floor(n: int) -> float:
    """The machine's CPU (ms) of a bare fork + exit of a process holding what the zygote
    holds (its modules and kernel template)."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_FLOOR.format(n=n)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return float(out.split()[-1])


async def main(args: argparse.Namespace) -> None:
    if shutil.which("perf") is None:
        raise SystemExit("needs perf (Debian: apt-get install linux-perf), run as root")
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict[str, object]]] = {"sandboxed": [], "unsandboxed": []}
    for _ in range(args.rounds):
        for label, flags in (("sandboxed", []), ("unsandboxed", ["--sandbox", "none"])):
            result = await measure(label, flags, args.seconds)
            results[label].append(result)
            report(result)
    for label, runs in results.items():
        eps = [float(r["eps"]) for r in runs]  # type: ignore[arg-type]
        cpu = [float(r["machine_ms"]) for r in runs]  # type: ignore[arg-type]
        print(
            f"{label}, {len(runs)} runs: {statistics.mean(eps):.1f} episodes/s, "
            f"{statistics.mean(cpu):.1f} ms of the machine's CPU an episode "
            f"(ceiling on {os.cpu_count()} cores: "
            f"{1000 * (os.cpu_count() or 1) / statistics.mean(cpu):.1f}/s)"
        )
    own = await phases(args.kernels)
    print(
        f"a forked sandboxed kernel's own CPU, one at a time (p50 of {args.kernels}): "
        f"start to its first reply {statistics.median(own['start']):.1f} ms, "
        f"three steps {statistics.median(own['steps']):.1f} ms"
    )
    floors = [fork_floor(200) for _ in range(3)]
    print(
        "a bare fork + exit of the zygote's memory (3 x 200): "
        + " / ".join(f"{f:.2f}" for f in floors)
        + " ms of the machine's CPU each"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="servers of each kind, alternated")
    parser.add_argument("--seconds", type=float, default=12.0, help="the sampled window")
    parser.add_argument("--kernels", type=int, default=20, help="kernels timed by phase")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
