"""The scheduler and the Lua scripts against a real Redis (no workers, no HTTP)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.codec import pack, unpack
from common.config import Config, ModelConfig, parse_config
from common.policy import candidate_class, select_provider, why_not
from common.redisconn import now_ms
from common.scripts import Scripts
from common.snapshots import read_snapshots
from common.wire import ErrorCode, ErrorInfo, RunKind
from gateway.errors import ApiError
from gateway.requests import ParsedRequest
from gateway.runs import RunClient
from scheduler.core import SCAN_AGAIN_MS, Outcome, Scheduler, Waiting, run_scheduler
from tests.conftest import async_wait_until, redis_full
from tests.test_script_batch import counting

MODEL = "m:1"


def make_config(capacities: dict[str, int], queue: dict[str, int] | None = None,
                runtime: dict[str, int] | None = None) -> Config:
    return parse_config({
        "models": [{"id": MODEL, "providers": {p: f"{p}-name" for p in capacities}}],
        "nodes": [{"id": f"n-{p}", "providers": [{"id": p, "type": "vllm", "base_url": "http://127.0.0.1:9",
                                                  "capacity": c, "models": [f"{p}-name"]}]}
                  for p, c in capacities.items()],
        "queue": queue or {"max_queue": 1000, "queue_timeout_ms": 60_000},
        "runtime": runtime or {},
    })


async def beat(redis: Redis, config: Config, health: str = "available") -> None:
    for node in config.nodes:
        for p in node.providers:
            await redis.hset(keys.heartbeat(p.id), mapping={
                "health": health, "capacity": p.capacity, "ts_ms": now_ms()})
            await redis.pexpire(keys.heartbeat(p.id), 60_000)


def request() -> ParsedRequest:
    return ParsedRequest(RunKind.CHAT, MODEL, False, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})


async def submit(client: RunClient, n: int) -> list[str]:
    model = client.config.model(MODEL)
    assert model is not None
    return [(await client.submit(model, request()))[0] for _ in range(n)]


async def waiting_runs(redis: Redis, config: Config, n: int) -> tuple[RunClient, Scheduler, list[str]]:
    """n runs queued, and read by a fresh scheduler replica; every provider beats as available."""
    await beat(redis, config)
    client = RunClient(redis, config)
    run_ids = await submit(client, n)
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    return client, sched, run_ids


async def leases(redis: Redis, config: Config) -> dict[str, int]:
    return {p.id: await redis.zcard(keys.leases(p.id)) for n in config.nodes for p in n.providers}


async def test_dispatch_follows_fifo_and_rewrites_the_target(redis: Redis) -> None:
    config = make_config({"a": 1})
    client, sched, run_ids = await waiting_runs(redis, config, 3)
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("a"), 0, -1) == [run_ids[0].encode()]
    assert await redis.xlen(keys.runs_stream(MODEL)) == 2
    record = await redis.hgetall(keys.run_record(run_ids[0]))
    assert record[b"state"] == b"dispatched"
    assert record[b"target"] == b"a-name" and record[b"provider"] == b"a" and record[b"node"] == b"n-a"
    assert await redis.zrange(keys.node_queue("n-a"), 0, -1) == [run_ids[0].encode()]  # the job is the run id
    assert not await redis.exists(f"arq:job:{run_ids[0]}")  # no arq payload: the worker reads the run record
    assert await redis.zrange(keys.node_queue("n-a"), 0, -1) == [run_ids[0].encode()]
    events = await redis.xrange(keys.run_events(run_ids[0]))
    assert [e[1][b"type"] for e in events] == [b"dispatched"]
    assert unpack(events[0][1][b"data"]) == {"provider": "a", "node": "n-a", "target": "a-name"}

    # Free the slot the way a worker does; the next run in order goes.
    await redis.zrem(keys.leases("a"), run_ids[0])
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("a"), 0, -1) == [run_ids[1].encode()]


async def test_two_schedulers_never_exceed_capacity(redis: Redis) -> None:
    config = make_config({"a": 1, "b": 2, "c": 3})
    await beat(redis, config)
    client = RunClient(redis, config)
    await submit(client, 120)
    replicas = [Scheduler(redis, config, consumer=f"s{i}") for i in range(2)]
    await replicas[0].ensure_groups()
    # Interleave the two replicas' reads so each owns part of the queue.
    for _ in range(6):
        for s in replicas:
            await s.read_new(block_ms=1, count=10)
    assert [len(s.waiting[MODEL]) for s in replicas] == [60, 60]
    await asyncio.gather(*(s.dispatch_all() for s in replicas for _ in range(5)))
    assert await leases(redis, config) == {"a": 1, "b": 2, "c": 3}
    queued = sum([await redis.zcard(keys.node_queue(f"n-{p}")) for p in "abc"])
    assert queued == 6
    assert await redis.xlen(keys.runs_stream(MODEL)) == 114


async def test_least_loaded_provider_wins(redis: Redis) -> None:
    config = make_config({"a": 3, "b": 3})
    await beat(redis, config)
    now = now_ms()
    await redis.zadd(keys.leases("a"), {"x1": now + 60_000})
    await redis.zadd(keys.leases("b"), {"y1": now + 60_000, "y2": now + 60_000})
    client = RunClient(redis, config)
    run_ids = await submit(client, 1)
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_ids[0]), "provider") == b"a"


async def test_overflow_is_exact_under_a_concurrent_burst(redis: Redis) -> None:
    config = make_config({"a": 1}, queue={"max_queue": 7, "queue_timeout_ms": 60_000})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None

    async def one() -> str:
        try:
            await client.submit(model, request())
            return "ok"
        except ApiError as exc:
            assert exc.status == 429 and exc.headers.get("Retry-After")
            return exc.code.value

    results = await asyncio.gather(*(one() for _ in range(60)))
    # 7 waiting, and 1 more that the free slot takes at once
    assert results.count("ok") == 8 and results.count("queue_full") == 52
    assert await redis.xlen(keys.runs_stream(MODEL)) == 8


async def queued(client: RunClient, model: ModelConfig) -> bool:
    """Whether a run of `model` is queued (else it must be a 429 queue_full)."""
    try:
        await client.submit(model, request())
        return True
    except ApiError as exc:
        assert exc.code.value == "queue_full"
        return False


async def accepted(client: RunClient, n: int) -> int:
    """How many of n runs submitted at once are queued (the others must be 429 queue_full)."""
    model = client.config.model(MODEL)
    assert model is not None
    return sum(await asyncio.gather(*(queued(client, model) for _ in range(n))))


@pytest.mark.parametrize("max_queue", [0, 2])
async def test_a_burst_fills_the_free_slots_then_the_queue(redis: Redis, max_queue: int) -> None:
    """Runs that free slots take at once are not waiting: a burst is refused only past the free
    slots plus `max_queue` (it was refused past `max_queue` with slots idle; with `max_queue: 0`
    every run was refused). Busy slots, a drained provider and a cordoned node's give no room;
    an operator's capacity override counts instead of the announced capacity."""
    config = make_config({"a": 4, "b": 3, "c": 3, "d": 2}, queue={"max_queue": max_queue, "queue_timeout_ms": 60_000})
    await beat(redis, config)
    await redis.zadd(keys.leases("a"), {"x1": now_ms() + 60_000, "x0": now_ms() - 1})  # one busy, one expired
    await redis.set(keys.drained("c"), now_ms())
    await redis.set(keys.cordoned("n-d"), now_ms())
    await redis.set(keys.capacity_override("b"), 2)
    client = RunClient(redis, config)
    free = (4 - 1) + 2  # a: 4 less its busy slot; b: its override; c drained, d cordoned
    assert await accepted(client, free + max_queue + 5) == free + max_queue
    assert await redis.xlen(keys.runs_stream(MODEL)) == free + max_queue


async def test_a_provider_s_free_slots_are_not_counted_for_two_models_at_once(redis: Redis) -> None:
    """A burst to two models that share a provider: each counted the shared provider's free slots
    as its own, so with `max_queue: 0` 3 runs waited in a queue (found by an operator's test with
    the demo pool). The runs waiting for the other models sharing a provider take its slots first."""
    config = parse_config({
        "models": [{"id": "m1", "providers": {"shared": "s", "only1": "o1"}},
                   {"id": "m2", "providers": {"shared": "s", "only2": "o2"}},
                   {"id": "m3", "providers": {"apart": "a"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "shared", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 4, "models": ["s"]},
            {"id": "only1", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 2, "models": ["o1"]},
            {"id": "only2", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 1, "models": ["o2"]},
            {"id": "apart", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 1, "models": ["a"]}]}],
        "queue": {"max_queue": 0, "queue_timeout_ms": 60_000},
    })
    await beat(redis, config)
    client = RunClient(redis, config)
    m1, m2, m3 = (config.model(m) for m in ("m1", "m2", "m3"))
    assert m1 is not None and m2 is not None and m3 is not None
    took = await asyncio.gather(*(queued(client, m) for _ in range(10) for m in (m1, m2, m3)))
    # no slot twice (it was 10 for m1 and m2); early by at most the other model's own slots
    assert 4 + 2 + 1 - 1 <= sum(took[i] for i in range(len(took)) if i % 3 != 2) <= 4 + 2 + 1
    assert sum(took[2::3]) == 1 == await redis.xlen(keys.runs_stream("m3"))  # (a model sharing nothing)
    for m in ("m1", "m2", "m3"):
        await redis.delete(keys.runs_stream(m))
    # The shared provider busy, m2's queue long: m1's own provider's free slots are still m1's.
    await redis.zadd(keys.leases("shared"), {f"x{i}": now_ms() + 60_000 for i in range(4)})
    await redis.xadd(keys.runs_stream("m2"), {"run": "w"})
    assert sum(await asyncio.gather(*(queued(client, m1) for _ in range(5)))) == 2


async def test_another_model_s_waiting_runs_take_only_the_slots_of_the_providers_it_has(redis: Redis) -> None:
    """m2 waits for B, which is full: A's free slots are m1's though m2 shares a provider with m1 (a
    review found m1 refused with A idle: every other model's waiting runs were taken from the free
    slots of every provider m1 shared with anyone)."""
    config = parse_config({
        "models": [{"id": "m1", "providers": {"A": "a", "B": "b"}},
                   {"id": "m2", "providers": {"B": "b"}, "queue": {"max_queue": 10}},
                   {"id": "m3", "providers": {"A": "a"}}],
        "nodes": [{"id": "n", "providers": [
            {"id": "A", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 2, "models": ["a"]},
            {"id": "B", "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 1, "models": ["b"]}]}],
        "queue": {"max_queue": 0, "queue_timeout_ms": 60_000},
    })
    await beat(redis, config)
    await redis.zadd(keys.leases("B"), {"x": now_ms() + 60_000})
    for i in range(5):
        await redis.xadd(keys.runs_stream("m2"), {"run": f"w{i}"})
    client = RunClient(redis, config)
    m1 = config.model("m1")
    assert m1 is not None
    await client.submit(m1, request())
    await client.submit(m1, request())
    with pytest.raises(ApiError) as err:  # A's 2 slots are taken by m1's 2 runs now
        await client.submit(m1, request())
    assert err.value.code.value == "queue_full"


async def test_a_refusal_read_after_a_provider_came_back_says_so(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """(A heartbeat that lands between the refusal and the read that explains it, as after a restart
    of Redis: the refusal said "(a: has a free slot now)", as if refused for nothing; an SRE's soak.)"""
    import gateway.runs
    from common.snapshots import why_none

    config = make_config({"a": 1})
    client = RunClient(redis, config)

    async def beat_first(*args: Any, **kwargs: Any) -> str:
        await beat(redis, config)
        return await why_none(*args, **kwargs)

    monkeypatch.setattr(gateway.runs, "why_none", beat_first)
    with pytest.raises(ApiError) as err:
        await submit(client, 1)
    assert err.value.status == 503 and err.value.code.value == "no_available_provider"
    assert err.value.message == (f"no provider of model {MODEL!r} was available when this request came "
                                 "(a: has a free slot now): one came back since; retry")
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0


async def test_no_available_provider_is_refused_at_once_saying_why(redis: Redis) -> None:
    """(Why: what each provider is now, as a run that timed out in its queue says; found by a
    hostile-provider audit: the refusal said no more than "right now".)"""
    config = make_config({"a": 1})
    client = RunClient(redis, config)
    with pytest.raises(ApiError) as err:
        await submit(client, 1)
    assert err.value.status == 503 and err.value.code.value == "no_available_provider"
    assert err.value.message == f"no provider of model {MODEL!r} is available right now (a: no heartbeat)"
    assert err.value.headers == {"Retry-After": "1"}
    await beat(redis, config, health="unavailable")
    with pytest.raises(ApiError) as err:
        await submit(client, 1)
    assert err.value.message == f"no provider of model {MODEL!r} is available right now (a: unavailable)"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    assert await redis.keys("iop:run:*") == []


async def waiting_without_a_slot(redis: Redis) -> tuple[Config, RunClient, Scheduler, str]:
    """A run that a scheduler holds, waiting: its one provider's slot is taken (60 s queue timeout)."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000})
    await beat(redis, config)
    await redis.zadd(keys.leases("a"), {"busy": now_ms() + 60_000})
    client = RunClient(redis, config)
    (run_id,) = await submit(client, 1)
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    return config, client, sched, run_id


async def test_queue_timeout_fails_the_run_and_leaves_the_queue(redis: Redis) -> None:
    _, client, sched, run_id = await waiting_without_a_slot(redis)
    assert sched.next_deadline_ms() is not None
    await sched.expire_overdue()  # not overdue yet: nothing happens
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    sched.waiting[MODEL][0].deadline_ms = now_ms() - 1  # move the clock past its deadline
    await sched.expire_overdue()
    assert await redis.hget(keys.run_record(run_id), "state") == b"timed_out"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].type == "failed" and events[-1].data["code"] == "queue_timeout"
    assert events[-1].data["message"] == \
        f"no provider of model {MODEL!r} had a free slot within 60000 ms (a: full (1 of 1))"


async def test_a_queue_timeout_names_a_drain_behind_it(redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """An operator who drained a model's only provider sees why its runs time out: the caller's
    error says so, and so does the scheduler's log line (which said only `timed_out in the queue:
    queue_timeout`, found by an operator's day with one provider drained and the other down)."""
    _, client, sched, run_id = await waiting_without_a_slot(redis)
    await redis.delete(keys.leases("a"))
    await redis.set(keys.drained("a"), "1")
    sched.waiting[MODEL][0].deadline_ms = now_ms() - 1
    with caplog.at_level(logging.INFO, "iop.scheduler"):
        await sched.expire_overdue()
    events = [e async for e in client.events(run_id)]
    await client.close()
    why = f"no provider of model {MODEL!r} had a free slot within 60000 ms (a: drained or cordoned)"
    assert events[-1].data["message"] == why
    said = [r.getMessage() for r in caplog.records if getattr(r, "run", None) == run_id]
    assert said == [f"timed_out in the queue: queue_timeout: {why}"]


async def test_a_run_read_long_after_its_queue_timeout_says_no_scheduler_was_there(redis: Redis) -> None:
    """A run a scheduler reads long after its deadline (every scheduler was down meanwhile) did not
    wait for a slot: its error says what kept it."""
    config, client, sched, run_id = await waiting_without_a_slot(redis)
    late = 2_000 + 2 * config.runtime.scheduler_liveness_ms + 500
    sched.waiting[MODEL][0].deadline_ms = now_ms() - late  # the clock moved on while no scheduler ran
    await sched.expire_overdue()
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].data["code"] == "queue_timeout"
    message = events[-1].data["message"]
    assert message.startswith("the run waited ") and "past its queue_timeout_ms (60000 ms)" in message
    assert "no scheduler was running" in message and int(message.split()[3]) >= 60_000 + late


async def test_a_dead_replicas_runs_are_taken_over_and_a_live_ones_are_not(redis: Redis) -> None:
    config = make_config({"a": 5})
    await beat(redis, config)
    client = RunClient(redis, config)
    await submit(client, 3)
    a, b = Scheduler(redis, config, consumer="a"), Scheduler(redis, config, consumer="b")
    await a.ensure_groups()
    await a.heartbeat()
    await b.heartbeat()
    assert await a.read_new(block_ms=10) == 3
    assert await b.take_over_dead() == 0  # a is alive: nothing is stolen
    await redis.delete(keys.scheduler_alive("a"))  # a died: its liveness key expired
    assert await b.take_over_dead() == 3
    await b.dispatch_all()
    assert await redis.zcard(keys.leases("a")) == 3
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0


async def test_a_replica_stays_alive_through_a_maintenance_round_longer_than_its_liveness(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's liveness beats on its own, not between maintenance sweeps: a sweep that takes
    longer than `scheduler_liveness_ms` (hundreds of models looked at one by one, under load) let the
    key lapse, and another replica took over the runs of one that was alive and dispatching them."""
    config = make_config({"a": 5}, runtime={"scheduler_liveness_ms": 1500})
    await beat(redis, config)
    client = RunClient(redis, config)
    await submit(client, 3)
    a, b = Scheduler(redis, config, consumer="a"), Scheduler(redis, config, consumer="b")
    await a.ensure_groups()
    assert await a.read_new(block_ms=10) == 3
    a.waiting[MODEL].clear()  # (a holds them pending; its dispatcher must not send them meanwhile)
    swept, release = asyncio.Event(), asyncio.Event()

    async def slow_sweep() -> int:
        swept.set()
        await release.wait()
        return 0

    beats = 0
    heartbeat = a.heartbeat

    async def counted() -> None:
        nonlocal beats
        await heartbeat()
        beats += 1

    monkeypatch.setattr(a, "take_over_dead", slow_sweep)
    monkeypatch.setattr(a, "heartbeat", counted)
    stop = asyncio.Event()
    running = asyncio.create_task(run_scheduler(a, stop))
    try:
        await async_wait_until(lambda: asyncio.sleep(0, swept.is_set()), what="the maintenance sweep to start")
        since = beats
        # (each beat renews the key for 1.5 s; four of them span more than that)
        await async_wait_until(lambda: asyncio.sleep(0, beats >= since + 4),
                               what="the replica to beat while its sweep is still going")
        assert await redis.exists(keys.scheduler_alive("a"))
        assert await b.take_over_dead() == 0  # a is alive: nothing is stolen
    finally:
        release.set()
        stop.set()
        await running
        await client.close()


async def test_a_replica_looks_at_every_model_and_provider_in_a_few_round_trips(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The looks for dead replicas and lost workers go over every model's group and every provider's
    leases each round, idle or not: in a pipeline each, not a round trip each (with 300 models and 100
    providers, 2 replicas sent 1,200 commands a second one by one, idle)."""
    n = 30
    config = parse_config({
        "models": [{"id": f"m{i}", "providers": {f"p{i}": "served"}} for i in range(n)],
        "nodes": [{"id": "n1", "providers": [{"id": f"p{i}", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["served"]} for i in range(n)]}],
    })
    await beat(redis, config)
    client = RunClient(redis, config)
    for i in range(n):
        model = config.model(f"m{i}")
        assert model is not None
        await client.submit(model, replace(request(), model=model.id, body={**request().body, "model": model.id}))
    a, b = Scheduler(redis, config, consumer="a"), Scheduler(redis, config, consumer="b")
    await a.ensure_groups()
    await a.heartbeat()
    await b.heartbeat()
    assert await a.read_new(block_ms=10) == n  # (every model's group names a)
    b._scanned = True  # (the SCAN for providers the config lacks is a task of its own, once)
    alone: list[object] = []
    execute = redis.execute_command

    async def counted(*args: Any, **kwargs: Any) -> Any:
        alone.append(args[0])
        return await execute(*args, **kwargs)

    monkeypatch.setattr(redis, "execute_command", counted)
    assert await b.take_over_dead() == 0  # a is alive
    assert await b.reap_expired_leases() == 0
    assert len(alone) <= 2, alone  # (the providers beating, and nothing else one by one)
    monkeypatch.undo()
    await redis.delete(keys.scheduler_alive("a"))  # a died
    assert await b.take_over_dead() == n
    await client.close()


async def test_expired_lease_requeues_then_fails_with_worker_lost(redis: Redis) -> None:
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 2})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)

    async def dispatch_and_expire() -> Any:
        await sched.dispatch_all()
        assert await redis.zcard(keys.leases("a")) == 1
        await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
        assert await sched.reap_expired_leases() == 1
        assert await redis.zcard(keys.leases("a")) == 0
        assert await redis.zcard(keys.node_queue("n-a")) == 0
        return await redis.hget(keys.run_record(run_id), "state")

    assert await dispatch_and_expire() == b"queued"  # attempt 1 of 2 sent nothing: tried again
    await sched.read_new(block_ms=10)
    assert await dispatch_and_expire() == b"failed"
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert [e.type for e in events] == ["dispatched", "requeued", "dispatched", "failed"]
    assert events[-1].data["code"] == "worker_lost"
    # (never started: no worker to look for a crash of; an SRE's soak read "the worker running this
    # run was lost" for runs no worker took before their leases ran out)
    why = "no worker of node n-a started this run before its lease ran out"
    assert events[-1].data["message"] == why and events[-1].data["before_output"] is True
    assert await redis.hget(keys.run_record(run_id), "error_message") == why.encode()


async def test_a_node_s_wake_list_lives_a_lease_after_its_last_id(redis: Redis) -> None:
    """An id `dispatch` pushes for the node's workers is of no use once the run's lease could have
    ended (it was started, or reaped): a node whose workers were killed, or that left the config,
    kept its ids for good (a list without a TTL)."""
    config = make_config({"a": 1})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    assert await redis.lrange(keys.node_wake("n-a"), 0, -1) == [run_id.encode()]
    assert 0 < await redis.pttl(keys.node_wake("n-a")) <= config.runtime.lease_ttl_ms
    await client.close()


async def test_a_lost_run_whose_attempts_used_up_none_is_tried_again(redis: Redis) -> None:
    """Attempts whose provider answered that it cannot do what the request asks (the record's
    `unable`, FINISH's `requeue_unable`) use up none of `max_attempts`: a run on its second attempt
    after one such, whose worker is lost, is tried again with `max_attempts: 2`."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 2})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    record = keys.run_record(run_id)
    await redis.hset(record, mapping={"attempts": 2, "unable": 1})  # (the second attempt, after one such)
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    assert await redis.hget(record, "state") == b"queued"
    await redis.hset(record, "unable", 0)  # (had both been counted: it fails)
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})
    assert await sched.reap_expired_leases() == 1
    assert await redis.hget(record, "state") == b"failed"
    await client.close()


@pytest.mark.parametrize("never", ["unable_by", "elsewhere"])
async def test_a_requeued_run_never_goes_back_to_a_provider_that_refused_it_as_unable(redis: Redis, never: str) -> None:
    """The record's `unable_by` (FINISH's `requeue_unable`) and `elsewhere` (`requeue_elsewhere`: a 5xx)
    go along with every requeue (here a lost lease's), and the scheduler's own dispatch leaves those
    providers out: tried on b and a, the run may go back to either, and the tie-break would send it to
    a, which refused it as unable, or answered it a 500; it goes to b."""
    config = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    record = keys.run_record(run_id)
    assert await redis.hget(record, "provider") == b"a"
    await redis.hset(record, mapping={"tried": "b,a", never: "a"})  # (as if b, then a, which refused it so)
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    [(_, fields)] = await redis.xrange(keys.runs_stream(MODEL))
    assert fields == {b"run": run_id.encode(), b"tried": b"b,a", never.encode(): b"a"}
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hmget(record, "state", "provider") == [b"dispatched", b"b"]
    await client.close()


@pytest.mark.parametrize("output", [True, False], ids=["after-output", "before-output"])
async def test_a_running_run_reaped_says_its_worker_was_lost(redis: Redis, output: bool) -> None:
    """Its `failed` event says `before_output` as the record says output went out: a run on its last
    attempt whose worker was lost before any output said false (a runs-API follower read that its
    caller had had output)."""
    config, client, sched, run_id, _ = await running_run(redis, output=output, cancel=False)
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].type == "failed" and events[-1].data["message"] == "the worker running this run was lost"
    assert events[-1].data["code"] == "worker_lost" and events[-1].data["before_output"] is not output


async def test_a_reaped_lease_s_warning_names_the_provider_and_node_it_was_lost_on(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """"lease expired: requeued" tells an operator a worker was lost; the line says whose (found by
    an operator's day: a worker SIGKILLed on one of two nodes left two such lines naming neither)."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    with caplog.at_level(logging.WARNING, "iop.scheduler"):
        assert await sched.reap_expired_leases() == 1
    [said] = [r for r in caplog.records if r.getMessage().startswith("lease expired")]
    assert (getattr(said, "run", None), getattr(said, "provider", None), getattr(said, "node", None)) == (
        run_id, "a", "n-a")
    await client.close()


async def running_run(redis: Redis, *, output: bool, cancel: bool) -> tuple[Config, RunClient, Scheduler, str, str]:
    """A run dispatched to a (one attempt at most) and running, with output sent and a cancel asked
    as said: (config, client, scheduler, run id, its attempt)."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 1})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    record = keys.run_record(run_id)
    await redis.hset(record, mapping={"state": "running", **({"output": "1"} if output else {}),
                                      **({"cancel": "1"} if cancel else {})})
    return config, client, sched, run_id, (await redis.hget(record, "attempts") or b"").decode()


async def counted_tokens(redis: Redis) -> list[tuple[int, int]]:
    """(prompt, completion) tokens of MODEL counted for each key, for good."""
    totals = [await redis.hgetall(k) for k in await redis.keys(keys.usage_total("") + "*")]
    return [(int(t.get(f"prompt_tokens:{MODEL}".encode(), 0)), int(t.get(f"completion_tokens:{MODEL}".encode(), 0)))
            for t in totals]


@pytest.mark.parametrize("cancelled", [False, True], ids=["lost", "lost-and-cancelled"])
async def test_a_stream_whose_worker_was_lost_after_output_counts_the_chunks_it_renewed_with(
        redis: Redis, cancelled: bool) -> None:
    """A worker SIGKILLed mid-stream: the reaper ended the run with no tokens counted, its caller
    having had 93 chunks (an SRE's soak). Each lease renewal records the chunks of output so far
    (`out_chunks`), which the reaper counts, cancelled or not."""
    config, client, sched, run_id, attempts = await running_run(redis, output=True, cancel=cancelled)
    record = keys.run_record(run_id)
    renewed = await Scripts(redis).call("renew", [keys.leases("a"), record],
                                        [run_id, config.runtime.lease_ttl_ms, attempts, 7])
    assert renewed == (2 if cancelled else 1)
    if cancelled:  # (a renewal that finds a cancel asked records nothing: the last one before it did)
        await redis.hset(record, "out_chunks", 7)
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    assert (await redis.hget(record, "state")) == (b"cancelled" if cancelled else b"failed")
    assert await counted_tokens(redis) == [(0, 7)]
    await client.close()


async def test_a_stream_whose_worker_was_lost_counts_every_chunk_it_emitted_not_a_renewal_old(redis: Redis) -> None:
    """A worker SIGKILLed a moment after its stream's first output: the reaper counted no token,
    its caller having had its chunks (no lease renewal had come since). Each emit records the
    chunks of output so far, and a renewal that carries an older count (made as an emit went
    out) does not lower it."""
    config, client, sched, run_id, attempt = await running_run(redis, output=False, cancel=False)
    record, events = keys.run_record(run_id), keys.run_events(run_id)
    scripts = Scripts(redis)
    for n, chunks in ((1, 3), (2, 5)):
        assert await scripts.call("emit", [record, events], [attempt, "delta", pack({"n": n}), 1000, run_id, n,
                                                             chunks]) == 1
    assert await scripts.call("renew", [keys.leases("a"), record],
                              [run_id, config.runtime.lease_ttl_ms, attempt, 4]) == 1
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    assert await redis.hget(record, "state") == b"failed"
    assert await counted_tokens(redis) == [(0, 5)]
    await client.close()


@pytest.mark.parametrize("output", [False, True], ids=["none-went-out", "output-went-out"])
async def test_a_run_whose_cancel_came_before_its_end_counts_only_what_its_caller_got(
        redis: Redis, output: bool) -> None:
    """Its worker ends it (here: the provider's whole answer, 40 + 200 tokens) as a cancel recorded
    before is found (`cancel_asked`): it ends cancelled, and counts what the worker counted only if
    output had gone out (its partial count); the caller of a non-stream run got no answer: none (a
    review: the whole usage was counted)."""
    config, client, sched, run_id, attempt = await running_run(redis, output=output, cancel=True)
    record = keys.run_record(run_id)
    rt = config.runtime
    args = [run_id, "completed" if not output else "failed", "completed", pack({}), rt.run_ttl_s,
            keys.scheduler_channel(""), MODEL, "", "", attempt, "ok", 0, "", 40, 200, 0, b"",
            rt.max_events_per_run, "", "", 0]
    run_keys = [record, keys.leases("a"), keys.run_events(run_id), keys.runs_stream(MODEL), keys.heartbeat("a"),
                keys.node_queue("n-a"), keys.arq_in_progress(run_id), keys.runs_stream(MODEL)]
    assert await Scripts(redis).call("finish", run_keys, args) == b"cancel_asked"
    assert (await redis.hget(record, "state")) == b"cancelled"
    assert await counted_tokens(redis) == [(40, 200) if output else (0, 0)]
    await client.close()


async def test_waiting_runs_fail_at_once_when_every_provider_reports_itself_down(redis: Redis) -> None:
    config = make_config({"a": 1, "b": 1})
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    await redis.delete(keys.heartbeat("a"))  # a is unknown: b alone being down is not enough
    await redis.hset(keys.heartbeat("b"), "health", "unavailable")
    await sched.dispatch_all()
    assert [await redis.hget(keys.run_record(r), "state") for r in run_ids] == [b"queued", b"queued"]
    await beat(redis, config, health="unavailable")
    await sched.dispatch_all()
    assert [await redis.hget(keys.run_record(r), "state") for r in run_ids] == [b"failed", b"failed"]
    events = [e async for e in client.events(run_ids[0])]
    await client.close()
    assert events[-1].data["code"] == "no_available_provider"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0


async def test_runs_failed_because_every_provider_is_benched_say_when_the_first_bench_ends(redis: Redis) -> None:
    """A bench ends at a known time, after which its provider takes runs whatever its probes say:
    runs failed because each provider is benched for the model say to try again then (Retry-After),
    not in 1 s, which only finds them benched still (it was 1 s)."""
    config = make_config({"a": 1, "b": 1})
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    now = now_ms()
    await redis.hset(keys.heartbeat("a"), keys.BENCH_FIELD + "a-name", now + 20_000)
    await redis.hset(keys.heartbeat("b"), keys.BENCH_FIELD + "b-name", now + 45_000)
    await sched.dispatch_all()
    assert [await redis.hget(keys.run_record(r), "state") for r in run_ids] == [b"failed", b"failed"]
    events = [e async for e in client.events(run_ids[0])]
    await client.close()
    assert events[-1].data["code"] == "no_available_provider"
    assert "a: benched, b: benched" in events[-1].data["message"]
    error = ApiError.from_info(ErrorInfo.from_wire(events[-1].data))
    assert error.status == 503 and 19 <= int(error.headers["Retry-After"]) <= 20


@pytest.mark.parametrize("back_in_ms", [2_000, 30_000])
async def test_runs_wait_for_a_busy_bench_only_if_it_ends_before_their_queue_timeout(redis: Redis,
                                                                                     back_in_ms: int) -> None:
    """Busy is not down: a run waits for a provider benched for its Retry-After, but not for one
    whose bench ends after the run's queue_timeout_ms: it waited all of it for nothing, then heard
    504 queue_timeout with no Retry-After (a review); it fails now, a 503 saying when to try again."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 5_000})
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    until = now_ms() + back_in_ms
    await redis.hset(keys.heartbeat("a"), mapping={"bench:a-name": until, "busy:a-name": until})
    await sched.dispatch_all()
    states = [await redis.hget(keys.run_record(r), "state") for r in run_ids]
    if back_in_ms < 5_000:
        assert states == [b"queued", b"queued"]
    else:
        assert states == [b"failed", b"failed"]
        events = [e async for e in client.events(run_ids[0])]
        error = ApiError.from_info(ErrorInfo.from_wire(events[-1].data))
        assert error.status == 503 and error.code is ErrorCode.NO_AVAILABLE_PROVIDER
        assert 29 <= int(error.headers["Retry-After"]) <= 30
    await client.close()


async def a_run_a_would_refuse(redis: Redis) -> tuple[Config, RunClient, str]:
    """A run of MODEL queued, whose adapter a would refuse (b alone would take it); a and b beat."""
    config = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    run_id, _ = await client.submit(model, request(), refuse=("a",))
    return config, client, run_id


async def test_a_run_only_a_busy_provider_would_take_waits_for_its_bench_whatever_the_others(redis: Redis) -> None:
    """b, benched 2 s for its Retry-After, is the one provider that would take the run (its adapter
    refuses it to a, an idle provider it never tried): it waits for b, as busy is not down. It
    failed at once, 503 no_available_provider, a being idle (review of 2b01360: only a provider the
    run was requeued off, taking runs again, makes it not wait)."""
    config, client, run_id = await a_run_a_would_refuse(redis)
    until = now_ms() + 2_000
    await redis.hset(keys.heartbeat("b"), mapping={"bench:b-name": until, "busy:b-name": until})
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    await redis.hdel(keys.heartbeat("b"), "bench:b-name", "busy:b-name")  # (its 2 s passed)
    await sched.dispatch_all()
    assert await redis.hmget(keys.run_record(run_id), "state", "provider") == [b"dispatched", b"b"]
    await client.close()


async def test_the_dispatch_script_picks_the_provider_on_the_live_counts_not_the_snapshot(redis: Redis) -> None:
    config = make_config({"a": 1, "b": 1})
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    model = config.model(MODEL)
    assert model is not None
    await redis.zadd(keys.leases("b"), {"elsewhere": now_ms() + 60_000})
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)  # a 0/1, b 1/1
    await redis.zadd(keys.leases("a"), {"other": now_ms() + 60_000})  # another replica got there first
    await redis.zrem(keys.leases("b"), "elsewhere")  # and a run on b ended
    # one trip, no re-read
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], snaps))[0][:2] == ("ok", "b")
    record = await redis.hgetall(keys.run_record(run_ids[0]))
    assert (record[b"provider"], record[b"node"], record[b"target"]) == (b"b", b"n-b", b"b-name")
    assert await redis.zrange(keys.node_queue("n-b"), 0, -1) == [run_ids[0].encode()]
    sched.waiting[MODEL].pop(0)
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], snaps))[0][:2] == ("stale", None)  # both full now
    assert await redis.hget(keys.run_record(run_ids[1]), "state") == b"queued"
    await client.close()


async def test_a_replica_batches_only_runs_next_in_a_row_that_it_holds(redis: Redis) -> None:
    """With several replicas their runs interleave in the stream: a replica's batch holds only the
    runs the script said are next and its own, so none of them finds another's older run ahead."""
    config = make_config({"a": 8})
    await beat(redis, config)
    client = RunClient(redis, config)
    run_ids = await submit(client, 6)
    a, b = Scheduler(redis, config), Scheduler(redis, config)
    await a.ensure_groups()
    for replica in (a, a, b, a, a, a):  # a reads runs 0 and 1, b run 2, a runs 3, 4 and 5
        assert await replica.read_new(block_ms=10, count=1) == 1
    trips_a, trips_b = counting(a.scripts), counting(b.scripts)

    async def states() -> list[str]:
        return [(await redis.hget(keys.run_record(r), "state") or b"").decode() for r in run_ids]

    await a.dispatch_all()  # run 0 alone; the script said run 1 is next and a's; then b's run 2 is the head
    assert trips_a == [1, 1] and await states() == ["dispatched"] * 2 + ["queued"] * 4
    await b.dispatch_all()
    assert trips_b == [1] and await states() == ["dispatched"] * 3 + ["queued"] * 3
    a.on_signal(MODEL.encode())  # b's dispatch woke a: its run 3 is the head now
    await a.dispatch_all()  # run 3 alone, then runs 4 and 5 together
    assert trips_a == [1, 1, 1, 2] and await states() == ["dispatched"] * 6
    assert sum(trips_a + trips_b) == 6  # not one script wasted
    await client.close()


async def test_the_runs_that_fit_go_in_one_round_trip_oldest_first(redis: Redis) -> None:
    config = make_config({"a": 2, "b": 2})
    client, sched, run_ids = await waiting_runs(redis, config, 6)
    trips = counting(sched.scripts)
    await sched.dispatch_all()
    # The first goes alone; its script says the next five in the stream are this replica's, and the
    # snapshots say three of them fit: one pipeline of three `dispatch` scripts.
    assert trips == [1, 3]
    states = [await redis.hget(keys.run_record(r), "state") for r in run_ids]
    assert states == [b"dispatched"] * 4 + [b"queued"] * 2
    assert await leases(redis, config) == {"a": 2, "b": 2}
    assert [w.run_id for w in sched.waiting[MODEL]] == run_ids[4:]
    await client.close()


async def test_in_a_batch_a_run_that_cannot_go_holds_back_the_runs_behind_it(redis: Redis) -> None:
    """FIFO within one pipeline: each script checks that its run is the oldest waiting one."""
    config = make_config({"a": 1, "b": 1})
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    model = config.model(MODEL)
    assert model is not None
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)  # room for both
    await redis.zadd(keys.leases("a"), {"other": now_ms() + 60_000})  # then both filled up elsewhere
    await redis.zadd(keys.leases("b"), {"another": now_ms() + 60_000})
    outcomes = await sched._dispatch(model, sched.waiting[MODEL][:2], snaps)
    assert [o[0] for o in outcomes] == ["stale", "not_head"]
    await redis.zrem(keys.leases("b"), "another")  # a slot for one: the second may not jump the first
    outcomes = await sched._dispatch(model, sched.waiting[MODEL][1:], snaps)
    assert [o[0] for o in outcomes] == ["not_head"]
    assert [await redis.hget(keys.run_record(r), "state") for r in run_ids] == [b"queued", b"queued"]
    await sched.dispatch_all()
    assert [await redis.hget(keys.run_record(r), "state") for r in run_ids] == [b"dispatched", b"queued"]
    await client.close()


async def test_the_dispatch_script_chooses_exactly_what_the_policy_chooses_on_the_live_state(
        redis: Redis) -> None:
    """Property: whatever changed between the snapshot and the script (runs started or ended on
    any provider, an override set or cleared, a provider drained or its node cordoned, its
    heartbeat gone stale or down or back, its capacity announced anew), the
    script reserves a slot on the provider `select_provider` chooses on the live state among the
    snapshot's candidates, or on none ('stale') when it chooses none, for runs with and without
    providers to avoid."""
    providers = ["a", "b", "c", "d"]
    config = make_config({p: 4 for p in providers})
    model = config.model(MODEL)
    assert model is not None
    client = RunClient(redis, config)
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    rng = random.Random(7)
    ttl = config.runtime.heartbeat_ttl_ms
    outcomes: Counter[str] = Counter()
    changed = 0

    async def set_leases(p: str, n: int) -> None:
        await redis.delete(keys.leases(p))
        if n:
            await redis.zadd(keys.leases(p), {f"x-{p}-{i}": now_ms() + 60_000 for i in range(n)})

    async def set_flag(key: str, on: bool) -> None:
        await (redis.set(key, "ops") if on else redis.delete(key))

    async def set_override(p: str, value: int | str | None) -> None:
        await (redis.delete(keys.capacity_override(p)) if value is None
               else redis.set(keys.capacity_override(p), value))

    async def draw(p: str) -> None:
        """A provider's whole state, drawn afresh (mostly able to take a run)."""
        capacity = rng.randint(1, 6)
        await redis.hset(keys.heartbeat(p), mapping={
            "health": "available" if rng.random() < 0.85 else "unavailable", "capacity": capacity,
            "ts_ms": now_ms() if rng.random() < 0.9 else now_ms() - ttl - 1000})
        await set_leases(p, rng.randint(0, capacity))
        await set_flag(keys.drained(p), rng.random() < 0.1)
        await set_flag(keys.cordoned(f"n-{p}"), rng.random() < 0.05)
        # (and overrides written by hand that `iop provider capacity` refuses: none, for every reader)
        await set_override(p, rng.choice([None, None, None, 1, 2, 5, "1.5", "0", "-1", " 2", "02", "0x3", "1e1", "+2"]))

    async def change(p: str) -> None:
        """One thing about a provider changes after the snapshot."""
        what = rng.randrange(9)
        if what < 3:  # runs ended or started there
            await set_leases(p, max(0, await redis.zcard(keys.leases(p)) + rng.choice([-2, -1, 1, 2])))
        elif what == 3:
            await redis.hset(keys.heartbeat(p), "health", rng.choice(["available", "unavailable"]))
        elif what == 4:  # its heartbeat went stale, or a new one came
            await redis.hset(keys.heartbeat(p), "ts_ms", rng.choice([now_ms() - ttl - 1000, now_ms()]))
        elif what == 5:
            await redis.hset(keys.heartbeat(p), "capacity", rng.randint(1, 6))
        elif what == 6:
            await set_flag(keys.drained(p), rng.random() < 0.5)
        elif what == 7:
            await set_flag(keys.cordoned(f"n-{p}"), rng.random() < 0.5)
        else:
            await set_override(p, rng.choice([None, 1, 2, 3, "2.5", "0"]))

    for _ in range(600):
        if not sched.waiting[MODEL]:
            await beat(redis, config)  # the gateway takes a run only while some provider is available
            await submit(client, 1)
            await sched.read_new(block_ms=10)
        for p in providers:
            await draw(p)
        now = now_ms()
        snaps = await read_snapshots(redis, sched._targets[MODEL], now, config.node_of)
        head = replace(sched.waiting[MODEL][0], avoid=frozenset(rng.sample(providers, rng.randint(0, 2))))
        choice = select_provider(snaps, now, ttl, head.avoid)
        if choice is None:
            continue
        for p in providers:
            if rng.random() < 0.4:
                await change(p)
        # the candidates are those of the snapshot (one drained then and not now waits for a re-read)
        was = {s.provider_id for s in snaps if candidate_class(s, now, ttl, head.avoid) is not None}
        live = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
        expected = select_provider([s for s in live if s.provider_id in was], now_ms(), ttl, head.avoid)
        outcome = (await sched._dispatch(model, [head], snaps))[0][:2]
        assert outcome == (("ok", expected.provider_id) if expected else ("stale", None)), (snaps, live, head.avoid)
        outcomes[outcome[0]] += 1
        if outcome[0] == "ok":
            sched.waiting[MODEL].pop(0)
            await redis.zrem(keys.leases(outcome[1] or ""), head.run_id)
            changed += expected is not None and expected.provider_id != choice.provider_id
    await client.close()
    # both answers were exercised, and the script often picked another provider than the snapshot would
    assert outcomes["ok"] > 200 and outcomes["stale"] > 20 and changed > 50, (outcomes, changed)


async def test_snapshots_are_kept_to_try_but_read_again_before_a_run_waits(redis: Redis) -> None:
    config = make_config({"a": 2})
    client, sched, (first,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(first), "provider") == b"a"

    async def next_run() -> str:
        (run_id,) = await submit(client, 1)
        await sched.read_new(block_ms=10)
        await redis.config_resetstat()
        await sched.dispatch_all()
        return run_id

    def snapshot_reads(stats: dict[str, Any]) -> int:
        """A snapshot read is one HMGET of a's heartbeat; the dispatch script (the only script sent
        here) runs two HMGETs (the run's record, a's heartbeat), and Redis counts the commands
        scripts run."""
        def calls(name: str) -> int:
            return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        return calls("hmget") - 2 * calls("evalsha")

    second = await next_run()  # the kept snapshot (a 1/2) says try: no read, one script
    assert await redis.hget(keys.run_record(second), "state") == b"dispatched"
    assert snapshot_reads(await redis.info("commandstats")) == 0
    await redis.zrem(keys.leases("a"), first)  # a run ended: the kept snapshot (a 2/2) is too high
    third = await next_run()
    assert await redis.hget(keys.run_record(third), "state") == b"dispatched"  # it looked again, not waited
    assert snapshot_reads(await redis.info("commandstats")) == 1
    sched.on_signal(b"*")  # a health or an operator's setting changed: nothing kept
    assert not sched._snaps
    await client.close()


def test_a_replica_wakes_only_for_signals_that_could_unblock_it() -> None:
    config = make_config({"a": 1})
    sched = Scheduler(Redis(), config)  # no command is sent
    sched.on_signal(MODEL.encode())
    assert not sched.kick.is_set()  # it holds no run of that model
    sched.waiting[MODEL].append(Waiting((1, 0), "run_x", "1-0", 0))
    sched.on_signal(b"other-model")
    assert not sched.kick.is_set()
    sched.on_signal(MODEL.encode())
    assert sched.kick.is_set()
    sched.kick.clear()
    sched.waiting[MODEL].clear()
    sched.on_signal(b"*")  # a provider's health changed
    assert sched.kick.is_set()


async def test_a_caller_that_leaves_while_its_run_is_queued_takes_the_run_back(redis: Redis) -> None:
    """Its `enqueue` may already be on its way (or done) when it leaves: once the run is queued,
    it is cancelled and out of the queue, never left to run for no one."""
    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    submitting = asyncio.create_task(client.submit(model, request(), run_id="run_gone"))
    await asyncio.sleep(0)  # its enqueue joined this turn's batch
    submitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await submitting

    async def taken_back() -> bool:
        return bool(await redis.hget(keys.run_record("run_gone"), "state") == b"cancelled")

    await async_wait_until(taken_back, what="the run to be cancelled")
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    await client.close()


async def test_a_new_run_is_dispatched_before_the_replica_reads_its_stream_again(redis: Redis) -> None:
    """The next blocking read is not on a new run's way: the dispatch goes out first (once the
    replica holds the providers' snapshots, as it does between runs)."""
    config = make_config({"a": 2})
    await beat(redis, config)
    sched = Scheduler(redis, config)
    sent: list[object] = []
    xreadgroup, call_many = redis.xreadgroup, sched.scripts.call_many

    async def reading(*args: Any, **kwargs: Any) -> Any:
        sent.append("read")
        reply = await xreadgroup(*args, **kwargs)
        sent.append(("got", sum(len(entries) for _, entries in reply or ())))
        return reply

    async def dispatching(name: str, calls: Any) -> list[Any]:
        sent.append(name)
        return await call_many(name, calls)

    redis.xreadgroup = reading
    sched.scripts.call_many = dispatching  # type: ignore[method-assign]
    stop = asyncio.Event()
    running = asyncio.create_task(run_scheduler(sched, stop))
    client = RunClient(redis, config)
    try:
        await async_wait_until(lambda: asyncio.sleep(0, "read" in sent), what="the replica to read its stream")
        for n in (1, 2):
            await submit(client, 1)
            await async_wait_until(lambda n=n: asyncio.sleep(0, sent.count("dispatch") == n),  # type: ignore[misc]
                                   what="the dispatch")
        second = len(sent) - 1 - sent[::-1].index("dispatch")
        assert sent[second - 1] == ("got", 1)
    finally:
        stop.set()
        await running
        del redis.xreadgroup
        await client.close()


@pytest.mark.parametrize("wake", [MODEL.encode(), b"*"], ids=["model", "all"])
async def test_a_wake_that_comes_while_a_dispatch_is_out_is_not_lost(
        redis: Redis, wake: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica ahead dispatched its run (or an operator freed a slot) and woke this one while
    this one's own `dispatch` was out, which then said `not_head`: the model must not be left
    `behind` (it waited for the 1 s safety tick: runs went ~0.9 s late after an undrain with two
    replicas). Without a wake meanwhile, `not_head` leaves it behind, as before."""
    config = make_config({"a": 1})
    _, sched, _ = await waiting_runs(redis, config, 1)
    model = config.model(MODEL)
    assert model is not None

    async def not_head(woken: bool) -> None:
        async def answer(_: Any, batch: list[Waiting], __: Any) -> list[Outcome]:
            if woken:
                sched.on_signal(wake)
            return [Outcome("not_head") for _ in batch]

        monkeypatch.setattr(sched, "_dispatch", answer)
        await sched.dispatch_model(model)

    await not_head(woken=True)
    assert MODEL not in sched.behind and sched.kick.is_set()
    await not_head(woken=False)
    assert sched.behind[MODEL] == sched.waiting[MODEL][0].entry_id


@pytest.mark.parametrize("limited", [False, True])
async def test_enqueue_writes_nothing_before_it_takes_a_run_so_a_full_redis_refuses_it_whole(
        redis: Redis, limited: bool) -> None:
    """A full Redis refuses `enqueue`'s first write, the run's: the script did nothing then, for a
    key with limits too (its window was trimmed first, which let Redis run the rest and queue the
    run). The same call made again for a run it took (a lost reply) only reads: it is answered."""
    from redis.exceptions import OutOfMemoryError

    from common.auth import Principal, Role

    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    who = Principal("team-a", Role.CALLER, max_in_flight=5 if limited else None,
                    requests_per_minute=100 if limited else None)
    taken, _ = await client.submit(model, request(), who)
    async with redis_full(redis):
        with pytest.raises(OutOfMemoryError):
            await client.submit(model, request(), who)
        assert (await client.submit(model, request(), who, run_id=taken))[0] == taken  # (the repeat)
    assert await redis.xlen(keys.runs_stream(MODEL)) == 1 and await redis.keys("iop:run:*") == [
        keys.run_record(taken).encode()]
    if limited:
        assert await redis.zcard(keys.key_in_flight("team-a")) == 1


async def test_a_run_never_goes_to_a_provider_that_would_refuse_it_also_once_requeued(redis: Redis) -> None:
    """`refuse` (`gateway.refusals`): a and b are equal, and the tie-break would send the run to a;
    it goes to b, and once its lease is reaped and it is queued again, to b again (not to a, which it
    never tried)."""
    config = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    run_id, _ = await client.submit(model, request(), refuse=("a",))
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hmget(keys.run_record(run_id), "provider", "refuse") == [b"b", b"a"]
    await redis.zadd(keys.leases("b"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    [(_, fields)] = await redis.xrange(keys.runs_stream(MODEL))
    assert fields == {b"run": run_id.encode(), b"tried": b"b", b"refuse": b"a"}
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hmget(keys.run_record(run_id), "state", "provider", "attempts") == [b"dispatched", b"b", b"2"]
    await client.close()


async def test_a_run_only_providers_that_would_refuse_it_could_take_is_refused_as_unavailable(redis: Redis) -> None:
    """b, the one provider that would take it, is down: the run is not queued to wait for a, which
    would refuse it (503 no_available_provider, as when none is available)."""
    config = make_config({"a": 1, "b": 1})
    await beat(redis, config)
    await redis.hset(keys.heartbeat("b"), "health", "unavailable")
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    with pytest.raises(ApiError) as refused:
        await client.submit(model, request(), refuse=("a",))
    assert refused.value.code is ErrorCode.NO_AVAILABLE_PROVIDER
    assert refused.value.message == ("no provider of model 'm:1' is available right now (a: would refuse the request, "
                                     "b: unavailable)")
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    await client.submit(model, request())  # (without it: a takes it)
    assert await redis.xlen(keys.runs_stream(MODEL)) == 1
    await client.close()



async def test_a_waiting_run_whose_takers_go_down_fails_as_unavailable_blaming_none_it_never_tried(
        redis: Redis) -> None:
    """b, the one provider that would take it, goes down while it waits: a 503
    no_available_provider saying what each is (a 502 said "a could not serve the run", a provider
    it never went to); a run that times out says which would refuse it too."""
    config, client, run_id = await a_run_a_would_refuse(redis)
    await redis.hset(keys.heartbeat("b"), "health", "unavailable")
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hmget(keys.run_record(run_id), "state", "error_code", "error_message") == [
        b"failed", b"no_available_provider", b"no provider of model 'm:1' is available (a: would refuse the request, "
                                             b"b: unavailable)"]

    await redis.zadd(keys.leases("b"), {"other": now_ms() + 60_000})  # b back, and full
    await beat(redis, config)
    model = config.model(MODEL)
    assert model is not None
    run_id, _ = await client.submit(model, request(), refuse=("a",))
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"  # it waits for b
    for w in sched.waiting[MODEL]:
        w.deadline_ms = now_ms() - 1  # (its queue_timeout_ms just past)
    await sched.expire_overdue()
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message") == [
        b"timed_out", b"no provider of model 'm:1' had a free slot within 60000 ms (a: would refuse the request, "
                      b"b: full (1 of 1))"]
    await client.close()


async def test_a_lost_run_of_a_provider_taken_out_of_the_config_is_reaped_too(redis: Redis) -> None:
    """b left the config (a scheduler of the new one runs) while a run of its was going on, and its
    worker died with it: the slot comes back and the run is queued again (no replica reaped a
    provider its config lacks: the caller waited out its whole deadline). Found by its lease key
    (a SCAN at the replica's first look: b's worker beats no more)."""
    before = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    await beat(redis, before)
    await redis.zadd(keys.leases("a"), {"other": now_ms() + 60_000})  # a is full: the run goes to b
    client, sched, (run_id,) = await waiting_runs(redis, before, 1)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "provider") == b"b"
    await redis.delete(keys.heartbeat("b"), keys.BEATING)  # its worker died

    after = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    replica = Scheduler(redis, after)
    await replica.ensure_groups()
    assert await replica.reap_expired_leases() == 0  # (its lease lives yet; the SCAN starts)
    await redis.zadd(keys.leases("b"), {run_id: now_ms() - 1})  # move the clock past the lease

    async def reaped() -> bool:  # (once the SCAN, a task of its own, found b)
        return await replica.reap_expired_leases() == 1

    await async_wait_until(reaped, what="b's lease reaped")
    await replica.close()
    assert await redis.exists(keys.leases("b")) == 0
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    await client.close()


async def test_a_provider_whose_heartbeat_comes_from_another_node_takes_no_run_here(redis: Redis) -> None:
    """b moved to node n-a in a config this replica does not run yet (its heartbeat, from n-a's
    worker, says so): a run is not sent to n-b's queue, where no worker serves b (its callers got
    502s while a rollout was half done); it waits, as for a provider with no heartbeat."""
    config = make_config({"a": 1, "b": 1})
    await beat(redis, config)
    await redis.hset(keys.heartbeat("a"), "node", "n-a")
    await redis.hset(keys.heartbeat("b"), "node", "n-a")  # (the config here says n-b)
    client, sched, run_ids = await waiting_runs(redis, config, 2)
    await sched.dispatch_all()
    assert [await redis.hget(keys.run_record(r), "provider") for r in run_ids] == [b"a", None]
    assert await redis.zcard(keys.node_queue("n-b")) == 0
    snaps = await read_snapshots(redis, {"a": "a-name", "b": "b-name"}, now_ms(), config.node_of)
    assert [s.heartbeat_ms is None for s in snaps] == [False, True]  # (the scheduler's own view: b has none)
    assert why_not(snaps[1], now_ms(), 6000) == "its heartbeat comes from node n-a, not this config's"
    await redis.hset(keys.heartbeat("b"), "node", "n-b")  # (the rollout done, as this replica's config says)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_ids[1]), "provider") == b"b"
    await client.close()



async def test_a_replica_of_an_older_config_requeues_a_lost_run_by_the_run_s_own_max_attempts(redis: Redis) -> None:
    """A replica whose config lacks the run's model reaps a lost run of a provider its config lacks
    too: the run's own `max_attempts` (3) says whether it goes back, not a limit of 1 taken for the
    model it does not know."""
    newer = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    await beat(redis, newer)
    await redis.zadd(keys.leases("a"), {"other": now_ms() + 60_000})
    client, sched, (run_id,) = await waiting_runs(redis, newer, 1)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "provider") == b"b"
    older = parse_config({"models": [{"id": "another", "providers": {"a": "a-name"}}],
                          "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "vllm", "capacity": 1,
                                                                 "base_url": "http://127.0.0.1:9",
                                                                 "models": ["a-name"]}]}]})
    replica = Scheduler(redis, older)
    await redis.zadd(keys.leases("b"), {run_id: now_ms() - 1})

    async def reaped() -> bool:
        return await replica.reap_expired_leases() == 1

    await async_wait_until(reaped, what="b's lease reaped")
    await replica.close()
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    await client.close()


async def test_a_lost_run_leaves_the_queue_of_the_node_it_was_sent_to(redis: Redis) -> None:
    """b moved from n-b to n-a in the config of the replica that reaps its lost run: the job leaves
    n-b's queue, where it was sent (it was taken out of n-a's, and a worker of the old config on
    n-b could still take the stale job)."""
    before = make_config({"b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    client, sched, (run_id,) = await waiting_runs(redis, before, 1)
    await sched.dispatch_all()
    assert await redis.zscore(keys.node_queue("n-b"), run_id) is not None
    moved = parse_config({"models": [{"id": MODEL, "providers": {"b": "b-name"}}],
                          "nodes": [{"id": "n-a", "providers": [{"id": "b", "type": "vllm", "capacity": 1,
                                                                 "base_url": "http://127.0.0.1:9",
                                                                 "models": ["b-name"]}]}]})
    await redis.zadd(keys.leases("b"), {run_id: now_ms() - 1})
    replica = Scheduler(redis, moved)
    assert await replica.reap_expired_leases() == 1
    await replica.close()
    assert await redis.zscore(keys.node_queue("n-b"), run_id) is None
    await client.close()


async def test_a_scan_that_fails_is_said_and_tried_again_later_not_at_every_look(
        redis: Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SCAN for providers the config lacks runs in a task of its own: an error of any kind (an
    ACL that refuses SCAN answers an error reply) is logged, and the SCAN waits `SCAN_AGAIN_MS`
    before it is tried again (its exception was never retrieved, and it started anew every look)."""
    config = make_config({"a": 1})
    replica = Scheduler(redis, config)
    calls = []

    def refused(**_: Any) -> Any:
        calls.append(1)
        raise ResponseError("NOPERM this user has no permissions to run the 'scan' command")

    monkeypatch.setattr(replica.redis, "scan_iter", refused)
    caplog.set_level(logging.WARNING, logger="iop.scheduler")
    await replica.reap_expired_leases()

    async def said() -> bool:
        return any("could not look for the leases" in r.getMessage() and "NOPERM" in r.getMessage()
                   for r in caplog.records)

    await async_wait_until(said, what="the failed SCAN logged")
    for _ in range(3):
        await replica.reap_expired_leases()
    assert len(calls) == 1
    later = now_ms() + SCAN_AGAIN_MS + 1
    monkeypatch.setattr("scheduler.core.now_ms", lambda: later)  # (its wait over)
    await replica.reap_expired_leases()

    async def again() -> bool:
        return len(calls) == 2

    await async_wait_until(again, what="the SCAN tried again")
    await replica.close()


@pytest.mark.parametrize("order", [["X", "A", "B"], ["X", "B", "A"]])
async def test_the_waiting_runs_with_the_least_choice_take_their_slots_first(redis: Redis, order: list[str]) -> None:
    """A waits for P1 or P2, B only for P1: the two take both slots, whatever the config's order (a
    review found X admitted to a queue of 0 when A came first: A's run was put on P1, and B's found
    no room left but P2, which B cannot use)."""
    providers = {"X": ["p1", "p2"], "A": ["p1", "p2"], "B": ["p1"]}
    config = parse_config({
        "models": [{"id": m, "providers": {p: p for p in providers[m]}} for m in order],
        "nodes": [{"id": "n", "providers": [
            {"id": p, "type": "vllm", "base_url": "http://127.0.0.1:9", "capacity": 1, "models": [p]}
            for p in ("p1", "p2")]}],
        "queue": {"max_queue": 0, "queue_timeout_ms": 60_000},
    })
    await beat(redis, config)
    for m in ("A", "B"):
        await redis.xadd(keys.runs_stream(m), {"run": f"w{m}"})
    x = config.model("X")
    assert x is not None
    with pytest.raises(ApiError) as err:
        await RunClient(redis, config).submit(x, request())
    assert err.value.code.value == "queue_full"


async def test_a_slot_of_a_provider_that_models_share_goes_to_the_run_that_came_first(redis: Redis) -> None:
    """A is first in the config and its runs keep coming; B's one run came before A's second: B's
    goes next. In the config's order, A took every slot its provider freed, and B's run waited out
    its queue_timeout_ms (504) while 116 runs of A that came after it were served."""
    config = parse_config({
        "models": [{"id": m, "providers": {"p1": f"served-{m}"}} for m in ("A", "B")],
        "nodes": [{"id": "n", "providers": [{"id": "p1", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                             "capacity": 1, "models": ["served-A", "served-B"]}]}],
        "queue": {"max_queue": 100, "queue_timeout_ms": 60_000},
    })
    await beat(redis, config)
    client = RunClient(redis, config)
    models = {m: config.model(m) for m in ("A", "B")}

    async def send(model_id: str) -> str:
        model = models[model_id]
        assert model is not None
        return (await client.submit(model, replace(request(), model=model_id,
                                                   body={**request().body, "model": model_id})))[0]

    async def next_ms() -> None:
        """Wait for Redis's clock to pass its last millisecond: runs of two models' streams queued in
        the same one tie, and go in the config's order (their ids are all a replica sees)."""
        seconds, micros = await redis.time()
        then = seconds * 1000 + micros // 1000

        async def later() -> bool:
            seconds, micros = await redis.time()
            return bool(seconds * 1000 + micros // 1000 > then)
        await async_wait_until(later, what="the next millisecond")

    a1 = await send("A")
    await next_ms()
    b1 = await send("B")
    await next_ms()
    a2 = await send("A")
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    assert await sched.read_new(block_ms=10) == 3
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("p1"), 0, -1) == [a1.encode()]  # (the one slot)
    await redis.zrem(keys.leases("p1"), a1)  # a1 ended: its slot is free
    await sched.dispatch_all()
    assert await redis.zrange(keys.leases("p1"), 0, -1) == [b1.encode()]
    assert [w.run_id for w in sched.waiting["A"]] == [a2]
    await client.close()


@pytest.mark.parametrize("never", ["elsewhere", "unable_by"])
async def test_a_queue_timeout_says_a_provider_the_run_never_goes_back_to_is_not_asked_again(
        redis: Redis, never: str) -> None:
    """a answered the run a 500 (its `elsewhere`) or refused it as unable (`unable_by`), then b reset
    the connection and was drained: the run waits for b, never for a, and its timeout says so. It said
    `a: has a free slot now`, as if the run had waited for nothing while a stood free."""
    config = make_config({"a": 1, "b": 1})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    record = keys.run_record(run_id)
    assert await redis.hget(record, "provider") == b"a"
    await redis.hset(record, mapping={"tried": "a,b", never: "a"})  # (as if a, then b, which reset)
    await redis.set(keys.drained("b"), "1")
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # its lease lapses: a plain requeue
    assert await sched.reap_expired_leases() == 1
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await redis.hget(record, "state") == b"queued"  # (it waits for b)
    for w in sched.waiting[MODEL]:
        w.deadline_ms = now_ms() - 1
    await sched.expire_overdue()
    assert await redis.hmget(record, "state", "error_message") == [
        b"timed_out", f"no provider of model {MODEL!r} had a free slot within 60000 ms (a: not asked again after it "
                      "failed this run, b: drained or cordoned)".encode()]
    await client.close()


async def test_a_runs_stream_of_another_type_written_by_hand_is_deleted_and_said_and_the_others_go_on(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """`redis-cli SET iop:runs:m:2 x`: the replicas' one blocking read of every model's stream failed
    with WRONGTYPE, twenty times a second, so no run of ANY model was dispatched (a replica started
    then failed its setup), until someone deleted the key. The replica deletes it, says so, and reads on."""
    config = parse_config({
        "models": [{"id": MODEL, "providers": {"a": "a-name"}}, {"id": "m:2", "providers": {"a": "a-name"}}],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                               "capacity": 4, "models": ["a-name"]}]}],
        "queue": {"max_queue": 1000, "queue_timeout_ms": 60_000},
    })
    await beat(redis, config)
    client = RunClient(redis, config)
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await redis.delete(keys.runs_stream("m:2"))
    await redis.set(keys.runs_stream("m:2"), "x")  # after the groups were made: the read meets it
    first = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 0  # (healed; the next read takes the run)
    await sched.read_new(block_ms=10)
    await sched.dispatch_round()
    assert await redis.hget(keys.run_record(first[0]), "state") == b"dispatched"
    assert await redis.type(keys.runs_stream("m:2")) == b"stream"
    # a replica that starts while such a key is there
    await redis.delete(keys.runs_stream("m:2"))
    await redis.set(keys.runs_stream("m:2"), "x")
    other = Scheduler(redis, config)
    await other.ensure_groups()
    assert await redis.type(keys.runs_stream("m:2")) == b"stream"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "deleted" in r.getMessage()]
    assert len(said) == 2 and all(keys.runs_stream("m:2") in s for s in said), said


async def test_a_head_whose_record_is_gone_wakes_the_replica_holding_the_next_run(redis: Redis) -> None:
    """A replica that finds its head's record gone (a run cancelled while queued, its record
    expired) drops the entry and wakes the replica that holds the run now at the head, as a
    dispatch does: that one waited for its next tick (up to a second)."""
    from common.subscription import subscribe

    config = make_config({"a": 2})
    await beat(redis, config)
    client = RunClient(redis, config)
    gone, nxt = await submit(client, 2)
    await beat(redis, config, health="unavailable")  # (the reads below dispatch nothing themselves)
    one, two = Scheduler(redis, config, consumer="one"), Scheduler(redis, config, consumer="two")
    await one.ensure_groups()
    assert await one.read_new(block_ms=10, count=1) == 1
    assert await two.read_new(block_ms=10, count=1) == 1
    await redis.hset(keys.run_record(gone), "state", "cancelled")
    await beat(redis, config)
    pubsub = redis.pubsub()
    await subscribe(pubsub, keys.scheduler_channel("two"))
    model = config.model(MODEL)
    assert model is not None
    await one.dispatch_model(model)
    assert [entry[b"run"] for _, entry in await redis.xrange(keys.runs_stream(MODEL))] == [nxt.encode()]
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    await pubsub.aclose()
    await client.close()
    assert message is not None and message["data"] == MODEL.encode(), message
