"""MCP's door (``/mcp``, streamable HTTP) against a real ``kernel-env serve``, driven by the
official ``mcp`` SDK's client: OpenEnv ``jupyter_env``'s five tools, one episode per MCP
session, setup and verify commands and their reward, tenants, and bad input; and its stdio
transport (``kernel-env mcp``, alone and bridged to a server), spawned by the SDK's stdio
client and on bare pipes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import procs
import pytest
import websockets
from serverkit import ServeProcess, metrics, serve_process, wait_until
from venvs import cached_venv

from kernel_env.remote import ws_url

httpx2 = pytest.importorskip("httpx2")
mcp_client = pytest.importorskip("mcp.client.session")
mcp_http = pytest.importorskip("mcp.client.streamable_http")
mcp_stdio = pytest.importorskip("mcp.client.stdio")

pytestmark = pytest.mark.integration  # a server and its kernels

TOKENS = {"alice": "alice-token-7Qm2xv9LkP3w", "bob": "bob-token-Rt5nZ8cYh1Ju"}
OPS = "ops-token-Wd4sK6gBq0Ee"
EPISODE = "io.github.kernel-env/episode"
OPENENV_VERSION = "0.10.0"  # the openenv release whose MCPToolClient is driven
FIVE = {
    "add_and_execute_code_cell",
    "edit_and_execute_current_cell",
    "execute_shell_command",
    "get_notebook_state",
    "final_answer",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tokens = tmp_path_factory.mktemp("mcp") / "tokens"
    lines = [f"{name} client {token}" for name, token in TOKENS.items()]
    tokens.write_text("\n".join([*lines, f"ops operator {OPS}"]) + "\n")
    tokens.chmod(0o600)
    with serve_process("--pool-size", "1", "--tokens-file", str(tokens)) as process:
        yield process


def _bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


@contextlib.asynccontextmanager
async def connect(
    url: str, episode: dict[str, Any] | None = None, who: str = "alice"
) -> AsyncIterator[Any]:
    """An initialized SDK client session; the episode's reset options as its extension."""
    async with (
        httpx2.AsyncClient(headers=_bearer(who), timeout=60) as http,
        mcp_http.streamable_http_client(f"{url}/mcp", http_client=http) as (read, write),
        mcp_client.ClientSession(
            read, write, extensions={EPISODE: episode} if episode is not None else None
        ) as session,
    ):
        await session.initialize()
        yield session


async def call(session: Any, name: str, **arguments: Any) -> tuple[str, bool]:
    result = await session.call_tool(name, arguments)
    return "\n".join(c.text for c in result.content), bool(result.is_error)


def kernels(server: ServeProcess) -> int:
    return int(metrics(server.url, OPS)["kernels_in_sessions"])  # type: ignore[call-overload]


async def test_the_tools_keep_state_edit_the_last_cell_and_run_shell(server: ServeProcess) -> None:
    """initialize, the five tools listed, a cell's value, state kept, the last cell replaced,
    a shell command in the sandbox's workspace, and the notebook's summary."""
    async with connect(server.url) as session:
        listed = await session.list_tools()
        assert {tool.name for tool in listed.tools} == FIVE
        assert await call(session, "add_and_execute_code_cell", code="x = 21 * 2\nx") == (
            "42",
            False,
        )
        text, failed = await call(session, "add_and_execute_code_cell", code="y = x +\n")
        assert not failed and text.startswith("ERROR:\nSyntaxError")
        assert await call(session, "edit_and_execute_current_cell", code="y = x + 1\ny") == (
            "43",
            False,
        )
        assert await call(session, "execute_shell_command", command="pwd") == ("/home/user", False)
        text, _ = await call(
            session, "execute_shell_command", command="echo out; echo err >&2; exit 3"
        )
        assert text == "out\nerr\nERROR:\nexit status 3"
        state, _ = await call(session, "get_notebook_state")
        assert state.splitlines() == [
            "[Cell 1] x = 21 * 2 ↵ x",
            "  → 42",
            "[Cell 2] y = x + 1 ↵ y",
            "  → 43",
            "[Cell 3] $ pwd",
            "  → /home/user",
            "[Cell 4] $ echo out; echo err >&2; exit 3",
            "  → out",
            "err",
            "ERROR:",
            "exit status 3",
        ]


async def test_a_command_runs_as_the_kernels_uid_with_no_capability(
    server: ServeProcess,
) -> None:
    """A shell command beside the kernel runs in its sandbox as the uid its cells see, with
    no capability left (a root server's and any other's alike)."""
    async with connect(server.url) as session:
        uid, _ = await call(session, "add_and_execute_code_cell", code="import os; os.getuid()")
        assert await call(session, "execute_shell_command", command="id -u") == (uid, False)
        caps, _ = await call(session, "execute_shell_command", command="grep Cap /proc/self/status")
        assert [line.split()[1] for line in caps.splitlines()[:3]] == ["0" * 16] * 3, caps
        # No descriptor of the server's reaches it: its shell's 0-2, and ls's own directory.
        fds, _ = await call(session, "execute_shell_command", command="ls /proc/self/fd")
        assert set(fds.split()) <= {"0", "1", "2", "3"}, fds


async def test_setup_and_verify_give_the_pass_rate_and_a_written_reward(
    server: ServeProcess,
) -> None:
    """Setup runs after the kernel starts; final_answer runs the verify commands and reports
    their pass rate, or the number a verify command wrote to reward.txt; the episode ends."""
    episode = {
        "setup": ["mkdir -p work && printf seed > work/input.txt"],
        "verify": ["test -f work/answer.txt", "grep -q seed work/input.txt", "false"],
    }
    async with connect(server.url, episode) as session:
        text, _ = await call(
            session, "add_and_execute_code_cell", code="open('work/answer.txt', 'w').write('4')"
        )
        assert text == "1"
        assert await call(session, "final_answer", answer="4") == (
            "Answer submitted: 4\nVerification: 2/3 passed; reward=0.6666666666666666",
            False,
        )
        text, failed = await call(session, "add_and_execute_code_cell", code="1")
        assert failed and "episode is over" in text
    written = {"verify": ["true", "echo 0.25 > /home/user/logs/verifier/reward.txt"]}
    async with connect(server.url, written) as session:
        text, _ = await call(session, "final_answer", answer="x")
        assert text.endswith("Verification: 2/2 passed; reward=0.25")


async def test_a_failing_setup_command_fails_initialize_and_leaves_no_kernel(
    server: ServeProcess,
) -> None:
    """A setup command that fails is initialize's error, naming it; its session is gone."""
    before = kernels(server)
    body = _initialize_body({"extensions": {EPISODE: {"setup": ["echo no; exit 7"]}}})
    answer = _post(server.url, body, _bearer("alice"))
    assert "Mcp-Session-Id" not in answer.headers
    assert answer.json()["error"]["message"] == (
        "setup command failed: echo no; exit 7\nno\nERROR:\nexit status 7"
    )
    assert wait_until(lambda: kernels(server) == before, 10)


async def test_verify_cannot_be_subverted_from_a_cell(server: ServeProcess) -> None:
    """A cell that rebinds subprocess, edits os.environ (PATH to its own `false`), and writes
    reward.txt before final_answer changes nothing: the verify commands are processes of
    their own, in a clean environment, and the reward file is cleared before they run."""
    attack = "\n".join(
        [
            "import os, subprocess",
            "subprocess.run = lambda *a, **k: subprocess.CompletedProcess(a, 0, '', '')",
            "subprocess.Popen = None",
            "os.makedirs('/tmp/evil', exist_ok=True)",
            "open('/tmp/evil/false', 'w').write('#!/bin/sh\\nexit 0\\n')",
            "os.chmod('/tmp/evil/false', 0o755)",
            "os.environ['PATH'] = '/tmp/evil:' + os.environ['PATH']",
            "os.environ['PWNED'] = '1'",
            "os.makedirs('/home/user/logs/verifier', exist_ok=True)",
            "open('/home/user/logs/verifier/reward.txt', 'w').write('1.0')",
        ]
    )
    verify = ["false", 'test "$PWNED" = 1', "test -f answer.txt"]
    async with connect(server.url, {"verify": verify}) as session:
        assert await call(session, "add_and_execute_code_cell", code=attack) == ("3", False)
        text, _ = await call(session, "final_answer", answer="anything")
        assert text.endswith("Verification: 0/3 passed; reward=0.0")


async def test_two_sessions_are_isolated_and_a_closed_one_frees_its_kernel(
    server: ServeProcess,
) -> None:
    """Two MCP sessions are two episodes (state and workspace apart); the SDK's DELETE on
    leaving frees the kernel."""
    before = kernels(server)
    async with connect(server.url) as one, connect(server.url) as two:
        await call(one, "add_and_execute_code_cell", code="secret = 1\nopen('mine.txt', 'w')")
        text, _ = await call(two, "add_and_execute_code_cell", code="secret")
        assert "NameError" in text
        listed, _ = await call(two, "add_and_execute_code_cell", code="import os; os.listdir()")
        assert "mine.txt" not in listed
        assert kernels(server) == before + 2
    assert wait_until(lambda: kernels(server) == before, 10)


async def test_bad_input_gets_clear_errors_and_the_session_stays_usable(
    server: ServeProcess,
) -> None:
    """An unknown tool, a missing or non-string argument: JSON-RPC errors that say so; the
    session then answers as before."""
    async with connect(server.url) as session:
        for name, arguments, said in [
            ("no_such_tool", {}, "Unknown tool: no_such_tool"),
            ("add_and_execute_code_cell", {}, "missing required argument 'code'"),
            ("add_and_execute_code_cell", {"code": 42}, "'code' must be a string, not int"),
            ("execute_shell_command", {"command": ["ls"]}, "must be a string, not list"),
        ]:
            with pytest.raises(Exception, match=said):
                await call(session, name, **arguments)
        assert await call(session, "add_and_execute_code_cell", code="6 * 7") == ("42", False)


def _post(url: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    wanted = {"Accept": "application/json, text/event-stream", **headers}
    return httpx.post(f"{url}/mcp", content=json.dumps(body), headers=wanted, timeout=60)


def _initialize_body(capabilities: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": capabilities or {},
                       "clientInfo": {"name": "t", "version": "0"}}}  # fmt: skip


def _initialize(url: str, who: str) -> str:
    response = _post(url, _initialize_body(), _bearer(who))
    assert response.status_code == 200 and response.json()["result"]["protocolVersion"]
    return response.headers["Mcp-Session-Id"]


def test_the_wire_tokens_tenants_and_limits(server: ServeProcess) -> None:
    """No token: 401 (but openenv validate's empty probe is JSON-RPC); another tenant's
    session id is answered as one that never existed; a call before initialize, and a body
    over the limit, are refused; GET is 405; DELETE ends the session."""
    url = server.url
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    assert _post(url, listing, {}).status_code == 401
    probe = _post(url, {}, {})
    assert probe.status_code == 200 and probe.json()["error"]["code"] == -32600
    sid = _initialize(url, "alice")
    mine = _post(url, listing, {**_bearer("alice"), "Mcp-Session-Id": sid})
    assert {t["name"] for t in mine.json()["result"]["tools"]} == FIVE
    theirs = _post(url, listing, {**_bearer("bob"), "Mcp-Session-Id": sid})
    nobody = _post(url, listing, {**_bearer("bob"), "Mcp-Session-Id": "0" * 32})
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["error"] == nobody.json()["error"]
    before = _post(url, listing, _bearer("alice"))
    assert before.status_code == 400 and "initialize first" in before.json()["error"]["message"]
    huge = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
            "params": {"name": "add_and_execute_code_cell",
                       "arguments": {"code": "x" * (64 << 20)}}}  # fmt: skip
    assert _post(url, huge, {**_bearer("alice"), "Mcp-Session-Id": sid}).status_code == 413
    assert httpx.get(f"{url}/mcp", headers=_bearer("alice")).status_code == 405
    bye = httpx.delete(f"{url}/mcp", headers={**_bearer("alice"), "Mcp-Session-Id": sid})
    assert bye.status_code == 204
    gone = _post(url, listing, {**_bearer("alice"), "Mcp-Session-Id": sid})
    assert gone.status_code == 404


def test_an_idle_session_is_culled(tmp_path: Path) -> None:
    """--idle-ttl reaps an MCP session like any other: its id then answers 404."""
    env = {**os.environ, "KERNEL_ENV_TOKEN": OPS}
    with serve_process("--pool-size", "0", "--idle-ttl", "1", env=env) as served:
        headers = {"Authorization": f"Bearer {OPS}"}
        sid = _post(served.url, _initialize_body(), headers).headers["Mcp-Session-Id"]
        listing = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        wanted = {**headers, "Mcp-Session-Id": sid}
        assert wait_until(lambda: _post(served.url, listing, wanted).status_code == 404, 30, 3)
        assert metrics(served.url, OPS)["kernels_in_sessions"] == 0


# -- OpenEnv 0.10's MCPToolClient, in a venv of its own -----------------------------------

CLIENT = Path(__file__).parent / "openenv_tool_client.py"
SETUP = ["mkdir -p work && printf seed > work/input.txt"]
VERIFY = ["test -f work/answer.txt", "grep -q seed work/input.txt", "false"]


@pytest.fixture(scope="module")
def openenv_python() -> Path:
    # The venv test_openenv_validate.py uses too (one venv: the same requirement).
    return cached_venv("openenv", [f"openenv=={OPENENV_VERSION}"])


def _openenv_client(python: Path, url: str, who: str, plan: list[dict[str, Any]]) -> list[Any]:
    """The outcomes of ``plan`` run by OpenEnv's MCPToolClient (tests/openenv_tool_client.py)."""
    done = subprocess.run(
        [str(python), str(CLIENT), url, TOKENS[who]],
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outcomes: list[Any] = json.loads(done.stdout)
    return outcomes


def _call(name: str, **kwargs: Any) -> dict[str, Any]:
    return {"op": "call_tool", "name": name, "kwargs": kwargs}


@pytest.mark.timeout(900)  # the first run makes the venv (~2 min)
def test_openenv_mcp_tool_client_runs_an_episode(
    server: ServeProcess, openenv_python: Path
) -> None:
    """OpenEnv 0.10's MCPToolClient as it is (its one mode: openenv/session/create, tools
    over /mcp with the session id in the params, reset and steps over /ws?session_id=): the
    reset's setup and verify, the five tools, a cell's value, state kept, the last cell
    replaced, a shell command in the sandbox, final_answer's pass-rate reward; a second
    episode on the same session scored through a /ws step; closing frees the kernel."""
    before = kernels(server)
    plan = [
        {"op": "reset", "kwargs": {"setup": SETUP, "verify": VERIFY}},
        {"op": "list_tools"},
        _call("add_and_execute_code_cell", code="x = 21 * 2\nx"),
        _call("add_and_execute_code_cell", code="x + 1"),
        _call("add_and_execute_code_cell", code="y = x +\n"),
        _call("edit_and_execute_current_cell", code="y = x + 2\ny"),
        _call("execute_shell_command", command="ls"),
        _call("execute_shell_command", command="id -u"),
        _call("add_and_execute_code_cell", code="import os; os.getuid()"),
        _call("get_notebook_state"),
        {"op": "state"},
        _call("add_and_execute_code_cell", code="open('work/answer.txt', 'w').write('4')"),
        _call("final_answer", answer="4"),
        _call("add_and_execute_code_cell", code="1"),
        {"op": "reset", "kwargs": {"verify": ["true", "false"]}},
        _call("add_and_execute_code_cell", code="x"),
        {"op": "step", "name": "final_answer", "kwargs": {"answer": "a"}},
    ]
    (reset, listed, cell, kept, broken, edited, ls, uid, kernel_uid, summary, state, wrote,
     answered, over, again, fresh, scored) = _openenv_client(
        openenv_python, server.url, "alice", plan)  # fmt: skip
    assert reset["done"] is False and reset["reward"] is None
    assert set(listed) == FIVE and len(listed) == 5
    assert cell == {"result": "42"}
    assert kept == {"result": "43"}
    assert broken["result"].startswith("ERROR:\nSyntaxError")
    assert edited == {"result": "44"}
    assert ls == {"result": "work"}  # the workspace the setup command wrote in
    assert uid == kernel_uid  # the shell runs as the kernel's uid, beside it
    assert summary["result"].splitlines()[:4] == [
        "[Cell 1] x = 21 * 2 ↵ x",
        "  → 42",
        "[Cell 2] x + 1",
        "  → 43",
    ]
    assert summary["result"].splitlines()[4:6] == ["[Cell 3] y = x + 2 ↵ y", "  → 44"]
    # The kernel ran five cells (an edit runs its code as a new step); shell commands are not
    # steps of the episode.
    assert state["episode_id"] and state["step_count"] == 5
    assert wrote == {"result": "1"}
    assert answered == {
        "result": "Answer submitted: 4\nVerification: 2/3 passed; reward=0.6666666666666666"
    }
    assert "episode is over" in over["error"]
    assert again["done"] is False
    assert "NameError" in fresh["result"]  # a new episode: a fresh kernel
    assert scored["done"] is True and scored["reward"] == 0.5
    assert scored["result"].endswith("Verification: 1/2 passed; reward=0.5")
    assert wait_until(lambda: kernels(server) == before, 10)


def _rpc(method: str, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": method, "params": params}


def _openenv_post(url: str, body: Any, who: str | None) -> httpx.Response:
    headers = _bearer(who) if who else {}
    return httpx.post(f"{url}/mcp", json=body, headers=headers, timeout=60)


async def _ws_attach(url: str, sid: str, who: str, frame: dict[str, Any]) -> Any:
    """The first frame a /ws?session_id= socket answers ``frame`` with, and the code the
    server closed it with after an error frame (None: left open, closed by the client)."""
    headers = _bearer(who)
    async with websockets.connect(f"{ws_url(url)}?session_id={sid}",
                                  additional_headers=headers) as ws:  # fmt: skip
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(json.dumps(frame))
        reply = json.loads(await ws.recv())
        if reply["type"] != "error":
            return reply, None
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.recv()
        return reply, ws.close_code


async def test_openenv_sessions_tokens_tenants_and_limits(server: ServeProcess) -> None:
    """OpenEnv's dialect on /mcp: no token is 401; a code call before the reset, or with a
    non-string code, is a JSON-RPC error that says so; another tenant's session id, over HTTP
    or as /ws?session_id=, is answered as one that never existed, and its owner's session
    is untouched; a body over the limit is 413 before it is read; openenv/session/close
    frees the kernel, and the id is then unknown."""
    url, before = server.url, kernels(server)
    assert _openenv_post(url, _rpc("openenv/session/create"), None).status_code == 401
    created = _openenv_post(url, _rpc("openenv/session/create"), "alice")
    assert created.status_code == 200
    sid = created.json()["result"]["session_id"]
    listed = _openenv_post(url, _rpc("tools/list", session_id=sid), "alice").json()
    assert {t["name"] for t in listed["result"]["tools"]} == FIVE
    early = _openenv_post(url, _rpc("tools/call", session_id=sid, name="get_notebook_state",
                                    arguments={}), "alice")  # fmt: skip
    assert early.json()["result"]["data"] == "No cells executed yet."
    for arguments, said in [({"code": "1"}, "reset"), ({"code": 42}, "must be a string, not int")]:
        refused = _openenv_post(url, _rpc("tools/call", session_id=sid, arguments=arguments,
                                          name="add_and_execute_code_cell"), "alice")  # fmt: skip
        assert refused.status_code == 200 and said in refused.json()["error"]["message"]
    reset, _ = await _ws_attach(url, sid, "alice", {"type": "reset", "data": {}})
    assert reset["type"] == "observation", reset
    code = {"name": "add_and_execute_code_cell", "arguments": {"code": "secret = 7\nsecret"}}
    mine = _openenv_post(url, _rpc("tools/call", session_id=sid, **code), "alice").json()
    assert mine["result"]["data"] == "7" and mine["result"]["is_error"] is False
    for method, params in [("tools/call", code), ("tools/list", {}), ("openenv/session/close", {})]:
        theirs = _openenv_post(url, _rpc(method, session_id=sid, **params), "bob")
        nobody = _openenv_post(url, _rpc(method, session_id="0" * 32, **params), "bob")
        assert theirs.status_code == nobody.status_code == 200
        assert theirs.json()["error"] == nobody.json()["error"], method
        assert "Unknown session_id" in theirs.json()["error"]["message"]
    refused, code_theirs = await _ws_attach(url, sid, "bob", {"type": "state"})
    unknown, code_nobody = await _ws_attach(url, "0" * 32, "bob", {"type": "state"})
    assert refused == unknown and refused["type"] == "error"
    assert code_theirs == code_nobody == 1008  # policy: not the caller's to attach to
    huge = _rpc("tools/call", session_id=sid, name="add_and_execute_code_cell",
                arguments={"code": "x" * (64 << 20)})  # fmt: skip
    assert _openenv_post(url, huge, "alice").status_code == 413
    still = _openenv_post(url, _rpc("tools/call", session_id=sid, name="add_and_execute_code_cell",
                                    arguments={"code": "secret * 6"}), "alice").json()  # fmt: skip
    assert still["result"]["data"] == "42"
    closed = _openenv_post(url, _rpc("openenv/session/close", session_id=sid), "alice").json()
    assert closed["result"] == {"session_id": sid, "closed": True}
    assert wait_until(lambda: kernels(server) == before, 10)
    gone = _openenv_post(url, _rpc("tools/list", session_id=sid), "alice").json()
    assert gone["error"]["message"] == "Session ended: the session was closed"


# -- stdio: `kernel-env mcp` ---------------------------------------------------------------

MCP_COMMAND = [sys.executable, "-m", "kernel_env", "mcp"]
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def _stdio(*args: str, token: str | None = None) -> Any:
    """The parameters of a stdio client spawning ``kernel-env mcp ARGS``."""
    env = {k: v for k, v in os.environ.items() if k != "KERNEL_ENV_TOKEN"}
    if token is not None:
        env["KERNEL_ENV_TOKEN"] = token
    return mcp_stdio.StdioServerParameters(command=MCP_COMMAND[0], args=[*MCP_COMMAND[1:], *args],
                                           env=env)  # fmt: skip


def _spawned() -> set[int]:
    """This test's `kernel-env mcp` children."""
    return {p for p in procs.child_pids(os.getpid()) if b"kernel_env\0mcp" in procs.cmdline(p)}


@contextlib.asynccontextmanager
async def stdio_session(*args: str, token: str | None = None) -> AsyncIterator[Any]:
    """An initialized SDK session with a `kernel-env mcp` it spawned."""
    async with (
        mcp_stdio.stdio_client(_stdio(*args, token=token)) as (read, write),
        mcp_client.ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def _tree(pid: int) -> set[int]:
    return {pid} | procs.descendants(pid)


async def test_stdio_runs_the_tools_in_a_kernel_of_its_own_and_leaves_nothing() -> None:
    """`kernel-env mcp` with no server: initialize, the five tools, a cell's value and state
    kept in the kernel it started; an unknown tool is an error and the session goes on; once
    the client closes, the process and its kernel are gone."""
    before, own_pipes = _spawned(), _own_pipes()
    async with stdio_session() as session:
        listed = await session.list_tools()
        assert {tool.name for tool in listed.tools} == FIVE
        assert await call(session, "add_and_execute_code_cell", code="x = 21 * 2\nx") == (
            "42",
            False,
        )
        with pytest.raises(Exception, match="Unknown tool: no_such_tool"):
            await call(session, "no_such_tool")
        assert await call(session, "add_and_execute_code_cell", code="x + 1") == ("43", False)
        (pid,) = _spawned() - before
        tree = _tree(pid)
        assert len(tree) > 1, "no kernel below kernel-env mcp"
        # The attack: a cell reads or writes the bridge's JSON-RPC pipes (its stdin and
        # stdout, moved to private descriptors) through a descriptor it inherited. Their
        # inodes are read at this end (a non-root reader may not list the bridge's).
        pipes = _own_pipes() - own_pipes
        assert len(pipes) >= 2, pipes  # the client's two, at least
        held, _ = await call(session, "add_and_execute_code_cell", code=HELD_PIPES)
        kernel_holds = set(json.loads(held))
        assert any(t.startswith("pipe:") for t in kernel_holds)  # the probe sees pipes
        assert pipes.isdisjoint(kernel_holds), (kernel_holds, pipes)
    assert wait_until(lambda: not any(procs.alive(p) for p in tree), 30)


HELD_PIPES = """\
import json, os
held = set()
for fd in os.listdir('/proc/self/fd'):
    try:
        held.add(os.readlink(f'/proc/self/fd/{fd}'))
    except OSError:
        pass  # the listing's own descriptor, closed by now
print(json.dumps(sorted(held)))
"""


def _own_pipes() -> set[str]:
    """The pipes this process holds (``pipe:[inode]``): a pipe's inode names it at both ends
    and in any namespace."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("pipe:"):
                found.add(target)
    return found


async def test_two_stdio_bridges_to_a_server_are_two_episodes(server: ServeProcess) -> None:
    """`kernel-env mcp --url`: each bridge is an MCP session of the server's (the token
    from KERNEL_ENV_TOKEN), apart from the other; each frees its kernel when it ends."""
    before = kernels(server)
    url, token = server.url, TOKENS["alice"]
    async with (
        stdio_session("--url", url, token=token) as one,
        stdio_session("--url", url, token=token) as two,
    ):
        await call(one, "add_and_execute_code_cell", code="secret = 1")
        text, _ = await call(two, "add_and_execute_code_cell", code="secret")
        assert "NameError" in text
        assert await call(one, "add_and_execute_code_cell", code="secret") == ("1", False)
        assert kernels(server) == before + 2
    assert wait_until(lambda: kernels(server) == before, 30)


class StdioProcess:
    """`kernel-env mcp` on pipes, spoken to line by line (a client with no SDK)."""

    def __init__(self, stderr: Path) -> None:
        with open(stderr, "wb") as sink:
            self.process = subprocess.Popen(
                MCP_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink
            )
        self.next_id = 0

    def send(self, line: bytes | dict[str, Any]) -> None:
        assert self.process.stdin is not None
        data = line if isinstance(line, bytes) else json.dumps(line).encode()
        self.process.stdin.write(data + b"\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        assert answer["jsonrpc"] == "2.0", answer
        return answer

    def request(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        answer = self.receive()
        assert answer["id"] == self.next_id, answer
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def cell(self, code: str) -> str:
        arguments = {"code": code}
        value = self.request("tools/call", name="add_and_execute_code_cell", arguments=arguments)
        return "\n".join(c["text"] for c in value["result"]["content"])


@pytest.mark.parametrize("end", ["eof", "sigterm", "sigint"])
def test_stdio_answers_bad_lines_keeps_stdout_clean_and_ends_on_eof_or_a_signal(
    tmp_path: Path, end: str
) -> None:
    """A line that is not JSON is a parse error (id null) and the session goes on; a kernel
    that writes to its descriptor 1 does not reach stdout (every line there is JSON-RPC);
    EOF on stdin, SIGTERM or SIGINT ends the process (exit 0) and its kernel."""
    mcp = StdioProcess(tmp_path / "stderr")
    try:
        body = _initialize_body()
        mcp.send(body)
        assert mcp.receive()["result"]["protocolVersion"] == "2025-06-18"
        mcp.send(INITIALIZED)
        mcp.send(b"{not json")
        parse_error = {"code": -32700, "message": "Parse error: the body is not JSON"}
        assert mcp.receive() == {"jsonrpc": "2.0", "id": None, "error": parse_error}
        noise = "import os, sys; os.write(1, b'fd 1\\n'); sys.__stdout__.write('stdout\\n')"
        mcp.cell(noise)
        assert mcp.cell("x = 21 * 2\nx") == "42"
        tree = _tree(mcp.process.pid)
        assert len(tree) > 1, "no kernel below kernel-env mcp"
        if end == "eof":
            assert mcp.process.stdin is not None
            mcp.process.stdin.close()
        else:
            mcp.process.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGINT)
        assert mcp.process.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
        assert mcp.process.stdout is not None
        assert mcp.process.stdout.read() == b""  # nothing but the answers, all read
        assert wait_until(lambda: not any(procs.alive(p) for p in tree), 30)
    finally:
        mcp.close()
