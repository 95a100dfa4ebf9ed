"""The gateway's SSE answer (`gateway.responses.SSEStream`) on a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from common.jsonio import dumps
from common.wire import EventType
from gateway.events import Event
from gateway.responses import KEEP_ALIVE, Cut, SSEStream, sse_chunks, stream_response


async def test_a_stream_s_headers_go_out_with_its_first_bytes_in_one_write() -> None:
    """One write, one TCP segment: the caller wakes once for the start of its stream, not for the
    headers and again for the first chunk (aiohttp's `StreamResponse` writes headers alone)."""
    writes: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        record_writes(request, writes)
        out = SSEStream(request, "run_1", {})
        await out.keep_alive()
        await out.write(b"data: {}\n\n")
        return await out.end(b"data: [DONE]\n\n")

    resp, body = await get(handler)
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "run_1"
    assert body == KEEP_ALIVE + b"data: {}\n\ndata: [DONE]\n\n"
    assert writes[0].startswith(b"HTTP/1.1 200 ") and KEEP_ALIVE in writes[0], writes[0]  # (chunk-framed)
    assert len(writes) == 3


def record_writes(request: web.Request, writes: list[bytes]) -> None:
    """What the answer to `request` writes to its connection from now on goes to `writes` too, a
    write (or a `writelines`) each."""
    transport: Any = request.transport
    write, writelines = transport.write, transport.writelines

    class Recording:  # (the transport's methods are read-only: a stand-in that records them)
        def __getattr__(self, name: str) -> Any:
            return getattr(transport, name)

        def write(self, data: bytes) -> None:
            writes.append(bytes(data))
            write(data)

        def writelines(self, lines: list[bytes]) -> None:
            writes.append(b"".join(lines))
            writelines(lines)

    request.protocol.transport = Recording()  # type: ignore[assignment]  # (what the writer writes to)


async def get(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[aiohttp.ClientResponse, bytes]:
    """A GET answered by `handler` on a real aiohttp server (port 0): the response and its body."""
    app = web.Application()
    app.router.add_get("/", handler)
    server = TestServer(app, port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http, http.get(server.make_url("/")) as resp:
            return resp, await resp.read()
    finally:
        await server.close()


class Played:
    """A follower that hands over the events it was given, each alone, then waits."""

    def __init__(self, events: list[Event]) -> None:
        self.events = list(events)
        self.writing = 0

    async def next(self, timeout: float) -> Event | None:
        if not self.events:
            await asyncio.Event().wait()
        return self.events.pop(0)

    def take_ready(self) -> list[Event]:
        return []


def delta(n: int | None, text: str) -> Event:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                            "finish_reason": None}]}
    return Event("1-0", EventType.DELTA, {"chunks": [chunk], **({"n": n} if n is not None else {})})


async def streamed(events: list[Event]) -> tuple[bytes, list[str]]:
    """The body a caller gets for `events`, and how `stream_response` ended ('cut' or 'ended')."""
    ended: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        out = SSEStream(request, "run_1", {})
        try:
            resp = await stream_response(request, Played(events), "m", out, 60)  # type: ignore[arg-type]
        except Cut:
            ended.append("cut")
            assert out.resp is not None
            return out.resp
        ended.append("ended")
        return resp

    return (await get(handler))[1], ended


def texts(body: bytes) -> list[str]:
    return [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in body.split(b"\n\n")
            if line.startswith(b"data: {") and b'"choices"' in line]


async def test_a_delta_redis_holds_twice_is_given_once_and_a_lost_one_ends_the_stream_saying_so() -> None:
    """A Sentinel failover: the worker wrote a delta again on the promoted replica after the old
    primary had it read (a caller got a token twice), or a delta only the old primary had was never
    read (a caller got a stream missing a token, and no error). Each delta says its number, and a
    completed stream how many it had."""
    completed = Event("2-0", EventType.COMPLETED, {"deltas": 2})
    body, ended = await streamed([delta(1, "a"), delta(1, "a"), delta(2, "b"), completed])
    assert texts(body) == ["a", "b"] and body.endswith(b"data: [DONE]\n\n") and ended == ["ended"]
    for events in ([delta(1, "a"), delta(3, "c"), completed],  # (a delta lost in the middle)
                   [delta(1, "a"), completed]):  # (the last delta lost)
        body, ended = await streamed(events)
        error = json.loads(body.split(b"\n\n")[-3][6:])["error"]
        assert texts(body) == ["a"] and ended == ["cut"], body
        assert error["code"] == "service_unavailable" and "Redis lost part of this run's output" in error["message"]
        assert body.endswith(b"data: [DONE]\n\n")
    # (an older worker's deltas, without numbers, are given as they come)
    body, ended = await streamed([delta(None, "a"), delta(None, "a"), Event("2-0", EventType.COMPLETED, {})])
    assert texts(body) == ["a", "a"] and ended == ["ended"]


async def test_a_requeue_after_deltas_the_caller_got_ends_the_stream_saying_redis_lost_them() -> None:
    """A run with output is not requeued: a requeue after deltas the caller got is a failover's (the
    promoted replica had neither them nor the record's `output`). The next attempt's answer does not
    follow them (the caller got "a b" then "a b c": no error); a requeue before any output does."""
    requeued = Event("3-0", EventType.REQUEUED, {"code": "worker_lost", "message": "lost"})
    completed = Event("4-0", EventType.COMPLETED, {"deltas": 3})
    body, ended = await streamed([delta(1, "a"), delta(2, "b"), requeued, delta(1, "a"), delta(2, "b"),
                                  delta(3, "c"), completed])
    error = json.loads(body.split(b"\n\n")[-3][6:])["error"]
    assert texts(body) == ["a", "b"] and ended == ["cut"], body
    assert error["code"] == "service_unavailable" and "Redis lost part of this run's output" in error["message"]
    body, ended = await streamed([requeued, delta(1, "a"), delta(2, "b"), delta(3, "c"), completed])
    assert texts(body) == ["a", "b", "c"] and ended == ["ended"], body


async def test_a_delta_of_another_attempt_after_deltas_the_caller_got_ends_the_stream() -> None:
    """A completion's gateway hears only output and ends from its inbox, not a requeue: the next
    attempt's deltas, numbered from 1 again, were taken for deltas written again and dropped until
    one passed the caller's last (an answer spliced from two attempts, no error). Each delta says its
    attempt (`a`)."""
    def of(attempt: str, n: int, text: str) -> Event:
        event = delta(n, text)
        event.data["a"] = attempt
        return event
    completed = Event("4-0", EventType.COMPLETED, {"deltas": 3})
    body, ended = await streamed([of("1", 1, "a"), of("1", 2, "b"), of("2", 1, "x"), of("2", 2, "y"),
                                  of("2", 3, "z"), completed])
    assert texts(body) == ["a", "b"] and ended == ["cut"], body
    body, ended = await streamed([of("1", 1, "a"), of("1", 1, "a"), of("1", 2, "b"), of("1", 3, "c"), completed])
    assert texts(body) == ["a", "b", "c"] and ended == ["ended"], body


def test_a_deltas_chunks_are_each_its_own_sse_line_saying_the_model() -> None:
    """One text for the delta, each chunk's line as `dumps` writes it: also a chunk orjson cannot write
    (a key that is no string, an integer beyond 64 bits), one that is no object, and a NaN (null)."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "served",
             "choices": [{"index": 0, "delta": {"content": "tok é \u2028"}, "finish_reason": None}]}
    cases: list[list[Any]] = [[], [dict(chunk)], [dict(chunk) for _ in range(3)],
                              [dict(chunk), {1: "int key"}, dict(chunk)], [{"n": 2**70}], [[1, 2], "x", None],
                              [{"f": float("nan"), "g": 1.5}]]
    for chunks in cases:
        expected = b"".join(b"data: " + dumps({**c, "model": "public"} if isinstance(c, dict) else c) + b"\n\n"
                            for c in chunks)
        assert sse_chunks(chunks, "public") == expected
        assert all(c["model"] == "public" for c in chunks if isinstance(c, dict))



async def test_events_that_waited_together_go_out_in_writes_of_about_write_bytes_each() -> None:
    """A caller that reads slowly has many events waiting when it takes them: their SSE lines go
    out in writes of at most `WRITE_BYTES` (and one event's lines), each awaited, not all at once
    into the gateway's buffers; every one arrives, in order."""
    from gateway.responses import WRITE_BYTES
    events = [delta(n, f"{n:04d} " + "y" * 3000) for n in range(1, 81)]
    events.append(Event("2-0", EventType.COMPLETED, {"deltas": 80}))

    class Waited(Played):
        async def next(self, timeout: float) -> Event | None:
            if not self.events:
                await asyncio.Event().wait()
            return self.events.pop(0)

        def take_ready(self) -> list[Event]:
            taken, self.events = self.events, []
            return taken

    async def handler(request: web.Request) -> web.StreamResponse:
        record_writes(request, written)
        out = SSEStream(request, "run_1", {})
        return await stream_response(request, Waited(events), "m", out, 60)  # type: ignore[arg-type]

    written: list[bytes] = []
    body = (await get(handler))[1]
    writes = [len(w) for w in written]
    assert texts(body) == [f"{n:04d} " + "y" * 3000 for n in range(1, 81)]
    assert body.endswith(b"data: [DONE]\n\n")
    one_event = len(sse_chunks(events[0].data["chunks"], "m"))
    assert sum(writes) > 3 * WRITE_BYTES and max(writes) <= WRITE_BYTES + one_event + 1024, writes
