"""Runs whose caller's gateway died are cancelled: the `orphans` script on a real Redis, and
real processes (a gateway killed with SIGKILL while its callers' runs stream and wait)."""

from __future__ import annotations

import functools
import json
import signal
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis as sync_redis
from aiohttp import web
from redis.asyncio import Redis

from common import keys
from common.config import parse_config
from common.scripts import Scripts
from gateway import liveness
from gateway.app import RUNS, build_app
from gateway.take_back import Kept
from scheduler.core import OUTAGE_GRACE, Scheduler
from tests.conftest import Stack, async_wait_until, wait_until
from tests.test_e2e import FAST_RUNTIME, pool_config, wait_available

LIVENESS_MS = 1000  # (FAST_RUNTIME's scheduler_liveness_ms: the least it may be)


async def orphans(redis: Redis, *run_ids: str) -> list[tuple[str, str]]:
    answer = await Scripts(redis).call("orphans", [keys.GATEWAYS],
                                       [keys.run_record(""), keys.gateway_alive(""), *run_ids])
    return [(answer[i].decode(), answer[i + 1].decode()) for i in range(0, len(answer), 2)]


async def test_a_run_is_orphaned_when_every_gateway_waiting_for_it_died(redis: Redis) -> None:
    await redis.hset(keys.GATEWAYS, mapping={"dead": 1, "live": 1, "dead2": 1})
    await redis.set(keys.gateway_alive("live"), 1)
    runs = {  # (the first watcher: the caller's gateway)
        "r-dead": ("dead~", "running"),
        "r-queued": ("dead2~,live", "queued"),  # (its caller's gateway died; a runs-API follower lives)
        "r-live": ("live~,dead", "dispatched"),
        "r-following": ("dead", "running"),  # (its caller's own gateway also followed it: still the caller's)
        "r-unknown": ("old~", "running"),  # (a gateway the hash does not name: an older version's)
        "r-ended": ("dead~", "completed"),
        "r-none": ("", "running"),
        # (its cancel is recorded already: its worker's renewal or the reaper ends it; each sweep
        # told it again, a line a sweep: a new operator)
        "r-told": ("dead~", "running"),
    }
    for run_id, (watchers, state) in runs.items():
        await redis.hset(keys.run_record(run_id), mapping={"watchers": watchers, "state": state, "model": "m"})
    await redis.hset(keys.run_record("r-told"), "cancel", "1")
    found = await orphans(redis, *runs, "r-missing")
    assert found == [("r-dead", "m"), ("r-queued", "m"), ("r-following", "m")]
    await redis.set(keys.gateway_alive("dead"), 1)  # (it beat again)
    assert await orphans(redis, *runs) == [("r-queued", "m")]


async def test_following_a_run_from_its_callers_gateway_keeps_that_gateway_first(redis: Redis) -> None:
    """The runs API's `watch` turns the caller's output-only watcher into a full one in its place
    (it was moved last, and `orphans` took the run for one no caller waits for)."""
    scripts = Scripts(redis)
    await redis.hset(keys.run_record("r"), mapping={"watchers": "g~,h", "state": "running"})
    assert await scripts.call("watch", [keys.run_record("r")], ["g"]) == 1
    assert await redis.hget(keys.run_record("r"), "watchers") == b"g,h"
    assert await scripts.call("watch", [keys.run_record("r")], ["k"]) == 1
    assert await redis.hget(keys.run_record("r"), "watchers") == b"g,h,k"


async def test_a_gateway_is_named_again_whenever_its_key_is_set_anew(redis: Redis) -> None:
    """Its first beat, and after a Redis that restarted empty (a gateway left unnamed would be
    presumed alive for good: its callers' runs never cancelled once it died)."""
    await liveness.beat(redis, "g1", 5_000)
    assert await redis.exists(keys.gateway_alive("g1")) and await redis.hexists(keys.GATEWAYS, "g1")
    await redis.hset(keys.GATEWAYS, "g1", "marked")
    await liveness.beat(redis, "g1", 5_000)  # (the key is there: only its TTL is renewed)
    assert await redis.hget(keys.GATEWAYS, "g1") == b"marked" and 0 < await redis.pttl(keys.gateway_alive("g1"))
    await redis.flushall()  # (Redis restarted without persistence)
    await liveness.beat(redis, "g1", 5_000)
    assert await redis.exists(keys.gateway_alive("g1")) and await redis.hexists(keys.GATEWAYS, "g1")
    await liveness.forget(redis, "g1")
    assert not await redis.exists(keys.gateway_alive("g1"), keys.GATEWAYS)


async def test_a_gateway_that_stops_with_cancels_redis_did_not_take_stays_named(redis_url: str) -> None:
    """A stopping gateway forgets itself (its runs are its own to end), but not while it holds
    cancels Redis did not take (Redis was away as its callers left, or as its stop cut their
    requests): named, with a key that lapses, it has those runs cancelled by a scheduler as a dead
    gateway's; forgotten, it was presumed alive, and they went on for nobody."""
    config = parse_config(pool_config({"p": ("n1", "http://127.0.0.1:9", 1)}))
    for kept in (False, True):
        app = build_app(config, redis_url)
        runner = web.AppRunner(app)
        await runner.setup()
        gateway_id = app[RUNS].hub.gateway_id
        async with Redis.from_url(redis_url) as redis:
            named = functools.partial(redis.hexists, keys.GATEWAYS, gateway_id)
            await async_wait_until(named, what="the gateway named")
            if kept:  # (as `TakeBack.add` keeps it when Redis refuses the cancel; no task sends it here)
                app[RUNS].take_back.kept["run_x"] = Kept("m", "the caller went away", float("inf"))
            await runner.cleanup()
            assert bool(await redis.hexists(keys.GATEWAYS, gateway_id)) is kept


async def test_after_its_start_or_an_outage_a_scheduler_waits_its_grace_before_judging_gateways(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that has reached Redis for less than `OUTAGE_GRACE` gateway liveness periods
    without a gap cancels no gateway's runs: processes cut off from Redis together come back at
    different times (under podman a gateway came back 15 s after a scheduler, its liveness 10 s,
    and every one of its callers' runs was cancelled). Then a dead gateway's running run is
    cancelled as before, with the 503 its callers hear."""
    config = parse_config({**pool_config({"p": ("n1", "http://127.0.0.1:9", 1)}),
                           "runtime": {**FAST_RUNTIME, "gateway_liveness_ms": LIVENESS_MS}})
    clock = [10_000_000]
    monkeypatch.setattr("scheduler.core.now_ms", lambda: clock[0])
    sched = Scheduler(redis, config)
    await redis.hset(keys.GATEWAYS, "dead", 1)  # (named, and its liveness key gone)
    await redis.hset(keys.run_record("r"), mapping={"watchers": "dead~", "state": "running", "node": "n1",
                                                    "model": "qwen3.6:35b"})
    await redis.zadd(keys.leases("p"), {"r": clock[0] + 60_000})
    # and one on a provider taken out of the config, whose worker of the old config runs it yet
    await redis.hset(keys.run_record("r2"), mapping={"watchers": "dead~", "state": "running", "node": "n2",
                                                     "model": "qwen3.6:35b"})
    await redis.zadd(keys.leases("gone"), {"r2": clock[0] + 60_000})
    assert await sched.reap_expired_leases() == 0  # (its lease lives: nothing to reap, but found)

    async def steady_for(ms: int) -> None:  # (heartbeats a third of the liveness apart: no gap)
        for _ in range(ms // (LIVENESS_MS // 3)):
            clock[0] += LIVENESS_MS // 3
            await sched.heartbeat()

    async def after_an_outage() -> None:
        clock[0] += 10 * LIVENESS_MS  # (no heartbeat went through meanwhile)
        await sched.heartbeat()

    for begin in (sched.heartbeat, after_an_outage):  # (its start, then an outage)
        await begin()
        await steady_for(OUTAGE_GRACE * LIVENESS_MS - LIVENESS_MS // 3)
        assert await sched.cancel_orphans() == 0
        assert await redis.hget(keys.run_record("r"), "cancel") is None
    await steady_for(LIVENESS_MS)
    assert await sched.cancel_orphans() == 2
    for run_id in ("r", "r2"):
        assert await redis.hmget(keys.run_record(run_id), ["cancel", "cancel_code"]) == [b"1", b"service_unavailable"]


def stream_in_thread(url: str, body: dict[str, Any], out: dict[str, Any]) -> threading.Thread:
    """A caller streaming on its own thread: what it read before its gateway died."""
    def read() -> None:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                out["first"] = resp.readline()
                out["rest"] = resp.read()
        except Exception as exc:  # (the gateway dies under it)
            out["error"] = exc

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def one_provider(stack: Stack) -> str:
    """A simulator as the one provider (capacity 1) of the model, a scheduler and a worker, with the
    test's gateway liveness; the simulator's URL."""
    sim = stack.simulator(["p-served"])
    config = pool_config({"p": ("n1", sim, 1)})
    config["runtime"] = {**FAST_RUNTIME, "gateway_liveness_ms": LIVENESS_MS}
    stack.write_config(config)
    stack.scheduler()
    stack.worker("n1")
    return sim


def test_a_killed_gateways_running_and_queued_runs_are_cancelled(stack: Stack) -> None:
    """Gateway A dies (SIGKILL) with one run of its caller streaming and one waiting behind it:
    within the liveness time both are cancelled (the provider's request is closed, its slot
    freed, the waiting run never sent to it), while gateway B's caller, whose run then takes
    the slot and outlives several liveness periods, gets its whole answer."""
    sim = one_provider(stack)
    scheduler = next(p for p in stack.procs if p.name == "scheduler")
    doomed = stack.start("gateway-a", "gateway", "--host", "127.0.0.1", "--port", "0")
    url_a = doomed.wait_for_line(r"listening on (http://\S+)").group(1)
    url_b = stack.gateway()
    wait_available(stack.redis_url, ["p"])
    r = sync_redis.Redis.from_url(stack.redis_url)

    def stats() -> dict[str, Any]:
        with urllib.request.urlopen(sim + "/stats") as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data

    slow = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "sim": {"tokens": 1000, "itl_ms": 50}}
    running: dict[str, Any] = {}
    stream_in_thread(url_a + "/v1/chat/completions", slow, running)
    wait_until(lambda: stats()["current"] == 1, what="A's run streaming")
    queued: dict[str, Any] = {}
    stream_in_thread(url_a + "/v1/chat/completions", slow, queued)
    wait_until(lambda: r.xlen("iop:runs:qwen3.6:35b") == 1, what="A's second run waiting")
    # B's caller waits behind them: the slot comes to it once A's runs are cancelled
    survivor: dict[str, Any] = {}
    b_body = {**slow, "sim": {"tokens": 40, "itl_ms": 50}}  # (2 s: several liveness periods)
    b_thread = stream_in_thread(url_b + "/v1/chat/completions", b_body, survivor)
    wait_until(lambda: r.xlen("iop:runs:qwen3.6:35b") == 2, what="B's run waiting")

    doomed.send(signal.SIGKILL)

    def cancelled() -> list[dict[bytes, bytes]]:
        return [rec for rec in (r.hgetall(k) for k in r.scan_iter("iop:run:*")) if rec.get(b"state") == b"cancelled"]

    wait_until(lambda: len(cancelled()) == 2, timeout=20, what="A's two runs cancelled")
    assert all(b"gateway stopped" in rec.get(b"error_message", b"") for rec in cancelled()), cancelled()
    # (the scheduler's line named no run: each run has its own, as every line about a run has. It is
    # logged after the cancel's script, and read from the scheduler's output by a thread: waited for)
    def named() -> list[str]:
        return [line for line in scheduler.output(last=2000).splitlines() if "cancelled (" in line]

    wait_until(lambda: len(named()) >= 2, what="the scheduler's two lines of the cancels")
    assert len(named()) == 2 and all(" run=run_" in line and "model=qwen3.6:35b" in line for line in named()), named()
    b_thread.join(60)
    assert "error" not in survivor, survivor
    assert survivor["rest"].rstrip().endswith(b"data: [DONE]") and b'"error"' not in survivor["rest"]
    served = stats()
    assert served["total"] == 2 and served["current"] == 0  # (A's waiting run never reached the provider)
    assert r.zcard("iop:leases:p") == 0
    r.close()


def test_a_live_gateways_long_run_is_never_cancelled(stack: Stack) -> None:
    """A run that streams for many liveness periods through a gateway that lives ends whole."""
    one_provider(stack)
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["p"])
    out: dict[str, Any] = {}
    body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "sim": {"tokens": 60, "itl_ms": 50}}  # (3 s: five liveness periods)
    stream_in_thread(gateway + "/v1/chat/completions", body, out).join(60)
    assert "error" not in out and out["rest"].rstrip().endswith(b"data: [DONE]") and b'"error"' not in out["rest"]


def call_in_thread(url: str, body: dict[str, Any], out: dict[str, Any]) -> threading.Thread:
    """A caller waiting for a whole answer on its own thread: its status and body."""
    def call() -> None:
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                out["status"], out["body"] = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            out["status"], out["body"] = exc.code, json.loads(exc.read())

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_paused_gateways_callers_hear_a_503_once_it_resumes(stack: Stack) -> None:
    """A gateway that stops renewing its liveness without dying (SIGSTOP here; a paused VM, a
    gateway cut off from Redis) has its callers' runs cancelled as a dead one's. Once it resumes,
    a caller whose run waited hears a 503 `service_unavailable` saying to send the request again
    (the official clients do), not a 499 for a cancel it never asked for; a stream that had
    output hears the same in the stream, then `[DONE]`."""
    sim = one_provider(stack)
    paused = stack.start("gateway-a", "gateway", "--host", "127.0.0.1", "--port", "0")
    url = paused.wait_for_line(r"listening on (http://\S+)").group(1) + "/v1/chat/completions"
    wait_available(stack.redis_url, ["p"])
    r = sync_redis.Redis.from_url(stack.redis_url)

    def current() -> int:
        with urllib.request.urlopen(sim + "/stats") as resp:
            return int(json.loads(resp.read())["current"])

    slow = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}],
            "sim": {"tokens": 1000, "itl_ms": 50}}
    streaming: dict[str, Any] = {}
    threads = [stream_in_thread(url, {**slow, "stream": True}, streaming)]
    wait_until(lambda: current() == 1 and "first" in streaming, what="the stream under way")
    waiting: dict[str, Any] = {}
    threads.append(call_in_thread(url, slow, waiting))
    wait_until(lambda: r.xlen("iop:runs:qwen3.6:35b") == 1, what="the second run waiting")

    paused.send(signal.SIGSTOP)
    try:
        wait_until(lambda: sorted(r.hget(k, "state") or b"" for k in r.scan_iter("iop:run:*")) == [b"cancelled"] * 2,
                   timeout=20, what="both runs cancelled")
    finally:
        paused.send(signal.SIGCONT)
    for thread in threads:
        thread.join(30)
    assert waiting["status"] == 503, waiting
    error = waiting["body"]["error"]
    assert error["code"] == "service_unavailable" and "send the request again" in error["message"], error
    rest = streaming["rest"].decode()
    assert '"code": "service_unavailable"' in rest.replace('":"', '": "') and rest.rstrip().endswith("data: [DONE]")
    wait_until(lambda: current() == 0, what="the provider's request closed")
    assert r.zcard("iop:leases:p") == 0
    r.close()


async def test_after_a_redis_outage_the_grace_holds_whichever_of_its_tasks_reaches_redis_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's liveness beats in a task of its own, and its sweeps (the look for orphans among
    them) in another: after an outage each comes back when its own backoff runs out. A sweep back
    first judged the gateways at once, with the gap its liveness task had not beaten through yet,
    and cancelled the runs of a live gateway whose key lapsed in the outage (the grace is there for
    that gateway: it reaches Redis after the replica, within the grace)."""
    import asyncio

    from common.redisconn import connect, now_ms
    from iop.embedded_redis import RedisServer
    from scheduler.core import run_scheduler
    from tests.conftest import async_wait_until

    server = RedisServer(appendonly=True).start()  # (the run and its lease outlive the restart)
    config = parse_config({**pool_config({"p": ("n1", "http://127.0.0.1:9", 1)}),
                           "runtime": {**FAST_RUNTIME, "gateway_liveness_ms": LIVENESS_MS, "lease_ttl_ms": 600_000}})
    redis = connect(server.url)
    sched = Scheduler(redis, config)
    await redis.hset(keys.GATEWAYS, "gw", now_ms())
    await redis.hset(keys.run_record("r"), mapping={"watchers": "gw~", "state": "running", "node": "n1",
                                                    "model": "qwen3.6:35b"})
    await redis.zadd(keys.leases("p"), {"r": now_ms() + 600_000})
    gateway_up = asyncio.Event()
    gateway_up.set()

    async def gateway() -> None:  # (renews its key every third of its liveness while it is up)
        while True:
            await gateway_up.wait()
            try:
                await redis.set(keys.gateway_alive("gw"), 1, px=LIVENESS_MS)
            except Exception:
                pass
            await asyncio.sleep(LIVENESS_MS / 3000)

    back = asyncio.Event()
    late = [True]
    heartbeat = sched.heartbeat

    async def beat_late() -> None:  # (the liveness task's backoff runs out after the sweeps' does)
        if back.is_set() and late[0]:
            late[0] = False
            await asyncio.sleep(2.5)
        await heartbeat()

    monkeypatch.setattr(sched, "heartbeat", beat_late)
    beater = asyncio.create_task(gateway())
    stop = asyncio.Event()
    running = asyncio.create_task(run_scheduler(sched, stop))
    try:
        # steady past its grace, the gateway alive: nothing is cancelled
        await async_wait_until(lambda: asyncio.sleep(0, sched._steady_since_ms and
                                                     now_ms() - sched._steady_since_ms > OUTAGE_GRACE * LIVENESS_MS),
                               what="the replica steady for its grace")
        gateway_up.clear()
        server.stop(kill=True)  # the outage: the gateway's key lapses meanwhile
        down_ms = now_ms()
        await async_wait_until(lambda: asyncio.sleep(0, now_ms() - down_ms > 2 * LIVENESS_MS),
                               what="the gateway's key to lapse", timeout=10)
        back.set()
        server.start()
        # the gateway comes back within the grace (right after the replica's liveness beat again)
        await async_wait_until(lambda: asyncio.sleep(0, sched._beat_ms > down_ms), what="the replica to beat again")
        gateway_up.set()
        await async_wait_until(lambda: redis.exists(keys.gateway_alive("gw")), what="the gateway back")
        assert await redis.hget(keys.run_record("r"), "cancel") is None
    finally:
        stop.set()
        await running
        beater.cancel()
        await asyncio.gather(beater, return_exceptions=True)
        await redis.aclose()
        server.cleanup()
