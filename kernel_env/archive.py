"""Unpacking an episode's export archive (``GET /sessions/{id}/export.zip``) on the client.

The archive comes from a server, which may be hostile or compromised: it must not be able to
write anything but the episode's own files into the directory the user named. So a member is
written only if its name is a plain file name that starts with the notebook's stem and ends
in ``.ipynb`` or ``.txt`` (no dotfiles, no ``..``, no directories), never over an existing
file unless the caller asks, and never bigger than ``max_bytes`` in all or more compressed
than ``max_ratio`` (a zip bomb). Sizes are counted while the bytes stream out, not taken from
the archive's headers, which a hostile server can fake.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

from kernel_env.errors import ArchiveError

__all__ = ["MAX_EXPORT_BYTES", "MAX_RATIO", "ArchiveError", "extract_export"]

MAX_EXPORT_BYTES = 1 << 30  # all members together
# A member may unpack to RATIO_FREE bytes whatever its compression; past that, to at most
# MAX_RATIO x its compressed size. Text and notebooks compress 3-20x; a bomb ~1000x.
MAX_RATIO = 200
RATIO_FREE = 64 << 20
_SUFFIXES = (".ipynb", ".txt")
_CHUNK = 1 << 20


def extract_export(
    data: bytes,
    directory: str | os.PathLike[str],
    *,
    stem: str | None = None,
    overwrite: bool = False,
    max_bytes: int = MAX_EXPORT_BYTES,
    max_ratio: int = MAX_RATIO,
) -> list[Path]:
    """Unpack an export archive into ``directory``; returns the paths written. ``stem``: the
    notebook's name without ``.ipynb`` (every member must start with it; default: the stem of
    the archive's first ``.ipynb``)."""
    root = Path(directory).resolve()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        stem = stem or _first_notebook_stem(members)
        targets = [_target(root, member, stem, overwrite) for member in members]
        root.mkdir(parents=True, exist_ok=True)
        budget = [max_bytes]
        written: list[Path] = []
        try:
            for member, target in zip(members, targets, strict=True):
                _copy(archive, member, target, budget, max_ratio)
                written.append(target)
        except BaseException:
            for path in written:  # all or nothing: no half-unpacked export is left
                path.unlink(missing_ok=True)
            raise
    return targets


def _first_notebook_stem(members: list[zipfile.ZipInfo]) -> str:
    for member in members:
        if member.filename.endswith(".ipynb"):
            return member.filename.removesuffix(".ipynb")
    raise ArchiveError("the export archive holds no notebook")


def _target(root: Path, member: zipfile.ZipInfo, stem: str, overwrite: bool) -> Path:
    name = member.filename
    plain = (
        name
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not name.startswith(".")
        and name not in (".", "..")
    )
    if not plain or member.is_dir():
        raise ArchiveError(f"{name[:100]!r} is not a plain file name (no dotfiles, no paths)")
    if not (name.startswith(stem) and name.endswith(_SUFFIXES)):
        raise ArchiveError(f"{name[:100]!r} is not a file of the episode {stem[:100]!r}")
    target = root / name
    if target.is_symlink() or (target.exists() and not overwrite):
        raise ArchiveError(f"{str(target)!r} exists; pass overwrite=True to replace it")
    return target


def _copy(
    archive: zipfile.ZipFile,
    member: zipfile.ZipInfo,
    target: Path,
    budget: list[int],
    max_ratio: int,
) -> None:
    limit = min(budget[0], max(RATIO_FREE, member.compress_size * max_ratio))
    size = 0
    with archive.open(member) as source, open(target, "wb") as sink:
        while chunk := source.read(_CHUNK):
            size += len(chunk)
            if size > limit:
                sink.close()
                target.unlink(missing_ok=True)
                raise ArchiveError(
                    f"{member.filename[:100]!r} unpacks to more than {limit:,} bytes (at most "
                    f"{max_ratio}x its compressed size and {budget[0]:,} bytes in all): refused"
                )
            sink.write(chunk)
    budget[0] -= size
