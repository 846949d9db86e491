"""The episode store's routes, as a table; their handlers are thin: each asks the server's
store (in its worker thread, after the writes asked before: SQLite and files are never read
on the event loop, and an answer sent after a step's reads that step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.routing import APIRoute

from kernel_env.errors import UnknownEpisode
from kernel_env.server.auth import tenant_of
from kernel_env.server.episodes.failures import HANDLERS
from kernel_env.server.index import STATES, Filters
from kernel_env.server.store import StoreReader

__all__ = ["EPISODES_PAGE", "MAX_EPISODES_PAGE", "ROUTES", "add_episodes"]

EPISODES_PAGE = 100
MAX_EPISODES_PAGE = 1000
_NOTEBOOK_TYPE = "application/x-ipynb+json"
_INTERNAL = ("key", "path")  # the store's own: never on the wire
_UNKNOWN = "no stored episode has this id: GET /episodes lists them"


def _store(request: Request) -> StoreReader:
    store: StoreReader | None = request.app.state.runtime.store
    if store is None:
        raise UnknownEpisode("this server keeps no episodes (it was started with --episodes none)")
    return store


def _visible_to(request: Request) -> str | None:
    """The tenant whose episodes the request may see; None: every one (an operator)."""
    tenant = tenant_of(request)
    return None if tenant.is_operator else tenant.name


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in _INTERNAL}


async def list_episodes(
    request: Request,
    cursor: int | None = Query(None, ge=0, description="the `next_cursor` of the page before"),
    limit: int = Query(EPISODES_PAGE, ge=1, le=MAX_EPISODES_PAGE),
    task: str | None = Query(None, max_length=1000, description="text in the task"),
    reward_min: float | None = Query(None),
    reward_max: float | None = Query(None),
    done: bool | None = Query(None),
    state: str | None = Query(None, pattern="^(" + "|".join(STATES) + ")$"),
    kernel: str | None = Query(None, max_length=200),
    since: float | None = Query(None, description="started at or after (seconds since 1970)"),
    until: float | None = Query(None, description="started at or before (seconds since 1970)"),
) -> dict[str, Any]:
    store = _store(request)
    filters = Filters(
        tenant=_visible_to(request),
        task=task,
        reward_min=reward_min,
        reward_max=reward_max,
        done=done,
        state=state,
        kernel=kernel,
        since=since,
        until=until,
    )
    page = await store.call(lambda: store.page(filters, cursor=cursor, limit=limit))
    return {
        "episodes": [_public(row) for row in page.episodes],
        "next_cursor": page.next_cursor,
        "skipped": page.skipped,
    }


async def get_episode(request: Request, episode_id: str) -> dict[str, Any]:
    store = _store(request)
    tenant = _visible_to(request)
    found = await store.call(lambda: store.episode(episode_id, tenant))
    if found is None:
        raise UnknownEpisode(_UNKNOWN)
    return {
        "episode": _public(found["episode"]),
        "children": [_public(r) for r in found["children"]],
        "forks": [_public(r) for r in found["forks"]],
    }


async def get_notebook(request: Request, episode_id: str) -> Response:
    return await _download(request, episode_id, StoreReader.notebook, _NOTEBOOK_TYPE)


async def get_export(request: Request, episode_id: str) -> Response:
    return await _download(request, episode_id, StoreReader.export_zip, "application/zip")


async def _download(
    request: Request, episode_id: str, render: Callable[..., tuple[str, bytes]], media_type: str
) -> Response:
    """One of the episode's files, as the store's ``render`` makes it from its row, or the
    unknown-episode answer for an id this caller cannot see."""
    store = _store(request)
    tenant = _visible_to(request)

    def read() -> tuple[str, bytes]:
        row = store.index.find(episode_id, tenant)
        if row is None:
            raise UnknownEpisode(_UNKNOWN)
        return render(store, row)

    name, body = await store.call(read)
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    return Response(body, media_type=media_type, headers=headers)


ROUTES = [
    APIRoute(
        "/episodes",
        list_episodes,
        methods=["GET"],
        tags=["Episodes"],
        summary="Stored episodes, newest first (a client's own; all for an operator), a page "
        "at a time: ask again with `cursor` set to the page's `next_cursor` until it is null",
    ),
    APIRoute(
        "/episodes/{episode_id}",
        get_episode,
        methods=["GET"],
        tags=["Episodes"],
        summary="A stored episode, with its forks and rlm_query children",
    ),
    APIRoute(
        "/episodes/{episode_id}/notebook",
        get_notebook,
        methods=["GET"],
        tags=["Episodes"],
        summary="A stored episode's notebook (.ipynb), as it was after its last step",
        response_class=Response,
        responses={200: {"content": {_NOTEBOOK_TYPE: {}}}},
    ),
    APIRoute(
        "/episodes/{episode_id}/export.zip",
        get_export,
        methods=["GET"],
        tags=["Episodes"],
        summary="A stored episode's notebook with its context file and rlm_query children's "
        "notebooks, zipped (as GET /sessions/{id}/export.zip)",
        response_class=Response,
        responses={200: {"content": {"application/zip": {}}}},
    ),
]


def add_episodes(app: FastAPI) -> None:
    """The store's routes on ``app``, and its answers to failures."""
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.include_router(APIRouter(routes=list(ROUTES)))
