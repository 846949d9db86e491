"""Unit tests for kernel_env.outputs, driven by scripted iopub message lists (no kernels)."""

from __future__ import annotations

import itertools
from typing import Any

import nbformat
import pytest

from kernel_env.outputs import OutputCollector, _clean_content, strip_ansi, truncate

PARENT = {"msg_id": "exec-1", "msg_type": "execute_request"}
_ids = itertools.count()


def msg(msg_type: str, **content: Any) -> dict[str, Any]:
    """A dict shaped like a jupyter_client iopub message for the execution PARENT."""
    return {
        "header": {"msg_type": msg_type, "msg_id": f"m-{next(_ids)}"},
        "parent_header": PARENT,
        "content": content,
        "metadata": {},
    }


def stream(name: str, text: str) -> dict[str, Any]:
    return msg("stream", name=name, text=text)


def display(data: dict[str, Any], display_id: str | None = None) -> dict[str, Any]:
    transient = {"display_id": display_id} if display_id else {}
    return msg("display_data", data=data, metadata={}, transient=transient)


def collect(*messages: dict[str, Any]) -> OutputCollector:
    collector = OutputCollector()
    for message in messages:
        collector.feed(message)
    assert_valid_notebook(collector)
    return collector


def assert_valid_notebook(collector: OutputCollector) -> None:
    cell = nbformat.v4.new_code_cell(outputs=collector.outputs, execution_count=1)
    nbformat.validate(nbformat.v4.new_notebook(cells=[cell]))


PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kg"
    "AAAABJRU5ErkJggg=="
)
ANSI_TRACEBACK = [
    "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m",
    "\x1b[0;31mZeroDivisionError\x1b[0m                         Traceback (most recent call last)",
    "Cell \x1b[0;32mIn[1], line 1\x1b[0m\n\x1b[0;32m----> 1\x1b[0m "
    "\x1b[38;5;241m1\x1b[39m\x1b[38;5;241m/\x1b[39m\x1b[38;5;241m0\x1b[39m",
    "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero",
]


def test_consecutive_same_name_streams_merge() -> None:
    """Consecutive stdout chunks become one stream output with the concatenated text."""
    c = collect(stream("stdout", "a\n"), stream("stdout", "b"), stream("stdout", "c\n"))
    assert len(c.outputs) == 1
    assert c.outputs[0].output_type == "stream"
    assert c.outputs[0].text == "a\nbc\n"
    assert c.stdout_text() == "a\nbc\n"
    assert c.stderr_text() == ""


def test_interleaved_stdout_stderr_not_merged() -> None:
    """Streams merge only with the immediately preceding output, so interleaving is kept."""
    c = collect(
        stream("stdout", "1\n"),
        stream("stderr", "warn\n"),
        stream("stdout", "2\n"),
        stream("stdout", "3\n"),
    )
    assert [(o.name, o.text) for o in c.outputs] == [
        ("stdout", "1\n"),
        ("stderr", "warn\n"),
        ("stdout", "2\n3\n"),
    ]
    assert c.stdout_text() == "1\n2\n3\n"
    assert c.stderr_text() == "warn\n"


def test_execute_result_text_in_stdout() -> None:
    """A bare last expression's text/plain appears in stdout_text after printed text."""
    c = collect(
        msg("status", execution_state="busy"),
        msg("execute_input", code="print('hi'); 1 + 1", execution_count=3),
        stream("stdout", "hi\n"),
        msg("execute_result", data={"text/plain": "2"}, metadata={}, execution_count=3),
        msg("status", execution_state="idle"),
    )
    assert [o.output_type for o in c.outputs] == ["stream", "execute_result"]
    assert c.outputs[1].execution_count == 3
    assert c.stdout_text() == "hi\n2\n"


def test_display_data_image_with_text_plain() -> None:
    """A display with image/png and text/plain keeps both mimes and shows the text to the model."""
    c = collect(display({"image/png": PNG, "text/plain": "<Figure size 640x480>"}))
    (out,) = c.outputs
    assert out.output_type == "display_data"
    assert out.data["image/png"] == PNG
    assert c.stdout_text() == "<Figure size 640x480>\n"


def test_display_data_placeholder_without_text_plain() -> None:
    """A display without text/plain is shown to the model as a placeholder listing its mimes."""
    c = collect(display({"image/png": PNG, "text/html": "<b>x</b>"}))
    assert c.stdout_text() == "<display_data: image/png, text/html>\n"


def test_update_display_data_updates_matching_output() -> None:
    """update_display_data replaces data of the output with its display_id and adds nothing."""
    c = collect(
        display({"text/plain": "first 0%"}, display_id="a"),
        display({"text/plain": "second"}, display_id="b"),
        msg(
            "update_display_data",
            data={"text/plain": "first 100%"},
            metadata={"k": 1},
            transient={"display_id": "a"},
        ),
        msg("update_display_data", data={"text/plain": "ghost"}, transient={"display_id": "zz"}),
    )
    assert [o.data["text/plain"] for o in c.outputs] == ["first 100%", "second"]
    assert c.outputs[0].metadata == {"k": 1}
    assert c.stdout_text() == "first 100%\nsecond\n"


def test_redisplay_with_same_display_id_refreshes_earlier_output() -> None:
    """As in nbclient, a new display with a known display_id also refreshes earlier ones."""
    c = collect(
        display({"text/plain": "v1"}, display_id="d"),
        display({"text/plain": "v2"}, display_id="d"),
    )
    assert [o.data["text/plain"] for o in c.outputs] == ["v2", "v2"]


def test_clear_output_immediate() -> None:
    """clear_output(wait=False) removes all earlier outputs and forgets their display ids."""
    c = collect(
        stream("stdout", "old\n"),
        display({"text/plain": "x"}, display_id="d"),
        msg("clear_output", wait=False),
    )
    assert c.outputs == []
    c.feed(msg("update_display_data", data={"text/plain": "y"}, transient={"display_id": "d"}))
    c.feed(stream("stdout", "new\n"))
    assert c.stdout_text() == "new\n"


def test_clear_output_wait_without_following_output_keeps_outputs() -> None:
    """clear_output(wait=True) with nothing after it leaves the outputs untouched."""
    c = collect(stream("stdout", "50%\n"), msg("clear_output", wait=True))
    assert c.stdout_text() == "50%\n"


def test_clear_output_wait_then_stream_replaces() -> None:
    """clear_output(wait=True) clears just before the next stream, which becomes the only output."""
    c = collect(
        stream("stdout", "50%\n"),
        msg("clear_output", wait=True),
        msg("status", execution_state="busy"),
        stream("stdout", "100%\n"),
        stream("stdout", "done\n"),
    )
    assert len(c.outputs) == 1
    assert c.stdout_text() == "100%\ndone\n"


def test_clear_output_wait_then_display_replaces() -> None:
    """A pending wait-clear is also triggered by a rich display."""
    c = collect(
        display({"text/plain": "frame 1"}),
        msg("clear_output", wait=True),
        display({"text/plain": "frame 2"}),
    )
    assert [o.data["text/plain"] for o in c.outputs] == ["frame 2"]


def test_error_traceback_ansi_stripped() -> None:
    """An error's traceback goes to stderr_text without ANSI codes; `error` keeps the raw one."""
    c = collect(
        stream("stdout", "before\n"),
        msg(
            "error", ename="ZeroDivisionError", evalue="division by zero", traceback=ANSI_TRACEBACK
        ),
    )
    stderr = c.stderr_text()
    assert "\x1b" not in stderr
    assert stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "----> 1 1/0" in stderr
    assert c.stdout_text() == "before\n"
    assert c.error == {
        "ename": "ZeroDivisionError",
        "evalue": "division by zero",
        "traceback": ANSI_TRACEBACK,
    }


def test_error_without_traceback_uses_ename_evalue() -> None:
    """An error with an empty traceback is shown as 'ename: evalue'."""
    c = collect(msg("error", ename="KeyError", evalue="'x'", traceback=[]))
    assert c.stderr_text() == "KeyError: 'x'\n"


def test_no_error_property_is_none() -> None:
    """Without an error output, `error` is None."""
    assert collect(stream("stdout", "ok\n")).error is None


def test_ansi_stripped_from_streams() -> None:
    """Colour codes printed to stdout are stripped from stdout_text but kept in outputs."""
    c = collect(stream("stdout", "\x1b[1;32mgreen\x1b[0m\n"))
    assert c.stdout_text() == "green\n"
    assert "\x1b" in c.outputs[0].text


def test_strip_ansi_handles_osc_hyperlinks() -> None:
    """OSC sequences such as terminal hyperlinks are removed, keeping their visible text."""
    link = "\x1b]8;;https://example.com\x1b\\site\x1b]8;;\x1b\\"
    assert strip_ansi(link) == "site"


def test_ignored_and_malformed_messages_do_not_raise() -> None:
    """Irrelevant, unknown and malformed messages are ignored or filled with defaults."""
    c = collect(
        {"content": {"name": "stdout", "text": "no header"}},
        {"header": {}, "content": {}},
        msg("comm_open", comm_id="c", target_name="t", data={}),
        msg("made_up_type", x=1),
        msg("stream"),
        msg("display_data", data={"text/plain": 5, "application/json": {"a": 1}}, transient=None),
        msg("execute_result", data={"text/plain": ["a\n", "b"]}),
        msg("update_display_data"),
        msg("clear_output"),
        msg("error"),
    )
    # clear_output without `wait` is immediate, so only the error survives it.
    assert [o.output_type for o in c.outputs] == ["error"]
    assert c.error == {"ename": "", "evalue": "", "traceback": []}


def test_malformed_display_data_still_valid() -> None:
    """Schema-invalid mime values are dropped so outputs stay valid nbformat."""
    c = collect(
        msg("display_data", data={"text/plain": 5, "application/json": {"a": 1}}, metadata=None),
        msg("execute_result", data={"text/plain": ["a\n", "b"]}, execution_count="x"),
    )
    assert dict(c.outputs[0].data) == {"application/json": {"a": 1}}
    assert c.outputs[1].execution_count is None
    assert c.stdout_text() == "<display_data: application/json>\na\nb\n"


def test_collector_does_not_alias_message_data() -> None:
    """Updating a display never mutates the dicts of the messages that were fed in."""
    original = display({"text/plain": "v1"}, display_id="d")
    c = collect(
        original,
        msg("update_display_data", data={"text/plain": "v2"}, transient={"display_id": "d"}),
    )
    assert original["content"]["data"] == {"text/plain": "v1"}
    assert c.outputs[0].data["text/plain"] == "v2"


def test_stream_and_error_outputs_are_what_nbformat_builds() -> None:
    """The collector builds stream and error outputs itself (nbformat validates each output it
    builds, 0.17 ms): the same nodes nbformat's output_from_msg makes, sloppy fields included."""
    contents = [
        ("stream", {"name": "stderr", "text": "x\n"}),
        ("stream", {"name": None, "text": 5}),
        ("stream", {}),
        ("error", {"ename": "E", "evalue": "v", "traceback": ["a", 1, None]}),
        ("error", {"ename": 3, "traceback": "not a list"}),
        ("error", {}),
    ]
    for msg_type, content in contents:
        built = collect(msg(msg_type, **content)).outputs[0]
        fields = _clean_content(msg_type, content)
        expected = nbformat.v4.output_from_msg(
            {"header": {"msg_type": msg_type}, "content": fields}
        )
        assert built == expected and list(built) == list(expected)
        assert isinstance(built, nbformat.NotebookNode)


def test_all_output_types_validate_in_notebook() -> None:
    """Every kind of output the collector builds validates inside a v4 notebook."""
    c = collect(
        stream("stdout", "out\n"),
        stream("stderr", "err\n"),
        display({"image/png": PNG, "text/plain": "img"}, display_id="d"),
        msg("execute_result", data={"text/plain": "42"}, metadata={}, execution_count=1),
        msg("update_display_data", data={"text/html": "<p/>"}, transient={"display_id": "d"}),
        msg("error", ename="E", evalue="v", traceback=["E: v"]),
    )
    assert [o.output_type for o in c.outputs] == [
        "stream",
        "stream",
        "display_data",
        "execute_result",
        "error",
    ]


def test_truncate_short_text_unchanged() -> None:
    """Text within the limit is returned as is with cut 0."""
    assert truncate("hello", 5) == ("hello", 0)
    assert truncate("", 10) == ("", 0)


def test_truncate_long_text_keeps_head_and_tail() -> None:
    """Long text keeps its head and tail around a marker that reports cut and total counts."""
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    result, cut = truncate(text, 100)
    marker = "\n... (truncated: 900 of 1000 chars cut) ...\n"
    assert cut == 900
    assert result == text[:50] + marker + text[-50:]
    assert len(result) <= 100 + len(marker)


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_truncate_tiny_limits(limit: int) -> None:
    """Very small limits still keep exactly `limit` original chars plus the marker."""
    text = "0123456789" * 3
    result, cut = truncate(text, limit)
    assert cut == len(text) - limit
    marker = f"\n... (truncated: {cut} of {len(text)} chars cut) ...\n"
    assert len(result) == limit + len(marker)
    assert result.startswith(text[: (limit + 1) // 2] + marker)


@pytest.mark.parametrize("limit", [0, -1])
def test_truncate_nonpositive_limit_means_no_limit(limit: int) -> None:
    """limit <= 0 disables truncation."""
    text = "x" * 10_000
    assert truncate(text, limit) == (text, 0)


def _html(n: int) -> dict[str, Any]:
    return msg("display_data", data={"text/html": "x" * n}, metadata={})


def test_a_flood_of_displays_is_cut_at_the_step_budget_with_one_marker() -> None:
    """Past the step's count or size budget, outputs are dropped and one marker says so, in
    the outputs and in the text the model reads."""
    collector = OutputCollector(max_outputs=5, max_chars=1000)
    for _ in range(300):
        collector.feed(_html(300))
    outputs = collector.outputs
    assert len(outputs) == 4  # three of 300 chars fit in 1000, then the marker
    assert outputs[-1]["name"] == "stderr"
    assert "297 output(s) (89,100 chars) dropped" in outputs[-1]["text"]
    assert "dropped" in collector.stderr_text()
    nbformat.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=outputs)]))


def test_cleared_outputs_free_their_room_and_updates_are_charged() -> None:
    """clear_output frees the budget (a progress bar may redraw forever); display updates
    are charged, so a loop of growing updates cannot grow the step."""
    collector = OutputCollector(max_outputs=2, max_chars=1000)
    for _ in range(100):
        collector.feed(msg("clear_output", wait=False))
        collector.feed(_html(600))
    assert len(collector.outputs) == 1 and collector.budget.dropped == 0
    shown = msg(
        "display_data", data={"text/plain": "a"}, metadata={}, transient={"display_id": "d"}
    )
    collector.feed(shown)
    for _ in range(10):
        collector.feed(
            msg(
                "update_display_data",
                data={"text/plain": "y" * 300},
                metadata={},
                transient={"display_id": "d"},
            )
        )
    assert collector.budget.chars <= 1000 and collector.budget.dropped > 0


def test_truncate_names_the_printed_size_when_only_part_arrived() -> None:
    """The kernel sent 1,000 of 100,000 printed chars: the marker and the count say 100,000."""
    text = "x" * 1_000
    result, cut = truncate(text, 100, printed=100_000)
    assert cut == 99_900 and "(truncated: 99900 of 100000 chars cut)" in result
    assert truncate(text, 5_000, printed=100_000) == (text, 99_000)  # nothing cut here
