"""E2B's sandbox listing (``GET /v2/sandboxes``): its filters, its order and its pages.

A pure function of the sandboxes a tenant sees and the query's parameters, as E2B's API
reads them: ``metadata`` (``k1=v1&k2=v2``, URL-encoded once more), ``state`` (a comma-separated
list), ``template`` (a template's id or its alias: here the kernel's name), ``startedAfter``
(at or after, an ISO 8601 time), ``order`` (by start time, ``desc`` unless ``asc``), ``limit``
(1 to 100, 100 by default) and ``nextToken``. A page ends with the cursor of the next one
(``X-Next-Token``: opaque to the client, the start time and id of the page's last sandbox)
when more follow, so a sandbox created or killed between pages neither repeats nor shifts
the ones after it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from kernel_env.errors import SandboxError
from kernel_env.server.e2b.sandboxes import Sandbox

__all__ = ["MAX_LIMIT", "Page", "page_of"]

MAX_LIMIT = 100  # E2B's paginationLimit: at most, and by default, 100 a page

_Key = tuple[float, str]  # (start time, id): the order's key, unique per sandbox


@dataclass(frozen=True)
class Page:
    """One page of a listing: its sandboxes, the cursor of the next page (None: the last
    page) and how many of the matching sandboxes run."""

    sandboxes: list[Sandbox]
    next_token: str | None
    running: int


def page_of(sandboxes: Iterable[Sandbox], query: Mapping[str, str]) -> Page:
    """The page of ``sandboxes`` that ``query`` (E2B's listing parameters) asks for."""
    wanted = dict(parse_qsl(query.get("metadata") or ""))
    states = set(filter(None, (query.get("state") or "").split(",")))
    template = query.get("template")
    after = _started_after(query.get("startedAfter"))
    found = [
        s
        for s in sandboxes
        if all(s.metadata.get(k) == v for k, v in wanted.items())
        and (not states or s.state in states)
        and (not template or template in (s.template, s.kernel_name))
        and (after is None or _started(s) >= after)
    ]
    descending = _order(query.get("order")) == "desc"
    found.sort(key=_key, reverse=descending)
    cursor = _cursor(query.get("nextToken"))
    if cursor is not None:
        found = [s for s in found if (_key(s) < cursor if descending else _key(s) > cursor)]
    limit = _limit(query.get("limit"))
    page = found[:limit]
    more = len(found) > limit
    return Page(
        page,
        _token(_key(page[-1])) if more else None,
        sum(1 for s in found if s.state == "running"),
    )


def _key(sandbox: Sandbox) -> _Key:
    return (sandbox.started, sandbox.id)


def _started(sandbox: Sandbox) -> datetime:
    # The time E2B's startedAt says (microseconds), so that a client's own startedAt, sent
    # back as startedAfter, matches its sandbox.
    return datetime.fromtimestamp(sandbox.started, UTC)


def _started_after(raw: str | None) -> datetime | None:
    if not raw:
        return None
    try:
        when = datetime.fromisoformat(raw.replace(" ", "+"))  # a '+' left unescaped
    except ValueError:
        raise SandboxError(400, f"startedAfter {raw!r} is not an ISO 8601 time") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _order(raw: str | None) -> str:
    if raw in (None, "", "asc", "desc"):
        return raw or "desc"
    raise SandboxError(400, f"order must be 'asc' or 'desc', not {raw!r}")


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return MAX_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise SandboxError(400, f"limit must be an integer between 1 and {MAX_LIMIT}")
    return limit


def _token(key: _Key) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode("ascii")


def _cursor(raw: str | None) -> _Key | None:
    if not raw:
        return None
    try:
        value: Any = json.loads(base64.urlsafe_b64decode(raw.encode("ascii")))
        started, sandbox_id = value
        if isinstance(started, bool) or not isinstance(started, int | float):
            raise TypeError(started)
        return (float(started), str(sandbox_id))
    except (ValueError, TypeError, binascii.Error, UnicodeError):
        raise SandboxError(400, "nextToken is not a token this server gave") from None
