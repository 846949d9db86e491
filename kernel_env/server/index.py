"""The episode store's index: one SQLite row per stored episode (the standard library's
``sqlite3``, WAL mode), and the queries that list, find and retire them.

Every call is short (an indexed lookup, a page of rows, one row written) and runs under the
index's lock, so that the store can call it from worker threads while the server's loop
never waits on SQLite. A row that cannot be read back (a value of the wrong type, a state
no server writes) is left out of an answer and said in the log, never raised: one bad row
must not hide the others. Times are seconds since the epoch.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel_env.server.retention import Stored

__all__ = ["STATES", "Filters", "Index", "Page"]

log = logging.getLogger(__name__)

STATES = ("running", "done", "interrupted")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    key          INTEGER PRIMARY KEY AUTOINCREMENT,
    episode_id   TEXT NOT NULL,
    session_id   TEXT,
    tenant       TEXT NOT NULL,
    kernel       TEXT,
    task         TEXT,
    steps        INTEGER NOT NULL DEFAULT 0,
    reward       REAL,
    final_answer TEXT,
    done         INTEGER NOT NULL DEFAULT 0,
    state        TEXT NOT NULL,
    reason       TEXT,
    started      REAL NOT NULL,
    ended        REAL,
    parent       INTEGER,
    relation     TEXT,
    container    INTEGER,
    path         TEXT NOT NULL,
    size         INTEGER NOT NULL DEFAULT 0,
    server       TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_by_id ON episodes (episode_id);
CREATE INDEX IF NOT EXISTS episodes_by_parent ON episodes (parent);
CREATE INDEX IF NOT EXISTS episodes_by_container ON episodes (container);
CREATE INDEX IF NOT EXISTS episodes_by_server ON episodes (server, state);
"""

_COLUMNS = (
    "e.key, e.episode_id, e.session_id, e.tenant, e.kernel, e.task, e.steps, e.reward, "
    "e.final_answer, e.done, e.state, e.reason, e.started, e.ended, e.relation, e.path, "
    "e.size, p.episode_id AS parent_id"
)
_FROM = "episodes AS e LEFT JOIN episodes AS p ON p.key = e.parent"


@dataclass(frozen=True)
class Filters:
    """What a listing keeps (None: no filter of that kind). ``tenant``: that tenant's own
    episodes only (a client's view; None: every one, an operator's)."""

    tenant: str | None = None
    task: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    done: bool | None = None
    state: str | None = None
    kernel: str | None = None
    since: float | None = None
    until: float | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses, values = [], []
        for column, op, value in (
            ("e.tenant", "=", self.tenant),
            ("e.reward", ">=", self.reward_min),
            ("e.reward", "<=", self.reward_max),
            ("e.state", "=", self.state),
            ("e.kernel", "=", self.kernel),
            ("e.started", ">=", self.since),
            ("e.started", "<=", self.until),
        ):
            if value is not None:
                clauses.append(f"{column} {op} ?")
                values.append(value)
        if self.done is not None:
            clauses.append("e.done = ?")
            values.append(int(self.done))
        if self.task:
            clauses.append("instr(lower(e.task), lower(?)) > 0")
            values.append(self.task)
        return " AND ".join(clauses) or "1", values


@dataclass(frozen=True)
class Page:
    episodes: list[dict[str, Any]]
    next_cursor: int | None  # the ``cursor`` of the next page; None: none is left
    skipped: int  # rows of this page that could not be read


class Index:
    """The index file of one store directory."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        if readonly:
            self._db = sqlite3.connect(
                f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=10
            )
        else:
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            # WAL's NORMAL: a committed row survives the server's death (a kill -9); only an
            # operating system's crash may lose the last ones, never corrupt the file.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, values: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock, self._db:
            return self._db.execute(sql, tuple(values))

    def _read(self, sql: str, values: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(values)).fetchall()

    # -- writing ---------------------------------------------------------------------------

    def insert(self, row: Mapping[str, Any]) -> int:
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        cursor = self._write(f"INSERT INTO episodes ({names}) VALUES ({marks})", row.values())
        return int(cursor.lastrowid or 0)

    def update(self, key: int, changes: Mapping[str, Any]) -> None:
        sets = ", ".join(f"{name} = ?" for name in changes)
        self._write(f"UPDATE episodes SET {sets} WHERE key = ?", [*changes.values(), key])

    def update_many(self, changes: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """Several rows' changes, in one transaction."""
        with self._lock, self._db:
            for key, change in changes:
                sets = ", ".join(f"{name} = ?" for name in change)
                self._db.execute(
                    f"UPDATE episodes SET {sets} WHERE key = ?", (*change.values(), key)
                )

    def running_servers(self, but: str) -> list[str]:
        rows = self._read(
            "SELECT DISTINCT server FROM episodes WHERE state = 'running' AND server != ?", [but]
        )
        return [str(row[0]) for row in rows]

    def running_of(self, server: str) -> list[tuple[int, str, str]]:
        """The episodes ``server`` left running (key, notebook path, tenant)."""
        rows = self._read(
            "SELECT key, path, tenant FROM episodes WHERE server = ? AND state = 'running' "
            "AND container IS NULL AND path != ''",
            [server],
        )
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]

    def child_paths(self, container: int) -> list[str]:
        """The notebook paths of the rlm_query children stored beside episode ``container``."""
        rows = self._read("SELECT path FROM episodes WHERE container = ?", [container])
        return [str(r[0]) for r in rows]

    def interrupt_server(self, server: str, reason: str, now: float) -> int:
        """Mark the episodes ``server`` left running as interrupted; how many there were."""
        cursor = self._write(
            "UPDATE episodes SET state = 'interrupted', reason = ?, ended = coalesce(ended, ?) "
            "WHERE server = ? AND state = 'running'",
            [reason, now, server],
        )
        return cursor.rowcount

    def totals(self) -> tuple[int, int, float | None]:
        """Episodes with files of their own (not children): how many, their bytes, the oldest."""
        row = self._read(
            "SELECT count(*), coalesce(sum(size), 0), min(started) FROM episodes "
            "WHERE container IS NULL"
        )[0]
        return int(row[0]), int(row[1]), row[2]

    def stored(self) -> list[Stored]:
        rows = self._read(
            "SELECT key, started, size, state FROM episodes WHERE container IS NULL "
            "ORDER BY started, key"
        )
        return [
            Stored(int(r[0]), _number(r[1]), int(_number(r[2])), r[3] == "running") for r in rows
        ]

    def remove(self, keys: list[int]) -> list[str]:
        """Remove these episodes and their children's rows; the paths of their notebooks."""
        if not keys:
            return []
        marks = ", ".join("?" for _ in keys)
        where = f"key IN ({marks}) OR container IN ({marks})"
        with self._lock, self._db:
            paths = self._db.execute(
                f"SELECT path FROM episodes WHERE key IN ({marks})", keys
            ).fetchall()
            self._db.execute(f"DELETE FROM episodes WHERE {where}", [*keys, *keys])
        return [str(p[0]) for p in paths]

    # -- reading ---------------------------------------------------------------------------

    def page(self, filters: Filters, *, cursor: int | None, limit: int) -> Page:
        """Newest first: up to ``limit`` rows older than ``cursor`` (a page's ``next_cursor``)."""
        where, values = filters.where()
        if cursor is not None:
            where += " AND e.key < ?"
            values.append(cursor)
        rows = self._read(
            f"SELECT {_COLUMNS} FROM {_FROM} WHERE {where} ORDER BY e.key DESC LIMIT ?",
            [*values, limit + 1],
        )
        more = len(rows) > limit
        rows = rows[:limit]
        episodes = [row for row in (_public(r) for r in rows) if row is not None]
        next_cursor = int(rows[-1]["key"]) if more else None
        return Page(episodes, next_cursor, len(rows) - len(episodes))

    def find(self, episode_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The newest readable episode with this id that ``tenant`` may see (None: any)."""
        where, values = Filters(tenant=tenant).where()
        rows = self._read(
            f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.episode_id = ? AND {where} "
            "ORDER BY e.key DESC LIMIT 20",
            [episode_id, *values],
        )
        for row in rows:
            if (found := _public(row)) is not None:
                return found
        return None

    def related(self, key: int) -> list[dict[str, Any]]:
        """The episodes whose parent is ``key``: its forks and ``rlm_query`` children."""
        rows = self._read(
            f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.parent = ? ORDER BY e.key", [key]
        )
        return [row for row in (_public(r) for r in rows) if row is not None]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _public(row: sqlite3.Row) -> dict[str, Any] | None:
    """A row as the routes answer it, or None (said in the log) when it cannot be read."""
    try:
        reward, ended = row["reward"], row["ended"]
        episode = {
            "episode_id": _text(row["episode_id"]),
            "session_id": row["session_id"],
            "tenant": _text(row["tenant"]),
            "kernel": row["kernel"],
            "task": row["task"] or "",
            "steps": int(_number(row["steps"])),
            "reward": None if reward is None else _number(reward),
            "final_answer": row["final_answer"],
            "done": bool(_number(row["done"])),
            "state": _state(row["state"]),
            "reason": row["reason"],
            "started": _number(row["started"]),
            "ended": None if ended is None else _number(ended),
            "parent": row["parent_id"],
            "relation": row["relation"],
            "size": int(_number(row["size"])),
            "key": int(row["key"]),
            "path": _text(row["path"]),
        }
    except (TypeError, ValueError) as exc:
        log.warning("episode store: index row %s is unreadable, skipped: %s", row["key"], exc)
        return None
    return episode


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"expected text, got {value!r}")
    return value


def _state(value: Any) -> str:
    if value not in STATES:
        raise ValueError(f"unknown state {value!r}")
    return str(value)
