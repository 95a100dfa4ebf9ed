"""Operator control against a real Redis: the `control` script, its audit entries, and the
`dispatch` script honouring drains, cordons and capacity overrides even when the scheduler's
snapshot predates them (no workers, no HTTP)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.catalog import change_report, read_catalog
from common.config import parse_config
from common.control import (
    Action,
    Change,
    ControlError,
    ProviderControl,
    UnknownTarget,
    apply,
    check_capacity,
    cli_user,
    format_duration,
    parse_duration,
    read_audit,
    read_control,
)
from common.policy import select_provider
from common.redisconn import now_ms
from common.snapshots import read_snapshots
from gateway.errors import ApiError
from gateway.runs import RunClient
from scheduler.core import Scheduler
from tests.conftest import async_wait_until
from tests.test_scheduler import MODEL, beat, leases, make_config, submit, waiting_runs

# --- pure parts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "ms"), [
    ("1s", 1_000), ("90s", 90_000), ("30m", 1_800_000), ("2h", 7_200_000), ("1h30m", 5_400_000),
    ("7d", 604_800_000), ("1d2h3m4s", 93_784_000), ("015m", 900_000),
])
def test_durations(text: str, ms: int) -> None:
    assert parse_duration(text) == ms
    assert parse_duration(format_duration(ms)) == ms


@pytest.mark.parametrize(("text", "says"), [
    ("", "is not a duration"), ("30", "is not a duration"), ("m", "is not a duration"), ("1m1h", "is not a duration"),
    ("-5m", "is not a duration"), ("1.5h", "is not a duration"), ("0s", "shorter than 1s"),
    ("8d", "longer than 7d"), ("7d1s", "longer than 7d"), ("169h", "longer than 7d"),
    # ASCII digits only, nothing around the duration
    ("\u0661h", "is not a duration"), ("1\u0660m", "is not a duration"), (" 15m ", "is not a duration"),
    (" 1h", "is not a duration"), ("1h\n", "is not a duration"), ("1h ", "is not a duration"),
    ("9" * 5000 + "s", "longer than 7d"),  # more digits than int() converts
])
def test_bad_durations_are_refused_with_a_reason(text: str, says: str) -> None:
    with pytest.raises(ControlError, match=says) as err:
        parse_duration(text)
    assert err.value.param == "for"


@pytest.mark.parametrize(("value", "ok"), [
    (1, True), (4, True), (10**6, True), ("3", True), (0, False), (-1, False),
    (2.5, False), ("two", False), (True, False), (None, False),
])
def test_capacity_bounds(value: object, ok: bool) -> None:
    if ok:
        assert check_capacity(value) == int(value)  # type: ignore[call-overload]
    else:
        with pytest.raises(ControlError):
            check_capacity(value)


@pytest.mark.parametrize(("value", "says"), [
    ("\u00b2", "N: '\u00b2' is not a whole number"),  # str.isdigit() says yes, int() refuses it
    ("\u0661", "N: '\u0661' is not a whole number"),  # int() reads this Arabic-Indic digit as 1
    (" 3", "N: ' 3' is not a whole number"),
    ("-1", "N: -1 is less than 1 (to take no runs, drain it)"),  # (as the HTTP route says it of -1)
    ("-0", "N: 0 is less than 1"), ("- 1", "N: '- 1' is not a whole number"),
    ("9" * 5000, "is too large for a capacity"),  # more digits than int() converts
    (True, "N: true is not a whole number"), (None, "N: null is not a whole number"),
    ({"n": False}, 'N: {"n": false} is not a whole number'),
    (float("inf"), "N: a number too large for a 64-bit float is not a whole number"),
])
def test_capacities_are_ascii_digits_and_messages_show_json_values(value: object, says: str) -> None:
    with pytest.raises(ControlError) as err:
        check_capacity(value, "N")
    assert says in str(err.value) and err.value.param == "N"


async def test_an_audit_page_before_takes_only_ids_redis_takes(redis: Redis) -> None:
    config = make_config({"a": 4})
    await apply(redis, config, Change(Action.DRAIN, "a", "ops"))
    assert await read_audit(redis, 10, before="0-0") == []  # before the first id there can be
    assert await read_audit(redis, 10, before="0") == []
    assert len(await read_audit(redis, 10, before="18446744073709551615-18446744073709551615")) == 1
    # `<ms>` alone: the entries before that ms, none of its own (found by an operator's audit:
    # Redis ends an exclusive `(<ms>` at that ms's last entry, so a page repeated the entries of its ms)
    ms = (await read_audit(redis, 1))[0].id.split("-")[0]
    await apply(redis, config, Change(Action.UNDRAIN, "a", "ops"))
    await redis.xadd(keys.AUDIT_STREAM, {"at_ms": ms}, id=f"{int(ms) + 10**9}-0")  # (a later one)
    await redis.xadd(keys.AUDIT_STREAM, {"at_ms": ms}, id=f"{int(ms) + 10**9}-1")
    later = str(int(ms) + 10**9)
    assert [e.id for e in await read_audit(redis, 10, before=later)][-1] == f"{ms}-0"
    assert f"{later}-0" not in [e.id for e in await read_audit(redis, 10, before=later)]
    assert [e.id for e in await read_audit(redis, 10, before=f"{later}-1")][0] == f"{later}-0"
    for bad in ("1-", "\u00b2", "\u0661-0", "1-\u0661", "+1", " 1", "", "18446744073709551616", "9" * 5000):
        with pytest.raises(ControlError, match="is not an audit entry id") as err:
            await read_audit(redis, 10, before=bad)
        assert err.value.param == "before"


def test_the_cli_acts_as_its_os_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGNAME", "alice")
    assert cli_user() == "cli:alice"


# --- the control script and the audit trail -----------------------------------------------------


async def test_each_change_is_recorded_with_who_what_and_the_previous_value(redis: Redis) -> None:
    config = make_config({"a": 4, "b": 2})
    first = await apply(redis, config, Change(Action.DRAIN, "a", "ops"))
    assert (first.action, first.target_kind, first.target, first.who) == ("drain", "provider", "a", "ops")
    assert (first.value, first.previous) == ("drained", "active")
    since = int(await redis.get(keys.drained("a")))
    again = await apply(redis, config, Change(Action.DRAIN, "a", "cli:bob"))
    assert (again.value, again.previous) == ("drained", "drained")
    assert int(await redis.get(keys.drained("a"))) == since  # a second drain keeps when it began
    await apply(redis, config, Change(Action.UNDRAIN, "a", "ops"))
    assert not await redis.exists(keys.drained("a"))

    cap = await apply(redis, config, Change(Action.CAPACITY, "b", "ops", capacity=1, for_ms=60_000))
    assert (cap.value, cap.previous, cap.previous_until_ms) == ("1", "none", None)
    assert cap.until_ms is not None and cap.until_ms - cap.at_ms == 60_000
    assert 0 < await redis.pttl(keys.capacity_override("b")) <= 60_000
    forever = await apply(redis, config, Change(Action.CAPACITY, "b", "ops", capacity=2))
    assert (forever.value, forever.until_ms, forever.previous, forever.previous_until_ms) == (
        "2", None, "1", cap.until_ms)
    assert await redis.pttl(keys.capacity_override("b")) == -1  # no expiry any more
    cleared = await apply(redis, config, Change(Action.CAPACITY_CLEAR, "b", "ops"))
    assert (cleared.value, cleared.previous) == ("none", "2")
    cordon = await apply(redis, config, Change(Action.CORDON, "n-b", "ops"))
    assert (cordon.target_kind, cordon.value, cordon.previous) == ("node", "cordoned", "active")

    trail = await read_audit(redis, 100)
    assert [(e.action, e.target, e.who) for e in trail] == [
        ("cordon", "n-b", "ops"), ("capacity_clear", "b", "ops"), ("capacity", "b", "ops"), ("capacity", "b", "ops"),
        ("undrain", "a", "ops"), ("drain", "a", "cli:bob"), ("drain", "a", "ops")]
    assert [e.id for e in await read_audit(redis, 2, before=trail[1].id)] == [trail[2].id, trail[3].id]
    assert all(a.at_ms >= b.at_ms for a, b in zip(trail, trail[1:], strict=False))


async def test_unknown_targets_and_bad_values_write_nothing(redis: Redis) -> None:
    config = make_config({"a": 4})
    for change in (Change(Action.DRAIN, "nope", "ops"), Change(Action.CORDON, "a", "ops"),  # a is no node
                   Change(Action.CAPACITY, "nope", "ops", capacity=1)):
        with pytest.raises(UnknownTarget):
            await apply(redis, config, change)
    for change in (Change(Action.CAPACITY, "a", "ops"), Change(Action.CAPACITY, "a", "ops", capacity=0),
                   Change(Action.CAPACITY, "a", "ops", capacity=2, for_ms=8 * 86_400_000),
                   Change(Action.CAPACITY, "a", "ops", capacity=5)):  # above the configured 4
        with pytest.raises(ControlError):
            await apply(redis, config, change)
    assert await redis.keys("iop:*") == []


async def test_a_setting_left_by_an_id_the_config_lacks_may_be_cleared(redis: Redis) -> None:
    """b was drained, given an override and its node cordoned, then taken out of the config: the
    keys stay (an id that came back would come back drained), and the clearing actions take them
    away (they were refused: no provider 'b' in the config). With nothing to clear, an unknown id
    is refused as before; a setting cannot be made on one."""
    before, after = make_config({"a": 4, "b": 4}), make_config({"a": 4})
    for change in (Change(Action.DRAIN, "b", "ops"), Change(Action.CAPACITY, "b", "ops", capacity=1),
                   Change(Action.CORDON, "n-b", "ops")):
        await apply(redis, before, change)
    for change in (Change(Action.UNDRAIN, "b", "ops"), Change(Action.CAPACITY_CLEAR, "b", "ops"),
                   Change(Action.UNCORDON, "n-b", "ops")):
        entry = await apply(redis, after, change)
        assert entry.target == change.target and entry.previous != entry.value
        report = change_report(await read_catalog(redis, after, now_ms()), entry)  # (what it answers)
        assert report["providers"] == [] and report.get("node", None) is None
    assert not await redis.exists(keys.drained("b"), keys.capacity_override("b"), keys.cordoned("n-b"))
    for change in (Change(Action.UNDRAIN, "b", "ops"), Change(Action.DRAIN, "b", "ops"),
                   Change(Action.UNCORDON, "nope", "ops")):
        with pytest.raises(UnknownTarget):
            await apply(redis, after, change)


async def test_the_audit_stream_is_capped(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "AUDIT_MAX_ENTRIES", 150)
    config = make_config({"a": 4})
    for i in range(400):
        await apply(redis, config, Change(Action.DRAIN if i % 2 else Action.UNDRAIN, "a", "ops"))
    # XADD MAXLEN ~ trims in whole blocks of entries (100 by default): a little over the cap, never far
    assert 150 <= await redis.xlen(keys.AUDIT_STREAM) < 150 + 100


async def test_a_change_wakes_the_schedulers(redis: Redis) -> None:
    config = make_config({"a": 4})
    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.SCHEDULER_SIGNALS)
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    await apply(redis, config, Change(Action.UNDRAIN, "a", "ops"))
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
    await pubsub.aclose()
    assert message is not None and message["data"] == b"*"


async def test_an_override_given_a_time_expires_by_itself(redis: Redis) -> None:
    config = make_config({"a": 4})
    await beat(redis, config)
    await apply(redis, config, Change(Action.CAPACITY, "a", "ops", capacity=1, for_ms=1_000))
    assert (await read_snapshots(redis, {"a": "a-name"}, now_ms(), config.node_of))[0].effective_capacity == 1
    controls, _ = await read_control(redis, config)
    assert controls["a"].capacity_override == 1 and controls["a"].capacity_override_until_ms is not None

    async def expired() -> bool:
        controls, _ = await read_control(redis, config)
        return controls["a"].capacity_override is None
    await async_wait_until(expired, timeout=10, what="the override to expire")
    assert (await read_snapshots(redis, {"a": "a-name"}, now_ms(), config.node_of))[0].effective_capacity == 4


@pytest.mark.parametrize("value", ["yes", "", "2026-12-06T17:00:00Z"])
async def test_a_drain_or_cordon_written_by_hand_reads_as_one_whatever_its_value(redis: Redis, value: str) -> None:
    """Found by an operator helper: `redis-cli SET iop:drain:a yes` (the gateway down, the README's
    key table at hand) drained it for the schedulers and the dispatch script, which ask whether the
    key exists, while the catalog, which read its value as a time, showed it `active`; `iop provider
    undrain` then said `was drained`."""
    config = make_config({"a": 4, "b": 4})
    await beat(redis, config)
    await redis.set(keys.drained("a"), value)
    await redis.set(keys.cordoned("n-b"), value)
    snaps = {s.provider_id: s for s in await read_snapshots(redis, {"a": "a-name", "b": "b-name"}, now_ms(),
                                                             config.node_of)}
    assert snaps["a"].drained and snaps["b"].drained  # as the schedulers see them
    controls, cordons = await read_control(redis, config)
    assert controls["a"].blocked and controls["a"].drained_since_ms == 0 and controls["a"].state(0) == "drained"
    assert controls["b"].blocked and controls["b"].cordoned_since_ms == 0 and cordons["n-b"] == 0
    catalog = await read_catalog(redis, config, now_ms())
    assert {p.id: p.control.state for p in catalog.providers} == {"a": "drained", "b": "drained"}


async def test_a_control_key_of_another_type_written_by_hand_is_none_and_the_next_change_replaces_it(
        redis: Redis) -> None:
    """`redis-cli HSET iop:drain:a by me` (a hash, not the string iop writes), the same for a's capacity
    and b's node's cordon: every reader takes such a key as none, as the dispatch scripts' MGET does.
    The scheduler's snapshot read (GET) failed with WRONGTYPE in every round, so no run of the model
    was dispatched again nor timed out, and the catalog failed too; `iop provider drain a` (the control
    script's GET) refused to replace the key."""
    config = make_config({"a": 4, "b": 4})
    _client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.drained("a"), "by", "me")
    await redis.rpush(keys.capacity_override("a"), "1")
    await redis.sadd(keys.cordoned("n-b"), "x")
    snaps = {s.provider_id: s for s in await read_snapshots(redis, {"a": "a-name", "b": "b-name"}, now_ms(),
                                                             config.node_of)}
    assert not snaps["a"].drained and snaps["a"].capacity_override is None and not snaps["b"].drained
    controls, cordons = await read_control(redis, config)
    assert controls["a"] == controls["b"] == ProviderControl() and cordons["n-b"] is None
    catalog = await read_catalog(redis, config, now_ms())
    assert {p.id: p.control.state for p in catalog.providers} == {"a": "active", "b": "active"}
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "state") == b"dispatched"
    entry = await apply(redis, config, Change(Action.DRAIN, "a", "ops"))
    assert entry.previous == "active" and await redis.type(keys.drained("a")) == b"string"
    await apply(redis, config, Change(Action.CAPACITY, "a", "ops", capacity=2))
    assert (await read_control(redis, config))[0]["a"].capacity_override == 2


@pytest.mark.parametrize("action", [Action.CAPACITY, Action.CAPACITY_CLEAR])
async def test_an_override_written_by_hand_that_is_no_integer_is_recorded_as_none_before(
        redis: Redis, action: Action) -> None:
    """`redis-cli SET iop:capacity:a 1.5 PX 60000`: every reader takes it as no override (the scheduler,
    the dispatch scripts, the catalog), but the audit entry of the next change said it was '1.5', until
    a time."""
    config = make_config({"a": 4})
    await redis.set(keys.capacity_override("a"), "1.5", px=60_000)
    entry = await apply(redis, config, Change(action, "a", "ops", capacity=2 if action is Action.CAPACITY else None))
    assert (entry.previous, entry.previous_until_ms) == ("none", None)


@pytest.mark.parametrize("change", [Change(Action.DRAIN, "a", "ops"), Change(Action.CAPACITY, "a", "ops", capacity=1),
                                    Change(Action.CORDON, "n-a", "ops")])
async def test_a_change_whose_audit_entry_redis_refuses_is_not_made(redis: Redis, change: Change) -> None:
    """`redis-cli SET iop:audit x` (a string, where iop keeps a stream): the change's audit entry is
    refused, and the change is not made either. The flag or the override was set before the entry
    (a script's writes before an error stay): the operator got an error for a drain that took
    effect, with no entry and no scheduler woken."""
    config = make_config({"a": 4})
    await redis.set(keys.AUDIT_STREAM, "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await apply(redis, config, change)
    assert await redis.exists(change.key()) == 0
    assert (await read_control(redis, config))[0]["a"] == ProviderControl()


# --- the dispatch script honours it, whatever the scheduler read -----------------------------------


async def test_a_drain_written_after_the_snapshot_is_refused_by_the_dispatch_script(redis: Redis) -> None:
    config = make_config({"a": 4, "b": 4})
    _client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    model = config.model(MODEL)
    assert model is not None
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
    assert not any(s.drained for s in snaps)
    await apply(redis, config, Change(Action.DRAIN, "a", "ops"))  # after the snapshot, before the dispatch
    head = sched.waiting[MODEL][0]
    seen = select_provider(snaps, now_ms(), config.runtime.heartbeat_ttl_ms)
    assert seen is not None and seen.provider_id == "a"  # as the scheduler read it
    assert (await sched._dispatch(model, [head], snaps))[0][:2] == ("ok", "b")  # the script saw the drain: b takes it
    assert await leases(redis, config) == {"a": 0, "b": 1}
    assert await redis.hget(keys.run_record(run_id), "provider") == b"b"


@pytest.mark.parametrize("flagged", ["b", "c"])
@pytest.mark.parametrize(("flag", "expected"), [("drained", ("ok", "a")), ("cordoned", ("ok", "a")),
                                                ("override", ("ok", "a")), ("probing", ("probing", None))])
async def test_the_dispatch_script_reads_each_candidates_own_flags(redis: Redis, flagged: str, flag: str,
                                                                   expected: tuple[str, str | None]) -> None:
    """The script reads the operator's flags of every candidate in one `MGET`: a flag on the
    second or the third candidate (the least loaded, which would take the run) is that one's, not
    a neighbour's."""
    config = make_config({"a": 4, "b": 4, "c": 4})
    _client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    model = config.model(MODEL)
    assert model is not None
    for busy in {"a", "b", "c"} - {flagged}:
        await redis.zadd(keys.leases(busy), {f"r-{busy}": now_ms() + 60_000})
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
    await redis.set({"drained": keys.drained(flagged), "cordoned": keys.cordoned(f"n-{flagged}"),
                     "override": keys.capacity_override(flagged), "probing": keys.probing(flagged)}[flag],
                    "0" if flag == "override" else "1")
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], snaps))[0][:2] == expected
    held = {p: 0 if p == flagged else 1 for p in ("a", "b", "c")}
    if expected[1] is not None:
        held[expected[1]] += 1
    assert await leases(redis, config) == held


async def test_a_cordon_written_after_the_snapshot_is_refused_by_the_dispatch_script(redis: Redis) -> None:
    config = make_config({"a": 4})
    _client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    model = config.model(MODEL)
    assert model is not None
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
    await apply(redis, config, Change(Action.CORDON, "n-a", "ops"))
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], snaps))[0][:2] == ("stale", None)
    await sched.dispatch_all()  # a is the only provider: the run waits, it does not fail
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    assert await leases(redis, config) == {"a": 0}
    await apply(redis, config, Change(Action.UNCORDON, "n-a", "ops"))
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "provider") == b"a"


async def test_an_override_below_the_live_leases_is_refused_even_with_a_snapshot_that_predates_it(
        redis: Redis) -> None:
    config = make_config({"a": 4})
    _client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    model = config.model(MODEL)
    assert model is not None
    await redis.zadd(keys.leases("a"), {"r1": now_ms() + 60_000, "r2": now_ms() + 60_000})
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
    assert snaps[0].effective_capacity == 4 and snaps[0].in_flight == 2
    await apply(redis, config, Change(Action.CAPACITY, "a", "ops", capacity=2))
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], snaps))[0][:2] == ("stale", None)
    await sched.dispatch_all()
    assert await leases(redis, config) == {"a": 2}  # held back, never over-filled
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"
    await redis.zrem(keys.leases("a"), "r1")  # one run ends: in_flight 1 < 2
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "provider") == b"a"


async def test_an_override_above_the_announced_capacity_counts_the_announced_one(redis: Redis) -> None:
    """Set while the config said 4, then the config (and the heartbeat) said 2: the scheduler, the
    dispatch script and `enqueue`'s free slots count 2 (an operator audit found runs dispatched
    to 4 leases while the node's workers ran 2, the others waiting for a worker)."""
    config = make_config({"a": 2, "b": 2})
    await redis.set(keys.capacity_override("a"), 4)  # (what `apply` would refuse now)
    _client, sched, run_ids = await waiting_runs(redis, config, 5)
    model = config.model(MODEL)
    assert model is not None
    snaps = await read_snapshots(redis, sched._targets[MODEL], now_ms(), config.node_of)
    assert [s.effective_capacity for s in snaps] == [2, 2]
    await sched.dispatch_all()
    assert await leases(redis, config) == {"a": 2, "b": 2}
    stale = [s if s.provider_id != "a" else replace(s, in_flight=0) for s in snaps]  # (a snapshot from before)
    assert (await sched._dispatch(model, [sched.waiting[MODEL][0]], stale))[0][:2] == ("stale", None)
    assert await leases(redis, config) == {"a": 2, "b": 2}  # the script counted 2 too
    client = RunClient(redis, parse_config({**config.model_dump(mode="json", exclude_none=True),
                                            "queue": {"max_queue": 1}}))
    with pytest.raises(ApiError) as err:  # 1 waits already, no slot is free: `enqueue` takes no second
        await submit(client, 1)
    assert err.value.code.value == "queue_full"
    assert err.value.message == f"the queue of model {MODEL!r} is full (1 runs waiting); retry later"
    client = RunClient(redis, parse_config({**config.model_dump(mode="json", exclude_none=True),
                                            "queue": {"max_queue": 0}}))
    with pytest.raises(ApiError) as err:  # (no queue: it said "full (0 runs waiting)", a new operator)
        await submit(client, 1)
    assert err.value.message == f"model {MODEL!r} has no free slot and no queue (max_queue 0); retry later"


async def test_three_replicas_never_exceed_an_override_nor_touch_a_drained_provider(redis: Redis) -> None:
    config = make_config({"a": 2, "b": 6, "c": 3})
    await beat(redis, config)
    await submit(RunClient(redis, config), 90)
    replicas = [Scheduler(redis, config, consumer=f"s{i}") for i in range(3)]
    await replicas[0].ensure_groups()
    for _ in range(9):
        for s in replicas:
            await s.read_new(block_ms=1, count=10)
    assert [len(s.waiting[MODEL]) for s in replicas] == [30, 30, 30]
    await apply(redis, config, Change(Action.CAPACITY, "b", "ops", capacity=1))
    await apply(redis, config, Change(Action.DRAIN, "c", "ops"))
    for _ in range(3):  # the replicas race each other for the slots, three times over
        await asyncio.gather(*(s.dispatch_all() for s in replicas for _ in range(4)))
        assert await leases(redis, config) == {"a": 2, "b": 1, "c": 0}
        for pid in ("a", "b"):  # one run ends on each
            (run,) = await redis.zrange(keys.leases(pid), 0, 0)
            await redis.zrem(keys.leases(pid), run)
    assert await redis.xlen(keys.runs_stream(MODEL)) == 90 - 3 - 2 - 2  # 3 at first, then 2 per round


async def test_an_override_above_an_old_config_s_capacity_says_the_workers_announce_more(redis: Redis) -> None:
    """A rollout raised a's capacity to 4 (its workers announce 4); the operator's `iop` command
    still read the old config (2). Refused as before, but "raise it in the config" sent them to a
    config that already said 4: the message now says what the workers announce."""
    await beat(redis, make_config({"a": 4}))
    old = make_config({"a": 2})
    with pytest.raises(ControlError) as err:
        await apply(redis, old, Change(Action.CAPACITY, "a", "ops", capacity=3))
    assert err.value.param == "capacity"
    assert str(err.value) == ("capacity: 3 is above a's configured capacity 2 (an override can only lower it; "
                              "raise it in the config; its workers announce 4: is this config older than the "
                              "pool's?)")
    with pytest.raises(ControlError) as err:  # (above what they announce too: no such hint)
        await apply(redis, old, Change(Action.CAPACITY, "a", "ops", capacity=5))
    assert str(err.value).endswith("(an override can only lower it; raise it in the config)")
    with pytest.raises(ControlError) as err:  # (another fault of the capacity: as it was)
        await apply(redis, old, Change(Action.CAPACITY, "a", "ops", capacity=0))
    assert str(err.value) == "capacity: 0 is less than 1 (to take no runs, drain it)"
    assert await redis.xlen(keys.AUDIT_STREAM) == 0 and not await redis.exists(keys.capacity_override("a"))


@pytest.mark.parametrize(("change", "says"), [
    (Change(Action.DRAIN, "vllm-aa", "ops"), "no provider 'vllm-aa' in the config (did you mean 'vllm-a'?)"),
    (Change(Action.DRAIN, "VLLM-A", "ops"), "no provider 'VLLM-A' in the config (did you mean 'vllm-a'?)"),
    (Change(Action.CORDON, "n-vllm-b", "ops"), "no node 'n-vllm-b' in the config (did you mean 'n-vllm-a'?)"),
    (Change(Action.DRAIN, "zzz", "ops"), "no provider 'zzz' in the config"),  # (nothing near: as before)
    (Change(Action.DRAIN, "n-vllm-a", "ops"), "no provider 'n-vllm-a' in the config ('n-vllm-a' is a node)"),
])
async def test_a_typo_d_provider_or_node_is_refused_naming_the_one_meant(redis: Redis, change: Change,
                                                                        says: str) -> None:
    """An operator typed `iop provider drain vllm-aa`: "no provider 'vllm-aa' in the config" left
    them to read the config for the right id (a worker's unknown --node lists the nodes)."""
    with pytest.raises(UnknownTarget) as err:
        await apply(redis, make_config({"vllm-a": 2, "sglang-b": 2}), change)
    assert str(err.value) == says
    assert await redis.xlen(keys.AUDIT_STREAM) == 0
