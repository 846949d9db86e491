"""P10: export a 200-step episode to .ipynb (target: <= 0.5 s).

Run: .venv/bin/python benchmarks/bench_notebook.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from kernel_env import KernelEnv

STEPS = 200


def main() -> None:
    with KernelEnv(llm_query_fn=lambda p: p.upper(), step_timeout=10) as env:
        env.reset(context="benchmark " * 1000, max_iterations=STEPS + 1)
        for i in range(STEPS):
            code = f"x{i} = {i}\nprint('step', {i})"
            if i % 20 == 0:
                code += "\nllm_query('q')"
            env.execute(code)
        with tempfile.TemporaryDirectory() as tmp:
            times = []
            for run in range(5):
                t0 = time.perf_counter()
                path = env.export_notebook(Path(tmp) / f"run{run}.ipynb")
                times.append(time.perf_counter() - t0)
            size = path.stat().st_size
    print(f"P10 export of a {STEPS}-step episode ({size / 1024:.0f} KiB .ipynb, validated):")
    print(
        f"  median {statistics.median(times) * 1000:.1f} ms, "
        f"max {max(times) * 1000:.1f} ms over {len(times)} runs (target <= 500 ms)"
    )


if __name__ == "__main__":
    main()
