"""The catalog's pure assembly: health, load ratio, selectability and what never appears."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from common.catalog import RawState, build_catalog, entry_ms, snapshot
from common.config import Config, parse_config
from common.control import ProviderControl
from common.policy import is_available
from iop.catalog_cmd import render_catalog

NOW = 1_000_000
TTL = 6_000


def config(**provider_extra: Any) -> Config:
    return parse_config({
        "models": [
            {"id": "m1", "display_name": "Model One", "providers": {"a": "a-m1", "b": "b-m1"}},
            {"id": "m2", "providers": {"a": "a-m2"}, "queue": {"max_queue": 5}},
        ],
        "nodes": [
            {"id": "n1", "providers": [
                {"id": "a", "type": "vllm", "base_url": "http://user:pw@a:8000", "capacity": 4,
                 "models": ["a-m1", "a-m2"], **provider_extra}]},
            {"id": "n2", "providers": [
                {"id": "b", "type": "openai_api", "base_url": "http://b", "capacity": 2, "models": ["b-m1"]},
                {"id": "c", "type": "lemonade", "category": "cli", "base_url": "http://c", "capacity": 1,
                 "models": ["c-x"]}]},
        ],
        "runtime": {"heartbeat_ttl_ms": TTL},
    })


def beat(health: str = "available", capacity: int | None = 4, age_ms: int = 100, reason: str = "",
         observed: list[str] | None = None, **extra: str) -> dict[str, str]:
    fields = {"health": health, "reason": reason, "ts_ms": str(NOW - age_ms),
              "observed_models": json.dumps(observed) if observed is not None else "", **extra}
    if capacity is not None:
        fields["capacity"] = str(capacity)
    return fields


def raw(heartbeats: dict[str, dict[str, str]], in_flight: dict[str, int] | None = None,
        queued: dict[str, int] | None = None, oldest: dict[str, tuple[int, str] | None] | None = None) -> RawState:
    return RawState(now_ms=NOW, heartbeats=heartbeats, in_flight=in_flight or {}, queued=queued or {},
                    oldest=oldest or {})


def test_every_configured_provider_and_model_has_a_record_in_config_order() -> None:
    cat = build_catalog(config(), raw({}))
    assert [(p.node_id, p.id) for p in cat.providers] == [("n1", "a"), ("n2", "b"), ("n2", "c")]
    assert [(m.id, m.display_name) for m in cat.models] == [("m1", "Model One"), ("m2", "m2")]
    assert [p.category for p in cat.providers] == ["local_inference", "api", "cli"]
    assert cat.heartbeat_ttl_ms == TTL and cat.generated_at_ms == NOW


@pytest.mark.parametrize(("heartbeat", "health", "reason_has"), [
    (None, "unknown", "no heartbeat: no worker of its node is running (stopped, or stuck"),  # (a paused worker too)
    (beat(age_ms=TTL + 1), "unknown", "last heartbeat 6.0s ago"),
    (beat(age_ms=TTL), "available", ""),
    (beat(health="unavailable", reason="connection refused"), "unavailable", "connection refused"),
    (beat(health="bogus"), "unknown", ""),
])
def test_health_is_unknown_without_a_fresh_heartbeat(heartbeat: dict[str, str] | None, health: str,
                                                      reason_has: str) -> None:
    cat = build_catalog(config(), raw({"a": heartbeat} if heartbeat else {}))
    a = cat.providers[0]
    assert a.health == health
    assert reason_has in a.health_reason
    if heartbeat is None:
        assert a.last_heartbeat is None and a.heartbeat_age_ms is None
    else:
        assert a.last_heartbeat == int(heartbeat["ts_ms"])


@pytest.mark.parametrize(("capacity", "in_flight", "ratio"), [
    (None, 0, None), (None, 2, None), (0, 0, None), (4, 0, 0.0), (4, 1, 0.25), (3, 2, 0.6667), (2, 2, 1.0),
])
def test_load_ratio_is_null_when_capacity_is_unknown_or_zero(capacity: int | None, in_flight: int,
                                                             ratio: float | None) -> None:
    cat = build_catalog(config(), raw({"a": beat(capacity=capacity)}, in_flight={"a": in_flight}))
    a = cat.providers[0]
    assert (a.capacity, a.in_flight, a.load_ratio) == (capacity, in_flight, ratio)
    assert a.configured_capacity == 4


def test_queued_counts_the_runs_waiting_for_every_model_the_provider_serves() -> None:
    cat = build_catalog(config(), raw({}, queued={"m1": 3, "m2": 2}, oldest={"m1": (NOW - 1500, "run_x")}))
    assert [p.queued for p in cat.providers] == [5, 3, 0]
    m1, m2 = cat.models
    assert (m1.queued, m1.max_queue, m1.oldest_waiting_ms, m1.oldest_run_id) == (3, 64, 1500, "run_x")
    assert (m2.queued, m2.max_queue, m2.oldest_waiting_ms, m2.oldest_run_id) == (2, 5, None, None)


def test_models_show_configured_and_observed_served_names() -> None:
    cat = build_catalog(config(), raw({"a": beat(observed=["a-m1", "other"]), "b": beat(capacity=2)}))
    a, b, _ = cat.providers
    assert a.models.configured == ["a-m1", "a-m2"] and a.models.observed == ["a-m1", "other"]
    assert b.models.observed is None
    assert a.serves == {"m1": "a-m1", "m2": "a-m2"}


@pytest.mark.parametrize(("heartbeat", "in_flight", "reason"), [
    (None, 0, "unknown"),
    (beat(age_ms=TTL + 500), 0, "stale"),
    (beat(health="unavailable", reason="HTTP 500"), 0, "unavailable"),
    (beat(health="unknown"), 0, "unknown"),
    (beat(observed=["a-m2"]), 0, "model_not_listed"),
    (beat(capacity=None), 0, "no_capacity"),
    (beat(capacity=0), 0, "no_capacity"),
    (beat(capacity=4), 4, "full"),
    (beat(capacity=4), 3, None),
    (beat(observed=["a-m1"]), 0, None),
])
def test_selectable_now_or_why_not_agrees_with_the_policy(heartbeat: dict[str, str] | None, in_flight: int,
                                                          reason: str | None) -> None:
    cat = build_catalog(config(), raw({"a": heartbeat} if heartbeat else {}, in_flight={"a": in_flight}))
    placement = cat.models[0].providers[0]
    assert (placement.provider_id, placement.target, placement.node_id) == ("a", "a-m1", "n1")
    assert placement.reason == reason
    assert placement.selectable is (reason is None)
    assert (placement.detail is None) is (reason is None)
    snap = snapshot("a", heartbeat or {}, in_flight, "a-m1")
    policy_says = is_available(snap, NOW, TTL) and snap.capacity is not None and in_flight < snap.capacity
    assert placement.selectable is policy_says


def test_a_model_missing_from_one_providers_list_stays_selectable_for_the_others() -> None:
    cat = build_catalog(config(), raw({"a": beat(observed=["a-m1"]), "b": beat(capacity=2)}))
    m1, m2 = cat.models
    assert [(p.provider_id, p.selectable) for p in m1.providers] == [("a", True), ("b", True)]
    assert [(p.provider_id, p.reason) for p in m2.providers] == [("a", "model_not_listed")]


def test_a_model_benched_on_a_provider_says_when_it_is_back_and_only_there() -> None:
    """The bench of a's a-m1 ends 12.3 s from now: m1's placement on a says so; a's other model and
    b are untouched; a bench already over is none."""
    cat = build_catalog(config(), raw({"a": {**beat(), "bench:a-m1": str(NOW + 12_300)}, "b": beat(capacity=2)}))
    m1, m2 = cat.models
    (on_a, on_b), (m2_on_a,) = m1.providers, m2.providers
    assert (on_a.selectable, on_a.reason) == (False, "benched")
    assert on_a.detail is not None and on_a.detail.endswith("back in 12.3s")
    assert on_b.selectable and m2_on_a.selectable
    over = build_catalog(config(), raw({"a": {**beat(), "bench:a-m1": str(NOW - 1)}}))
    assert over.models[0].providers[0].selectable


def test_the_terminal_s_provider_row_says_what_it_is_benched_for() -> None:
    """A benched provider showed `available` with no reason in `iop catalog`'s provider table; only
    its model's line said why (an operator reviewer's finding)."""
    cat = build_catalog(config(), raw({"a": {**beat(), "bench:a-m1": str(NOW + 12_300)}, "b": beat(capacity=2)}))
    rows = {line.split()[1]: line for line in render_catalog(cat).splitlines()[1:] if line.strip()
            and line.split()[1] in ("a", "b")}
    assert rows["a"].rstrip().endswith("benched for m1") and "benched" not in rows["b"]


def test_a_model_benched_because_its_provider_was_too_busy_says_so() -> None:
    """A 429 or 503 benches the model there for its Retry-After (`busy:` says the same end): the
    detail says it was too busy, not that runs failed there (a blame's bench, later, says that)."""
    until = str(NOW + 30_000)
    cat = build_catalog(config(), raw({"a": {**beat(), "bench:a-m1": until, "busy:a-m1": until}}))
    on_a = cat.models[0].providers[0]
    assert (on_a.reason, on_a.detail) == (
        "benched", "it answered a run of 'a-m1' too busy or out of quota (429, 503, 402, key limit); back in 30.0s")
    blamed = build_catalog(config(), raw({"a": {**beat(), "bench:a-m1": str(NOW + 31_000), "busy:a-m1": until}}))
    assert (blamed.models[0].providers[0].detail or "").startswith("3 runs of 'a-m1' in a row failed there")


def test_lifecycle_flags_come_from_the_heartbeat_else_from_the_config() -> None:
    announced = json.dumps(["list_models", "load_model"])
    cat = build_catalog(config(), raw({"a": beat(lifecycle=announced)}))
    a, b, c = cat.providers
    assert a.lifecycle_capabilities == {"list_models": True, "load_model": True, "unload_model": False,
                                        "pull_model": False, "delete_model": False}
    assert [f for f, on in b.lifecycle_capabilities.items() if on] == ["list_models"]  # openai_api's default
    assert all(c.lifecycle_capabilities.values())  # lemonade manages its own models
    overridden = build_catalog(config(lifecycle_capabilities=["pull_model"]), raw({}))
    assert [f for f, on in overridden.providers[0].lifecycle_capabilities.items() if on] == ["pull_model"]


def test_no_secret_ever_appears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_SECRET_KEY_VAR", "sk-very-secret-value")
    cfg = config(api_key_env="IOP_TEST_SECRET_KEY_VAR", api_key_header="api-key")  # (not with base_url's user:pw)
    cat = build_catalog(cfg, raw({"a": beat(), "b": beat(capacity=2)}, in_flight={"a": 1}))
    text = json.dumps(cat.to_json())
    for leak in ("sk-very-secret-value", "IOP_TEST_SECRET_KEY_VAR", "api_key", "base_url", "user:pw", "http://"):
        assert leak not in text


def test_the_json_has_the_documented_fields() -> None:
    data = build_catalog(config(), raw({"a": beat()})).to_json()
    assert set(data) == {"generated_at_ms", "heartbeat_ttl_ms", "providers", "models", "nodes",
                         "unconfigured_providers"}
    assert {"id", "node_id", "type", "category", "health", "health_reason", "capacity", "configured_capacity",
            "effective_capacity", "in_flight", "load_ratio", "models", "queued", "lifecycle_capabilities",
            "last_heartbeat", "control"} <= set(data["providers"][0])
    assert set(data["providers"][0]["control"]) == {"state", "drained_since_ms", "cordoned_since_ms",
                                                    "capacity_override", "capacity_override_until_ms"}
    assert data["nodes"] == [{"id": "n1", "cordoned_since_ms": None, "providers": ["a"]},
                             {"id": "n2", "cordoned_since_ms": None, "providers": ["b", "c"]}]
    assert {"id", "display_name", "providers", "queued"} <= set(data["models"][0])
    assert {"provider_id", "target", "selectable", "reason"} <= set(data["models"][0]["providers"][0])
    json.dumps(data)  # plain JSON, no dataclasses or Fractions left


def test_entry_ms_reads_the_time_part_of_a_stream_id() -> None:
    assert entry_ms(b"1712345678901-3") == 1712345678901
    assert entry_ms("5-0") == 5


# --- operator control -------------------------------------------------------------------------

def controlled(ctl: dict[str, ProviderControl], cordons: dict[str, int | None] | None = None,
               in_flight: dict[str, int] | None = None) -> RawState:
    return RawState(now_ms=NOW, heartbeats={"a": beat(), "b": beat(capacity=2)}, in_flight=in_flight or {},
                    queued={}, oldest={}, control=ctl, cordons=cordons or {})


@pytest.mark.parametrize(("ctl", "in_flight", "state", "reason"), [
    (ProviderControl(), 0, "active", None),
    (ProviderControl(), 3, "active", None),
    (ProviderControl(drained_since_ms=NOW - 5), 3, "draining", "drained"),
    (ProviderControl(drained_since_ms=NOW - 5), 0, "drained", "drained"),
    (ProviderControl(cordoned_since_ms=NOW - 5), 1, "draining", "cordoned"),
    (ProviderControl(cordoned_since_ms=NOW - 5), 0, "drained", "cordoned"),
    (ProviderControl(drained_since_ms=NOW - 9, cordoned_since_ms=NOW - 5), 0, "drained", "drained"),
])
def test_a_drained_or_cordoned_provider_is_draining_until_its_in_flight_is_0(
        ctl: ProviderControl, in_flight: int, state: str, reason: str | None) -> None:
    cat = build_catalog(config(), controlled({"a": ctl}, in_flight={"a": in_flight}))
    a = cat.providers[0]
    assert a.control.state == state
    assert a.health == "available"  # a drain is not a health
    placement = cat.models[0].providers[0]
    assert placement.provider_id == "a"
    assert placement.reason == (reason or (None if in_flight < 4 else "full"))
    assert placement.selectable is (reason is None)


def test_a_capacity_override_is_the_effective_capacity_and_the_load_ratio_follows_it() -> None:
    ctl = ProviderControl(capacity_override=1, capacity_override_until_ms=NOW + 60_000)
    cat = build_catalog(config(), controlled({"a": ctl}, in_flight={"a": 3}))
    a = cat.providers[0]
    assert (a.configured_capacity, a.capacity, a.effective_capacity) == (4, 4, 1)
    assert a.load_ratio == 3.0
    assert a.control.capacity_override == 1 and a.control.capacity_override_until_ms == NOW + 60_000
    assert a.control.state == "active"
    placement = cat.models[0].providers[0]
    assert (placement.selectable, placement.reason) == (False, "full")
    assert placement.detail == "3/1 slots in use (an operator set the capacity to 1)"
    # above the announced capacity (set before the config lowered it): the announced one counts (an
    # operator audit found its runs dispatched to leases that waited for a worker)
    cat = build_catalog(config(), controlled({"a": ProviderControl(capacity_override=6)}, in_flight={"a": 4}))
    assert cat.providers[0].effective_capacity == 4 and cat.providers[0].load_ratio == 1.0
    placement = cat.models[0].providers[0]
    assert (placement.selectable, placement.detail) == (False, "4/4 slots in use")


def test_an_override_of_a_provider_without_a_heartbeat_gives_it_no_capacity() -> None:
    """(An operator's catalog check: `iop provider capacity pg 1` on a provider no worker beats for
    showed it 0/1 with a load ratio of 0.00.)"""
    raw = controlled({"a": ProviderControl(capacity_override=1)})
    raw.heartbeats.pop("a")
    a = build_catalog(config(), raw).providers[0]
    assert (a.capacity, a.effective_capacity, a.load_ratio) == (None, None, None)
    assert a.control.capacity_override == 1


def test_a_cordoned_node_shows_in_the_node_records() -> None:
    cat = build_catalog(config(), controlled({"b": ProviderControl(cordoned_since_ms=NOW - 1),
                                              "c": ProviderControl(cordoned_since_ms=NOW - 1)},
                                             cordons={"n1": None, "n2": NOW - 1}))
    assert [(n.id, n.cordoned_since_ms) for n in cat.nodes] == [("n1", None), ("n2", NOW - 1)]
    assert [p.control.state for p in cat.providers] == ["active", "drained", "drained"]


def test_providers_that_beat_but_the_config_lacks_are_named() -> None:
    """The reader's config is not the pool's (a rollout half done): its records cannot show a
    provider it does not define, but they say that one beats."""
    state = raw({"a": beat()})
    assert build_catalog(config(), state).unconfigured_providers == []
    state = dataclasses.replace(state, beating=["zeta", "a", "d-new"])
    assert build_catalog(config(), state).unconfigured_providers == ["d-new", "zeta"]
    assert render_catalog(build_catalog(config(), state)).endswith(
        "\n\nproviders with heartbeats that this config does not define: d-new, zeta (the pool runs another config)")
    assert "does not define" not in render_catalog(build_catalog(config(), raw({})))
    # (a name written into Redis by hand: it neither rewrites the terminal nor forges a line)
    state = dataclasses.replace(state, beating=["zz\x1b[2J\nforged"])
    assert render_catalog(build_catalog(config(), state)).endswith(
        "does not define: zz\\u001b[2J\\u000aforged (the pool runs another config)")


def test_a_provider_whose_heartbeat_comes_from_another_node_is_not_selectable_and_says_why() -> None:
    """b is on n2 in this config, but its heartbeat comes from n1 (a rollout moved it there, half
    done): the schedulers of this config send it no run, and the catalog says so (it said
    selectable); a heartbeat from its own node, or one that names none (an older worker's), is fine."""
    cat = build_catalog(config(), raw({"a": beat(node="n1"), "b": beat(capacity=2, node="n1")}))
    (on_a, on_b), _ = (cat.models[0].providers, cat.models[1].providers)
    assert on_a.selectable and (on_b.selectable, on_b.reason) == (False, "elsewhere")
    assert on_b.detail == "its heartbeat comes from node n1, not this config's n2"
    for heartbeat in (beat(capacity=2, node="n2"), beat(capacity=2)):
        assert build_catalog(config(), raw({"b": heartbeat})).models[0].providers[1].selectable


def test_each_provider_s_observed_list_is_read_once_however_many_models_it_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider may list 1,000 served names and serve as many models: its list was parsed again for
    each of them (1,000 models on 10 such providers: a second a catalog, for every `/v1/catalog`, scrape
    of a scheduler's metrics, operator's change and load sample)."""
    import common.catalog as catalog

    served = [f"s{i}" for i in range(40)]
    cfg = parse_config({
        "models": [{"id": f"m{i}", "providers": {"a": served[i], "b": served[i]}} for i in range(40)],
        "nodes": [{"id": "n1", "providers": [{"id": p, "type": "vllm", "base_url": "http://x", "capacity": 4,
                                              "models": served} for p in ("a", "b")]}],
    })
    reads: list[str | None] = []
    names = catalog._names

    def counted(value: str | None) -> list[str] | None:
        reads.append(value)
        return names(value)

    monkeypatch.setattr(catalog, "_names", counted)
    cat = build_catalog(cfg, raw({"a": beat(observed=served), "b": beat(observed=served[1:])}))
    lists = [r for r in reads if r and r.startswith('["s')]  # (its lifecycle flags are read so too)
    assert len(lists) <= 3 * 2  # (a few for each provider, none for each of its 40 models)
    assert [pl.selectable for pl in cat.models[0].providers] == [True, False]  # b does not list s0
    assert cat.models[0].providers[1].reason == "model_not_listed"
    assert all(pl.selectable for m in cat.models[1:] for pl in m.providers)
    assert cat.providers[0].serves == {f"m{i}": served[i] for i in range(40)}
