"""Final-answer detection in the text an agent's code prints.

An agent ends an episode by printing ``FINAL(<answer>)`` or ``FINAL_VAR(<variable name>)``
(OpenEnv ``repl_env`` conventions). Both scanners here are pure, never raise, and run in
linear time, because the text is arbitrary kernel output that may be many megabytes long.
"""

from __future__ import annotations

import keyword
import re

__all__ = ["find_final", "find_final_var"]

# `(?<!\w)` rejects MY_FINAL(…) and xFINAL(…); `FINAL\(` itself rejects FINAL_VAR(…).
_FINAL_OPEN = re.compile(r"(?<!\w)FINAL\(")
_FINAL_VAR_OPEN = re.compile(r"(?<!\w)FINAL_VAR\(")
_PAREN = re.compile(r"[()]")
_QUOTES = ("'", '"')


def find_final(text: str) -> str | None:
    """The stripped argument of the first balanced ``FINAL(...)`` in ``text``, or None.

    Nested parentheses are allowed (``FINAL(f(x) + (1))`` gives ``f(x) + (1)``). A ``FINAL(``
    that is never closed is not an answer; a later, balanced one still counts. Parentheses
    inside quotes are counted like any others.
    """
    first = _FINAL_OPEN.search(text)
    if first is None:
        return None
    span = _first_balanced_candidate(text, first.end() - 1)
    if span is None:
        return None
    start, end = span
    return text[start:end].strip()


def _first_balanced_candidate(text: str, scan_from: int) -> tuple[int, int] | None:
    """(start, end) of the argument of the earliest ``FINAL(`` whose paren gets closed.

    One stack-matching pass over the parentheses from ``scan_from`` (the first candidate's
    open paren): linear, where re-scanning from every unclosed candidate could be quadratic.
    """
    stack: list[tuple[int, bool]] = []  # (position of "(", opens a FINAL candidate?)
    open_candidates = 0
    best: tuple[int, int] | None = None
    for match in _PAREN.finditer(text, scan_from):
        pos = match.start()
        if text[pos] == "(":
            is_candidate = _FINAL_OPEN.match(text, pos - 5) is not None if pos >= 5 else False
            stack.append((pos, is_candidate))
            open_candidates += is_candidate
            continue
        if not stack:
            continue  # a stray ")" closes nothing we are tracking
        open_pos, is_candidate = stack.pop()
        if not is_candidate:
            continue
        open_candidates -= 1
        if best is None or open_pos < best[0]:
            best = (open_pos + 1, pos)
        # Every candidate seen so far is now closed (unclosed ones stay on the stack), and any
        # later one starts after them, so the earliest closed one can no longer be beaten.
        if open_candidates == 0:
            return best
    return best


def find_final_var(text: str) -> str | None:
    """The variable name in the first ``FINAL_VAR(name)`` in ``text``, or None.

    ``name`` may be bare (``x``) or quoted (``'x'``, ``"x"``), with surrounding whitespace.
    Only the first ``FINAL_VAR(`` is considered; if its argument is not a valid Python
    identifier (or it is never closed) the result is None.
    """
    opening = _FINAL_VAR_OPEN.search(text)
    if opening is None:
        return None
    close = text.find(")", opening.end())
    if close == -1:
        return None
    return _variable_name(text[opening.end() : close])


def _variable_name(argument: str) -> str | None:
    """``argument`` unquoted and stripped, if it names a Python variable; else None."""
    name = argument.strip()
    if len(name) >= 2 and name[0] in _QUOTES and name[-1] == name[0]:
        name = name[1:-1].strip()
    # Keywords pass isidentifier() but can never be assigned to, so they name no variable.
    if name.isidentifier() and not keyword.iskeyword(name):
        return name
    return None
