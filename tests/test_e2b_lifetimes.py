"""How long what an E2B client starts can outlive it, against a real ``kernel-env serve``: a
command stream ends once its client goes away, a stream's polls are not activity (an idle
sandbox is reaped, paused or not), a paused sandbox is reaped after ``--paused-ttl``, and a
sandbox holds a bounded number of streams."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import unprivileged
from connect import command_stream
from serverkit import ServeProcess, metrics, serve_process, wait_until

pytestmark = pytest.mark.integration  # a server and its kernels

TOKEN = "e2b_" + secrets.token_hex(20)
ENVD = "49983"
KEY = {"X-API-KEY": TOKEN}
# A command whose output stays open after it returns: its background child holds it.
OPEN_OUTPUT = "(sleep 3000 &)"
MAX_STREAMS = 16  # kernel_env.server.sessions.MAX_STREAMS, as a client sees it


@contextlib.contextmanager
def _server(who: str, *args: str) -> Iterator[ServeProcess]:
    """A server run by root, or by a fresh unprivileged uid."""
    if who == "root":
        env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
        with serve_process("--pool-size", "1", *args, env=env) as process:
            yield process
        return
    if unprivileged.problem() is not None:
        pytest.skip(str(unprivileged.problem()))
    token = {"KERNEL_ENV_TOKEN": TOKEN}
    with unprivileged.serve_unprivileged("--pool-size", "1", *args, env=token) as process:
        yield process


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def server(request: pytest.FixtureRequest) -> Iterator[ServeProcess]:
    with _server(request.param) as process:
        yield process


def _create(url: str, **body: Any) -> dict[str, Any]:
    created = httpx.post(f"{url}/sandboxes", json=body, headers=KEY, timeout=60)
    assert created.status_code == 201, created.text
    sandbox: dict[str, Any] = created.json()
    return sandbox


def _exists(url: str, sandbox: dict[str, Any]) -> bool:
    found = httpx.get(f"{url}/sandboxes/{sandbox['sandboxID']}", headers=KEY, timeout=10)
    assert found.status_code in (200, 404), found.text
    return found.status_code == 200


def _kill(url: str, sandbox: dict[str, Any]) -> None:
    httpx.delete(f"{url}/sandboxes/{sandbox['sandboxID']}", headers=KEY, timeout=30)


def _streams_open(url: str) -> int:
    return int(metrics(url, TOKEN)["streams_open"])  # type: ignore[call-overload]


def test_a_stream_ends_within_5_s_of_its_client_leaving(server: ServeProcess) -> None:
    """A command whose output stays open, its client gone: the server stops following it
    (the gauge of open streams drops back) within 5 s, and the sandbox serves on."""
    sandbox = _create(server.url)
    try:
        with httpx.Client(timeout=60) as client:
            with command_stream(client, server.url, sandbox, OPEN_OUTPUT) as frames:
                assert "start" in frames[0][1]["event"], frames
                assert _streams_open(server.url) == 1
            left = time.monotonic()
        assert wait_until(lambda: _streams_open(server.url) == 0, timeout=5), (
            "the stream still runs 5 s after its client left"
        )
        print(f"stream ended {time.monotonic() - left:.2f} s after its client left")
        assert _exists(server.url, sandbox)
    finally:
        _kill(server.url, sandbox)


def test_a_sandbox_holds_a_bounded_number_of_streams(server: ServeProcess) -> None:
    """Streams past the bound are refused with resource_exhausted (and no command starts);
    one that closes makes room again."""
    sandbox = _create(server.url)
    limits = httpx.Limits(max_connections=MAX_STREAMS + 4)
    try:
        with httpx.Client(timeout=60, limits=limits) as client, contextlib.ExitStack() as held:
            for _ in range(MAX_STREAMS):
                frames = held.enter_context(
                    command_stream(client, server.url, sandbox, "sleep 300")
                )
                assert "start" in frames[0][1]["event"], frames
            with command_stream(client, server.url, sandbox, "touch refused") as frames:
                flags, end = frames[0]
            assert flags & 2 and end["error"]["code"] == "resource_exhausted", frames
            assert f"{MAX_STREAMS} command streams" in end["error"]["message"], end
            assert _streams_open(server.url) == MAX_STREAMS
        assert wait_until(lambda: _streams_open(server.url) == 0, timeout=10)
        with (
            httpx.Client(timeout=60) as client,
            command_stream(client, server.url, sandbox, "echo again") as frames,
        ):
            assert "start" in frames[0][1]["event"], frames
        listed = httpx.get(
            f"{server.url}/files",
            params={"path": "/home/user/refused"},
            headers={
                "E2b-Sandbox-Id": sandbox["sandboxID"],
                "E2b-Sandbox-Port": ENVD,
                "X-Access-Token": sandbox["envdAccessToken"],
            },
            timeout=30,
        )
        assert listed.status_code == 404, "the refused command ran"
    finally:
        _kill(server.url, sandbox)


@pytest.mark.parametrize("who", ["root", "unprivileged"])
def test_a_stream_held_open_by_a_hung_client_is_not_activity(who: str) -> None:
    """A client that holds a silent command's stream open and then pauses its sandbox
    (the E2B timer stops): the stream's polls do not count as activity, so --idle-ttl reaps
    the sandbox."""
    with _server(who, "--idle-ttl", "3") as server:
        sandbox = _create(server.url, timeout=300)
        try:
            with (
                httpx.Client(timeout=60) as client,
                command_stream(client, server.url, sandbox, OPEN_OUTPUT) as frames,
            ):
                assert "start" in frames[0][1]["event"], frames
                paused = httpx.post(
                    f"{server.url}/sandboxes/{sandbox['sandboxID']}/pause", headers=KEY
                )
                assert paused.status_code == 204, paused.text
                since = time.monotonic()
                assert wait_until(lambda: not _exists(server.url, sandbox), timeout=15), (
                    "the sandbox outlived --idle-ttl 3 while its stream was polled"
                )
                print(f"reaped {time.monotonic() - since:.2f} s after pause (idle-ttl 3 s)")
                assert _streams_open(server.url) == 0
        finally:
            _kill(server.url, sandbox)


def test_a_paused_sandbox_is_reaped_after_paused_ttl() -> None:
    """With no idle TTL, a paused sandbox still goes after --paused-ttl; resuming restores
    its E2B timeout."""
    with _server("root", "--idle-ttl", "0", "--paused-ttl", "3") as server:
        kept, dropped = _create(server.url, timeout=300), _create(server.url, timeout=300)
        try:
            for sandbox in (kept, dropped):
                paused = httpx.post(
                    f"{server.url}/sandboxes/{sandbox['sandboxID']}/pause", headers=KEY
                )
                assert paused.status_code == 204, paused.text
            since = time.monotonic()
            resumed = httpx.post(
                f"{server.url}/sandboxes/{kept['sandboxID']}/resume",
                json={"timeout": 300},
                headers=KEY,
            )
            assert resumed.status_code == 201, resumed.text
            assert _exists(server.url, dropped)
            assert wait_until(lambda: not _exists(server.url, dropped), timeout=10), (
                "the paused sandbox outlived --paused-ttl 3"
            )
            print(f"paused sandbox reaped {time.monotonic() - since:.2f} s after pause")
            assert time.monotonic() - since >= 2.5
            assert _exists(server.url, kept)
        finally:
            _kill(server.url, kept)
            _kill(server.url, dropped)
