"""Issue 14, item 4: one kernel budget (``max_kernels``) counts sessions' kernels, the warm pool
and rlm_query children alike; a child that gets no kernel fails in the cell, clearly."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai import FakeOpenAI
from serverkit import small_settings, thread_server

from kernel_env.kernel.fork.zygote import KERNEL_NAME

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def kernel_processes(root: int) -> int:
    """Running ipykernel processes descending from ``root`` (one per kernel, sandboxed or not:
    the kernel's own python, wherever bubblewrap or a fork server put it)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            forked = Path(f"/proc/{entry}/comm").read_text().strip() == KERNEL_NAME
            if not forked and (len(argv) < 3 or argv[1:3] != [b"-m", b"ipykernel_launcher"]):
                continue
            pid = int(entry)
            while pid > 1:
                pid = _ppid(pid)
                if pid == root:
                    count += 1
                    break
    return count


@contextlib.contextmanager
def peak_kernels() -> Iterator[list[int]]:
    """Samples the kernel count every 20 ms while the block runs; yields [peak]."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], kernel_processes(os.getpid()))
            done.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join(5)


def child_model(body: dict[str, Any]) -> str:
    """A child's root model: hold the kernel for 3 s, longer than the pool lets a child wait for
    room (2 s), so that children waiting meanwhile are refused however fast kernels start; then
    answer. A depth-1 child that may recurse asks for grandchildren as well."""
    prompt = next(m["content"] for m in body["messages"] if m["role"] == "user")
    if "DEEP" in prompt and "GRAND" not in prompt:
        return "```repl\nr = rlm_query_batched(['GRAND'] * 4)\nFINAL('child')\n```"
    return "```repl\nimport time\ntime.sleep(3)\nFINAL('child')\n```"


# rlm_max_depth counts levels as OpenEnv does: 1 runs no child, 2 children, 3 grandchildren.
@pytest.mark.parametrize(("depth", "prompt"), [(2, "q"), (3, "DEEP")])
def test_rlm_children_never_exceed_the_kernel_budget(depth: int, prompt: str) -> None:
    """--max-sessions 1 --pool-size 1 (so at most 2 kernels): rlm_query_batched([...] * 8)
    runs at most 2 kernels at once, with children and with grandchildren; children that get
    none fail in the cell with a clear error, and the episode goes on."""
    with FakeOpenAI(child_model) as fake:
        settings = small_settings(
            max_sessions=1, pool_size=1, llm_base_url=fake.url, llm_model="m", step_timeout=120
        )
        with thread_server(settings) as url, httpx.Client(base_url=url, timeout=180) as http:
            reset = http.post("/reset", json={"context": "c", "rlm_max_depth": depth})
            sid = reset.headers["X-Session-Id"]
            code = f"r = rlm_query_batched([{prompt!r}] * 8)\nprint(r)"
            with peak_kernels() as peak:
                step = http.post(
                    "/step", json={"action": {"code": code}}, headers={"X-Session-Id": sid}
                )
            result = step.json()["observation"]["result"]
            assert result["success"], result
            answers = eval(result["stdout"])  # the printed list of 8 answers
            assert "child" in answers
            refused = [a for a in answers if a.startswith("Error:")]
            assert refused and all("no kernel available" in a for a in refused)
            assert "all 2 kernels of this server are in use" in refused[0]
            after = http.post(
                "/step", json={"action": {"code": "print(1 + 1)"}}, headers={"X-Session-Id": sid}
            )
            assert after.json()["observation"]["result"]["stdout"] == "2\n"
            metrics = http.get("/metrics").json()
    assert 1 <= peak[0] <= 2, peak[0]
    assert metrics["max_kernels"] == 2 and metrics["kernels_refused"] >= len(refused)


def test_sessions_and_warm_kernels_share_the_budget() -> None:
    """--max-kernels 2 with a pool of 2: a first session takes a warm kernel; the pool is not
    refilled past the budget, and a second session's reset gets the other warm kernel."""
    settings = small_settings(max_sessions=4, pool_size=2, max_kernels=2)
    with thread_server(settings) as url, httpx.Client(base_url=url, timeout=60) as http:
        first = http.post("/reset", json={"context": "a"})
        second = http.post("/reset", json={"context": "b"})
        assert first.status_code == second.status_code == 200
        third = http.post("/reset", json={"context": "c"})
        assert third.status_code == 503
        assert "no kernel available" in third.json()["detail"]
        assert "X-Session-Id" not in third.headers
        assert http.get("/metrics").json()["kernels"] <= 2
        assert kernel_processes(os.getpid()) <= 2
