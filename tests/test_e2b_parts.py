"""The E2B front door's pure parts: output events -> E2B's lines, and envd's file operations
as the kernel runs them (``kernel_env.inkernel.envd``, called here in-process on a temporary
home)."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import pytest

from kernel_env.inkernel import envd
from kernel_env.inkernel.contract import DEFAULT_OUTPUT_CAP
from kernel_env.server.e2b.interpreter import e2b_output
from kernel_env.server.e2b.signed import signature
from kernel_env.server.e2b.transfers import DOWN_CHUNK
from kernel_env.server.logs import HideSignatures


def test_streams_results_and_errors_become_e2b_lines() -> None:
    """stdout/stderr keep their text; a MIME bundle spreads over E2B's fields (a string's
    quotes dropped, unknown types in extra); an error joins its traceback."""
    out = e2b_output({"output_type": "stream", "name": "stderr", "text": "oops\n"})
    assert out is not None and (out["type"], out["text"]) == ("stderr", "oops\n")
    assert isinstance(out["timestamp"], int)

    result = e2b_output(
        {
            "output_type": "execute_result",
            "data": {"text/plain": "'abc'", "image/png": "iVBOR", "application/x-thing": 1},
        }
    )
    assert result == {
        "type": "result",
        "is_main_result": True,
        "text": "abc",
        "png": "iVBOR",
        "extra": {"application/x-thing": 1},
    }
    shown = e2b_output({"output_type": "display_data", "data": {"text/html": "<b>x</b>"}})
    assert shown == {"type": "result", "is_main_result": False, "html": "<b>x</b>"}

    error = e2b_output(
        {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["a", "b"]}
    )
    assert error == {"type": "error", "name": "E", "value": "v", "traceback": "a\nb"}
    assert e2b_output({"output_type": "clear_output", "wait": False}) is None


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def call(name: str, **args: object) -> object:
    answer = json.loads(repr(envd.call(name, json.dumps(args))))
    return answer.get("ok", answer.get("error"))


def test_home_user_is_the_kernels_home(home: Path) -> None:
    """/home/user and relative paths land in $HOME; answers show E2B's paths."""
    data = "aGk="  # "hi"
    assert call("write", path="/home/user/a/b.txt", data=data) == {
        "name": "b.txt",
        "type": "file",
        "path": "/home/user/a/b.txt",
    }
    assert (home / "a" / "b.txt").read_text() == "hi"
    assert call("read", path="a/b.txt") == data
    entry = call("stat", path="/home/user/a")
    assert isinstance(entry, dict) and (entry["type"], entry["path"]) == ("dir", "/home/user/a")


def test_file_operations_answer_with_connect_codes(home: Path) -> None:
    """A missing file is not_found, an existing directory already_exists; list, move and
    remove do what E2B's do."""
    assert call("read", path="none.txt") == {
        "code": "not_found",
        "message": "No such file or directory: /home/user/none.txt",
    }
    assert isinstance(call("make_dir", path="d/e"), dict)
    assert call("make_dir", path="d/e")["code"] == "already_exists"  # type: ignore[index]
    call("write", path="d/f.txt", data="")
    listed = call("list_dir", path="/home/user/d", depth=1)
    assert [e["name"] for e in listed] == ["e", "f.txt"]  # type: ignore[union-attr]
    deep = call("list_dir", path="/home/user", depth=2)
    assert {e["path"] for e in deep} == {
        "/home/user/d",
        "/home/user/d/e",  # type: ignore[union-attr]
        "/home/user/d/f.txt",
    }
    moved = call("move", source="d/f.txt", destination="/home/user/g.txt")
    assert moved["path"] == "/home/user/g.txt"  # type: ignore[index]
    assert call("remove", path="d") is None and not (home / "d").exists()
    assert call("no_such_operation")["code"] == "unimplemented"  # type: ignore[index]


def test_a_file_is_written_and_read_a_chunk_at_a_time(home: Path) -> None:
    """``write`` with ``append`` adds to the file; ``read`` takes ``size`` bytes from
    ``offset`` (fewer at the end, none past it); a download's chunk, in base64 inside the
    call's JSON answer, stays under the kernel's output cap, which would cut it."""
    first, second = base64.b64encode(b"abc").decode(), base64.b64encode(b"defg").decode()
    call("write", path="c.bin", data=first)
    call("write", path="c.bin", data=second, append=True)
    assert (home / "c.bin").read_bytes() == b"abcdefg"
    assert base64.b64decode(str(call("read", path="c.bin", offset=2, size=3))) == b"cde"
    assert base64.b64decode(str(call("read", path="c.bin", offset=5, size=3))) == b"fg"
    assert call("read", path="c.bin", offset=7, size=3) == ""
    call("write", path="c.bin", data=second)  # not appended: the file is made again
    assert (home / "c.bin").read_bytes() == b"defg"
    (home / "big.bin").write_bytes(b"\xff" * (2 * DOWN_CHUNK))
    answer = repr(envd.call("read", json.dumps({"path": "big.bin", "size": DOWN_CHUNK})))
    assert len(answer) < DEFAULT_OUTPUT_CAP
    assert len(base64.b64decode(json.loads(answer)["ok"])) == DOWN_CHUNK


def test_a_file_links_signature_is_the_sdks() -> None:
    """signed.signature computes what the SDK's get_signature does, with and without an
    expiration, for the default user and a named one."""
    sdk = pytest.importorskip("e2b.sandbox.signature")
    for user, expires in ((None, None), ("user", 120)):
        signed = sdk.get_signature("a/b.txt", "read", user, "tok", expires)
        assert (
            signature("a/b.txt", "read", user or "", "tok", signed["expiration"])
            == (signed["signature"])
        )
    assert signature("a", "read", "", "tok") != signature("a", "write", "", "tok")


def test_an_access_line_hides_a_links_signature() -> None:
    """The access log keeps a signed link's path, not its signature."""
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        "",
        0,
        '%s "%s %s"',
        ("c", "GET", "/files?path=a&signature=v1_x&n=1"),
        None,
    )
    assert HideSignatures().filter(record)
    assert record.getMessage() == 'c "GET /files?path=a&signature=[hidden]&n=1"'
