"""A scheduler replica whose memory and Redis disagree after a failover lost the newest writes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from redis.asyncio import Redis

from common import keys
from gateway.runs import RunClient
from scheduler.core import Scheduler
from tests.test_scheduler import beat, leases, make_config, submit, waiting_runs


async def test_a_run_whose_dispatch_was_lost_is_adopted_again_instead_of_holding_up_its_model(redis: Redis) -> None:
    config = make_config({"a": 1})
    _, sched, run_ids = await waiting_runs(redis, config, 2)
    # The replica dispatched the first run, but the primary that acknowledged it died before its
    # replica got the write: the new primary still has the run at the head of the stream, pending
    # for this replica, which no longer holds it.
    forgotten = sched.waiting["m:1"].pop(0)
    assert forgotten.run_id == run_ids[0]
    await sched.dispatch_all()
    assert await leases(redis, config) == {"a": 0}  # the second run may not pass the first (FIFO)

    assert await sched.adopt_forgotten() == 0  # it may be a run just read: only a mismatch seen twice counts
    assert await sched.adopt_forgotten() == 1
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("a"), 0, -1) == [run_ids[0].encode()]
    assert await redis.hget(keys.run_record(run_ids[0]), "state") == b"dispatched"
    assert [w.run_id for w in sched.waiting["m:1"]] == [run_ids[1]]
    assert await sched.adopt_forgotten() == 0  # what it holds is what Redis holds for it


async def test_a_forgotten_run_is_adopted_though_a_run_the_failover_lost_makes_the_counts_agree(
        redis: Redis) -> None:
    """In the same second a failover lost a dispatch (the run is back at the head, pending for this
    replica) and the queueing of a run this replica had read (it holds a run Redis has not): the
    counts agreed, nothing was adopted, and the model's queue stood still until its runs timed out
    (20 s in a failover test)."""
    config = make_config({"a": 1})
    _, sched, run_ids = await waiting_runs(redis, config, 3)
    forgotten = sched.waiting["m:1"].pop(0)
    assert forgotten.run_id == run_ids[0]
    last = sched.waiting["m:1"][-1]
    sched.waiting["m:1"].append(replace(last, sort_key=(last.sort_key[0] + 1, 0), run_id="run_lost",
                                        entry_id=f"{last.sort_key[0] + 1}-0"))
    for _ in range(3):
        await sched.dispatch_all()
        assert await leases(redis, config) == {"a": 0}  # the second run may not pass the first (FIFO)
        if await sched.adopt_forgotten():
            break
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("a"), 0, -1) == [run_ids[0].encode()]


async def test_a_run_kept_back_once_and_then_waiting_for_a_slot_costs_no_read_of_what_is_pending(
        redis: Redis) -> None:
    """Two replicas, no failover: a run kept back once by the other's older run, then first in line
    waiting for a slot, made every maintenance look read all that was pending for its replica
    (`XREADGROUP … 0`; found by a review: 271 ms of the event loop a look with 3,000 waiting)."""
    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    a, b = Scheduler(redis, config, consumer="A"), Scheduler(redis, config, consumer="B")
    await a.ensure_groups()
    [older] = await submit(client, 1)
    await b.read_new(block_ms=10)  # B holds the older run
    await submit(client, 1)
    await a.read_new(block_ms=10)  # A the newer
    await a.dispatch_all()  # a free slot, but B's run is at the head: not_head
    await b.dispatch_all()  # B's run takes the only slot
    assert await redis.zrange(keys.leases("a"), 0, -1) == [older.encode()]
    a.on_signal(b"m:1")  # A is woken, finds no slot, and waits: first in line now
    await a.dispatch_all()
    reads = 0
    read = redis.xreadgroup

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += "0" in args[2].values()
        return await read(*args, **kwargs)

    redis.xreadgroup = counted
    for _ in range(4):
        assert await a.adopt_forgotten() == 0
    assert reads == 0
