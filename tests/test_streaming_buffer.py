"""The output buffer between a kernel and a slow consumer (pure: no kernel)."""

from __future__ import annotations

import asyncio

from kernel_env.streaming import OutputStream, event_from_message


def _out(text: str, name: str = "stdout") -> dict[str, object]:
    return {"output_type": "stream", "name": name, "text": text}


async def _drain(stream: OutputStream) -> list[dict[str, object]]:
    return [event async for event in stream]


async def test_text_of_one_stream_is_merged_and_order_kept() -> None:
    stream = OutputStream()
    for event in (_out("a"), _out("b"), _out("e", "stderr"), _out("c")):
        stream.push(event)
    stream.push({"output_type": "clear_output", "wait": False})
    stream.close()
    assert await _drain(stream) == [
        _out("ab"),
        _out("e", "stderr"),
        _out("c"),
        {"output_type": "clear_output", "wait": False},
    ]


async def test_past_the_bound_output_is_dropped_and_said_where() -> None:
    stream = OutputStream(max_bytes=10)
    stream.push(_out("0123456789"))
    stream.push(_out("lost!"))
    stream.push(_out("more"))
    first = [event async for event in _take(stream, 1)]
    stream.push(_out("later"))
    stream.close()
    rest = await _drain(stream)
    assert first == [_out("0123456789")]
    assert rest == [{"output_type": "dropped", "bytes": 9}, _out("later")]
    assert stream.dropped_total == 9


async def _take(stream: OutputStream, n: int):  # type: ignore[no-untyped-def]
    got = 0
    async for event in stream:
        yield event
        got += 1
        if got == n:
            return


async def test_a_consumer_waits_for_events_and_ends_at_close() -> None:
    stream = OutputStream()
    consumer = asyncio.create_task(_drain(stream))
    await asyncio.sleep(0.01)
    stream.push(_out("x"))
    await asyncio.sleep(0.01)
    stream.close()
    assert await asyncio.wait_for(consumer, 1) == [_out("x")]


async def test_a_sync_callback_runs_off_the_loop() -> None:
    seen: list[str] = []
    stream = OutputStream()
    stream.push(_out("x"))
    stream.close()
    await stream.deliver(lambda event: seen.append(str(event["text"])))
    assert seen == ["x"]


def test_events_from_iopub_messages() -> None:
    def msg(kind: str, **content: object) -> dict[str, object]:
        return {"header": {"msg_type": kind}, "content": content}

    assert event_from_message(msg("stream", name="stderr", text="t")) == _out("t", "stderr")
    assert event_from_message(msg("status", execution_state="idle")) is None
    error = event_from_message(msg("error", ename="E", evalue="v", traceback=["tb"]))
    assert error == {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["tb"]}
    shown = event_from_message(msg("display_data", data={"text/plain": "1"}, metadata={}))
    assert shown == {"output_type": "display_data", "data": {"text/plain": "1"}, "metadata": {}}


async def test_a_text_that_half_fits_keeps_its_head_then_says_what_was_cut() -> None:
    stream = OutputStream(max_bytes=4)
    stream.push(_out("abcdefgh"))
    stream.close()
    assert await _drain(stream) == [_out("abcd"), {"output_type": "dropped", "bytes": 4}]
