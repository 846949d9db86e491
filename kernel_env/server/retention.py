"""How long the episode store keeps episodes: ``--episodes-keep count=N,age=30d,size=20GiB``.

A pure part (no files, no SQLite): the flag's text as a :class:`Keep`, and which stored
episodes go, oldest first, for the totals a store holds (:func:`to_remove`). A running
episode is never chosen, whatever the limits say: it is still being written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DEFAULT_KEEP", "Keep", "Stored", "parse_keep", "to_remove"]

# Enough for a training run's rollouts, well short of filling a disk.
DEFAULT_KEEP = "count=100000,age=30d,size=20GiB"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SPANS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Keep:
    """Episodes kept at most (None: no limit of that kind): how many, how old (seconds since
    they started), how many bytes in all."""

    count: int | None = None
    age: float | None = None
    size: int | None = None


@dataclass(frozen=True)
class Stored:
    """What retention needs to know of one stored episode (its own files and its children's)."""

    key: int
    started: float
    size: int
    running: bool


def parse_keep(text: str) -> Keep:
    """``count=N,age=30d,size=20GiB``, any subset, in any order; an unknown key, a key given
    twice or a value that is not a positive amount is a ValueError saying which."""
    values: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = item.partition("=")
        key = key.strip().lower()
        if not equals or key not in ("count", "age", "size"):
            raise ValueError(
                f"episodes_keep: expected count=N, age=DURATION or size=BYTES, got {item!r} "
                f"(e.g. {DEFAULT_KEEP})"
            )
        if key in values:
            raise ValueError(f"episodes_keep: {key} is given twice")
        values[key] = _amount(key, value)
    count, age, size = (values.get(k) for k in ("count", "age", "size"))
    return Keep(
        count=None if count is None else int(count),
        age=age,
        size=None if size is None else int(size),
    )


def _amount(key: str, value: str) -> float:
    match = _NUMBER.match(value)
    units = {"count": {"": 1}, "age": _SPANS, "size": _UNITS}[key]
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units or (key == "count" and "." in match.group(1)):
        shown = {"count": "a whole number", "age": "e.g. 30d, 12h, 90m, 3600s", "size": ""}
        hint = shown[key] or "e.g. 20GiB, 500MB, 1048576"
        raise ValueError(f"episodes_keep: {key}={value!r} is not a valid {key} ({hint})")
    amount = float(match.group(1)) * units[unit]
    if amount <= 0:
        raise ValueError(f"episodes_keep: {key} must be greater than 0, got {value!r}")
    return amount


def to_remove(episodes: Iterable[Stored], keep: Keep, now: float) -> list[int]:
    """The keys of the episodes to remove, oldest first, so that what is left is within
    ``keep``; running episodes stay (and count toward the totals)."""
    ordered = sorted(episodes, key=lambda e: (e.started, e.key))
    count, size = len(ordered), sum(e.size for e in ordered)
    removed: list[int] = []
    for episode in ordered:
        too_many = keep.count is not None and count > keep.count
        too_big = keep.size is not None and size > keep.size
        too_old = keep.age is not None and now - episode.started > keep.age
        if not (too_many or too_big or too_old):
            break
        if episode.running:
            continue
        removed.append(episode.key)
        count, size = count - 1, size - episode.size
    return removed
