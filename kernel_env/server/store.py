"""The episode store: every episode a server runs, kept on disk as it runs.

A store is a directory::

    DIR/index.sqlite            the index (:mod:`.index`): a row per episode
    DIR/episodes/<key>-<id>/    an episode's notebook, its context file, its rlm_query
                                children's notebooks (as an export writes them)
    DIR/servers/<id>.lock       held (flock) by each server that writes here, while it lives

The session core (:mod:`.sessions`) calls it as episodes begin (a reset, a fork's copy),
step and end, from whichever door they came. After each completed step the episode's
notebook so far is written to a temporary file, flushed to the disk and renamed over the
last one, and its row updated: a server killed at any point loses no completed step, and a
reader never sees half a notebook. Writing runs in a worker thread, off the event loop.

At start, the episodes a dead server left ``running`` (its lock is free) are marked
``interrupted``; several live servers may share one directory. As episodes end, retention
(:mod:`.retention`) removes the oldest beyond ``--episodes-keep``, never a running one.

A store that cannot write (a full disk, a removed directory) says so in the log and lets the
episode go on: keeping an episode never fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kernel_env.errors import StoredEpisodeError
from kernel_env.notebook import (
    INLINE_CONTEXT_CHARS,
    child_notebook_name,
    notebook_name,
    notebook_text,
)
from kernel_env.record import EpisodeRecord
from kernel_env.server.index import Filters, Index, Page
from kernel_env.server.retention import Keep, to_remove

__all__ = ["INDEX_NAME", "EpisodeStore", "StoreReader", "write_durably"]

log = logging.getLogger(__name__)

T = TypeVar("T")
INDEX_NAME = "index.sqlite"
_TASK_CHARS = 2000  # of the task prompt, in the index (the notebook has it whole)
_DEAD_SERVER = "the server stopped before the episode ended (killed, or it crashed)"


def write_durably(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: a temporary file beside it, flushed to the disk,
    then renamed over it."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        # Owner-only: a store holds every tenant's episodes.
        with open(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class StoreReader:
    """Reads a store directory: listings, one episode, its notebook. A server's store is
    one; ``kernel-env episodes --episodes DIR`` uses one of its own, read-only."""

    def __init__(self, directory: Path, index: Index) -> None:
        self.directory = directory
        self.index = index

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> StoreReader:
        root = Path(directory)
        if not (root / INDEX_NAME).is_file():
            raise FileNotFoundError(f"no episode store in {root} (no {INDEX_NAME})")
        return cls(root, Index(root / INDEX_NAME, readonly=True))

    def close(self) -> None:
        self.index.close()

    def page(self, filters: Filters, *, cursor: int | None, limit: int) -> Page:
        page = self.index.page(filters, cursor=cursor, limit=limit)
        if page.skipped:
            log.warning("episode store: %d unreadable row(s) left out of a listing", page.skipped)
        return page

    def episode(self, episode_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The episode (``tenant``'s own; None: any) with its forks and children, or None."""
        row = self.index.find(episode_id, tenant)
        if row is None:
            return None
        related = self.index.related(row["key"])
        return {
            "episode": row,
            "children": [r for r in related if r["relation"] == "child"],
            "forks": [r for r in related if r["relation"] == "fork"],
        }

    def notebook(self, row: dict[str, Any]) -> tuple[str, bytes]:
        """A stored episode's notebook: its file name and bytes, checked to be JSON."""
        path = self.directory / row["path"]
        try:
            data = path.read_bytes()
            json.loads(data)
        except (OSError, ValueError) as exc:
            log.warning("episode store: the notebook of %s is unreadable: %s", row["key"], exc)
            raise StoredEpisodeError(
                f"the stored notebook of episode {row['episode_id'][:80]!r} is missing or "
                "unreadable"
            ) from None
        return path.name, data


class EpisodeStore(StoreReader):
    """A store a server writes to (one per server process; see the module's docstring)."""

    def __init__(self, directory: Path, index: Index, keep: Keep, lock: int, server: str):
        super().__init__(directory, index)
        self.keep = keep
        self.server = server  # this server's id in the rows it writes
        self._lock_fd = lock
        self._children: dict[int, int] = {}  # key -> steps whose children are stored
        self._tenants: dict[int, str] = {}  # key -> its tenant, while it runs

    @classmethod
    def open_sync(cls, directory: str | os.PathLike[str], keep: Keep) -> EpisodeStore:
        root = Path(directory).expanduser()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (root / "episodes").mkdir(mode=0o700, exist_ok=True)
        (root / "servers").mkdir(mode=0o700, exist_ok=True)
        server = f"{os.getpid()}-{secrets.token_hex(6)}"
        lock = os.open(root / "servers" / f"{server}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        store = cls(root, _open_index(root / INDEX_NAME), keep, lock, server)
        store._interrupt_dead_servers()
        return store

    @classmethod
    async def open(cls, directory: str | os.PathLike[str], keep: Keep) -> EpisodeStore:
        return await asyncio.to_thread(cls.open_sync, directory, keep)

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):
            (self.directory / "servers" / f"{self.server}.lock").unlink()
        os.close(self._lock_fd)

    def _interrupt_dead_servers(self) -> None:
        for server in self.index.running_servers(but=self.server):
            if _alive(self.directory / "servers" / f"{server}.lock"):
                continue
            count = self.index.interrupt_server(server, _DEAD_SERVER, time.time())
            log.warning("episode store: %d episode(s) of a stopped server: interrupted", count)
            with contextlib.suppress(OSError):
                (self.directory / "servers" / f"{server}.lock").unlink()

    # -- the session core's calls (each in a thread; a failure is logged, never raised) ----

    async def begin(
        self,
        record: EpisodeRecord,
        *,
        session_id: str,
        tenant: str,
        parent: int | None = None,
        relation: str | None = None,
    ) -> int | None:
        """A new episode's row and notebook; its key (None: it could not be stored)."""

        def begin() -> int:
            key = self._insert(record, session_id, tenant, parent, relation, container=None)
            self._children[key] = len(record.steps)  # a fork's shared steps are its parent's
            self._tenants[key] = tenant
            self._write(key, record)
            return key

        return await self._safely(f"episode {record.episode_id}", begin)

    async def save(self, key: int | None, record: EpisodeRecord) -> None:
        """After a step: the notebook so far and the row; an episode that ended, retired."""
        if key is not None:
            await self._safely(f"episode {record.episode_id}", lambda: self._save(key, record))

    async def end(self, key: int | None, record: EpisodeRecord | None, reason: str) -> None:
        """The episode will not step again (its session closed, or reset): done if it was,
        else interrupted for ``reason``."""
        if key is None or record is None:
            return

        def end() -> None:
            steps = self._children.pop(key, None)
            self._tenants.pop(key, None)
            if record.done and steps == len(record.steps):
                return  # written, and retired, as its last step ended
            self._write(key, record, ended=True, reason=reason)
            self._retire()

        await self._safely(f"episode {record.episode_id}", end)

    async def _safely(self, what: str, call: Callable[[], T]) -> T | None:
        try:
            return await asyncio.to_thread(call)
        except (OSError, sqlite3.Error, ValueError) as exc:
            log.error("episode store: %s was not stored: %s", what, exc)
            return None

    def _save(self, key: int, record: EpisodeRecord) -> None:
        stored = self._children.get(key, 0)
        for step in record.steps[stored:]:
            children = [child for call in step.llm_calls for child in call.children]
            for n, child in enumerate(children, 1):
                self._child(key, record, child, step.index, n)
        self._children[key] = len(record.steps)
        self._write(key, record, ended=record.done)
        if record.done:
            self._retire()

    # -- rows and files ----------------------------------------------------------------------

    def _insert(
        self,
        record: EpisodeRecord,
        session_id: str,
        tenant: str,
        parent: int | None,
        relation: str | None,
        container: int | None,
        path: str = "",
    ) -> int:
        return self.index.insert(
            {
                "episode_id": record.episode_id,
                "session_id": session_id,
                "tenant": tenant,
                "kernel": record.kernel_name,
                "task": record.task_prompt[:_TASK_CHARS],
                "state": "running",
                "started": record.started,
                "parent": parent,
                "relation": relation,
                "container": container,
                "path": path,
                "server": self.server,
            }
        )

    def _folder(self, key: int, record: EpisodeRecord) -> Path:
        return self.directory / "episodes" / f"{key}-{notebook_name(record.episode_id)[:-6]}"

    def _write(
        self, key: int, record: EpisodeRecord, *, ended: bool = False, reason: str | None = None
    ) -> None:
        folder = self._folder(key, record)
        folder.mkdir(mode=0o700, exist_ok=True)
        name = notebook_name(record.episode_id)
        text = notebook_text(record, name, validate=False)
        sidecar = folder / f"{Path(name).stem}.context.txt"
        if len(record.context) > INLINE_CONTEXT_CHARS and not sidecar.exists():
            write_durably(sidecar, record.context.encode())
        write_durably(folder / name, text.encode())
        changes = _outcome(record) | {
            "path": str((folder / name).relative_to(self.directory)),
            "size": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
        }
        if ended:
            changes |= {"ended": time.time(), "state": "done" if record.done else "interrupted"}
            changes["reason"] = None if record.done else reason
        self.index.update(key, changes)

    def _child(
        self, key: int, parent: EpisodeRecord, child: EpisodeRecord, step: int, n: int
    ) -> None:
        """An rlm_query child episode: its notebook beside its parent's, a row of its own."""
        folder = self._folder(key, parent)
        name = child_notebook_name(Path(notebook_name(parent.episode_id)).stem, step, n)
        write_durably(folder / name, notebook_text(child, name, validate=False).encode())
        path = str(folder.relative_to(self.directory) / name)
        tenant = self._tenants.get(key, "")
        row = self._insert(child, "", tenant, key, "child", container=key, path=path)
        self.index.update(
            row,
            _outcome(child)
            | {
                "session_id": None,
                "state": "done" if child.done else "interrupted",
                "reason": None if child.done else "its parent's rlm_query ended before it did",
                "ended": time.time(),
                "size": (folder / name).stat().st_size,
            },
        )

    def _retire(self) -> None:
        """Retention, once an episode ended: the oldest beyond ``keep`` go."""
        count, size, oldest = self.index.totals()
        keep, now = self.keep, time.time()
        if not (
            (keep.count is not None and count > keep.count)
            or (keep.size is not None and size > keep.size)
            or (keep.age is not None and oldest is not None and now - oldest > keep.age)
        ):
            return
        victims = to_remove(self.index.stored(), keep, now)
        for path in self.index.remove(victims):
            folder = (self.directory / path).parent
            if folder.parent == self.directory / "episodes":
                shutil.rmtree(folder, ignore_errors=True)
        if victims:
            log.info("episode store: %d episode(s) removed by --episodes-keep", len(victims))


def _outcome(record: EpisodeRecord) -> dict[str, Any]:
    return {
        "steps": len(record.steps),
        "reward": record.reward,
        "final_answer": record.final_answer,
        "done": int(record.done),
    }


def _alive(lock: Path) -> bool:
    """Whether the server that holds this lock file still runs (its flock is held)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _open_index(path: Path) -> Index:
    """The index; one SQLite cannot read is moved aside (said in the log) for a new one."""
    try:
        index = Index(path)
        index.totals()
        return index
    except sqlite3.DatabaseError as exc:
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        log.error("episode store: %s is unreadable (%s); moved to %s", path, exc, aside.name)
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.remove(f"{path}{suffix}")
        return Index(path)
