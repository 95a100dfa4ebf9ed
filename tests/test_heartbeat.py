"""The heartbeat loop of one worker against a real Redis, with scripted probes: it probes only
when nothing showed the provider alive, never a disturbing probe while the provider runs
iop's runs, ignores a probe timeout while it is busy, and takes an idle provider down after
three timeouts and back up after a probe that passes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.catalog import read_catalog
from common.config import Config, parse_config
from common.policy import Health
from common.redisconn import NotPrimaryError, now_ms
from common.scripts import Scripts
from common.wire import RunKind
from tests.conftest import async_wait_until
from workers.adapters.base import ProbeResult
from workers.heartbeat import Heartbeats, health_said


class Probed:
    """An adapter whose probe answers what the test says, or never (`hang`)."""

    def __init__(self) -> None:
        self.calls = 0
        self.hang = False
        self.broken = False
        self.result = ProbeResult(Health.AVAILABLE, "", ["served"], strikes=0)

    async def probe(self) -> ProbeResult:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.broken:
            raise RecursionError("maximum recursion depth exceeded")
        return self.result

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        raise AssertionError("not used")

    def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        raise AssertionError("not used")

    async def close(self) -> None:
        return None


def config(ptype: str) -> Config:
    return parse_config({
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n", "providers": [{"id": "p", "type": ptype, "base_url": "http://127.0.0.1:9",
                                              "capacity": 2, "models": ["served"], "probe_timeout_ms": 50}]}],
        "runtime": {"heartbeat_interval_ms": 30, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 40},
    })


@pytest.fixture
async def beating(redis: Redis, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Heartbeats, Probed]]:
    adapter = Probed()
    beats = Heartbeats(redis, config(request.param), "n", {"p": adapter})
    task = asyncio.create_task(beats.run())
    yield beats, adapter
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def health(redis: Redis) -> str:
    return ((await redis.hget(keys.heartbeat("p"), "health")) or b"").decode()


async def more_probes(adapter: Probed, count: int, timeout: float = 15.0) -> None:
    """Wait until `adapter` has been probed `count` more times than now."""
    probes = adapter.calls

    async def probed() -> bool:
        return adapter.calls >= probes + count

    await async_wait_until(probed, timeout, what=f"{count} more probes")


async def until_health(redis: Redis, expected: str) -> None:
    async def check() -> bool:
        return await health(redis) == expected
    await async_wait_until(check, timeout=10, what=f"health {expected}")


async def hold_slot(redis: Redis) -> None:
    await redis.zadd(keys.leases("p"), {"run_x": now_ms() + 600_000})


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_an_idle_provider_is_down_after_three_timeouts_and_up_after_a_pass(
        redis: Redis, beating: tuple[Heartbeats, Probed]) -> None:
    beats, adapter = beating
    await until_health(redis, "available")
    adapter.hang = True
    await until_health(redis, "unavailable")
    reason = (await redis.hget(keys.heartbeat("p"), "reason") or b"").decode()
    assert reason == "the probe got no answer within 1150 ms"  # (vLLM: three requests of 50 ms, and 1 s)
    assert int(await redis.hget(keys.heartbeat("p"), "fails") or 0) >= 3
    adapter.hang = False
    await until_health(redis, "available")


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_a_provider_going_down_is_a_warning_and_its_return_info(
        redis: Redis, beating: tuple[Heartbeats, Probed], caplog: pytest.LogCaptureFixture) -> None:
    """A provider that went down was said at INFO: an operator's log filter at WARNING never saw it."""
    beats, adapter = beating
    caplog.set_level(logging.INFO, logger="iop.worker")

    def said(health: str) -> list[str]:
        return [r.levelname for r in caplog.records if r.getMessage().startswith(f"provider p is {health}")]

    async def said_up() -> bool:
        return bool(said("available"))

    await async_wait_until(said_up, timeout=10, what="the provider said available")
    adapter.hang = True

    async def said_down() -> bool:
        return bool(said("unavailable"))

    await async_wait_until(said_down, timeout=10, what="the provider said unavailable")
    assert said("unavailable") == ["WARNING"]
    # (its provider and node as fields, for a JSON log's filter)
    down = next(r for r in caplog.records if r.getMessage().startswith("provider p is unavailable"))
    assert (getattr(down, "provider", None), getattr(down, "node", None)) == ("p", beats.node_id)
    adapter.hang = False
    caplog.clear()
    await async_wait_until(said_up, timeout=10, what="the provider said available again")
    assert said("available") == ["INFO"]


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_a_probe_that_fails_in_the_worker_is_recorded_and_the_next_one_runs(
        redis: Redis, beating: tuple[Heartbeats, Probed], caplog: pytest.LogCaptureFixture) -> None:
    """A probe that raises (a bug, an answer nothing foresaw) ends as `unknown` with why, instead of
    a task whose error nobody reads and a health frozen at what it was."""
    beats, adapter = beating
    await until_health(redis, "available")
    adapter.broken = True
    with caplog.at_level(logging.ERROR, logger="iop.worker"):
        await until_health(redis, "unknown")
        assert await redis.hget(keys.heartbeat("p"), "reason") == b"the probe failed in the worker (RecursionError)"
        await more_probes(adapter, 2)
    # (its traceback once, not at every probe: a helper counted 32 a minute)
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [
        "probe of p failed (logged once; its heartbeat's reason says so while it lasts)"]
    adapter.broken = False
    await until_health(redis, "available")


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_a_busy_provider_whose_probe_times_out_stays_available(
        redis: Redis, beating: tuple[Heartbeats, Probed]) -> None:
    beats, adapter = beating
    await until_health(redis, "available")
    await hold_slot(redis)
    adapter.hang = True
    await more_probes(adapter, 3, timeout=20)  # (each timing out)
    assert await health(redis) == "available"
    assert int(await redis.hget(keys.heartbeat("p"), "fails") or 0) == 0


@pytest.mark.parametrize("beating", ["llamacpp"], indirect=True)
async def test_a_disturbing_probe_waits_until_the_provider_runs_nothing(
        redis: Redis, beating: tuple[Heartbeats, Probed]) -> None:
    beats, adapter = beating
    await until_health(redis, "available")
    await hold_slot(redis)
    calls = adapter.calls
    await redis.hset(keys.heartbeat("p"), mapping={"ok_ms": 0, "probe_ms": 0})  # long since a sign of life
    beats_seen: set[bytes] = set()

    async def ten_beats() -> bool:
        beats_seen.add(await redis.hget(keys.heartbeat("p"), "ts_ms") or b"")
        return len(beats_seen) > 10

    await async_wait_until(ten_beats, what="ten heartbeats")
    assert adapter.calls == calls and await health(redis) == "available"  # not one probe while it runs
    await redis.delete(keys.leases("p"))
    await async_wait_until(lambda: asyncio.sleep(0, adapter.calls > calls), what="a probe once idle")
    assert not await redis.exists(keys.probing("p"))  # its lock is gone again


@pytest.mark.parametrize("beating", ["llamacpp"], indirect=True)
async def test_a_disturbing_probe_waits_while_the_server_still_generates_a_run_iop_gave_up(
        redis: Redis, beating: tuple[Heartbeats, Probed]) -> None:
    """llama-cpp-python goes on generating a non-stream answer whose caller left, for nobody, and its
    `GET /v1/models` waits for that: probes sent then timed out, three strikes, and the catalog said a
    busy server `unavailable` until it was done (40 s of a 2,000-token answer, found by an operator's
    day). Until the heartbeat's `busy_until_ms` (the runner's, as it gives such a run up) no probe is
    sent, as while it runs iop's runs; the health stays what it was."""
    beats, adapter = beating
    await until_health(redis, "available")
    adapter.hang = True  # (what a probe would meet: no answer until the generation ends)
    calls = adapter.calls
    await redis.hset(keys.heartbeat("p"), mapping={"ok_ms": 0, "probe_ms": 0, "busy_until_ms": now_ms() + 600_000})
    beats_seen: set[bytes] = set()

    async def ten_beats() -> bool:
        beats_seen.add(await redis.hget(keys.heartbeat("p"), "ts_ms") or b"")
        return len(beats_seen) > 10

    await async_wait_until(ten_beats, what="ten heartbeats")
    assert adapter.calls == calls and await health(redis) == "available"
    assert int(await redis.hget(keys.heartbeat("p"), "fails") or 0) == 0
    adapter.hang = False
    await redis.hset(keys.heartbeat("p"), "busy_until_ms", now_ms() - 1)  # (done: probed again)
    await async_wait_until(lambda: asyncio.sleep(0, adapter.calls > calls), what="a probe once it is done")


async def test_a_worker_s_heartbeat_keeps_it_among_its_node_s_workers_for_as_long_as_a_heartbeat_lives(
        redis: Redis) -> None:
    """`iop:workers:{node}`, which the last worker to stop reads (`worker_left`): each beat puts
    the worker's instance there until `heartbeat_ttl_ms` from now, and the set itself expires
    then, so a node whose workers all died leaves nothing behind."""
    cfg = config("vllm")
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()}, "host:1:abc")
    before = now_ms()
    await beats.beat_once(cfg.nodes[0].providers[0])
    until = await redis.zscore(keys.node_workers("n"), "host:1:abc")
    ttl = cfg.runtime.heartbeat_ttl_ms
    assert until is not None and before + ttl <= until <= now_ms() + ttl
    assert 0 < await redis.pttl(keys.node_workers("n")) <= cfg.runtime.heartbeat_ttl_ms
    await Heartbeats(redis, cfg, "n", {"p": Probed()}).beat_once(cfg.nodes[0].providers[0])  # (no instance: none)
    assert await redis.zcard(keys.node_workers("n")) == 1


async def test_a_killed_worker_s_entry_leaves_its_node_s_workers_at_the_next_beat_of_another(redis: Redis) -> None:
    """A worker killed with SIGKILL never runs `worker_left`: its instance stayed in `iop:workers:{node}`
    with its lapsed time for as long as another worker of the node kept beating (found after a
    SIGKILL of one of a node's two workers: still there 24 min later). Each beat now drops the lapsed."""
    cfg = config("vllm")
    lapsed = now_ms() - cfg.runtime.heartbeat_ttl_ms - 1_000  # (lapsed a heartbeat's life ago)
    await redis.zadd(keys.node_workers("n"), {"host:2:killed": lapsed, "host:3:alive": now_ms() + 60_000})
    await Heartbeats(redis, cfg, "n", {"p": Probed()}, "host:1:abc").beat_once(cfg.nodes[0].providers[0])
    assert sorted(await redis.zrange(keys.node_workers("n"), 0, -1)) == [b"host:1:abc", b"host:3:alive"]


async def test_a_worker_of_the_node_announcing_the_provider_otherwise_is_warned_of_once(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Two workers of a node with different configs (a rollout half done) overwrite each other's
    capacity every beat: the one that sees the other's says so, once for each disagreement."""
    cfg = config("vllm")
    provider = cfg.nodes[0].providers[0]
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})

    async def other_beat(**fields: str) -> None:  # (as another worker's beat leaves the hash)
        await redis.hset(keys.heartbeat("p"), mapping={"worker": "other-host:7", "capacity": "2", **fields})
        await beats.beat_once(provider)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    await other_beat()  # the same capacity: nothing to say
    await beats.beat_once(provider)  # (its own beat last)
    assert warnings() == []
    for _ in range(3):
        await other_beat(capacity="3")
        await beats.beat_once(provider)
    assert warnings() == ["provider p: worker other-host:7 of node n announces capacity 3 (this one's: 2): the "
                          "provider's workers run different configs, and each beat's writer wins (restart them with "
                          "one config)"]
    await other_beat(capacity="3", models='["served", "more"]')
    assert len(warnings()) == 2 and "capacity 3 (this one's: 2); models [\"served\", \"more\"]" in warnings()[1]
    assert await redis.hget(keys.heartbeat("p"), "capacity") == b"2"  # (its own config, as before)
    await other_beat(node="n-new")  # (a rollout that moves the provider to another node)
    assert "worker other-host:7 of node n-new announces node n-new (this one's: n)" in warnings()[2]


async def test_a_beat_puts_its_provider_among_those_beating_which_a_catalog_of_another_config_names(
        redis: Redis) -> None:
    cfg = config("vllm")
    ttl = cfg.runtime.heartbeat_ttl_ms
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    await redis.zadd(keys.BEATING, {"gone": now_ms() - 10 * ttl})  # (a provider whose workers stopped long ago)
    before = now_ms()
    await beats.beat_once(cfg.nodes[0].providers[0])
    until = await redis.zscore(keys.BEATING, "p")
    assert until is not None and before + ttl <= until <= now_ms() + ttl
    assert await redis.zscore(keys.BEATING, "gone") is None and 0 < await redis.pttl(keys.BEATING) <= ttl
    other = parse_config({
        "models": [{"id": "m", "providers": {"q": "served"}}],
        "nodes": [{"id": "n2", "providers": [{"id": "q", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                               "capacity": 1, "models": ["served"]}]}],
    })
    assert (await read_catalog(redis, other, now_ms())).unconfigured_providers == ["p"]
    assert (await read_catalog(redis, cfg, now_ms())).unconfigured_providers == []
    assert (await read_catalog(redis, other, int(until) + 1)).unconfigured_providers == []  # (its beat lapsed)


async def test_a_beat_judged_from_evidence_that_changed_since_does_not_undo_it(redis: Redis) -> None:
    """Between a beat's read and its write, a run's end took the provider down (`finish` wrote the
    strikes and `unavailable`): the beat's `available`, judged from what it read before, is not
    written over it (the rest of the beat is), and the worker is told to judge again."""
    hb = keys.heartbeat("p")
    await redis.hset(hb, mapping={"health": "unavailable", "reason": "provider p: connection refused", "fails": "3",
                                  "fail_ms": "5", "ok_ms": "1"})
    scripts = Scripts(redis)

    def beat(ok_ms: str, fails: str, fail_ms: str) -> Any:
        return scripts.call("beat", [hb, keys.node_workers("n"), keys.BEATING],
                            [ok_ms, fails, fail_ms, 1000, now_ms(), "p", "", "", "health", "available", "reason", "",
                             "capacity", "2"])

    assert await beat("1", "0", "") == 0  # (read before the strikes)
    assert await redis.hmget(hb, "health", "reason", "capacity") == [
        b"unavailable", b"provider p: connection refused", b"2"]
    assert await redis.zscore(keys.BEATING, "p") is not None
    assert await beat("1", "3", "5") == 1  # (read after them: its verdict stands)
    assert await redis.hmget(hb, "health", "reason") == [b"available", b""]

    # the worker's own beat: a verdict that could not be written makes it beat again at once
    cfg = config("vllm")
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    real = beats.scripts.call

    async def strikes_meanwhile(name: str, script_keys: Any, args: Any) -> Any:
        if name == "beat":
            await redis.hset(hb, mapping={"fails": "3", "fail_ms": str(now_ms()), "health": "unavailable"})
        return await real(name, script_keys, args)

    beats.scripts.call = strikes_meanwhile  # type: ignore[method-assign,assignment]
    await redis.hset(hb, mapping={"fails": "0", "ok_ms": str(now_ms())})
    await beats.beat_once(cfg.nodes[0].providers[0])
    assert beats.wake["p"].is_set() and await health(redis) == "unavailable"


async def test_two_workers_of_one_pid_on_one_host_are_told_apart(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Containers on the host's network, each worker its PID 1: the hash names each by its instance."""
    cfg = config("vllm")
    provider = cfg.nodes[0].providers[0]
    other = parse_config({**cfg.model_dump(exclude_none=True), "nodes": [{**cfg.nodes[0].model_dump(), "providers": [
        {**provider.model_dump(exclude_none=True), "capacity": 3}]}]})
    first = Heartbeats(redis, cfg, "n", {"p": Probed()}, "host:1:aaaa")
    second = Heartbeats(redis, other, "n", {"p": Probed()}, "host:1:bbbb")
    await first.beat_once(provider)
    assert await redis.hget(keys.heartbeat("p"), "worker") == b"host:1:aaaa"
    await second.beat_once(other.nodes[0].providers[0])
    assert any("worker host:1:aaaa of node n announces capacity 2 (this one's: 3)" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")


async def test_a_vllm_probe_has_time_for_its_three_requests(redis: Redis) -> None:
    """vLLM's probe asks `/health`, `/is_sleeping` and the model list: a server that answers each of
    the two that count within `probe_timeout_ms` and lets its sleep state go unanswered (judged as if
    it had none) passed. Its whole probe was given the time of two requests: it timed out, a strike
    on an idle provider (three took it down), though no request did."""
    import aiohttp
    from aiohttp import web

    from tests.fakes.serving import stop_runner
    from workers.adapters.openai_compat import OpenAICompatAdapter

    async def slow_health(request: web.Request) -> web.Response:
        await asyncio.sleep(1.3)
        return web.Response()

    async def asleep_unanswered(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("not answered")

    async def slow_models(request: web.Request) -> web.Response:
        await asyncio.sleep(1.3)
        return web.json_response({"object": "list", "data": [{"id": "served"}]})

    app = web.Application()
    app.router.add_get("/health", slow_health)
    app.router.add_get("/is_sleeping", asleep_unanswered)
    app.router.add_get("/v1/models", slow_models)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cfg = parse_config({
        "models": [{"id": "m", "providers": {"p": "served"}}],
        "nodes": [{"id": "n", "providers": [{"id": "p", "type": "vllm", "base_url": url, "capacity": 2,
                                              "models": ["served"], "probe_timeout_ms": 1500}]}],
    })
    provider = cfg.nodes[0].providers[0]
    try:
        async with aiohttp.ClientSession() as session:
            beats = Heartbeats(redis, cfg, "n", {"p": OpenAICompatAdapter(provider, session)})
            await beats.beat_once(provider)
            await beats._probe(provider, False)
            said = await redis.hgetall(keys.heartbeat("p"))
            assert said[b"health"] == b"available", {k: v for k, v in said.items() if b"reason" in k or k == b"fails"}
    finally:
        await stop_runner(runner)


@pytest.mark.parametrize(("key", "write"), [
    (keys.heartbeat("p"), ("set", "x")),
    (keys.leases("p"), ("set", "x")),
    (keys.node_workers("n"), ("hset", "x", "y")),
    (keys.BEATING, ("set", "x")),
])
async def test_a_key_of_the_beat_of_another_type_written_by_hand_is_replaced_and_said(
        redis: Redis, caplog: pytest.LogCaptureFixture, key: str, write: tuple[str, ...]) -> None:
    """`redis-cli SET iop:provider:p x` (or the provider's leases, its node's workers, the set of
    those beating): every beat failed with WRONGTYPE, for good, and every run of its models with it
    (a 503), until someone deleted the key. The beat deletes it, says so, and beats."""
    cfg = config("vllm")
    await redis.execute_command(write[0].upper(), key, *write[1:])
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()}, "host:1:abc")
    await beats.beat_once(cfg.nodes[0].providers[0])
    assert await redis.hget(keys.heartbeat("p"), "health") is not None
    assert await redis.type(key) in (b"hash", b"zset", b"none")
    assert await redis.zscore(keys.BEATING, "p") is not None
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and key in said[0] and "deleted" in said[0], said


async def test_a_beat_redis_did_not_take_is_made_again_as_soon_as_redis_answers(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an outage longer than `heartbeat_ttl_ms` (a Redis restart, a Sentinel failover) every
    provider is `unknown` until its next beat, and each caller meanwhile hears 503
    no_available_provider: 1,320 callers of 1,625 in the 2 s after a restart, with 2 s beats. A beat
    Redis refused now starts the worker's wait for Redis (`redis_lost`), which beats every provider
    once a PING is answered: here at once, not a minute later."""
    cfg = parse_config({**config("vllm").model_dump(mode="json", exclude_defaults=True),
                        "runtime": {"heartbeat_interval_ms": 60_000, "heartbeat_ttl_ms": 120_000}})
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    beat, refusals = beats._beat, 1

    async def refused_at_first(provider: Any) -> Health:
        nonlocal refusals
        if refusals:
            refusals -= 1
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return await beat(provider)

    monkeypatch.setattr(beats, "_beat", refused_at_first)
    task = asyncio.create_task(beats.run())
    try:
        await async_wait_until(lambda: redis.exists(keys.heartbeat("p")), what="the beat Redis took")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert refusals == 0


async def test_a_worker_whose_redis_went_away_between_beats_beats_once_it_answers(redis: Redis) -> None:
    """A Redis restarted without its data (or a failover that lost the newest writes) between two
    beats: nothing failed in the heartbeat loop, and the provider stayed unknown until its next beat,
    up to an interval later (a minute here). The cancel listener, whose subscription broke, says
    Redis went away (`redis_lost`), and every provider beats once it answers."""
    cfg = parse_config({**config("vllm").model_dump(mode="json", exclude_defaults=True),
                        "runtime": {"heartbeat_interval_ms": 60_000, "heartbeat_ttl_ms": 120_000}})
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    task = asyncio.create_task(beats.run())
    try:
        await async_wait_until(lambda: redis.exists(keys.heartbeat("p")), what="the first beat")
        await redis.delete(keys.heartbeat("p"))  # (lost with Redis's data)
        beats.redis_lost()
        await async_wait_until(lambda: redis.exists(keys.heartbeat("p")), what="a beat once Redis answers")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_redis_that_answers_pings_but_refuses_the_beats_does_not_wake_them_again_and_again(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers PING but refuses every beat (a read-only replica: a URL that names one,
    a primary demoted by hand) made each refused beat start a new watch for Redis, whose PING
    answered at once and woke every beat again: every provider beat, was refused and said so about
    three times a second (each beat's refusal is redis-py's retries, ~0.3 s), not once an interval
    (a reviewer, with a real worker on a Redis turned replica by REPLICAOF). The beats woken by an
    answer that are refused again wait for their interval, as before."""
    cfg = parse_config({**config("vllm").model_dump(mode="json", exclude_defaults=True),
                        "runtime": {"heartbeat_interval_ms": 60_000, "heartbeat_ttl_ms": 120_000}})
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    refused, watches = 0, 0
    watch = beats.comeback.watch

    async def read_only(provider: Any) -> Health:
        nonlocal refused
        refused += 1
        raise NotPrimaryError("the server is not the primary (READONLY You can't write against a read only replica.)")

    def counted() -> asyncio.Event:
        nonlocal watches
        watches += 1
        return watch()

    monkeypatch.setattr(beats, "_beat", read_only)
    monkeypatch.setattr(beats.comeback, "watch", counted)
    task = asyncio.create_task(beats.run())
    try:  # the first beat refused, Redis's answer, the beat it woke refused again
        await async_wait_until(lambda: asyncio.sleep(0, refused >= 2), what="the woken beat")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert watches == 1, f"{watches} watches for Redis started; {refused} beats refused"


async def test_answers_at_once_to_other_loops_watches_wake_the_beats_once_an_interval(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's writes through an outage pause on the worker's watch too, and each retried write of
    each running run starts one: on a server that answers PING but refuses the writes (a read-only
    replica), each answer woke every beat to be refused and logged again. An answer at once now
    wakes them once an interval at most; one after Redis was away always does."""
    cfg = parse_config({**config("vllm").model_dump(mode="json", exclude_defaults=True),
                        "runtime": {"heartbeat_interval_ms": 60_000, "heartbeat_ttl_ms": 120_000}})
    beats = Heartbeats(redis, cfg, "n", {"p": Probed()})
    refused = 0

    async def read_only(provider: Any) -> Health:
        nonlocal refused
        refused += 1
        raise NotPrimaryError("the server is not the primary (READONLY You can't write against a read only replica.)")

    monkeypatch.setattr(beats, "_beat", read_only)
    task = asyncio.create_task(beats.run())
    try:
        await async_wait_until(lambda: asyncio.sleep(0, refused >= 2), what="the first beat and the one its watch woke")
        for _ in range(5):  # (five retried writes of running runs, each watching; each PING answered at once)
            answered = beats.comeback.watch()
            await async_wait_until(lambda: asyncio.sleep(0, beats.comeback._task is not None
                                                         and beats.comeback._task.done()), what="the PING answered")
            assert not answered.is_set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert refused == 2
        beats._beat_all(True)  # (Redis was away: every beat, however recent the last answer)
        await async_wait_until(lambda: asyncio.sleep(0, refused == 3), what="the beat after an outage")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_a_served_name_the_provider_does_not_list_is_warned_of_once_and_its_return_said(
        redis: Redis, beating: tuple[Heartbeats, Probed], caplog: pytest.LogCaptureFixture) -> None:
    """Found by a newcomer's audit: a served name the server does not list (a typo in the config)
    validates, and the worker logged only `provider p is available`, while every run of the model
    it alone serves was refused with a 503."""
    beats, adapter = beating
    with caplog.at_level(logging.INFO, logger="iop.worker"):
        adapter.result = ProbeResult(Health.AVAILABLE, "", ["other"], strikes=0)
        await more_probes(adapter, 3)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == ["provider p does not list 'served', which its config gives it: no run of that model goes "
                          "there (check the served name in the config, or the server's models)"], warned
        adapter.result = ProbeResult(Health.AVAILABLE, "", ["served", "other"], strikes=0)

        async def said_back() -> bool:
            return any(r.getMessage() == "provider p lists every served name its config gives it"
                       for r in caplog.records)

        await async_wait_until(said_back, what="the served name listed again")


@pytest.mark.parametrize("beating", ["vllm"], indirect=True)
async def test_a_served_name_the_provider_lists_in_another_case_is_named_in_the_warning(
        redis: Redis, beating: tuple[Heartbeats, Probed], caplog: pytest.LogCaptureFixture) -> None:
    """Found by a newcomer: `Org/Alpha-7b` in the config, `Org/Alpha-7B` in the server's list; the
    warning said the name was not listed, and the operator had to find the difference by eye."""
    beats, adapter = beating
    with caplog.at_level(logging.INFO, logger="iop.worker"):
        adapter.result = ProbeResult(Health.AVAILABLE, "", ["other", "SERVED"], strikes=0)
        # (two: the warning comes once the first probe's result is recorded, after the probe's call; a
        # worker's next probe of a provider begins only after its last one ended, warning included)
        await more_probes(adapter, 2)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == ["provider p does not list 'served' (it lists 'SERVED'), which its config gives it: no run "
                          "of that model goes there (check the served name in the config, or the server's models)"
                          ], warned


def test_a_provider_s_health_line_says_its_id_once() -> None:
    """A run's failure as the reason said the id twice: 'provider p is unavailable: provider p:
    connection refused'."""
    assert health_said("p", Health.UNAVAILABLE, "provider p: connection refused") == \
        "provider p is unavailable: connection refused"
    assert health_said("p", Health.UNAVAILABLE, "provider p answered 500") == \
        "provider p is unavailable: provider p answered 500"  # (a sentence of its own, kept whole)
    assert health_said("p", Health.AVAILABLE, "") == "provider p is available"
