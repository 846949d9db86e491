"""The operator's routes: a landing page, readiness, Prometheus metrics, running sessions,
`kernel-env ps`, one log format with a line per episode end, and /docs with no CDN."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway import free_port
from prometheus_client.parser import text_string_to_metric_families
from serverkit import (
    LoopbackClient,
    make_client,
    serve_process,
    small_settings,
    thread_server,
    wait_until,
)

from kernel_env.kernel.scripted import ScriptedSource
from kernel_env.server import create_app
from kernel_env.server.settings import ServerSettings

pytestmark = pytest.mark.integration  # kernels, servers or other processes

KERNEL_ENV = str(Path(sys.executable).with_name("kernel-env"))
TOKEN = "operator-token-5e1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_landing_page_links_the_rest_and_needs_no_token() -> None:
    with make_client(token=TOKEN, sandbox="none") as client:
        page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for path in ("/docs", "/health", "/ready", "/metrics", "/sessions"):
        assert f'href="{path}"' in page.text


def test_metrics_in_prometheus_format_parse_with_prometheus_clients_parser() -> None:
    with make_client(sandbox="none") as client:
        sid = client.post("/reset", json={}).headers["X-Session-Id"]
        client.post("/step", json={"action": {"code": "x = 1"}}, headers={"X-Session-Id": sid})
        as_json = client.get("/metrics").json()
        text = client.get("/metrics", headers={"Accept": "text/plain"})
        direct = client.get("/metrics/prometheus")
    assert text.headers["content-type"].startswith("text/plain")
    assert direct.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(text.text)}
    steps = families["kernel_env_steps"]
    assert steps.type == "counter" and steps.samples[0].value == as_json["steps"] == 1
    assert families["kernel_env_sessions_active"].type == "gauge"
    assert families["kernel_env_sessions_active"].samples[0].value == 1
    assert {f.name for f in text_string_to_metric_families(direct.text)} == set(families)


def test_sessions_lists_running_episodes_behind_the_token() -> None:
    with make_client(token=TOKEN, sandbox="none") as client:
        assert client.get("/sessions").status_code == 401
        ids = []
        for task in ("count the words", "find the needle"):
            body = {"task_prompt": task, "context": "SECRET-CTX"}
            reply = client.post("/reset", json=body, headers=AUTH)
            ids.append(reply.headers["X-Session-Id"])
        client.post(
            "/step", json={"action": {"code": "1"}}, headers={"X-Session-Id": ids[0], **AUTH}
        )
        listed = client.get("/sessions", headers=AUTH)
    body = listed.json()
    assert {s["session_id"] for s in body["sessions"]} == set(ids)
    first = next(s for s in body["sessions"] if s["session_id"] == ids[0])
    assert first["episode"]["task"] == "count the words" and first["episode"]["steps"] == 1
    assert first["state"] == "idle" and first["kind"] == "http"
    assert "SECRET-CTX" not in listed.text


def test_kernel_env_ps_lists_a_servers_episodes() -> None:
    with thread_server(small_settings(token=TOKEN, sandbox="none")) as url:
        httpx.post(f"{url}/reset", json={"task_prompt": "ps me"}, headers=AUTH, timeout=60)
        env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
        shown = subprocess.run(
            [KERNEL_ENV, "ps", "--url", url], capture_output=True, text=True, timeout=60, env=env
        )
        refused = subprocess.run(
            [KERNEL_ENV, "ps", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "KERNEL_ENV_TOKEN"},
        )
    assert shown.returncode == 0, shown.stderr
    assert "ps me" in shown.stdout and "1 session(s)" in shown.stdout
    assert refused.returncode == 2 and "KERNEL_ENV_TOKEN" in refused.stderr


def test_readiness_fails_while_kernels_cannot_start_and_liveness_holds() -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    with thread_server(small_settings(gateway_url=unreachable)) as url:
        assert wait_until(
            lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, timeout=30
        )
        ready = httpx.get(f"{url}/ready", timeout=5).json()
        health = httpx.get(f"{url}/health", timeout=5)
    assert "kernels cannot start" in ready["reason"] and "gateway" in ready["reason"]
    assert health.status_code == 200 and health.json()["status"] == "healthy"


def test_a_healthy_server_is_ready() -> None:
    with make_client(sandbox="none") as client:
        assert wait_until(lambda: client.get("/ready").status_code == 200, timeout=30)
        assert client.get("/ready").json()["status"] == "ready"


def test_json_logs_one_format_and_a_line_per_episode_end() -> None:
    with serve_process("--sandbox", "none", "--log-format", "json") as server:
        sid = httpx.post(f"{server.url}/reset", json={}, timeout=60).headers["X-Session-Id"]
        step = {"action": {"code": "FINAL(42)"}}
        httpx.post(f"{server.url}/step", json=step, headers={"X-Session-Id": sid}, timeout=60)
        assert wait_until(lambda: "ended (final answer)" in server.log.read_text(), timeout=10)
        lines = server.log.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    others = [line for line in lines if not line.startswith("{")]
    assert all(line.startswith("kernel-env:") for line in others), others  # the status lines
    loggers = {r["logger"] for r in records}
    assert (
        "uvicorn.error" in loggers
        and "uvicorn.access" in loggers
        and "kernel_env.environment" in loggers
    )
    end = next(r for r in records if "ended (final answer)" in r["message"])
    assert "1 step(s), reward" in end["message"] and "LLM call(s)" in end["message"]


def test_docs_are_served_from_the_package() -> None:
    with make_client(token=TOKEN, sandbox="none") as client:
        page = client.get("/docs")
        script = client.get("/static-offline-docs/swagger-ui-bundle.js")
    assert page.status_code == 200 and "/static-offline-docs/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower()
    assert script.status_code == 200 and len(script.content) > 100_000


def test_the_new_routes_need_the_token_and_the_public_prefix_opens_nothing_else() -> None:
    """Every route this server added that shows or changes an episode refuses a request
    without the token; the public docs-assets prefix cannot be walked out of."""
    with make_client(token=TOKEN, sandbox="none") as client:
        sid = client.post("/reset", json={"context": "SECRET-CTX"}, headers=AUTH).headers[
            "X-Session-Id"
        ]
        guarded = [
            ("get", "/sessions"),
            ("get", "/metrics/prometheus"),
            ("get", f"/web/api/sessions/{sid}/events"),
            ("get", f"/sessions/{sid}/notebook.html"),
            ("post", f"/sessions/{sid}/fork"),
        ]
        for method, path in guarded:
            assert getattr(client, method)(path).status_code == 401, path
        for path in (
            "/static-offline-docs/%2e%2e/sessions",
            f"/static-offline-docs/%2e%2e/web/api/sessions/{sid}/events",
            "/static-offline-docs/..%2f..%2fsessions",
        ):
            reply = client.get(path)
            assert reply.status_code in (404, 401), (path, reply.status_code)
            assert "SECRET-CTX" not in reply.text and sid not in reply.text
        assert client.get(f"/web/api/sessions/{sid}/events", headers=AUTH).status_code == 200


# -- a thousand sessions ----------------------------------------------------------------------

MANY = 1001  # past the largest page (1000), so `kernel-env ps` asks for two


def _scripted_app(**overrides: object) -> tuple[Any, ServerSettings]:
    settings = small_settings(max_sessions=MANY, pool_size=0, claim_ttl=0, **overrides)
    return create_app(settings, kernel_factory=ScriptedSource()), settings


async def _open_many(url: str, n: int) -> list[str]:
    gate = asyncio.Semaphore(16)

    async def one(client: httpx.AsyncClient) -> str:
        async with gate:
            reply = await client.post("/reset", json={})
            assert reply.status_code == 200, reply.text
            return reply.headers["X-Session-Id"]

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


@pytest.fixture(scope="module")
def thousand() -> Iterator[tuple[str, list[str]]]:
    """A real server of 1,001 open HTTP sessions on scripted kernels (16 resets at a time);
    its URL and their ids."""
    app, settings = _scripted_app()
    with thread_server(settings, app) as url:
        yield url, asyncio.run(_open_many(url, MANY))


def _pages(client: Any, headers: dict[str, str] | None = None, **params: int) -> list[Any]:
    pages, after = [], 0
    while after is not None:
        reply = client.get("/sessions", params={**params, "after": after}, headers=headers or {})
        assert reply.status_code == 200, reply.text
        pages.append(reply.json())
        after = pages[-1]["next"]
    return pages


def test_sessions_come_a_page_at_a_time_in_the_order_they_opened(
    thousand: tuple[str, list[str]],
) -> None:
    """1,001 sessions: GET /sessions answers 100 (its default page), each page's `next` leads
    to the next, and the pages hold every session once, in one order whatever their size;
    at most 1,000 a page; /metrics counts them all."""
    url, ids = thousand
    with httpx.Client(base_url=url, timeout=30) as client:
        pages = _pages(client)
        big = _pages(client, limit=1000)
        refused = [client.get("/sessions", params={"limit": n}).status_code for n in (0, 1001)]
        active = client.get("/metrics").json()["sessions_active"]
    assert [len(p["sessions"]) for p in pages] == [100] * 10 + [1]
    assert {p["total"] for p in pages} == {MANY} and pages[-1]["next"] is None
    listed = [s["session_id"] for p in pages for s in p["sessions"]]
    assert len(listed) == len(set(listed)) and set(listed) == set(ids)
    assert [s["session_id"] for p in big for s in p["sessions"]] == listed  # the same order
    assert [len(p["sessions"]) for p in big] == [1000, 1]
    assert refused == [422, 422]
    assert active == MANY


def test_kernel_env_ps_lists_every_session_page_after_page(
    thousand: tuple[str, list[str]],
) -> None:
    """`kernel-env ps` on a server of 1,001 sessions asks for two pages and lists all."""
    url, ids = thousand
    shown = subprocess.run(
        [KERNEL_ENV, "ps", "--url", url], capture_output=True, text=True, timeout=90
    )
    assert shown.returncode == 0, shown.stderr
    listed = [line.split()[0] for line in shown.stdout.splitlines()[1:-1]]
    assert sorted(listed) == sorted(ids) and shown.stdout.endswith(f"{MANY} session(s)\n")


def test_a_session_closed_between_pages_shifts_none_of_the_others() -> None:
    """Pages list sessions in the order they opened, and the next page starts after the
    last session of the page before, not at a position: a session of the next page closing
    first is simply not on it."""
    app, _ = _scripted_app()
    with LoopbackClient(app) as client:
        ids = [client.post("/reset", json={}).headers["X-Session-Id"] for _ in range(7)]
        first = client.get("/sessions", params={"limit": 3}).json()
        assert client.delete(f"/sessions/{ids[3]}").status_code == 204
        second = client.get("/sessions", params={"limit": 3, "after": first["next"]}).json()
    assert [s["session_id"] for s in first["sessions"]] == ids[:3]
    assert [s["session_id"] for s in second["sessions"]] == ids[4:7]
    assert second["total"] == 6 and second["next"] is None


def test_a_client_tenants_pages_and_total_are_its_own(tmp_path: Path) -> None:
    """A client tenant pages through its own sessions among others', and its total counts
    only them."""
    tokens = tmp_path / "tokens"
    tokens.write_text("ops operator ops-token-0123456789\nann client ann-token-0123456789\n")
    app, _ = _scripted_app(tokens_file=str(tokens))
    ops = {"Authorization": "Bearer ops-token-0123456789"}
    ann = {"Authorization": "Bearer ann-token-0123456789"}
    with LoopbackClient(app) as client:

        def open_as(headers: dict[str, str], n: int) -> list[str]:
            return [
                client.post("/reset", json={}, headers=headers).headers["X-Session-Id"]
                for _ in range(n)
            ]

        theirs = open_as(ops, 4)
        mine = open_as(ann, 5)
        theirs += open_as(ops, 4)
        mine += open_as(ann, 2)
        pages = _pages(client, ann, limit=3)
        everyone = _pages(client, ops, limit=100)
    assert [len(p["sessions"]) for p in pages] == [3, 3, 1]
    assert [s["session_id"] for p in pages for s in p["sessions"]] == mine
    assert {p["total"] for p in pages} == {7}
    assert everyone[0]["total"] == 15 and len(everyone[0]["sessions"]) == 15
    assert {s["session_id"] for s in everyone[0]["sessions"]} == set(theirs + mine)
