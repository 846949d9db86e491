"""Tests for kernel_env.answers: FINAL(...) and FINAL_VAR(...) detection."""

from __future__ import annotations

import pytest

from kernel_env.answers import find_final, find_final_var


def test_simple_final() -> None:
    """A plain FINAL(answer) yields its argument."""
    assert find_final("FINAL(42)") == "42"


def test_nested_parens() -> None:
    """Nested parentheses stay inside the answer up to the balancing paren."""
    assert find_final("FINAL(f(x) + (1))") == "f(x) + (1)"


def test_printed_output_with_newline_and_prefix() -> None:
    """Output of print(f"FINAL({x})") with surrounding text and newline is found."""
    assert find_final("computing...\nFINAL(11)\n") == "11"


def test_argument_is_stripped() -> None:
    """Whitespace around the argument is stripped, inner whitespace kept."""
    assert find_final("FINAL(  the answer \n)") == "the answer"


def test_first_of_several() -> None:
    """The first FINAL(...) wins when several are printed."""
    assert find_final("FINAL(a) then FINAL(b)") == "a"


def test_identifier_prefix_does_not_match() -> None:
    """FINAL preceded by an identifier character (MY_FINAL, xFINAL) is not an answer."""
    assert find_final("MY_FINAL(3)") is None
    assert find_final("xFINAL(3)") is None
    assert find_final("MY_FINAL(3) FINAL(4)") == "4"


def test_final_var_not_matched_by_find_final() -> None:
    """FINAL_VAR(x) is not a FINAL(...) answer."""
    assert find_final("FINAL_VAR(x)") is None


def test_no_final() -> None:
    """Text without FINAL gives None."""
    assert find_final("just some output\n") is None
    assert find_final("") is None


def test_unbalanced_is_not_an_answer() -> None:
    """An unclosed FINAL( is not an answer."""
    assert find_final("FINAL(1 + (2") is None
    assert find_final("FINAL(") is None


def test_unbalanced_then_balanced() -> None:
    """After an unclosed FINAL(, a later balanced FINAL(...) is still found."""
    assert find_final("FINAL(( FINAL(3)") == "3"


def test_stray_closing_paren_before_final() -> None:
    """Closing parens before FINAL do not disturb the matching."""
    assert find_final(") ) FINAL(ok) )") == "ok"


def test_outer_balanced_final_beats_inner_one() -> None:
    """When a balanced FINAL contains another, the outer (first) one is the answer."""
    assert find_final("FINAL(x FINAL(y) z)") == "x FINAL(y) z"


def test_final_at_end_of_10mb_text() -> None:
    """A FINAL after 10 MB of output (with parens in it) is found."""
    filler = "log line (ok) " * (10_000_000 // 14)
    assert find_final(filler + "FINAL(done)") == "done"


def test_many_unclosed_finals_in_10mb_text() -> None:
    """10 MB of unclosed FINAL( openings is scanned without blowing up and gives None."""
    assert find_final("FINAL(" * (10_000_000 // 6)) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FINAL_VAR(x)", "x"),
        ("FINAL_VAR( result_2 )", "result_2"),
        ("FINAL_VAR('answer')", "answer"),
        ('FINAL_VAR( "answer" )\n', "answer"),
        ("noise FINAL_VAR(a) FINAL_VAR(b)", "a"),
    ],
)
def test_final_var_valid(text: str, expected: str) -> None:
    """FINAL_VAR accepts bare or quoted names with whitespace; the first one wins."""
    assert find_final_var(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "FINAL_VAR(1x)",
        "FINAL_VAR(a.b)",
        "FINAL_VAR('x\")",
        "FINAL_VAR()",
        "FINAL_VAR(class)",
        "FINAL_VAR(x",
        "MY_FINAL_VAR(x)",
        "FINAL(x)",
        "",
    ],
)
def test_final_var_invalid(text: str) -> None:
    """FINAL_VAR with a non-identifier, keyword, unclosed paren or wrong prefix gives None."""
    assert find_final_var(text) is None


def test_final_var_in_10mb_text() -> None:
    """A FINAL_VAR after 10 MB of output is found."""
    assert find_final_var("x" * 10_000_000 + "\nFINAL_VAR(v)") == "v"
