"""kernel_env's export routes beside OpenEnv's: a session's episode as a Jupyter notebook
(``GET /sessions/{id}/notebook``), or zipped with its context file and child episodes
(``GET /sessions/{id}/export.zip``). Either id names it: the session's, or its episode's."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request, Response

from kernel_env.notebook import ExportPathError, export_zip, named_notebook, notebook_name
from kernel_env.record import EpisodeRecord
from kernel_env.server.auth import tenant_of
from kernel_env.server.sessions import Session

__all__ = ["NOTEBOOK_MEDIA_TYPE", "export", "notebook"]

NOTEBOOK_MEDIA_TYPE = "application/x-ipynb+json"
# File names are at most 255 bytes; the export adds ".context.txt" or ".child-N-M.ipynb".
_MAX_NAME_BYTES = 200


async def notebook(request: Request, session_id: str) -> Response:
    session = _exported(request, session_id)
    name, body = await session.export(named_notebook)
    return Response(body, media_type=NOTEBOOK_MEDIA_TYPE, headers=_attachment(name))


async def export(request: Request, session_id: str, name: str | None = None) -> Response:
    """``name``: the notebook's file name in the archive (default: the episode id)."""
    session = _exported(request, session_id)
    if name is not None and (
        not name
        or Path(name).name != name
        or name[0] == "."
        or len(name.encode()) > _MAX_NAME_BYTES
    ):
        raise ExportPathError(
            f"name must be a plain file name of at most {_MAX_NAME_BYTES} bytes, got {name[:80]!r}"
        )

    def archive(record: EpisodeRecord) -> bytes:
        return export_zip(record, name or notebook_name(record.episode_id))

    body = await session.export(archive)
    return Response(body, media_type="application/zip", headers=_attachment("episode.zip"))


def _attachment(filename: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{filename}"'}


def _exported(request: Request, key: str) -> Session:
    """The session a notebook route names: by its session id, or by its episode's id (the one
    ``state()`` and the web view show), among the request's tenant's own sessions."""
    sessions = request.app.state.runtime.sessions
    found: Session = sessions.resolve(key, tenant_of(request))
    return found
