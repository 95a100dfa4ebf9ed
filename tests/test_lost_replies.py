"""A reply lost on the way back: the command ran, the connection dropped before its answer
arrived, and redis-py (every service's client retries a dropped command, `client_options`) or
the worker's own retry loop sends it again. The scripts whose second run would do harm make
the same call once: a run is queued once, an output event is added once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.codec import pack
from common.redisconn import connect
from common.scripts import Scripts


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    """A client as the services make it (with their retry of a dropped command)."""
    r = connect(redis_url)
    await r.flushdb()
    yield r
    await r.aclose()


@contextmanager
def next_reply_lost() -> Iterator[list[Any]]:
    """The next reply read on any connection is read, then lost: the connection drops as it
    arrives. Yields the replies lost so (one, once it happened)."""
    lost: list[Any] = []
    original = AbstractConnection.read_response

    async def read_response(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        reply = await original(self, *args, **kwargs)
        if not lost:
            lost.append(reply)
            await self.disconnect()
            raise RedisConnectionError("the connection dropped as the reply arrived")
        return reply

    AbstractConnection.read_response = read_response
    try:
        yield lost
    finally:
        AbstractConnection.read_response = original


async def enqueue(scripts: Scripts, run_id: str) -> list[bytes]:
    result: list[bytes] = await scripts.call(
        "enqueue",
        [keys.runs_stream("m"), keys.run_record(run_id), keys.key_in_flight("k"), keys.key_requests("k"),
         keys.heartbeat("p")],
        [run_id, 64, 600, "m", "chat", "0", pack({"model": "m"}), "k", 1, 0, 60_000, 3, "gw"])
    return result


async def test_a_run_whose_enqueue_reply_was_lost_is_queued_once_and_not_refused_by_its_own_limit(
        client: Redis) -> None:
    await client.hset(keys.heartbeat("p"), "health", "available")
    scripts = Scripts(client)
    await scripts.load()
    with next_reply_lost() as lost:
        answer = await enqueue(scripts, "run_a")
    assert lost and lost[0][0] == b"ok"  # the first call queued it; its answer was lost
    # the answer of the call made again: queued (under the first call's entry), not refused by
    # the key's max_in_flight of 1, which the run itself now fills
    assert answer[0] == b"ok" and answer[1] == lost[0][1]
    assert await client.xlen(keys.runs_stream("m")) == 1
    assert await client.zcard(keys.key_in_flight("k")) == 1
    assert (await enqueue(scripts, "run_b"))[0] == b"key_in_flight"  # the limit holds for another run


async def test_an_output_event_whose_emit_reply_was_lost_is_added_once(client: Redis) -> None:
    record, events = keys.run_record("run_e"), keys.run_events("run_e")
    await client.hset(record, mapping={"state": "running", "attempts": "2", "watchers": f"gw{keys.OUTPUT_ONLY}"})
    scripts = Scripts(client)
    await scripts.load()

    async def emit(n: int, data: str, attempt: str = "2") -> Any:
        return await scripts.call("emit", [record, events], [attempt, "delta", pack({"t": data}), 1000, "run_e", n])

    assert await emit(1, "a") == 1
    with next_reply_lost() as lost:
        assert await emit(2, "b") == 1
    assert lost == [1]
    assert await emit(3, "b") == 1  # the same output again, as a new emit: added
    assert [f[b"data"] for _, f in await client.xrange(events)] == [pack({"t": x}) for x in "abb"]
    assert await client.xlen(keys.gateway_inbox("gw")) == 3
    assert await client.hget(record, "output") == b"1"
    # the numbers are the attempt's own: another attempt's first emit is not taken for a repeat
    await client.hset(record, "attempts", "3")
    assert await emit(1, "c", attempt="3") == 1
    assert await client.xlen(events) == 4
