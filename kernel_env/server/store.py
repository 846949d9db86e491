"""The episode store: every episode a server runs, kept on disk as it runs.

A store is a directory::

    DIR/index.sqlite            the index (:mod:`.index`): a row per episode
    DIR/episodes/<key>-<id>/    an episode's journal while it runs (:mod:`.journal`), then
                                its notebook, its context file, its rlm_query children's
                                notebooks (as an export writes them)
    DIR/servers/<id>.lock       held (flock) by each server that writes here, while it lives

The session core (:mod:`.sessions`) calls it as episodes begin (a reset, a fork's copy),
step and end, from whichever door they came. A completed step is one line appended to the
episode's journal, on the event loop, before the step's answer goes out: a server killed at
any point loses no completed step, and a step costs the same at its 1st step as at its
1,000th. A new episode's row and journal are written in a thread (its reset waits on them);
the rest runs in the store's one worker thread, in the order it was asked, and no step
waits on it: the index rows (a running episode's row is brought up to date a moment later,
and before any read of the index), the notebook, rendered from the journal and written
once, as the episode ends (temporary file, fsync, rename), rlm_query children, retention.
Reads of the index go through the same thread, after the writes asked before them, so an
answer sent after a step's reads that step. A running episode's notebook is rendered from
its journal when asked for.

At start, the episodes a dead server left ``running`` (its lock is free) get their notebook
from their journal and are marked ``interrupted``; several live servers may share one
directory. As episodes end, retention (:mod:`.retention`) removes the oldest beyond
``--episodes-keep``, never a running one.

A store that cannot write (a full disk, a removed directory) says so in the log and lets the
episode go on: keeping an episode never fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kernel_env.errors import StoredEpisodeError
from kernel_env.notebook import (
    INLINE_CONTEXT_CHARS,
    child_notebook_name,
    notebook_name,
    notebook_text,
)
from kernel_env.record import EpisodeRecord, StepRecord
from kernel_env.server.index import Filters, Index, Page
from kernel_env.server.journal import (
    Journal,
    Replayed,
    header_line,
    journal_path,
    outcome_line,
    read_journal,
    step_line,
)
from kernel_env.server.retention import Keep, to_remove

__all__ = ["INDEX_NAME", "EpisodeStore", "StoreReader", "write_durably"]

log = logging.getLogger(__name__)

T = TypeVar("T")
INDEX_NAME = "index.sqlite"
_TASK_CHARS = 2000  # of the task prompt, in the index (the notebook has it whole)
_DEAD_SERVER = "the server stopped before the episode ended (killed, or it crashed)"
_ROWS_EVERY = 0.5  # seconds: how stale a running episode's row may be for another process
_FAILURES = (OSError, sqlite3.Error, ValueError, TypeError, StoredEpisodeError)


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


def render(journal: Path, name: str) -> tuple[Replayed, bytes]:
    """The episode a journal holds, and its notebook's bytes (as ``name``)."""
    replayed = read_journal(journal)
    if replayed.unreadable:
        log.warning(
            "episode store: %d unreadable line(s) of %s skipped (a torn last line is a "
            "server killed while writing it)",
            replayed.unreadable,
            journal.relative_to(journal.parents[2]),
        )
    text = notebook_text(replayed.record, name, validate=False)
    return replayed, text.encode()


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

    async def call(self, read: Callable[[], T]) -> T:
        """``read()`` (of this store's methods) off the event loop."""
        return await asyncio.to_thread(read)

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
        """A stored episode's notebook: its file name and bytes, checked to be JSON (a
        running one's rendered from its journal)."""
        path = self.directory / row["path"]
        journal = journal_path(path)
        try:
            if row["state"] == "running" and journal.is_file():
                return path.name, render(journal, path.name)[1]
            data = path.read_bytes()
            json.loads(data)
        except (OSError, ValueError, StoredEpisodeError) as exc:
            log.warning("episode store: the notebook of %s is unreadable: %s", row["key"], exc)
            raise StoredEpisodeError(
                f"the stored notebook of episode {row['episode_id'][:80]!r} is missing or "
                "unreadable"
            ) from None
        return path.name, data

    def export_zip(self, row: dict[str, Any]) -> tuple[str, bytes]:
        """A stored episode's files, as an export archive is (``GET /sessions/{id}/
        export.zip``): its notebook, its context file, its rlm_query children's notebooks,
        at the archive's top level; the archive's file name."""
        name, notebook = self.notebook(row)
        folder, stem = (self.directory / row["path"]).parent, Path(name).stem
        # Not its journal, nor a file being written (".name.tmp"); a child has no files beside.
        beside = [
            file
            for file in ([] if row["relation"] == "child" else sorted(folder.iterdir()))
            if file.name.startswith(f"{stem}.")
            and file.suffix in (".ipynb", ".txt")
            and file.name != name
            and file.is_file()
        ]
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(name, notebook)
            for file in beside:
                archive.write(file, file.name)
        return f"{stem}.zip", buffer.getvalue()


@dataclass
class _Running:
    """What the store holds of an episode while it runs (on the event loop's side)."""

    journal: Journal
    folder: Path
    name: str  # its notebook's file name
    tenant: str
    steps: int  # steps in its journal


class EpisodeStore(StoreReader):
    """A store a server writes to (one per server process; see the module's docstring)."""

    def __init__(self, directory: Path, index: Index, keep: Keep, lock: int, server: str):
        super().__init__(directory, index)
        self.keep = keep
        self.server = server  # this server's id in the rows it writes
        self._lock_fd = lock
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="episode-store")
        self._running: dict[int, _Running] = {}  # by key; the event loop's alone
        self._rows: dict[int, tuple[Path, dict[str, Any]]] = {}  # row changes not yet written
        self._rows_lock = threading.Lock()
        self._rows_timer: asyncio.TimerHandle | None = None

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
        """Once every episode ended: the work asked of the worker done, the files closed."""
        self._worker.submit(self._write_rows)
        self._worker.shutdown(wait=True)
        for running in self._running.values():
            running.journal.close()
        self._running.clear()
        super().close()
        with contextlib.suppress(OSError):
            (self.directory / "servers" / f"{self.server}.lock").unlink()
        os.close(self._lock_fd)

    async def aclose(self) -> None:
        if self._rows_timer is not None:
            self._rows_timer.cancel()
        await asyncio.to_thread(self.close)

    async def call(self, read: Callable[[], T]) -> T:
        """``read()`` in the worker, after every write asked before it."""

        def rows_then_read() -> T:
            self._write_rows()
            return read()

        return await asyncio.wrap_future(self._worker.submit(rows_then_read))

    def _interrupt_dead_servers(self) -> None:
        for server in self.index.running_servers(but=self.server):
            if _alive(self.directory / "servers" / f"{server}.lock"):
                continue
            for key, path, tenant in self.index.running_of(server):
                self._recover(key, self.directory / path, tenant)
            count = self.index.interrupt_server(server, _DEAD_SERVER, time.time())
            log.warning("episode store: %d episode(s) of a stopped server: interrupted", count)
            with contextlib.suppress(OSError):
                (self.directory / "servers" / f"{server}.lock").unlink()

    def _recover(self, key: int, notebook: Path, tenant: str) -> None:
        """A dead server's running episode: its notebook and children from its journal."""
        if not journal_path(notebook).is_file():
            return  # written before journals, or its notebook was already written
        try:
            self._finish(key, notebook, tenant, _DEAD_SERVER, retire=False)
        except _FAILURES as exc:
            log.error("episode store: the journal of episode %d is unreadable: %s", key, exc)

    # -- the session core's calls (a failure is logged, never raised) ------------------------

    async def begin(
        self,
        record: EpisodeRecord,
        *,
        session_id: str,
        tenant: str,
        parent: int | None = None,
        relation: str | None = None,
    ) -> int | None:
        """A new episode's row and journal; its key (None: it could not be stored)."""

        def begin() -> tuple[int, _Running]:
            key = self._insert(record, session_id, tenant, parent, relation, container=None)
            folder = self.directory / "episodes" / f"{key}-{notebook_name(record.episode_id)[:-6]}"
            folder.mkdir(mode=0o700, exist_ok=True)
            name = notebook_name(record.episode_id)
            self.index.update(key, {"path": str((folder / name).relative_to(self.directory))})
            if len(record.context) > INLINE_CONTEXT_CHARS:
                write_durably(folder / f"{Path(name).stem}.context.txt", record.context.encode())
            # A fork's copied steps are in its journal; their children are its parent's.
            lines = [header_line(record), *(step_line(s, record) for s in record.steps)]
            journal = Journal(journal_path(folder / name), b"".join(lines))
            return key, _Running(journal, folder, name, tenant, len(record.steps))

        try:
            # Not behind the worker's queue (ended episodes' notebooks): a reset waits on it,
            # and nothing asked before it concerns this episode.
            key, running = await asyncio.to_thread(begin)
        except _FAILURES as exc:
            log.error("episode store: episode %s was not stored: %s", record.episode_id, exc)
            return None
        self._running[key] = running
        return key

    def save(self, key: int | None, record: EpisodeRecord) -> None:
        """After a step, before its answer: the new steps in the journal; an episode that
        ended, finished (in the worker)."""
        running = None if key is None else self._running.get(key)
        if key is None or running is None:
            return
        new = record.steps[running.steps :]
        try:
            # On the loop: one write of a line to the page cache costs less than a hop to a
            # thread (benchmarks/README.md), and it must be in the file before the answer.
            running.journal.append(b"".join(step_line(step, record) for step in new))
        except _FAILURES as exc:
            log.error("episode store: a step of %s was not stored: %s", record.episode_id, exc)
            return
        running.steps = len(record.steps)
        if any(call.children for step in new for call in step.llm_calls):
            notebook, tenant = running.folder / running.name, running.tenant
            self._submit(
                record.episode_id, lambda: self._store_children(key, notebook, tenant, new)
            )
        self._row_changed(key, running.folder, _outcome(record))
        if record.done:
            self.end(key, record, "")

    def end(self, key: int | None, record: EpisodeRecord | None, reason: str) -> None:
        """The episode will not step again (it is done, its session closed, or reset): its
        notebook written, its row done if it was, else interrupted for ``reason``."""
        running = None if key is None else self._running.pop(key, None)
        if key is None or running is None or record is None:
            return
        try:
            running.journal.append(outcome_line(record))
        except _FAILURES as exc:
            log.error("episode store: the end of %s was not stored: %s", record.episode_id, exc)
        running.journal.close()
        notebook = running.folder / running.name
        self._submit(record.episode_id, lambda: self._finish(key, notebook, running.tenant, reason))

    def _submit(self, what: str, work: Callable[[], object]) -> None:
        def logged() -> None:
            try:
                work()
            except _FAILURES as exc:
                log.error("episode store: episode %s was not stored: %s", what, exc)

        self._worker.submit(logged).add_done_callback(_log_unexpected)

    # -- rows, a moment after the steps ------------------------------------------------------

    def _row_changed(self, key: int, folder: Path, changes: dict[str, Any]) -> None:
        with self._rows_lock:
            self._rows[key] = (folder, self._rows.get(key, (folder, {}))[1] | changes)
        if self._rows_timer is None:
            loop = asyncio.get_running_loop()
            self._rows_timer = loop.call_later(_ROWS_EVERY, self._rows_due)

    def _rows_due(self) -> None:
        self._rows_timer = None
        self._submit("rows", self._write_rows)

    def _write_rows(self) -> None:
        """In the worker: the running episodes' rows, up to date, in one transaction."""
        with self._rows_lock:
            rows, self._rows = self._rows, {}
        if rows:
            self.index.update_many(
                (key, changes | {"size": _size(folder)}) for key, (folder, changes) in rows.items()
            )

    # -- in the worker: notebooks, children, retention ----------------------------------------

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

    def _finish(
        self, key: int, notebook: Path, tenant: str, reason: str, *, retire: bool = True
    ) -> None:
        """The ended episode's notebook, from its journal, and its row; then retention."""
        self._write_rows()  # a pending change must not land after the final one
        journal = journal_path(notebook)
        replayed, data = render(journal, notebook.name)
        record = replayed.record
        self._store_children(key, notebook, tenant, record.steps)
        write_durably(notebook, data)
        changes = _outcome(record) | {"size": _size(notebook.parent, but=journal)}
        changes |= {"ended": time.time(), "state": "done" if record.done else "interrupted"}
        changes["reason"] = None if record.done else reason
        if replayed.unreadable and not record.done:
            changes["reason"] += f" ({replayed.unreadable} unreadable journal line(s) skipped)"
        self.index.update(key, changes)
        journal.unlink()
        if retire:
            self._retire()

    def _store_children(self, key: int, parent: Path, tenant: str, steps: list[StepRecord]) -> None:
        """The rlm_query child episodes of these steps not stored yet: each its notebook
        beside its parent's notebook (``parent``), and a row of its own."""
        stored = set(self.index.child_paths(key))
        for step in steps:
            children = [child for call in step.llm_calls for child in call.children]
            for n, child in enumerate(children, 1):
                notebook = parent.with_name(child_notebook_name(parent.stem, step.index, n))
                path = str(notebook.relative_to(self.directory))
                if path not in stored:
                    self._child(key, tenant, child, notebook, path)

    def _child(
        self, key: int, tenant: str, child: EpisodeRecord, notebook: Path, path: str
    ) -> None:
        write_durably(notebook, notebook_text(child, notebook.name, validate=False).encode())
        row = self._insert(child, "", tenant, key, "child", container=key, path=path)
        self.index.update(
            row,
            _outcome(child)
            | {
                "session_id": None,
                "state": "done" if child.done else "interrupted",
                "reason": None if child.done else "its parent's rlm_query ended before it did",
                "ended": time.time(),
                "size": notebook.stat().st_size,
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


def _log_unexpected(done: Future[None]) -> None:
    if (exc := done.exception()) is not None:
        log.error("episode store: the worker failed", exc_info=exc)


def _size(folder: Path, but: Path | None = None) -> int:
    """The bytes of an episode's files (``but`` one of them)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f != but)


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
