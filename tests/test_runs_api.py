"""The runs API on a real Redis and real HTTP (port 0); events are written by the test itself,
so the moments of connecting, disconnecting and resuming are exact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.codec import event_fields
from common.config import Config, parse_config
from common.redisconn import now_ms
from common.wire import RunKind
from gateway.app import RUNS, build_app
from gateway.events import HELD_BYTES, READ_COUNT
from gateway.requests import ParsedRequest
from gateway.runs import RunClient
from gateway.runs_api import FIRST_PAGE
from tests.conftest import async_wait_until
from tests.openapi import validate
from tests.sse import Message, next_message, read_all

MODEL = "m:1"


def make_config(run_ttl_s: int = 3600) -> Config:
    return parse_config({
        "models": [{"id": MODEL, "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"run_ttl_s": run_ttl_s},
        # runs here are short: let a 1 s record TTL pass validation
        "queue": {"queue_timeout_ms": 200, "execution_timeout_ms": 300},
    })


class Api:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession, redis: Redis, config: Config) -> None:
        self.server = server
        self.session = session
        self.redis = redis
        self.config = config
        self.client = RunClient(redis, config)

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def submit(self) -> str:
        model = self.config.model(MODEL)
        assert model is not None
        req = ParsedRequest(RunKind.CHAT, MODEL, True, {"model": MODEL, "messages": [], "stream": True})
        return (await self.client.submit(model, req))[0]

    async def event(self, run_id: str, etype: str, data: dict[str, Any]) -> str:
        """An event added as the scripts add one: to the run's stream, and a copy to the inbox of
        each gateway that follows the run."""
        fields = event_fields(etype, data)
        entry = (await self.redis.xadd(keys.run_events(run_id), fields)).decode()
        for gateway in ((await self.redis.hget(keys.run_record(run_id), "watchers")) or b"").decode().split(","):
            if gateway:
                await self.redis.xadd(keys.gateway_inbox(gateway), {"run": run_id, "id": entry, **fields})
        return str(entry)

    async def end(self, run_id: str, state: str = "completed") -> None:
        await self.redis.hset(keys.run_record(run_id), mapping={"state": state, "finished_ms": now_ms()})


@asynccontextmanager
async def api_for(config: Config, redis_url: str) -> AsyncIterator[Api]:
    server = TestServer(build_app(config, redis_url), host="127.0.0.1", port=0, handler_cancellation=True)
    await server.start_server()
    redis = Redis.from_url(redis_url)
    try:  # (closed also when the test body leaves by an exception: a skip, a failed assert)
        await redis.hset(keys.heartbeat("p"), mapping={"health": "available", "capacity": 1, "ts_ms": now_ms()})
        async with aiohttp.ClientSession() as session:
            yield Api(server, session, redis, config)
    finally:
        await redis.aclose()
        await server.close()


@pytest.fixture
async def api(redis_url: str) -> AsyncIterator[Api]:
    async with api_for(make_config(), redis_url) as a:
        yield a


def chunk(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "model": "p-served",
            "choices": [{"index": 0, "delta": {"content": text}}]}


async def test_an_unknown_run_is_404_on_every_route(api: Api) -> None:
    for method, path in (("GET", "/v1/runs/run_nope"), ("GET", "/v1/runs/run_nope/events"),
                         ("DELETE", "/v1/runs/run_nope")):
        async with api.session.request(method, api.url(path)) as resp:
            assert resp.status == 404, path
            body = await resp.json()
            validate("ErrorResponse", body)
            assert body["error"]["code"] == "not_found" and "run_nope" in body["error"]["message"]


async def test_get_answers_the_run_record(api: Api) -> None:
    run_id = await api.submit()
    async with api.session.get(api.url(f"/v1/runs/{run_id}")) as resp:
        assert resp.status == 200 and resp.headers["X-IOP-Run-Id"] == run_id
        view = await resp.json()
    assert view["id"] == run_id and view["object"] == "run"
    assert (view["state"], view["model"], view["kind"], view["stream"]) == ("queued", MODEL, "chat", True)
    assert view["attempts"] == 0 and view["provider"] is None and view["error"] is None
    assert (view["unable"], view["max_attempts"], view["unable_by"], view["elsewhere"]) == (0, 3, [], [])
    assert isinstance(view["created_ms"], int) and view["finished_ms"] is None
    assert "body" not in view

    await api.redis.hset(keys.run_record(run_id), mapping={
        "state": "failed", "provider": "p", "node": "n1", "target": "p-served", "attempts": 2, "unable": 1,
        "tried": "q,r,p", "unable_by": "r", "elsewhere": "q",
        "error_code": "provider_error", "error_message": "boom", "finished_ms": now_ms()})
    async with api.session.get(api.url(f"/v1/runs/{run_id}")) as resp:
        view = await resp.json()
    assert (view["state"], view["provider"], view["node"], view["target"], view["attempts"], view["unable"]) == (
        "failed", "p", "n1", "p-served", 2, 1)
    assert (view["tried"], view["unable_by"], view["elsewhere"]) == (["q", "r", "p"], ["r"], ["q"])
    assert view["error"] == {"code": "provider_error", "message": "boom"}


async def test_events_resume_after_last_event_id_with_nothing_lost_or_repeated(api: Api) -> None:
    run_id = await api.submit()
    written = [await api.event(run_id, "dispatched", {"provider": "p", "node": "n1", "target": "p-served"}),
               await api.event(run_id, "started", {"attempt": 1}),
               await api.event(run_id, "delta", {"chunks": [chunk("a")]})]

    first: list[Message] = []
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        for _ in range(3):
            msg = await next_message(resp)
            assert msg is not None
            first.append(msg)
        # Following: an event written now reaches the open stream.
        written.append(await api.event(run_id, "delta", {"chunks": [chunk("b")]}))
        msg = await next_message(resp)
        assert msg is not None
        first.append(msg)
    # Disconnected; the run goes on without a reader.
    written += [await api.event(run_id, "delta", {"chunks": [chunk("c")]}),
                await api.event(run_id, "delta", {"chunks": [chunk("d")]})]

    headers = {"Last-Event-ID": str(first[-1].id)}
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers=headers) as resp:
        rest = [await next_message(resp), await next_message(resp)]
        written.append(await api.event(run_id, "completed", {}))
        await api.end(run_id)
        tail = await read_all(resp)  # the terminal event, then the stream ends
    second = [m for m in rest if m is not None] + tail

    assert [m.event for m in first] == ["dispatched", "started", "delta", "delta"]
    assert [m.event for m in second] == ["delta", "delta", "completed"]
    assert [m.id for m in first + second] == written  # every event once, in order
    assert first[0].data == {"provider": "p", "node": "n1", "target": "p-served"}
    texts = [m.data["chunks"][0]["choices"][0]["delta"]["content"] for m in first + second if m.event == "delta"]
    assert texts == ["a", "b", "c", "d"]
    # Output says the model id the caller used, never the served name.
    assert all(c["model"] == MODEL for m in first + second if m.event == "delta" for c in m.data["chunks"])


async def test_an_ended_run_replays_and_closes_and_a_resume_at_its_end_is_empty(api: Api) -> None:
    run_id = await api.submit()
    ids = [await api.event(run_id, "dispatched", {"provider": "p"}),
           await api.event(run_id, "failed", {"code": "provider_error", "message": "boom"})]
    await api.end(run_id, "failed")
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages = await read_all(resp)
    assert [(m.id, m.event) for m in messages] == [(ids[0], "dispatched"), (ids[1], "failed")]
    assert messages[1].data["code"] == "provider_error"
    for last, expected in ((ids[0], [ids[1]]), (ids[1], [])):
        async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": last}) as resp:
            assert [m.id for m in await read_all(resp)] == expected


@pytest.mark.parametrize("ended", [True, False])
async def test_head_of_events_answers_headers_only_and_the_connection_goes_on(api: Api, ended: bool) -> None:
    """(a hostile caller's audit: HEAD sent the whole stream, unframed, and followed a running run
    to its end: the next answer on the kept-alive connection was read from SSE text)"""
    run_id = await api.submit()
    await api.event(run_id, "dispatched", {"provider": "p"})
    if ended:
        await api.event(run_id, "failed", {"code": "provider_error", "message": "boom"})
        await api.end(run_id, "failed")
    reader, writer = await asyncio.open_connection(api.server.host, api.server.port)
    try:
        writer.write(f"HEAD /v1/runs/{run_id}/events HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     f"GET /v1/runs/{run_id} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        heads = []
        for _ in range(2):
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode()
            heads.append(head)
            fields = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if line)
        body = await reader.readexactly(int(fields["content-length"]))
    finally:
        writer.close()
    assert heads[0].startswith("HTTP/1.1 200") and "text/event-stream" in heads[0]
    assert "x-request-id" in heads[0].lower() and f"X-IOP-Run-Id: {run_id}" in heads[0]
    assert heads[1].startswith("HTTP/1.1 200")
    assert json.loads(body)["id"] == run_id


async def test_an_events_stream_the_gateway_stops_following_ends_with_an_error_event(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that has not ended when its longest possible life has passed (here 0.5 s: queue and
    execution timeouts, no grace): the stream ends with an `error` event, not as if the run had
    ended (a hostile caller's audit: it ended bare)."""
    monkeypatch.setattr("gateway.runs.FOLLOW_GRACE_S", 0.0)
    run_id = await api.submit()
    first = await api.event(run_id, "dispatched", {"provider": "p"})
    await api.redis.hset(keys.run_record(run_id), "state", "running")  # (no stuck-run check ends it)
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages = await asyncio.wait_for(read_all(resp), 30)
    assert [m.id for m in messages[:-1]] == [first]
    last = messages[-1]
    assert last.event == "error" and last.id is None
    validate("ErrorResponse", last.data)
    assert last.data["error"]["code"] == "execution_timeout"
    assert "Last-Event-ID" in last.data["error"]["message"] and run_id in last.data["error"]["message"]


async def test_a_follower_that_stopped_reading_is_closed_once_the_stream_is_given_up(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runs-API caller that reads nothing while its run writes megabytes: once the follow's bound
    passes (0.5 s here), the gateway gives it `END_WITHIN_S` for the stream's end, then closes its
    connection (its handler waited for the caller's reads for good before)."""
    import socket

    monkeypatch.setattr("gateway.runs.FOLLOW_GRACE_S", 0.0)
    run_id = await api.submit()
    await api.redis.hset(keys.run_record(run_id), "state", "running")  # (no stuck-run check ends it)
    for _ in range(40):  # 10 MB, more than the sockets hold
        await api.event(run_id, "delta", {"chunks": [chunk("x" * 256 * 1024)]})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (api.server.host, api.server.port))
    try:
        await asyncio.get_running_loop().sock_sendall(
            sock, f"GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        assert api.server.runner is not None and api.server.runner.server is not None
        server = api.server.runner.server

        async def opened() -> bool:
            return len(server.connections) == 1

        async def closed() -> bool:
            return not server.connections

        await async_wait_until(opened, what="the follower's connection")
        await async_wait_until(closed, timeout=15, what="the connection of a caller that reads nothing to close")
    finally:
        sock.close()


@pytest.mark.parametrize("last", [
    "abc", "1-2-3", "-1", "1-", "\u0661\u0662",  # Arabic-Indic digits are digits to Python, not to Redis
    "99999999999999999999-0", "0-99999999999999999999", str(2**64), f"{2**64}-0",
    "9" * 4301, "1-" + "9" * 5000,  # (longer than Python's int() takes: was a 500)
])
async def test_a_malformed_or_out_of_range_last_event_id_is_400(api: Api, last: str) -> None:
    run_id = await api.submit()
    headers = {"Last-Event-ID": last}
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers=headers) as resp:
        assert resp.status == 400
        body = await resp.json()
    validate("ErrorResponse", body)
    assert body["error"]["param"] == "Last-Event-ID"
    assert body["error"]["code"] == "invalid_request_error"


async def test_last_event_id_given_twice_is_400(api: Api) -> None:
    """(an audit: the first of two was used, silently)"""
    run_id = await api.submit()
    first = await api.event(run_id, "dispatched", {"provider": "p"})
    headers = [("Last-Event-ID", first), ("Last-Event-ID", "0")]
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers=headers) as resp:
        assert resp.status == 400
        body = await resp.json()
    validate("ErrorResponse", body)
    assert body["error"]["param"] == "Last-Event-ID" and "2 times" in body["error"]["message"]


@pytest.mark.parametrize("ended", [True, False])
@pytest.mark.parametrize("last", [f"{2**64 - 1}-{2**64 - 1}", str(2**64 - 1)])
async def test_the_largest_last_event_id_is_accepted(api: Api, last: str, ended: bool) -> None:
    """Nothing comes after the largest id: the stream ends at once, with an error event that says
    so, whether the run has ended or still runs (it was an HTTP 500 written inside the started
    stream for a running run)."""
    run_id = await api.submit()
    await api.event(run_id, "dispatched", {"provider": "p"})
    if ended:
        await api.event(run_id, "failed", {"code": "provider_error", "message": "boom"})
        await api.end(run_id, "failed")
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": last}) as resp:
        assert resp.status == 200
        messages = await read_all(resp)
    assert [m.event for m in messages] == ["error"] and messages[0].data["error"]["code"] == "not_found"
    assert messages[0].data["error"]["message"] == (
        f"Last-Event-ID {last} is past the events of run {run_id} (it never wrote that event, or Redis lost it in "
        f"a failover); no event can come after it: resume with the id of the last event received, or 0, or "
        f"GET /v1/runs/{run_id} for its state")


async def test_an_id_with_thousands_of_leading_zeros_is_the_id_it_names(api: Api) -> None:
    run_id = await api.submit()
    first = await api.event(run_id, "dispatched", {"provider": "p"})
    second = await api.event(run_id, "failed", {"code": "provider_error", "message": "boom"})
    await api.end(run_id, "failed")
    ms, seq = first.split("-")
    headers = {"Last-Event-ID": "0" * 4400 + ms + "-" + "0" * 3000 + seq}  # (a header line is at most 8 KiB)
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers=headers) as resp:
        assert [m.id for m in await read_all(resp)] == [second]


@pytest.mark.parametrize("ended", [True, False])
async def test_a_run_of_many_pages_of_events_is_replayed_whole_and_in_order(api: Api, ended: bool) -> None:
    """An ended run's replay and a running run's catch-up read its stream a page at a time
    (`READ_COUNT`): every event comes once, in order."""
    run_id = await api.submit()
    count = 3 * READ_COUNT + 5
    ids = [await api.event(run_id, "delta", {"chunks": [chunk(str(n))]}) for n in range(count)]
    if ended:
        ids.append(await api.event(run_id, "completed", {}))
        await api.end(run_id)
        await api.redis.config_resetstat()
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages: list[Message] = []
        if not ended:
            while len(messages) < count:
                message = await next_message(resp)
                assert message is not None
                messages.append(message)
            ids.append(await api.event(run_id, "completed", {}))
        messages += await read_all(resp)
    assert [m.id for m in messages] == ids
    assert [m.data["chunks"][0]["choices"][0]["delta"]["content"] for m in messages[:count]] == [
        str(n) for n in range(count)]
    if ended:  # a page at a time: 8, 16, 32, 64, 64 and the last 14
        assert (await api.redis.info("commandstats"))["cmdstat_xrange"]["calls"] >= 6


async def test_a_replay_of_large_events_reads_smaller_pages(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page holds about `HELD_BYTES` of events (as stored) at most, but for one event: pages of 64
    events of 64 KiB each (a hostile provider's) had a reader that read nothing hold 4 MB of the
    gateway's memory. Small ones go 8, then twice as many a page, up to `READ_COUNT`."""
    runs = api.server.app[RUNS]
    xrange = runs.redis.xrange
    counts: list[int] = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        counts.append(kwargs["count"])
        return await xrange(*args, **kwargs)

    monkeypatch.setattr(runs.redis, "xrange", counted)
    for size, many, pages in ((HELD_BYTES // 4, 24, None), (10, 200, [8, 16, 32, 64, 64, 64])):
        run_id = await api.submit()
        ids = [await api.event(run_id, "delta", {"chunks": [chunk(f"{n} " + "z" * size)]}) for n in range(many)]
        ids.append(await api.event(run_id, "completed", {}))
        await api.end(run_id)
        counts.clear()
        async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
            messages = await read_all(resp)
        assert [m.id for m in messages] == ids
        if pages is None:  # (a quarter of HELD_BYTES each: after the first page, 2 to 4 a page)
            assert counts[0] == FIRST_PAGE and 2 <= min(counts[1:]) and max(counts[1:]) <= 4, counts
        else:
            assert counts == pages, counts


async def ended_run_of_two_pages(api: Api) -> tuple[str, list[str]]:
    """A run that ended after READ_COUNT + 5 deltas (two pages of a replay): its id, its events' ids."""
    run_id = await api.submit()
    ids = [await api.event(run_id, "delta", {"chunks": [chunk(str(n))]}) for n in range(READ_COUNT + 5)]
    ids.append(await api.event(run_id, "completed", {}))
    await api.end(run_id)
    return run_id, ids


async def test_a_replay_cut_by_redis_ends_with_an_error_event_saying_so_without_redis_s_text(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis goes away between two pages of a replay (the headers went out): the stream ends with
    an OpenAI-shaped error event that says what happened and how to resume; redis-py's text (with
    the server's address) goes to the gateway's log only."""
    run_id, ids = await ended_run_of_two_pages(api)
    runs = api.server.app[RUNS]
    xrange = runs.redis.xrange
    pages = 0

    async def then_gone(*args: Any, **kwargs: Any) -> Any:
        nonlocal pages
        pages += 1
        if pages > 1:
            raise RedisConnectionError("Error 111 connecting to 10.1.2.3:6379. Connection refused.")
        return await xrange(*args, **kwargs)

    monkeypatch.setattr(runs.redis, "xrange", then_gone)
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages = await read_all(resp)
    assert [m.id for m in messages[:-1]] == ids[:FIRST_PAGE]
    error = messages[-1]
    assert error.event == "error" and error.data["error"]["code"] == "service_unavailable"
    assert error.data["error"]["message"] == ("the run store (Redis) became unavailable while this stream followed "
                                              "the run; Last-Event-ID resumes its events")
    validate("ErrorResponse", error.data)


@pytest.mark.parametrize(("data", "shown"), [
    (b"\x93\x01\x02\x03\xff", {"chunks": []}),
    (b"\x81\x90\x01", {"chunks": []}),
    (msgpack.packb({"chunks": 5}), {"chunks": []}),  # (the replay hung on it: a review)
    (msgpack.packb({"chunks": [b"x"]}, use_bin_type=True), {}),  # (bytes: no JSON holds them)
], ids=["not-msgpack", "array-key", "chunks-not-a-list", "bytes"])
async def test_an_event_that_is_not_iop_s_writing_is_shown_without_its_data(
        api: Api, data: bytes, shown: dict[str, Any]) -> None:
    """An entry of a run's events whose data is not msgpack (written by hand, by another program),
    or msgpack Python cannot hold (a map keyed by an array: unhashable, a TypeError; the replay then
    never ended): the replay ended with an empty 200 body and an "unhandled error" (operator's
    audit); it is shown with no data, and the rest follow."""
    run_id = await api.submit()
    first = await api.event(run_id, "dispatched", {"provider": "p"})
    odd = (await api.redis.xadd(keys.run_events(run_id), {"type": "delta", "data": data})).decode()
    last = await api.event(run_id, "completed", {})
    await api.end(run_id)
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages = await read_all(resp)
    assert [(m.id, m.event) for m in messages] == [(first, "dispatched"), (odd, "delta"), (last, "completed")]
    assert messages[1].data == shown  # (a delta with nothing in it)


async def test_a_replay_whose_events_expire_before_its_end_ends_with_an_error_not_bare(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's events expire (`run_ttl_s`) with its record, and may go first by a few ms, or between
    two pages of a replay: the stream just stopped, which a client takes for the run's end."""
    run_id, ids = await ended_run_of_two_pages(api)
    runs = api.server.app[RUNS]
    xrange = runs.redis.xrange

    async def then_expire(*args: Any, **kwargs: Any) -> Any:
        page = await xrange(*args, **kwargs)
        await api.redis.delete(keys.run_events(run_id))  # (expired after the first page was read)
        return page

    monkeypatch.setattr(runs.redis, "xrange", then_expire)
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events")) as resp:
        messages = await read_all(resp)
    assert [m.id for m in messages[:-1]] == ids[:FIRST_PAGE]
    assert messages[-1].event == "error" and messages[-1].data["error"]["code"] == "not_found"
    assert messages[-1].data["error"]["message"] == (
        f"the events of run {run_id} expired (runtime.run_ttl_s) before this stream reached the run's end; "
        f"GET /v1/runs/{run_id} tells how it ended while its record lasts")
    # the record outlived its events: a replay from the start, or from an event, has nothing to send
    for last in ("0", ids[3]):
        async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": last}) as resp:
            assert [m.event for m in await read_all(resp)] == ["error"]


async def test_delete_of_a_queued_run_takes_it_out_of_the_queue(api: Api) -> None:
    first, second = await api.submit(), await api.submit()
    assert await api.redis.xlen(keys.runs_stream(MODEL)) == 2
    async with api.session.delete(api.url(f"/v1/runs/{first}")) as resp:
        assert resp.status == 200
        view = await resp.json()
    assert view["state"] == "cancelled" and view["error"]["code"] == "cancelled"
    assert await api.redis.xlen(keys.runs_stream(MODEL)) == 1
    left = await api.redis.xrange(keys.runs_stream(MODEL))
    assert [fields[b"run"].decode() for _, fields in left] == [second]
    async with api.session.get(api.url(f"/v1/runs/{first}/events")) as resp:
        assert [m.event for m in await read_all(resp)] == ["failed"]
    # Deleting it again changes nothing and says so.
    async with api.session.delete(api.url(f"/v1/runs/{first}")) as resp:
        assert resp.status == 200 and (await resp.json())["state"] == "cancelled"


async def test_run_records_and_events_expire_after_run_ttl_s(redis_url: str) -> None:
    async with api_for(make_config(run_ttl_s=1), redis_url) as api:
        run_id = await api.submit()
        assert 0 < await api.redis.ttl(keys.run_record(run_id)) <= 1
        async with api.session.delete(api.url(f"/v1/runs/{run_id}")) as resp:
            assert (await resp.json())["state"] == "cancelled"
        assert 0 < await api.redis.pttl(keys.run_events(run_id)) <= 1000
        assert 0 < await api.redis.pttl(keys.run_record(run_id)) <= 1000

        async def gone() -> bool:
            async with api.session.get(api.url(f"/v1/runs/{run_id}")) as resp:
                return resp.status == 404

        await async_wait_until(gone, timeout=10, what="the run to expire")
        assert not await api.redis.exists(keys.run_events(run_id))


@pytest.mark.parametrize("events", [0, 1])
async def test_a_last_event_id_past_a_running_runs_last_event_ends_the_stream_with_why(
        api: Api, events: int) -> None:
    """A client that says it had an event the run never wrote (an id in the future; or one a Redis
    failover lost): nothing it has not had can come, and the run's end would go unseen (it waited
    until the gateway gave up on it, 30 s and more): the stream ends at once, with an error event
    that names the run's last event to resume from (it ended empty, which a client could take
    for the run's end). An id the run has is followed as ever."""
    run_id = await api.submit()
    ids = [await api.event(run_id, "dispatched", {"provider": "p"}) for _ in range(events)]
    future = f"{now_ms() + 3_600_000}-0"
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": future}) as resp:
        assert resp.status == 200
        messages = await asyncio.wait_for(read_all(resp), 10)
    assert [m.event for m in messages] == ["error"] and messages[0].data["error"]["code"] == "not_found"
    validate("ErrorResponse", messages[0].data)
    where = f"its last event is {ids[0]}: resume with that Last-Event-ID" if ids else \
        "it has none yet: resume with Last-Event-ID 0"
    assert f"Last-Event-ID {future} is past the events of run {run_id}" in messages[0].data["error"]["message"]
    assert f"; {where}, or GET /v1/runs/{run_id} for its state" in messages[0].data["error"]["message"]
    if ids:
        async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": ids[0]}) as resp:
            later = await api.event(run_id, "completed", {})
            await api.end(run_id)
            assert [m.id for m in await read_all(resp)] == [later]


@pytest.mark.parametrize("last", ["0-0", "0-1", "1", "past"])
async def test_a_last_event_id_redis_has_passed_follows_a_run_with_no_event_yet(api: Api, last: str) -> None:
    """Before a run's first event, an id from Redis's past comes before all it will write: the
    stream follows it (a hostile caller's audit: `0-0` ended it at once, empty, and a client
    resuming from it never saw the run's end)."""
    run_id = await api.submit()
    if last == "past":
        seconds, _ = await api.redis.time()
        last = f"{(seconds - 1) * 1000}-0"
    async with api.session.get(api.url(f"/v1/runs/{run_id}/events"), headers={"Last-Event-ID": last}) as resp:
        ids = [await api.event(run_id, "dispatched", {"provider": "p"}), await api.event(run_id, "completed", {})]
        await api.end(run_id)
        assert [m.id for m in await read_all(resp)] == ids


def test_an_id_of_redis_s_current_millisecond_is_not_yet_passed() -> None:
    """(a review: only the millisecond was compared, so `<now>-999999` was followed, and the run's
    first event, written in that millisecond as `<now>-0`, would come before it: never sent)"""
    from gateway.runs_api import not_yet_passed

    now = 1_700_000_000_123
    assert [not_yet_passed(i, now) for i in (f"{now}-0", f"{now}-999999", f"{now + 1}-0", str(now))] == [True] * 4
    assert [not_yet_passed(i, now) for i in ("0-0", "0", f"{now - 1}-999999", "garbage")] == [False] * 4


def stuck_soon(monkeypatch: pytest.MonkeyPatch) -> Config:
    """The config (and the gateway's constants) of a test of the stuck-run check: quiet runs looked
    at every 50 ms, ended as soon as they are past their queue timeout (200 ms)."""
    monkeypatch.setattr("gateway.events.QUIET_CHECK_S", 0.05)
    monkeypatch.setattr("gateway.runs.STUCK_GRACE_MS", 0)
    return parse_config({**make_config().model_dump(mode="json", exclude_unset=True),
                         "runtime": {"scheduler_liveness_ms": 50}})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_no_scheduler_takes_ends_with_queue_timeout_from_the_gateway(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """No scheduler runs (or none has the model in its config): the run would wait out its
    caller's follow deadline (minutes). Well past its queue timeout the gateway ends it itself,
    saying why, and takes it out of the queue."""
    config = stuck_soon(monkeypatch)
    async with api_for(config, redis_url) as api:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        async with api.session.post(api.url("/v1/chat/completions"), json=body) as resp:
            assert resp.status == 504
            error = await resp.json()
            run_id = resp.headers["X-IOP-Run-Id"]
        validate("ErrorResponse", error)
        assert error["error"]["code"] == "queue_timeout"
        assert "no scheduler took the run" in error["error"]["message"] and repr(MODEL) in error["error"]["message"]
        record = await api.redis.hgetall(keys.run_record(run_id))
        assert record[b"state"] == b"timed_out" and b"entry" not in record
        assert await api.redis.xlen(keys.runs_stream(MODEL)) == 0


async def test_a_run_a_live_scheduler_holds_is_left_to_it(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its queue timeout by the gateway's config, a run that a live scheduler replica holds
    (its config may give it longer) is that replica's to end; once the replica is gone, the
    gateway ends it (found by a review: a gateway with a shorter timeout ended a live scheduler's runs)."""
    config = stuck_soon(monkeypatch)
    checks: list[list[str]] = []
    unheld = RunClient._unheld

    async def counted(self: RunClient, model_id: str, waiting: list[tuple[str, str]]) -> list[str]:
        found = await unheld(self, model_id, waiting)
        checks.append(found)
        return found

    monkeypatch.setattr(RunClient, "_unheld", counted)
    async with api_for(config, redis_url) as api:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        call = asyncio.create_task(api.session.post(api.url("/v1/chat/completions"), json=body))
        stream = keys.runs_stream(MODEL)
        await async_wait_until(lambda: api.redis.xlen(stream), what="the run queued")
        await api.redis.xgroup_create(stream, keys.SCHEDULER_GROUP, id="0", mkstream=True)
        await api.redis.xreadgroup(keys.SCHEDULER_GROUP, "replica-1", {stream: ">"})  # a replica holds it
        await api.redis.set(keys.scheduler_alive("replica-1"), 1)
        await async_wait_until(lambda: asyncio.sleep(0, len(checks) >= 3), what="three stuck checks")
        assert checks[:3] == [[], [], []] and not call.done()
        assert await api.redis.xlen(stream) == 1
        await api.redis.delete(keys.scheduler_alive("replica-1"))  # the replica died
        async with await asyncio.wait_for(call, 15) as resp:
            assert resp.status == 504 and (await resp.json())["error"]["code"] == "queue_timeout"
