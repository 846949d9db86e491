"""E2B's SDK against kernel_env's own client, on the same ``kernel-env serve``.

    python benchmarks/bench_e2b.py            # ~1 minute on 2 cores
    python benchmarks/bench_e2b.py --quick    # a smoke run

first result   ``Sandbox.create()`` -> its first ``run_code("1 + 1")`` answered (E2B's SDK),
               against ``reset()`` -> its first ``run("1 + 1")`` (kernel_env's client over
               its WebSocket): the time a user waits for a fresh sandbox to compute
run_code p50   one more cell in a warm sandbox: ``run_code("x = x + 1")`` against
               ``run("x = x + 1")``

Both talk to one server on loopback (pool of 2, sandboxed kernels), taking turns, so the
figures differ by the protocol and its client only. Needs the SDK: ``pip install
e2b==2.63.0 e2b-code-interpreter==2.11.5``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from e2b_code_interpreter import Sandbox

from kernel_env import KernelEnv

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serverkit import serving

TOKEN = "e2b_" + secrets.token_hex(20)


def e2b_first(url: str, n: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    sandbox = Sandbox.create(api_url=url, sandbox_url=url, api_key=TOKEN)
    try:
        assert sandbox.run_code("1 + 1").text == "2"
        first = time.perf_counter() - t0
        sandbox.run_code("x = 0")
        cells = []
        for _ in range(n):
            t1 = time.perf_counter()
            sandbox.run_code("x = x + 1")
            cells.append(time.perf_counter() - t1)
        return first, cells
    finally:
        sandbox.kill()


def own_first(url: str, n: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    with KernelEnv(base_url=url, token=TOKEN) as env:
        env.reset(max_iterations=n + 10)
        assert env.run("1 + 1").outputs
        first = time.perf_counter() - t0
        env.run("x = 0")
        cells = []
        for _ in range(n):
            t1 = time.perf_counter()
            env.run("x = x + 1")
            cells.append(time.perf_counter() - t1)
        return first, cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 sandboxes, 10 cells each")
    args = parser.parse_args()
    rounds = 3 if args.quick else 10
    n = 10 if args.quick else 50
    log = Path(tempfile.mkstemp(prefix="bench-e2b-", suffix=".log")[1])
    command = [
        sys.executable,
        "-m",
        "kernel_env",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--pool-size",
        "2",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    results: dict[str, tuple[list[float], list[float]]] = {
        "e2b SDK": ([], []),
        "kernel_env": ([], []),
    }
    with serving(command, log, env=env) as server:
        e2b_first(server.url, 1)  # warm both paths once
        own_first(server.url, 1)
        for _ in range(rounds):
            for name, run in (("e2b SDK", e2b_first), ("kernel_env", own_first)):
                first, cells = run(server.url, n)
                results[name][0].append(first)
                results[name][1].extend(cells)
                time.sleep(0.3)  # the pool refills between sandboxes
    log.unlink(missing_ok=True)
    print(f"{'client':<12} {'first result p50':>18} {'run_code p50':>14} {'run_code p90':>14}")
    for name, (firsts, cells) in results.items():
        p90 = statistics.quantiles(cells, n=10)[-1]
        print(
            f"{name:<12} {statistics.median(firsts) * 1e3:>15.1f} ms "
            f"{statistics.median(cells) * 1e3:>11.2f} ms {p90 * 1e3:>11.2f} ms"
        )


if __name__ == "__main__":
    main()
