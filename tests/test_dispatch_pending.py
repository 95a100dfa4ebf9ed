"""The scheduler's read of the model streams with `dispatch_pending` in the same write: Redis
dispatches the runs the read hands a replica as soon as it answers the read. Against a real Redis,
with clients made as the services make them (`common.redisconn.connect`: the pipelined path needs
a line; a plain redis-py client takes the scheduler's usual way, which `test_scheduler.py` covers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakeredis import FakeAsyncRedis
from redis.asyncio import Redis

from common import keys
from common.config import parse_config
from common.redisconn import connect, now_ms
from gateway.runs import RunClient
from scheduler.core import PENDING_CANDIDATES, PENDING_MODELS, Scheduler, Waiting, run_scheduler
from tests.conftest import async_wait_until
from tests.test_scheduler import MODEL, beat, leases, make_config, request, submit


@pytest.fixture
async def lined(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


async def reader(redis: Redis, config: Any) -> Scheduler:
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)  # (the group's first read: nothing yet)
    return sched


def dispatches_sent(sched: Scheduler) -> list[str]:
    """Records each `dispatch` call the scheduler itself sends (its usual way)."""
    sent: list[str] = []
    call_many = sched.scripts.call_many

    async def counting(name: str, calls: Any) -> list[Any]:
        sent.extend([name] * len(calls) if name == "dispatch" else [])
        return await call_many(name, calls)

    sched.scripts.call_many = counting  # type: ignore[method-assign]
    return sent


async def test_runs_read_are_dispatched_by_redis_oldest_first_up_to_the_free_slots(lined: Redis) -> None:
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    sent = dispatches_sent(sched)
    client = RunClient(lined, config)
    run_ids = await submit(client, 3)

    left = await sched.read_new(block_ms=10)

    assert left == 1 and [w.run_id for w in sched.waiting[MODEL]] == [run_ids[2]]
    assert await leases(lined, config) == {"a": 1, "b": 1}
    states = [await lined.hmget(keys.run_record(r), "state", "provider") for r in run_ids]
    assert states[:2] == [[b"dispatched", b"a"], [b"dispatched", b"b"]]  # least loaded, then by id
    assert states[2] == [b"queued", None]
    assert sent == []  # none went the scheduler's own way
    assert await lined.xlen(keys.runs_stream(MODEL)) == 1
    await client.close()


async def test_a_run_that_failed_somewhere_goes_elsewhere_and_one_excluded_everywhere_is_left_to_the_scheduler(
        lined: Redis) -> None:
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    stream = keys.runs_stream(MODEL)
    # as `finish` requeues them: tried on a (go elsewhere if you can), and answered 500 by a and b
    await lined.hset(keys.run_record("run_x"), mapping={"state": "queued", "tried": "a"})
    await lined.xadd(stream, {"run": "run_x", "tried": "a"})
    assert await sched.read_new(block_ms=10) == 0
    assert await lined.hget(keys.run_record("run_x"), "provider") == b"b"

    await lined.delete(keys.leases("b"))
    await lined.hset(keys.run_record("run_y"), mapping={"state": "queued", "tried": "a,b"})
    await lined.xadd(stream, {"run": "run_y", "tried": "a,b", "exclude": "1"})
    assert await sched.read_new(block_ms=10) == 1  # no provider it may go to: the scheduler fails it
    assert [w.run_id for w in sched.waiting[MODEL]] == ["run_y"]
    assert await lined.hget(keys.run_record("run_y"), "state") == b"queued"


async def test_a_run_of_another_replica_ahead_holds_back_the_runs_read_after_it(lined: Redis) -> None:
    config = make_config({"a": 1})
    await beat(lined, config)
    first = await reader(lined, config)
    second = await reader(lined, config)
    client = RunClient(lined, config)
    await lined.zadd(keys.leases("a"), {"run_elsewhere": 2**50})  # the one slot is taken
    (older,) = await submit(client, 1)
    assert await first.read_new(block_ms=10) == 1  # no slot: it waits with `first`
    await lined.delete(keys.leases("a"))
    (newer,) = await submit(client, 1)
    assert await second.read_new(block_ms=10) == 1  # not the head: FIFO across replicas
    assert await lined.zcard(keys.leases("a")) == 0
    await first.dispatch_all()
    assert await lined.zrange(keys.leases("a"), 0, -1) == [older.encode()]
    assert [w.run_id for w in second.waiting[MODEL]] == [newer]
    await client.close()


async def test_a_model_with_runs_waiting_here_is_left_to_the_dispatcher(lined: Redis) -> None:
    config = make_config({"a": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    run_ids = await submit(client, 2)
    assert await sched.read_new(block_ms=10) == 1
    assert sched._pending_call() is None  # a run waits: whatever comes is behind it
    await lined.delete(keys.leases("a"))  # a slot freed
    (third,) = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 1
    assert await lined.zcard(keys.leases("a")) == 0
    await sched.dispatch_all()
    assert await lined.zrange(keys.leases("a"), 0, -1) == [run_ids[1].encode()]
    assert [w.run_id for w in sched.waiting[MODEL]] == [third]
    await client.close()


async def test_a_script_redis_forgot_is_loaded_and_a_script_error_loses_no_run(
        lined: Redis, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config({"a": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    await lined.script_flush()
    (run_id,) = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 0
    assert await lined.hget(keys.run_record(run_id), "state") == b"dispatched"

    await lined.set(keys.leases("a"), "not a sorted set")  # the script fails on it (WRONGTYPE)
    (second,) = await submit(client, 1)
    with caplog.at_level(logging.WARNING, "iop.scheduler"):
        assert await sched.read_new(block_ms=10) == 1
    assert [w.run_id for w in sched.waiting[MODEL]] == [second]
    assert "dispatching the runs just read failed, the dispatcher takes them" in caplog.text
    await client.close()


async def test_the_dispatch_goes_in_the_same_write_as_the_read_and_runs_when_the_read_is_answered(
        lined: Redis) -> None:
    """The replica blocks on its read; a run queued meanwhile is dispatched before the replica
    has its answer (Redis runs the script right after it answers the read)."""
    config = make_config({"a": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    assert sched.intake_line is not None
    replies: list[Any] = []
    execute_many = sched.intake_line.execute_many

    async def recording(commands: Any, block_s: float = 0.0) -> list[Any]:
        replies.append([c[0] for c in commands])
        return await execute_many(commands, block_s)

    sched.intake_line.execute_many = recording  # type: ignore[method-assign]
    reading = asyncio.create_task(sched.read_new(block_ms=5000))
    await asyncio.sleep(0)
    (run_id,) = await submit(client, 1)
    assert await reading == 0
    assert replies == [["XREADGROUP", "EVALSHA"]]
    assert await lined.hget(keys.run_record(run_id), "state") == b"dispatched"
    assert await lined.lrange(keys.node_wake("n-a"), 0, -1) == [run_id.encode()]
    await client.close()


def test_it_looks_at_the_models_with_runs_read_most_recently_and_none_with_runs_waiting_here() -> None:
    models = [f"m{i:02d}" for i in range(PENDING_MODELS + 4)]
    config = parse_config({
        "models": [{"id": m, "providers": {"a": "served"}} for m in models],
        "nodes": [{"id": "n", "providers": [{"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                             "capacity": 1, "models": ["served"]}]}]})
    sched = Scheduler(FakeAsyncRedis(), config)

    def covered() -> list[str]:
        call = sched._pending_call()
        assert call is not None
        return [k[len(keys.runs_stream("")):] for k in call[0] if k.startswith(keys.runs_stream(""))]

    assert covered() == sorted(models[-PENDING_MODELS:])
    sched._active.pop("m00")
    sched._active["m00"] = None  # a run of m00 was just read
    sched.waiting["m19"].append(Waiting((1, 0), "run_w", "1-0", 2**50))
    assert covered() == sorted(["m00", *models[4:19]])  # (m19 has a run waiting here)


async def test_a_provider_whose_server_does_not_list_the_model_is_not_a_candidate(lined: Redis) -> None:
    """As the scheduler's own snapshots say (`has_model`): a run never goes where the server
    answered that it has no such model; with no provider listing it, the scheduler fails it."""
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    await lined.hset(keys.heartbeat("a"), "observed_models", '["other"]')
    await lined.hset(keys.heartbeat("b"), "observed_models", '["b-name", "other"]')
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    (first,) = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 0
    assert await lined.hget(keys.run_record(first), "provider") == b"b"

    await lined.hset(keys.heartbeat("b"), "observed_models", "[]")
    (second,) = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 1
    await sched.dispatch_all()
    assert await lined.hmget(keys.run_record(second), "state", "error_code") == [b"failed", b"no_available_provider"]
    # (what each provider is, as the gateway's own refusal says it)
    assert await lined.hget(keys.run_record(second), "error_message") == (
        f"no provider of model {MODEL!r} is available (a: missing the model, b: missing the model)").encode()
    await client.close()


async def test_a_run_that_waited_its_queue_timeout_is_left_to_the_scheduler_to_time_out(lined: Redis) -> None:
    """Runs queued while no scheduler ran, read after their `queue_timeout_ms`: timed out, as the
    scheduler's own way does, not dispatched because a slot happens to be free."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 1000})
    await beat(lined, config)
    sched = await reader(lined, config)
    stream = keys.runs_stream(MODEL)
    await lined.hset(keys.run_record("run_old"), mapping={"state": "queued", "model": MODEL})
    old_entry = await lined.xadd(stream, {"run": "run_old"}, id=f"{now_ms() - 5000}-0")
    await lined.hset(keys.run_record("run_old"), "entry", old_entry)
    assert await sched.read_new(block_ms=10) == 1
    assert await lined.zcard(keys.leases("a")) == 0
    await sched.expire_overdue()
    assert await lined.hget(keys.run_record("run_old"), "state") == b"timed_out"


async def test_runs_dispatched_before_an_error_stay_dispatched_and_the_rest_wait(
        lined: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """The first run (whose adapter on b would refuse it: a its only candidate) is dispatched to a;
    the second's dispatch then fails on b's leases, of another type (WRONGTYPE), before it writes
    anything: it waits, and is dispatched once they are mended."""
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    model = config.model(MODEL)
    assert model is not None
    run_ids = [(await client.submit(model, request(), refuse=("b",)))[0], *await submit(client, 1)]
    await lined.set(keys.leases("b"), "not a sorted set")  # read by the second run's dispatch alone
    with caplog.at_level(logging.WARNING, "iop.scheduler"):
        assert await sched.read_new(block_ms=10) == 1
    assert "WRONGTYPE" in caplog.text
    assert await lined.hget(keys.run_record(run_ids[0]), "state") == b"dispatched"
    assert [w.run_id for w in sched.waiting[MODEL]] == [run_ids[1]]
    assert await lined.hget(keys.run_record(run_ids[1]), "state") == b"queued"
    await lined.delete(keys.leases("b"))
    await sched.dispatch_all()
    assert await lined.hget(keys.run_record(run_ids[1]), "state") == b"dispatched"
    assert await leases(lined, config) == {"a": 1, "b": 1}
    await client.close()


def test_a_model_with_more_providers_than_a_call_takes_is_left_to_the_dispatcher() -> None:
    many = [f"p{i:02d}" for i in range(PENDING_CANDIDATES + 1)]
    config = parse_config({
        "models": [{"id": "big", "providers": {p: "served" for p in many}},
                   {"id": "small", "providers": {"p00": "served"}}],
        "nodes": [{"id": "n", "providers": [{"id": p, "type": "vllm", "base_url": "http://127.0.0.1:9",
                                             "capacity": 1, "models": ["served"]} for p in many]}]})
    call = Scheduler(FakeAsyncRedis(), config)._pending_call()
    assert call is not None
    assert [k for k in call[0] if k.startswith(keys.runs_stream(""))] == [keys.runs_stream("small")]


async def test_after_a_run_waited_the_runs_that_follow_go_with_the_read_again(lined: Redis) -> None:
    """A run that waits for a slot keeps its model out of `dispatch_pending` while it waits. Once
    it went, the replica must not stay on its own way for the runs that keep coming: at most the
    one run read while the waiting one was being dispatched goes that way."""
    config = make_config({"a": 1})
    await beat(lined, config)
    sched = Scheduler(lined, config)
    by_replica: list[str] = []
    call_many = sched.scripts.call_many

    async def recording(name: str, calls: Any) -> list[Any]:
        if name == "dispatch":
            by_replica.extend(args[0] for _, args in calls)
        return await call_many(name, calls)

    sched.scripts.call_many = recording  # type: ignore[method-assign]
    stop = asyncio.Event()
    running = asyncio.create_task(run_scheduler(sched, stop))
    client = RunClient(lined, config)

    async def dispatched(run_id: str) -> None:
        async def there() -> bool:
            return bool(await lined.hget(keys.run_record(run_id), "state") == b"dispatched")
        await async_wait_until(there, what=f"{run_id} dispatched")

    async def free_the_slot() -> None:
        await lined.delete(keys.leases("a"))
        await lined.publish(keys.SCHEDULER_SIGNALS, b"*")  # (as a run's end wakes the replica)

    try:
        (first,) = await submit(client, 1)
        await dispatched(first)
        (waits,) = await submit(client, 1)  # no free slot: it waits at the replica
        await async_wait_until(lambda: asyncio.sleep(0, bool(sched.waiting[MODEL])), what="a run waiting")
        await free_the_slot()
        await dispatched(waits)
        later = []
        for _ in range(4):
            await free_the_slot()
            (run_id,) = await submit(client, 1)
            await dispatched(run_id)
            later.append(run_id)
        assert waits in by_replica
        assert [r for r in later[1:] if r in by_replica] == []
    finally:
        stop.set()
        await running
        await client.close()


async def test_the_intake_waits_for_a_dispatch_round_only_up_to_its_bound() -> None:
    """No dispatcher running (it is stuck on a Redis that does not answer, say): the wait for its
    round ends at the bound, and a round that ends does end it."""
    sched = Scheduler(FakeAsyncRedis(), make_config({"a": 1}))
    await asyncio.wait_for(sched.dispatched_since(sched.rounds_started, 0.05), timeout=10)
    assert sched.rounds_done == 0
    waiting = asyncio.create_task(sched.dispatched_since(sched.rounds_started, 60))
    await asyncio.sleep(0)
    assert not waiting.done()
    await sched.dispatch_round()
    await asyncio.wait_for(waiting, timeout=10)
    assert sched.rounds_done == 1


async def test_a_run_read_never_goes_to_a_provider_that_would_refuse_it(lined: Redis) -> None:
    """The entry's `refuse` (`gateway.refusals`): a and b are equal, and the tie-break would send
    the run to a; Redis sends it to b."""
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    model = config.model(MODEL)
    assert model is not None
    run_id, _ = await client.submit(model, request(), refuse=("a",))
    assert await sched.read_new(block_ms=10) == 0
    assert await lined.hget(keys.run_record(run_id), "provider") == b"b"
    await client.close()


async def test_a_run_read_never_goes_to_a_provider_whose_heartbeat_comes_from_another_node(lined: Redis) -> None:
    """b's heartbeat says n-a, the config here n-b (a rollout half done): with a full, Redis
    leaves the run waiting, not sent to n-b's queue."""
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    await lined.hset(keys.heartbeat("b"), "node", "n-a")
    await lined.zadd(keys.leases("a"), {"other": now_ms() + 60_000})  # a is full
    sched = await reader(lined, config)
    client = RunClient(lined, config)
    (run_id,) = await submit(client, 1)
    assert await sched.read_new(block_ms=10) == 1  # (left waiting)
    assert await lined.hget(keys.run_record(run_id), "state") == b"queued"
    await client.close()


@pytest.mark.parametrize("never", ["unable_by", "elsewhere"])
async def test_a_run_read_never_goes_back_to_a_provider_that_refused_it_as_unable(lined: Redis, never: str) -> None:
    """The entry's `unable_by` (`finish`'s `requeue_unable_back`) or `elsewhere` (a 500 from a, then a
    connection reset on b: a plain `requeue`): tried on a and b, it may go back to either (`tried`, no
    `exclude`), and the tie-break would send it to a; a refused it as unable to do what it asks, or
    answered it a 500, so Redis sends it to b."""
    config = make_config({"a": 1, "b": 1})
    await beat(lined, config)
    sched = await reader(lined, config)
    await lined.hset(keys.run_record("run_x"), mapping={"state": "queued", "tried": "b,a", never: "a"})
    await lined.xadd(keys.runs_stream(MODEL), {"run": "run_x", "tried": "b,a", never: "a"})
    assert await sched.read_new(block_ms=10) == 0
    assert await lined.hget(keys.run_record("run_x"), "provider") == b"b"
