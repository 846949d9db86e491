"""The oracle of ``openenv validate``: solves the runtime plan's task (validation/runtime.json)
by submitting its expected answer, against a kernel_env server, and prints the reward.

    python validation/oracle.py http://127.0.0.1:8000
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kernel_env import KernelEnv

PLAN = Path(__file__).with_name("runtime.json")


def main(base_url: str) -> float:
    options = json.loads(PLAN.read_text())["reset"]["options"]
    with KernelEnv(base_url=base_url) as env:
        env.reset(**options)
        result = env.execute(f"FINAL({options['expected_answer']!r})")
    assert result.done, result
    return float(result.reward or 0.0)


if __name__ == "__main__":
    print(main(sys.argv[1]))
