"""Pure tests of the selection policy (common/policy.py, D02/S04)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from fractions import Fraction

import pytest

from common.policy import (
    Health,
    ProviderSnapshot,
    all_refused,
    is_available,
    is_fresh,
    retry_after_s,
    select_provider,
    why_not,
)

NOW = 1_000_000_000
TTL = 6_000


def snap(
    provider_id: str,
    in_flight: int,
    capacity: int | None,
    *,
    health: Health = Health.AVAILABLE,
    heartbeat_ms: int | None = NOW - 100,
    drained: bool = False,
    override: int | None = None,
) -> ProviderSnapshot:
    return ProviderSnapshot(provider_id=provider_id, health=health, capacity=capacity, in_flight=in_flight,
                            heartbeat_ms=heartbeat_ms, drained=drained, capacity_override=override)


def pick(*snaps: ProviderSnapshot) -> str | None:
    chosen = select_provider(list(snaps), NOW, TTL)
    return None if chosen is None else chosen.provider_id


EXCLUDED = [
    snap("unavailable", 0, 4, health=Health.UNAVAILABLE),
    snap("unknown", 0, 4, health=Health.UNKNOWN),
    snap("stale", 0, 4, heartbeat_ms=NOW - TTL - 1),
    snap("no-heartbeat", 0, 4, heartbeat_ms=None),
    snap("capacity-0", 0, 0),
    snap("capacity-none", 0, None),
    snap("full", 3, 3),
    snap("over-full", 4, 3),
    snap("drained", 0, 4, drained=True),
    snap("overridden-full", 1, 4, override=1),
    snap("overridden-below-in-flight", 4, 4, override=2),
]

# (id, snapshots, expected provider id or None)
CASES: list[tuple[str, list[ProviderSnapshot], str | None]] = [
    ("no-snapshots", [], None),
    *[(f"only-{s.provider_id}", [s], None) for s in EXCLUDED],
    ("all-excluded", EXCLUDED, None),
    ("excluded-lose-to-a-busy-eligible-one", [*EXCLUDED, snap("busy", 2, 3)], "busy"),
    ("heartbeat-exactly-ttl-old-is-fresh", [snap("edge", 0, 1, heartbeat_ms=NOW - TTL)], "edge"),
    ("heartbeat-in-the-future-is-fresh", [snap("ahead", 0, 1, heartbeat_ms=NOW + 500)], "ahead"),
    ("1/3-beats-2/3", [snap("b", 2, 3), snap("a", 1, 3)], "a"),
    ("1/3-beats-2/3-whatever-the-ids", [snap("a", 2, 3), snap("b", 1, 3)], "b"),
    ("1/4-beats-1/3", [snap("three", 1, 3), snap("four", 1, 4)], "four"),
    ("0/1-beats-2/10-despite-8-free-slots", [snap("big", 2, 10), snap("small", 0, 1)], "small"),
    ("1/3-beats-5/10-despite-5-free-slots", [snap("big", 5, 10), snap("small", 1, 3)], "small"),
    ("2/10-beats-1/3", [snap("small", 1, 3), snap("big", 2, 10)], "big"),
    ("exact-tie-1/3-vs-2/6-larger-capacity-wins", [snap("a", 1, 3), snap("b", 2, 6)], "b"),
    ("exact-tie-0/1-vs-0/4-larger-capacity-wins", [snap("a-small", 0, 1), snap("z-large", 0, 4)], "z-large"),
    ("same-ratio-same-capacity-lexical-id",
     [snap("vllm-b", 1, 2), snap("vllm-a", 1, 2), snap("vllm-c", 1, 2)], "vllm-a"),
    ("lexical-is-not-natural-order", [snap("p9", 0, 2), snap("p10", 0, 2)], "p10"),
    ("ratios-compared-exactly-not-as-floats",
     # as floats both ratios are 1.0, so the capacity tie-break would wrongly pick "y"
     [snap("x", 10**17, 10**17 + 1), snap("y", 10**17 + 1, 10**17 + 2)], "x"),
    ("full-provider-with-lower-ratio-elsewhere", [snap("full", 1, 1), snap("busy", 8, 10)], "busy"),
    ("unavailable-idle-loses-to-busy-available",
     [snap("idle", 0, 8, health=Health.UNAVAILABLE), snap("busy", 3, 4)], "busy"),
    # operator control (a drain or a cordon; a capacity override)
    ("drained-idle-loses-to-busy", [snap("idle", 0, 8, drained=True), snap("busy", 3, 4)], "busy"),
    ("drained-everywhere-none", [snap("a", 0, 8, drained=True), snap("b", 0, 2, drained=True)], None),
    ("override-raises-the-ratio-1/2-loses-to-1/3", [snap("a", 1, 4, override=2), snap("b", 1, 3)], "b"),
    ("override-raises-b's-ratio-1/4-loses-to-1/8", [snap("a", 1, 8), snap("b", 1, 8, override=4)], "a"),
    # (an override set before the config lowered the capacity: the announced one counts, found by an
    # operator audit: slots above it were leases waiting for a worker)
    ("override-above-the-announced-capacity-frees-no-slot", [snap("a", 4, 4, override=6)], None),
    ("override-above-the-announced-capacity-counts-the-announced", [snap("a", 0, 1, override=8), snap("b", 0, 4)],
     "b"),
    ("override-0/1-vs-0/4-larger-effective-wins", [snap("a", 0, 4, override=1), snap("b", 0, 2)], "b"),
    ("override-without-heartbeat-is-still-unknown", [snap("a", 0, None, heartbeat_ms=None, override=4)], None),
]


@pytest.mark.parametrize(("snaps", "expected"), [(s, e) for _, s, e in CASES], ids=[c[0] for c in CASES])
def test_select_provider(snaps: list[ProviderSnapshot], expected: str | None) -> None:
    assert pick(*snaps) == expected
    assert pick(*reversed(snaps)) == expected


def test_select_returns_the_snapshot_itself() -> None:
    a = snap("a", 1, 3)
    assert select_provider([snap("b", 2, 3), a], NOW, TTL) is a


def test_select_accepts_any_iterable() -> None:
    chosen = select_provider((s for s in [snap("b", 2, 3), snap("a", 1, 3)]), NOW, TTL)
    assert chosen is not None and chosen.provider_id == "a"


@pytest.mark.parametrize(("s", "available"), [
    (snap("ok", 0, 1), True),
    (snap("ok-but-full", 1, 1), True),  # available says nothing about free slots
    (snap("unavailable", 0, 1, health=Health.UNAVAILABLE), False),
    (snap("unknown", 0, 1, health=Health.UNKNOWN), False),
    (snap("stale", 0, 1, heartbeat_ms=NOW - TTL - 1), False),
    (snap("edge", 0, 1, heartbeat_ms=NOW - TTL), True),
    (snap("no-heartbeat", 0, 1, heartbeat_ms=None), False),
    (snap("capacity-0", 0, 0), False),
    (snap("capacity-none", 0, None), False),
    (snap("capacity-negative", 0, -1), False),
    (snap("drained", 0, 1, drained=True), True),  # drained is not a health: it never fails runs
    (snap("override-0", 0, 4, override=0), False),
    (snap("override-on-no-capacity", 0, None, override=2), True),
])
def test_is_available(s: ProviderSnapshot, available: bool) -> None:
    assert is_available(s, NOW, TTL) is available


def test_is_fresh() -> None:
    assert is_fresh(snap("a", 0, 1, heartbeat_ms=NOW), NOW, TTL)
    assert is_fresh(snap("a", 0, 1, heartbeat_ms=NOW - TTL), NOW, TTL)
    assert not is_fresh(snap("a", 0, 1, heartbeat_ms=NOW - TTL - 1), NOW, TTL)
    assert not is_fresh(snap("a", 0, 1, heartbeat_ms=None), NOW, TTL)


@pytest.mark.parametrize(("capacity", "in_flight", "ratio"), [
    (3, 1, Fraction(1, 3)), (6, 2, Fraction(1, 3)), (4, 0, Fraction(0)), (2, 2, Fraction(1)),
    (0, 0, None), (None, 0, None), (0, 3, None),
])
def test_load_ratio(capacity: int | None, in_flight: int, ratio: Fraction | None) -> None:
    assert snap("a", in_flight, capacity).load_ratio() == ratio


@pytest.mark.parametrize(("capacity", "override", "in_flight", "effective", "ratio"), [
    (4, None, 2, 4, Fraction(1, 2)), (4, 1, 2, 1, Fraction(2)), (4, 8, 2, 4, Fraction(1, 2)),
    (None, 2, 1, 2, Fraction(1, 2)), (None, None, 1, None, None),
])
def test_a_capacity_override_is_the_capacity_the_policy_counts_with(
        capacity: int | None, override: int | None, in_flight: int, effective: int | None,
        ratio: Fraction | None) -> None:
    s = snap("a", in_flight, capacity, override=override)
    assert s.effective_capacity == effective
    assert s.load_ratio() == ratio


def test_a_drained_provider_never_makes_runs_fail() -> None:
    """Only a refusal by health fails a model's runs; a drain keeps them waiting."""
    assert not all_refused([snap("a", 0, 4, drained=True)], NOW, TTL)
    assert not all_refused([snap("a", 0, 4, drained=True), snap("b", 0, 4, health=Health.UNAVAILABLE)], NOW, TTL)
    assert all_refused([snap("b", 0, 4, health=Health.UNAVAILABLE)], NOW, TTL)


def test_a_provider_benched_because_it_was_too_busy_keeps_runs_waiting() -> None:
    """Busy is not down: a provider benched for its Retry-After (it answered 429 or 503) is back
    when it ends, so the model's waiting runs wait for it; a hosted API's one 429 failed them all.
    A bench for failed runs (blame) refuses, as before."""
    busy = replace(snap("a", 0, 4), benched=True, bench_until_ms=NOW + 30_000, busy=True)
    assert not all_refused([busy], NOW, TTL)
    assert all_refused([replace(busy, busy=False)], NOW, TTL)
    assert not all_refused([busy, snap("b", 0, 4, health=Health.UNAVAILABLE)], NOW, TTL)
    # (a run whose deadline comes before the bench ends does not wait for it)
    assert not all_refused([busy], NOW, TTL, back_by_ms=NOW + 30_000)
    assert all_refused([busy], NOW, TTL, back_by_ms=NOW + 29_999)
    # a run that waited out its queue_timeout_ms behind it says why it went nowhere
    assert why_not(busy, NOW, TTL) == "benched: it answered too busy or out of quota (429, 503, 402, key limit)"
    assert why_not(replace(busy, busy=False), NOW, TTL) == "benched"


def benched(s: ProviderSnapshot, until_ms: int) -> ProviderSnapshot:
    return replace(s, benched=True, bench_until_ms=until_ms)


def test_a_refusal_by_benches_alone_says_to_retry_when_the_first_ends() -> None:
    a, b = snap("a", 0, 4), snap("b", 0, 4)
    assert retry_after_s([benched(a, NOW + 20_000), benched(b, NOW + 4_001)], NOW, TTL, 60) == 5
    assert retry_after_s([benched(a, NOW + 300_000)], NOW, TTL, 60) == 60  # (at most most_s)
    assert retry_after_s([benched(a, NOW + 10)], NOW, TTL, 60) == 1
    # anything else keeping one out may end at any moment: 1 s
    assert retry_after_s([benched(a, NOW + 20_000), snap("b", 0, 4, health=Health.UNAVAILABLE)], NOW, TTL, 60) == 1
    assert retry_after_s([benched(snap("a", 0, 4, health=Health.UNAVAILABLE), NOW + 20_000)], NOW, TTL, 60) == 1
    assert retry_after_s([benched(snap("a", 0, 4, drained=True), NOW + 20_000)], NOW, TTL, 60) == 1
    assert retry_after_s([benched(snap("a", 0, 4, heartbeat_ms=NOW - TTL - 1), NOW + 20_000)], NOW, TTL, 60) == 1
    assert retry_after_s([replace(a, benched=True)], NOW, TTL, 60) == 1  # (its end unknown)
    assert retry_after_s([], NOW, TTL, 60) == 1


def test_health_values_are_the_wire_strings() -> None:
    assert [h.value for h in Health] == ["available", "unavailable", "unknown"]
    assert Health("available") is Health.AVAILABLE


# --- property-style ---------------------------------------------------------------------------


def _eligible(s: ProviderSnapshot) -> bool:
    """An independent statement of the candidate rule (DESIGN.md, "Selection policy")."""
    return (
        s.health == Health.AVAILABLE
        and s.heartbeat_ms is not None
        and NOW - s.heartbeat_ms <= TTL
        and not s.drained
        and 0 < _capacity(s)
        and s.in_flight < _capacity(s)
    )


def _capacity(s: ProviderSnapshot) -> int:
    """The operator's override when there is one, else the announced capacity (0 when unknown);
    never above the announced capacity."""
    if s.capacity_override is not None:
        return s.capacity_override if s.capacity is None else min(s.capacity_override, s.capacity)
    return s.capacity or 0


def _random_snapshots(rng: random.Random) -> list[ProviderSnapshot]:
    names = [f"p{i}" for i in range(20)] + ["vllm-a", "vllm-b", "ollama", "a", "Z"]
    ids = rng.sample(names, rng.randint(0, 8))
    out = []
    for pid in ids:
        capacity = rng.choice([None, 0, 1, 1, 2, 3, 3, 4, 6, 8, 10])
        top = (capacity or 2) + 1
        heartbeat = rng.choice([None, NOW - rng.randint(0, TTL), NOW - rng.randint(0, 3 * TTL), NOW + 10])
        health = rng.choices(list(Health), weights=[6, 1, 1])[0]
        override = rng.choice([None, None, None, 1, 2, 5])
        out.append(snap(pid, rng.randint(0, top), capacity, health=health, heartbeat_ms=heartbeat,
                        drained=rng.random() < 0.15, override=override))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_select_property(seed: int) -> None:
    rng = random.Random(seed)
    chose_some = 0
    for _ in range(1500):
        snaps = _random_snapshots(rng)
        chosen = select_provider(snaps, NOW, TTL)
        eligible = [s for s in snaps if _eligible(s)]
        if not eligible:
            assert chosen is None, snaps
            continue
        chose_some += 1
        assert chosen is not None, snaps
        assert any(chosen is s for s in eligible)
        ratio = chosen.load_ratio()
        assert ratio is not None
        best = min(Fraction(s.in_flight, _capacity(s)) for s in eligible)
        assert ratio == best, snaps
        tied = [s for s in eligible if s.load_ratio() == best]
        assert _capacity(chosen) == max(_capacity(s) for s in tied)
        assert chosen.provider_id == min(s.provider_id for s in tied if _capacity(s) == _capacity(chosen))
        # deterministic whatever the input order
        for _ in range(3):
            shuffled = list(snaps)
            rng.shuffle(shuffled)
            again = select_provider(shuffled, NOW, TTL)
            assert again is not None and again.provider_id == chosen.provider_id
    assert chose_some > 500  # the generator really exercises the selection


# --- simulations ------------------------------------------------------------------------------


def _assign(snaps: dict[str, ProviderSnapshot], runs: int) -> list[str | None]:
    """Assign runs one by one, reserving a slot on the chosen provider each time."""
    order: list[str | None] = []
    for _ in range(runs):
        chosen = select_provider(snaps.values(), NOW, TTL)
        order.append(None if chosen is None else chosen.provider_id)
        if chosen is not None:
            snaps[chosen.provider_id] = replace(chosen, in_flight=chosen.in_flight + 1)
    return order


def test_capacities_1_and_3_split_4_runs_1_and_3() -> None:
    snaps = {"small": snap("small", 0, 1), "big": snap("big", 0, 3)}
    order = _assign(snaps, 4)
    assert Counter(order) == {"big": 3, "small": 1}
    # 0/3 ties 0/1 -> larger capacity; then 0/1 beats 1/3; then only big has room
    assert order == ["big", "small", "big", "big"]
    assert snaps["small"].in_flight == 1 and snaps["big"].in_flight == 3
    assert _assign(snaps, 1) == [None]


def test_fill_is_proportional_to_capacity() -> None:
    snaps = {pid: snap(pid, 0, cap) for pid, cap in [("a", 2), ("b", 3), ("c", 5)]}
    order = _assign(snaps, 10)
    assert Counter(order) == {"a": 2, "b": 3, "c": 5}
    assert _assign(snaps, 1) == [None]


def test_fill_skips_unavailable_provider() -> None:
    snaps = {
        "ok": snap("ok", 0, 2),
        "down": snap("down", 0, 8, health=Health.UNAVAILABLE),
        "stale": snap("stale", 0, 8, heartbeat_ms=NOW - TTL - 1),
    }
    assert _assign(snaps, 3) == ["ok", "ok", None]


def test_a_retry_avoids_the_providers_it_failed_on_when_it_can() -> None:
    a, b = snap("a", 0, 4), snap("b", 2, 4)
    assert pick(a, b) == "a"
    chosen = select_provider([a, b], NOW, TTL, avoid=frozenset({"a"}))
    assert chosen is not None and chosen.provider_id == "b"
    # Only avoided providers have a free slot: the run still goes, to the best of them.
    chosen = select_provider([a, snap("b", 4, 4)], NOW, TTL, avoid=frozenset({"a"}))
    assert chosen is not None and chosen.provider_id == "a"
    # Avoiding never makes an ineligible provider eligible.
    assert select_provider([snap("b", 4, 4)], NOW, TTL, avoid=frozenset({"a"})) is None


def test_a_provider_that_does_not_list_the_model_is_never_chosen() -> None:
    assert pick(replace(snap("a", 0, 4), has_model=False), snap("b", 3, 4)) == "b"
    assert pick(replace(snap("a", 0, 4), has_model=False)) is None


def test_a_drained_provider_takes_nothing_while_the_others_fill() -> None:
    snaps = {"a": snap("a", 0, 4, drained=True), "b": snap("b", 0, 2)}
    assert _assign(snaps, 3) == ["b", "b", None]


def test_an_override_below_in_flight_holds_new_runs_back_until_in_flight_is_below_it() -> None:
    """Capacity 4 lowered to 1 with 4 in flight: nothing goes there until in_flight is 0."""
    for in_flight, expected in [(4, None), (3, None), (2, None), (1, None), (0, "a")]:
        assert pick(snap("a", in_flight, 4, override=1)) == expected
    assert _assign({"a": snap("a", 0, 4, override=1)}, 2) == ["a", None]


@pytest.mark.parametrize(("snapshot", "why"), [
    (snap("a", 0, 4, heartbeat_ms=None), "no heartbeat"),
    (snap("a", 0, 4, heartbeat_ms=NOW - TTL - 1), "no heartbeat"),
    (snap("a", 0, 4, health=Health.UNAVAILABLE), "unavailable"),
    (snap("a", 0, 4, health=Health.UNKNOWN), "unknown"),
    (replace(snap("a", 0, 4), has_model=False), "missing the model"),
    (snap("a", 0, 4, drained=True), "drained or cordoned"),
    (snap("a", 0, 4, override=0), "capacity 0"),
    (snap("a", 4, 4), "full (4 of 4)"),
    (snap("a", 2, 4, override=2), "full (2 of 2)"),
    (snap("a", 1, 4), "has a free slot now"),
])
def test_why_a_provider_takes_no_run_is_said_in_a_few_words(snapshot: ProviderSnapshot, why: str) -> None:
    assert why_not(snapshot, NOW, TTL) == why
