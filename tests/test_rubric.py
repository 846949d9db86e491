"""Tests for kernel_env.rubric: rubrics, rewards and final-answer scoring."""

from __future__ import annotations

import pytest

from kernel_env.rubric import (
    CallableRubric,
    ExactMatch,
    FuzzyMatch,
    Rewards,
    RubricError,
    as_rubric,
    normalize,
    score_final,
)


def test_normalize() -> None:
    """normalize strips, lower-cases and collapses internal whitespace."""
    assert normalize("  Hello \n\t World  ") == "hello world"


def test_exact_match_ignores_case_and_whitespace() -> None:
    """ExactMatch compares normalized strings."""
    assert ExactMatch()("  Paris\n", "paris") == 1.0
    assert ExactMatch()("New   York", "new york") == 1.0


def test_exact_match_mismatch() -> None:
    """ExactMatch scores different answers 0.0, including numerically equal ones."""
    assert ExactMatch()("Paris", "London") == 0.0
    assert ExactMatch()("3.0", "3") == 0.0


def test_fuzzy_identical_is_one() -> None:
    """FuzzyMatch scores identical normalized strings 1.0."""
    assert FuzzyMatch()("Hello World", "hello world") == 1.0


def test_fuzzy_above_threshold_returns_ratio() -> None:
    """FuzzyMatch returns the similarity ratio when it reaches the threshold."""
    score = FuzzyMatch(threshold=0.8)("kitten", "kittens")
    assert score == pytest.approx(12 / 13)


def test_fuzzy_below_threshold_is_zero() -> None:
    """FuzzyMatch returns 0.0 when the ratio is under the threshold."""
    assert FuzzyMatch(threshold=0.95)("kitten", "kittens") == 0.0
    assert FuzzyMatch()("apple", "orange") == 0.0


def test_fuzzy_threshold_zero_accepts_anything() -> None:
    """With threshold 0 the raw ratio is returned even for dissimilar strings."""
    assert 0.0 < FuzzyMatch(threshold=0.0)("apple", "orange") < 0.8


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_fuzzy_threshold_out_of_range(threshold: float) -> None:
    """A threshold outside [0, 1] is rejected with ValueError."""
    with pytest.raises(ValueError, match="threshold"):
        FuzzyMatch(threshold=threshold)


@pytest.mark.parametrize(
    ("answer", "expected"), [("3.0", "3"), (" 1e3 ", "1000"), ("0.30000000000000004", "0.3")]
)
def test_fuzzy_numeric_equality(answer: str, expected: str) -> None:
    """FuzzyMatch scores numerically equal answers 1.0."""
    assert FuzzyMatch(threshold=1.0)(answer, expected) == 1.0


def test_fuzzy_numeric_inequality_falls_back_to_ratio() -> None:
    """Different numbers are compared as strings, so 3 vs 4 scores 0.0."""
    assert FuzzyMatch()("3", "4") == 0.0


def test_callable_rubric_bool_result() -> None:
    """A callable returning a bool is converted to 1.0 / 0.0."""
    rubric = CallableRubric(lambda answer, expected: answer in expected)
    assert rubric("b", "abc") == 1.0
    assert rubric("z", "abc") == 0.0


def test_callable_rubric_float_result() -> None:
    """A callable returning a number is passed through as a float."""
    assert CallableRubric(lambda answer, expected: 0.25)("a", "b") == 0.25


def test_callable_rubric_raising_becomes_rubric_error() -> None:
    """A callable that raises surfaces as RubricError naming the callable."""

    def broken_rubric(answer: str, expected: str) -> float:
        raise KeyError("boom")

    with pytest.raises(RubricError, match="broken_rubric") as info:
        CallableRubric(broken_rubric)("a", "b")
    assert isinstance(info.value.__cause__, KeyError)


def test_callable_rubric_non_number_becomes_rubric_error() -> None:
    """A callable returning a non-number surfaces as RubricError."""
    with pytest.raises(RubricError, match="not a number"):
        CallableRubric(lambda answer, expected: "yes")("a", "b")


def test_rewards_defaults() -> None:
    """Rewards defaults are OpenEnv repl_env's and the dataclass is frozen."""
    rewards = Rewards()
    assert (rewards.step_ok, rewards.step_failed, rewards.budget_exhausted) == (0.0, -0.05, -0.1)
    assert rewards.final_no_expected == 0.0
    with pytest.raises(AttributeError):
        rewards.step_ok = 1.0  # type: ignore[misc]


def test_score_final_without_expected() -> None:
    """Without an expected answer the reward is rewards.final_no_expected."""
    assert score_final("anything", None, None, Rewards(final_no_expected=0.5)) == 0.5


def test_score_final_default_rubric_is_exact() -> None:
    """With an expected answer and no rubric, ExactMatch decides."""
    assert score_final(" Paris ", "paris", None, Rewards()) == 1.0
    assert score_final("3.0", "3", None, Rewards()) == 0.0


def test_score_final_custom_rubric() -> None:
    """With an expected answer and a rubric, the rubric's score is the reward."""
    assert score_final("3.0", "3", FuzzyMatch(), Rewards()) == 1.0


def test_as_rubric_names_and_none() -> None:
    """None and 'exact' give ExactMatch; 'fuzzy' gives FuzzyMatch."""
    assert isinstance(as_rubric(None), ExactMatch)
    assert isinstance(as_rubric("exact"), ExactMatch)
    assert isinstance(as_rubric("fuzzy"), FuzzyMatch)


def test_as_rubric_builtin_instance_is_returned() -> None:
    """A built-in rubric instance is returned unchanged."""
    fuzzy = FuzzyMatch(threshold=0.5)
    assert as_rubric(fuzzy) is fuzzy


def test_as_rubric_wraps_plain_function() -> None:
    """A plain function is wrapped in CallableRubric."""
    rubric = as_rubric(lambda answer, expected: answer == expected)
    assert isinstance(rubric, CallableRubric)
    assert rubric("a", "a") == 1.0


@pytest.mark.parametrize(("value", "message"), [("levenshtein", "unknown rubric"), (42, "int")])
def test_as_rubric_errors(value: object, message: str) -> None:
    """An unknown rubric name or a non-callable raises ValueError."""
    with pytest.raises(ValueError, match=message):
        as_rubric(value)
