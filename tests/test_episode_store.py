"""The episode store (``kernel-env serve --episodes DIR``): every episode a server runs is
kept as it runs, from any door, and read back with ``GET /episodes``, the client's
``episodes()`` and ``kernel-env episodes``; a server's death loses no completed step;
retention keeps the store bounded and never removes a running episode; a tenant sees only
its own; bad files and rows are skipped, never fatal."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
from fake_openai import FakeOpenAI
from serverkit import ServeProcess, serve_process, terminate, wait_until

from kernel_env import KernelEnv
from kernel_env.archive import extract_export
from kernel_env.hostcalls import LLMCall
from kernel_env.notebook import cells_match, notebook_name, notebook_text, recorded_steps
from kernel_env.record import AGENT, JUPYTER, EpisodeRecord, StepRecord
from kernel_env.server.dataset import (
    CARD_NAME,
    DATA_NAME,
    NOTEBOOKS_NAME,
    DatasetWriter,
    episode_row,
)
from kernel_env.server.index import Filters
from kernel_env.server.retention import Keep, Stored, parse_keep, to_remove
from kernel_env.server.settings import ServerSettings, default_episodes
from kernel_env.server.store import INDEX_NAME, EpisodeStore, StoreReader

TOKENS = {
    "alice": "alice-token-Ep4xv9LkP3w",
    "bob": "bob-token-Ep5nZ8cYh1J",
    "ops": "ops-token-Ep6sK6gBq0",
}


def _serve(directory: Path | None, *args: str, env: dict[str, str] | None = None) -> Any:
    store = ["--episodes", str(directory)] if directory is not None else []
    return serve_process("--sandbox", "none", "--pool-size", "2", *store, *args, env=env)


def _as(name: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"} if name else {}


def _episode(
    url: str,
    steps: list[str],
    *,
    tenant: str | None = None,
    **reset: Any,
) -> tuple[str, str]:
    """An episode over stateless HTTP (``POST /reset``, ``POST /step``), never exported nor
    closed: its session id and episode id."""
    headers = _as(tenant)
    reply = httpx.post(f"{url}/reset", json=reset, headers=headers, timeout=60)
    reply.raise_for_status()
    headers["X-Session-Id"] = reply.headers["X-Session-Id"]
    for code in steps:
        step = httpx.post(
            f"{url}/step", json={"action": {"code": code}}, headers=headers, timeout=60
        )
        step.raise_for_status()
    state = httpx.get(f"{url}/state", headers=headers, timeout=30).json()
    return headers["X-Session-Id"], state["episode_id"]


def _listing(url: str, tenant: str | None = None, **params: Any) -> dict[str, Any]:
    reply = httpx.get(f"{url}/episodes", params=params, headers=_as(tenant), timeout=30)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def _every(url: str, **params: Any) -> list[dict[str, Any]]:
    rows, cursor = [], None
    while True:
        page = _listing(url, **params, **({"cursor": cursor} if cursor else {}))
        rows += page["episodes"]
        if (cursor := page["next_cursor"]) is None:
            return rows


# -- 20 episodes of an OpenEnv client that never exports --------------------------------------


def _steps_of(i: int) -> list[str]:
    """The code of the ``i``th OpenEnv episode's steps: one asks the model (llm_query)."""
    answer = "7" if i % 2 == 0 else "wrong"
    return [
        f"x = {i}\nprint('step one of', x)",
        f"said = llm_query('double {i}')\nprint('the model said:', said)",
        f"print('FINAL({answer})')",
    ]


def _doubling_model(body: dict[str, Any]) -> str:
    """The model behind the OpenEnv episodes: ``double N`` is answered ``2N``."""
    return str(2 * int(body["messages"][-1]["content"].split()[-1]))


async def _openenv_episodes(url: str, n: int) -> None:
    """``n`` episodes through OpenEnv's own client (``/ws``): half answered right."""
    from openenv.core.generic_client import GenericEnvClient

    for i in range(n):
        async with GenericEnvClient(base_url=url) as env:
            await env.reset(context=f"ctx {i}", task_prompt=f"task number {i}", expected_answer="7")
            *steps, last = _steps_of(i)
            for code in steps:
                await env.step({"code": code})
            final = await env.step({"code": last})
            assert final.done is True


def _rerun_offline(notebook: str) -> tuple[Any, Any]:
    """A stored notebook, and the same executed top to bottom by nbclient in a fresh kernel
    (its llm_query answered from the answers recorded in it)."""
    from nbclient import NotebookClient

    recorded = nbformat.reads(notebook, as_version=4)
    rerun = nbformat.reads(notebook, as_version=4)
    NotebookClient(rerun, timeout=60, kernel_name="python3").execute()
    return recorded, rerun


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_twenty_episodes_of_a_client_that_never_exports_are_all_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is on by default (in the state dir): 20 episodes of OpenEnv's client, which
    never calls an export, each asking the model once, are all listed with their rewards,
    each notebook valid and re-run offline by nbclient (no model reachable) to the recorded
    outputs; the filters, pages, the client's episodes(), the CLI and the dataset see the
    same."""
    pytest.importorskip("openenv")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("KERNEL_ENV_EPISODES")
    default = Path(default_episodes(env))
    notebooks = {}
    with (
        FakeOpenAI(_doubling_model) as model,
        _serve(None, "--llm-base-url", model.url, "--llm-model", "fake-model", env=env) as server,
    ):
        assert f"episodes: kept in {default}" in server.log.read_text()
        asyncio.run(_openenv_episodes(server.url, 20))
        rows = _every(server.url, limit=7)
        assert len(rows) == 20 and len({r["episode_id"] for r in rows}) == 20
        assert [r["task"] for r in rows] == [f"task number {i}" for i in reversed(range(20))]
        assert all(r["state"] == "done" and r["done"] and r["steps"] == 3 for r in rows)
        rewards = {int(r["task"].split()[-1]): r["reward"] for r in rows}
        assert rewards == {i: 1.0 if i % 2 == 0 else 0.0 for i in range(20)}
        assert len(model.requests) == 20
        for row in rows:
            reply = httpx.get(f"{server.url}/episodes/{row['episode_id']}/notebook", timeout=30)
            assert reply.status_code == 200
            nb = nbformat.reads(reply.text, as_version=4)
            nbformat.validate(nb)
            i = int(row["task"].split()[-1])
            assert [c.source for c in recorded_steps(nb)] == _steps_of(i)
            assert nb.metadata["kernel_env"]["reward"] == row["reward"]
            notebooks[i] = reply.text
        assert len(_listing(server.url, reward_min=1)["episodes"]) == 10
        assert [r["task"] for r in _listing(server.url, task="NUMBER 1")["episodes"]] == [
            f"task number {i}" for i in (19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 1)
        ]
        with KernelEnv(base_url=server.url) as client:
            assert [r["episode_id"] for r in client.episodes()] == [r["episode_id"] for r in rows]
            assert len(client.episodes(reward_max=0.5, limit=4)) == 4
        _cli("episodes", "dataset", str(tmp_path / "served"), "--url", server.url)
        replayed = _cli("episodes", "replay", rows[0]["episode_id"], "--url", server.url)
        assert "all cells match: 3 match" in replayed and "final answer: wrong" in replayed
    listed = _cli("episodes", "ls", "--episodes", str(default), "--json")
    assert [r["episode_id"] for r in json.loads(listed)["episodes"]] == [
        r["episode_id"] for r in rows
    ]
    # Offline, from the store directory, with no server and no model.
    report = json.loads(
        _cli("episodes", "replay", rows[1]["episode_id"], "--episodes", str(default), "--json")
    )
    assert report["all_match"] and report["counts"] == {"match": 3}
    assert (report["path"], report["final_answer"]) == (rows[1]["episode_id"], "7")
    unknown = _cli_run("episodes", "replay", "no-such-episode", "--episodes", str(default))
    assert unknown.returncode == 2 and "no stored episode has the id" in unknown.stderr
    _check_dataset(tmp_path, default, rows, monkeypatch)
    for name in [n for n in os.environ if n.startswith("KERNEL_ENV_LLM_")]:
        monkeypatch.delenv(name)  # the kernel answers from the recording, or fails
    for i, notebook in sorted(notebooks.items()):
        recorded, rerun = _rerun_offline(notebook)
        steps = list(zip(recorded_steps(recorded), recorded_steps(rerun), strict=True))
        assert [cells_match(old.outputs, new.outputs) for old, new in steps] == [True] * 3
        assert [new.outputs[0].text for _, new in steps] == [
            f"step one of {i}\n",
            f"the model said: {2 * i}\n",
            f"FINAL({'7' if i % 2 == 0 else 'wrong'})\n",
        ]


def _check_dataset(
    tmp_path: Path, store: Path, rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kernel-env episodes dataset`` of the 20 episodes, from the store directory and from
    the server (written above as ``served``), loads with ``datasets`` and filters by reward."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "dataset"
    done = _cli_run("episodes", "dataset", str(out), "--episodes", str(store))
    assert done.returncode == 0, done.stderr
    assert "20 episode(s), 0 skipped" in done.stderr
    data = out / "episodes.jsonl"
    assert data.read_bytes() == (tmp_path / "served" / "episodes.jsonl").read_bytes()
    refused = _cli_run("episodes", "dataset", str(out), "--episodes", str(store))
    assert refused.returncode != 0 and "--overwrite" in refused.stderr
    loaded = datasets.load_dataset("json", data_files=str(data), split="train")
    assert len(loaded) == 20 and "tenant" not in loaded.column_names
    solved = loaded.filter(lambda row: row["reward"] > 0)
    by_task = {r["task"]: r for r in rows}
    assert sorted(solved["episode_id"]) == sorted(
        by_task[f"task number {i}"]["episode_id"] for i in range(0, 20, 2)
    )
    for row in solved:
        i = int(row["task_prompt"].split()[-1])
        assert (row["reward"], row["done"], row["status"], row["iterations"]) == (
            1.0, True, "done", 3,
        )  # fmt: skip
        assert row["final_answer"] == "7" and row["expected_answer"] == "7"
        assert [s["code"] for s in row["steps"]] == _steps_of(i)
        assert [s["stdout"] for s in row["steps"]][1] == f"the model said: {2 * i}\n"
        assert all(s["success"] and s["author"] == "agent" for s in row["steps"])
        [call] = row["steps"][1]["llm_calls"]
        assert (call["prompt"], call["response"]) == (f"double {i}", str(2 * i))
        assert row["started"] <= row["ended"]
    for row in loaded:  # each row's notebook, beside it: the episode's own
        nb = nbformat.read(out / row["notebook"], as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernel_env"]["episode_id"] == row["episode_id"]
    assert len(list((out / "notebooks").iterdir())) == 20
    card = datasets.load_dataset(str(out), split="train")
    assert card["episode_id"] == loaded["episode_id"]


def _cli(*args: str, cwd: Path | None = None, token: str | None = None) -> str:
    done = _cli_run(*args, cwd=cwd, token=token)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cli_run(
    *args: str, cwd: Path | None = None, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KERNEL_ENV_TOKEN"}
    if token is not None:
        env["KERNEL_ENV_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kernel_env", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def test_a_dataset_row_holds_the_steps_as_text_and_no_tenant() -> None:
    """A row is built from a listing row and the notebook: the steps' code (without the
    mark of a cell not to re-run), streams, errors, status and calls; a person's cell is
    not an iteration; the tenant, session and store path are left out."""
    t0 = datetime(2026, 12, 2, 1, 2, 3, tzinfo=UTC)

    def step(index: int, code: str, outputs: list[dict[str, Any]], **more: Any) -> StepRecord:
        return StepRecord(
            index, code, outputs, index, t0, t0 + timedelta(seconds=1), 1.0, **more
        )  # fmt: skip

    record = EpisodeRecord("ep-1", "the whole task " * 200, "ctx", 5, expected_answer="3")
    record.steps = [
        step(
            1, "print('a'); said = llm_query('hi')",
            [{"output_type": "stream", "name": "stdout", "text": "a\n"},
             {"output_type": "stream", "name": "stderr", "text": "warn\n"}],
            status="ok", llm_calls=[LLMCall("llm_query", "hi", "hello", "m", 0.1)],
        ),
        step(
            2, "1 / 0",
            [{"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero",
              "traceback": []}],
            status="error", author=JUPYTER,
        ),
        step(3, "while True: pass", [], status="timeout", interrupted=True),
    ]  # fmt: skip
    listed = {
        "episode_id": "ep-1", "session_id": "s", "tenant": "alice", "kernel": "python3",
        "task": "the whole", "steps": 3, "reward": 0, "final_answer": None, "done": False,
        "state": "interrupted", "reason": "closed", "started": 10.0, "ended": 12.5,
        "parent": None, "relation": None, "size": 1, "key": 4, "path": "episodes/x",
    }  # fmt: skip
    row = episode_row(listed, notebook_text(record, "ep-1.ipynb"))
    assert not {"tenant", "session_id", "path", "key"} & set(row)
    assert row["task_prompt"] == record.task_prompt and row["reward"] == 0.0
    assert (row["status"], row["reason"], row["done"], row["iterations"]) == (
        "interrupted", "closed", False, 2,
    )  # fmt: skip
    assert [(s["code"], s["stdout"], s["stderr"], s["error"]) for s in row["steps"]] == [
        ("print('a'); said = llm_query('hi')", "a\n", "warn\n", ""),
        ("1 / 0", "", "", "ZeroDivisionError: division by zero"),
        ("while True: pass", "", "", ""),
    ]
    assert [(s["status"], s["success"], s["author"]) for s in row["steps"]] == [
        ("ok", True, AGENT), ("error", False, JUPYTER), ("timeout", False, AGENT),
    ]  # fmt: skip
    assert row["steps"][0]["llm_calls"] == [
        {"op": "llm_query", "prompt": "hi", "response": "hello"}
    ]
    assert json.loads(json.dumps(row)) == row


def test_a_dataset_that_fails_midway_leaves_no_file(tmp_path: Path) -> None:
    """Rows and notebooks are written under temporary names: a failure before the end leaves
    no rows file, no notebooks and no card; a dataset written whole has them all, the rows a
    line of JSON each, each row's notebook named by the row."""
    with pytest.raises(KeyError), DatasetWriter(tmp_path / "out") as dataset:
        dataset.write({"episode_id": "a"})
        raise KeyError("the store went away")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(KeyError), DatasetWriter(tmp_path / "out") as dataset:
        dataset.write({"episode_id": "a"}, b"{}")
        raise KeyError("the store went away")
    assert list((tmp_path / "out").iterdir()) == []
    with DatasetWriter(tmp_path / "out") as dataset:
        dataset.write({"episode_id": "a/b"}, b'{"a": 1}')
        dataset.write({"episode_id": "a?b"}, b'{"b": 2}')  # made safe alike: another name
        dataset.write({"episode_id": "c"})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        CARD_NAME, DATA_NAME, NOTEBOOKS_NAME,
    ]  # fmt: skip
    lines = (tmp_path / "out" / DATA_NAME).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["episode_id"] for row in rows] == ["a/b", "a?b", "c"]
    assert [row.get("notebook") for row in rows] == [
        "notebooks/a_b.ipynb", "notebooks/a_b-2.ipynb", None,
    ]  # fmt: skip
    assert (tmp_path / "out" / rows[1]["notebook"]).read_bytes() == b'{"b": 2}'
    with DatasetWriter(tmp_path / "out", overwrite=True) as dataset:
        dataset.write({"episode_id": "d"}, b"{}")
    assert [p.name for p in (tmp_path / "out" / NOTEBOOKS_NAME).iterdir()] == ["d.ipynb"]


# -- every door ---------------------------------------------------------------------------------

DOOR_TOKEN = "door-token-Ep7mW2qRt5"


def _e2b_door(url: str) -> None:
    e2b_ci = pytest.importorskip("e2b_code_interpreter")
    sandbox = e2b_ci.Sandbox.create(api_url=url, sandbox_url=url, api_key=DOOR_TOKEN)
    try:
        assert sandbox.run_code("print('through e2b')").logs.stdout == ["through e2b\n"]
    finally:
        sandbox.kill()


def _jupyter_door(url: str) -> None:
    from websockets.sync.client import connect

    auth = {"Authorization": f"token {DOOR_TOKEN}"}
    kernel = httpx.post(f"{url}/api/kernels", json={}, headers=auth, timeout=60).json()["id"]
    channels = url.replace("http://", "ws://", 1) + f"/api/kernels/{kernel}/channels"
    with connect(channels, additional_headers=auth) as ws:
        msg_id = os.urandom(8).hex()
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": "s",
                  "username": "u", "date": "", "version": "5.3"}  # fmt: skip
        content = {"code": "print('through jupyter')", "silent": False, "store_history": True}
        ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {},
                            "content": content, "channel": "shell"}))  # fmt: skip
        while True:
            msg = json.loads(ws.recv(timeout=60))
            if msg["msg_type"] == "execute_reply" and msg["parent_header"]["msg_id"] == msg_id:
                break
    assert httpx.delete(f"{url}/api/kernels/{kernel}", headers=auth, timeout=60).is_success


def _mcp_door(url: str) -> None:
    headers = {"Authorization": f"Bearer {DOOR_TOKEN}", "Accept": "application/json"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}  # fmt: skip
    opened = httpx.post(f"{url}/mcp", json=init, headers=headers, timeout=60)
    headers["Mcp-Session-Id"] = opened.headers["Mcp-Session-Id"]
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "add_and_execute_code_cell",
                       "arguments": {"code": "print('through mcp')"}}}  # fmt: skip
    answer = httpx.post(f"{url}/mcp", json=call, headers=headers, timeout=60).json()
    assert "through mcp" in answer["result"]["content"][0]["text"], answer
    assert httpx.delete(f"{url}/mcp", headers=headers, timeout=60).is_success


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_door_keeps_its_episodes(tmp_path: Path) -> None:
    """An episode through E2B's SDK, the Jupyter door (kernels API and channels) and MCP is
    kept as one through OpenEnv's protocol is: listed, ended, its cell in its notebook."""
    env = {**os.environ, "KERNEL_ENV_TOKEN": DOOR_TOKEN}
    with _serve(tmp_path / "store", env=env) as server:
        doors = {"e2b": _e2b_door, "jupyter": _jupyter_door, "mcp": _mcp_door}
        for door in doors.values():
            door(server.url)
        auth = {"Authorization": f"Bearer {DOOR_TOKEN}"}

        def kept() -> dict[str, dict[str, Any]]:
            rows = httpx.get(f"{server.url}/episodes", headers=auth, timeout=30).json()
            found = {}
            for row in rows["episodes"]:
                path = f"{server.url}/episodes/{row['episode_id']}/notebook"
                notebook = httpx.get(path, headers=auth, timeout=30).text
                for name in doors:
                    if f"print('through {name}')" in notebook:
                        found[name] = {**row, "notebook": notebook}
            return found

        wait_until(lambda: all(r["state"] != "running" for r in kept().values()), 30)
        found = kept()
    assert sorted(found) == sorted(doors)
    for name, row in found.items():
        nb = nbformat.reads(row["notebook"], as_version=4)
        nbformat.validate(nb)
        assert [c.source for c in recorded_steps(nb)] == [f"print('through {name}')"], name
        assert row["steps"] == 1 and row["state"] in ("done", "interrupted"), row


# -- a server killed mid-episode --------------------------------------------------------------


@pytest.mark.integration
def test_a_server_killed_after_step_3_leaves_the_episode_interrupted_with_3_steps(
    tmp_path: Path,
) -> None:
    """kill -9 after step 3 of 5: a new server on the same directory lists the episode as
    interrupted, its notebook holding the 3 completed steps."""
    with _serve(tmp_path) as first:
        codes = [f"print('step', {n})" for n in range(1, 4)]
        _, episode_id = _episode(first.url, codes, task_prompt="five steps", max_iterations=5)
        row = _listing(first.url)["episodes"][0]
        assert (row["episode_id"], row["state"], row["steps"]) == (episode_id, "running", 3)
        terminate(first.process, signal.SIGKILL)
        first.process.wait(10)
    with _serve(tmp_path) as second:
        [row] = _listing(second.url)["episodes"]
        assert (row["episode_id"], row["state"], row["steps"]) == (episode_id, "interrupted", 3)
        assert "stopped before the episode ended" in row["reason"]
        reply = httpx.get(f"{second.url}/episodes/{episode_id}/notebook", timeout=30)
        nb = nbformat.reads(reply.text, as_version=4)
        nbformat.validate(nb)
        assert [cell.source for cell in recorded_steps(nb)] == codes
        assert [c.outputs[0]["text"] for c in recorded_steps(nb)] == [
            "step 1\n",
            "step 2\n",
            "step 3\n",
        ]


@pytest.mark.integration
def test_a_torn_last_journal_line_is_skipped_and_reported(tmp_path: Path) -> None:
    """kill -9, and half a line at the end of the episode's journal (a kill in the middle of
    its write): the new server keeps the 2 whole steps, says it skipped the torn line, in its
    log and the episode's reason, and serves on."""
    codes = ["print('one')", "print('two')"]
    with _serve(tmp_path) as first:
        _, episode_id = _episode(first.url, codes, task_prompt="torn")
        terminate(first.process, signal.SIGKILL)
        first.process.wait(10)
    [journal] = (tmp_path / "episodes").glob("*/*.journal.jsonl")
    assert len(journal.read_bytes().splitlines()) == 1 + len(codes)
    with open(journal, "ab") as f:
        f.write(b'{"step":{"index":3,"code":"print(\'thr')
    with _serve(tmp_path) as second:
        [row] = _listing(second.url)["episodes"]
        assert (row["episode_id"], row["state"], row["steps"]) == (episode_id, "interrupted", 2)
        assert "1 unreadable journal line(s) skipped" in row["reason"]
        assert "1 unreadable line(s)" in second.log.read_text()
        reply = httpx.get(f"{second.url}/episodes/{episode_id}/notebook", timeout=30)
        nb = nbformat.reads(reply.text, as_version=4)
        nbformat.validate(nb)
        assert [cell.source for cell in recorded_steps(nb)] == codes
        assert not journal.exists()  # its notebook is written: the journal is done with
        _, new = _episode(second.url, ["FINAL('b')"])
        assert _listing(second.url)["episodes"][0]["episode_id"] == new


# -- retention -----------------------------------------------------------------------------


@pytest.mark.integration
def test_retention_by_count_keeps_the_newest_and_never_a_running_episode(tmp_path: Path) -> None:
    """count=3: as episodes end, the oldest go; the oldest of all, still running, stays."""
    with _serve(tmp_path, "--episodes-keep", "count=3") as server:
        _, running = _episode(server.url, ["x = 1"], task_prompt="still running")
        ended = [_episode(server.url, ["FINAL('a')"], task_prompt=f"done {i}")[1] for i in range(5)]
        rows = _every(server.url)
        assert [r["episode_id"] for r in rows] == [*reversed(ended[-2:]), running]
        assert rows[-1]["state"] == "running"
        assert len(list((tmp_path / "episodes").iterdir())) == 3
        gone = httpx.get(f"{server.url}/episodes/{ended[0]}", timeout=10)
        assert gone.status_code == 404


@pytest.mark.integration
def test_retention_by_size_bounds_the_stored_bytes(tmp_path: Path) -> None:
    """size=60KB with episodes of ~20 KB each: what is left stays under it, the newest kept,
    and a running episode stays though it is the oldest."""
    big = "print('y' * 20000)"
    with _serve(tmp_path, "--episodes-keep", "size=60KB") as server:
        _, running = _episode(server.url, [big], task_prompt="running")
        ended = [_episode(server.url, [big, "FINAL('a')"])[1] for _ in range(5)]
        rows = _every(server.url)
        assert rows[-1]["episode_id"] == running and rows[-1]["state"] == "running"
        assert [r["episode_id"] for r in rows[:-1]] == list(reversed(ended))[: len(rows) - 1]
        assert 1 <= len(rows) - 1 < 5
        assert sum(r["size"] for r in rows) <= 60_000
        on_disk = sum(f.stat().st_size for f in (tmp_path / "episodes").rglob("*") if f.is_file())
        assert on_disk == sum(r["size"] for r in rows)


def test_the_keep_flag_is_parsed_with_clear_errors() -> None:
    """Any subset, in any order, with units; a bad part names itself."""
    assert parse_keep("count=10000,age=30d,size=20GiB") == Keep(10000, 30 * 86400, 20 << 30)
    assert parse_keep("size=500MB") == Keep(size=500_000_000)
    assert parse_keep(" age=12h , count=5 ") == Keep(count=5, age=43200)
    for bad, said in [
        ("count=1.5", "count='1.5' is not a valid count"),
        ("age=3 fortnights", "age='3 fortnights'"),
        ("size=-1GB", "size='-1GB'"),
        ("count=0", "count must be greater than 0"),
        ("count=1,count=2", "count is given twice"),
        ("keep=5", "expected count=N, age=DURATION or size=BYTES, got 'keep=5'"),
    ]:
        with pytest.raises(ValueError, match=said.replace("(", r"\(")):
            parse_keep(bad)
    with pytest.raises(ValueError, match="episodes_keep"):
        ServerSettings(episodes_keep="size=lots")
    assert ServerSettings(episodes="none").episodes is None
    assert ServerSettings.from_env({"HOME": "/h"}).episodes == "/h/.local/state/kernel_env/episodes"
    assert ServerSettings.from_env({"KERNEL_ENV_EPISODES": "none"}).episodes is None


def test_retention_removes_the_oldest_first_and_skips_running_ones() -> None:
    """The pure choice: oldest first until within every limit; a running one is passed over."""
    stored = [Stored(k, started=float(k), size=10, running=k == 1) for k in range(1, 7)]
    assert to_remove(stored, Keep(count=3), now=10) == [2, 3, 4]
    assert to_remove(stored, Keep(size=25), now=10) == [2, 3, 4, 5]
    assert to_remove(stored, Keep(age=6.5), now=10) == [2, 3]
    assert to_remove(stored, Keep(count=6, size=60), now=10) == []


# -- tenants ---------------------------------------------------------------------------------


@pytest.fixture
def tenants_server(tmp_path: Path) -> Iterator[ServeProcess]:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "".join(
            f"{name} {'operator' if name == 'ops' else 'client'} {t}\n"
            for name, t in TOKENS.items()
        )
    )
    tokens.chmod(0o600)
    with _serve(tmp_path / "store", "--tokens-file", str(tokens)) as server:
        yield server


@pytest.mark.integration
def test_a_tenant_sees_only_its_own_episodes(tenants_server: ServeProcess) -> None:
    """Another tenant's episode id is answered exactly as an id no episode has, on every
    route; the operator sees every one; no token, or a foreign Origin, is refused."""
    url = tenants_server.url
    _, alices = _episode(url, ["FINAL('a')"], tenant="alice", task_prompt="alice's")
    _, bobs = _episode(url, ["FINAL('b')"], tenant="bob", task_prompt="bob's")
    assert [r["episode_id"] for r in _listing(url, "alice")["episodes"]] == [alices]
    assert [r["episode_id"] for r in _listing(url, "bob")["episodes"]] == [bobs]
    assert {r["episode_id"] for r in _listing(url, "ops")["episodes"]} == {alices, bobs}
    assert _listing(url, "bob", task="alice")["episodes"] == []
    for route in ("/episodes/{}", "/episodes/{}/notebook", "/episodes/{}/export.zip"):
        theirs = httpx.get(url + route.format(alices), headers=_as("bob"), timeout=10)
        nobodys = httpx.get(url + route.format("no-such-episode"), headers=_as("bob"), timeout=10)
        assert theirs.status_code == nobodys.status_code == 404
        assert theirs.json() == nobodys.json()
        assert theirs.json()["exception"] == "UnknownEpisode"
        mine = httpx.get(url + route.format(alices), headers=_as("alice"), timeout=10)
        assert mine.status_code == 200
        assert httpx.get(url + route.format(alices), headers=_as("ops"), timeout=10).is_success
    assert httpx.get(f"{url}/episodes", timeout=10).status_code == 401
    foreign = {**_as("alice"), "Origin": "https://evil.example"}
    assert httpx.get(f"{url}/episodes", headers=foreign, timeout=10).status_code == 403


@pytest.mark.integration
@pytest.mark.timeout(300)  # nine CLI processes, each importing the client (seconds, loaded)
def test_the_cli_reads_a_servers_episodes_with_a_tenants_token(
    tenants_server: ServeProcess, tmp_path: Path
) -> None:
    """``kernel-env episodes ls / show / export --url``, the token in KERNEL_ENV_TOKEN: the
    tenant's own episodes; another's id fails as an unknown one; no token is refused."""
    url, alice = tenants_server.url, TOKENS["alice"]
    codes = ["print('a')", "FINAL('a')"]
    _, alices = _episode(url, codes, tenant="alice", task_prompt="alice's task")
    _, bobs = _episode(url, ["FINAL('b')"], tenant="bob", task_prompt="bob's task")
    listed = json.loads(_cli("episodes", "ls", "--url", url, "--json", token=alice))
    assert [r["episode_id"] for r in listed["episodes"]] == [alices]
    table = _cli("episodes", "ls", "--url", url, token=alice)
    assert alices in table and "alice's task" in table and "1 episode(s)" in table
    shown = json.loads(_cli("episodes", "show", alices, "--url", url, "--json", token=alice))
    assert (shown["episode"]["state"], shown["episode"]["steps"]) == ("done", 2)
    assert shown["forks"] == shown["children"] == [] and "path" not in shown["episode"]
    plain = _cli("episodes", "show", alices, "--url", url, token=alice)
    assert f"episode_id: {alices}" in plain and "state: done" in plain and "reward: " in plain
    theirs = _cli_run("episodes", "show", bobs, "--url", url, token=alice)
    assert theirs.returncode == 2 and "no stored episode has this id" in theirs.stderr
    target = tmp_path / "alice.ipynb"
    assert _cli("episodes", "export", alices, "--url", url, "-o", str(target), token=alice)
    nb = nbformat.read(target, as_version=4)
    nbformat.validate(nb)
    assert [c.source for c in recorded_steps(nb)] == codes
    again = _cli_run("episodes", "export", alices, "--url", url, "-o", str(target), token=alice)
    assert again.returncode == 2 and "add --overwrite" in again.stderr
    refused = _cli_run("episodes", "ls", "--url", url)
    assert refused.returncode == 2 and "401" in refused.stderr
    every = _cli("episodes", "show", bobs, "--episodes", str(tmp_path / "store"))
    assert f"episode_id: {bobs}" in every and "tenant: bob" in every


@pytest.mark.integration
def test_a_stored_episodes_export_zip_holds_its_files(tmp_path: Path) -> None:
    """GET /episodes/{id}/export.zip: its notebook (a running one's, from its journal) and
    its context file, never the journal; the client's own unpacker takes the archive."""
    context = "word " * 4000  # past INLINE_CONTEXT_CHARS: the context goes beside the notebook
    with _serve(tmp_path / "store") as server:
        sid, episode_id = _episode(
            server.url, ["print(len(context))"], context=context, task_prompt="zipped"
        )
        stem = Path(notebook_name(episode_id)).stem

        def archive() -> bytes:
            reply = httpx.get(f"{server.url}/episodes/{episode_id}/export.zip", timeout=30)
            assert reply.status_code == 200 and reply.headers["content-type"] == "application/zip"
            return reply.content

        running = zipfile.ZipFile(io.BytesIO(archive()))
        assert sorted(running.namelist()) == [f"{stem}.context.txt", f"{stem}.ipynb"]
        assert running.read(f"{stem}.context.txt").decode() == context
        nb = nbformat.reads(running.read(f"{stem}.ipynb").decode(), as_version=4)
        assert [c.outputs[0]["text"] for c in recorded_steps(nb)] == [f"{len(context)}\n"]
        step = httpx.post(
            f"{server.url}/step",
            json={"action": {"code": "FINAL('z')"}},
            headers={"X-Session-Id": sid},
            timeout=60,
        )
        assert step.json()["done"] is True
        written = extract_export(archive(), tmp_path / "out", stem=stem)
    assert sorted(p.name for p in written) == [f"{stem}.context.txt", f"{stem}.ipynb"]
    nb = nbformat.read(tmp_path / "out" / f"{stem}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernel_env"]["final_answer"] == "z"


# -- forks -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_fork_is_stored_with_its_parent_link(tmp_path: Path) -> None:
    """A fork's copy is an episode of its own, whose parent is the forked one."""
    with _serve(tmp_path) as server:
        sid, parent = _episode(server.url, ["x = 41"], task_prompt="forked")
        reply = httpx.post(f"{server.url}/sessions/{sid}/fork", json={"n": 1}, timeout=60)
        assert reply.status_code == 200, reply.text
        [fork] = reply.json()["sessions"]
        step = httpx.post(
            f"{server.url}/step",
            json={"action": {"code": "FINAL(x + 1)"}},
            headers={"X-Session-Id": fork["session_id"]},
            timeout=60,
        )
        assert step.json()["done"] is True
        found = httpx.get(f"{server.url}/episodes/{parent}", timeout=10).json()
        assert [f["episode_id"] for f in found["forks"]] == [fork["episode_id"]]
        assert found["children"] == []
        copy = httpx.get(f"{server.url}/episodes/{fork['episode_id']}", timeout=10).json()
        assert copy["episode"]["parent"] == parent
        assert copy["episode"]["relation"] == "fork"
        assert (copy["episode"]["state"], copy["episode"]["steps"]) == ("done", 2)


def _child_model(body: dict[str, Any]) -> str:
    """The model behind rlm_query's child: it answers with code that gives the answer."""
    return "```repl\nFINAL(6 * 7)\n```"


@pytest.mark.integration
def test_an_rlm_query_child_is_stored_with_its_parent_link(tmp_path: Path) -> None:
    """rlm_query's child episode gets a row of its own, linked to its parent, and its
    notebook, valid, beside the parent's."""
    with FakeOpenAI(_child_model) as model:
        model_flags = ("--llm-base-url", model.url, "--llm-model", "fake-model")
        with _serve(tmp_path, *model_flags) as server:
            code = "print(rlm_query('what is six times seven?'))"
            _, parent = _episode(server.url, [code], task_prompt="ask", rlm_max_depth=2)
            found = httpx.get(f"{server.url}/episodes/{parent}", timeout=10).json()
            [child] = found["children"]
            assert (child["parent"], child["relation"], child["state"]) == (parent, "child", "done")
            assert child["final_answer"] == "42" and child["tenant"] == found["episode"]["tenant"]
            reply = httpx.get(f"{server.url}/episodes/{child['episode_id']}/notebook", timeout=10)
            nbformat.validate(nbformat.reads(reply.text, as_version=4))
            nb = httpx.get(f"{server.url}/episodes/{parent}/notebook", timeout=10).text
            assert f"{parent}.child-1-1.ipynb" in nb
            zipped = httpx.get(f"{server.url}/episodes/{parent}/export.zip", timeout=10)
            names = zipfile.ZipFile(io.BytesIO(zipped.content)).namelist()
            assert sorted(names) == [f"{parent}.child-1-1.ipynb", f"{parent}.ipynb"]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_corrupt_notebook_or_row_is_reported_and_skipped(tmp_path: Path) -> None:
    """A notebook file overwritten with garbage answers 500 (the row is still listed); a row
    with values of the wrong type is left out of the listing (``skipped``); the server goes
    on serving both the others and new episodes; the CLI reads what is left."""
    with _serve(tmp_path) as server:
        ids = [_episode(server.url, ["FINAL('a')"], task_prompt=f"t{i}")[1] for i in range(3)]
        broken_file, broken_row, fine = ids
        index = sqlite3.connect(tmp_path / INDEX_NAME)
        with index:
            path = index.execute(
                "SELECT path FROM episodes WHERE episode_id = ?", [broken_file]
            ).fetchone()[0]
            index.execute(
                "UPDATE episodes SET reward = 'lots', started = 'yesterday' WHERE episode_id = ?",
                [broken_row],
            )
        index.close()
        (tmp_path / path).write_bytes(b"\x00not json{")
        page = _listing(server.url)
        assert [r["episode_id"] for r in page["episodes"]] == [fine, broken_file]
        assert page["skipped"] == 1
        reply = httpx.get(f"{server.url}/episodes/{broken_file}/notebook", timeout=10)
        assert reply.status_code == 500 and reply.json()["exception"] == "StoredEpisodeError"
        assert httpx.get(f"{server.url}/episodes/{broken_row}", timeout=10).status_code == 404
        assert httpx.get(f"{server.url}/episodes/{fine}/notebook", timeout=10).is_success
        _, new = _episode(server.url, ["FINAL('b')"])
        assert _listing(server.url)["episodes"][0]["episode_id"] == new
    out = _cli("episodes", "ls", "--episodes", str(tmp_path))
    assert fine in out and broken_file in out and broken_row not in out
    _cli("episodes", "export", fine, "--episodes", str(tmp_path), "-o", str(tmp_path / "x.ipynb"))
    nbformat.validate(nbformat.read(tmp_path / "x.ipynb", as_version=4))
    done = _cli_run("episodes", "dataset", str(tmp_path / "data"), "--episodes", str(tmp_path))
    assert done.returncode == 0 and f"{broken_file} skipped" in done.stderr, done.stderr
    assert "2 episode(s), 1 skipped" in done.stderr
    written = (tmp_path / "data" / "episodes.jsonl").read_text().splitlines()
    assert [json.loads(line)["episode_id"] for line in written] == [new, fine]


def test_an_unreadable_index_is_moved_aside_for_a_new_one(tmp_path: Path) -> None:
    """An index SQLite cannot open is kept beside the store under another name, and the
    store starts over; a reader of a directory with no store says so."""
    tmp_path.joinpath(INDEX_NAME).write_bytes(b"this is not a database" * 100)
    store = EpisodeStore.open_sync(tmp_path, Keep())
    try:
        assert store.page(Filters(), cursor=None, limit=10).episodes == []
    finally:
        store.close()
    assert [p.name.split("-")[0] for p in tmp_path.glob(f"{INDEX_NAME}.unreadable-*")] == [
        f"{INDEX_NAME}.unreadable"
    ]
    with pytest.raises(FileNotFoundError, match="no episode store"):
        StoreReader.read(tmp_path / "elsewhere")


@pytest.mark.integration
def test_no_secret_reaches_the_store(tmp_path: Path) -> None:
    """A reset's hf_token and the server's token appear in no file of the store: not the
    journal of the running episode, not its notebook once ended, not the index; nor in the
    dataset of its episodes, read from the server (with its token) or the directory."""
    hf_token, server_token = "hf_StoreSecret9xQ2", "server-StoreSecret7kW"
    env = {**os.environ, "KERNEL_ENV_TOKEN": server_token}
    directory = tmp_path / "eps"
    with _serve(directory, env=env) as server:
        headers = {"Authorization": f"Bearer {server_token}"}
        reply = httpx.post(
            f"{server.url}/reset", json={"hf_token": hf_token, "context": "c"},
            headers=headers, timeout=60,
        )  # fmt: skip
        reply.raise_for_status()
        headers["X-Session-Id"] = reply.headers["X-Session-Id"]
        step = httpx.post(
            f"{server.url}/step", json={"action": {"code": "x = 1"}}, headers=headers, timeout=60
        )
        step.raise_for_status()
        running = b"".join(p.read_bytes() for p in directory.rglob("*") if p.is_file())
        assert running and hf_token.encode() not in running
        assert server_token.encode() not in running
        closed = httpx.delete(f"{server.url}/sessions/{headers['X-Session-Id']}", headers=headers)
        assert closed.status_code == 204, closed.text

        def ended() -> bool:
            rows = httpx.get(f"{server.url}/episodes", headers=headers, timeout=30).json()
            return bool(rows["episodes"]) and rows["episodes"][0]["state"] != "running"

        assert wait_until(ended, 30)
        served = tmp_path / "served"
        _cli("episodes", "dataset", str(served), "--url", server.url, token=server_token)
    _cli("episodes", "dataset", str(tmp_path / "read"), "--episodes", str(directory))
    datasets = [tmp_path / name / "episodes.jsonl" for name in ("served", "read")]
    assert [len(path.read_text().splitlines()) for path in datasets] == [1, 1]
    kept = {p: p.read_bytes() for p in [*directory.rglob("*"), *datasets] if p.is_file()}
    assert any(p.suffix == ".ipynb" for p in kept), sorted(kept)
    for path, data in kept.items():
        assert hf_token.encode() not in data and server_token.encode() not in data, path
