"""Scoring final answers against expected ones, and the reward values of an episode.

A rubric maps ``(answer, expected)`` to a float score. Built-ins: :class:`ExactMatch` and
:class:`FuzzyMatch`; any user callable is wrapped in :class:`CallableRubric`, which turns its
failures into :class:`RubricError` so the caller decides how a broken rubric is handled.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kernel_env.errors import RubricError

__all__ = [
    "CallableRubric",
    "ExactMatch",
    "FuzzyMatch",
    "Rewards",
    "Rubric",
    "RubricError",
    "StepRubric",
    "as_rubric",
    "give_expected",
    "is_step_rubric",
    "normalize",
    "score_final",
    "score_step",
]

# Relative tolerance for numeric equality: loose enough for "0.1 + 0.2" style float noise.
_NUMERIC_REL_TOL = 1e-9


class Rubric(Protocol):
    """Scores an answer against the expected answer."""

    def __call__(self, answer: str, expected: str) -> float: ...


class StepRubric(Protocol):
    """An OpenEnv (RFC 004) rubric, such as upstream's ``REPLRubric``: it scores every step
    from ``(action, observation)``, and may take the expected answer through
    ``set_expected(expected)`` and forget it through ``reset()``."""

    def forward(self, action: Any, observation: Any) -> Any: ...

    def __call__(self, action: Any, observation: Any) -> Any: ...


def is_step_rubric(value: object) -> bool:
    """Whether ``value`` is an OpenEnv rubric (it has a ``forward(action, observation)``)."""
    return callable(value) and callable(getattr(value, "forward", None))


def normalize(text: str) -> str:
    """``text`` stripped, lower-cased, with internal whitespace runs collapsed to one space."""
    return " ".join(text.split()).lower()


class ExactMatch:
    """1.0 when the normalized answer equals the normalized expected answer, else 0.0."""

    def __call__(self, answer: str, expected: str) -> float:
        return 1.0 if normalize(answer) == normalize(expected) else 0.0

    def __repr__(self) -> str:
        return "ExactMatch()"


class FuzzyMatch:
    """Similarity ratio of the normalized strings, or 0.0 below ``threshold``.

    Numbers that are equal within a relative 1e-9 (``"3.0"`` and ``"3"``) score 1.0.
    """

    def __init__(self, threshold: float = 0.8) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"FuzzyMatch threshold must be within [0, 1], got {threshold!r}")
        self.threshold = threshold

    def __call__(self, answer: str, expected: str) -> float:
        a, b = normalize(answer), normalize(expected)
        if _numerically_equal(a, b):
            return 1.0
        # autojunk=False: its heuristic drops frequent characters from strings of 200+ chars,
        # which would make the score of long answers depend on their length, not similarity.
        ratio = difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
        return ratio if ratio >= self.threshold else 0.0

    def __repr__(self) -> str:
        return f"FuzzyMatch(threshold={self.threshold!r})"


def _numerically_equal(a: str, b: str) -> bool:
    """Whether both strings parse as floats that are equal within the relative tolerance."""
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=_NUMERIC_REL_TOL)


class CallableRubric:
    """A user callable ``(answer, expected) -> float | bool`` as a rubric returning a float."""

    def __init__(self, fn: Callable[[str, str], float | bool]) -> None:
        if not callable(fn):
            raise ValueError(f"CallableRubric needs a callable, got {fn!r}")
        self.fn = fn

    @property
    def name(self) -> str:
        """The wrapped callable's name, for error messages."""
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)

    def __call__(self, answer: str, expected: str) -> float:
        try:
            result = self.fn(answer, expected)
        except Exception as exc:
            raise RubricError(f"rubric {self.name} raised {type(exc).__name__}: {exc}") from exc
        try:
            return float(result)
        except (TypeError, ValueError) as exc:
            raise RubricError(
                f"rubric {self.name} returned {result!r}, which is not a number or bool"
            ) from exc

    def __repr__(self) -> str:
        return f"CallableRubric({self.name})"


@dataclass(frozen=True)
class Rewards:
    """Reward values; defaults are OpenEnv repl_env's."""

    step_ok: float = 0.0
    step_failed: float = -0.05
    budget_exhausted: float = -0.1
    final_no_expected: float = 0.0  # a final answer when no expected answer was given


def score_final(
    answer: str, expected: str | None, rubric: Rubric | None, rewards: Rewards
) -> float:
    """Reward for a final answer.

    ``rewards.final_no_expected`` when ``expected`` is None (nothing to compare against);
    otherwise ``rubric`` (default :class:`ExactMatch`) applied to ``(answer, expected)``.
    """
    if expected is None:
        return rewards.final_no_expected
    scorer = ExactMatch() if rubric is None else rubric
    return float(scorer(answer, expected))


_NAMED_RUBRICS: dict[str, Callable[[], Rubric]] = {"exact": ExactMatch, "fuzzy": FuzzyMatch}
_BUILTIN_RUBRICS = (ExactMatch, FuzzyMatch, CallableRubric)


def as_rubric(value: object) -> Rubric:
    """A rubric from a configuration value.

    None or ``"exact"`` -> :class:`ExactMatch`; ``"fuzzy"`` -> :class:`FuzzyMatch`; a built-in
    rubric -> itself; any other callable -> wrapped in :class:`CallableRubric` (so its failures
    surface as :class:`RubricError`). Anything else raises ValueError.
    """
    if value is None:
        return ExactMatch()
    if isinstance(value, str):
        factory = _NAMED_RUBRICS.get(value.strip().lower())
        if factory is None:
            names = ", ".join(repr(name) for name in _NAMED_RUBRICS)
            raise ValueError(f"unknown rubric name {value!r}; expected one of {names}")
        return factory()
    if isinstance(value, _BUILTIN_RUBRICS):
        return value
    if callable(value):
        return CallableRubric(value)
    raise ValueError(
        f"rubric must be None, 'exact', 'fuzzy' or a callable (answer, expected) -> float, "
        f"got {type(value).__name__}: {value!r}"
    )


def score_step(rubric: StepRubric, action: Any, observation: Any) -> tuple[float, str | None]:
    """An OpenEnv rubric's reward for a step; a rubric that raises or returns no number
    scores 0 with its error, so the step itself is never lost."""
    name = type(rubric).__qualname__
    try:
        result = rubric(action, observation)
    except Exception as exc:  # user code: any failure is the rubric's, reported as data
        return 0.0, f"rubric {name} raised {type(exc).__name__}: {exc}"
    try:
        return float(result), None
    except (TypeError, ValueError):
        return 0.0, f"rubric {name} returned {result!r}, which is not a number or bool"


def give_expected(rubric: StepRubric | None, expected: str | None) -> None:
    """Give an OpenEnv rubric a new episode's expected answer, as upstream's reset does."""
    if rubric is None:
        return
    reset = getattr(rubric, "reset", None)
    if callable(reset):
        reset()
    set_expected = getattr(rubric, "set_expected", None)
    if callable(set_expected) and expected is not None:
        set_expected(expected)
