"""What E2B's sandbox daemon (envd) does, done inside an episode's kernel: files and processes.

The server's E2B front door calls :func:`call` in a silent request to the kernel (its
answer's ``repr`` is JSON, read from the request's ``user_expressions``), so every file it
touches and every command it starts is the kernel's own: same sandbox, same uid, same
limits, same workspace, and no path of the host. A command runs as a child of the kernel
(its own process group), its output read by a thread into a bounded buffer that the host
collects with ``proc_poll``.

E2B's home, ``/home/user``, is the kernel's ``$HOME`` (its workspace); a relative path is
relative to it.

Runs in the kernel: the standard library only.
"""

from __future__ import annotations

import base64
import grp
import json
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["E2B_HOME", "call"]

E2B_HOME = "/home/user"
E2B_USER = "user"  # E2B's name for its sandbox's user: here, the kernel's uid
_BUFFER_BYTES = 8 << 20  # undelivered output kept per process; beyond it, dropped and counted


class _JSON:
    """A value whose repr is its JSON (``user_expressions`` carry reprs)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return json.dumps(self.value)


class _Failure(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def call(name: str, args: str) -> _JSON:
    """``{"ok": result}`` of the operation ``name`` with JSON ``args``, or ``{"error":
    {"code", "message"}}`` (a Connect code: not_found, already_exists, invalid_argument...)."""
    operation = _OPERATIONS.get(name)
    if operation is None:
        return _JSON({"error": {"code": "unimplemented", "message": f"no operation {name}"}})
    try:
        return _JSON({"ok": operation(**json.loads(args))})
    except _Failure as exc:
        return _JSON({"error": {"code": exc.code, "message": str(exc)}})
    except FileNotFoundError as exc:
        return _JSON({"error": {"code": "not_found", "message": _say(exc)}})
    except FileExistsError as exc:
        return _JSON({"error": {"code": "already_exists", "message": _say(exc)}})
    except (NotADirectoryError, IsADirectoryError, ValueError) as exc:
        return _JSON({"error": {"code": "invalid_argument", "message": _say(exc)}})
    except PermissionError as exc:
        return _JSON({"error": {"code": "permission_denied", "message": _say(exc)}})
    except OSError as exc:
        return _JSON({"error": {"code": "internal", "message": _say(exc)}})


def _say(exc: OSError | ValueError) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror}: {_shown(str(exc.filename))}"
    return str(exc)


# -- paths -------------------------------------------------------------------------------


def _home() -> str:
    return os.path.expanduser("~")


def _real(path: str) -> str:
    """The kernel's path for E2B's ``path``."""
    if not path:
        raise ValueError("path is empty")
    if path == E2B_HOME or path.startswith(E2B_HOME + "/"):
        path = _home() + path[len(E2B_HOME) :]
    elif path == "~" or path.startswith("~/"):
        path = _home() + path[1:]
    return os.path.normpath(os.path.join(_home(), path))


def _shown(path: str) -> str:
    """E2B's path for the kernel's ``path``."""
    home = _home()
    if path == home or path.startswith(home + "/"):
        return E2B_HOME + path[len(home) :]
    return path


def _entry(path: str) -> dict[str, Any]:
    """E2B's entry for ``path``: a symlink is described by its target, as envd does (its
    type, size and mode; ``symlink_target`` names it); a dangling one as a symlink."""
    own = os.lstat(path)
    link = stat.S_ISLNK(own.st_mode)
    try:
        info = os.stat(path) if link else own
    except OSError:
        info = own
    kind = (
        "symlink" if stat.S_ISLNK(info.st_mode) else "dir" if stat.S_ISDIR(info.st_mode) else "file"
    )
    entry = {
        "name": os.path.basename(path) or "/",
        "type": kind,
        "path": _shown(path),
        "size": info.st_size,
        "mode": stat.S_IMODE(info.st_mode),
        "permissions": stat.filemode(info.st_mode),
        "owner": _named(info.st_uid, os.getuid(), pwd.getpwuid),
        "group": _named(info.st_gid, os.getgid(), grp.getgrgid),
        "modified": info.st_mtime,
    }
    if link:
        entry["symlink_target"] = _shown(os.path.realpath(path))
    return entry


def _named(number: int, own: int, lookup: Callable[[int], Any]) -> str:
    """E2B's name for a file's owner (or group): ``user`` for the kernel's own, as E2B names
    its sandbox's user; else the system's name for it, or its number."""
    if number == own:
        return E2B_USER
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


# -- files -------------------------------------------------------------------------------


def _stat(path: str) -> dict[str, Any]:
    return _entry(_real(path))


def _list_dir(path: str, depth: int = 1) -> list[dict[str, Any]]:
    root = _real(path)
    if not os.path.isdir(root):
        if not os.path.exists(root):
            raise FileNotFoundError(2, "No such file or directory", root)
        raise NotADirectoryError(20, "Not a directory", root)
    entries: list[dict[str, Any]] = []

    def walk(directory: str, level: int) -> None:
        for name in sorted(os.listdir(directory)):
            full = os.path.join(directory, name)
            entries.append(_entry(full))
            if level < depth and os.path.isdir(full) and not os.path.islink(full):
                walk(full, level + 1)

    walk(root, 1)
    return entries


def _make_dir(path: str) -> dict[str, Any]:
    real = _real(path)
    os.makedirs(os.path.dirname(real), exist_ok=True)
    os.mkdir(real)  # FileExistsError: E2B answers already_exists
    return _entry(real)


def _move(source: str, destination: str) -> dict[str, Any]:
    target = _real(destination)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(_real(source), target)
    return _entry(target)


def _remove(path: str) -> None:
    """Remove the file or the directory (with what it holds); nothing if it is not there,
    as envd does."""
    real = _real(path)
    if not os.path.lexists(real):
        return
    if os.path.isdir(real) and not os.path.islink(real):
        shutil.rmtree(real)
    else:
        os.remove(real)


def _read(path: str, offset: int = 0, size: int = -1) -> str:
    """``size`` bytes of the file from ``offset`` (all the rest: -1), in base64; fewer at
    its end. The host reads a large file a chunk at a time."""
    with open(_real(path), "rb") as f:
        f.seek(offset)
        return base64.b64encode(f.read(size)).decode("ascii")


def _write(path: str, data: str, append: bool = False) -> dict[str, Any]:
    """The file at ``path`` made ``data`` (base64), or ``data`` added at its end: the host
    writes a large file a chunk at a time."""
    real = _real(path)
    os.makedirs(os.path.dirname(real), exist_ok=True)
    with open(real, "ab" if append else "wb") as f:
        f.write(base64.b64decode(data))
    return {"name": os.path.basename(real), "type": "file", "path": _shown(real)}


def _set_envs(envs: dict[str, str]) -> None:
    """The sandbox's variables (E2B's ``envs``): the kernel's, and its commands' by inheritance."""
    os.environ.update(envs)


# -- processes ---------------------------------------------------------------------------


class _Process:
    """A command the kernel started, and its output not yet collected."""

    def __init__(self, popen: subprocess.Popen[bytes], config: dict[str, Any], tag: str | None):
        self.popen = popen
        self.config = config
        self.tag = tag
        self.lock = threading.Lock()
        self.chunks: list[tuple[str, bytes]] = []
        self.buffered = 0
        self.dropped = 0
        self.ended = False
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"envd-{popen.pid}")
        self.reader.start()

    def _read(self) -> None:
        selector = selectors.DefaultSelector()
        for name, stream in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            if stream is not None:
                selector.register(stream, selectors.EVENT_READ, name)
        while selector.get_map():
            for key, _ in selector.select():
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                self._keep(key.data, data)
        selector.close()
        self.popen.wait()
        with self.lock:
            self.ended = True

    def _keep(self, name: str, data: bytes) -> None:
        with self.lock:
            if self.buffered + len(data) > _BUFFER_BYTES:
                self.dropped += len(data)
                return
            if self.chunks and self.chunks[-1][0] == name:
                self.chunks[-1] = (name, self.chunks[-1][1] + data)
            else:
                self.chunks.append((name, data))
            self.buffered += len(data)

    def take(self) -> dict[str, Any]:
        with self.lock:
            chunks, self.chunks, self.buffered = self.chunks, [], 0
            ended = self.ended
        out = [[name, base64.b64encode(data).decode("ascii")] for name, data in chunks]
        result: dict[str, Any] = {"output": out, "end": None}
        if ended:
            code = self.popen.returncode
            status = f"exit status {code}" if code >= 0 else f"signal: {signal.Signals(-code).name}"
            result["end"] = {"exit_code": code, "exited": code >= 0, "status": status}
        return result


_PROCESSES: dict[int, _Process] = {}


def _proc_start(
    cmd: str,
    args: list[str],
    envs: dict[str, str],
    cwd: str | None,
    stdin: bool = False,
    tag: str | None = None,
) -> int:
    popen = subprocess.Popen(
        [cmd, *args],
        cwd=_real(cwd) if cwd else _home(),
        env={**os.environ, **envs},
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a kill takes its children, SIGINT spares it
    )
    config = {"cmd": cmd, "args": args, "envs": envs, "cwd": cwd}
    _PROCESSES[popen.pid] = _Process(popen, config, tag)
    return popen.pid


def _find(pid: int | None = None, tag: str | None = None) -> _Process:
    for found_pid, process in _PROCESSES.items():
        if (pid is not None and found_pid == pid) or (tag is not None and process.tag == tag):
            return process
    raise _Failure(
        "not_found", f"process with {'pid ' + str(pid) if pid else 'tag ' + str(tag)} not found"
    )


def _proc_find(pid: int | None = None, tag: str | None = None) -> int:
    """The pid of the process with this pid or tag, if the kernel started it (not_found
    otherwise; one that has ended is found until its end is collected)."""
    return _find(pid, tag).popen.pid


def _proc_poll(pid: int) -> dict[str, Any]:
    """The output since the last poll, and the end once the process has ended."""
    process = _find(pid)
    result = process.take()
    if result["end"] is not None:
        _PROCESSES.pop(pid, None)
    return result


def _proc_signal(signal_number: int, pid: int | None = None, tag: str | None = None) -> None:
    process = _find(pid, tag)
    if process.ended:  # reaped: its pid (and group id) may be another process's by now
        raise _Failure("not_found", "the process has ended")
    try:
        os.killpg(process.popen.pid, signal_number)
    except ProcessLookupError:
        raise _Failure("not_found", "the process has ended") from None


def _proc_input(data: str, pid: int | None = None, tag: str | None = None) -> None:
    process = _find(pid, tag)
    if process.popen.stdin is None:
        raise _Failure("failed_precondition", "the process was started without stdin")
    process.popen.stdin.write(base64.b64decode(data))
    process.popen.stdin.flush()


def _proc_close_stdin(pid: int | None = None, tag: str | None = None) -> None:
    process = _find(pid, tag)
    if process.popen.stdin is not None:
        process.popen.stdin.close()


def _proc_list() -> list[dict[str, Any]]:
    return [
        {"pid": pid, "tag": p.tag, "config": p.config}
        for pid, p in _PROCESSES.items()
        if not p.ended
    ]


_OPERATIONS: dict[str, Callable[..., Any]] = {
    "stat": _stat,
    "list_dir": _list_dir,
    "make_dir": _make_dir,
    "move": _move,
    "remove": _remove,
    "read": _read,
    "write": _write,
    "set_envs": _set_envs,
    "proc_start": _proc_start,
    "proc_find": _proc_find,
    "proc_poll": _proc_poll,
    "proc_signal": _proc_signal,
    "proc_input": _proc_input,
    "proc_close_stdin": _proc_close_stdin,
    "proc_list": _proc_list,
}
