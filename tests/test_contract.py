"""The host <-> kernel contract (``kernel_env.inkernel.contract``) as plain data: its pure
functions, and the shims and expressions that must say what it says."""

from __future__ import annotations

import json
import sys

from kernel_env.inkernel import contract


def test_a_recorded_answer_is_taken_by_prompt_first_unused_first() -> None:
    """Recorded pairs answer by prompt in any order (a batch completes in any order); each is
    used once; a prompt never recorded gets None."""
    pairs = [["a", "1"], ["b", "2"], ["a", "3"]]
    assert contract.take_recorded(pairs, "b") == "2"
    assert contract.take_recorded(pairs, "a") == "1"
    assert contract.take_recorded(pairs, "a") == "3"
    assert contract.take_recorded(pairs, "a") is None
    assert pairs == []
    assert contract.take_recorded([("x", "tuple")], "x") == "tuple"


def test_the_final_answer_is_the_first_final_display() -> None:
    """A display or result under FINAL_MIME ends the episode; R's boxed scalar is unboxed, a
    number is its text; streams and other displays are not answers."""
    final = contract.FINAL_MIME
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "FINAL(no)"},
        {"output_type": "display_data", "data": {"text/plain": "FINAL(no)"}},
        {"output_type": "display_data", "data": {final: {"answer": ["42"]}}},
        {"output_type": "execute_result", "data": {final: {"answer": "later"}}},
    ]
    assert contract.final_from_outputs(outputs) == "42"
    assert (
        contract.final_from_outputs(
            [{"output_type": "display_data", "data": {final: {"answer": 7}}}]
        )
        == "7"
    )
    assert contract.final_from_outputs(outputs[:2]) is None


def test_the_shims_speak_the_contract() -> None:
    """The R and Deno shims send the contract's request tag, read its probe reply and publish
    under its MIME type (their literals cannot import it)."""
    for shim in ("ir.R", "deno.ts"):
        text = (contract.SHIMS / shim).read_text()
        for literal in (contract.LANGUAGE_REQUEST_TAG, contract.LANGUAGE_PROBE_REPLY):
            assert f'"{literal}"' in text, (shim, literal)
        assert contract.FINAL_MIME in text, shim
    assert "\x00" not in contract.LANGUAGE_REQUEST_TAG + contract.LANGUAGE_PROBE_REPLY


def test_the_state_expression_reaches_the_extension() -> None:
    """``STATE_EXPRESSION`` names the extension's module: evaluated where it is loaded, it
    calls its ``state()`` (here, with no episode, its answer says so)."""
    from kernel_env.inkernel import extension

    assert sys.modules[contract.EXTENSION_MODULE] is extension
    state = json.loads(repr(eval(contract.STATE_EXPRESSION)))
    assert state == {"error": "kernel_env extension not loaded"}


def test_an_unsent_marker_names_its_count() -> None:
    """The marker the kernel writes where a stream's chars were not sent carries the count
    the host reads back."""
    assert "12345 chars not sent" in contract.unsent_marker(12345)
