"""Ordering races, each forced deterministically: an await point of one task is held on an
asyncio.Event while another task does what it does in production meanwhile, against a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

import scheduler.core
from common import keys
from common.snapshots import read_snapshots
from gateway.runs import RunClient
from scheduler.core import Scheduler
from tests.test_scheduler import MODEL, beat, make_config, request, submit


async def test_a_run_taken_over_while_the_head_is_dropped_is_not_dropped_in_its_place(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher decided to fail the head it looked at (b, the one provider that would take it,
    is down) while the maintenance task took over a dead replica's older run, which went to the
    front of the queue during the dispatcher's read of the snapshots: the head it looked at fails,
    not the run taken over (which a, available, serves). `queue.pop(0)` after the await failed the
    run taken over, with the other run's error."""
    config = make_config({"a": 1, "b": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    older = (await submit(client, 1))[0]  # any provider takes it
    dead, me = Scheduler(redis, config, consumer="dead"), Scheduler(redis, config, consumer="me")
    await me.ensure_groups()
    assert await dead.read_new(block_ms=10) == 1  # the older run is held by a replica that then dies
    head, _ = await client.submit(model, request(), refuse=("a",))
    await me.heartbeat()
    assert await me.read_new(block_ms=10) == 1
    await redis.hset(keys.heartbeat("b"), "health", "unavailable")  # the head's one taker is down

    held, go = asyncio.Event(), asyncio.Event()
    read = read_snapshots

    async def slow_read(*args: Any, **kwargs: Any) -> Any:
        snaps = await read(*args, **kwargs)
        held.set()
        await go.wait()  # (the maintenance task's turn comes while the read is out)
        return snaps

    monkeypatch.setattr(scheduler.core, "read_snapshots", slow_read)
    dispatching = asyncio.create_task(me.dispatch_model(model))
    await held.wait()
    monkeypatch.setattr(scheduler.core, "read_snapshots", read)
    assert await me.take_over_dead() == 1  # (the dead replica's liveness key never existed)
    assert [w.run_id for w in me.waiting[MODEL]] == [older, head]
    go.set()
    await dispatching
    await client.close()
    assert await redis.hget(keys.run_record(head), "error_code") == b"no_available_provider"
    assert await redis.hmget(keys.run_record(older), "state", "provider") == [b"dispatched", b"a"]
