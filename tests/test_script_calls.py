"""How many commands the scripts run for a run (a command from Lua costs Redis several µs: most of a
run's Redis time, docs/performance.md). Against a real Redis, counted with `INFO commandstats`
around one script call: the commands a run needs, not the ones its outcome does not depend on."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.asyncio import Redis

from common import keys
from common.codec import pack
from common.redisconn import now_ms
from common.scripts import SHAS, Scripts
from tests.test_scheduler import MODEL, make_config, running_run, waiting_runs


class Inside:
    """The commands the scripts run from `start` on, by name (lower case): SLOWLOG at a 0 µs threshold
    logs each one, a script's own marked with the client `?:0`."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.saved = "10000"

    async def start(self) -> None:
        self.saved = str((await self.redis.config_get("slowlog-log-slower-than"))["slowlog-log-slower-than"])
        await self.redis.config_set("slowlog-max-len", 10_000)
        await self.redis.slowlog_reset()
        await self.redis.config_set("slowlog-log-slower-than", 0)

    async def ran(self) -> Counter[str]:
        await self.redis.config_set("slowlog-log-slower-than", -1)
        entries = await self.redis.slowlog_get(10_000)
        await self.redis.config_set("slowlog-log-slower-than", self.saved)
        await self.redis.slowlog_reset()
        out: Counter[str] = Counter()
        for e in entries:
            address = e.get("client_address") or b""
            if (address.decode() if isinstance(address, bytes) else str(address)).startswith("?"):
                command = e["command"]
                name = (command.decode(errors="replace") if isinstance(command, bytes) else command).split(" ")[0]
                out[name.lower()] += 1
        return out


async def test_a_dispatch_counts_no_slots_of_a_provider_that_cannot_win(redis: Redis) -> None:
    """Two idle providers of the same capacity: the first (by id) wins whatever the second holds,
    so the second's leases are not counted (one ZCOUNT, not two). A busier first is still weighed
    against the second, which then wins."""
    config = make_config({"a": 4, "b": 4})
    _, sched, run_ids = await waiting_runs(redis, config, 2)
    inside = Inside(redis)
    await inside.start()
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_ids[0]), "provider") == b"a"
    assert await redis.hget(keys.run_record(run_ids[1]), "provider") == b"b"  # a holds one: b wins
    assert (await inside.ran())["zcount"] == 1 + 2


async def test_a_larger_idle_provider_after_an_idle_one_is_counted_and_wins(redis: Redis) -> None:
    config = make_config({"a": 4, "b": 8})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "provider") == b"b"  # (the larger capacity)


async def test_dispatching_the_only_run_of_a_queue_reads_the_queue_once(redis: Redis) -> None:
    """The dispatch reads the head with the entry behind it: none, and the queue is empty once the
    head goes, so there is nobody to wake and no second read of it."""
    config = make_config({"a": 4})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    inside = Inside(redis)
    await inside.start()
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "state") == b"dispatched"
    ran = await inside.ran()
    assert ran["xrange"] == 1 and ran["xpending"] == 0


async def test_a_run_requeued_by_the_reaper_lives_run_ttl_s_from_its_requeue(redis: Redis) -> None:
    """A record lives `run_ttl_s` from when it is queued and again from its end (README's Redis
    keys): a lost attempt's run queued again too, not only from its first queueing (the dispatch
    sets no TTL of the record: the queueing's outlasts the attempt)."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 2})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    record = keys.run_record(run_id)
    await sched.dispatch_all()
    await redis.expire(record, 100)  # (long after its queueing)
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    assert await redis.hget(record, "state") == b"queued"
    assert await redis.ttl(record) > config.runtime.run_ttl_s - 60


async def test_a_dispatch_leaves_the_record_s_ttl_as_its_queueing_set_it(redis: Redis) -> None:
    config = make_config({"a": 1})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    record = keys.run_record(run_id)
    await redis.expire(record, 1000)
    inside = Inside(redis)
    await inside.start()
    await sched.dispatch_all()
    assert await redis.hget(record, "state") == b"dispatched"
    assert 0 < await redis.ttl(record) <= 1000
    assert (await inside.ran())["expire"] == 1  # (the events', made by the dispatch)
    assert await redis.ttl(keys.run_events(run_id)) > config.runtime.run_ttl_s - 60


async def test_a_run_cancelled_before_its_start_lives_run_ttl_s_from_its_end(redis: Redis) -> None:
    config = make_config({"a": 1})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    record = keys.run_record(run_id)
    await sched.dispatch_all()
    await redis.hset(record, "cancel", "1")
    await redis.expire(record, 100)  # (long after its queueing)
    rt = config.runtime
    assert await Scripts(redis).call("start", [record, keys.run_events(run_id)], [
        run_id, rt.lease_ttl_ms, rt.run_ttl_s, "host:1", pack({}), keys.SCHEDULER_SIGNALS,
        keys.leases("")]) == [b"cancelled"]
    assert await redis.hget(record, "state") == b"cancelled"
    assert await redis.ttl(record) > rt.run_ttl_s - 60


@pytest.mark.parametrize("blamed", [False, True], ids=["no-blame", "blamed"])
async def test_a_completed_run_deletes_its_served_name_s_blame_only_when_there_is_one(
        redis: Redis, blamed: bool) -> None:
    """A run completed there starts the provider's count of blame for its served name over (`FINISH`):
    the count is read with the freshness of the provider's last sign of life, and deleted only when
    there is one (no HDEL of the heartbeat every run)."""
    config, client, _, run_id, attempt = await running_run(redis, output=False, cancel=False)
    hb = keys.heartbeat("a")
    if blamed:
        await redis.hset(hb, "blame:a-name", 2)
    rt = config.runtime
    args = [run_id, "completed", "completed", pack({}), rt.run_ttl_s, keys.scheduler_channel(""), MODEL, "", "",
            attempt, "ok", 0, "", 1, 2, 1000, b"", rt.max_events_per_run, "", "a-name", 0]
    run_keys = [keys.run_record(run_id), keys.leases("a"), keys.run_events(run_id), keys.runs_stream(MODEL), hb,
                keys.node_queue("n-a"), keys.arq_in_progress(run_id), keys.runs_stream(MODEL)]
    for fresh in (False, True):  # (the first end writes the sign of life, the second finds it fresh)
        if fresh:
            await redis.hset(keys.run_record(run_id), "state", "running")
            if blamed:
                await redis.hset(hb, "blame:a-name", 2)
        inside = Inside(redis)
        await inside.start()
        assert await Scripts(redis).call("finish", run_keys, args) == b"ok"
        assert await redis.hget(hb, "blame:a-name") is None
        assert (await inside.ran())["hdel"] == (2 if blamed else 1)  # (and the record's body)
    await client.close()


#: a lease of the run (ARGV[2]) until `lease_ttl_ms` (ARGV[1]) after the server's millisecond, as the
#: dispatch writes it; returns that millisecond
LEASE_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return now
"""


async def test_a_start_in_the_millisecond_of_its_dispatch_leaves_the_lease_as_it_is(redis: Redis) -> None:
    """A run's start sets its lease to `lease_ttl_ms` from then; one the dispatch gave in the same
    millisecond ends then already, and is not written again (no ZADD). Either way it ends
    `lease_ttl_ms` after the start."""
    config = make_config({"a": 100})
    rt = config.runtime
    _, sched, run_ids = await waiting_runs(redis, config, 20)
    await sched.dispatch_all()
    scripts = Scripts(redis)
    await scripts.load()
    same = 0
    for run_id in run_ids:
        record = keys.run_record(run_id)
        inside = Inside(redis)
        await inside.start()
        pipe = redis.pipeline(transaction=True)  # (one after the other: most often in the same millisecond)
        pipe.eval(LEASE_NOW, 1, keys.leases("a"), rt.lease_ttl_ms, run_id)
        pipe.evalsha(SHAS["start"], 2, record, keys.run_events(run_id), run_id, rt.lease_ttl_ms, rt.run_ttl_s,
                     "host:1", pack({}), keys.SCHEDULER_SIGNALS, keys.leases(""))
        leased_ms, started = await pipe.execute()
        assert started[0] == b"ok"
        started_ms = int(await redis.hget(record, "started_ms") or 0)
        assert await redis.zscore(keys.leases("a"), run_id) == started_ms + rt.lease_ttl_ms
        zadds = (await inside.ran())["zadd"] - 1  # (the lease written above)
        assert zadds == (0 if leased_ms == started_ms else 1)
        same += leased_ms == started_ms
    assert same > 0
