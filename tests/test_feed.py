"""The web view's per-session feed (pure: no kernel): numbered, bounded in count and size."""

from __future__ import annotations

from kernel_env.server.feed import EpisodeFeed


def _text(n: int) -> dict[str, object]:
    return {"output_type": "stream", "name": "stdout", "text": "x" * n}


def test_events_are_numbered_and_read_after_a_number() -> None:
    feed = EpisodeFeed()
    feed.episode_started("e1", "task", 10)
    feed.step_started("print(1)", False)
    feed.output(_text(2))
    assert [e["kind"] for e in feed.since(0)] == ["episode", "step", "output"]
    assert [e["seq"] for e in feed.since(1)] == [2, 3] and feed.last == 3


def test_a_step_keeps_its_share_of_output_and_says_what_it_dropped() -> None:
    from kernel_env.models import CodeBlockResult, REPLObservation

    feed = EpisodeFeed(step_chars=10)
    feed.step_started("loop()", False)
    for _ in range(3):
        feed.output(_text(4))
    feed.step_ended(REPLObservation(result=CodeBlockResult()), [])
    outputs = [e["output"] for e in feed.since(0) if e["kind"] == "output"]
    assert outputs[-1] == {"output_type": "dropped", "bytes": 4} and len(outputs) == 3


def test_the_whole_feed_stays_within_its_size_dropping_the_oldest() -> None:
    feed = EpisodeFeed(max_chars=1000, step_chars=10_000)
    for _ in range(50):  # 50 steps of 100 chars of output each: 5,000 chars offered
        feed.step_started("s", False)
        feed.output(_text(100))
    kept = feed.since(0)
    size = sum(len(str(e.get("output", {}).get("text", ""))) + len(e.get("code", "")) for e in kept)
    assert size <= 1000 and kept[-1]["seq"] == feed.last  # the newest are the ones kept
    assert kept[0]["seq"] > 1


def test_closing_wakes_readers() -> None:
    import asyncio

    async def main() -> list[dict[str, object]]:
        feed = EpisodeFeed()
        waiting = asyncio.create_task(feed.wait(0, 30))
        await asyncio.sleep(0.01)
        feed.close()
        return await asyncio.wait_for(waiting, 1)

    assert asyncio.run(main()) == []
