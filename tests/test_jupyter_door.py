"""The Jupyter door (``kernel_env/server/jupyter/``) against a real ``kernel-env serve``.

Jupyter Server 2 itself is the first client (``jupyter server --gateway-url``): it lists
kernel_env's kernelspecs, starts a kernel through its own REST API, runs cells over its own
channels (proxied to the door), interrupts, restarts and shuts down. Then the door's attacks,
driven directly over HTTP and WebSocket: no token, another tenant's token (exactly the
unknown-id answer), a foreign Origin, oversized frames and bodies, a flood of executes, and
the bounds on kernels per tenant and on idle kernels. JupyterLab's client library
(``@jupyterlab/services``, under node) drives a kernel too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai import FakeOpenAI
from jupyterkit import gateway_client
from procs import peak_growth
from serverkit import ServeProcess, serve_process, wait_until
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from kernel_env import AsyncKernelEnv, KernelEnv
from kernel_env.models import StepResult
from kernel_env.server.jupyter import messages
from kernel_env.server.jupyter.channels import MAX_QUEUED

pytestmark = pytest.mark.integration  # kernels, servers and other processes

TOKENS = {"alice": "alice-jupyter-token-7Qm2xv9L", "bob": "bob-jupyter-token-Rt5nZ8cY"}
OPS = "ops-jupyter-token-Wd4sK6gB"
JUPYTER_TOKEN = "jupyter-server-token-3kPq"
LLM_ANSWER = "hello from the fake model"
MAX_CODE_CHARS = 20_000  # the door's frame limit follows it: 6 x this + 64 KiB


def _tokens_file(tmp: Path) -> Path:
    path = tmp / "tokens"
    lines = [f"{name} client {token}" for name, token in TOKENS.items()]
    path.write_text("\n".join([*lines, f"ops operator {OPS}"]) + "\n")
    path.chmod(0o600)
    return path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")}


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(lambda body: LLM_ANSWER) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(llm: FakeOpenAI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tokens = _tokens_file(tmp_path_factory.mktemp("tokens"))
    args = ["--tokens-file", str(tokens), "--pool-size", "1", "--max-sessions-per-tenant", "2"]
    args += ["--llm-base-url", llm.url, "--llm-model", "fake", "--step-timeout", "90"]
    args += ["--max-code-chars", str(MAX_CODE_CHARS)]
    with serve_process(*args, env=_env()) as served:
        yield served


def auth(name: str, scheme: str = "token") -> dict[str, str]:
    return {"Authorization": f"{scheme} {TOKENS.get(name, OPS)}"}


def ws_url(base: str, path: str) -> str:
    return base.replace("http://", "ws://", 1) + path


def request(msg_type: str, content: dict[str, Any], channel: str = "shell") -> dict[str, Any]:
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "test",
              "username": "test", "date": "", "version": "5.3"}  # fmt: skip
    return {"header": header, "parent_header": {}, "metadata": {}, "content": content,
            "channel": channel}  # fmt: skip


def execute(ws: ClientConnection, code: str, timeout: float = 60) -> dict[str, Any]:
    """Run ``code`` over the channels: its iopub messages and its execute_reply."""
    sent = request("execute_request", {"code": code, "silent": False, "store_history": True})
    ws.send(json.dumps(sent))
    return collect(ws, sent["header"]["msg_id"], timeout)


def collect(ws: ClientConnection, msg_id: str, timeout: float = 60) -> dict[str, Any]:
    """The messages answering ``msg_id``, until its reply and its idle both came."""
    return collect_all(ws, [msg_id], timeout)[msg_id]


def collect_all(ws: ClientConnection, ids: list[str], timeout: float = 60) -> dict[str, Any]:
    """The messages answering each of ``ids``, until each one's reply and idle came."""
    iopub: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    replies: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(replies) < len(ids) or not all(any(map(_is_idle, iopub[i])) for i in ids):
        msg = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        parent = msg["parent_header"].get("msg_id")
        if parent not in iopub:
            continue
        if msg["channel"] == "iopub":
            iopub[parent].append(msg)
        elif msg["msg_type"].endswith("_reply"):
            replies[parent] = msg["content"]
    return {
        i: {"iopub": iopub[i], "reply": replies[i], "types": [m["msg_type"] for m in iopub[i]]}
        for i in ids
    }


def _is_idle(msg: dict[str, Any]) -> bool:
    return msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"


def stdout(result: dict[str, Any]) -> str:
    return "".join(m["content"]["text"] for m in result["iopub"] if m["msg_type"] == "stream")


def text_result(result: dict[str, Any]) -> str:
    found = [m for m in result["iopub"] if m["msg_type"] == "execute_result"]
    return str(found[-1]["content"]["data"]["text/plain"]) if found else ""


# -- Jupyter Server as the client ----------------------------------------------------------


def jupyter_server(gateway: str, token: str, tmp: Path) -> contextlib.AbstractContextManager[str]:
    """``jupyter server --gateway-url`` at the door, with Jupyter dirs of its own."""
    return gateway_client("jupyter_server", gateway, token, tmp, own_token=JUPYTER_TOKEN)


def test_jupyter_server_drives_a_sandboxed_kernel_env_kernel(
    server: ServeProcess, llm: FakeOpenAI, tmp_path: Path
) -> None:
    """Jupyter Server 2 with ``--gateway-url`` at the door lists kernel_env's kernelspec,
    starts a kernel through its own API, runs a cell and ``llm_query`` over its channels,
    interrupts ``time.sleep(60)`` within 2 s, restarts and shuts the kernel down; the kernel
    is sandboxed (another uid, no network), has the helpers, and is an episode of the server."""
    with (
        jupyter_server(server.url, TOKENS["alice"], tmp_path) as url,
        httpx.Client(
            base_url=url, headers={"Authorization": f"token {JUPYTER_TOKEN}"}, timeout=90
        ) as jupyter,  # fmt: skip
    ):
        specs = jupyter.get("/api/kernelspecs").json()
        assert specs["default"] == "python3"
        assert "kernel_env" in specs["kernelspecs"]["python3"]["spec"]["display_name"]
        started = jupyter.post("/api/kernels", json={"name": "python3"})
        assert started.status_code == 201, started.text
        kernel_id = started.json()["id"]
        door = httpx.get(f"{server.url}/api/kernels", headers=auth("alice")).json()
        assert [k["id"] for k in door] == [kernel_id]  # the gateway's id is the door's
        channels = ws_url(url, f"/api/kernels/{kernel_id}/channels?token={JUPYTER_TOKEN}")
        with connect(channels, open_timeout=30, max_size=None) as ws:
            _runs_cells_and_llm_query(ws, llm, server)
            _is_sandboxed(ws, llm)
            _interrupts(ws, lambda: jupyter.post(f"/api/kernels/{kernel_id}/interrupt"))
        assert jupyter.post(f"/api/kernels/{kernel_id}/restart").status_code == 200
        with connect(channels, open_timeout=30, max_size=None) as ws:
            after = execute(ws, "'x' in dir()")
            assert text_result(after) == "False"  # a fresh kernel: state is gone
        assert jupyter.delete(f"/api/kernels/{kernel_id}").status_code == 204
        gone = httpx.get(f"{server.url}/api/kernels/{kernel_id}", headers=auth("alice"))
        assert gone.status_code == 404


def _runs_cells_and_llm_query(ws: ClientConnection, llm: FakeOpenAI, server: ServeProcess) -> None:
    info = request("kernel_info_request", {})
    ws.send(json.dumps(info))
    assert collect(ws, info["header"]["msg_id"])["reply"]["implementation"] == "kernel_env"
    first = execute(ws, "x = 6*7\nx")
    assert first["reply"]["status"] == "ok"
    assert text_result(first) == "42"
    assert first["types"][0] == "status" and first["types"][-1] == "status"
    asked = len(llm.requests)
    answered = execute(ws, "print(llm_query('hi'))")
    assert answered["reply"]["status"] == "ok", answered
    assert LLM_ANSWER in stdout(answered)
    assert len(llm.requests) == asked + 1  # answered by the server's backend


def _is_sandboxed(ws: ClientConnection, llm: FakeOpenAI) -> None:
    port = int(llm.url.rsplit(":", 1)[1].split("/")[0])
    probe = execute(
        ws,
        "import os, socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); net = 'reached'\n"
        "except OSError as exc:\n"
        "    net = type(exc).__name__\n"
        "print(os.getuid(), net, os.environ.get('KERNEL_PROBE_VALUE'),"
        " all(callable(f) for f in (llm_query, FINAL, FINAL_VAR)))",
    )
    uid, net, probe_env, helpers = stdout(probe).split()
    if os.getuid() == 0:
        assert int(uid) != 0  # the kernel runs as a uid of its own, not the server's
    assert net != "reached"  # no network, not even loopback
    assert probe_env == "None"  # the KERNEL_* env Jupyter Server sent set nothing
    assert helpers == "True"


def _interrupts(ws: ClientConnection, interrupt: Any) -> None:
    sent = request("execute_request", {"code": "import time\ntime.sleep(60)"})
    ws.send(json.dumps(sent))
    time.sleep(0.5)
    started = time.monotonic()
    assert interrupt().status_code == 204
    result = collect(ws, sent["header"]["msg_id"], timeout=10)
    assert time.monotonic() - started < 2.0
    assert result["reply"]["status"] == "error"
    assert result["reply"]["ename"] == "KeyboardInterrupt"
    assert text_result(execute(ws, "x")) == "42"  # state kept


NODE_CLIENTS = Path(__file__).parent / "node"


@pytest.mark.skipif(
    not (NODE_CLIENTS / "node_modules" / "@jupyterlab" / "services").is_dir(),
    reason="needs nodejs and tests/node's packages (make test-deps installs them)",
)
def test_jupyterlab_services_drives_a_kernel_env_kernel(
    server: ServeProcess, llm: FakeOpenAI
) -> None:
    """``@jupyterlab/services``, the client library of JupyterLab and VS Code, under node:
    it lists the kernelspecs, starts a kernel (the token in the channels' URL, as a browser
    sends it), runs a cell and ``llm_query`` over the channels, sees the kernel running, and
    shuts it down."""
    cells = ["x = 6 * 7\nx", "print(llm_query('hi'))"]
    script = NODE_CLIENTS / "jupyterlab_services.mjs"
    ran = subprocess.run(
        ["node", str(script), server.url, TOKENS["bob"], *cells],
        capture_output=True, text=True, timeout=110, cwd=NODE_CLIENTS, env=_env(),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    said = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    stages = {line["stage"]: line for line in said if line["stage"] != "executed"}
    assert stages["specs"]["default"] == "python3" and "python3" in stages["specs"]["names"]
    kernel_id = stages["started"]["id"]
    executed = [line for line in said if line["stage"] == "executed"]
    assert [line["status"] for line in executed] == ["ok", "ok"], executed
    assert executed[0]["outputs"] == ["42"]
    assert LLM_ANSWER in "".join(executed[1]["outputs"])
    assert kernel_id in stages["running"]["ids"]
    assert kernel_id not in stages["shutdown"]["ids"]
    gone = httpx.get(f"{server.url}/api/kernels/{kernel_id}", headers=auth("bob"), timeout=30)
    assert gone.status_code == 404


# -- the door's routes, directly -------------------------------------------------------------


def start_kernel(server: ServeProcess, who: str = "alice") -> str:
    started = httpx.post(f"{server.url}/api/kernels", headers=auth(who), json={}, timeout=90)
    assert started.status_code == 201, started.text
    assert started.headers["location"] == f"/api/kernels/{started.json()['id']}"
    return str(started.json()["id"])


@pytest.fixture
def alices_kernel(server: ServeProcess) -> Iterator[str]:
    kernel_id = start_kernel(server)
    yield kernel_id
    httpx.delete(f"{server.url}/api/kernels/{kernel_id}", headers=auth("alice"), timeout=30)


def test_a_kernel_is_an_episode_of_the_server(server: ServeProcess, alices_kernel: str) -> None:
    """A kernel of the door is a session: listed in ``/sessions``, its cells in ``/web``'s
    feed and in the exported notebook; the token works as ``Bearer`` and ``?token=`` too."""
    channels = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels")
    with connect(channels, additional_headers=auth("alice", "Bearer")) as ws:
        assert execute(ws, "answer_to_all = 6*7")["reply"]["status"] == "ok"
    session_id = uuid.UUID(alices_kernel).hex  # the kernel's id is the session's, as a UUID
    listed = httpx.get(f"{server.url}/sessions", headers=auth("ops", "Bearer")).json()
    mine = [s for s in listed["sessions"] if s["session_id"] == session_id]
    assert mine and mine[0]["kind"] == "jupyter" and mine[0]["tenant"] == "alice"
    feed = httpx.get(f"{server.url}/web/api/sessions/{session_id}/events", headers=auth("ops"))
    assert "answer_to_all = 6*7" in feed.text
    notebook = httpx.get(f"{server.url}/sessions/{session_id}/notebook", headers=auth("alice"))
    assert "answer_to_all = 6*7" in notebook.text
    by_query = httpx.get(
        f"{server.url}/api/kernels/{alices_kernel}", params={"token": TOKENS["alice"]}
    )
    assert by_query.status_code == 200
    assert by_query.json()["execution_state"] == "idle"
    # Only Jupyter's paths take ?token=; and the log shows none.
    assert httpx.get(f"{server.url}/sessions", params={"token": OPS}).status_code == 401
    logged = server.log.read_text(errors="replace")
    assert "token=[redacted]" in logged
    assert not any(token in logged for token in (*TOKENS.values(), OPS))


def test_no_token_is_refused_on_every_route(server: ServeProcess, alices_kernel: str) -> None:
    """Without a token (or with a wrong one) the API answers 401 and the channels socket is
    refused at the handshake."""
    for method, path in _routes(alices_kernel):
        assert httpx.request(method, server.url + path).status_code == 401, path
        wrong = {"Authorization": "token not-a-token-of-anyone"}
        assert httpx.request(method, server.url + path, headers=wrong).status_code == 401
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server.url, f"/api/kernels/{alices_kernel}/channels"))
    assert refused.value.response.status_code == 403


def _routes(kernel_id: str) -> list[tuple[str, str]]:
    return [("GET", "/api/kernels"), ("GET", f"/api/kernels/{kernel_id}"),
            ("DELETE", f"/api/kernels/{kernel_id}"),
            ("POST", f"/api/kernels/{kernel_id}/interrupt"),
            ("POST", f"/api/kernels/{kernel_id}/restart"), ("GET", "/api/kernelspecs")]  # fmt: skip


def test_another_tenants_kernel_is_an_unknown_id(server: ServeProcess, alices_kernel: str) -> None:
    """Bob lists none of Alice's kernels, and every route (the channels socket too) answers
    Alice's id exactly as it answers an id no kernel ever had."""
    assert httpx.get(f"{server.url}/api/kernels", headers=auth("bob")).json() == []
    unknown = str(uuid.uuid4())
    for method, path in _routes(alices_kernel)[1:-1]:
        theirs = httpx.request(method, server.url + path, headers=auth("bob"))
        nobodys = httpx.request(method, server.url + path.replace(alices_kernel, unknown),
                                headers=auth("bob"))  # fmt: skip
        assert theirs.status_code == nobodys.status_code == 404
        assert theirs.content.replace(alices_kernel.encode(), b"ID") == nobodys.content.replace(
            unknown.encode(), b"ID"
        )
    refusals = []
    for kernel_id in (alices_kernel, unknown):
        url = ws_url(server.url, f"/api/kernels/{kernel_id}/channels?token={TOKENS['bob']}")
        with pytest.raises(InvalidStatus) as refused:
            connect(url)
        response = refused.value.response
        refusals.append((response.status_code, response.body.replace(kernel_id.encode(), b"ID")))
    assert refusals[0] == refusals[1] and refusals[0][0] == 404
    alive = httpx.get(f"{server.url}/api/kernels/{alices_kernel}", headers=auth("alice"))
    assert alive.status_code == 200  # bob's DELETE and restart did nothing to it


def test_a_foreign_origin_is_refused_at_the_handshake(
    server: ServeProcess, alices_kernel: str
) -> None:
    """A web page of another origin cannot open a kernel's channels, token or not."""
    url = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels?token={TOKENS['alice']}")
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="http://evil.example")  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    with connect(url, origin=server.url) as ws:  # type: ignore[arg-type]
        assert execute(ws, "1+1")["reply"]["status"] == "ok"


def test_oversized_frames_and_bodies_are_refused(server: ServeProcess, alices_kernel: str) -> None:
    """A frame over the step's body limit closes the socket (1009); the kernel serves the
    next one. A start body that is not Jupyter's, or over 1 MiB, is refused."""
    url = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels?token={TOKENS['alice']}")
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps(request("execute_request", {"code": "#" * (10 * MAX_CODE_CHARS)})))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    with connect(url) as ws:
        assert text_result(execute(ws, "6*7")) == "42"
    base = f"{server.url}/api/kernels"
    for body in (b"[1]", b"{not json", json.dumps({"name": "no-such-kernel"}).encode(),
                 json.dumps({"env": {"KERNEL_X": 1}}).encode()):  # fmt: skip
        refused = httpx.post(base, headers=auth("alice"), content=body)
        assert refused.status_code == 400, body
        assert set(refused.json()) == {"message", "reason"}
    huge = httpx.post(base, headers=auth("alice"), content=b"{" + b" " * (2 << 20) + b"}")
    assert huge.status_code == 413


def test_a_flood_of_executes_is_bounded(server: ServeProcess, alices_kernel: str) -> None:
    """Past MAX_QUEUED executes waiting, each further one is answered at once with an
    error; the queued ones run, in order, and the kernel serves on."""
    url = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels?token={TOKENS['alice']}")
    with connect(url, max_size=None) as ws:
        first = request("execute_request", {"code": "import time; time.sleep(3); n = 0"})
        ws.send(json.dumps(first))
        flood = [request("execute_request", {"code": "n += 1"}) for _ in range(MAX_QUEUED + 40)]
        for sent in flood:
            ws.send(json.dumps(sent))
        replies = collect_all(ws, [m["header"]["msg_id"] for m in flood], 90)
        refused = [r for r in replies.values() if r["reply"].get("ename") == "QueueFull"]
        assert len(refused) >= 40
        ran = [r for r in replies.values() if r["reply"]["status"] == "ok"]
        assert len(ran) <= MAX_QUEUED
        assert text_result(execute(ws, "n")) == str(len(ran))


def test_a_flood_of_large_frames_does_not_grow_the_server(
    server: ServeProcess, alices_kernel: str
) -> None:
    """400 frames of 120 KB (48 MB), sent while a cell runs and read as they are answered:
    the server holds at most MAX_QUEUED of them (16 MiB) and refuses the rest at once, so its
    peak memory grows by far less than what was sent."""
    url = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels?token={TOKENS['alice']}")
    padding = "#" * (6 * MAX_CODE_CHARS - 100)
    with connect(url, max_size=None) as ws, peak_growth(server.pid) as grown:
        ws.send(json.dumps(request("execute_request", {"code": "import time; time.sleep(3)"})))
        flood = [request("execute_request", {"code": f"n = 1 {padding}"}) for _ in range(400)]

        def send() -> None:
            for sent in flood:
                ws.send(json.dumps(sent))

        sender = threading.Thread(target=send)
        sender.start()
        replies = collect_all(ws, [m["header"]["msg_id"] for m in flood], 180)
        sender.join(timeout=60)
    refused = [r for r in replies.values() if r["reply"].get("ename") == "QueueFull"]
    sent_mib = sum(len(json.dumps(m)) for m in flood) / (1 << 20)
    print(
        f"jupyter door: {sent_mib:.0f} MiB of frames grew the server's peak by {grown[0]:.0f} MiB"
    )
    assert len(refused) >= 400 - MAX_QUEUED and grown[0] < sent_mib / 2, (len(refused), grown)


def test_control_interrupts_the_running_cell(server: ServeProcess, alices_kernel: str) -> None:
    """``interrupt_request`` on control ends a running cell within 2 s, state kept."""
    url = ws_url(server.url, f"/api/kernels/{alices_kernel}/channels?token={TOKENS['alice']}")
    with connect(url) as ws:
        execute(ws, "kept = 1")
        running = request("execute_request", {"code": "import time\ntime.sleep(60)"})
        ws.send(json.dumps(running))
        time.sleep(0.5)
        started = time.monotonic()
        stop = request("interrupt_request", {}, channel="control")
        ws.send(json.dumps(stop))
        answered = collect_all(ws, [running["header"]["msg_id"]], timeout=10)
        assert time.monotonic() - started < 2.0
        assert answered[running["header"]["msg_id"]]["reply"]["ename"] == "KeyboardInterrupt"
        assert text_result(execute(ws, "kept")) == "1"


def test_kernels_per_tenant_are_bounded(server: ServeProcess, alices_kernel: str) -> None:
    """A tenant holds at most ``--max-sessions-per-tenant`` kernels: the next start is a 503
    in Jupyter's shape, and a shutdown makes room."""
    second = start_kernel(server)
    try:
        refused = httpx.post(f"{server.url}/api/kernels", headers=auth("alice"), json={})
        assert refused.status_code == 503
        assert "limit" in refused.json()["message"]
        assert len(httpx.get(f"{server.url}/api/kernels", headers=auth("alice")).json()) == 2
    finally:
        httpx.delete(f"{server.url}/api/kernels/{second}", headers=auth("alice"), timeout=30)
    bobs = start_kernel(server, "bob")  # the cap is per tenant
    httpx.delete(f"{server.url}/api/kernels/{bobs}", headers=auth("bob"), timeout=30)


def test_an_idle_kernel_is_culled(llm: FakeOpenAI, tmp_path: Path) -> None:
    """``--idle-ttl`` reaps a kernel nobody sent a request: it leaves the list, its id is
    unknown, and its open channels socket is closed."""
    args = ["--tokens-file", str(_tokens_file(tmp_path)), "--pool-size", "0", "--idle-ttl", "2"]
    with serve_process(*args, env=_env()) as served:
        kernel_id = start_kernel(served)
        url = ws_url(served.url, f"/api/kernels/{kernel_id}/channels?token={TOKENS['alice']}")
        with connect(url) as ws, pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        gone = httpx.get(f"{served.url}/api/kernels/{kernel_id}", headers=auth("alice"))
        assert gone.status_code == 404
        assert httpx.get(f"{served.url}/api/kernels", headers=auth("alice")).json() == []


# -- an agent's episode, attached ------------------------------------------------------------


def channels_of(server: ServeProcess, kernel_id: str, who: str = "alice") -> str:
    return ws_url(server.url, f"/api/kernels/{kernel_id}/channels?token={TOKENS[who]}")


def _code_cells(notebook: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, author) of each step's cell in an exported notebook."""
    return [
        ("".join(c["source"]), c["metadata"]["kernel_env"]["author"])
        for c in notebook["cells"]
        if c["cell_type"] == "code" and "step" in c["metadata"].get("kernel_env", {})
    ]


def test_a_person_attaches_to_an_agents_episode(server: ServeProcess, tmp_path: Path) -> None:
    """An agent's episode over ``/ws`` is a kernel of its owner's: its id in the reset's
    metadata, ``GET /api/kernels`` and ``/sessions``. A Jupyter client attached to it reads
    and sets the agent's variables; the agent's next step sees the change; the notebook and
    ``/web`` have each cell with its author, and the person's cells are no iterations."""
    with KernelEnv(server.url, token=TOKENS["alice"]) as agent:
        kernel_id = agent.reset(task_prompt="keep a secret").observation.metadata["kernel_id"]
        assert agent.execute("secret = 41").observation.result.success
        mine = httpx.get(f"{server.url}/api/kernels", headers=auth("alice")).json()
        assert kernel_id in [k["id"] for k in mine]
        assert httpx.get(f"{server.url}/api/kernels", headers=auth("bob")).json() == []
        rows = httpx.get(f"{server.url}/sessions", headers=auth("ops")).json()["sessions"]
        assert [r["kind"] for r in rows if r["kernel_id"] == kernel_id] == ["ws"]
        with connect(channels_of(server, kernel_id)) as ws:
            assert text_result(execute(ws, "secret")) == "41"
            assert execute(ws, "secret = 42")["reply"]["status"] == "ok"
        seen = agent.execute("print(secret)").observation
        assert seen.result.stdout.strip() == "42"
        assert seen.iteration == 2  # the person's cells are not the agent's iterations
        written = agent.export_notebook(tmp_path / "episode.ipynb")
        session_id = uuid.UUID(kernel_id).hex
        feed = httpx.get(f"{server.url}/web/api/sessions/{session_id}/events", headers=auth("ops"))
        steps = [e for e in feed.json()["events"] if e["kind"] == "step"]
    cells = _code_cells(json.loads(written.read_text()))
    assert cells == [("secret = 41", "agent"), ("secret", "jupyter"),
                     ("secret = 42", "jupyter"), ("print(secret)", "agent")]  # fmt: skip
    assert [e["author"] for e in steps] == ["agent", "jupyter", "jupyter", "agent"]


def test_a_persons_execute_waits_behind_the_agents_cell(server: ServeProcess) -> None:
    """A person's execute sent while the agent's cell runs waits its turn, then runs in the
    same kernel; the ``/web`` feed shows both, each with its author."""
    with KernelEnv(server.url, token=TOKENS["alice"]) as agent:
        kernel_id = agent.reset().observation.metadata["kernel_id"]
        agent.execute("order = []")
        done: list[StepResult[Any]] = []
        running = threading.Thread(target=lambda: done.append(agent.execute(
            "import time\ntime.sleep(2)\norder.append('agent')")))  # fmt: skip
        running.start()
        try:
            assert wait_until(lambda: _state(server, kernel_id) == "busy", 30)
            with connect(channels_of(server, kernel_id)) as ws:
                assert execute(ws, "order.append('person')")["reply"]["status"] == "ok"
                # The agent's cell had ended before the person's ran (its client may read
                # its reply later: on a loaded machine it did).
                assert text_result(execute(ws, "order")) == "['agent', 'person']"
        finally:
            running.join(60)
        assert done and done[0].observation.result.success
        feed = httpx.get(f"{server.url}/web/api/sessions/{uuid.UUID(kernel_id).hex}/events",
                         headers=auth("alice")).json()  # fmt: skip
        authors = [e["author"] for e in feed["events"] if e["kind"] == "step"]
        assert authors == ["agent", "agent", "jupyter", "jupyter"]


def _state(server: ServeProcess, kernel_id: str) -> str:
    found = httpx.get(f"{server.url}/api/kernels/{kernel_id}", headers=auth("alice")).json()
    return str(found.get("execution_state"))


def test_interrupt_reaches_the_agents_running_cell(server: ServeProcess) -> None:
    """``POST /api/kernels/{id}/interrupt`` on an agent's episode ends its running cell: the
    agent's ``/ws`` step returns within 2 s with a KeyboardInterrupt, its state kept. A
    restart, which would end the agent's episode, is refused."""
    with KernelEnv(server.url, token=TOKENS["alice"]) as agent:
        kernel_id = agent.reset().observation.metadata["kernel_id"]
        agent.execute("kept = 'still here'")
        done: list[tuple[float, StepResult[Any]]] = []
        looping = threading.Thread(target=lambda: done.append(
            (time.monotonic(), agent.execute("while True: pass"))))  # fmt: skip
        looping.start()
        try:
            assert wait_until(lambda: _state(server, kernel_id) == "busy", 30)
            time.sleep(0.3)  # the loop is running in the kernel
            sent = time.monotonic()
            stop = httpx.post(f"{server.url}/api/kernels/{kernel_id}/interrupt",
                              headers=auth("alice"))  # fmt: skip
            assert stop.status_code == 204
        finally:
            looping.join(30)
        returned, interrupted = done[0]
        assert returned - sent < 2.0
        result = interrupted.observation.result
        assert not result.success and "KeyboardInterrupt" in (result.exception or "") + str(
            result.outputs
        )
        assert agent.execute("print(kept)").observation.result.stdout.strip() == "still here"
        refused = httpx.post(f"{server.url}/api/kernels/{kernel_id}/restart",
                             headers=auth("alice"))  # fmt: skip
        assert refused.status_code == 400
        assert agent.execute("print(kept)").observation.result.stdout.strip() == "still here"


# -- the client's interrupt, and Ctrl-C ------------------------------------------------------

LOOP = "print('looping', flush=True)\nwhile True: pass"


@pytest.fixture(params=["local", "remote"])
def base_url(request: pytest.FixtureRequest, server: ServeProcess) -> str | None:
    return None if request.param == "local" else server.url


def test_env_interrupt_stops_the_running_cell(base_url: str | None) -> None:
    """``env.interrupt()`` from another thread (or the step's output callback) ends the
    running cell within 2 s, locally and on a server: the step returns with a
    KeyboardInterrupt, and the next step runs in the same kernel, its state kept."""
    token = TOKENS["alice"] if base_url else None
    with KernelEnv(base_url, token=token) as env:
        env.reset()
        env.execute("kept = 7")
        running = threading.Event()
        stopped: list[float] = []  # when the cell's KeyboardInterrupt came out
        done: list[tuple[float, StepResult[Any]]] = []

        def watch(event: dict[str, Any]) -> None:
            running.set()
            if event.get("ename") == "KeyboardInterrupt":
                stopped.append(time.monotonic())

        def loop() -> None:
            seen = env.execute(LOOP, on_output=watch)
            done.append((time.monotonic(), seen))

        looping = threading.Thread(target=loop)
        looping.start()
        try:
            assert running.wait(60)
            sent = time.monotonic()
            env.interrupt()
        finally:
            looping.join(30)
        returned, interrupted = done[0]
        assert stopped[0] - sent < 2.0  # the cell stopped
        assert returned - sent < 10.0  # and its step returned, at once
        result = interrupted.observation.result
        assert not result.success and "KeyboardInterrupt" in str(result.outputs)
        assert env.execute("print(kept)").observation.result.stdout.strip() == "7"
        env.interrupt()  # between steps: nothing runs, nothing happens
        assert env.execute("print(kept)").observation.result.stdout.strip() == "7"
        # The step's own output callback may stop it.
        stopped = env.execute(LOOP, on_output=lambda event: env.interrupt()).observation.result
        assert not stopped.success and "KeyboardInterrupt" in str(stopped.outputs)


async def test_a_cancelled_step_interrupts_its_cell(base_url: str | None) -> None:
    """An ``AsyncKernelEnv`` step whose caller is cancelled (Ctrl-C under ``asyncio.run``)
    interrupts its cell and lets the step return before the cancellation ends: the next step
    runs at once in the same kernel, its state kept."""
    token = TOKENS["alice"] if base_url else None
    async with AsyncKernelEnv(base_url, token=token) as env:
        await env.reset()
        await env.execute("kept = 7")
        running = asyncio.Event()

        async def started(event: dict[str, Any]) -> None:
            running.set()

        step = asyncio.create_task(env.execute(LOOP, on_output=started))
        await asyncio.wait_for(running.wait(), 60)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(step, 5)
        seen = await asyncio.wait_for(env.execute("print(kept)"), 10)
        assert seen.observation.result.stdout.strip() == "7"


_CTRL_C_CLIENT = """
import os, sys, time
from kernel_env import AsyncKernelEnv, KernelEnv

with KernelEnv(sys.argv[1] or None) as env:
    env.reset()
    env.execute("kept = 7")
    try:
        env.execute(LOOP, on_output=lambda event: print(
            "stopped" if event.get("ename") else "running", time.monotonic(), flush=True))
        print("finished", flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
    seen = env.execute("print(kept)").observation.result.stdout.strip()
    print("next", seen, time.monotonic(), flush=True)
""".replace("LOOP", repr(LOOP))


def test_ctrl_c_interrupts_the_episodes_cell(base_url: str | None, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) in a script inside ``env.execute()`` interrupts the episode's cell
    rather than abandoning it: the KeyboardInterrupt comes within 2 s, and the next step runs
    at once in the same kernel, its state kept; locally and on a server."""
    script = tmp_path / "client.py"
    script.write_text(_CTRL_C_CLIENT)
    env = {**_env(), "KERNEL_ENV_TOKEN": TOKENS["alice"]} if base_url else _env()
    command = [sys.executable, str(script), base_url or ""]
    # As in a terminal: a job started in the background (CI's) inherits SIGINT ignored.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                          ) as client:  # fmt: skip
        try:
            lines = _lines_until(client, "running", 90)
            sent = time.monotonic()
            client.send_signal(signal.SIGINT)
            lines += _lines_until(client, "next", 30)
        finally:
            client.kill()
    said = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
    assert "finished" not in said, lines
    stopped_at, interrupted_at = float(said["stopped"][0]), float(said["interrupted"][0])
    seen, next_at = said["next"][0], float(said["next"][1])
    assert stopped_at - sent < 2.0  # the cell stopped: its KeyboardInterrupt came out
    assert interrupted_at - sent < 10.0  # then the step returned and Ctrl-C was raised
    assert seen == "7"  # the same kernel, its state kept
    assert next_at - interrupted_at < 10.0  # at once: not behind an abandoned cell


def _lines_until(process: subprocess.Popen[str], word: str, timeout: float) -> list[str]:
    """The process's lines up to the first that starts with ``word`` (all it said, on failure)."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(word):
            return lines
    raise AssertionError(f"no {word!r} line from the client:\n{''.join(lines)}")


# -- messages, as plain data ----------------------------------------------------------------


def test_messages_are_read_and_built_as_jupyter_defines_them() -> None:
    """A client's message needs a header with a msg_id and a msg_type, a content object and
    a channel; the kernel's carry the parent's header and a fresh msg_id."""
    good = request("execute_request", {"code": "1"})
    parsed = messages.parse(good)
    assert not isinstance(parsed, str) and parsed.msg_type == "execute_request"
    for bad in ([], {"header": {}}, {**good, "channel": "hb"}, {**good, "content": []}):
        assert isinstance(messages.parse(bad), str)
    reply = messages.message("shell", "execute_reply", {"status": "ok"},
                             parent=good["header"], session="s")  # fmt: skip
    assert reply["parent_header"] == good["header"]
    assert reply["header"]["msg_id"] != good["header"]["msg_id"]
    assert reply["header"]["date"].endswith("Z") and reply["channel"] == "shell"
    event = {"output_type": "display_data", "data": {"text/plain": "x"}}
    shown = messages.iopub_for_event(event, parent=good["header"], session="s")
    assert shown is not None
    assert shown["content"] == {"data": {"text/plain": "x"}, "metadata": {}, "transient": {}}
    dropped = messages.iopub_for_event({"output_type": "dropped", "bytes": 9},
                                       parent=good["header"], session="s")  # fmt: skip
    assert dropped is not None and "9 bytes" in dropped["content"]["text"]
    info = messages.kernel_info("python", "1.0")
    assert info["language_info"]["name"] == "python" and info["protocol_version"] == "5.3"


def test_messages_are_jupyter_clients_own() -> None:
    """What the door sends survives jupyter_client's own wire format (signed, serialized and
    read back), as the messages of a kernel do."""
    from jupyter_client.session import Session

    session = Session(key=b"k")
    parent = session.msg("execute_request", {"code": "1"})
    built = messages.message("iopub", "status", {"execution_state": "idle"},
                             parent=parent["header"], session="s")  # fmt: skip
    frames = session.serialize(built)
    _, frames = session.feed_identities(frames[1:] if frames[0] == b"" else frames)
    read = session.deserialize(frames, content=True)
    assert read["msg_type"] == "status" and read["content"] == {"execution_state": "idle"}
    assert read["parent_header"]["msg_id"] == parent["header"]["msg_id"]
    assert set(parent["header"]) <= set(built["header"])
