"""The gateway's cancels that Redis could not take (`gateway.take_back`): kept, one task for all of
them, sent once Redis answers; bounded in number and in time. Real Redis, paused with SIGSTOP."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import pytest
import redis as sync_redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.redisconn import connect
from common.redisline import may_have_run
from gateway import metrics, take_back
from gateway.runs import LEFT, RunClient
from iop.embedded_redis import RedisServer, free_port
from tests.conftest import async_wait_until, paused
from tests.test_scheduler import MODEL, beat, make_config, request, submit


def _evalsha_calls(url: str) -> int:
    with sync_redis.Redis.from_url(url) as r:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_callers_leaving_while_redis_is_paused_are_cancelled_together_once_it_answers(
        own_redis: RedisServer) -> None:
    """Each caller's cancel was a task of its own, trying again every second or two: a paused Redis
    got one call a caller a try, and ran them all when it resumed. Now one task keeps them, PINGs
    while Redis is away, and sends them together once it answers."""
    config = make_config({"a": 1})
    client = RunClient(connect(own_redis.url + "?socket_timeout=0.5"), config)
    await beat(client.redis, config)
    run_ids = await submit(client, 40)  # (queued: no scheduler runs)
    pings = 0
    ping = client.take_back.redis.ping

    async def counted_ping() -> Any:
        nonlocal pings
        pings += 1
        return await ping()

    client.take_back.redis.ping = counted_ping
    before = _evalsha_calls(own_redis.url)
    try:
        with paused(own_redis):
            await asyncio.gather(*(client.leave(run_id, MODEL) for run_id in run_ids))
            assert len(client.take_back) == 40 and not client._leaving  # (kept: no task of their own)
            await async_wait_until(lambda: asyncio.sleep(0, pings >= 3), what="three tries while Redis is away")
            assert len(client.take_back) == 40
        await async_wait_until(lambda: asyncio.sleep(0, len(client.take_back) == 0), what="all cancels sent")
        states = await asyncio.gather(*(client.redis.hget(keys.run_record(r), "state") for r in run_ids))
        assert states == [b"cancelled"] * 40
        assert await client.redis.xlen(keys.runs_stream(MODEL)) == 0
        assert await client.redis.hget(keys.run_record(run_ids[0]), "error_message") == LEFT.encode()
        # each cancel reached Redis twice at most: its first try (a paused Redis runs what it had
        # received) and the batch; not once more for every try made while Redis was away
        assert _evalsha_calls(own_redis.url) - before <= 2 * 40
    finally:
        await client.close()
        await client.redis.aclose()


async def test_the_cancels_kept_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(take_back, "MAX_KEPT", 3)
    client = RunClient(connect(f"redis://127.0.0.1:{free_port()}/0"), make_config({"a": 1}))  # (nothing listens)
    try:
        with caplog.at_level(logging.WARNING, "iop.gateway"):
            for i in range(5):
                client._cancel_later(f"run_{i}", MODEL, LEFT)
            client._cancel_later("run_0", MODEL, LEFT)  # (kept already: not counted twice)
        assert list(client.take_back.kept) == ["run_0", "run_1", "run_2"]
        metrics.TAKE_BACK.source = lambda: client.take_back  # (what /metrics says)
        assert metrics.REGISTRY.get_sample_value("iop_gateway_cancels_waiting") == 3
        assert metrics.REGISTRY.get_sample_value("iop_gateway_cancels_abandoned_total", {"reason": "full"}) == 2
        full = [r.getMessage() for r in caplog.records if "the most the gateway keeps" in r.getMessage()]
        assert full == ["3 cancels wait for Redis already, the most the gateway keeps: runs whose caller left while "
                        "Redis could not take their cancel may go on"]  # (once, not once a run)
    finally:
        await client.close()
        await client.redis.aclose()


async def test_a_redis_that_refuses_for_a_while_does_not_end_the_take_back(redis_url: str) -> None:
    """Found by a review: a Redis whose snapshot failed (MISCONF) refuses even PING with an error
    reply, which is no outage to redis-py: the one take-back task died of it, and the cancels it
    kept were never sent (the run queued for a caller who had heard 503)."""
    config = make_config({"a": 1})
    client = RunClient(connect(redis_url), config)
    await beat(client.redis, config)
    [run_id] = await submit(client, 1)
    ping = client.take_back.redis.ping
    refusals = 0

    async def refusing_ping() -> Any:
        nonlocal refusals
        if refusals < 3:
            refusals += 1
            raise ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
                                "persist to disk")
        return await ping()

    client.take_back.redis.ping = refusing_ping
    try:
        client._cancel_later(run_id, MODEL, LEFT)
        await async_wait_until(lambda: asyncio.sleep(0, len(client.take_back) == 0), what="the cancel sent")
        assert refusals == 3
        assert await client.redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    finally:
        await client.close()
        await client.redis.aclose()


async def test_no_take_back_starts_once_the_gateway_s_client_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    """Found by a review: a caller's leaving that failed after `close` started a task nothing would
    stop (it tried until the run's follow deadline)."""
    client = RunClient(connect(f"redis://127.0.0.1:{free_port()}/0"), make_config({"a": 1}))  # (nothing listens)
    await client.close()
    with caplog.at_level(logging.WARNING, "iop.gateway"):
        await client.leave("run_late", MODEL)
    assert client.take_back.task is None and not client.take_back
    assert [r.getMessage() for r in caplog.records][-1] == "could not cancel: the gateway stops"
    await client.redis.aclose()


async def test_a_queueing_whose_connection_broke_once_sent_is_taken_back_one_never_sent_is_not(
        own_redis: RedisServer) -> None:
    """A Redis that went down with the queueing in hand may have run it (kept with AOF): the run
    would go on for a caller who heard 503. One that refused the connection got nothing."""
    config = make_config({"a": 1})
    model = config.model(MODEL)
    assert model is not None
    refused = RunClient(connect(f"redis://127.0.0.1:{free_port()}/0"), config)
    with pytest.raises(RedisConnectionError) as err:
        await refused.submit(model, request(), run_id="run_never_sent")
    assert not may_have_run(err.value) and not refused.take_back
    await refused.close()
    await refused.redis.aclose()

    client = RunClient(connect(own_redis.url + "?socket_timeout=30"), config)
    try:
        await beat(client.redis, config)
        assert own_redis.proc is not None
        own_redis.proc.send_signal(signal.SIGSTOP)  # (it takes the queueing in, and runs nothing yet)
        submitting = asyncio.ensure_future(client.submit(model, request(), run_id="run_sent"))
        line = client.scripts.line
        assert line is not None
        await async_wait_until(lambda: asyncio.sleep(0, line._link is not None and bool(line._link.waiting)
                                                     and not line._link.out), what="the queueing written")
        own_redis.stop(kill=True)  # (Redis goes down with it in hand: no new connection can be made)
        with pytest.raises(RedisConnectionError) as err:
            await submitting
        assert may_have_run(err.value) and list(client.take_back.kept) == ["run_sent"]
    finally:
        await client.close()
        await client.redis.aclose()



async def test_a_queueing_whose_connection_was_not_made_in_time_is_not_taken_back() -> None:
    """Found by a review: a connection whose handshake (`CLIENT SETNAME`) timed out sent nothing, yet
    every timeout was taken for a queueing that may have run: each request of a Redis pause kept a
    cancel (and left a cancelled record when Redis came back)."""
    got = bytearray()
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:  # (accepts, answers nothing)
        writers.append(writer)
        while data := await reader.read(65536):
            got.extend(data)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    config = make_config({"a": 1})
    model = config.model(MODEL)
    assert model is not None
    url = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0?socket_timeout=0.3"
    client = RunClient(connect(url, client_name="iop-gateway"), config)
    try:
        with pytest.raises(RedisTimeoutError) as err:
            await client.submit(model, request(), run_id="run_never_sent")
        assert b"SETNAME" in got and b"EVALSHA" not in got  # (the handshake went, the queueing did not)
        assert not may_have_run(err.value) and not client.take_back.kept
    finally:
        await client.close()
        await client.redis.aclose()
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
