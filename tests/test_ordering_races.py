"""Ordering races, each forced deterministically: an await point of one task is held on an
asyncio.Event while another task does what it does in production meanwhile, against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from arq.constants import in_progress_key_prefix
from redis.asyncio import Redis

import scheduler.core
from common import keys
from common.codec import pack
from common.comeback import Comeback
from common.config import parse_config
from common.scripts import Scripts
from common.snapshots import read_snapshots
from common.wire import ErrorCode, ErrorInfo, RunKind, cancelled_by_caller
from gateway.runs import RunClient
from scheduler.core import Scheduler
from tests.conftest import async_wait_until
from tests.test_cancel import StallingAdapter
from tests.test_scheduler import MODEL, beat, make_config, request, submit, waiting_runs
from workers import runner as runner_module
from workers import service
from workers.adapters.base import ProviderError, Retry
from workers.runner import Runner


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


@asynccontextmanager
async def cancels_heard(redis: Redis, runner: Runner, run_id: str,
                        monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[asyncio.Event]:
    """The node's cancel listener on `runner` for the block, subscribed: an event set once it has
    heard (and handled) a cancel of `run_id`."""
    heard = asyncio.Event()
    cancel = service._cancel

    async def cancel_heard(runner: Runner, cancelled: str) -> None:
        await cancel(runner, cancelled)
        if cancelled == run_id:
            heard.set()

    monkeypatch.setattr(service, "_cancel", cancel_heard)
    listener = asyncio.create_task(service._listen_cancels(runner, "n-a", Comeback(redis)))
    try:
        await async_wait_until(lambda: _subscribers(redis, keys.node_cancel("n-a")), what="the listener subscribed")
        yield heard
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def start_here(runner: Runner, run_id: str) -> list[Any]:
    """The run started in Redis by this worker, as its `take` does (its task not begun)."""
    started: list[Any] = await runner.scripts.call("start", [keys.run_record(run_id), keys.run_events(run_id)],
                                                   [run_id, *runner.start_args(), keys.leases("")])
    assert started[0] == b"ok"
    return started


async def assert_left_by_its_caller(redis: Redis, run_id: str) -> None:
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message") == [
        b"cancelled", b"the caller went away"]


async def test_a_cancel_heard_between_a_run_s_start_and_its_task_is_not_lost(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's `take` started the run in Redis, and its caller left before the run's task had
    registered it in `Runner.running` (the take's answer on its way back, or the run's task waiting
    for its previous attempt's task to end): the node's cancel message, heard then, found no run
    here and was dropped; the provider generated the whole answer for nobody, its slot held, until
    the lease's first renewal (`lease_ttl_ms / 3`, 5 s by default) read the cancel flag."""
    config = make_config({"a": 1}, runtime={"lease_ttl_ms": 600_000})  # (no renewal within the test)
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    client = RunClient(redis, config)
    await sched.dispatch_all()
    runner = Runner(redis, config, "n-a", {"a": StallingAdapter()})
    try:
        async with cancels_heard(redis, runner, run_id, monkeypatch) as heard:
            started = await start_here(runner, run_id)  # the run is running in Redis; its task has not begun
            assert await client.cancel(run_id, MODEL, "the caller went away") == "signalled"
            await asyncio.wait_for(heard.wait(), 10)  # the listener heard it, before the run's task began
            execution = asyncio.create_task(runner.run(run_id, started))
            assert (await asyncio.wait_for(execution, 10)).startswith("cancelled")
    finally:
        await client.close()
    await assert_left_by_its_caller(redis, run_id)
    assert await redis.zcard(keys.leases("a")) == 0


async def _subscribers(redis: Redis, channel: str) -> bool:
    return bool((await redis.pubsub_numsub(channel))[0][1] == 1)


def test_the_cancels_heard_of_runs_not_running_here_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker of a node hears every cancel of the node: it keeps the newest, at most
    `MAX_CANCELS_HEARD`, for a lease's life."""
    monkeypatch.setattr(runner_module, "MAX_CANCELS_HEARD", 3)
    runner = Runner(Redis(), make_config({"a": 1}, runtime={"lease_ttl_ms": 600_000}), "n-a", {})
    for i in range(5):
        runner.heard_cancel(f"r{i}")
    runner.heard_cancel("r2")  # (heard again: the newest)
    assert list(runner.cancels_heard) == ["r3", "r4", "r2"]
    assert runner._heard_before("r4") and not runner._heard_before("r4") and not runner._heard_before("r0")
    runner.cancels_heard["r3"] -= 601  # (heard a lease's life ago: it would have been reaped)
    assert not runner._heard_before("r3")


async def test_a_run_adopted_again_as_its_dispatch_went_out_is_not_timed_out_at_its_old_entry(
        redis_url: str, redis: Redis) -> None:
    """A replica that lost track of a run it held (a failover lost its dispatch) reads every run
    Redis holds for it (`adopt_forgotten`), and adopts those it does not hold. Its dispatcher sent
    a run's dispatch as that read went out: the read still listed the run, the dispatch's answer
    took it out of the waiting runs first, and the read's answer put it back, at the entry it had
    left. The run's attempt was then lost and the run queued again (a new entry); at the old
    entry's queue timeout the replica timed the run out: `drop_queued` dropped whatever entry the
    run was queued at. (Two replicas that claimed a dead one's runs at once both held them so too.)"""
    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    run_id, forgotten = await submit(client, 2)
    c_redis = Redis.from_url(redis_url)
    c = Scheduler(c_redis, config, consumer="c")
    await c.ensure_groups()
    assert await c.read_new(block_ms=10) == 2
    c.waiting[MODEL][:] = [w for w in c.waiting[MODEL] if w.run_id != forgotten]  # (the failover lost it)
    assert await c.adopt_forgotten() == 0  # (one look short: the read comes at the second)
    read = c_redis.xreadgroup

    async def dispatched_meanwhile(*args: Any, **kwargs: Any) -> Any:
        answer = await read(*args, **kwargs)
        await c.dispatch_all()  # (its answer is handled before the read's)
        return answer

    c_redis.xreadgroup = dispatched_meanwhile
    try:
        assert await c.adopt_forgotten() == 2  # the forgotten run, and the one just dispatched
        c_redis.xreadgroup = read
        assert await redis.hget(keys.run_record(run_id), "state") == b"dispatched"
        await redis.zadd(keys.leases("a"), {run_id: 1})  # its worker died: the lease lapsed
        assert await c.reap_expired_leases() == 1
        assert await redis.hget(keys.run_record(run_id), "state") == b"queued"  # queued again, a new entry
        [ghost] = [w for w in c.waiting[MODEL] if w.run_id == run_id]
        ghost.deadline_ms = 0  # (the old entry's queue timeout passed; the new one's has not)
        await c.expire_overdue()
    finally:
        await c_redis.aclose()
        await client.close()
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 2  # (it, queued again, and the forgotten one)


async def test_a_run_given_up_as_its_node_s_last_worker_leaves_makes_no_heartbeat_that_never_expires(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-stream llama-cpp-python run given up (its caller left) marks its provider busy in its
    heartbeat: `EXISTS`, then `HSET`, two steps. The node's last worker left between them (its
    `worker_left` deletes the node's heartbeats): the `HSET` made a heartbeat hash of that field
    alone with no TTL, which stays for good (a `finish` of a run still ending there then writes
    `health: available` into it, as a run's evidence does into a live heartbeat)."""
    config = parse_config({
        "models": [{"id": MODEL, "providers": {"a": "a-name"}}],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "llamacpp", "base_url": "http://127.0.0.1:9",
                                                "capacity": 1, "models": ["a-name"]}]}],
        "queue": {"max_queue": 10, "queue_timeout_ms": 60_000},
    })
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    adapter = StallingAdapter()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    task = asyncio.create_task(runner.execute(run_id))
    await async_wait_until(lambda: asyncio.sleep(0, adapter.calls == 1), what="the provider asked")
    lost = ErrorInfo(ErrorCode.WORKER_LOST, "the last worker of node n-a stopped before taking the run")
    left: list[Any] = []

    async def last_worker_leaves() -> None:  # (as `workers.service.leave_node` does, once)
        if not left:
            left.append(await Scripts(redis).call("worker_left", [
                keys.node_workers("n-a"), keys.node_queue("n-a"), keys.node_wake("n-a"), keys.heartbeat("a")],
                ["w1", in_progress_key_prefix, pack(lost.to_wire()), keys.SCHEDULER_SIGNALS, 3600]))

    exists, call = redis.exists, runner.scripts.call

    async def exists_then_left(*names: Any) -> Any:  # (the look before the mark: the worker leaves after it)
        found = await exists(*names)
        if names == (keys.heartbeat("a"),):
            await last_worker_leaves()
        return found

    async def left_then_call(name: str, script_keys: Any, args: Any) -> Any:  # (a mark in one step: before it)
        if name == "mark_busy":
            await last_worker_leaves()
        return await call(name, script_keys, args)

    monkeypatch.setattr(redis, "exists", exists_then_left)
    monkeypatch.setattr(runner.scripts, "call", left_then_call)
    assert runner.cancel(run_id, cancelled_by_caller())
    assert (await task).startswith("cancelled")
    await client.close()
    assert left == [[1, 0]]  # (it was the node's last worker, and it left as the mark was made)
    assert not await redis.exists(keys.heartbeat("a")), await redis.hgetall(keys.heartbeat("a"))


class FailsThenStalls(StallingAdapter):
    """A provider whose first answer breaks off (another attempt may go anywhere) and whose next
    never comes."""

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        if self.calls == 0:
            self.calls += 1
            raise ProviderError("provider a: the connection was reset", retry=Retry.ANY)
        return await super().complete(kind, body, request_id)


async def test_a_cancel_heard_while_the_run_s_last_attempt_here_ends_reaches_its_next_attempt_here(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's first attempt here failed and put it back in its queue; its task, still ending
    (the `finish` ran, its reply not read), held the run's place in `Runner.running` while the run's
    next attempt was dispatched here and started. The caller left then: the cancel message found the
    ending attempt (which takes no cancel) and was dropped, and the next attempt generated for
    nobody until its first renewal."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 2},
                         runtime={"lease_ttl_ms": 600_000})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    client = RunClient(redis, config)
    await sched.dispatch_all()
    adapter = FailsThenStalls()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    ended, go = asyncio.Event(), asyncio.Event()
    call = runner.scripts.call

    async def slow_reply(name: str, script_keys: Any, args: Any) -> Any:
        answer = await call(name, script_keys, args)
        if name == "finish" and not ended.is_set():  # (the first attempt's end ran in Redis ...)
            ended.set()
            await go.wait()  # (... and its reply is read late)
        return answer

    monkeypatch.setattr(runner.scripts, "call", slow_reply)
    try:
        async with cancels_heard(redis, runner, run_id, monkeypatch) as heard:
            first = asyncio.create_task(runner.execute(run_id))
            await asyncio.wait_for(ended.wait(), 10)
            assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
            await sched.read_new(block_ms=10)
            await sched.dispatch_all()  # its next attempt, here again
            started = await start_here(runner, run_id)
            assert await client.cancel(run_id, MODEL, "the caller went away") == "signalled"
            await asyncio.wait_for(heard.wait(), 10)  # heard while the first attempt's task still ends
            go.set()
            assert (await first).startswith("requeued")
            second = asyncio.create_task(runner.run(run_id, started))  # (as `_after` runs it, the first one done)
            assert (await asyncio.wait_for(second, 10)).startswith("cancelled")
    finally:
        await client.close()
    await assert_left_by_its_caller(redis, run_id)


async def test_runs_a_replica_read_as_it_was_taken_over_are_not_left_pending_for_nobody(
        redis_url: str, redis: Redis) -> None:
    """A replica whose liveness key lapsed (stalled past `scheduler_liveness_ms`) was still alive,
    and its blocking read handed it a new run between another replica's claim of its pending runs
    and that replica's `XGROUP DELCONSUMER`: the delete took the new run's pending entry with it.
    The stalled replica then died for real: the run, pending for nobody, was at the head of its
    stream, no replica could take it over (none holds it), and every later run of the model found
    it ahead (`not_head`) until the run's caller's gateway ended it past its queue timeout."""
    config = make_config({"a": 4})
    await beat(redis, config)
    client = RunClient(redis, config)
    stalled_redis, b_redis = Redis.from_url(redis_url), Redis.from_url(redis_url)
    stalled, b = Scheduler(stalled_redis, config, consumer="stalled"), Scheduler(b_redis, config, consumer="b")
    await b.ensure_groups()
    await b.heartbeat()
    await submit(client, 1)
    assert await stalled.read_new(block_ms=10) == 1  # (its liveness key lapsed: taken for dead)
    new: list[str] = []

    async def stalled_reads() -> None:  # (once)
        if not new:
            new.extend(await submit(client, 1))
            assert await stalled.read_new(block_ms=10) == 1

    delete, call = b_redis.xgroup_delconsumer, b.scripts.call

    async def read_then_delete(*args: Any, **kwargs: Any) -> Any:  # (b claimed; it deletes the consumer next)
        await stalled_reads()
        return await delete(*args, **kwargs)

    async def take_over_then_read(name: str, script_keys: Any, args: Any) -> Any:  # (claim and delete: one step)
        answer = await call(name, script_keys, args)
        if name == "take_over":
            await stalled_reads()
        return answer

    b_redis.xgroup_delconsumer = read_then_delete
    b.scripts.call = take_over_then_read  # type: ignore[method-assign,assignment]
    try:
        assert await b.take_over_dead() == 1
        assert len(new) == 1
        # the stalled replica dies now, its run not dispatched; later runs come, b reads them
        (later,) = await submit(client, 1)
        for _ in range(2):  # (b's maintenance rounds)
            await b.take_over_dead()
            await b.adopt_forgotten()
        assert await b.read_new(block_ms=10) == 1
        await b.dispatch_all()
        states = {r: await redis.hget(keys.run_record(r), "state") for r in (*new, later)}
    finally:
        await stalled_redis.aclose()
        await b_redis.aclose()
        await client.close()
    assert states == {new[0]: b"dispatched", later: b"dispatched"}


async def test_a_cancel_that_reaches_a_lost_attempt_here_reaches_the_run_s_next_attempt_here_too(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's first attempt here lost its lease (this worker was paused past it) and the reaper
    put the run back in its queue; the run's next attempt was dispatched here and started while the
    first attempt's task, its renewal not yet due, still ran. The caller left then: the cancel
    message cancelled the first attempt (whose end `finish` then refused: `stale`), and the next
    attempt, waiting for that task to end, generated for nobody until its first renewal."""
    config = make_config({"a": 1}, runtime={"lease_ttl_ms": 600_000})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    client = RunClient(redis, config)
    await sched.dispatch_all()
    adapter = StallingAdapter()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    try:
        async with cancels_heard(redis, runner, run_id, monkeypatch) as heard:
            first = asyncio.create_task(runner.execute(run_id))
            await async_wait_until(lambda: asyncio.sleep(0, adapter.calls == 1), what="the provider asked")
            await redis.zadd(keys.leases("a"), {run_id: 1})  # (this worker was paused past its lease)
            assert await sched.reap_expired_leases() == 1
            await sched.read_new(block_ms=10)
            await sched.dispatch_all()  # its next attempt, here again
            started = await start_here(runner, run_id)
            assert await client.cancel(run_id, MODEL, "the caller went away") == "signalled"
            await asyncio.wait_for(heard.wait(), 10)
            assert (await asyncio.wait_for(first, 10)).startswith("cancelled:stale")  # (the first attempt took it)
            second = asyncio.create_task(runner.run(run_id, started))  # (as `_after` runs it, the first one done)
            assert (await asyncio.wait_for(second, 10)).startswith("cancelled")
    finally:
        await client.close()
    await assert_left_by_its_caller(redis, run_id)
