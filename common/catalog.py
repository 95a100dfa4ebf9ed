"""The provider catalog (D04–D06, S06–S09): what every provider and model looks like now.

Read-only. `read_raw` fetches everything in one Redis pipeline; `build_catalog` is a pure
function of the config and that raw reading, so the gateway's `/v1/catalog`, the page and
`iop catalog` all show the same records. Whether a provider is selectable for a model is
decided by the selection policy's own predicates, so the catalog never disagrees with the
scheduler. What operators set (`common.control`: drains, cordons, capacity overrides) is shown
here and changed elsewhere (`/v1/admin/…`, `iop provider …`, `iop node …`).

Nothing secret is ever read into a record: no `api_key_env`, no environment value, no
`base_url` (it may carry credentials in its userinfo or query).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from types import EllipsisType
from typing import Any

from redis.asyncio import Redis

from common import control, keys
from common.config import Config, ModelConfig, ProviderConfig
from common.control import AuditEntry, ProviderControl
from common.policy import BLAME_RUNS, Health, ProviderSnapshot, has_free_slot, is_available, is_fresh
from common.provider_types import LIFECYCLE_FLAGS
from common.redisconn import as_text_map


@dataclass(frozen=True, slots=True)
class RawState:
    """What Redis held at `now_ms`, undecoded beyond plain strings."""

    now_ms: int
    #: provider id -> its heartbeat hash ({} when there is none)
    heartbeats: dict[str, dict[str, str]]
    #: provider id -> live leases (score > now)
    in_flight: dict[str, int]
    #: model id -> XLEN of its runs stream
    queued: dict[str, int]
    #: model id -> (ms timestamp from its entry id, run id) of the oldest waiting run, None when empty
    oldest: dict[str, tuple[int, str] | None]
    #: provider id -> what operators set for it (absent: nothing)
    control: dict[str, ProviderControl] = field(default_factory=dict)
    #: node id -> since when it is cordoned (ms), None when it is not
    cordons: dict[str, int | None] = field(default_factory=dict)
    #: the providers whose heartbeat lives, configured or not (`keys.BEATING`)
    beating: list[str] = field(default_factory=list)


async def read_raw(redis: Redis, config: Config, now_ms: int) -> RawState:
    """One pipeline: every provider's heartbeat and live lease count, every model's queue."""
    providers = [p.id for n in config.nodes for p in n.providers]
    pipe = redis.pipeline(transaction=False)
    for pid in providers:
        pipe.hgetall(keys.heartbeat(pid))
        pipe.zcount(keys.leases(pid), f"({now_ms}", "+inf")
    for m in config.models:
        pipe.xlen(keys.runs_stream(m.id))
        pipe.xrange(keys.runs_stream(m.id), "-", "+", count=1)
    control.queue_reads(pipe, config)
    pipe.zrangebyscore(keys.BEATING, f"({now_ms}", "+inf")
    replies = await pipe.execute()
    beating = [p.decode(errors="replace") for p in replies.pop()]
    n = len(providers)
    oldest: dict[str, tuple[int, str] | None] = {}
    for i, m in enumerate(config.models):
        head = replies[2 * n + 2 * i + 1]
        oldest[m.id] = (entry_ms(head[0][0]), as_text_map(head[0][1]).get("run", "")) if head else None
    controls, cordons = control.from_replies(config, replies[2 * n + 2 * len(config.models):])
    return RawState(
        now_ms=now_ms,
        heartbeats={pid: as_text_map(replies[2 * i]) for i, pid in enumerate(providers)},
        in_flight={pid: int(replies[2 * i + 1]) for i, pid in enumerate(providers)},
        queued={m.id: int(replies[2 * n + 2 * i]) for i, m in enumerate(config.models)},
        oldest=oldest,
        control=controls,
        cordons=cordons,
        beating=beating,
    )


def entry_ms(entry_id: bytes | str) -> int:
    """The ms timestamp of a stream entry id `<ms>-<seq>`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


# --- records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderModels:
    #: served names the config says the provider offers
    configured: list[str]
    #: served names the provider itself listed at its last probe; None = it did not list any
    observed: list[str] | None


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """What operators set for a provider, and where that leaves it."""

    #: active | draining (drained or cordoned, runs still in flight) | drained (and none in flight)
    state: str
    #: since when the provider is drained (ms); None = not drained
    drained_since_ms: int | None
    #: since when its node is cordoned (ms); None = not cordoned
    cordoned_since_ms: int | None
    #: the capacity an operator set; None = the announced one is used
    capacity_override: int | None
    #: when that override expires (ms); None = until cleared
    capacity_override_until_ms: int | None


@dataclass(frozen=True, slots=True)
class ProviderRecord:
    id: str
    node_id: str
    type: str
    category: str
    #: available | unavailable | unknown (no fresh heartbeat)
    health: str
    health_reason: str
    #: slots the provider's heartbeat announces; None without a heartbeat
    capacity: int | None
    configured_capacity: int
    #: the capacity the policy counts with: an operator's override, else the announced one
    effective_capacity: int | None
    in_flight: int
    #: in_flight / effective_capacity; None when it is unknown or 0
    load_ratio: float | None
    models: ProviderModels
    #: model id -> the served name it has on this provider
    serves: dict[str, str]
    #: runs waiting in the queues of the models it serves
    queued: int
    lifecycle_capabilities: dict[str, bool]
    #: when the last heartbeat was written (ms since the epoch); None if there is none
    last_heartbeat: int | None
    heartbeat_age_ms: int | None
    control: ControlRecord


@dataclass(frozen=True, slots=True)
class Placement:
    """One provider of a model, and whether a run of the model could go there now."""

    provider_id: str
    node_id: str
    target: str
    selectable: bool
    #: why not, when not: drained | cordoned | elsewhere | unknown | stale | unavailable | model_not_listed |
    #: benched | no_capacity | full
    reason: str | None
    detail: str | None


@dataclass(frozen=True, slots=True)
class ModelRecord:
    id: str
    display_name: str
    #: the other names callers may ask for it by
    aliases: list[str]
    providers: list[Placement]
    queued: int
    max_queue: int
    #: how long the oldest waiting run has waited since it was (re)queued (ms); None when none waits
    oldest_waiting_ms: int | None
    oldest_run_id: str | None


@dataclass(frozen=True, slots=True)
class NodeRecord:
    id: str
    #: since when an operator cordoned it (ms); None = not cordoned
    cordoned_since_ms: int | None
    providers: list[str]


@dataclass(frozen=True, slots=True)
class Catalog:
    generated_at_ms: int
    heartbeat_ttl_ms: int
    providers: list[ProviderRecord]
    models: list[ModelRecord]
    nodes: list[NodeRecord]
    #: providers whose workers beat but this config does not define: the pool runs another config
    #: (one being rolled out, or this one is old); the scheduler and workers see what this does not
    unconfigured_providers: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- assembly (pure) -----------------------------------------------------------------


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _names(value: str | None) -> list[str] | None:
    """A JSON list of names from a heartbeat field; None when absent, empty or malformed."""
    if not value:
        return None
    try:
        names = json.loads(value)
    except ValueError:
        return None
    if not isinstance(names, list):
        return None
    return [str(x) for x in names]


def _lifecycle(p: ProviderConfig, beat: dict[str, str]) -> dict[str, bool]:
    """Every coarse lifecycle flag (D05) -> whether the provider has it: the flags its heartbeat
    announces (a JSON list), else the ones its config gives it."""
    announced = _names(beat.get("lifecycle"))
    flags = set(announced if announced is not None else p.effective_lifecycle)
    return {f: f in flags for f in LIFECYCLE_FLAGS}


def _health(value: str | None) -> Health:
    try:
        return Health(value) if value else Health.UNKNOWN
    except ValueError:
        return Health.UNKNOWN


def snapshot(provider_id: str, beat: dict[str, str], in_flight: int, served: str | None,
             ctl: ProviderControl = control.NONE, now_ms: int | None = None,
             listed: Collection[str] | None | EllipsisType = ...) -> ProviderSnapshot:
    """The policy's view of a provider (for a model served there as `served`; benched for it if its
    bench lasts past `now_ms`). `listed`: the names its heartbeat's `observed_models` holds, when
    the caller read them already (`...`: read them here)."""
    observed = _names(beat.get("observed_models")) if isinstance(listed, EllipsisType) else listed
    bench = _int(beat.get(keys.BENCH_FIELD + served)) if served is not None else None
    return ProviderSnapshot(
        provider_id=provider_id,
        health=_health(beat.get("health")),
        capacity=_int(beat.get("capacity")),
        in_flight=in_flight,
        heartbeat_ms=_int(beat.get("ts_ms")),
        has_model=served is None or observed is None or served in observed,
        drained=ctl.blocked,
        capacity_override=ctl.capacity_override,
        benched=now_ms is not None and (bench or 0) > now_ms,
        bench_until_ms=bench,
        busy=bench is not None and served is not None and beat.get(keys.BUSY_FIELD + served) == str(bench),
    )


def _provider_health(snap: ProviderSnapshot, beat: dict[str, str], now_ms: int, ttl_ms: int) -> tuple[str, str]:
    if snap.heartbeat_ms is None:
        return Health.UNKNOWN.value, ("no heartbeat: no worker of its node is running (stopped, or stuck: a paused "
                                      "process, a host cut off), or Redis lost it")
    if not is_fresh(snap, now_ms, ttl_ms):
        age_s = (now_ms - snap.heartbeat_ms) / 1000
        return Health.UNKNOWN.value, f"last heartbeat {age_s:.1f}s ago (older than {ttl_ms / 1000:g}s)"
    return snap.health.value, beat.get("reason", "")


def _why_not(snap: ProviderSnapshot, beat: dict[str, str], target: str, now_ms: int, ttl_ms: int,
             ctl: ProviderControl = control.NONE, node: str | None = None) -> tuple[str | None, str | None]:
    """(reason, detail) a run of the model cannot go to this provider now; (None, None) if it can.
    An operator's drain or cordon comes first: it is why, whatever else holds. `node`: the
    config's for it (a heartbeat from another node counts as none, as the schedulers read it)."""
    if ctl.drained_since_ms is not None:
        return "drained", "an operator drained it"
    if ctl.cordoned_since_ms is not None:
        return "cordoned", "an operator cordoned its node"
    if node is not None and beat.get("node", node) != node:
        return "elsewhere", f"its heartbeat comes from node {beat['node']}, not this config's {node}"
    if snap.heartbeat_ms is None:
        return "unknown", "no heartbeat"
    if not is_fresh(snap, now_ms, ttl_ms):
        return "stale", f"last heartbeat {(now_ms - snap.heartbeat_ms) / 1000:.1f}s ago"
    if snap.health is not Health.AVAILABLE:
        return snap.health.value, beat.get("reason") or f"its last probe says {snap.health.value}"
    if not snap.has_model:
        return "model_not_listed", f"the provider does not list {target!r}"
    if snap.benched:
        back_s = ((snap.bench_until_ms or 0) - now_ms) / 1000
        if snap.busy:
            return "benched", (f"it answered a run of {target!r} too busy or out of quota (429, 503, 402, key limit); "
                               f"back in {back_s:.1f}s")
        return "benched", (f"{BLAME_RUNS} runs of {target!r} in a row failed there and another provider "
                           f"served them; back in {back_s:.1f}s")
    capacity = snap.effective_capacity
    if not capacity:
        return "no_capacity", "capacity unknown or 0"
    if not has_free_slot(snap):
        override = f" (an operator set the capacity to {capacity})" if snap.capacity_override == capacity else ""
        return "full", f"{snap.in_flight}/{capacity} slots in use{override}"
    assert is_available(snap, now_ms, ttl_ms)
    return None, None


def _provider_record(config: Config, p: ProviderConfig, raw: RawState) -> ProviderRecord:
    beat = raw.heartbeats.get(p.id, {})
    in_flight = raw.in_flight.get(p.id, 0)
    ctl = raw.control.get(p.id, control.NONE)
    snap = snapshot(p.id, beat, in_flight, None, ctl)
    ttl = config.runtime.heartbeat_ttl_ms
    health, reason = _provider_health(snap, beat, raw.now_ms, ttl)
    # (without a heartbeat its capacity is unknown, an operator's override or not: it showed 0/1, 0.00)
    effective = snap.effective_capacity if snap.capacity is not None else None
    ratio = snap.load_ratio() if snap.capacity is not None else None
    serves = {}
    for model_id in config.models_of(p.id):  # (not every model for every provider: 1,000 of each made 10^6 looks)
        model = config.model(model_id)
        assert model is not None
        serves[model_id] = model.providers[p.id]
    return ProviderRecord(
        id=p.id,
        node_id=config.node_of(p.id),
        type=p.type,
        category=p.effective_category,
        health=health,
        health_reason=reason,
        capacity=snap.capacity,
        configured_capacity=p.capacity,
        effective_capacity=effective,
        in_flight=in_flight,
        load_ratio=round(float(ratio), 4) if ratio is not None else None,
        models=ProviderModels(configured=list(p.models), observed=_names(beat.get("observed_models"))),
        serves=serves,
        queued=sum(raw.queued.get(mid, 0) for mid in serves),
        lifecycle_capabilities=_lifecycle(p, beat),
        last_heartbeat=snap.heartbeat_ms,
        heartbeat_age_ms=raw.now_ms - snap.heartbeat_ms if snap.heartbeat_ms is not None else None,
        control=ControlRecord(state=ctl.state(in_flight), drained_since_ms=ctl.drained_since_ms,
                              cordoned_since_ms=ctl.cordoned_since_ms, capacity_override=ctl.capacity_override,
                              capacity_override_until_ms=ctl.capacity_override_until_ms),
    )


def _model_record(config: Config, m: ModelConfig, raw: RawState,
                  listed: Mapping[str, frozenset[str] | None]) -> ModelRecord:
    """`listed`: each provider's observed names, read once for every model (a provider may list
    1,000, and serve as many models: reading its list again for each model made the catalog of 1,000
    models on 10 such providers take a second)."""
    ttl = config.runtime.heartbeat_ttl_ms
    placements = []
    for pid, target in m.providers.items():
        beat = raw.heartbeats.get(pid, {})
        ctl = raw.control.get(pid, control.NONE)
        snap = snapshot(pid, beat, raw.in_flight.get(pid, 0), target, ctl, raw.now_ms, listed.get(pid))
        reason, detail = _why_not(snap, beat, target, raw.now_ms, ttl, ctl, config.node_of(pid))
        placements.append(Placement(provider_id=pid, node_id=config.node_of(pid), target=target,
                                    selectable=reason is None, reason=reason, detail=detail))
    oldest = raw.oldest.get(m.id)
    return ModelRecord(
        id=m.id,
        display_name=m.title,
        aliases=list(m.aliases),
        providers=placements,
        queued=raw.queued.get(m.id, 0),
        max_queue=config.queue_for(m).max_queue,
        oldest_waiting_ms=max(0, raw.now_ms - oldest[0]) if oldest is not None else None,
        oldest_run_id=oldest[1] if oldest is not None else None,
    )


def build_catalog(config: Config, raw: RawState, models: bool = True) -> Catalog:
    """Every configured provider (in config order, node by node) and every model. Pure. `models`:
    False for no model records (an operator's change answers with its providers' records, and a
    scheduler's scrape reads those: every model's placements, built for each of 50 changes at once
    with 300 models, held a gateway's one thread for seconds)."""
    listed: dict[str, frozenset[str] | None] = {}
    for pid, beat in raw.heartbeats.items() if models else ():
        names = _names(beat.get("observed_models"))
        listed[pid] = frozenset(names) if names is not None else None
    return Catalog(
        generated_at_ms=raw.now_ms,
        heartbeat_ttl_ms=config.runtime.heartbeat_ttl_ms,
        providers=[_provider_record(config, p, raw) for n in config.nodes for p in n.providers],
        models=[_model_record(config, m, raw, listed) for m in config.models] if models else [],
        nodes=[NodeRecord(id=n.id, cordoned_since_ms=raw.cordons.get(n.id), providers=[p.id for p in n.providers])
               for n in config.nodes],
        unconfigured_providers=sorted(set(raw.beating) - {p.id for n in config.nodes for p in n.providers}),
    )


async def read_catalog(redis: Redis, config: Config, now_ms: int, models: bool = True) -> Catalog:
    return build_catalog(config, await read_raw(redis, config, now_ms), models)


def change_report(catalog: Catalog, entry: AuditEntry) -> dict[str, Any]:
    """What an operator's change answers (HTTP and `iop … --json` alike): the change as recorded, and
    the catalog records of the providers it touched (a node's: all of its providers), as they are now."""
    report: dict[str, Any] = {"object": "control.change", "change": entry.to_json()}
    if entry.target_kind == "node":
        node = next((n for n in catalog.nodes if n.id == entry.target), None)  # (None: one the config lacks)
        report["node"] = asdict(node) if node is not None else None
        touched = set(node.providers) if node is not None else set()
    else:
        touched = {entry.target}
    report["providers"] = [asdict(p) for p in catalog.providers if p.id in touched]
    return report
