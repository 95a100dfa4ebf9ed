"""The last worker of a node to stop hands the node's work back at once (`workers.service.leave_node`,
the `worker_left` script), against a real Redis: its providers' heartbeats go (as if they had
lapsed), and the runs dispatched to the node that no worker took go back to their queue without
an attempt counted."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from common import keys
from common.codec import unpack
from gateway.runs import RunClient
from scheduler.core import Scheduler
from tests.test_runner import dispatched_runs, fields, node_worker
from workers.runner import new_worker_instance
from workers.service import RUNNER_CTX, leave_node


async def test_the_last_worker_to_stop_queues_again_the_runs_no_worker_took(
        redis: Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "iop.worker")
    runner, run_ids = await dispatched_runs(redis, 2)
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    await redis.zadd(keys.node_workers("n-a"), {worker.instance: 2**50})  # as its heartbeat registers it
    await redis.zadd(keys.BEATING, {"a": 2**50, "elsewhere": 2**50})
    try:
        await leave_node(worker, runner.config, "n-a")
        assert await redis.zrange(keys.BEATING, 0, -1) == [b"elsewhere"]  # (another node's provider stays)
        for run_id in run_ids:
            assert await fields(redis, keys.run_record(run_id), "state", "attempts", "provider", "tried") == [
                "queued", "0", None, "a"]
            last = (await redis.xrevrange(keys.run_events(run_id), count=1))[0][1]
            assert last[b"type"] == b"requeued" and unpack(last[b"data"])["code"] == "worker_lost"
        assert await redis.xlen(keys.runs_stream(runner.config.models[0].id)) == 2
        assert not await redis.zcard(keys.leases("a")) and not await redis.zcard(keys.node_queue("n-a"))
        assert not await redis.exists(keys.node_wake("n-a"), keys.node_workers("n-a"))
        assert not await redis.exists(keys.heartbeat("a"))  # as if it had lapsed: waiting runs wait
        assert any(r.getMessage().endswith("; 2 runs no worker took queued again") for r in caplog.records)
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_run_the_last_worker_queues_again_lives_run_ttl_s_from_then(redis: Redis, redis_url: str) -> None:
    """As from its first queueing (README's Redis keys): the dispatch sets no TTL of the record."""
    runner, (run_id,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    await redis.zadd(keys.node_workers("n-a"), {worker.instance: 2**50})
    await redis.expire(keys.run_record(run_id), 100)  # (long after its queueing)
    try:
        await leave_node(worker, runner.config, "n-a")
        assert await fields(redis, keys.run_record(run_id), "state") == ["queued"]
        assert await redis.ttl(keys.run_record(run_id)) > runner.config.runtime.run_ttl_s - 60
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_runs_of_a_model_whose_only_node_lost_its_last_worker_wait_for_a_worker_they_do_not_fail(
        redis: Redis, redis_url: str) -> None:
    """A restart of a one-worker node (SIGTERM, then the new worker): the runs it gave back and those
    that waited wait on; a provider with no heartbeat is not known to be down. (Marking the providers
    `unavailable` made the scheduler fail every waiting run of the model with 503; found in review.)"""
    from tests.test_scheduler import submit
    runner, (given_back,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    sched = Scheduler(redis, runner.config)
    await sched.ensure_groups()
    (waiting,) = await submit(RunClient(redis, runner.config), 1)
    try:
        await leave_node(worker, runner.config, "n-a")
        await sched.read_new(block_ms=10)
        sched.on_signal(b"*")  # (what the script published)
        await sched.dispatch_all()
        for run_id in (given_back, waiting):
            assert await fields(redis, keys.run_record(run_id), "state") == ["queued"]
        assert len(sched.waiting[runner.config.models[0].id]) == 2
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_worker_that_stops_while_another_of_its_node_lives_leaves_the_node_s_work_alone(
        redis: Redis, redis_url: str) -> None:
    runner, (run_id,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    await redis.zadd(keys.node_workers("n-a"), {worker.instance: 2**50, new_worker_instance(): 2**50})
    try:
        await leave_node(worker, runner.config, "n-a")
        assert await fields(redis, keys.run_record(run_id), "state", "provider") == ["dispatched", "a"]
        assert await redis.zcard(keys.node_queue("n-a")) == 1 and await redis.llen(keys.node_wake("n-a")) == 1
        assert await fields(redis, keys.heartbeat("a"), "health") == ["available"]
        assert await redis.zrange(keys.node_workers("n-a"), 0, -1) != []  # the other one, not this one
        assert worker.instance.encode() not in await redis.zrange(keys.node_workers("n-a"), 0, -1)
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_run_a_worker_took_or_its_caller_cancelled_is_left_to_its_lease(redis: Redis, redis_url: str) -> None:
    """A run in progress (its marker set) goes on where it is; one cancelled before its start ends
    through its lease, as before (the reaper ends it `cancelled`)."""
    runner, (taken, cancelled) = await dispatched_runs(redis, 2)
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    await redis.set(f"arq:in-progress:{taken}", "someone")
    await redis.hset(keys.run_record(cancelled), "cancel", "1")
    try:
        await leave_node(worker, runner.config, "n-a")  # (no live worker registered: it was the last)
        assert await fields(redis, keys.run_record(taken), "state") == ["dispatched"]
        assert await fields(redis, keys.run_record(cancelled), "state") == ["dispatched"]
        assert await redis.zcard(keys.leases("a")) == 2
    finally:
        await worker.pool.aclose(close_connection_pool=True)
