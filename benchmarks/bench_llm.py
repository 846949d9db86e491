"""P5: ``llm_query`` round trip from a cell, and ``llm_query_batched`` fan-out.

Targets (docs/acceptance.md): a call with an instant backend <= 1.5 ms; a batch of 100 prompts
against a backend with 20 ms latency at concurrency 16 <= 250 ms (the floor is 7 waves x 20 ms).
Times are taken inside the cell, so they are what kernel code sees. Rows without a target are
for information: they add a real HTTP round trip to a Python ``http.server`` on loopback.

Run: .venv/bin/python benchmarks/bench_llm.py [--calls 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fake_openai import FakeOpenAI

from kernel_env import AsyncKernelEnv
from kernel_env.llm import (
    Budget,
    CallableBackend,
    OpenAIBackend,
    ScriptedBackend,
    Usage,
    as_query_fn,
)

BATCH, LATENCY, CONCURRENCY = 100, 0.020, 16

ONE_BY_ONE = """\
import time as _time
_t0 = _time.perf_counter()
for _i in range({calls}):
    llm_query('ping')
(_time.perf_counter() - _t0) / {calls} * 1000
"""

BATCHED = """\
import time as _time
_t0 = _time.perf_counter()
_answers = llm_query_batched(['ping %d' % _i for _i in range({batch})])
assert len(_answers) == {batch} and not any(a.startswith('Error') for a in _answers)
(_time.perf_counter() - _t0) * 1000
"""


async def in_cell_ms(fn: Callable[[str], Any], code: str, repeats: int) -> list[float]:
    """Run ``code`` (whose last expression is a time in ms) ``repeats`` times in one kernel."""
    async with AsyncKernelEnv(llm_query_fn=fn, step_timeout=120) as env:
        await env.reset(max_iterations=repeats + 2)
        await env.execute(code.replace("{calls}", "5").replace("{batch}", "5"))  # warm-up
        times = []
        for _ in range(repeats):
            result = (await env.execute(code)).observation.result
            if not result.success:
                raise RuntimeError(f"benchmark cell failed: {result.exception}")
            times.append(float(result.stdout))
    return times


async def echo(prompt: str) -> str:
    return prompt


async def sleepy(prompt: str) -> str:
    await asyncio.sleep(LATENCY)
    return prompt


async def main(calls: int, repeats: int) -> None:
    one = ONE_BY_ONE.replace("{calls}", str(calls))
    batched = BATCHED.replace("{batch}", str(BATCH))
    batch = f"llm_query_batched x{BATCH}, 20 ms"
    nan = float("nan")
    with (
        FakeOpenAI(lambda body: "pong") as instant_server,
        FakeOpenAI(lambda body: "pong", latency=LATENCY) as slow_server,
    ):
        http = OpenAIBackend(instant_server.url, "m", api_key="sk-bench")
        slow_http = OpenAIBackend(slow_server.url, "m", api_key="sk-bench", concurrency=CONCURRENCY)
        scripted = ScriptedBackend(lambda p: p)
        cases = [
            ("llm_query, sync callable (lambda p: p)", lambda p: p, one, 1.5),
            ("llm_query, async callable (async def echo)", echo, one, 1.5),
            (
                "llm_query, as_query_fn(ScriptedBackend) + Usage/Budget",
                as_query_fn(scripted, Usage(), Budget(max_calls=10**9)),
                one,
                1.5,
            ),
            ("llm_query, OpenAIBackend -> loopback HTTP", as_query_fn(http, Usage()), one, nan),
            (
                f"{batch} async CallableBackend, c={CONCURRENCY}",
                as_query_fn(CallableBackend(sleepy), Usage()),
                batched,
                250.0,
            ),
            (
                f"{batch} HTTP server, c={CONCURRENCY}",
                as_query_fn(slow_http, Usage()),
                batched,
                250.0,
            ),
        ]
        rows = [(name, await in_cell_ms(fn, code, repeats), t) for name, fn, code, t in cases]
        await http.aclose()
        await slow_http.aclose()
    print_table(rows, calls, repeats)


def print_table(rows: list[tuple[str, list[float], float]], calls: int, repeats: int) -> None:
    print(f"P5 (per-call figures over {calls} calls a cell; median/max of {repeats} cells)")
    print(f"{'what':<62} {'median':>9} {'max':>9} {'target':>8}  ok")
    for name, times, target in rows:
        median, worst = statistics.median(times), max(times)
        ok = "-" if target != target else ("yes" if median <= target else "NO")
        shown = "-" if target != target else f"{target:g}"
        print(f"{name:<62} {median:>7.2f}ms {worst:>7.2f}ms {shown:>8}  {ok}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.repeats))
