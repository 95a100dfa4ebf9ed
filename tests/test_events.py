"""The gateway's one event reader against a real Redis: callers get every event of their run once,
in order, whether it was written before they followed or after, and after the inbox lost
entries, from the run's own stream."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.codec import event_fields, pack
from common.redisconn import connect
from common.scripts import Scripts
from gateway import events as events_module
from gateway.events import HELD_BYTES, READ_COUNT, READS_SHARE, Event, EventHub, Follower
from tests.conftest import async_wait_until


async def add(redis: Redis, run_id: str, gateway: str | None, etype: str, n: int) -> str:
    """An event as the scripts add one: to the run's stream and, for a follower, its inbox."""
    fields = event_fields(etype, {"n": n})
    entry: str = (await redis.xadd(keys.run_events(run_id), fields)).decode()
    if gateway is not None:
        await redis.xadd(keys.gateway_inbox(gateway), {"run": run_id, "id": entry, **fields})
    return entry


async def collect(follower_next: object, count: int) -> list[int]:
    out = []
    for _ in range(count):
        event = await asyncio.wait_for(follower_next(), 10)  # type: ignore[operator]
        out.append(event.data["n"])
    return out


async def test_events_before_during_and_after_the_first_read_arrive_once_in_order(redis: Redis) -> None:
    hub = EventHub(redis)
    run_id = "run_a"
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
    try:
        await add(redis, run_id, None, "delta", 0)  # before anyone followed: only in its stream
        async with hub.follow(run_id) as follower:
            for n in range(1, 30):
                await add(redis, run_id, hub.gateway_id, "delta", n)
            await add(redis, run_id, hub.gateway_id, "completed", 30)
            got = await collect(follower.next, 31)
        assert got == list(range(31))
    finally:
        await hub.close()


async def test_a_fresh_reader_hears_what_comes_after_it_starts(redis: Redis) -> None:
    for i in range(5):
        hub = EventHub(redis)
        run_id = f"run_b{i}"
        await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
        try:
            async with hub.follow(run_id) as follower:
                await add(redis, run_id, hub.gateway_id, "delta", 1)
                assert await collect(follower.next, 1) == [1]
        finally:
            await hub.close()


async def test_after_the_inbox_lost_entries_the_runs_own_stream_fills_the_gap(redis: Redis) -> None:
    hub = EventHub(redis)
    run_id = "run_c"
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
    try:
        async with hub.follow(run_id) as follower:
            await add(redis, run_id, hub.gateway_id, "delta", 1)
            assert await collect(follower.next, 1) == [1]
            await add(redis, run_id, None, "delta", 2)  # its inbox copy lost (as in a restart)
            await redis.connection_pool.disconnect()  # the reader reconnects: it reads every run again
            assert await collect(follower.next, 1) == [2]
            await add(redis, run_id, hub.gateway_id, "delta", 3)
            assert await collect(follower.next, 1) == [3]
    finally:
        await hub.close()


async def test_a_completion_callers_gateway_gets_output_and_end_only_until_it_follows_every_event(
        redis: Redis) -> None:
    """The scripts' `add_event` (here through `emit`) copies to an output-only watcher (`gw~`, the
    gateway a completion caller waits on) only `delta`, `completed` and `failed`; a gateway that
    follows the run through the runs API (`watch`) gets every event, once."""
    scripts = Scripts(redis)
    record, events = keys.run_record("run_w"), keys.run_events("run_w")
    await redis.hset(record, mapping={"state": "running", "attempts": "1",
                                      "watchers": f"gw-a{keys.OUTPUT_ONLY},gw-b"})

    emitted = 0

    async def emit(etype: str) -> None:
        nonlocal emitted
        emitted += 1
        assert await scripts.call("emit", [record, events], ["1", etype, pack({}), 1000, "run_w", emitted]) == 1

    async def inbox(gateway: str) -> list[str]:
        return [fields[b"type"].decode() for _, fields in await redis.xrange(keys.gateway_inbox(gateway))]

    for etype in ("started", "delta", "requeued", "delta"):
        await emit(etype)
    assert await inbox("gw-a") == ["delta", "delta"]
    assert await inbox("gw-b") == ["started", "delta", "requeued", "delta"]
    assert await scripts.call("watch", [record], ["gw-a"]) == 1  # a runs-API caller on gw-a (kept first)
    assert await redis.hget(record, "watchers") == b"gw-a,gw-b"
    assert await scripts.call("watch", [record], ["gw-a"]) == 1  # twice changes nothing
    assert await redis.hget(record, "watchers") == b"gw-a,gw-b"
    await emit("started")
    await emit("completed")
    assert await inbox("gw-a") == ["delta", "delta", "started", "completed"]
    assert await inbox("gw-b") == ["started", "delta", "requeued", "delta", "started", "completed"]
    assert await scripts.call("watch", [keys.run_record("run_gone")], ["gw-a"]) == 0


async def test_a_completions_own_caller_follows_before_its_run_exists_and_reads_nothing_first(
        redis: Redis) -> None:
    """`fresh`: the gateway follows a run it is about to queue, so every event comes through its
    inbox and the run's own stream is not read (no XRANGE: one Redis round trip less a run)."""
    hub = EventHub(redis)
    run_id = "run_f"
    try:
        await redis.config_resetstat()
        async with hub.follow(run_id, fresh=True) as follower:
            await redis.hset(keys.run_record(run_id), mapping={"state": "queued", "watchers": hub.gateway_id})
            for n in range(1, 11):
                await add(redis, run_id, hub.gateway_id, "delta", n)
            await add(redis, run_id, hub.gateway_id, "completed", 11)
            assert await collect(follower.next, 11) == list(range(1, 12))
        stats = await redis.info("commandstats")
        assert "cmdstat_xadd" in stats and "cmdstat_xrange" not in stats
    finally:
        await hub.close()


async def test_a_follower_hands_events_over_in_order_and_its_wait_may_end_empty() -> None:
    follower = Follower("run_x", "0", fresh=True)
    assert await follower.next(timeout=0.01) is None  # nothing came: the caller sends a keep-alive
    waiting = asyncio.create_task(follower.next())
    await asyncio.sleep(0)  # it waits now
    follower.give(Event("1-0", "delta", {"n": 1}))
    follower.give(Event("1-0", "delta", {"n": 1}))  # had it already
    follower.give(Event("2-0", "delta", {"n": 2}))
    assert (await waiting) == Event("1-0", "delta", {"n": 1})
    assert (await follower.next(timeout=0)) == Event("2-0", "delta", {"n": 2})
    assert await follower.next(timeout=0) is None


async def test_a_caller_woken_by_an_event_runs_before_the_listener_reads_the_inbox_again(redis: Redis) -> None:
    """The caller's answer is not kept waiting while the listener sends its next blocking read."""
    hub = EventHub(redis)
    reads: list[str] = []
    xread = redis.xread

    async def counting_xread(*args: object, **kwargs: object) -> object:
        reads.append("xread")
        return await xread(*args, **kwargs)

    redis.xread = counting_xread
    try:
        async with hub.follow("run_o", fresh=True) as follower:
            await redis.hset(keys.run_record("run_o"), mapping={"state": "queued", "watchers": hub.gateway_id})

            async def woken() -> int:
                await follower.next()
                return len(reads)  # the listener's reads sent by the time the caller ran

            seen = asyncio.create_task(woken())
            await async_wait_until(lambda: asyncio.sleep(0, bool(reads)), what="the listener to block on the inbox")
            await add(redis, "run_o", hub.gateway_id, "completed", 1)
            assert await asyncio.wait_for(seen, 10) == 1
            # and then it reads again
            await async_wait_until(lambda: asyncio.sleep(0, len(reads) == 2), what="the next read")
            assert len(reads) == 2
    finally:
        del redis.xread
        await hub.close()


async def add_big(redis: Redis, run_id: str, gateway: str, n: int, size: int) -> None:
    fields = event_fields("delta", {"n": n, "text": "x" * size})
    entry = (await redis.xadd(keys.run_events(run_id), fields)).decode()
    await redis.xadd(keys.gateway_inbox(gateway), {"run": run_id, "id": entry, **fields})


@pytest.mark.parametrize("fresh", [True, False])
async def test_a_caller_that_does_not_take_its_events_holds_a_bounded_amount_and_then_gets_them_all(
        redis: Redis, fresh: bool) -> None:
    """Past `HELD_BYTES` the listener's events for a caller are dropped; once it has taken what it
    held it reads the rest from the run's own stream: every event once, in order."""
    hub = EventHub(redis)
    run_id = f"run_slow_{fresh}"
    size, count = HELD_BYTES // 8, 40  # five times what a caller may hold
    try:
        await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
        if not fresh:  # half of it there before the caller follows (its first read)
            for n in range(count // 2):
                await add_big(redis, run_id, hub.gateway_id, n, size)
        async with hub.follow(run_id, fresh=fresh) as follower:
            for n in range(0 if fresh else count // 2, count):
                await add_big(redis, run_id, hub.gateway_id, n, size)
            await add(redis, run_id, hub.gateway_id, "completed", count)
            # the listener has read the whole inbox: the caller is behind, holding no more than allowed
            last = (await redis.xrevrange(keys.gateway_inbox(hub.gateway_id), "+", "-", count=1))[0][0].decode()
            await async_wait_until(lambda: asyncio.sleep(0, hub.heard_to == last), what="the inbox read")
            assert follower.behind
            assert follower.held <= HELD_BYTES and len(follower.items) < count // 4
            got = await collect(follower.next, count + 1)
        assert got == list(range(count + 1))
        assert not follower.behind and follower.held == 0
    finally:
        await hub.close()


async def test_a_caller_behind_while_redis_is_away_gets_its_keep_alive_turn_and_then_every_event(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that fell behind reads on from its run's stream: while Redis is away, `next`
    returns None at the caller's keep-alive timeout (it waited for Redis, and sent the stream
    nothing); once Redis is back it gets every event, once, in order."""
    hub = EventHub(redis)
    run_id = "run_behind_down"
    away = True
    read_runs = hub._read_runs

    async def flaky(*args: Any, **kwargs: Any) -> None:
        if away:
            raise RedisConnectionError("Connection refused")
        await read_runs(*args, **kwargs)

    try:
        await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
        async with hub.follow(run_id, fresh=True) as follower:
            follower.behind = True  # (as past `HELD_BYTES`: what the listener brings is dropped)
            for n in range(3):
                await add(redis, run_id, hub.gateway_id, "delta", n)
            monkeypatch.setattr(hub, "_read_runs", flaky)
            monkeypatch.setattr("gateway.events.log.warning", lambda *a, **k: None)
            for _ in range(2):
                assert await asyncio.wait_for(follower.next(0.05), 10) is None
                assert follower.behind and follower.pending is None
            await add(redis, run_id, hub.gateway_id, "completed", 3)
            away = False
            assert await collect(follower.next, 4) == [0, 1, 2, 3]
    finally:
        await hub.close()


async def test_the_listener_trims_from_its_inbox_what_it_handed_out(redis: Redis,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox's copies go once read: it holds about `TRIM_EVERY_S` of events, not the last
    `INBOX_MAXLEN` (which may be whole answers); the runs' own streams keep theirs."""
    monkeypatch.setattr("gateway.events.TRIM_EVERY_S", 0.0)
    hub = EventHub(redis)
    run_id = "run_trim"
    try:
        async with hub.follow(run_id, fresh=True) as follower:
            await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
            for n in range(500):
                await add(redis, run_id, hub.gateway_id, "delta", n)
            assert await collect(follower.next, 500) == list(range(500))
            inbox = keys.gateway_inbox(hub.gateway_id)

            async def trimmed() -> bool:
                return int(await redis.xlen(inbox)) < 200

            await async_wait_until(trimmed, what="the inbox trimmed")
            assert await redis.xlen(keys.run_events(run_id)) == 500
    finally:
        await hub.close()


async def test_followers_leaving_while_queued_runs_are_handed_over_do_not_end_the_read(redis: Redis) -> None:
    """`_read_runs` awaits the hub's `queued` callback (the gateway's stuck-run check): a run whose
    followers all left meanwhile is not read on (it raised KeyError, which would have ended the
    listener every caller waits on; found by a review)."""
    told: list[list[tuple[str, str, str]]] = []

    async def queued(runs: list[tuple[str, str, str]]) -> None:
        await asyncio.sleep(0)
        hub._leave(paged)
        told.append(runs)

    hub = EventHub(redis, queued=queued)
    await redis.hset(keys.run_record("run_q"), mapping={"state": "queued", "model": "m", "entry": "1-0"})
    await redis.hset(keys.run_record("run_p"), mapping={"state": "running"})
    for n in range(3 * READ_COUNT):
        await redis.xadd(keys.run_events("run_p"), event_fields("delta", {"n": n}))
    waiting, paged = Follower("run_q", "0", hub=hub), Follower("run_p", "0", hub=hub)
    hub.followers = {"run_q": [waiting], "run_p": [paged]}
    await hub._read_runs(["run_q", "run_p"], check_lost=True)
    assert told == [[("run_q", "m", "1-0")]]


def test_what_a_caller_is_still_writing_counts_against_what_it_may_hold() -> None:
    """A stream's caller took its events and waits for a slow reader to take their text: those
    still count (they were 0 once taken, so a stalled caller held twice the bound; found by an audit)."""
    follower = Follower("run_w", "0", fresh=True, hub=EventHub.__new__(EventHub))
    follower.give(Event("1-0", "delta", {}, HELD_BYTES // 2))
    taken = follower.take_ready()
    follower.writing = sum(e.size for e in taken)
    follower.give(Event("2-0", "delta", {}, HELD_BYTES // 4))
    follower.give(Event("3-0", "delta", {}, HELD_BYTES // 2))  # past the bound with what is being written
    assert [e.id for e in follower.items] == ["2-0"] and follower.behind


async def test_a_followed_run_whose_record_is_gone_ends_worker_lost_naming_loss_and_expiry(redis: Redis) -> None:
    """A run's record and events gone under a follower: Redis lost them, or they expired before a
    slow reader took the run's end (the two look the same; the message said "Redis lost" only,
    which an audit found false for the second)."""
    hub = EventHub(redis)
    follower = Follower("run_gone", "0", hub=hub)
    heard = Follower("run_gone", "1-0", hub=hub)  # (it had the run's events up to 1-0, output among them)
    hub.followers = {"run_gone": [follower, heard]}
    await hub._read_runs(["run_gone"], check_lost=True)
    [event] = follower.take_ready()
    assert event.type == "failed" and event.data["code"] == "worker_lost"
    assert "Redis lost its record" in event.data["message"] and "run_ttl_s" in event.data["message"]
    # (it said "before output" to a caller that had had output: a helper)
    assert event.data["before_output"] is True
    assert heard.take_ready()[0].data["before_output"] is False
    # (one that heard the run start, and no output, hears it was lost before output: it was told
    # false for having heard anything at all; a review)
    started = Follower("run_started", "0", hub=hub)
    hub.followers = {"run_started": [started]}
    started.give(Event("1-0", "dispatched", {}))
    started.give(Event("2-0", "started", {}))
    started.take_ready()
    await hub._read_runs(["run_started"], check_lost=True)
    assert started.take_ready()[0].data["before_output"] is True


async def test_a_run_still_being_queued_is_not_lost_for_having_no_record_yet(redis: Redis) -> None:
    """A completion's caller follows before its gateway queues the run. When Redis comes back from a
    restart the listener reads every followed run again, the record of one whose queueing is still
    waiting for Redis among them: that record is not there yet, and the caller was told its run was
    lost (502) while the queueing went on and the run ran (a helper's Redis restart with AOF: 15 of
    40 callers). Once queued, a missing record is a loss again."""
    hub = EventHub(redis)
    follower = Follower("run_new", "0", fresh=True, hub=hub)
    hub.followers = {"run_new": [follower]}
    await hub._read_runs(["run_new"], check_lost=True)
    assert follower.take_ready() == [] and not follower.ended
    follower.queued()
    await hub._read_runs(["run_new"], check_lost=True)
    [event] = follower.take_ready()
    assert event.type == "failed" and event.data["code"] == "worker_lost"


async def test_reads_for_single_followers_take_turns_in_their_share_of_the_pool(redis_url: str) -> None:
    """Many callers' first reads of their runs (runs-API followers arriving together) hold at most
    `READS_SHARE` of the gateway's pool at once; the rest wait their turn, and each still gets all
    its run has (an audit: 1,500 followers of a large run held every connection, and an unrelated
    completion waited 8 s for one)."""
    redis = Redis.from_url(redis_url, max_connections=8)
    hub = EventHub(redis)
    share = int(8 * READS_SHARE)
    runs = [f"run_turn{i}" for i in range(3 * share)]
    for run_id in runs:
        await redis.hset(keys.run_record(run_id), mapping={"state": "running"})
        for n in range(3):
            await add(redis, run_id, None, "delta", n)
    active = most = 0
    gate = asyncio.Event()
    try:
        async with hub.follow("run_started", fresh=True):  # (the listener is up before reads are counted)
            pass
        make_pipeline = redis.pipeline

        def counted_pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            execute = pipe.execute

            async def gated(*a: Any, **kw: Any) -> Any:
                nonlocal active, most
                active += 1
                most = max(most, active)
                try:
                    await gate.wait()
                    return await execute(*a, **kw)
                finally:
                    active -= 1

            pipe.execute = gated
            return pipe

        redis.pipeline = counted_pipeline

        async def first_read(run_id: str) -> list[int]:
            async with hub.follow(run_id) as follower:
                return [e.data["n"] for e in follower.take_ready()]

        tasks = [asyncio.create_task(first_read(r)) for r in runs]

        async def reads_waiting() -> bool:
            return active >= share

        await async_wait_until(reads_waiting, what="the first reads to start")
        for _ in range(100):  # (every other follower gets the loop: none may start a read meanwhile)
            await asyncio.sleep(0)
        assert most == share
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 10) == [[0, 1, 2]] * len(runs)
    finally:
        gate.set()
        await hub.close()
        await redis.aclose()


async def test_a_caller_s_keep_alive_wait_is_an_entry_of_its_hub_s_sweeper_not_a_timer_of_its_own(
        redis: Redis) -> None:
    """`asyncio.timeout` gave each streamed caller waiting for its run a timer of its own (~1 KB of
    the ~18 KB a waiting caller holds, under uvloop, by tracemalloc). The wait is now an entry of its
    hub's `keep_alives`: the wait still ends without an event (the caller's keep-alive goes out), and
    an event still ends it at once."""
    hub = EventHub(redis, keep_alive_s=0.2)
    assert hub.keep_alives.period_s == pytest.approx(0.02)
    run_id = "run_keep_alive"
    try:
        await redis.hset(keys.run_record(run_id), mapping={"state": "queued", "watchers": hub.gateway_id})
        async with hub.follow(run_id, fresh=True) as follower:
            waiting = asyncio.create_task(follower.next(0.2))
            await async_wait_until(lambda: asyncio.sleep(0, waiting in hub.keep_alives._due), what="the wait")
            assert await asyncio.wait_for(waiting, 10) is None and not hub.keep_alives._due
            waiting = asyncio.create_task(follower.next(600))
            await async_wait_until(lambda: asyncio.sleep(0, waiting in hub.keep_alives._due), what="the wait")
            await add(redis, run_id, hub.gateway_id, "delta", 0)
            event = await asyncio.wait_for(waiting, 10)
            assert event is not None and event.type == "delta" and not hub.keep_alives._due
    finally:
        await hub.close()


async def test_a_caller_s_keep_alive_goes_out_by_stream_keepalive_ms_not_a_sweep_after(redis: Redis) -> None:
    """The hub's sweeper looks at the waits every tenth of `stream_keepalive_ms`, so a wait bounded
    by the keep-alive time itself ended up to a tenth late: keep-alives 10-11 s apart with the
    default 10 s (p99 11.0 s, 2,000 waiting callers), where the config says a stream silent that
    long gets one (a proxy whose idle timeout sits just above it would cut the stream). The wait is due a sweep
    early: it ends between a tenth before the keep-alive time and that time."""
    hub = EventHub(redis, keep_alive_s=600)
    period = hub.keep_alives.period_s
    run_id = "run_keep_alive_in_time"
    try:
        await redis.hset(keys.run_record(run_id), mapping={"state": "queued", "watchers": hub.gateway_id})
        async with hub.follow(run_id, fresh=True) as follower:
            began = time.monotonic()
            waiting = asyncio.create_task(follower.next(600))
            await async_wait_until(lambda: asyncio.sleep(0, waiting in hub.keep_alives._due), what="the wait")
            due = hub.keep_alives._due[waiting]
            assert began + 600 - period - 1 <= due <= time.monotonic() + 600 - period  # (swept by 600 s)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
    finally:
        await hub.close()


async def test_a_listener_whose_connection_was_made_again_reads_every_followed_run_again(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault review, real processes: after `SENTINEL FAILOVER`, the runs queued on the old primary
    in the second before Sentinel's announcement were not on the promoted one. Their callers heard
    502 `worker_lost` only 10-11 s later, from the quiet check: the listener's blocking read was
    made again on a new connection by the line's own retry, so the listener never heard of the
    reconnect and did not read its runs again (the README: "a Redis restart or reconnect"). Here
    the record goes and the listener's connection is killed under it; the quiet check is off."""
    monkeypatch.setattr(events_module, "QUIET_CHECK_S", 3600.0)
    redis = connect(redis_url, client_name="iop-gateway")
    hub = EventHub(redis)
    try:
        await redis.hset(keys.run_record("run_moved"), mapping={"state": "running", "model": "m"})
        async with hub.follow("run_moved", fresh=True) as follower:
            follower.queued()

            async def listening() -> bool:
                return any(c.get("name") == "iop-gateway:inbox" for c in await redis.client_list())

            await async_wait_until(listening, what="the listener's connection")
            await redis.delete(keys.run_record("run_moved"))  # (not on the promoted replica)
            [inbox] = [c for c in await redis.client_list() if c.get("name") == "iop-gateway:inbox"]
            await redis.client_kill_filter(_id=inbox["id"])
            event = await asyncio.wait_for(follower.next(), 15)
            assert event is not None and event.type == "failed" and event.data["code"] == "worker_lost"
    finally:
        await hub.close()
        await redis.aclose()


async def test_a_follower_that_joins_while_the_listener_reads_its_run_again_misses_no_event(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault review, real processes: a runs-API reader resumed (Last-Event-ID at delta 138) right
    after a Sentinel failover, while the listener read every followed run again; its next event was
    delta 1,141. The listener's read started after the run's other follower (its own caller, far
    ahead), but handed what it read to every follower the run had when the reply came, the one that
    had joined meanwhile too: that one's position jumped past the 1,000 events between, which its
    own first read then never read. Here the listener's read is held until the new follower joined."""
    run_id = "run_joined"
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "model": "m"})
    entries = [await add(redis, run_id, None, "delta", n) for n in range(200)]
    hub = EventHub(redis)
    ahead = Follower(run_id, entries[150], hub=hub)  # the run's own caller, far ahead
    joining = Follower(run_id, entries[10], hub=hub)  # a reader resuming after event 10
    hub.followers = {run_id: [ahead]}

    sent, go = asyncio.Event(), asyncio.Event()
    pipeline = redis.pipeline

    def held_once(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def held(*a: Any, **k: Any) -> Any:
            if not go.is_set():
                sent.set()
                await go.wait()
            return await execute(*a, **k)

        pipe.execute = held
        return pipe

    monkeypatch.setattr(redis, "pipeline", held_once)
    try:
        again = asyncio.create_task(hub._read_runs([run_id], check_lost=True))  # the listener's, after a reconnect
        await asyncio.wait_for(sent.wait(), 10)
        hub.followers[run_id].append(joining)  # (`EventHub._enter`: it joins, then reads for itself)
        go.set()
        await asyncio.wait_for(again, 10)
        assert await hub._catch_up(joining, 10)
        assert [e.data["n"] for e in joining.take_ready()] == list(range(11, 200))
        assert [e.data["n"] for e in ahead.take_ready()] == list(range(151, 200))
    finally:
        await hub.close()
