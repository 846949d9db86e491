"""One server, more live episodes than select(2) could ever watch: no descriptor-number
ceiling (FD_SETSIZE, 1024) anywhere on the path of a reset or a step, a server started with
the usual soft limit of 1024 open files raises it to the hard limit itself, and its
connections are capped at what the limit leaves once every kernel has its descriptors."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from procs import cmdline, comm, descendants
from serverkit import alive, kernel_pids, serve_args, serving, small_settings, wait_until
from websockets.sync.client import connect

from kernel_env.kernel.merging import merge_problem
from kernel_env.server.capacity import (
    DESCRIPTORS_PER_KERNEL,
    MIN_CONNECTIONS,
    RESERVED_DESCRIPTORS,
    machine_capacity,
)
from kernel_env.server.runner import connection_cap, descriptor_shortfall
from kernel_env.server.settings import ServerSettings

EPISODES = 300  # past 1024 / 8: the descriptors of the 128th kernel are beyond select's reach
AT_ONCE = 8  # requests in flight: the 2-core machine starts kernels, it does not queue them
SOFT = 1024  # the soft limit the server starts with (a login shell's usual one)


def _hard_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open files limit in /proc/{pid}/limits")


async def _open_and_set(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int) -> str:
    async with gate:
        reset = await client.post("/reset", json={})
        assert reset.status_code == 200, (i, reset.text[:500])
        sid = reset.headers["X-Session-Id"]
        step = await client.post(
            "/step", json={"action": {"code": f"mine = {i}"}}, headers={"X-Session-Id": sid}
        )
        assert step.status_code == 200 and step.json()["observation"]["result"]["success"], (
            i,
            step.text[:500],
        )
        return sid


async def _read_back(client: httpx.AsyncClient, gate: asyncio.Semaphore, sid: str) -> str:
    async with gate:
        step = await client.post(
            "/step", json={"action": {"code": "print(mine)"}}, headers={"X-Session-Id": sid}
        )
        assert step.status_code == 200, step.text[:500]
        return str(step.json()["observation"]["result"]["stdout"]).strip()


async def _close(client: httpx.AsyncClient, gate: asyncio.Semaphore, sid: str) -> int:
    async with gate:
        return (await client.delete(f"/sessions/{sid}")).status_code


async def _drive(url: str) -> tuple[list[str], list[str], list[int], float]:
    gate = asyncio.Semaphore(AT_ONCE)
    limits = httpx.Limits(max_connections=AT_ONCE, max_keepalive_connections=AT_ONCE)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        started = time.monotonic()
        sids = await asyncio.gather(*(_open_and_set(client, gate, i) for i in range(EPISODES)))
        opened = time.monotonic() - started
        answers = await asyncio.gather(*(_read_back(client, gate, sid) for sid in sids))
        closed = await asyncio.gather(*(_close(client, gate, sid) for sid in sids))
    return sids, answers, closed, opened


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_three_hundred_live_episodes_each_keep_their_own_state() -> None:
    """300 HTTP episodes open at once on one server started with a soft limit of 1024 open
    files: each is set, then every one steps and answers its own value; all close, and no
    kernel is left. (select(2) refused the pidfd of the 113th kernel: "filedescriptor out of
    range in select()"; a soft limit of 1024 ran out at the 125th.)"""
    hard = _hard_limit()
    needed = (EPISODES + 30) * DESCRIPTORS_PER_KERNEL + EPISODES + 64 + RESERVED_DESCRIPTORS
    if hard < needed:
        pytest.skip(f"the hard open files limit ({hard}) is below the {needed} this needs")
    command = [
        "prlimit",
        f"--nofile={SOFT}:{hard}",
        sys.executable,
        *serve_args(
            "--max-sessions", str(EPISODES + 20), "--max-kernels", str(EPISODES + 30),
            "--pool-size", "8", "--claim-ttl", "0", "--idle-ttl", "0",
        ),
    ]  # fmt: skip
    log = Path(f"/tmp/kernel-env-density-{time.monotonic_ns()}.log")
    try:
        with serving(command, log) as server:
            sids, answers, closed, opened = asyncio.run(_drive(server.url))
            assert _soft_limit_of(server.pid) == hard  # raised by the server itself
            assert len(set(sids)) == EPISODES
            assert answers == [str(i) for i in range(EPISODES)]
            assert closed == [204] * EPISODES
            print(f"{EPISODES} episodes opened and set in {opened:.1f} s")
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).json()
            assert metrics["sessions_active"] == 0 and metrics["sessions_total"] == EPISODES
            # The warm pool's kernels remain; every session's is gone.
            assert wait_until(lambda: len(kernel_pids(server.pid)) <= 8, timeout=60)
            warm = kernel_pids(server.pid)
            text = log.read_text(errors="replace")
            assert "out of range" not in text and "Too many open files" not in text
        assert wait_until(lambda: not any(alive(pid) for pid in warm), timeout=30)
    finally:
        log.unlink(missing_ok=True)


# -- the connection cap --------------------------------------------------------------------


def test_the_connection_cap_is_what_the_kernels_leave_of_the_descriptor_limit() -> None:
    """Connections at most: the open files limit less every kernel's descriptors and the
    server's own; never below one a session and 64 more; --max-connections wins. A limit too
    low for the kernels asked for is said, with what to do."""
    settings = small_settings(max_sessions=64, pool_size=4)  # 68 kernels
    kernels = 68 * DESCRIPTORS_PER_KERNEL
    assert connection_cap(settings, 20_000) == 20_000 - kernels - RESERVED_DESCRIPTORS
    assert connection_cap(settings, 1024) == 64 + MIN_CONNECTIONS  # 88 would be left
    assert connection_cap(small_settings(max_connections=10), 20_000) == 10
    assert descriptor_shortfall(settings, 20_000) is None
    warning = descriptor_shortfall(settings, 1024)
    assert warning is not None and "too low for 68 kernels" in warning
    assert "ulimit -Hn" in warning and "--max-kernels" in warning
    wide = small_settings(max_sessions=64, pool_size=4, max_connections=30_000)
    assert descriptor_shortfall(wide, 20_000) is not None  # connections asked for count too


def _held(url: str) -> socket.socket:
    """A new connection that asked for /health once and is kept open (HTTP/1.1 keep-alive),
    and what it was answered."""
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return conn


def _answer(conn: socket.socket) -> bytes:
    """The next response on ``conn`` (a short one: its head and body in one read or two)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    while length is not None and len(body) < int(length.group(1)):
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _ws_step(ws: object, code: str) -> dict[str, object]:
    ws.send(json.dumps({"type": "step", "data": {"code": code}}))  # type: ignore[attr-defined]
    reply: dict[str, object] = json.loads(ws.recv(timeout=60))  # type: ignore[attr-defined]
    return reply


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_connections_past_the_cap_get_503_and_a_session_still_steps() -> None:
    """A server whose open files limit leaves 70 connections once its 2 kernels have their
    descriptors says so at start; with 70 held (a WebSocket session, 69 idle keep-alive
    connections), a new one is answered 503 and closed, while the session steps and a held
    connection is still answered."""
    cap = 70
    limit = cap + 2 * DESCRIPTORS_PER_KERNEL + RESERVED_DESCRIPTORS
    command = [
        "prlimit", f"--nofile={limit}:{limit}", sys.executable,
        *serve_args("--max-sessions", "1", "--pool-size", "1", "--sandbox", "none"),
    ]  # fmt: skip
    log = Path(f"/tmp/kernel-env-connections-{time.monotonic_ns()}.log")
    held: list[socket.socket] = []
    try:
        with serving(command, log) as server:
            assert f"connections at most {cap}, past them 503" in log.read_text()
            ws_url = server.url.replace("http", "ws", 1) + "/ws"
            with connect(ws_url, open_timeout=30) as ws:
                ws.send(json.dumps({"type": "reset", "data": {}}))
                assert json.loads(ws.recv(timeout=60))["type"] == "observation"
                assert _ws_step(ws, "kept = 41")["type"] == "observation"
                for _ in range(cap - 1):
                    held.append(_held(server.url))
                    assert _answer(held[-1]).startswith(b"HTTP/1.1 200")
                refused = _held(server.url)
                answer = _answer(refused)
                assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
                assert b"connection: close" in answer.lower()
                assert refused.recv(1) == b""  # closed by the server
                refused.close()
                stepped = _ws_step(ws, "print(kept + 1)")
                result = stepped["data"]["observation"]["result"]  # type: ignore[index]
                assert result["stdout"] == "42\n", stepped
                held[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert _answer(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for conn in held:
            conn.close()
        log.unlink(missing_ok=True)


# -- defaults from the machine -------------------------------------------------------------


def test_a_server_not_told_how_many_sessions_takes_what_the_machine_holds() -> None:
    """Without --max-sessions, the machine's capacity less the warm pool; --max-kernels
    bounds it; a given --max-sessions wins; a gateway's kernels take only descriptors."""
    held = machine_capacity().kernels
    derived = ServerSettings(pool_size=4).max_sessions
    assert abs(derived - (held - 4)) <= max(2, held // 50)  # memory moves between the reads
    assert ServerSettings(pool_size=4, max_kernels=10).max_sessions == 6
    assert ServerSettings(max_sessions=3).max_sessions == 3
    gateway = ServerSettings(gateway_url="http://127.0.0.1:9", pool_size=0)
    assert gateway.max_sessions == machine_capacity(local=False).kernels
    assert machine_capacity(forked=False).kernels <= held  # a new interpreter costs more


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_open_files_limit_bounds_the_default_and_the_status_line_says_so() -> None:
    """Under a hard limit of 1024 open files, `kernel-env capacity` and a server not told
    --max-sessions both take what the limit holds, at a descriptor budget and a connection a
    kernel, and name open files as the bound; the server does not warn of a shortfall."""
    fits = (1024 - RESERVED_DESCRIPTORS - MIN_CONNECTIONS) // (DESCRIPTORS_PER_KERNEL + 1)
    prlimit = ["prlimit", "--nofile=1024:1024"]
    shown = subprocess.run(
        [*prlimit, sys.executable, "-m", "kernel_env", "capacity"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert int(shown.stdout) == fits and "bound by open files" in shown.stderr
    command = [*prlimit, sys.executable, *serve_args("--pool-size", "1", "--sandbox", "none")]
    log = Path(f"/tmp/kernel-env-capacity-{time.monotonic_ns()}.log")
    try:
        with serving(command, log) as server:
            text = log.read_text()
            assert f"max {fits - 1} sessions" in text and "bound by open files" in text
            metrics = httpx.get(f"{server.url}/metrics", timeout=30).json()
            assert (metrics["max_sessions"], metrics["max_kernels"]) == (fits - 1, fits)
            assert "too low" not in text  # the default fits the limit it came from
    finally:
        log.unlink(missing_ok=True)


# -- memory merging (--merge-pages) --------------------------------------------------------


def _merge_any(pid: int) -> str:
    """``ksm_merge_any`` of /proc/<pid>/ksm_stat: whether all the process's memory is marked
    mergeable (``prctl(PR_SET_MEMORY_MERGE)``); "" once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/ksm_stat").read_text()
    except FileNotFoundError:
        return ""
    lines = (line.split(maxsplit=1) for line in text.splitlines())  # "name value", "name: value"
    return {name.rstrip(":"): value for name, value in lines}.get("ksm_merge_any", "")


def _kernel_interpreters(server: int) -> set[int]:
    """The server's kernels' Python processes: forked ones, and cold ones (under the launch
    wrapper and bubblewrap, whose command lines name ipykernel too)."""
    found = set()
    for pid in descendants(server):
        argv = cmdline(pid).split(b"\0")
        if comm(pid) == "ke-kernel" or (
            Path(argv[0].decode(errors="replace")).name.startswith("python")
            and b"ipykernel_launcher" in argv
        ):
            found.add(pid)
    return found


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("flags", "marked"),
    [
        pytest.param(("--merge-pages", "true"), "yes", id="forked-merged"),
        pytest.param(("--merge-pages", "true", "--forkserver", "false"), "yes", id="cold-merged"),
        pytest.param((), "no", id="forked-by-default"),
    ],
)
def test_merge_pages_marks_every_kernel_of_the_server_and_only_then(
    flags: tuple[str, ...], marked: str
) -> None:
    """A server started with --merge-pages: each of its kernels, warm or an episode's, forked
    or cold, has all its memory marked mergeable (``ksm_merge_any: yes``), says so on its
    status line, and still runs its cells; one started without: none is (``no``)."""
    problem = merge_problem()
    if problem is not None:
        pytest.skip(f"this host cannot merge pages: {problem}")
    command = [sys.executable, *serve_args("--pool-size", "1", *flags)]
    log = Path(f"/tmp/kernel-env-merge-{time.monotonic_ns()}.log")
    try:
        with serving(command, log) as server:
            with connect(server.url.replace("http", "ws", 1) + "/ws", open_timeout=30) as ws:
                ws.send(json.dumps({"type": "reset", "data": {}}))
                assert json.loads(ws.recv(timeout=120))["type"] == "observation"
                ws.send(json.dumps({"type": "step", "data": {"code": "print(6 * 7)"}}))
                reply = json.loads(ws.recv(timeout=120))["data"]
                assert reply["observation"]["result"]["stdout"].strip() == "42", reply

                # The episode's kernel and the one the pool warmed in its place (a warm kernel
                # has loaded its extensions: a cold one still starting has not, yet).
                def warm() -> bool:
                    metrics = httpx.get(f"{server.url}/metrics", timeout=10).json()
                    return metrics["pool_warm"] >= 1

                assert wait_until(warm, timeout=120)
                assert wait_until(lambda: len(_kernel_interpreters(server.pid)) >= 2, timeout=60)
                kernels = _kernel_interpreters(server.pid)
                states = {pid: _merge_any(pid) for pid in kernels}
                assert set(states.values()) == {marked}, states
            said = log.read_text(errors="replace")
            assert ("memory merging (KSM)" in said) == (marked == "yes"), said[-2000:]
    finally:
        log.unlink(missing_ok=True)


def test_merge_pages_is_for_local_kernels_and_read_from_the_environment() -> None:
    """--merge-pages with a gateway is refused (its kernels run elsewhere); the variable
    KERNEL_ENV_MERGE_PAGES sets it as the flag does; it is off unless asked."""
    with pytest.raises(ValueError, match="local kernels"):
        ServerSettings(merge_pages=True, gateway_url="http://127.0.0.1:1")
    assert ServerSettings.from_env({"KERNEL_ENV_MERGE_PAGES": "true"}).merge_pages
    assert not ServerSettings.from_env({}).merge_pages
