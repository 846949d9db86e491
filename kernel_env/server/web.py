"""``/web``: a live view of the server's episodes, served by the server itself.

A static page (``webview/``: HTML, one script, one stylesheet; no build step, no CDN) lists the
sessions (``GET /sessions``) and shows one episode as a notebook while it runs, reading the
session's feed (:mod:`kernel_env.server.feed`) with ``GET /web/api/sessions/{id}/events``.
Why not Gradio (OpenEnv's ``/web``): a heavy dependency for one page; nor nbconvert: it renders
finished notebooks, not running ones.

The page itself holds no data and is public; everything it shows comes from routes behind the
token (the page asks for it, keeps it in ``sessionStorage`` and sends it as a header), so a
client tenant's token shows its own sessions, an operator's every one. Kernel
output is untrusted: the page's Content-Security-Policy allows only its own script, and HTML or
SVG from a cell is shown in ``<iframe sandbox="allow-same-origin">``: no script runs there (the
same origin lets the page fit the frame's height to the output; with scripts allowed too it
would let the output read the token). ``/web#session=ID`` opens one session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute

from kernel_env.notebook import PAGE_CSP, named_notebook, notebook_html
from kernel_env.record import EpisodeRecord
from kernel_env.server.auth import tenant_of
from kernel_env.server.sessions import UnknownSession

__all__ = ["ROUTES", "WEB_PUBLIC", "add_web_routes"]

_FILES = Path(__file__).parent / "webview"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# An episode's HTML page: the policy in its own <meta>, and a sandbox (no script, an opaque
# origin), which only a header can set.
_PAGE_HEADERS = {
    "Content-Security-Policy": f"{PAGE_CSP}; frame-ancestors 'none'; sandbox",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_STATIC = {"/web": "index.html", "/web/app.js": "app.js", "/web/app.css": "app.css"}
WEB_PUBLIC = tuple(_STATIC)  # the page and its files hold no data: no token needed


async def events(
    request: Request,
    session_id: str,
    after: int = Query(0, ge=0),
    wait: float = Query(0.0, ge=0, le=30),
) -> dict[str, Any]:
    sessions = request.app.state.runtime.sessions
    session = sessions.peek(session_id, tenant_of(request))  # watching is no claim
    if session is None:
        raise UnknownSession(f"no open session {session_id[:40]!r}")
    events = await session.feed.wait(after, wait) if wait else session.feed.since(after)
    last = events[-1]["seq"] if events else after
    return {"events": events, "last": last, "closed": session.feed.closed}


async def notebook_page(request: Request, session_id: str) -> Response:
    session = request.app.state.runtime.sessions.get(session_id, tenant_of(request))
    name, page = await session.export(_page)
    headers = {**_PAGE_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'}
    return Response(page, media_type="text/html", headers=headers)


def _static(name: str) -> Any:
    async def serve() -> FileResponse:
        return FileResponse(_FILES / name, headers=_HEADERS)

    return serve


ROUTES = [
    *(
        APIRoute(path, _static(name), methods=["GET"], include_in_schema=False)
        for path, name in _STATIC.items()
    ),
    APIRoute(
        "/web/api/sessions/{session_id}/events",
        events,
        methods=["GET"],
        tags=["Operations"],
        summary="A session's live feed for the web view (waits up to `wait` s for news)",
    ),
    APIRoute(
        "/sessions/{session_id}/notebook.html",
        notebook_page,
        methods=["GET"],
        tags=["Sessions"],
        summary="The session's current (or last) episode as an HTML page (needs nbconvert)",
        response_class=Response,
        responses={200: {"content": {"text/html": {}}}},
    ),
]


def add_web_routes(app: FastAPI) -> None:
    app.include_router(APIRouter(routes=list(ROUTES)))


def _page(record: EpisodeRecord) -> tuple[str, str]:
    """The episode's HTML file name and page (run in a thread: nbconvert takes a while)."""
    name, text = named_notebook(record)
    nb = nbformat.reads(text, as_version=4)
    try:
        return Path(name).with_suffix(".html").name, notebook_html(nb)
    except RuntimeError as exc:  # no nbconvert on this server
        raise HTTPException(501, str(exc)) from None
