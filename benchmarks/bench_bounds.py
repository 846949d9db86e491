"""What one hostile cell or client can make the server hold: its peak RSS growth, and a
neighbour's step time, for each attack the server bounds.

    python benchmarks/bench_bounds.py           # every attack, ~1 minute on 2 cores
    python benchmarks/bench_bounds.py --quick   # one round each

One ``kernel-env serve`` subprocess (pool of 2, sandboxed kernels) on loopback, its token set
so that both doors are served. Each attack runs from its own session (or sandbox) while a
neighbour session steps ``x = n`` over HTTP; for each: how much the server's peak RSS grew
(VmHWM reset before it, as root; else RSS sampled every 5 ms), the attack's answer, and the
neighbour's step p50 during the attack beside its p50 alone, measured just before. E2B's file
transfers are measured with E2B's SDK in ``bench_e2b_transfer.py``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from attacks import HUGE_MESSAGE, MiB, chunked, code_body, send_huge
from procs import peak_growth
from serverkit import ServeProcess, serve_process

TOKEN = "e2b_" + secrets.token_hex(20)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _reset(client: httpx.Client) -> str:
    reply = client.post("/reset", json={"context": "c", "max_iterations": 100_000})
    reply.raise_for_status()
    return reply.headers["X-Session-Id"]


def _step(client: httpx.Client, sid: str, code: str) -> dict[str, object]:
    reply = client.post("/step", json={"action": {"code": code}}, headers={"X-Session-Id": sid})
    reply.raise_for_status()
    result: dict[str, object] = reply.json()["observation"]["result"]
    return result


def _huge_message(server: ServeProcess) -> str:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        result = _step(client, _reset(client), HUGE_MESSAGE)
    return f"kernel restarted: {result['kernel_restarted']}"


def _huge_step(server: ServeProcess) -> str:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        sid = _reset(client)
    host = server.url.removeprefix("http://")
    head = (
        f"POST /step HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TOKEN}\r\nX-Session-Id: {sid}\r\n"
    )
    return _huge_bodies(server.url, head)


def _huge_execute(server: ServeProcess) -> str:
    created = httpx.post(
        f"{server.url}/sandboxes", json={}, headers={"X-API-KEY": TOKEN}, timeout=60
    ).json()
    host = server.url.removeprefix("http://")
    head = (
        f"POST /execute HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"E2b-Sandbox-Id: {created['sandboxID']}\r\nE2b-Sandbox-Port: 49999\r\n"
        f"X-Access-Token: {created['envdAccessToken']}\r\n"
    )
    answer = _huge_bodies(server.url, head)
    httpx.delete(
        f"{server.url}/sandboxes/{created['sandboxID']}", headers={"X-API-KEY": TOKEN}, timeout=30
    )
    return answer


def _huge_bodies(url: str, head: str, size: int = 150 * MiB) -> str:
    """``head``'s request with a ``size`` body, declared and then chunked: the answers."""
    declared = send_huge(url, head + f"Content-Length: {size}\r\n", code_body(size))
    streamed = send_huge(url, head + "Transfer-Encoding: chunked\r\n", chunked(code_body(size)))
    return f"HTTP {declared} declared, {streamed} chunked"


ATTACKS: dict[str, Callable[[ServeProcess], str]] = {
    "a cell's 400 MB message to the host": _huge_message,
    "150 MiB POST /step (declared, chunked)": _huge_step,
    "150 MiB POST /execute (declared, chunked)": _huge_execute,
}


def _neighbour_steps(client: httpx.Client, sid: str, until: Callable[[], bool]) -> list[float]:
    times: list[float] = []
    while not until() or len(times) < 5:
        began = time.perf_counter()
        _step(client, sid, f"x = {len(times)}")
        times.append(time.perf_counter() - began)
    return times


def _measure(server: ServeProcess, name: str, attack: Callable[[ServeProcess], str]) -> str:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        sid = _reset(client)
        alone = [t for _ in range(3) for t in _neighbour_steps(client, sid, lambda: True)]
        answer: list[str] = []
        runner = threading.Thread(target=lambda: answer.append(attack(server)))
        with peak_growth(server.pid) as grown:
            runner.start()
            began = time.perf_counter()
            during = _neighbour_steps(client, sid, lambda: not runner.is_alive())
            runner.join()
            wall = time.perf_counter() - began
    ms = 1000
    return (
        f"{name}: {answer[0] if answer else 'raised'}; server peak RSS +{grown[0]:.0f} MiB; "
        f"{wall:.1f} s; neighbour step p50 {statistics.median(during) * ms:.1f} ms during "
        f"(n={len(during)}) vs {statistics.median(alone) * ms:.1f} ms alone"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of each attack")
    args = parser.parse_args()
    rounds = 1 if args.quick else 2
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    with serve_process("--pool-size", "2", "--step-timeout", "120", env=env) as server:
        for name, attack in ATTACKS.items():
            for _ in range(rounds):
                print(_measure(server, name, attack), flush=True)


if __name__ == "__main__":
    main()
