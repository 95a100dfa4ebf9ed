"""Calls of one script from many tasks go to a real Redis together, and every caller gets its own
answer or error, never a wait without end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.redisconn import connect
from common.redisline import may_have_run
from common.script_batch import SLOW_FAILURE_S, ScriptBatch
from common.scripts import Scripts
from iop.embedded_redis import RedisServer
from tests.conftest import async_wait_until, paused


def counting(scripts: Scripts) -> list[int]:
    """The calls of each round trip `scripts` makes, as they happen."""
    trips: list[int] = []
    call_many = scripts.call_many

    async def counted(name: str, calls: Any) -> list[Any]:
        trips.append(len(calls))
        return await call_many(name, calls)

    scripts.call_many = counted  # type: ignore[method-assign]
    return trips


async def watch(batch: ScriptBatch, run_id: str) -> Any:
    """The `watch` script: 1 if the run's record exists (and now has watcher gw), else 0."""
    return await batch.call([keys.run_record(run_id)], ["gw"])


async def test_the_calls_of_one_turn_go_in_one_round_trip_each_with_its_own_answer(redis: Redis) -> None:
    scripts = Scripts(redis)
    await scripts.load()
    trips = counting(scripts)
    batch = ScriptBatch(scripts, "watch", max_batch=50)
    for i in range(0, 120, 2):
        await redis.hset(keys.run_record(f"run_{i}"), "state", "queued")
    answers = await asyncio.gather(*(watch(batch, f"run_{i}") for i in range(120)))
    assert answers == [1 - i % 2 for i in range(120)]  # each its own: the even runs exist
    assert trips == [50, 50, 20]
    assert await redis.hget(keys.run_record("run_4"), "watchers") == b"gw"
    assert await watch(batch, "run_0") == 1  # alone later: a round trip of one
    assert trips[-1] == 1


async def test_scripts_redis_forgot_are_loaded_and_called(redis: Redis) -> None:
    scripts = Scripts(redis)
    batch = ScriptBatch(scripts, "watch")
    await redis.hset(keys.run_record("run_a"), "state", "queued")
    await redis.script_flush()
    await redis.config_resetstat()
    assert list(await asyncio.gather(watch(batch, "run_a"), watch(batch, "run_b"))) == [1, 0]
    evalsha = (await redis.info("commandstats"))["cmdstat_evalsha"]
    assert (evalsha["calls"], evalsha["failed_calls"]) == (4, 2)  # both found it missing, then both were called again
    await redis.script_flush()
    assert await watch(batch, "run_a") == 1


async def test_a_call_that_fails_fails_alone(redis: Redis) -> None:
    batch = ScriptBatch(Scripts(redis), "watch")
    await redis.hset(keys.run_record("run_s"), "state", "queued")
    await redis.hset(keys.run_record("run_h"), "state", "queued")
    # (a call without its gateway id: the script's HSET of none fails; a record of another type, which
    # failed it before, is a run gone to it now)
    answers: list[Any] = list(await asyncio.gather(batch.call([keys.run_record("run_s")], []), watch(batch, "run_h"),
                                                   return_exceptions=True))
    wrong, right = answers
    assert isinstance(wrong, ResponseError) and "must be strings or integers" in str(wrong), wrong
    assert right == 1


async def test_when_redis_is_away_every_caller_hears_it() -> None:
    redis = Redis.from_url("redis://127.0.0.1:1")  # nothing listens there
    batch = ScriptBatch(Scripts(redis), "watch")
    try:
        answers = await asyncio.wait_for(
            asyncio.gather(*(watch(batch, f"run_{i}") for i in range(5)), return_exceptions=True), 10)
        assert all(isinstance(a, RedisConnectionError) for a in answers), answers
    finally:
        await redis.aclose()


async def test_a_caller_that_leaves_does_not_hold_up_the_others(redis: Redis) -> None:
    batch = ScriptBatch(Scripts(redis), "watch")
    await redis.hset(keys.run_record("run_k"), "state", "queued")
    leaving = asyncio.create_task(watch(batch, "run_k"))
    staying = asyncio.create_task(watch(batch, "run_k"))
    await asyncio.sleep(0)  # both have joined the batch
    leaving.cancel()
    assert await asyncio.wait_for(staying, 10) == 1
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def left_at_once(batch: ScriptBatch, run_id: str, what: str) -> list[Any]:
    """What a `watch` call whose caller left as soon as it joined the batch gave its `if_left`."""
    left: list[Any] = []
    leaving = asyncio.create_task(batch.call([keys.run_record(run_id)], ["gw"], left.append))
    await asyncio.sleep(0)  # it has joined the batch
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving

    async def heard() -> bool:
        return bool(left)

    await async_wait_until(heard, what=what)
    return left


async def test_a_caller_that_leaves_still_gets_its_answer_to_undo_it(redis: Redis) -> None:
    batch = ScriptBatch(Scripts(redis), "watch")
    await redis.hset(keys.run_record("run_u"), "state", "queued")
    left = await left_at_once(batch, "run_u", "the call to be made all the same")
    assert left == [1] and await redis.hget(keys.run_record("run_u"), "watchers") == b"gw"


async def test_a_caller_that_leaves_hears_none_when_redis_did_not_answer_in_time() -> None:
    """Redis may still make the call once it resumes (a paused Redis runs what it had received):
    the caller's undo runs with None, an unknown outcome (it heard nothing before)."""
    server = RedisServer().start()
    redis = connect(server.url + "?socket_timeout=0.2")
    batch = ScriptBatch(Scripts(redis), "watch")
    try:
        await redis.ping()
        with paused(server):
            left = await left_at_once(batch, "run_p", "the call to time out")
        assert left == [None]
    finally:
        await redis.aclose()
        server.cleanup()


async def test_calls_made_while_a_round_trip_is_on_its_way_wait_and_go_together_in_the_next(redis: Redis) -> None:
    """A burst is packed only as fast as Redis answers: one pipeline on its way at a time (the
    default), the calls made meanwhile held unpacked, then sent in one."""
    scripts = Scripts(redis)
    await scripts.load()
    trips: list[int] = []
    call_many = scripts.call_many
    answered = asyncio.Event()

    async def held_first(name: str, calls: Any) -> list[Any]:
        trips.append(len(calls))
        if len(trips) == 1:
            await answered.wait()  # the first round trip is on its way until the test says
        return await call_many(name, calls)

    scripts.call_many = held_first  # type: ignore[method-assign]
    batch = ScriptBatch(scripts, "watch", max_batch=2)
    await redis.hset(keys.run_record("run_0"), "state", "queued")
    first = asyncio.create_task(watch(batch, "run_0"))
    await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
    later = [asyncio.create_task(watch(batch, f"run_{i}")) for i in range(5)]
    for _ in range(5):  # turns of the loop in which a second round trip could have gone
        await asyncio.sleep(0)
    assert trips == [1]
    answered.set()
    assert await first == 1
    assert await asyncio.gather(*later) == [1, 0, 0, 0, 0]
    assert trips == [1, 2, 2, 1]  # then one at a time again, `max_batch` each


async def _true(value: Any) -> bool:
    return bool(value)


async def test_calls_waiting_behind_a_round_trip_redis_did_not_answer_hear_it_at_once_as_never_sent() -> None:
    """Redis stopped answering: the calls behind the one on its way are not sent in turn, each to
    wait out the timeout again; they fail with it, and say they did not run (no undo needed)."""
    server = RedisServer().start()
    redis = connect(server.url + "?socket_timeout=0.3")
    scripts = Scripts(redis)
    trips = counting(scripts)
    batch = ScriptBatch(scripts, "watch")
    try:
        await scripts.load()
        with paused(server):
            first = asyncio.create_task(watch(batch, "run_t"))
            await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
            behind = [asyncio.create_task(watch(batch, f"run_{i}")) for i in range(4)]
            answers = await asyncio.wait_for(asyncio.gather(first, *behind, return_exceptions=True), 20)
        assert all(isinstance(a, RedisTimeoutError) for a in answers), answers
        assert [may_have_run(a) for a in answers] == [True, False, False, False, False]
        assert trips == [1]  # the calls behind it were never sent
        assert await watch(batch, "run_t") == 0  # and Redis back, calls go again
    finally:
        await redis.aclose()
        server.cleanup()


@pytest.mark.parametrize("slow_s", [SLOW_FAILURE_S, 0.0], ids=["quick", "however-long"])
async def test_calls_waiting_behind_a_round_trip_that_found_no_connection_get_tries_of_their_own(
        slow_s: float) -> None:
    """A lost or refused connection fails a round trip within its retries (not after a timeout):
    the calls that waited behind it are sent next, with retries of their own, and Redis may be
    back by then (a restart, a Sentinel failover: failed at once with the first, a burst's callers
    of the second or so of the failover heard 503 where each would have been answered). However
    long those retries took (`slow_s` 0: every round trip slow): through a Sentinel pool those of
    a refused connection take 1.42-1.49 s, the retries of the connect within those of the
    command, and which side of 1.5 s depends on the load, not on whether Redis is coming back (a
    failover's 4 s, two busy processes on 2 cores: one took 1.68 s and 1,404 of 1,500 callers
    heard 503, against 513-580 when the calls behind it went next)."""
    server = RedisServer().start()
    redis = connect(server.url)
    scripts = Scripts(redis)
    trips: list[int] = []
    call_many = scripts.call_many
    answered, back = asyncio.Event(), asyncio.Event()

    async def held(name: str, calls: Any) -> list[Any]:
        trips.append(len(calls))
        await (answered if len(trips) == 1 else back).wait()
        return await call_many(name, calls)

    scripts.call_many = held  # type: ignore[method-assign]
    batch = ScriptBatch(scripts, "watch", slow_s=slow_s)
    try:
        await scripts.load()
        first = asyncio.create_task(watch(batch, "run_0"))
        await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
        behind = [asyncio.create_task(watch(batch, f"run_{i}")) for i in range(1, 4)]
        server.stop(kill=True)
        answered.set()
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(first, 20)
        assert not any(task.done() for task in behind)  # not failed with it: they go next
        server = RedisServer(port=server.port, dir=server.dir).start()  # (Redis back: a restart)
        back.set()
        assert await asyncio.wait_for(asyncio.gather(*behind), 20) == [0, 0, 0]
        assert trips == [1, 3]
    finally:
        await redis.aclose()
        server.cleanup()


async def test_calls_waiting_behind_a_round_trip_that_failed_slowly_hear_it_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A round trip that failed only after a wait, not at once (the sentinels cut off: the kernel
    takes their connections, nobody answers, and no primary is found within `SENTINEL_TIMEOUT_S`;
    a gateway cut off from Redis's hosts): the calls behind it would each wait as long again, in
    turn, 256 a round trip, a backlog that grows with every caller arriving meanwhile (the last of
    a burst of 5,000 waited 20 such waits). They fail with it at once, as calls never sent."""
    from common import redisconn
    from tests.test_redisconn import silent_sentinels

    monkeypatch.setattr(redisconn, "SENTINEL_TIMEOUT_S", 0.6)
    servers = await silent_sentinels([])
    hosts = ",".join(f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    redis = connect(f"redis+sentinel://{hosts}/mymaster/0")
    scripts = Scripts(redis)
    trips = counting(scripts)
    batch = ScriptBatch(scripts, "watch", slow_s=0.3)
    try:
        first = asyncio.create_task(watch(batch, "run_t"))
        await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
        behind = [asyncio.create_task(watch(batch, f"run_{i}")) for i in range(4)]
        answers = await asyncio.wait_for(asyncio.gather(first, *behind, return_exceptions=True), 20)
    finally:
        await redis.aclose()
        for server in servers:
            server.close()
    assert all(isinstance(a, RedisConnectionError) for a in answers), answers
    assert str(answers[1]).startswith("No master found for 'mymaster'")
    assert not any(may_have_run(a) for a in answers)
    assert trips == [1]  # the calls behind it were never sent


async def test_a_call_that_has_waited_long_behind_failed_round_trips_fails_with_the_next() -> None:
    """While Redis refuses connections, the calls behind a failed round trip went next, 256 at a time,
    each round trip failing after its retries (~1.45 s through a Sentinel pool): a wait that grew
    with every caller arriving meanwhile (1,500 callers in a second waited up to 9.3 s). At a round
    trip's failure, a call that has waited `max_wait_s` fails with it, as never sent; the others go
    next (a failover of a few seconds answers them: a call that waited behind one failure only, as
    tried first, turned away 1,292-1,389 of 1,500 callers in a failover of 4 s under load, where
    513-769 heard 503 when all went next)."""
    server = RedisServer().start()
    redis = connect(server.url)
    scripts = Scripts(redis)
    trips: list[int] = []
    call_many = scripts.call_many
    gates = [asyncio.Event() for _ in range(4)]

    async def held(name: str, calls: Any) -> list[Any]:
        trips.append(len(calls))
        await gates[len(trips) - 1].wait()
        return await call_many(name, calls)

    scripts.call_many = held  # type: ignore[method-assign]
    clock = [0.0]
    batch = ScriptBatch(scripts, "watch", max_batch=1, max_wait_s=5.0, clock=lambda: clock[0])

    async def fails_at(t: float, trip: int) -> None:  # (round trip `trip`, Redis away, fails at `t`)
        clock[0] = t
        gates[trip - 1].set()
        await async_wait_until(lambda: _true(len(trips) > trip), what=f"the round trip after {trip}")

    try:
        await scripts.load()
        first = asyncio.create_task(watch(batch, "run_0"))
        await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
        r1, r2, r3 = (asyncio.create_task(watch(batch, f"run_{i}")) for i in range(1, 4))
        await async_wait_until(lambda: _true(len(batch._pending) == 3), what="the calls behind to wait")
        server.stop(kill=True)
        await fails_at(1.0, 1)  # (r1 goes)
        with pytest.raises(RedisConnectionError):
            await first
        clock[0] = 1.5
        later = asyncio.create_task(watch(batch, "run_4"))
        await async_wait_until(lambda: _true(len(batch._pending) == 3), what="the later call to wait")
        await fails_at(2.0, 2)  # (r2 goes: r2 and r3 waited 2 s, behind two failures)
        assert not r3.done() and not later.done()
        await fails_at(6.0, 3)  # (r3 waited 6 s: it fails with r2; later waited 4.5 s: it goes)
        answers = await asyncio.wait_for(asyncio.gather(r1, r2, r3, return_exceptions=True), 20)
        assert all(isinstance(a, RedisConnectionError) for a in answers), answers
        assert may_have_run(answers[2]) is False  # (never sent)
        assert not later.done()
        server = RedisServer(port=server.port, dir=server.dir).start()  # (Redis back)
        gates[3].set()
        assert await asyncio.wait_for(later, 20) == 0
        assert trips == [1, 1, 1, 1]
    finally:
        await redis.aclose()
        server.cleanup()


async def test_calls_waiting_behind_a_round_trip_that_failed_slowly_with_no_outage_of_redis_go_next(
        redis: Redis) -> None:
    """A round trip that failed after `slow_s` with an error that is no Redis outage (a bug; an error
    whose type takes other arguments than its `args`, as `DatabaseRefused` does): the calls behind it
    were failed as never sent, their error made anew from its type and args, which raised TypeError
    there instead, their callers left waiting for good. They go next, as behind any such error."""

    class Odd(Exception):
        def __init__(self, what: str, why: str) -> None:
            super().__init__(f"{what}: {why}")

    scripts = Scripts(redis)
    call_many = scripts.call_many
    trips: list[int] = []
    found = asyncio.Event()

    async def odd_first(name: str, calls: Any) -> list[Any]:
        trips.append(len(calls))
        if len(trips) == 1:
            await found.wait()
            raise Odd("a bug", "found late")
        return await call_many(name, calls)

    scripts.call_many = odd_first  # type: ignore[method-assign]
    batch = ScriptBatch(scripts, "watch", slow_s=0.0)  # (every round trip slow: however short it took)
    first = asyncio.create_task(watch(batch, "run_t"))
    await async_wait_until(lambda: _true(trips), what="the first round trip to be on its way")
    behind = [asyncio.create_task(watch(batch, f"run_{i}")) for i in range(4)]
    await async_wait_until(lambda: _true(len(batch._pending) == 4), what="the calls behind to wait")
    found.set()
    answers = await asyncio.wait_for(asyncio.gather(first, *behind, return_exceptions=True), 10)
    assert isinstance(answers[0], Odd)
    assert answers[1:] == [0, 0, 0, 0]
    assert trips == [1, 4]
