"""Tenants: a token per client, from a tokens file (``--tokens-file``). A client sees and acts
on its own sessions only, and another tenant's session id answers exactly as an id no session
ever had; an operator sees and acts on all. The single ``KERNEL_ENV_TOKEN`` is an operator, as
before, and no token at all is the open loopback server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from serverkit import make_client, serve_process, small_settings, thread_server
from starlette.websockets import WebSocketDisconnect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

import kernel_env.server.auth as auth
from kernel_env import KernelEnv
from kernel_env.server.settings import ServerSettings

TOKENS = {
    "alice": "alice-token-7Qm2xv9LkP3w",
    "bob": "bob-token-Rt5nZ8cYh1Ju",
    "ops": "ops-token-Wd4sK6gBq0Ee",
}
LEGACY = "legacy-single-token-9Hf3"
UNKNOWN = "alice-token-7Qm2xv9LkP3x"  # one character from alice's
HF_TOKEN = "hf_tenantTestNotARealToken"


def tokens_text(**extra: str) -> str:
    lines = ["# name role token", "alice client " + TOKENS["alice"]]
    lines += ["", "bob   client   " + TOKENS["bob"], "ops operator " + TOKENS["ops"]]
    return "\n".join([*lines, *extra.values()]) + "\n"


def write_tokens(tmp_path: Path, text: str | None = None, mode: int = 0o600) -> Path:
    path = tmp_path / "tokens"
    path.write_text(tokens_text() if text is None else text)
    path.chmod(mode)
    return path


def as_(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS.get(name, LEGACY)}"}


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")}
    return {**env, **variables}


# -- the attack, on a real `kernel-env serve` ------------------------------------------------


@pytest.mark.integration
def test_attack_a_second_client_can_neither_list_nor_attach_to_the_firsts_session(
    tmp_path: Path,
) -> None:
    """The break as found: with one token for everyone, client B read client A's session id
    from GET /sessions, attached to it with /ws?session=, read its state, and closing that
    socket ended A's episode. With a token each, B is refused every step of the way."""
    tokens = write_tokens(tmp_path)
    with serve_process(
        "--sandbox", "none", "--pool-size", "1", env=_env(KERNEL_ENV_TOKENS_FILE=str(tokens))
    ) as server:
        url = server.url
        reset = httpx.post(
            f"{url}/reset", json={"context": "A-PRIVATE-CONTEXT"}, headers=as_("alice"), timeout=60
        )
        sid = reset.headers["X-Session-Id"]
        step = {"action": {"code": "secret = 42"}}
        headers = {**as_("alice"), "X-Session-Id": sid}
        assert httpx.post(f"{url}/step", json=step, headers=headers, timeout=60).status_code == 200

        leaks = []
        listed = httpx.get(f"{url}/sessions", headers=as_("bob"), timeout=10)
        if sid in listed.text:
            leaks.append("B listed A's session id in GET /sessions")
        ws_url = url.replace("http", "ws", 1) + f"/ws?session={sid}"
        reply = first_reply(ws_url, as_("bob"), {"type": "state"})
        if reply["type"] == "state" or "A-PRIVATE-CONTEXT" in json.dumps(reply):
            leaks.append("B attached to A's session over /ws and read its state")
        after = httpx.post(
            f"{url}/step", json={"action": {"code": "secret"}}, headers=headers, timeout=60
        )
        if after.status_code != 200:
            leaks.append(f"closing B's socket ended A's session: {after.status_code}")
        assert leaks == []
        assert reply == {
            "type": "error",
            "data": {"message": auth_unknown_message(), "code": "SESSION_ERROR"},
        }
        assert after.json()["observation"]["result"]["outputs"][0]["data"]["text/plain"] == "42"


def auth_unknown_message() -> str:
    return "unknown session id: call POST /reset to open a session"


def first_reply(url: str, headers: dict[str, str], frame: dict[str, Any]) -> dict[str, Any]:
    """The first frame a socket receives after sending ``frame`` (a refused attach is
    answered, and closed, before the frame is read: its error frame is what comes)."""
    reply: dict[str, Any] | None = None
    with contextlib.suppress(ConnectionClosed), connect(url, additional_headers=headers) as ws:
        with contextlib.suppress(ConnectionClosed):
            ws.send(json.dumps(frame))
        reply = json.loads(ws.recv(timeout=60))
    assert reply is not None, "the socket closed without a frame"
    return reply


# -- every session route, in-process --------------------------------------------------------

Route = Callable[[str], tuple[str, str, dict[str, str], Any]]

ROUTES: dict[str, Route] = {
    "step": lambda s: ("POST", "/step", {"X-Session-Id": s}, {"action": {"code": "secret"}}),
    "state": lambda s: ("GET", "/state", {"X-Session-Id": s}, None),
    "reset": lambda s: ("POST", "/reset", {"X-Session-Id": s}, {}),
    "fork": lambda s: ("POST", f"/sessions/{s}/fork", {}, {"n": 1}),
    "notebook": lambda s: ("GET", f"/sessions/{s}/notebook", {}, None),
    "notebook.html": lambda s: ("GET", f"/sessions/{s}/notebook.html", {}, None),
    "export.zip": lambda s: ("GET", f"/sessions/{s}/export.zip", {}, None),
    "events": lambda s: ("GET", f"/web/api/sessions/{s}/events", {}, None),
    "close": lambda s: ("DELETE", f"/sessions/{s}", {}, None),
}


def call(client: TestClient, who: str, route: Route, sid: str) -> tuple[int, str]:
    method, path, headers, body = route(sid)
    reply = client.request(method, path, headers={**as_(who), **headers}, json=body)
    return reply.status_code, reply.text.replace(sid, "<id>")


def attach(client: TestClient, who: str, sid: str) -> tuple[dict[str, Any], int]:
    """What a refused ``/ws?session=`` gets: its error frame and close code."""
    with client.websocket_connect(f"/ws?session={sid}", headers=as_(who)) as ws:
        frame: dict[str, Any] = ws.receive_json()
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    return frame, closed.value.code


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(sandbox="none", tokens_file=str(write_tokens(tmp_path))) as client:
        yield client


def open_session(client: TestClient, who: str, context: str = "PRIVATE") -> str:
    reply = client.post("/reset", json={"context": context}, headers=as_(who))
    assert reply.status_code == 200, reply.text
    sid = reply.headers["X-Session-Id"]
    headers = {**as_(who), "X-Session-Id": sid}
    step = client.post("/step", json={"action": {"code": "secret = 42"}}, headers=headers)
    assert step.status_code == 200
    return sid


@pytest.mark.integration
def test_another_clients_session_answers_as_an_unknown_one_on_every_route(
    tenants: TestClient,
) -> None:
    """B names A's session on each route: the answer is byte for byte the one for an id no
    session ever had (no oracle), and A's session is untouched; A itself is served."""
    sid = open_session(tenants, "alice", "A-PRIVATE-CONTEXT")
    for name, route in ROUTES.items():
        unknown = secrets.token_hex(16)
        assert call(tenants, "bob", route, sid) == call(tenants, "bob", route, unknown), name
    assert attach(tenants, "bob", sid) == attach(tenants, "bob", secrets.token_hex(16))
    assert attach(tenants, "bob", sid)[1] == 1008

    headers = {**as_("alice"), "X-Session-Id": sid}
    still = tenants.post("/step", json={"action": {"code": "secret"}}, headers=headers)
    assert still.status_code == 200  # B's reset, close and socket changed nothing
    assert still.json()["observation"]["result"]["outputs"][0]["data"]["text/plain"] == "42"
    for name in ("state", "fork", "notebook", "notebook.html", "export.zip", "events"):
        status, body = call(tenants, "alice", ROUTES[name], sid)
        assert status == 200, (name, body)
    listed = tenants.get("/sessions", headers=as_("bob")).json()["sessions"]
    assert listed == []  # neither A's session nor the copy A forked

    with tenants.websocket_connect(f"/ws?session={sid}", headers=as_("alice")) as ws:
        ws.send_json({"type": "state"})
        assert ws.receive_json()["data"]["context"] == "A-PRIVATE-CONTEXT"
    # A's socket closed A's session: gone for A (410), still unknown for B (404, as any id).
    assert call(tenants, "alice", ROUTES["state"], sid)[0] == 410
    unknown = secrets.token_hex(16)
    gone = call(tenants, "bob", ROUTES["state"], sid)
    assert gone == call(tenants, "bob", ROUTES["state"], unknown) and gone[0] == 404


@pytest.mark.integration
def test_a_client_lists_only_its_own_sessions_and_an_operator_all(tenants: TestClient) -> None:
    mine = {open_session(tenants, "alice"), open_session(tenants, "alice")}
    theirs = open_session(tenants, "bob")

    def listed(who: str) -> dict[str, str]:
        reply = tenants.get("/sessions", headers=as_(who))
        assert reply.status_code == 200
        return {s["session_id"]: s["tenant"] for s in reply.json()["sessions"]}

    assert listed("alice") == dict.fromkeys(mine, "alice")
    assert listed("bob") == {theirs: "bob"}
    assert listed("ops") == {**dict.fromkeys(mine, "alice"), theirs: "bob"}
    for token in TOKENS.values():
        assert token not in tenants.get("/sessions", headers=as_("ops")).text


@pytest.mark.integration
def test_an_operator_acts_on_every_session_and_only_it_reads_metrics(
    tenants: TestClient,
) -> None:
    sid = open_session(tenants, "alice", "A-PRIVATE-CONTEXT")
    state = tenants.get("/state", headers={**as_("ops"), "X-Session-Id": sid})
    assert state.status_code == 200 and state.json()["context"] == "A-PRIVATE-CONTEXT"
    fork = tenants.post(f"/sessions/{sid}/fork", json={"n": 1}, headers=as_("ops"))
    child = fork.json()["sessions"][0]["session_id"]
    # A copy belongs to the forked session's owner: A sees it, B does not.
    owners = {
        s["session_id"]: s["tenant"]
        for s in tenants.get("/sessions", headers=as_("ops")).json()["sessions"]
    }
    assert owners == {sid: "alice", child: "alice"}
    for path in ("/metrics", "/metrics/prometheus"):
        assert tenants.get(path, headers=as_("ops")).status_code == 200
        refused = tenants.get(path, headers=as_("alice"))
        assert refused.status_code == 403 and "operator" in refused.text
    assert tenants.delete(f"/sessions/{child}", headers=as_("ops")).status_code == 204
    assert call(tenants, "alice", ROUTES["state"], child)[0] == 410


@pytest.mark.integration
def test_a_client_holds_at_most_max_sessions_per_tenant(tmp_path: Path) -> None:
    """One client cannot take every session: past its cap its resets, sockets and forks are
    refused (CAPACITY_REACHED), while other tenants still open sessions."""
    path = str(write_tokens(tmp_path))
    with make_client(sandbox="none", tokens_file=path, max_sessions_per_tenant=1) as client:
        held = open_session(client, "alice")  # claimed: its id came back with a step
        refused = client.post("/reset", json={}, headers=as_("alice"))
        assert refused.status_code == 503
        assert refused.json()["detail"]["code"] == "CAPACITY_REACHED"
        assert "alice" in refused.text and "max-sessions-per-tenant" in refused.text
        with client.websocket_connect("/ws", headers=as_("alice")) as ws:
            assert ws.receive_json()["data"]["code"] == "CAPACITY_REACHED"
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
            assert closed.value.code == 1013
        fork = client.post(f"/sessions/{held}/fork", json={"n": 1}, headers=as_("alice"))
        assert fork.status_code == 503
        open_session(client, "bob")
        open_session(client, "ops")
        open_session(client, "ops")  # operators are not capped
        # A client's own unclaimed session makes room for its next reset, as at the server's cap.
        assert client.delete(f"/sessions/{held}", headers=as_("alice")).status_code == 204
        first = client.post("/reset", json={}, headers=as_("alice")).headers["X-Session-Id"]
        second = client.post("/reset", json={}, headers=as_("alice"))
        assert second.status_code == 200
        gone = client.get("/state", headers={**as_("alice"), "X-Session-Id": first})
        assert gone.status_code == 410 and "never claimed" in gone.text


@pytest.mark.integration
def test_the_remote_client_runs_and_exports_an_episode_with_its_tenants_token(
    tmp_path: Path,
) -> None:
    settings = small_settings(sandbox="none", tokens_file=str(write_tokens(tmp_path)))
    with thread_server(settings) as url, KernelEnv(base_url=url, token=TOKENS["bob"]) as env:
        env.reset(context="B-CONTEXT", expected_answer="9")
        assert env.execute("FINAL(len(context))").reward == 1.0
        env.export_notebook(tmp_path / "bob.ipynb")
        listed = httpx.get(f"{url}/sessions", headers=as_("alice"), timeout=10).json()
        assert listed == {"sessions": [], "total": 0, "next": None}
    assert "B-CONTEXT" in (tmp_path / "bob.ipynb").read_text()


# -- the single token, as before ------------------------------------------------------------


@pytest.mark.integration
def test_the_single_token_is_an_operator_as_before() -> None:
    """KERNEL_ENV_TOKEN alone: its holders share every session, as they always have."""
    with make_client(sandbox="none", token=LEGACY) as client:
        first = open_session(client, "legacy")
        second = open_session(client, "legacy")
        listed = client.get("/sessions", headers=as_("legacy")).json()["sessions"]
        assert {(s["session_id"], s["tenant"]) for s in listed} == {
            (first, "default"),
            (second, "default"),
        }
        with client.websocket_connect(f"/ws?session={first}", headers=as_("legacy")) as ws:
            ws.send_json({"type": "state"})
            assert ws.receive_json()["data"]["context"] == "PRIVATE"
        assert client.get("/metrics", headers=as_("legacy")).status_code == 200


@pytest.mark.integration
def test_a_single_token_beside_a_tokens_file_is_the_operator_default(tmp_path: Path) -> None:
    path = str(write_tokens(tmp_path))
    with make_client(sandbox="none", token=LEGACY, tokens_file=path) as client:
        sid = open_session(client, "alice")
        own = open_session(client, "legacy")
        listed = client.get("/sessions", headers=as_("legacy")).json()["sessions"]
        assert {(s["session_id"], s["tenant"]) for s in listed} == {
            (sid, "alice"),
            (own, "default"),
        }
        assert client.get("/sessions", headers=as_("alice")).json()["sessions"][0]["tenant"] == (
            "alice"
        )


# -- the tokens file ------------------------------------------------------------------------


def test_a_valid_tokens_file_names_each_tenant_and_role(tmp_path: Path) -> None:
    tenants = auth.load_tenants(None, str(write_tokens(tmp_path)))
    found = {name: tenants.identify(f"Bearer {token}") for name, token in TOKENS.items()}
    assert {n: (t.name, t.role) for n, t in found.items() if t} == {
        "alice": ("alice", "client"),
        "bob": ("bob", "client"),
        "ops": ("ops", "operator"),
    }
    for wrong in (f"Bearer {UNKNOWN}", TOKENS["alice"], f"Basic {TOKENS['ops']}", None, ""):
        assert tenants.identify(wrong) is None
    assert not any(token in repr(tenants) for token in TOKENS.values())


BAD_FILES = {
    "two fields": ("alice client", 1, "name role token"),
    "four fields": (f"alice client {TOKENS['alice']} # mine", 1, "name role token"),
    "unknown role": (f"alice admin {TOKENS['alice']}", 1, "client or operator"),
    "fields swapped": (f"alice {TOKENS['alice']} client", 1, "client or operator"),
    "short token": ("alice client short-token", 1, "at least 16"),
    "non-ascii token": ("alice client tökentökentökentök", 1, "printable ASCII"),
    "bad name": (f"al/ice client {TOKENS['alice']}", 1, "name"),
    "same name": (f"bob client {TOKENS['bob']}\nbob client {TOKENS['alice']}", 2, "line 1"),
    "same token": (f"bob client {TOKENS['bob']}\nops operator {TOKENS['bob']}", 2, "line 1"),
    "empty": ("# nobody yet\n\n", None, "no tenant"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_malformed_tokens_file_is_refused_with_its_line(tmp_path: Path, case: str) -> None:
    text, line, says = BAD_FILES[case]
    path = write_tokens(tmp_path, text + "\n")
    with pytest.raises(auth.TokensFileError) as refused:
        auth.load_tenants(None, str(path))
    message = str(refused.value)
    assert message.startswith(f"tokens file {path}") and "\n" not in message
    assert (f"line {line}:" in message) if line else not re.search(r"line \d", message)
    assert says in message
    assert not any(secret in message for secret in (*TOKENS.values(), "short-token", "tökent"))


def test_a_tokens_file_others_can_write_is_refused_and_one_they_can_read_is_warned(
    tmp_path: Path,
) -> None:
    with pytest.raises(auth.TokensFileError, match="others can write"):
        auth.load_tenants(None, str(write_tokens(tmp_path, mode=0o602)))
    with pytest.raises(auth.TokensFileError, match="cannot read"):
        auth.load_tenants(None, str(tmp_path / "missing"))
    assert auth.load_tenants(None, str(write_tokens(tmp_path, mode=0o600))).warnings == ()
    (warning,) = auth.load_tenants(None, str(write_tokens(tmp_path, mode=0o644))).warnings
    assert str(tmp_path / "tokens") in warning and "others can read" in warning


def test_the_single_token_cannot_clash_with_the_file(tmp_path: Path) -> None:
    clash = write_tokens(tmp_path, f"default client {TOKENS['alice']}\n")
    with pytest.raises(auth.TokensFileError, match="line 1: the name default is"):
        auth.load_tenants(LEGACY, str(clash))
    same = write_tokens(tmp_path, f"alice client {LEGACY}\n")
    with pytest.raises(auth.TokensFileError, match=r"line 1: .*KERNEL_ENV_TOKEN") as refused:
        auth.load_tenants(LEGACY, str(same))
    assert LEGACY not in str(refused.value)


def test_tokens_file_and_cap_are_settings_flag_and_variable() -> None:
    env = {"KERNEL_ENV_TOKENS_FILE": "/run/t", "KERNEL_ENV_MAX_SESSIONS_PER_TENANT": "3"}
    settings = ServerSettings.from_env(env)
    assert (settings.tokens_file, settings.max_sessions_per_tenant) == ("/run/t", 3)
    assert ServerSettings.from_env(env, tokens_file="/x").tokens_file == "/x"
    assert ServerSettings().max_sessions_per_tenant is None
    with pytest.raises(ValueError, match="max_sessions_per_tenant"):
        ServerSettings(max_sessions_per_tenant=0)


@pytest.mark.integration
def test_serve_stops_at_a_malformed_tokens_file_with_one_clear_line(tmp_path: Path) -> None:
    path = write_tokens(tmp_path, f"alice client {TOKENS['alice']}\nbob client\n")
    done = subprocess.run(
        [sys.executable, "-m", "kernel_env", "serve", "--port", "0", "--tokens-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"kernel-env serve: tokens file {path}, line 2: expected three fields, "
        "name role token (a token holds no space)"
    )
    assert TOKENS["alice"] not in done.stderr + done.stdout


@pytest.mark.integration
def test_no_token_reaches_the_servers_log(tmp_path: Path) -> None:
    """At debug level, through resets, steps, refusals and sockets of every tenant, the log
    names the file (it warns that others can read it) but never a token: neither a tenant's
    (the websockets library logs each handshake header) nor a reset frame's hf_token."""
    tokens = write_tokens(tmp_path, mode=0o644)
    with serve_process(
        "--sandbox",
        "none",
        "--pool-size",
        "1",
        "--log-level",
        "debug",
        "--tokens-file",
        str(tokens),
        env=_env(KERNEL_ENV_TOKEN=LEGACY),
    ) as server:
        url = server.url
        sid = httpx.post(f"{url}/reset", json={}, headers=as_("alice"), timeout=60).headers[
            "X-Session-Id"
        ]
        for who in ("alice", "bob", "ops", "legacy"):
            headers = {**as_(who), "X-Session-Id": sid}
            httpx.post(f"{url}/step", json={"action": {"code": "1"}}, headers=headers, timeout=60)
            httpx.get(f"{url}/sessions", headers=as_(who), timeout=10)
        wrong = {"Authorization": f"Bearer {UNKNOWN}"}
        assert httpx.get(f"{url}/sessions", headers=wrong, timeout=10).status_code == 401
        ws_url = url.replace("http", "ws", 1) + f"/ws?session={sid}"
        assert first_reply(ws_url, as_("bob"), {"type": "state"})["type"] == "error"
        reset = {"type": "reset", "data": {"hf_token": HF_TOKEN}}
        assert first_reply(ws_url.split("?")[0], as_("alice"), reset)["type"] == "observation"
        with pytest.raises(InvalidStatus):
            connect(ws_url, additional_headers=wrong, open_timeout=10)
        log = server.log.read_text(errors="replace")
    assert "GET /sessions" in log and f"tokens file {tokens}" in log and "others can read" in log
    assert "< authorization: [redacted]" in log  # the line that held a token at debug level
    for secret in (*TOKENS.values(), LEGACY, UNKNOWN, HF_TOKEN):
        assert secret not in log
