"""Served episodes as notebooks: GET /sessions/{id}/notebook and /export.zip, the remote
client's export_notebook, and `kernel-env export` (B3 for the names a client may send)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from fastapi.testclient import TestClient
from serverkit import make_client, small_settings, thread_server

from kernel_env import KernelEnv
from kernel_env.archive import extract_export
from kernel_env.notebook import ExportPathError, recorded_steps

pytestmark = pytest.mark.integration  # kernels, servers or other processes

BIG = "word " * 4_000  # 20,000 characters: the context goes to a sidecar file


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with make_client(token="export-test-token") as c:
        c.headers["Authorization"] = "Bearer export-test-token"
        yield c


def _episode(client: TestClient, context: str) -> str:
    reset = client.post("/reset", json={"context": context, "task_prompt": "Count words."})
    sid = reset.headers["X-Session-Id"]
    step = client.post(
        "/step", json={"action": {"code": "len(context.split())"}}, headers={"X-Session-Id": sid}
    )
    assert step.status_code == 200
    return sid


def test_notebook_route_returns_a_valid_notebook(client: TestClient) -> None:
    sid = _episode(client, "one two three")
    response = client.get(f"/sessions/{sid}/notebook")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ipynb+json")
    nb = nbformat.reads(response.text, as_version=4)
    nbformat.validate(nb)
    (step,) = recorded_steps(nb)
    assert step.outputs[0]["data"]["text/plain"] == "3"
    assert nb.metadata["kernel_env"]["context"] == "one two three"
    assert "export-test-token" not in response.text


def test_export_zip_has_notebook_and_context_file(client: TestClient, tmp_path: Path) -> None:
    sid = _episode(client, BIG)
    response = client.get(f"/sessions/{sid}/export.zip", params={"name": "mine.ipynb"})
    assert response.status_code == 200
    names = zipfile.ZipFile(io.BytesIO(response.content)).namelist()
    assert sorted(names) == ["mine.context.txt", "mine.ipynb"]
    extract_export(response.content, tmp_path)
    assert (tmp_path / "mine.context.txt").read_text() == BIG
    nb = nbformat.read(tmp_path / "mine.ipynb", as_version=4)
    assert recorded_steps(nb)[0].outputs[0]["data"]["text/plain"] == "4000"


@pytest.mark.parametrize("name", ["../up.ipynb", "/abs.ipynb", "sub/x.ipynb", ".hidden", "a\0b"])
def test_export_names_cannot_leave_the_export(client: TestClient, name: str) -> None:
    """B3: a name with a path in it is refused with 422, nothing is written."""
    sid = _episode(client, "x")
    response = client.get(f"/sessions/{sid}/export.zip", params={"name": name})
    assert response.status_code == 422, response.text


def test_zip_members_with_paths_are_refused(tmp_path: Path) -> None:
    """B3 on the client: an archive whose member names leave the directory writes nothing."""
    for member in ["../evil.txt", "/tmp/evil.txt", "sub/evil.txt"]:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("fine.ipynb", "{}")
            archive.writestr(member, "evil")
        with pytest.raises(ExportPathError):
            extract_export(buffer.getvalue(), tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out").exists()


def test_notebook_routes_need_the_token_and_a_known_session(client: TestClient) -> None:
    sid = _episode(client, "x")
    bare = {"Authorization": ""}
    assert client.get(f"/sessions/{sid}/notebook", headers=bare).status_code == 401
    assert client.get("/sessions/nope/notebook").status_code == 404


def test_remote_client_exports_through_the_server(tmp_path: Path) -> None:
    """KernelEnv(base_url).export_notebook downloads the served episode, sidecar included,
    and `kernel-env export SESSION --url` writes the same files (plus HTML)."""
    with thread_server(small_settings()) as url, KernelEnv(url) as env:
        env.reset(context=BIG, task_prompt="Count words.")
        env.execute("n = len(context.split())\nprint(n)")
        path = env.export_notebook(tmp_path / "remote")
        assert path == (tmp_path / "remote.ipynb").resolve()
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert recorded_steps(nb)[0].outputs[0]["text"] == "4000\n"
        assert (tmp_path / "remote.context.txt").read_text() == BIG

        sid = env.reset(context="abc").observation.metadata["session_id"]
        # Hex ids: never read as an option when typed on a command line (no leading "-").
        assert re.fullmatch(r"[0-9a-f]{32}", sid)
        env.execute("print(context * 2)")
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "kernel_env",
                "export",
                sid,
                "--url",
                url,
                "-o",
                str(tmp_path / "cli.ipynb"),
                "--html",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.split() == [str(tmp_path / "cli.ipynb"), str(tmp_path / "cli.html")]
        nb = nbformat.read(tmp_path / "cli.ipynb", as_version=4)
        assert recorded_steps(nb)[0].outputs[0]["text"] == "abcabc\n"
        assert "abcabc" in (tmp_path / "cli.html").read_text()


def test_cli_export_errors_are_clear(tmp_path: Path) -> None:
    notebook = tmp_path / "x.ipynb"
    notebook.write_text("{}")
    cases = [
        (["export", str(notebook)], "already a notebook; add --html"),
        (["export", "some-session", "--url", "http://127.0.0.1:9"], "cannot reach"),
    ]
    for args, message in cases:
        run = subprocess.run(
            [sys.executable, "-m", "kernel_env", *args], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and message in run.stderr, run.stderr
