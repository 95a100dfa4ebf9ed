"""A reply lost on the way back: the command ran, the connection dropped before its answer
arrived, and redis-py (every service's client retries a dropped command, `client_options`) or
the worker's own retry loop sends it again. The scripts whose second run would do harm make
the same call once: a run is queued once, an output event is added once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.codec import pack, unpack
from common.config import RuntimeConfig
from common.redisconn import connect
from common.scripts import Scripts
from tests.conftest import async_wait_until, redis_full
from tests.test_runner import node_worker


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    """A client as the services make it (with their retry of a dropped command)."""
    r = connect(redis_url)
    await r.flushdb()
    yield r
    await r.aclose()


@contextmanager
def next_reply_lost(after: int = 0) -> Iterator[list[Any]]:
    """The next reply read on any connection (after `after` others) is read, then lost: the
    connection drops as it arrives. Yields the replies lost so (one, once it happened)."""
    lost: list[Any] = []
    original = AbstractConnection.read_response
    passed = 0

    async def read_response(self: AbstractConnection, *args: Any, **kwargs: Any) -> Any:
        nonlocal passed
        reply = await original(self, *args, **kwargs)
        if passed < after:
            passed += 1
            return reply
        if not lost:
            lost.append(reply)
            await self.disconnect()
            raise RedisConnectionError("the connection dropped as the reply arrived")
        return reply

    AbstractConnection.read_response = read_response
    try:
        yield lost
    finally:
        AbstractConnection.read_response = original


async def enqueue(scripts: Scripts, run_id: str) -> list[bytes]:
    result: list[bytes] = await scripts.call(
        "enqueue",
        [keys.runs_stream("m"), keys.run_record(run_id), keys.key_in_flight("k"), keys.key_requests("k"),
         keys.heartbeat("p"), keys.leases("p"), keys.capacity_override("p"), keys.drained("p"), keys.cordoned("n")],
        [run_id, 64, 600, "m", "chat", "0", pack({"model": "m"}), "k", 1, 0, 60_000, 3, "gw"])
    return result


async def test_a_run_whose_enqueue_reply_was_lost_is_queued_once_and_not_refused_by_its_own_limit(
        client: Redis) -> None:
    await client.hset(keys.heartbeat("p"), "health", "available")
    scripts = Scripts(client)
    await scripts.load()
    with next_reply_lost() as lost:
        answer = await enqueue(scripts, "run_a")
    assert lost and lost[0][0] == b"ok"  # the first call queued it; its answer was lost
    # the answer of the call made again: queued (under the first call's entry), not refused by
    # the key's max_in_flight of 1, which the run itself now fills
    assert answer[0] == b"ok" and answer[1] == lost[0][1]
    assert await client.xlen(keys.runs_stream("m")) == 1
    assert await client.zcard(keys.key_in_flight("k")) == 1
    assert (await enqueue(scripts, "run_b"))[0] == b"key_in_flight"  # the limit holds for another run


async def test_an_output_event_whose_emit_reply_was_lost_is_added_once(client: Redis) -> None:
    record, events = keys.run_record("run_e"), keys.run_events("run_e")
    await client.hset(record, mapping={"state": "running", "attempts": "2", "watchers": f"gw{keys.OUTPUT_ONLY}"})
    scripts = Scripts(client)
    await scripts.load()

    async def emit(n: int, data: str, attempt: str = "2") -> Any:
        return await scripts.call("emit", [record, events], [attempt, "delta", pack({"t": data}), 1000, "run_e", n])

    assert await emit(1, "a") == 1
    with next_reply_lost() as lost:
        assert await emit(2, "b") == 1
    assert lost == [1]
    assert await emit(3, "b") == 1  # the same output again, as a new emit: added
    assert [f[b"data"] for _, f in await client.xrange(events)] == [pack({"t": x}) for x in "abb"]
    assert await client.xlen(keys.gateway_inbox("gw")) == 3
    assert await client.hget(record, "output") == b"1"
    # the numbers are the attempt's own: another attempt's first emit is not taken for a repeat
    await client.hset(record, "attempts", "3")
    assert await emit(1, "c", attempt="3") == 1
    assert await client.xlen(events) == 4


async def test_an_emit_after_a_failover_lost_emits_its_reader_already_had_is_added(client: Redis) -> None:
    """A Sentinel failover: the old primary took emit 2 and its reader (the gateway) read it there;
    the promoted replica never got it. Emit 3 is added, and the reader, reading on from where it
    was, has the whole output: failing the run here failed callers who had every token (24 of 24
    runs so failed in a fault run of 6 failovers had all their worker's output)."""
    record, events = keys.run_record("run_g"), keys.run_events("run_g")
    await client.hset(record, mapping={"state": "running", "attempts": "1", "watchers": "gw"})
    scripts = Scripts(client)
    await scripts.load()

    async def emit(n: int) -> Any:
        return await scripts.call("emit", [record, events], ["1", "delta", pack({"n": n}), 1000, "run_g", n])

    assert [await emit(1), await emit(2)] == [1, 1]
    read = [unpack(fields[b"data"])["n"] for _, fields in await client.xrange(events)]
    last_id = (await client.xrevrange(events, count=1))[0][0]
    await client.xdel(events, last_id)  # (emit 2, lost with the old primary after its reader had it)
    await client.hset(record, "emitted", "1:1")
    assert await emit(3) == 1
    read += [unpack(fields[b"data"])["n"] for _, fields in await client.xrange(events, min=b"(" + last_id)]
    assert read == [1, 2, 3]


async def test_a_job_whose_take_reply_was_lost_is_handed_to_its_worker_again_not_left_to_its_lease(
        redis: Redis, redis_url: str) -> None:
    """The `take` made again finds the job in progress for this same worker (the first call
    started the run): the run is handed over as started, and runs now; before, it waited for its
    lease to expire (15 s) and was tried again. Not on the run's last possible attempt, whose
    start took its body out of Redis: that one is still left to its lease (and fails then)."""

    from tests.test_runner import TEXT, Scripted, fields, start_one
    from workers.arq_worker import WakeWorker
    from workers.runner import Runner

    async def lose_the_take_reply(max_attempts: int) -> tuple[str, WakeWorker]:
        await redis.flushdb()
        sched, run_id = await start_one(redis, {"a": 1}, max_attempts=max_attempts)
        runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
        worker = node_worker(redis_url, runner)
        with next_reply_lost() as lost:
            await worker.claim_and_start([run_id])
        assert lost and lost[0][0][:2] == [run_id.encode(), b"ok"]  # the first call started it
        return run_id, worker

    run_id, worker = await lose_the_take_reply(max_attempts=3)
    try:
        assert list(worker.tasks) == [run_id]
        assert await worker.tasks[run_id] == "completed:ok"
        assert await fields(redis, keys.run_record(run_id), "state", "attempts") == ["completed", "1"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)
    run_id, worker = await lose_the_take_reply(max_attempts=1)
    try:
        assert not worker.tasks
        assert await fields(redis, keys.run_record(run_id), "state") == ["running"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_woken_job_whose_take_reply_was_lost_is_handed_to_its_worker_again(
        redis: Redis, redis_url: str) -> None:
    """The same for the wake-up's `take_woken`, sent with the `BLMOVE`: its answer lost (the
    `BLMOVE`'s came), both go out again, and the script hands over again the run its lost answer
    started, which its worker's list kept (the worker had not said it received it)."""

    from tests.test_runner import TEXT, Scripted, fields, start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1}, max_attempts=3)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    try:
        with next_reply_lost(after=1) as lost:
            assert await worker._wait_for_work() is True  # (the BLMOVE made again waited, for nothing)
        assert lost and lost[0][0][:2] == [run_id.encode(), b"ok"]  # the lost answer started it
        assert list(worker.tasks) == [run_id]
        assert await worker.tasks[run_id] == "completed:ok"
        assert await fields(redis, keys.run_record(run_id), "state", "attempts") == ["completed", "1"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_woken_job_whose_take_reply_came_is_not_handed_over_again(redis: Redis, redis_url: str) -> None:
    """The worker's next `take_woken` says which ids it received: its list drops them, and their
    runs (running, nothing sent yet) are not handed over a second time."""

    from tests.test_cancel import StallingAdapter
    from tests.test_runner import start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": StallingAdapter()})
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    answered = keys.worker_answered(worker.instance)
    try:
        assert await worker._wait_for_work() is False
        assert list(worker.tasks) == [run_id]
        assert await redis.get(answered) == f"{run_id}:1".encode()  # until the next call says received
        assert 0 < await redis.pttl(answered) <= sched.config.runtime.lease_ttl_ms  # (as long as an unrenewed lease)
        assert not await redis.exists(keys.worker_woken(worker.instance))  # (the moved id was taken)
        taken, came, refused = await worker._take_woken(1)
        assert (taken, came, refused) == ([], False, None) and not await redis.exists(answered)
        worker.tasks[run_id].cancel()
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_run_handed_over_again_is_not_run_twice_when_its_task_ended_before_the_answer_came(
        redis: Redis, redis_url: str) -> None:
    """arq's poll took a run (its task sends it to the provider), and the wake-up's `take_woken`
    ran in Redis while it ran: the run was running on this worker with no output yet, so the
    script handed it over again. The task ended (the provider answered, the run completed) before
    that answer was read: the answer's run is the one it ran, not one to run again. (A clean-clone
    CI saw the provider run it twice: `_start` forgot ended tasks before it compared.)"""

    from tests.test_runner import fields, start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1}, stream=False)  # (its id is in the node's wake list too)
    provider = Gated()
    runner = Runner(redis, sched.config, "n-a", {"a": provider})  # type: ignore[dict-item]
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    try:
        await worker.claim_and_start([run_id])  # as arq's poll does
        first = worker.tasks[run_id]
        await async_wait_until(lambda: asyncio.sleep(0, provider.calls == 1), what="the run to reach its provider")
        taken, woken, _ = await worker._take_woken(1)
        assert woken and [t[:2] for t in taken] == [[run_id.encode(), b"ok"]]  # handed over again
        provider.go.set()
        assert await first == "completed:ok"
        await worker._start(taken)
        await asyncio.gather(*worker.tasks.values())  # (a second task, had one started, runs to its end)
        assert provider.calls == 1
        assert await fields(redis, keys.run_record(run_id), "state") == ["completed"]
    finally:
        for task in worker.tasks.values():
            task.cancel()
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_worker_never_asks_for_a_job_it_runs(redis: Redis, redis_url: str) -> None:
    """`take` hands a job in progress for the asking worker over again, so the worker must not
    ask for the jobs it runs (arq's poll lists every due job, those in progress included)."""

    from tests.test_cancel import StallingAdapter
    from tests.test_runner import start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": StallingAdapter()})
    worker = node_worker(redis_url, runner)
    try:
        await worker.claim_and_start([run_id])
        first = worker.tasks[run_id]
        await worker.claim_and_start([run_id])  # as its poll would, while the run goes on
        assert worker.tasks[run_id] is first and worker.job_counter == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_job_one_worker_runs_is_not_handed_to_another_worker_of_the_same_process(
        redis: Redis, redis_url: str) -> None:
    """Each worker is an instance of its own: two workers of one process (one `iop worker` runs
    one; an embedding or a test may run more) never get each other's jobs handed over."""

    from tests.test_cancel import StallingAdapter
    from tests.test_runner import start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": StallingAdapter()})
    first, second = node_worker(redis_url, runner), node_worker(redis_url, runner)
    try:
        await first.claim_and_start([run_id])
        await second.claim_and_start([run_id])  # its poll lists the job the first one runs
        assert list(first.tasks) == [run_id] and not second.tasks and second.job_counter == 0
        first.tasks[run_id].cancel()
        await asyncio.gather(*first.tasks.values(), return_exceptions=True)
    finally:
        for worker in (first, second):
            await worker.pool.aclose(close_connection_pool=True)


async def test_arq_s_poll_leaves_out_the_jobs_a_worker_runs_before_counting_its_free_slots(
        redis: Redis, redis_url: str) -> None:
    """arq's poll lists every due job of the node, those this worker runs included: they must not
    take the places of new ones (a worker with one free slot takes the new job)."""

    from tests.test_cancel import StallingAdapter
    from tests.test_scheduler import make_config, waiting_runs
    from workers.runner import Runner

    config = make_config({"a": 2}, queue={"max_queue": 10, "queue_timeout_ms": 60_000})
    _, sched, (first, second) = await waiting_runs(redis, config, 2)
    await sched.dispatch_all()
    runner = Runner(redis, config, "n-a", {"a": StallingAdapter()})
    worker = node_worker(redis_url, runner, max_jobs=2)
    try:
        await worker.claim_and_start([first])
        await worker.start_jobs([first.encode(), second.encode()])  # one slot free, its own job listed first
        assert sorted(worker.tasks) == sorted([first, second]) and worker.job_counter == 2
    finally:
        for task in worker.tasks.values():
            task.cancel()
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_worker_restarted_in_place_is_not_handed_its_predecessor_s_job(redis: Redis) -> None:
    """A container's worker restarted by its restart policy has the same host and pid (1) as the
    one that died, but is another instance: the dead one's run goes through its lease and the
    reaper, and counts an attempt (else a run that crashes its worker would never reach
    max_attempts)."""
    from tests.test_runner import start_one
    from workers.runner import WORKER_ID

    sched, run_id = await start_one(redis, {"a": 1})
    scripts = Scripts(redis)
    runner_args = [in_progress_prefix(), 60_000, keys.run_record(""), keys.run_events(""), keys.leases(""),
                   sched.config.runtime.lease_ttl_ms, sched.config.runtime.run_ttl_s, WORKER_ID, pack({}),
                   keys.SCHEDULER_SIGNALS]
    queue = [keys.node_queue("n-a")]
    first = await scripts.call("take", queue, [*runner_args, f"{WORKER_ID}:before", "", "", run_id])
    assert [t[:2] for t in first] == [[run_id.encode(), b"ok"]]
    assert await scripts.call("take", queue, [*runner_args, f"{WORKER_ID}:after", "", "", run_id]) == []
    again = await scripts.call("take", queue, [*runner_args, f"{WORKER_ID}:before", "", "", run_id])
    assert [t[:2] for t in again] == [[run_id.encode(), b"ok"]]  # the same instance, its answer lost


#: a live worker's score in `iop:workers:{node}` (ms: long after now)
LIVE_UNTIL = 10**13


class NodeOfTwo:
    """A run dispatched to provider a of node n-a, whose live workers are `old` (its config lacks
    the run's model there) and `new` (it serves it), each with its `iop:serves` set; and the
    arguments of the `take` scripts for one of them."""

    def __init__(self, redis: Redis, run_id: str, rt: RuntimeConfig) -> None:
        self.redis, self.run_id, self.rt = redis, run_id, rt
        self.scripts = Scripts(redis)
        self.workers, self.wake, self.passed = keys.node_workers("n-a"), keys.node_wake("n-a"), keys.node_passed("n-a")

    @classmethod
    async def start(cls, redis: Redis) -> NodeOfTwo:
        from tests.test_runner import start_one

        sched, run_id = await start_one(redis, {"a": 1})
        node = cls(redis, run_id, sched.config.runtime)
        model = (await redis.hget(keys.run_record(run_id), "model") or b"").decode()
        await redis.zadd(node.workers, {"old": LIVE_UNTIL, "new": LIVE_UNTIL})
        await redis.sadd(keys.worker_serves("old"), "a\tsome-other-model")
        await redis.sadd(keys.worker_serves("new"), f"a\t{model}")
        return node

    def args(self, instance: str) -> list[Any]:
        """The `take` scripts' first 13 arguments, for the worker `instance`."""
        from workers.runner import WORKER_ID

        return [in_progress_prefix(), 60_000, keys.run_record(""), keys.run_events(""), keys.leases(""),
                self.rt.lease_ttl_ms, self.rt.run_ttl_s, WORKER_ID, pack({}), keys.SCHEDULER_SIGNALS, instance,
                keys.worker_serves(""), self.workers]

    async def take(self, instance: str) -> list[Any]:
        return list(await self.scripts.call("take", [keys.node_queue("n-a")], [*self.args(instance), self.run_id]))

    async def take_woken(self, instance: str) -> list[Any]:
        """What `instance`'s `take_woken` started or passed over ([id, status] of each), 4 slots free."""
        script_keys = [keys.node_queue("n-a"), keys.worker_woken(instance), keys.worker_answered(instance),
                       self.wake, self.passed]
        taken = await self.scripts.call("take_woken", script_keys, [*self.args(instance), 4])
        return [t[:2] for t in taken]


async def test_a_worker_passes_over_a_run_it_does_not_serve_only_while_another_of_the_node_does(
        redis: Redis) -> None:
    """The `take` script checks the run's `provider<TAB>model` against the worker's set
    (`iop:serves:{instance}`): one it lacks is passed over, left in the node's queue with no
    marker, while another live worker of the node serves it or has no set to say (an older
    version); with no such worker, or with no set of its own (not written yet, lost with Redis),
    the run starts here as before."""
    node = await NodeOfTwo.start(redis)
    run_id = node.run_id
    model = (await redis.hget(keys.run_record(run_id), "model") or b"").decode()
    assert await node.take("old") == [[run_id.encode(), b"passed", b"a", model.encode()]]
    assert await redis.zscore(keys.node_queue("n-a"), run_id) is not None  # (still queued)
    assert not await redis.exists(in_progress_prefix() + run_id)  # (no marker: free to take)
    assert (await redis.hget(keys.run_record(run_id), "state")) == b"dispatched"

    await redis.delete(keys.worker_serves("new"))  # an older version: it says nothing, so it may
    assert [t[:2] for t in await node.take("old")] == [[run_id.encode(), b"passed"]]

    await redis.zrem(node.workers, "new")  # no other worker: it starts here (its own check fails it)
    assert [t[:2] for t in await node.take("old")] == [[run_id.encode(), b"ok"]]


async def test_a_run_passed_over_off_the_wake_list_is_taken_first_by_a_worker_that_serves_it(redis: Redis) -> None:
    """`take_woken`: a run the old worker took off the wake list and passed over goes to the
    node's passed list, and the next `take_woken` of a worker that serves it takes it from there
    (before its wake list), not at arq's next poll; a worker that does not serve it leaves it there."""
    node = await NodeOfTwo.start(redis)
    run_id, wake, passed = node.run_id.encode(), node.wake, node.passed
    assert await redis.lrange(wake, 0, -1) == [run_id]
    assert await node.take_woken("old") == [[run_id, b"passed"]]
    # (back on the wake list once, for a serving worker blocked there: see the test below)
    assert await redis.lrange(passed, 0, -1) == [run_id] and await redis.lrange(wake, 0, -1) == [run_id]
    assert 0 < await redis.pttl(wake) <= node.rt.lease_ttl_ms  # (as `dispatch` leaves it: test_scheduler)
    assert await node.take_woken("old") == [[run_id, b"passed"]]
    assert await redis.lrange(passed, 0, -1) == [run_id] and not await redis.llen(wake)
    assert await node.take_woken("old") == [] and await redis.llen(passed) == 1  # (not its own: left there)
    assert await node.take_woken("new") == [[run_id, b"ok"]]
    assert not await redis.exists(passed)


async def test_a_run_passed_over_wakes_a_worker_that_serves_it_blocked_on_the_wake_list(
        redis: Redis, redis_url: str) -> None:
    """A run the old worker passed over goes back on the wake list, once: the worker that serves it,
    blocked there (idle), takes it now. It waited for that worker's wait to end before (poll_delay,
    a second): most runs of a rollout half done, at a low rate, took a second more. The one worker's
    list holds it once, and its `take_woken` takes it once (from its own list and the passed list)."""
    node = await NodeOfTwo.start(redis)
    run_id = node.run_id.encode()
    await redis.rpoplpush(node.wake, keys.worker_woken("old"))  # (the old worker's BLMOVE got it)
    blocked = Redis.from_url(redis_url)  # the serving worker, idle, blocked on the wake list
    try:
        move = asyncio.create_task(blocked.blmove(node.wake, keys.worker_woken("new"), 5.0, "RIGHT", "LEFT"))
        await async_wait_until(lambda: _blocked_clients(redis), what="the serving worker blocked")
        assert await node.take_woken("old") == [[run_id, b"passed"]]
        assert await asyncio.wait_for(move, 1.0) == run_id  # woken now, not in 5 s
    finally:
        await blocked.aclose()
    assert await node.take_woken("new") == [[run_id, b"ok"]]  # (once: its own list and the passed list)
    assert not await redis.exists(node.passed) and not await redis.llen(node.wake)


async def test_a_passed_run_no_live_worker_serves_any_more_is_taken_by_one_that_lacks_it(redis: Redis) -> None:
    """The worker that served it stopped or died after the run was passed over: the next
    `take_woken` of the node takes it from the passed list and starts it (its own check fails it,
    and it goes back to its queue), instead of leaving it for its lease."""
    node = await NodeOfTwo.start(redis)
    run_id = node.run_id.encode()
    assert await node.take_woken("old") == [[run_id, b"passed"]]
    await redis.delete(node.wake)  # (its one wake-up went to nobody)
    assert await redis.lrange(node.passed, 0, -1) == [run_id]
    await redis.zrem(node.workers, "new")  # the serving worker is gone
    assert await node.take_woken("old") == [[run_id, b"ok"]]
    assert not await redis.exists(node.passed)


async def test_a_passed_list_at_its_cap_keeps_the_newest_and_the_oldest_is_still_taken_from_the_node_s_queue(
        redis: Redis) -> None:
    """`iop:passed:{node}` holds at most 1,024 runs: the 1,025th run passed over goes in (first in
    line for a serving worker, as every one passed over), and the oldest leaves the list. That one
    is not lost: its job stays in the node's queue with its lease and no marker, and a serving
    worker's poll of the queue (arq's, `take`) starts it; unpolled, its lease lapses and it is
    requeued as a lost run (`REAP`). The passing worker does not put runs listed already back on the
    wake list (no hand-round), and a serving worker takes the listed ones from the list, oldest first."""
    from tests.test_scheduler import MODEL, beat, make_config, submit, waiting_runs

    config = make_config({"a": 1100})
    client, sched, run_ids = await waiting_runs(redis, config, 1024)

    async def dispatched() -> bool:  # (the replica reads 256 at a time; a slow machine's beats kept fresh)
        await beat(redis, config)
        await sched.read_new(block_ms=10)
        await sched.dispatch_all()
        return not await redis.xlen(keys.runs_stream(MODEL))
    await async_wait_until(dispatched, what="the runs dispatched")
    node = NodeOfTwo(redis, run_ids[0], config.runtime)
    await redis.zadd(node.workers, {"old": LIVE_UNTIL, "new": LIVE_UNTIL})
    await redis.sadd(keys.worker_serves("old"), "a\tsome-other-model")
    await redis.sadd(keys.worker_serves("new"), f"a\t{MODEL}")
    script_keys = [keys.node_queue("n-a"), keys.worker_woken("old"), keys.worker_answered("old"), node.wake,
                   node.passed]

    async def old_takes() -> list[bytes]:
        return [t[1] for t in await node.scripts.call("take_woken", script_keys, [*node.args("old"), 2000])]

    assert await old_takes() == [b"passed"] * 1024
    assert await redis.llen(node.passed) == 1024 and await redis.llen(node.wake) == 1024  # (each back once)
    assert await old_takes() == [b"passed"] * 1024  # listed already: not put back again
    assert not await redis.llen(node.wake)

    run_ids += await submit(client, 1)
    await async_wait_until(dispatched, what="the 1,025th dispatched")
    assert await old_takes() == [b"passed"]
    assert [i.decode() for i in await redis.lrange(node.passed, 0, -1)] == run_ids[:0:-1]  # (newest first)
    oldest = run_ids[0]
    assert await redis.zscore(keys.node_queue("n-a"), oldest) is not None
    assert not await redis.exists(in_progress_prefix() + oldest)
    assert await redis.hget(keys.run_record(oldest), "state") == b"dispatched"

    # a serving worker: the listed ones from the list, oldest first; the one left out by its poll
    assert await node.take_woken("new") == [[i.encode(), b"ok"] for i in run_ids[1:5]]
    assert [t[:2] for t in await node.take("new")] == [[oldest.encode(), b"ok"]]


async def _blocked_clients(redis: Redis) -> bool:
    return int((await redis.info("clients"))["blocked_clients"]) > 0


async def test_a_worker_whose_set_redis_lost_passes_over_only_what_another_s_set_names(redis: Redis) -> None:
    """No `iop:serves:{instance}` of its own (a worker writes it before its first take, so Redis lost
    it, restarted without persistence, or it lapsed; its next beat writes it again): a run that another
    live worker's set names is passed over to that worker. It was taken and failed by the worker that
    lacks it ("model 'm-b' is not in the config of node n1's worker": 503 with max_attempts 1, for
    runs dispatched between the serving worker's first beat after a Redis restart and its own). A run
    no other worker's set names is taken, as before (one without a set says nothing)."""
    node = await NodeOfTwo.start(redis)
    run_id = node.run_id.encode()
    await redis.delete(keys.worker_serves("old"))
    assert [t[:2] for t in await node.take("old")] == [[run_id, b"passed"]]
    await redis.delete(keys.worker_serves("new"))  # (lost too: neither says)
    assert [t[:2] for t in await node.take("old")] == [[run_id, b"ok"]]


async def test_a_worker_that_serves_a_run_it_passed_over_does_not_say_its_config_lacks_it(
        redis: Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker passes over a run it serves only while Redis has lost its set (above): it does not
    tell the operator its config lacks the model (a WARNING that sent one to check a config that was
    right), and still says so of a run its config does lack."""
    import logging

    from tests.test_runner import Scripted, start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1})
    model = (await redis.hget(keys.run_record(run_id), "model") or b"").decode()
    worker = node_worker(redis_url, Runner(redis, sched.config, "n-a", {"a": Scripted([])}))
    try:
        with caplog.at_level(logging.INFO, logger="iop.worker"):
            worker._passed_over(run_id, "a", model)
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert "until this worker's next heartbeat" in caplog.text
            worker._passed_over(run_id, "a", "another-model")
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
                "runs of model 'another-model' on provider a are left to the node's other workers: this worker's "
                "config lacks model 'another-model' (a rollout half done: restart it with the config the schedulers "
                "run)"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


def in_progress_prefix() -> str:
    from arq.constants import in_progress_key_prefix
    return in_progress_key_prefix


async def test_a_wake_up_a_full_redis_refuses_still_runs_what_its_script_started(
        redis: Redis, redis_url: str) -> None:
    """At `maxmemory` Redis refuses the worker's `BLMOVE`, while `take_woken`, sent with it, runs
    (its first write frees, so Redis lets the rest through) and starts the run: the worker runs it,
    then backs off (the refusal is raised after). Its answer was thrown away before: the run stayed
    `running` on no worker until its lease went."""

    from redis.exceptions import OutOfMemoryError

    from tests.test_runner import TEXT, Scripted, fields, start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1}, max_attempts=1)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    async with redis_full(redis):
        with pytest.raises(OutOfMemoryError):
            await worker._wait_for_work()
        assert list(worker.tasks) == [run_id]  # started here, before the refusal was raised
    try:
        assert await worker.tasks[run_id] == "completed:ok"
        assert await fields(redis, keys.run_record(run_id), "state") == ["completed"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_job_task_that_ends_cancelled_does_not_stop_the_worker_loop(
        redis: Redis, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A run's task ends with its outcome; should one ever end cancelled (a bug: a run cancelled
    twice did), the loop that forgets finished tasks goes on, with an ERROR line. It raised the
    CancelledError before, which ended the loop, and the process exited 0 as if stopped."""
    import logging

    from tests.test_runner import start_one
    from workers.runner import Runner

    sched, _ = await start_one(redis, {"a": 1})
    worker = node_worker(redis_url, Runner(redis, sched.config, "n-a", {}))
    try:
        task = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        worker.tasks["run_gone"] = task
        with caplog.at_level(logging.ERROR, "iop.worker"):
            worker._forget_finished()
        assert worker.tasks == {} and "a run's task ended cancelled" in caplog.text
    finally:
        await worker.pool.aclose(close_connection_pool=True)


class Gated:
    """A provider that answers a whole completion once let."""

    def __init__(self) -> None:
        self.calls = 0
        self.go = asyncio.Event()

    async def complete(self, kind: Any, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.calls += 1
        await self.go.wait()
        return {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}

    async def probe(self) -> Any:
        raise AssertionError("not probed here")

    async def close(self) -> None:
        return None


async def test_a_run_whose_ended_task_arq_s_poll_forgets_leaves_no_attempt_behind(redis: Redis, redis_url: str) -> None:
    """arq's own poll (`_poll_iteration`, run when a wait on the wake list ran out) forgets the
    tasks of `tasks` that ended while it asked Redis for due jobs: the attempt the worker noted for
    each (`_attempts`) goes with it. Before, it stayed for the worker's life: a soak of 8 minutes
    left 54 in a worker whose tasks held 6, one more every few runs, for good."""

    from tests.test_runner import start_one
    from workers.runner import Runner

    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    provider = Gated()
    worker = node_worker(redis_url, Runner(redis, sched.config, "n-a", {"a": provider}))  # type: ignore[dict-item]
    claim_and_start = worker.claim_and_start

    async def the_run_ends_meanwhile(job_ids: list[str]) -> None:
        await claim_and_start(job_ids)  # (the poll's `take`, after it forgot what had ended before)
        provider.go.set()
        await asyncio.wait([worker.tasks[run_id]])

    try:
        await worker.claim_and_start([run_id])
        await async_wait_until(lambda: asyncio.sleep(0, provider.calls == 1), what="the run to reach its provider")
        assert worker._attempts == {run_id: b"1"}
        worker.claim_and_start = the_run_ends_meanwhile  # type: ignore[method-assign]
        await worker._poll_iteration()
        assert worker.tasks == {} and worker._attempts == {}
    finally:
        provider.go.set()
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.pool.aclose(close_connection_pool=True)
