"""Issue 14, item 3: one cell cannot grow the server without bound. Rich-output floods and
refused huge prompts are cut, with a marker that is the same in the observation, the record
and the export."""

from __future__ import annotations

import io
import json
import threading
import zipfile

import httpx
import pytest
from attacks import HUGE_MESSAGE
from fake_openai import FakeOpenAI
from procs import peak_growth
from serverkit import metrics, serve_process, small_settings, thread_server

from kernel_env import AsyncKernelEnv, EnvConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FLOOD = """
from IPython.display import HTML, display
for _ in range(300):
    display(HTML('x' * 999_000))
"""
HUGE_PROMPT = "llm_query('p' * 15_000_000)"


def _step(client: httpx.Client, sid: str, code: str) -> httpx.Response:
    response = client.post("/step", json={"action": {"code": code}}, headers={"X-Session-Id": sid})
    assert response.status_code == 200, response.text[:500]
    return response


def _export(client: httpx.Client, sid: str) -> dict[str, bytes]:
    response = client.get(f"/sessions/{sid}/export.zip")
    assert response.status_code == 200
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_a_flood_of_rich_outputs_is_cut_with_one_marker_everywhere() -> None:
    """display(HTML('x' * 999_000)) 300 times: the reply holds a few MB, not 286 MiB, and the
    marker saying how many outputs were dropped is in the observation (outputs and text), the
    record and the exported notebook."""
    with (
        thread_server(small_settings(pool_size=1)) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        sid = client.post("/reset", json={"context": "c"}).headers["X-Session-Id"]
        replies = [_step(client, sid, FLOOD) for _ in range(2)]
        for reply in replies:
            assert len(reply.content) < 16_000_000, len(reply.content)
            result = reply.json()["observation"]["result"]
            displays = [o for o in result["outputs"] if o["output_type"] == "display_data"]
            assert 1 <= len(displays) <= 12
            markers = [o for o in result["outputs"] if "rich output(s)" in json.dumps(o)]
            assert len(markers) == 1
            assert "not sent" in result["stdout"]  # the text the model reads says so too
        files = _export(client, sid)
    notebook = next(v for k, v in files.items() if k.endswith(".ipynb"))
    assert len(notebook) < 40_000_000
    assert notebook.count(b"rich output(s)") == 2  # one marker per flooded step


async def test_the_episode_keeps_a_bounded_share_of_outputs() -> None:
    """Past the episode's output budget, a step's outputs are replaced by the episode's
    marker, in the observation and in the record."""
    config = EnvConfig(max_episode_output_chars=3_000_000, step_timeout=60)
    async with AsyncKernelEnv(config=config) as env:
        await env.reset()
        code = "from IPython.display import HTML, display\ndisplay(HTML('y' * 1_000_000))"
        results = [(await env.execute(code)).observation.result for _ in range(4)]
        record = env.environment.record
    assert [len(r.outputs) for r in results[:2]] == [1, 1]
    last = results[-1]
    assert "episode's limit" in last.outputs[-1]["text"] and "episode's limit" in last.stderr
    assert all(o["output_type"] != "display_data" for o in last.outputs)
    assert record.steps[-1].outputs == last.outputs


@pytest.mark.parametrize("max_prompt_chars", [None, 20_000_000])
def test_refused_huge_prompts_keep_nothing_but_their_error(max_prompt_chars: int | None) -> None:
    """After the budget is spent (or over the prompt limit), llm_query with a 15 MB prompt is
    refused, and the refused call keeps only its error: three such steps leave a small
    record and a small export, not 45 MB of prompts. The host's own check (a kernel could skip
    the kernel-side one) is covered by test_the_host_refuses_long_prompts_the_kernel_sent."""
    with FakeOpenAI(lambda body: "ok") as fake:
        extra = {"max_prompt_chars": max_prompt_chars} if max_prompt_chars else {}
        settings = small_settings(llm_base_url=fake.url, llm_model="m", llm_max_calls=1, **extra)
        with thread_server(settings) as url, httpx.Client(base_url=url, timeout=120) as client:
            sid = client.post("/reset", json={"context": "c"}).headers["X-Session-Id"]
            assert _step(client, sid, "llm_query('spend the budget')").json()["observation"][
                "result"
            ]["success"]
            for _ in range(3):
                result = _step(client, sid, HUGE_PROMPT).json()["observation"]["result"]
                expected = "budget exceeded" if max_prompt_chars else "exceeds the limit"
                assert expected in (result["exception"] or ""), result["exception"]
            files = _export(client, sid)
    assert sum(len(v) for v in files.values()) < 1_000_000
    notebook = next(v for k, v in files.items() if k.endswith(".ipynb")).decode()
    if max_prompt_chars:  # refused on the host by the budget: a marker in place of the prompt
        assert "15,000,000 chars not kept: the call failed" in notebook
    else:  # over the prompt limit: refused in the kernel, never sent, nothing to record
        assert "chars not kept" not in notebook and "exceeds the limit" in notebook
    assert "p" * 1000 not in notebook
    assert len(fake.requests) == 1


def test_the_host_refuses_long_prompts_the_kernel_sent() -> None:
    """A cell that skips the kernel-side check (calling the host directly) still gets its
    over-long prompt refused by the host, and the record keeps only the error."""
    code = (
        "import sys\n"
        "ks = sys.modules['kernel_env.inkernel.extension']\n"
        "ks._episode.call_host('llm_query', prompt='q' * 2_000_000, model=None)"
    )
    with FakeOpenAI(lambda body: "ok") as fake:
        settings = small_settings(llm_base_url=fake.url, llm_model="m")
        with thread_server(settings) as url, httpx.Client(base_url=url, timeout=120) as client:
            sid = client.post("/reset", json={"context": "c"}).headers["X-Session-Id"]
            result = _step(client, sid, code).json()["observation"]["result"]
            assert "exceeds the limit of 1,000,000" in (result["exception"] or "")
            files = _export(client, sid)
    notebook = next(v for k, v in files.items() if k.endswith(".ipynb")).decode()
    assert "2,000,000 chars not kept: the call failed" in notebook
    assert fake.requests == []


def test_a_cells_huge_message_restarts_its_kernel_not_the_server() -> None:
    """A 400 MB message from a cell to the host is dropped unread: the server's peak RSS grows
    by at most 64 MiB, the step's kernel is restarted and its observation says why, /metrics
    counts it, and another session steps normally meanwhile."""
    with (
        serve_process("--pool-size", "2", "--step-timeout", "60") as served,
        httpx.Client(base_url=served.url, timeout=120) as client,
    ):
        one = client.post("/reset", json={"context": "c"}).headers["X-Session-Id"]
        other = client.post("/reset", json={"context": "c"}).headers["X-Session-Id"]
        _step(client, one, "x = 1")
        replies: list[httpx.Response] = []
        attack = threading.Thread(target=lambda: replies.append(_step(client, one, HUGE_MESSAGE)))
        with peak_growth(served.pid) as grown:
            attack.start()
            for n in range(5):
                result = _step(client, other, f"print({n} * 3)").json()["observation"]["result"]
                assert result["stdout"] == f"{n * 3}\n", result
            attack.join(timeout=150)
        grown_mib = grown[0]
        result = replies[0].json()["observation"]["result"]
        assert grown_mib <= 64, f"the server's peak RSS grew by {grown_mib:.0f} MiB; {result}"
        assert result["kernel_restarted"] and result["state_lost"], result
        assert "over the host's limit" in result["stderr"], result
        assert "huge" not in result["stdout"]
        seen = metrics(served.url)
        assert seen["oversize_messages"] == 1 and seen["restarts"] == 1, seen
        again = _step(client, one, "print('x' in dir())").json()["observation"]["result"]
        assert again["stdout"] == "False\n", again  # a fresh kernel, which steps normally
