"""`workers.stream_pump`: what `runtime.stream_batch_ms` holds, and the bound on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from tests.conftest import async_wait_until
from workers.adapters.base import LastRead
from workers.stream_pump import Pump

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}


def text(t: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}], "usage": None}


async def test_the_pump_stops_reading_once_max_held_chunks_wait_until_they_are_taken() -> None:
    read = 0

    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        nonlocal read
        for n in range(100):
            read += 1
            yield [text(str(n))]

    pump = Pump(reads(), wanted_usage=True, max_held=8)
    loop = asyncio.get_running_loop()
    try:
        await pump.ready(None)  # the first output (this provider sends faster than it is taken)
        assert read == 8  # it stopped reading at 8 chunks held
        assert [c["choices"][0]["delta"]["content"] for c in pump.take()] == [str(n) for n in range(8)]
        await pump.ready(loop.time() + 3600)  # not the deadline: 8 chunks wait
        assert len(pump.held) == 8 and read == 16
        assert len(pump.take()) == 8
    finally:
        await pump.close()


async def test_opening_chunks_wait_for_output_and_usage_is_kept_aside() -> None:
    gate = asyncio.Event()

    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        yield [ROLE]
        await gate.wait()
        yield [text("a")]
        yield [{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}]

    pump = Pump(reads(), wanted_usage=False)
    loop = asyncio.get_running_loop()
    try:
        await pump.ready(loop.time() + 0.01)  # the deadline passes: only the opening chunk is there
        assert pump.take() == [] and pump.held == [ROLE]
        gate.set()
        await pump.ready(None)
        assert pump.take() == [ROLE, {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}]
        await pump.ready(None)
        assert pump.ended and pump.error is None and pump.take_all() == []  # (the usage-only chunk is not the caller's)
        assert pump.usage == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    finally:
        await pump.close()


async def test_an_error_of_the_stream_ends_it_and_is_kept_for_the_runner() -> None:
    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        yield [text("a")]
        raise ValueError("broken")

    pump = Pump(reads(), wanted_usage=True)
    await pump.ready(asyncio.get_running_loop().time() + 3600)  # the end comes before the deadline
    assert pump.ended and isinstance(pump.error, ValueError)
    assert pump.take_all() == [text("a")]
    await pump.close()


async def test_so_many_opening_chunks_that_the_pump_is_full_go_out_as_output() -> None:
    """(Found in review: with max_held opening chunks held, the pump waited for room and the runner
    for output, for good.)"""
    empty = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}

    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        for _ in range(10):
            yield [empty]
        yield [text("a")]

    pump = Pump(reads(), wanted_usage=True, max_held=8)
    try:
        await asyncio.wait_for(pump.ready(None), 10)
        assert pump.take() == [empty] * 8
    finally:
        await pump.close()


async def test_closing_a_full_pump_closes_the_provider_stream() -> None:
    """(Found in review: a pump cancelled while it waited for room left the provider's stream, and
    its request, open until the stream was garbage.)"""
    closed = asyncio.Event()

    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        try:
            for n in range(100):
                yield [text(str(n))]
        finally:
            closed.set()

    stream = reads()  # (held, as the runner holds it)
    pump = Pump(stream, wanted_usage=True, max_held=4)
    await pump.ready(None)
    assert len(pump.held) == 4  # full: the pump waits for room
    await pump.close()
    assert closed.is_set()


async def test_a_last_read_waits_for_the_end_but_not_past_max_held_chunks() -> None:
    """A read the adapter marks as its last goes with the run's end, not at once; but a provider that
    goes on sending after it (before the end) gets no more held than `max_held` chunks."""
    go, more = asyncio.Event(), asyncio.Event()
    read, waiting = 0, False

    async def reads() -> AsyncIterator[list[dict[str, Any]]]:
        nonlocal read, waiting
        yield [text("a")]
        await go.wait()
        yield LastRead([text("b")])
        waiting = True
        await more.wait()
        for n in range(20):
            read += 1
            yield LastRead([text(str(n))])

    def said(chunks: list[dict[str, Any]]) -> list[str]:
        return [c["choices"][0]["delta"]["content"] for c in chunks]

    pump = Pump(reads(), wanted_usage=True, max_held=8)
    try:
        await pump.ready(None)
        assert said(pump.take()) == ["a"]
        ready = asyncio.ensure_future(pump.ready(None))
        go.set()
        async def past() -> bool:
            return waiting

        await async_wait_until(past, what="the pump past the last read")
        assert not ready.done() and said(pump.held) == ["b"]  # held for the end
        more.set()
        await ready  # 8 chunks wait: they go out, though each came in a last read
        got = said(pump.take())
        assert got == ["b", *map(str, range(7))] and read == 7
        while not pump.ended:
            await pump.ready(None)
            got += said(pump.take())
        assert got + said(pump.take_all()) == ["b", *map(str, range(20))]
    finally:
        await pump.close()
