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
