"""Keys of iop's written by hand with another type (`redis-cli SET iop:node:n1 x`): Redis answers
WRONGTYPE to every command of iop's on them, for good. Those that hold only what iop writes there
are deleted, and said (a WARNING names the key), by the process whose loop met the error, or the
script's write that could fail midway is not made (a script's writes before an error stay).
Against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from common import keys
from common.config import Config
from tests.conftest import async_wait_until
from tests.test_runner import TEXT, Scripted, fields, node_worker, start_one
from workers.runner import Runner


async def taken_and_completed(redis: Redis, redis_url: str, config: Config, run_id: str) -> None:
    """The node's worker takes the run, whose provider answers it whole: it completes."""
    worker = node_worker(redis_url, Runner(redis, config, "n-a", {"a": Scripted([[TEXT]])}))
    try:
        await worker.claim_and_start([run_id])
        assert await worker.tasks[run_id] == "completed:ok"
        assert await fields(redis, keys.run_record(run_id), "state") == ["completed"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


#: how long a gateway may go without renewing its liveness key in the orphan sweeps' tests
LIVENESS_MS = 3000


def orphan_sweep(redis: Redis, monkeypatch: pytest.MonkeyPatch,
                 leased: tuple[str, ...] = ("r",)) -> Callable[[], Awaitable[int]]:
    """A scheduler replica whose clock moves only when its sweep is made, gateways judged dead after
    `LIVENESS_MS`, and the runs `leased` holding long leases of provider p. Returns its sweep for dead
    gateways' runs, made once the replica has reached Redis long enough without a gap to judge."""
    from common.config import parse_config
    from scheduler.core import OUTAGE_GRACE, Scheduler
    from tests.test_e2e import FAST_RUNTIME, pool_config

    config = parse_config({**pool_config({"p": ("n1", "http://127.0.0.1:9", 1)}),
                           "runtime": {**FAST_RUNTIME, "gateway_liveness_ms": LIVENESS_MS}})
    clock = [10_000_000]
    monkeypatch.setattr("scheduler.core.now_ms", lambda: clock[0])
    sched = Scheduler(redis, config)

    async def sweep() -> int:
        await redis.zadd(keys.leases("p"), dict.fromkeys(leased, clock[0] + 600_000), nx=True)
        for _ in range((OUTAGE_GRACE + 1) * LIVENESS_MS // 300):  # (beats 300 ms apart: no gap)
            clock[0] += 300
            await sched.heartbeat()
        return await sched.cancel_orphans()

    return sweep


async def running_of_g1(redis: Redis) -> None:
    """Run r's record: running on provider p's node, followed by gateway g1."""
    await redis.hset(keys.run_record("r"), mapping={"watchers": "g1~", "state": "running", "node": "n1",
                                                    "model": "qwen3.6:35b"})


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


async def test_a_run_whose_gateway_s_inbox_is_of_another_type_ends_all_the_same(
        redis: Redis, redis_url: str) -> None:
    """`SET iop:inbox:{gateway} x`: every script that adds an event of that gateway's runs failed
    midway at its inbox copy (after the event itself): a run's start failed the worker's take, and a
    run's end was written (its caller answered from the run's stream) but the run stayed `running`
    for good, its key's in-flight slot held, its usage uncounted. Only the copy is skipped now."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.hset(keys.run_record(run_id), "watchers", "g1~")
    await redis.set(keys.gateway_inbox("g1"), "x")
    await taken_and_completed(redis, redis_url, sched.config, run_id)
    assert await redis.get(keys.gateway_inbox("g1")) == b"x"  # (its gateway's to delete)


async def test_a_gateway_s_inbox_of_another_type_is_deleted_and_said_and_its_runs_read_from_their_streams(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """The gateway's one listener failed every read of such an inbox (an error logged every second,
    for good); it deletes it, says so, and reads its runs' own streams."""
    from gateway.events import EventHub
    from tests.test_events import add, collect

    hub = EventHub(redis)
    run_id = "run_w"
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
    try:
        async with hub.follow(run_id) as follower:
            await add(redis, run_id, hub.gateway_id, "delta", 1)
            assert await collect(follower.next, 1) == [1]
            await redis.delete(keys.gateway_inbox(hub.gateway_id))
            await redis.set(keys.gateway_inbox(hub.gateway_id), "x")
            await add(redis, run_id, None, "delta", 2)  # (the scripts skip the copy)
            assert await collect(follower.next, 1) == [2]
            await add(redis, run_id, hub.gateway_id, "delta", 3)
            assert await collect(follower.next, 1) == [3]
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "deleted" in r.getMessage()]
        assert len(said) == 1 and keys.gateway_inbox(hub.gateway_id) in said[0], said
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
    finally:
        await hub.close()


@pytest.mark.parametrize("which", ["day", "total", "in_flight"])
async def test_a_run_whose_key_s_usage_or_in_flight_set_is_of_another_type_ends_whole(
        redis: Redis, redis_url: str, which: str) -> None:
    """`SET iop:usage:team-a:2026-12-07 x` (or its all-time usage, its in-flight set): every end of the
    key's runs failed midway (`ended`), its state written and the rest not (the freed slot's waiting
    runs not woken, a queued run's `failed` event never added). Such a key is deleted, and the run's
    end counted afresh."""
    import time

    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.hset(keys.run_record(run_id), mapping={"key": "team-a", "limited": "1"})
    day = time.strftime("%Y-%m-%d", time.gmtime())
    key = {"day": keys.usage_day("team-a", day), "total": keys.usage_total("team-a"),
           "in_flight": keys.key_in_flight("team-a")}[which]
    await redis.set(key, "x")
    await taken_and_completed(redis, redis_url, sched.config, run_id)
    assert await redis.type(key) in (b"hash", b"none")
    for usage in (keys.usage_day("team-a", day), keys.usage_total("team-a")):
        assert await redis.hget(usage, "runs:m:1") == b"1", usage


@pytest.mark.parametrize("which", ["in_flight", "requests"])
async def test_a_key_s_in_flight_set_or_request_window_of_another_type_is_deleted_and_said_and_its_run_queued(
        redis: Redis, caplog: pytest.LogCaptureFixture, which: str) -> None:
    """`SET iop:inflight:team-a x` (or its request window): every run of the key was refused with a 503
    (the `enqueue` script's read of it failed), for good, until someone deleted the key. The gateway
    deletes it, says so, and queues the run."""
    from common.auth import Principal, Role
    from gateway.runs import RunClient
    from tests.test_scheduler import MODEL, beat, make_config, request

    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    who = Principal("team-a", Role.CALLER, max_in_flight=5, requests_per_minute=100)
    key = keys.key_in_flight("team-a") if which == "in_flight" else keys.key_requests("team-a")
    await redis.set(key, "x")
    try:
        run_id, _ = await client.submit(model, request(), who)
        assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
        assert await redis.zscore(key, run_id) is not None
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "deleted" in r.getMessage()]
        assert len(said) == 1 and key in said[0], said
    finally:
        await client.close()


async def test_a_run_whose_events_are_of_another_type_runs_and_its_node_s_worker_goes_on(
        redis: Redis, redis_url: str) -> None:
    """`HSET iop:events:{run} a b`: the dispatch of the run failed midway (dispatched, its job queued, no
    event), then its start failed the worker's take of the node's jobs, and the worker exited. The
    events key is deleted (said in Redis's log) and the event added."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.delete(keys.run_events(run_id))
    await redis.hset(keys.run_events(run_id), "a", "b")
    await taken_and_completed(redis, redis_url, sched.config, run_id)
    assert [f[b"type"] for _, f in await redis.xrange(keys.run_events(run_id))] == [b"started", b"completed"]


async def test_a_gateways_hash_of_another_type_is_deleted_and_said_and_dead_gateways_runs_cancelled_again(
        redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`SET iop:gateways x`: every sweep for the runs of dead gateways failed with WRONGTYPE (an error
    logged every sweep, for good), and no dead gateway's runs were cancelled. The replica deletes it,
    says so; a gateway names itself again at its beat, and once it died its runs are cancelled."""
    from gateway import liveness

    sweep_later = orphan_sweep(redis, monkeypatch)
    await redis.set(keys.GATEWAYS, "x")
    await running_of_g1(redis)

    assert await sweep_later() == 0
    assert await redis.type(keys.GATEWAYS) == b"none"
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "deleted" in r.getMessage()]
    assert len(said) == 1 and keys.GATEWAYS in said[0], said
    await liveness.beat(redis, "g1", LIVENESS_MS)  # (g1 names itself again) ...
    await redis.delete(keys.gateway_alive("g1"))  # ... and dies
    assert await sweep_later() == 1
    assert await redis.hget(keys.run_record("r"), "cancel") == b"1"


async def test_a_history_of_another_type_is_deleted_and_said_and_sampled_again(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """`SET iop:history x`: every load sample failed (a warning each interval) and every read of the
    catalog's charts got a 503, for good. The sampler deletes it, says so, and samples again."""
    from scheduler.history import sample_forever
    from tests.test_admin_api import OPEN, beat

    await beat(redis, OPEN)
    await redis.set(keys.HISTORY_STREAM, "x")
    task = asyncio.create_task(sample_forever(redis, OPEN))
    try:
        async def sampled() -> bool:
            return bool(await redis.type(keys.HISTORY_STREAM) == b"stream")
        await async_wait_until(sampled, what="a sample")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and keys.HISTORY_STREAM in said[0] and "deleted" in said[0], said


async def test_a_job_s_in_progress_marker_of_another_type_is_deleted_and_its_run_run(
        redis: Redis, redis_url: str) -> None:
    """`HSET arq:in-progress:{run} a b`: the take of the node's jobs failed with WRONGTYPE (the other
    jobs of that take with it) and the worker exited, and so did each worker of the node after it,
    its poll meeting the job again. The marker goes (said in Redis's log) and the run is run."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.hset(keys.arq_in_progress(run_id), "a", "b")
    await taken_and_completed(redis, redis_url, sched.config, run_id)


async def test_a_key_healed_by_another_process_meanwhile_and_written_again_is_not_deleted(redis: Redis) -> None:
    """Every worker of a node meets a `SET iop:node:n1 x` at once, and each heals: between one's
    TYPE (a string) and its DEL, another deleted the key and the scheduler queued a job there. The
    DEL is made only if the key still holds another type: the job stays."""
    import logging

    from common.wrongtype import delete_wrong_types

    key = keys.node_queue("n-race")
    await redis.set(key, "x")
    pipeline = redis.pipeline

    def meanwhile(*args: object, **kwargs: object) -> object:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def execute_then_another_heals() -> object:
            answers = await execute()
            await redis.delete(key)  # (another worker's heal)
            await redis.zadd(key, {"run-1": 1})  # (a job queued since)
            return answers
        pipe.execute = execute_then_another_heals
        return pipe
    redis.pipeline = meanwhile
    try:
        await delete_wrong_types(redis, {key: "zset"}, logging.getLogger("test"), "worker")
    finally:
        del redis.pipeline
    assert await redis.zrange(key, 0, -1) == [b"run-1"]


async def test_a_heal_that_meets_redis_away_says_so_and_raises_nothing() -> None:
    """The gateway's inbox listener and the scheduler's sampler heal in the handler of the loop
    that must not end: Redis going away there (a restart) ended the loop for good (every caller of the
    gateway left waiting; no sample again). A heal that met Redis away healed nothing."""
    import logging

    from common.wrongtype import delete_wrong_types

    away = Redis(port=1, socket_connect_timeout=0.5)
    try:
        assert await delete_wrong_types(away, {"iop:inbox:g": "stream"}, logging.getLogger("test"), "x") == []
    finally:
        await away.aclose()


async def test_a_run_s_record_of_another_type_fails_that_run_alone(redis: Redis, redis_url: str) -> None:
    """`SET iop:run:{run} x` of a dispatched run: the take of the node's jobs failed with WRONGTYPE (the
    other jobs of that take with it) and the worker exited, and so did each worker of the node after
    it, its poll meeting the job again. The record is read as missing: that run's job alone goes."""
    from tests.test_scheduler import make_config, waiting_runs

    config = make_config({"a": 2}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    _, sched, (bad, good) = await waiting_runs(redis, config, 2)
    await sched.dispatch_all()
    await redis.delete(keys.run_record(bad))
    await redis.set(keys.run_record(bad), "x")
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], [TEXT]])})
    worker = node_worker(redis_url, runner)
    try:
        await worker.claim_and_start([bad, good])
        assert await worker.tasks[good] == "completed:ok"
        assert await fields(redis, keys.run_record(good), "state") == ["completed"]
        assert bad not in worker.tasks
        assert await redis.zscore(keys.node_queue("n-a"), bad) is None
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_run_s_record_of_another_type_does_not_fail_the_sweep_for_dead_gateways_runs(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SET iop:run:{run} x` of a leased run: every sweep for dead gateways' runs failed with WRONGTYPE
    while the run was listed (its batch of runs with it), and no dead gateway's runs were cancelled.
    That record names no gateway: the others are swept."""
    sweep = orphan_sweep(redis, monkeypatch, leased=("r", "bad"))
    await redis.hset(keys.GATEWAYS, "g1", 1)  # (and no liveness key: it died)
    await running_of_g1(redis)
    await redis.set(keys.run_record("bad"), "x")
    assert await sweep() == 1
    assert await redis.get(keys.run_record("bad")) == b"x"


async def test_a_queued_run_s_record_of_another_type_does_not_stop_its_model_s_dispatch(redis: Redis) -> None:
    """`SET iop:run:{run} x` of a queued run: at the head of its model's queue, every dispatch of the
    model failed with WRONGTYPE, for good (no run of the model was dispatched). It goes, as a run whose
    record is gone; the runs behind it are dispatched."""
    from tests.test_scheduler import make_config, waiting_runs

    config = make_config({"a": 2}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    _, sched, (bad, good) = await waiting_runs(redis, config, 2)
    await redis.delete(keys.run_record(bad))
    await redis.set(keys.run_record(bad), "x")
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(good), "state") == ["dispatched"]
    assert await redis.get(keys.run_record(bad)) == b"x"


async def test_a_leased_run_s_record_of_another_type_does_not_stop_the_reaping_of_expired_leases(
        redis: Redis) -> None:
    """`SET iop:run:{run} x` of a run whose lease ran out: every sweep of expired leases failed with
    WRONGTYPE at that run, for good, and the expired leases after it were never given back (their
    slots held, the runs' callers waiting out their deadlines). That record holds no run: its lease
    goes, the slot's waiters are woken, and the other runs are reaped."""
    from tests.test_scheduler import make_config, waiting_runs

    config = make_config({"a": 2}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 2})
    client, sched, (bad, good) = await waiting_runs(redis, config, 2)
    await sched.dispatch_all()
    assert await redis.zcard(keys.leases("a")) == 2
    await redis.delete(keys.run_record(bad))
    await redis.set(keys.run_record(bad), "x")
    await redis.zadd(keys.leases("a"), {bad: 1, good: 2})  # (both ran out; the bad one is read first)
    assert await sched.reap_expired_leases() == 2
    assert await redis.zcard(keys.leases("a")) == 0
    assert await redis.hget(keys.run_record(good), "state") == b"queued"  # (tried again: 1 attempt of 2)
    assert await redis.get(keys.run_record(bad)) == b"x"
    await client.close()


async def test_a_followed_run_s_record_of_another_type_ends_that_run_and_the_gateway_s_listener_goes_on(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SET iop:run:{run} x` of a run a caller follows: the gateway's check of its quiet runs reads
    their records in one pipeline, whose WRONGTYPE failed the whole check; the listener then read
    every followed run again before its inbox, failing so each time, for good: no caller of the
    gateway heard anything more of its run. That record holds no run: its caller hears it lost
    (`worker_lost`, saying so), and the other callers their runs' events."""
    from gateway.events import EventHub
    from tests.test_events import add, collect

    monkeypatch.setattr("gateway.events.QUIET_CHECK_S", 0.05)
    hub = EventHub(redis)
    await redis.hset(keys.run_record("good"), mapping={"state": "running", "watchers": hub.gateway_id})
    await redis.set(keys.run_record("bad"), "x")
    try:
        async with hub.follow("good") as good, hub.follow("bad") as bad:
            event = await asyncio.wait_for(bad.next(), 10)
            assert event is not None and event.type == "failed" and event.data["code"] == "worker_lost"
            assert "another type" in event.data["message"], event.data
            await add(redis, "good", hub.gateway_id, "delta", 1)
            assert await collect(good.next, 1) == [1]
    finally:
        await hub.close()
    assert await redis.get(keys.run_record("bad")) == b"x"


async def test_a_followed_run_s_events_of_another_type_go_and_the_gateway_s_listener_goes_on(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SET iop:events:{run} x` of a run a caller follows: the gateway's reads of its followed runs'
    streams (its check of the quiet ones, then every read again) failed at its WRONGTYPE, the
    listener reading them all again before its inbox, failing so each time: no caller of the gateway
    heard its run until that run's next event replaced the key, if any came (an ended run's never
    does). That key holds no event: it goes, said, and the run's next event makes it again."""
    from gateway.events import EventHub
    from tests.test_events import add, collect

    monkeypatch.setattr("gateway.events.QUIET_CHECK_S", 0.05)
    hub = EventHub(redis)
    for run_id in ("bad", "good"):
        await redis.hset(keys.run_record(run_id), mapping={"state": "running", "watchers": hub.gateway_id})
    try:
        async with hub.follow("bad") as bad, hub.follow("good") as good:  # (the bad one read first)
            await add(redis, "bad", hub.gateway_id, "delta", 1)
            assert await collect(bad.next, 1) == [1]
            await redis.delete(keys.run_events("bad"))
            await redis.set(keys.run_events("bad"), "x")

            async def gone() -> bool:
                return bool(await redis.type(keys.run_events("bad")) == b"none")
            await async_wait_until(gone, what="the events of another type deleted")
            await add(redis, "good", hub.gateway_id, "delta", 1)
            assert await collect(good.next, 1) == [1]
            await add(redis, "bad", hub.gateway_id, "delta", 2)
            assert await collect(bad.next, 1) == [2]
    finally:
        await hub.close()


async def test_a_run_s_record_of_another_type_is_404_on_the_runs_api(redis_url: str) -> None:
    """`SET iop:run:{run} x`: `GET /v1/runs/{id}` (its events, its DELETE) answered 503 "the run store
    refused iop's command" with `Retry-After`, for as long as the key lived: the client was told to
    try again. That record holds no run: 404, OpenAI-shaped."""
    from tests.openapi import validate
    from tests.test_runs_api import api_for, make_config

    async with api_for(make_config(), redis_url) as api:
        await api.redis.set(keys.run_record("run_x"), "x")
        for method, path in (("GET", "/v1/runs/run_x"), ("GET", "/v1/runs/run_x/events"),
                             ("DELETE", "/v1/runs/run_x")):
            async with api.session.request(method, api.url(path)) as resp:
                assert resp.status == 404, (method, path, resp.status)
                body = await resp.json()
                validate("ErrorResponse", body)
                assert body["error"]["code"] == "not_found" and "run_x" in body["error"]["message"]
        await api.client.close()


async def test_a_waiting_run_s_record_of_another_type_times_out_alone_and_its_model_s_runs_go_on(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SET iop:run:{run} x` of a run waiting for a slot: at its queue timeout its `drop_queued` failed
    with WRONGTYPE (the round's dispatch with it), and its entry stayed at the head of the model's
    queue, which no dispatch takes: every run of the model behind it was `not_head`, for good. The
    entry goes as a run whose record is gone; the runs behind it are dispatched."""
    from common.redisconn import now_ms
    from tests.test_scheduler import MODEL, make_config, waiting_runs

    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    await redis.zadd(keys.leases("a"), {"busy": now_ms() + 60_000})  # (no slot: both wait)
    client, sched, (bad, good) = await waiting_runs(redis, config, 2)
    await redis.delete(keys.run_record(bad))
    await redis.set(keys.run_record(bad), "x")
    adopt = sched._adopt

    def adopt_overdue(model_id: str, entry_id: str, raw: dict[bytes, bytes]) -> None:
        adopt(model_id, entry_id, raw)  # (its queue timeout passed, the other's not: as if the clock moved)
        for w in sched.waiting[model_id]:
            if w.run_id == bad:
                w.deadline_ms = 0
    monkeypatch.setattr(sched, "_adopt", adopt_overdue)
    sched.waiting[MODEL][0].deadline_ms = 0
    await sched.dispatch_round()
    await redis.delete(keys.leases("a"))  # (a slot frees)
    for _ in range(3):  # (a replica adopts what Redis says it holds and it lost track of at two looks)
        await sched.adopt_forgotten()
        await sched.dispatch_round()
    assert await fields(redis, keys.run_record(good), "state") == ["dispatched"]
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    assert await redis.get(keys.run_record(bad)) == b"x"
    await client.close()


async def test_a_waiting_run_s_events_of_another_type_do_not_stop_its_model_s_dispatch(redis: Redis) -> None:
    """`SET iop:events:{run} x` of a run waiting after an attempt (tried on a provider it does not go
    back to): the scheduler reads its last event for the caller's 4xx it may end with, and that read
    failed with WRONGTYPE, and the whole dispatch round with it (the models after it in the round's
    order not dispatched), at every round, the run left at the head of its model's queue. That key
    holds no event, so no such 4xx: the run ends as one that no other provider takes would, its
    end's event replacing the key, and the run behind it is dispatched."""
    from tests.test_scheduler import MODEL, make_config, waiting_runs

    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    client, sched, (bad, good) = await waiting_runs(redis, config, 2)
    assert sched.waiting[MODEL][0].run_id == bad
    sched.waiting[MODEL][0].exclude = frozenset({"a"})  # (an attempt failed there: it goes nowhere else)
    await redis.delete(keys.run_events(bad))
    await redis.set(keys.run_events(bad), "x")
    await sched.dispatch_round()
    assert await fields(redis, keys.run_record(bad), "state", "error_code") == ["failed", "provider_error"]
    assert [f[b"type"] for _, f in await redis.xrange(keys.run_events(bad))] == [b"failed"]
    assert await fields(redis, keys.run_record(good), "state") == ["dispatched"]
    await client.close()


async def test_a_running_run_s_record_of_another_type_stops_its_attempt_at_its_next_renewal(redis: Redis) -> None:
    """`SET iop:run:{run} x` of a running run: its lease's renewal failed with WRONGTYPE, which ended
    the renewals (an exception nobody read) while the request went on at its provider, for as long as
    its execution timeout, past its lease: the reaper gave its slot to another run meanwhile, one
    more than the provider's capacity. The attempt owns no run: it stops, as one whose lease went."""
    from tests.test_cancel import StallingAdapter, dispatched_run

    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=150)
    adapter = StallingAdapter()
    runner = Runner(redis, client.config, "n-a", {"a": adapter})
    execution = asyncio.create_task(runner.execute(run_id))
    try:
        async def running() -> bool:
            return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")
        await async_wait_until(running, what="the run to start")
        await redis.delete(keys.run_record(run_id))
        await redis.set(keys.run_record(run_id), "x")
        assert await asyncio.wait_for(execution, 10) == "lease_lost"
        assert adapter.closed.is_set()
        assert run_id not in runner.running
    finally:
        execution.cancel()
        await asyncio.gather(execution, return_exceptions=True)
        await client.close()
    assert await redis.get(keys.run_record(run_id)) == b"x"


async def test_a_running_run_s_record_of_another_type_leaves_its_worker_hearing_the_others_cancels(
        redis: Redis) -> None:
    """`SET iop:run:{run} x` of a run running here: a cancel message for it (the gateway tells every node
    to cancel a run it found lost) failed the read of why it was cancelled, and the cancel listener
    subscribed again, whose look for the cancels it missed (one pipeline for every run running here)
    failed on the same record, again and again while the run ran: the cancels of the worker's other
    runs went unheard meanwhile. That run is cancelled as by its caller; the others' cancels are heard."""
    from tests.test_scheduler import make_config
    from workers.runner import CANCELLED, Attempt
    from workers.service import _cancel, _cancelled_unheard

    runner = Runner(redis, make_config({"a": 2}), "n-a", {})
    hold = asyncio.Event()
    tasks = {r: asyncio.create_task(hold.wait()) for r in ("bad", "good")}
    for run_id, task in tasks.items():
        runner.running[run_id] = (Attempt(run_id, "m:1", "a", "1", 3), task)
    await redis.set(keys.run_record("bad"), "x")
    await redis.hset(keys.run_record("good"), mapping={"state": "running", "cancel": "1"})
    try:
        assert await _cancelled_unheard(runner) == ["good"]
        await _cancel(runner, "bad")
        assert runner.running["bad"][0].cancelled == CANCELLED
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def test_a_passed_run_s_record_of_another_type_does_not_stop_its_node_s_workers(
        redis: Redis, redis_url: str) -> None:
    """`SET iop:run:{run} x` of a run in its node's passed list (a worker that lacks its provider or model
    left it to another): every `take_woken` of the node's workers failed with WRONGTYPE at it, and each
    worker exited, for as long as it was listed. It leaves the list; the node's runs are taken."""
    from tests.test_scheduler import make_config, waiting_runs

    config = make_config({"a": 2}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    _, sched, (good,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()  # (its id goes on the node's wake list)
    await redis.set(keys.run_record("bad"), "x")
    await redis.lpush(keys.node_passed("n-a"), "bad")
    worker = node_worker(redis_url, Runner(redis, config, "n-a", {"a": Scripted([[TEXT]])}), poll_delay=0.2)
    try:
        taken, _, _ = await worker._take_woken(2)
        await worker._start(taken)
        assert await worker.tasks[good] == "completed:ok"
        assert not await redis.exists(keys.node_passed("n-a"))
    finally:
        await worker.pool.aclose(close_connection_pool=True)
    assert await redis.get(keys.run_record("bad")) == b"x"


async def test_a_dispatched_run_s_record_of_another_type_does_not_keep_the_last_worker_from_giving_back_the_rest(
        redis: Redis, redis_url: str) -> None:
    """`SET iop:run:{run} x` of a run dispatched to a node whose last worker stops: `worker_left` failed
    with WRONGTYPE at it, midway, the node's runs after it left to their leases (an attempt counted
    each) and no scheduler woken. It is passed over; the others are queued again."""
    from tests.test_runner import dispatched_runs
    from workers.service import RUNNER_CTX, leave_node

    runner, _ = await dispatched_runs(redis, 2)
    bad, good = [r.decode() for r in await redis.zrange(keys.node_queue("n-a"), 0, -1)]
    await redis.delete(keys.run_record(bad))
    await redis.set(keys.run_record(bad), "x")
    worker = node_worker(redis_url, runner)
    worker.ctx[RUNNER_CTX] = runner
    await redis.zadd(keys.node_workers("n-a"), {worker.instance: 2**50})  # as its heartbeat registers it
    try:
        await leave_node(worker, runner.config, "n-a")
        assert await fields(redis, keys.run_record(good), "state", "attempts") == ["queued", "0"]
        assert not await redis.exists(keys.node_wake("n-a"))
    finally:
        await worker.pool.aclose(close_connection_pool=True)
    assert await redis.get(keys.run_record(bad)) == b"x"


async def test_every_script_that_reads_a_run_s_record_answers_one_of_another_type_as_a_run_gone(
        redis: Redis) -> None:
    """`SET iop:run:{run} x`: each of these scripts failed with WRONGTYPE (an attempt's output, its end,
    its blame, a follower's watch, a cancel), its caller with it. Each answers as for a run gone (or an
    attempt that owns none), writes nothing to the key, and leaves it to its owner."""
    from common.scripts import Scripts

    scripts = Scripts(redis)
    record, events = keys.run_record("bad"), keys.run_events("bad")
    await redis.set(record, "x")
    assert await scripts.call("renew", [keys.leases("a"), record], ["bad", 1000, "1", ""]) == 0
    assert await scripts.call("emit", [record, events], ["1", "delta", b"", 10, "bad", 1]) == 0
    assert await scripts.call("finish", [record, keys.leases("a"), events, keys.runs_stream("m"),
                                         keys.heartbeat("a"), keys.node_queue("n"), keys.arq_in_progress("bad")],
                              ["bad", "completed", "completed", b"", 60, "", "m", "", "", "1"]) == b"stale"
    assert await scripts.call("blame", [record, keys.heartbeat("b")], [3, 1000, "b", "b-name"]) == []
    assert await scripts.call("watch", [record], ["g1"]) == 0
    assert await scripts.call("drop_queued", [keys.runs_stream("m"), record, events], [
        "bad", keys.SCHEDULER_GROUP, "cancelled", b"", 60, "cancelled", "gone", keys.node_cancel(""), "", "m"]) == \
        b"missing"
    assert await redis.get(record) == b"x"
    assert not await redis.exists(events)


async def test_the_caller_of_a_run_whose_record_is_of_another_type_is_answered_not_left_waiting(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SET iop:run:{run} x` while its caller waits: the caller heard nothing until its follow deadline
    (the gateway's listener failing every read meanwhile). It hears 502 `worker_lost`, OpenAI-shaped,
    saying why, at the gateway's next check of its quiet runs."""
    from tests.openapi import validate
    from tests.test_runs_api import MODEL, api_for, make_config

    monkeypatch.setattr("gateway.events.QUIET_CHECK_S", 0.05)
    async with api_for(make_config(), redis_url) as api:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = asyncio.create_task(api.session.post(api.url("/v1/chat/completions"), json=body))
        try:
            async def queued() -> list[bytes]:
                return [k for k in await api.redis.keys(keys.run_record("*")) if await api.redis.type(k) == b"hash"]
            (record,) = await async_wait_until(queued, what="the run queued")
            await api.redis.delete(record)
            await api.redis.set(record, "x")
            async with asyncio.timeout(10):  # (its follow deadline is 31.5 s)
                resp = await answer
            assert resp.status == 502
            error = await resp.json()
            validate("ErrorResponse", error)
            assert error["error"]["code"] == "worker_lost" and "another type" in error["error"]["message"]
            resp.release()
        finally:
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            await api.client.close()
