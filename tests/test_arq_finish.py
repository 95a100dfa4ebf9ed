"""arq's end-of-job bookkeeping in the node's worker: retried through a Redis outage, but only while
the node queue still holds the job this task ran (not a later attempt's, which has the same id)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from arq.worker import func
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from workers.arq_worker import _JOB_SCORE, WakeWorker, arq_redis

QUEUE = keys.node_queue("n1")


async def _noop(ctx: dict[str, object], run_id: str) -> None:
    return None


@pytest.fixture
async def worker(redis_url: str) -> AsyncIterator[WakeWorker]:
    w = WakeWorker(functions=[func(_noop, name=keys.JOB_FUNCTION)], queue_name=QUEUE, wake_key=keys.node_wake("n1"),
                   redis_pool=arq_redis(redis_url), handle_signals=False)
    yield w
    await w.pool.aclose(close_connection_pool=True)


class FlakyFinish:
    """A finish step that fails `failures` times as a Redis outage would, then removes the job."""

    def __init__(self, redis: Redis, failures: int) -> None:
        self.redis = redis
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        await self.redis.zrem(QUEUE, "run_1")


async def _as_task_with_score(score: int, worker: WakeWorker, finish: FlakyFinish) -> None:
    """The way a job's task does it: the score is set in the task's own context."""
    async def go() -> None:
        _JOB_SCORE.set(score)
        await worker._through_outage("run_1", finish)
    await asyncio.create_task(go())


async def test_the_end_of_a_job_is_recorded_once_redis_is_back(worker: WakeWorker, redis: Redis) -> None:
    await redis.zadd(QUEUE, {"run_1": 1000})
    finish = FlakyFinish(redis, failures=2)
    await _as_task_with_score(1000, worker, finish)
    assert finish.calls == 3
    assert await redis.zscore(QUEUE, "run_1") is None


async def test_a_later_attempt_s_job_is_left_alone(worker: WakeWorker, redis: Redis) -> None:
    await redis.zadd(QUEUE, {"run_1": 2000})  # the run was reaped and dispatched again meanwhile
    finish = FlakyFinish(redis, failures=1)
    await _as_task_with_score(1000, worker, finish)
    assert finish.calls == 1
    assert await redis.zscore(QUEUE, "run_1") == 2000


async def test_a_job_already_gone_is_not_finished_again(worker: WakeWorker, redis: Redis) -> None:
    finish = FlakyFinish(redis, failures=1)  # its first try went through; only the answer was lost
    await _as_task_with_score(1000, worker, finish)
    assert finish.calls == 1
