"""Short text for people: error messages, log lines, previews. One rule everywhere."""

from __future__ import annotations

__all__ = ["shorten"]


def shorten(text: str, limit: int, *, one_line: bool = False) -> str:
    """``text`` cut to its first ``limit`` chars, for messages, logs and previews.

    ``one_line`` first collapses whitespace runs to one space and marks a cut with "…";
    otherwise a cut ends with "… (N more chars)". (The model's outputs are cut by
    :func:`kernel_env.outputs.truncate`, which keeps the head and the tail.)
    """
    if one_line:
        text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit] + ("…" if one_line else f" … ({len(text) - limit} more chars)")
