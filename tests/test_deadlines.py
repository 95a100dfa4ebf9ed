"""One sweeper bounds every waiting caller (`gateway.deadlines`), as `asyncio.timeout` would."""

from __future__ import annotations

import asyncio

import pytest

from gateway.deadlines import Deadlines


async def test_a_task_past_its_deadline_gets_timeout_error_whatever_it_awaits() -> None:
    deadlines = Deadlines(period_s=0.01)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # a caller that stops reading, say

    async def waiting() -> None:
        with deadlines.within(0.02):
            await never

    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting(), 10)
        assert not deadlines._due and not deadlines._expired
    finally:
        await deadlines.close()


async def test_a_block_done_in_time_leaves_nothing_behind_and_others_cancellations_stay_cancellations() -> None:
    deadlines = Deadlines(period_s=0.01)
    try:
        with deadlines.within(60):
            await asyncio.sleep(0)
        assert not deadlines._due

        started = asyncio.Event()

        async def cancelled_by_its_caller() -> None:
            with deadlines.within(60):
                started.set()
                await asyncio.get_running_loop().create_future()

        task = asyncio.create_task(cancelled_by_its_caller())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not deadlines._due
    finally:
        await deadlines.close()


async def test_a_run_is_followed_as_long_as_each_of_its_attempts_may_take_unable_ones_too() -> None:
    """Each provider but one may refuse a run as unable to do what it asks (`Retry.UNABLE`: none of
    `max_attempts` used up), and a refusal may come as late as the attempt's execution timeout. Three
    providers that each refused after 19 s of a 20 s execution timeout (`max_attempts: 1`) had the caller
    answered 504 `execution_timeout` at 52 s, while the third still ran (its 400 came at 57 s): the
    gateway added only a queue timeout for each of them."""
    from fakeredis import FakeAsyncRedis

    from common.config import parse_config
    from gateway.runs import FOLLOW_GRACE_S, RunClient

    config = parse_config({
        "models": [{"id": "m", "providers": {p: "s" for p in ("a", "b", "c")}}],
        "nodes": [{"id": "n1", "providers": [{"id": p, "type": "vllm", "base_url": "http://127.0.0.1:1",
                                              "capacity": 1, "models": ["s"]} for p in ("a", "b", "c")]}],
        "queue": {"max_attempts": 1, "queue_timeout_ms": 500, "execution_timeout_ms": 20_000}})
    redis = FakeAsyncRedis()
    client = RunClient(redis, config)
    try:
        longest_s = (0.5 + 20) * (1 + 2)  # (its one attempt, and one unable refusal on each other provider)
        assert client.follow_deadline_s("m") >= longest_s + FOLLOW_GRACE_S
    finally:
        await client.close()
        await redis.aclose()
