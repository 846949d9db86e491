"""Eight hostile sessions at once against one real ``kernel-env serve``, each doing what a cell
or a client can to grow the server or starve its neighbours, over both doors (a cell's 400 MB
message, a fork bomb, a memory bomb, an output flood, 150 MiB /step and /execute bodies,
abandoned command streams, a 150 MiB upload and download): a ninth session
completes 100 steps with no error meanwhile, and once the hostile ones close the server's RSS
is back within 10 % of what it was before they came."""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from attacks import (
    FORK_BOMB,
    HUGE_MESSAGE,
    MEMORY_BOMB,
    OUTPUT_FLOOD,
    MiB,
    chunked,
    code_body,
    send_huge,
)
from connect import ENVD, command_stream
from procs import peak_growth, rss_kib
from serverkit import ServeProcess, metrics, serve_process, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "e2b_" + secrets.token_hex(20)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INTERPRETER = "49999"


class OpenEnvSession:
    """One episode over the OpenEnv door's HTTP routes."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, headers=AUTH, timeout=120)
        reset = self.client.post("/reset", json={"context": "c", "max_iterations": 1000})
        assert reset.status_code == 200, reset.text[:300]
        self.id = reset.headers["X-Session-Id"]

    def step(self, code: str) -> dict[str, Any]:
        reply = self.client.post(
            "/step", json={"action": {"code": code}}, headers={"X-Session-Id": self.id}
        )
        assert reply.status_code == 200, reply.text[:300]
        result: dict[str, Any] = reply.json()["observation"]["result"]
        return result

    def close(self) -> None:
        self.client.delete(f"/sessions/{self.id}")
        self.client.close()

    def __enter__(self) -> OpenEnvSession:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class E2BSandbox:
    """One sandbox over the E2B door."""

    def __init__(self, url: str) -> None:
        self.url = url
        created = httpx.post(f"{url}/sandboxes", json={}, headers={"X-API-KEY": TOKEN}, timeout=60)
        assert created.status_code == 201, created.text[:300]
        self.id = created.json()["sandboxID"]
        self.token = created.json()["envdAccessToken"]

    def headers(self, port: str = INTERPRETER) -> dict[str, str]:
        return {"E2b-Sandbox-Id": self.id, "E2b-Sandbox-Port": port, "X-Access-Token": self.token}

    def close(self) -> None:
        httpx.delete(f"{self.url}/sandboxes/{self.id}", headers={"X-API-KEY": TOKEN}, timeout=30)

    def __enter__(self) -> E2BSandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# -- the eight -----------------------------------------------------------------------------


def _huge_messages(url: str) -> None:
    with OpenEnvSession(url) as session:
        for _ in range(2):
            result = session.step(HUGE_MESSAGE)
            assert result["kernel_restarted"], result
            assert (result["exception"] or "").startswith("MessageTooLarge"), result


def _fork_bomb(url: str) -> None:
    with OpenEnvSession(url) as session:
        for _ in range(2):
            session.step(FORK_BOMB)


def _memory_bomb(url: str) -> None:
    with OpenEnvSession(url) as session:
        result = session.step(MEMORY_BOMB)
        assert result["kernel_restarted"] or "bounded" in result["stdout"], result


def _output_flood(url: str) -> None:
    with OpenEnvSession(url) as session:
        for _ in range(2):
            result = session.step(OUTPUT_FLOOD)
            assert len(result["stdout"]) < 20 * MiB, len(result["stdout"])


def _huge_steps(url: str) -> None:
    with OpenEnvSession(url) as session:
        host = url.removeprefix("http://")
        head = (
            f"POST /step HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {TOKEN}\r\nX-Session-Id: {session.id}\r\n"
        )
        for _ in range(3):
            size = 150 * MiB
            assert send_huge(url, head + f"Content-Length: {size}\r\n", code_body(size)) == 413


def _huge_executes(url: str) -> None:
    with E2BSandbox(url) as sandbox:
        host = url.removeprefix("http://")
        fields = {"Host": host, "Content-Type": "application/json", **sandbox.headers()}
        head = "POST /execute HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        for _ in range(2):
            size = 150 * MiB
            assert send_huge(url, head + f"Content-Length: {size}\r\n", code_body(size)) == 413
            te = head + "Transfer-Encoding: chunked\r\n"
            assert send_huge(url, te, chunked(code_body(size))) == 413


def _transfers(url: str) -> None:
    """A 150 MiB upload to envd's ``/files``, and the same file down again."""
    with E2BSandbox(url) as sandbox:
        envd = sandbox.headers(ENVD)
        target = f"{url}/files?path=/home/user/big.bin"
        sent = httpx.post(
            target,
            content=iter([b"z" * MiB] * 150),
            headers={**envd, "Content-Type": "application/octet-stream"},
            timeout=600,
        )
        assert sent.status_code == 200, sent.text[:300]
        size = 0
        with httpx.stream("GET", target, headers=envd, timeout=600) as reply:
            assert reply.status_code == 200, reply.read()[:300]
            for piece in reply.iter_bytes():
                assert piece.count(b"z") == len(piece)
                size += len(piece)
        assert size == 150 * MiB


def _abandoned_streams(url: str) -> None:
    """Commands whose output stays open, each stream dropped by its client: the server stops
    following each, so more can always be started (at most 16 are open per sandbox)."""
    with E2BSandbox(url) as sandbox:
        described = {"sandboxID": sandbox.id, "envdAccessToken": sandbox.token}
        for _ in range(3):
            for _ in range(12):
                with (
                    httpx.Client(timeout=60) as client,
                    command_stream(client, url, described, "(sleep 3000 &)") as started,
                ):
                    assert "start" in json.dumps(started), started
            assert wait_until(lambda: _streams_open(url) == 0, timeout=10), _streams_open(url)


def _streams_open(url: str) -> int:
    return int(metrics(url, TOKEN)["streams_open"])  # type: ignore[call-overload]


ATTACKS: list[Callable[[str], None]] = [
    _huge_messages,
    _fork_bomb,
    _memory_bomb,
    _output_flood,
    _huge_steps,
    _huge_executes,
    _abandoned_streams,
    _transfers,
]


# -- the ninth -----------------------------------------------------------------------------


def _warm_up(url: str) -> None:
    """One episode and one sandbox, each with a step, closed: the server has imported and
    made what any session needs before its RSS is taken as the start."""
    with OpenEnvSession(url) as session:
        assert session.step("print(1 + 1)")["stdout"] == "2\n"
    with E2BSandbox(url) as sandbox:
        reply = httpx.post(
            f"{url}/execute", json={"code": "1 + 1"}, headers=sandbox.headers(), timeout=60
        )
        assert reply.status_code == 200, reply.text[:300]


def _attackers(url: str, failures: list[str]) -> Iterator[threading.Thread]:
    for attack in ATTACKS:

        def run(attack: Callable[[str], None] = attack) -> None:
            try:
                attack(url)
            except BaseException as exc:  # reported by the test, which must see every one
                failures.append(f"{attack.__name__}: {exc!r}"[:600])

        yield threading.Thread(target=run, name=attack.__name__)


@pytest.fixture
def server() -> Iterator[ServeProcess]:
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    with serve_process(
        "--pool-size", "2", "--max-sessions", "16", "--step-timeout", "60", env=env
    ) as process:
        yield process


def test_eight_hostile_sessions_leave_a_ninth_stepping_and_the_server_as_it_was(
    server: ServeProcess,
) -> None:
    _warm_up(server.url)
    start = rss_kib(server.pid)
    failures: list[str] = []
    attackers = list(_attackers(server.url, failures))
    under_attack = 0  # steps taken while an attack ran
    with peak_growth(server.pid) as grown:
        for attacker in attackers:
            attacker.start()
        ninth = OpenEnvSession(server.url)
        try:
            for n in range(100):
                result = ninth.step(f"x = {n}\nprint(x * 3)")
                assert result["stdout"] == f"{n * 3}\n", result
                assert result["success"] and not result["kernel_restarted"], result
                under_attack += any(a.is_alive() for a in attackers)
        finally:
            ninth.close()
            for attacker in attackers:
                attacker.join(timeout=600)
    assert not failures, failures
    assert under_attack >= 50, f"only {under_attack} of the 100 steps ran beside an attack"
    back = wait_until(lambda: rss_kib(server.pid) <= start * 1.1, timeout=60, interval=1)
    assert back, (
        f"the server's RSS is {rss_kib(server.pid) / 1024:.0f} MiB, from {start / 1024:.0f} "
        f"(its peak grew by {grown[0]:.0f} MiB under the attacks)"
    )
