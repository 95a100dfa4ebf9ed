"""Keys of iop's written by hand with another type (`redis-cli SET iop:node:n1 x`): Redis answers
WRONGTYPE to every command of iop's on them, for good. Those that hold only what iop writes there
are deleted, and said (a WARNING names the key), by the process whose loop met the error, or the
script's write that could fail midway is not made (a script's writes before an error stay).
Against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from common import keys
from tests.conftest import async_wait_until
from tests.test_runner import TEXT, Scripted, fields, node_worker, start_one
from workers.runner import Runner


@pytest.mark.parametrize("key", [keys.node_queue("n-a"), keys.node_wake("n-a"), keys.node_passed("n-a")])
async def test_a_key_of_the_node_s_pick_up_of_another_type_is_deleted_and_said_and_the_worker_goes_on(
        redis: Redis, redis_url: str, caplog: pytest.LogCaptureFixture, key: str) -> None:
    """`SET iop:node:n1 x` (or its wake list, its passed list): the worker's poll or wake-up failed with
    WRONGTYPE and the worker process exited (status 1), and so did every worker of the node started
    after it, until someone deleted the key. The worker deletes it, says so, and runs the node's runs."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    await redis.delete(key)  # (the run's job stays in the queue when the wake list or passed list is hit)
    if key == keys.node_queue("n-a"):
        await redis.set(key, "x")
    else:
        await redis.hset(key, "a", "b")
    main = asyncio.create_task(worker.main())
    try:
        async def healed() -> bool:
            assert not main.done(), main.exception()
            return await redis.type(key) not in (b"hash", b"string")
        await async_wait_until(healed, what="the key deleted")
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "deleted" in r.getMessage()]
        assert len(said) == 1 and key in said[0], said
        if key != keys.node_queue("n-a"):  # (its job was in the queue the operator overwrote)
            async def done() -> bool:
                assert not main.done(), main.exception()
                return (await fields(redis, keys.run_record(run_id), "state"))[0] == "completed"
            await async_wait_until(done, what="the run run")
        assert not main.done()
    finally:
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.pool.aclose(close_connection_pool=True)
