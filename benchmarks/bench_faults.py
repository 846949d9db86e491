"""F3 and F7 of docs/acceptance.md: how soon a kernel's death, or input(), is reported.

    python benchmarks/bench_faults.py            # ~1 minute on 2 cores
    python benchmarks/bench_faults.py --quick    # 3 rounds, for a smoke run

Each round, in one local episode (5 s step timeout, as the fault tests' T): a trivial step
(`pass`, what the machine adds to any step now), a cell that calls `os._exit(1)` (from the
step's start to its error observation), and a kernel SIGKILLed 0.5 s into `time.sleep(30)`
(from the kill to the observation); then the step after each, which runs in the restarted
kernel; and a cell that calls `input()` (no stdin in an episode). Goals: the death reported
within 2 s, never after T; the next step within 5 s; `input()` failed within 1 s.
``tests/test_faults.py`` checks the behaviour (reported before T, the next step works);
this measures the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

from kernel_env import KernelEnv

STEP_TIMEOUT = 5.0


def timed(env: KernelEnv, code: str) -> tuple[float, bool]:
    """How long the step took, and whether it reported the kernel's death."""
    t0 = time.monotonic()
    result = env.execute(code).observation.result
    return time.monotonic() - t0, (result.exception or "").startswith("KernelDied")


def killed_mid_step(env: KernelEnv) -> tuple[float, bool]:
    """From a SIGKILL of the kernel 0.5 s into a sleeping step to the step's observation."""
    pid = env.environment.kernel.pid  # type: ignore[union-attr]
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Timer(0.5, kill)
    killer.start()
    result = env.execute("import time; time.sleep(30)").observation.result
    reported = time.monotonic()
    killer.join()
    return reported - killed[0], (result.exception or "").startswith("KernelDied")


def measure(rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {
        "trivial step": [], "os._exit(1)": [], "next step after it": [],
        "kill -9 mid-step": [], "next step after the kill": [], "input() fails": [],
    }  # fmt: skip
    with KernelEnv(step_timeout=STEP_TIMEOUT) as env:
        env.reset(max_iterations=10_000)
        for _ in range(rounds):
            samples["trivial step"].append(timed(env, "pass")[0])
            took, died = timed(env, "import os; os._exit(1)")
            assert died, "os._exit(1) was not reported as the kernel's death"
            samples["os._exit(1)"].append(took)
            samples["next step after it"].append(timed(env, "1 + 1")[0])
            took, died = killed_mid_step(env)
            assert died, "the SIGKILL was not reported as the kernel's death"
            samples["kill -9 mid-step"].append(took)
            samples["next step after the kill"].append(timed(env, "1 + 1")[0])
            samples["input() fails"].append(timed(env, "input('name? ')")[0])
    return samples


def report(samples: dict[str, list[float]]) -> str:
    lines = [f"{'what':<26} {'p50':>8} {'max':>8}  goal"]
    goals = {"os._exit(1)": 2.0, "kill -9 mid-step": 2.0, "next step after it": 5.0,
             "next step after the kill": 5.0, "input() fails": 1.0}  # fmt: skip
    for name, s in samples.items():
        goal = goals.get(name)
        verdict = (
            "" if goal is None else f"≤ {goal:.0f} s: {'met' if max(s) <= goal else 'NOT met'}"
        )
        lines.append(f"{name:<26} {statistics.median(s):>7.2f}s {max(s):>7.2f}s  {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, not 10")
    rounds = 3 if parser.parse_args().quick else 10
    samples = measure(rounds)
    print(f"{rounds} rounds, one local episode, step timeout {STEP_TIMEOUT:.0f} s")
    print(report(samples))


if __name__ == "__main__":
    main()
