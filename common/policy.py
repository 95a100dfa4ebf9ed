"""The selection policy (D02, S04): a pure function of provider snapshots.

A provider is a candidate when its heartbeat is fresh, its health is `available`, its
capacity is known and > 0, and it has a free slot (in_flight < capacity). Among the
candidates the lowest `in_flight / capacity` wins; ratios are compared exactly
(1/3 beats 2/3, and free slots alone never beat a lower ratio).

Ties break deterministically: first the larger capacity (a 0/4 provider is preferred
over a 0/1 one, so the small provider is kept for when the large one fills), then the
provider id in lexical order.

A run being retried passes the providers it already failed on as `avoid`: they are only
chosen when no other candidate has a free slot. A run whose provider answered with a server
error passes them as `exclude` instead: it goes to another provider or waits.

Operator control is an input like the rest: a provider that is drained (or whose node is
cordoned) is never a candidate, and a capacity override replaces the announced capacity
everywhere the capacity counts (free slots, the ratio, the tie-break). Neither says anything
about health: a drained provider is not down, so it never makes a model's runs fail.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from fractions import Fraction


def capacity_override(value: bytes | str | None) -> int | None:
    """An operator's capacity override as its key holds it: an integer in ASCII digits (a minus
    sign allowed: 0 or less leaves no slot), as `iop provider capacity` writes one (>= 1); anything
    else written by hand ('1.5', ' 2', '0x3') is no override, for every reader alike (the dispatch
    scripts' `capped` reads it so)."""
    if value is None:
        return None
    text = value if isinstance(value, bytes) else value.encode()
    digits = text[1:] if text.startswith(b"-") else text
    return int(text) if digits.isdigit() else None  # (bytes: ASCII digits only)


class Health(StrEnum):
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"
    UNKNOWN = "unknown"


#: Strikes since its last sign of life that make a provider down (`workers.health`); a refused
#: connection, a host that does not resolve, a health endpoint that says it is not ready strike
#: this many at once.
DOWN = 3
#: why a provider is down when its strikes said nothing
DOWN_REASON = "it failed repeatedly"
#: Runs of a model in a row that failed on a provider (a 5xx, a timeout, a broken answer) and were
#: then served by another that bench it for that model (`common.scripts.BLAME`): none of the model's
#: runs go there for `runtime.bench_ms`, whatever its probes say (a server whose health endpoint
#: answers while its runs fail). Its health and its other models are not touched.
BLAME_RUNS = 3


@dataclass(frozen=True, slots=True)
class ProviderSnapshot:
    """What the scheduler knows about one provider at one instant."""

    provider_id: str
    health: Health
    capacity: int | None
    in_flight: int
    #: when the heartbeat was written (ms since the epoch); None = no heartbeat
    heartbeat_ms: int | None
    #: False when the provider listed the models it serves and the run's served name was not
    #: among them: it cannot take this model's runs, whatever its health
    has_model: bool = True
    #: an operator drained the provider or cordoned its node: it takes no new runs
    drained: bool = False
    #: the capacity an operator set for it (until cleared or expired); None = the announced one
    capacity_override: int | None = None
    #: benched for the model: its runs of it failed where another provider's succeeded (`BLAME_RUNS`)
    benched: bool = False
    #: when that bench ends (ms since the epoch), if the reader knows it
    bench_until_ms: int | None = None
    #: the bench is a busy one: it answered a run 429, 503 or 402 and asked to be left alone until then
    #: (`keys.BUSY_FIELD`): busy is not down, so the model's runs wait for it (`all_refused`)
    busy: bool = False
    #: the node its heartbeat comes from when that is not the config's (it moved there in a config
    #: the reader does not run yet): its heartbeat counts as none (`heartbeat_ms` None)
    beats_from: str | None = None

    @property
    def effective_capacity(self) -> int | None:
        """The capacity the policy counts with: the operator's override, else the announced one;
        never more than the announced one (an override set before the config lowered the
        capacity only lowers it too: slots above it would be leases waiting for a worker)."""
        if self.capacity_override is None:
            return self.capacity
        if self.capacity is None:
            return self.capacity_override
        return min(self.capacity, self.capacity_override)

    def load_ratio(self) -> Fraction | None:
        capacity = self.effective_capacity
        if not capacity:
            return None
        return Fraction(self.in_flight, capacity)


def is_fresh(snap: ProviderSnapshot, now_ms: int, ttl_ms: int) -> bool:
    return snap.heartbeat_ms is not None and now_ms - snap.heartbeat_ms <= ttl_ms


def is_available(snap: ProviderSnapshot, now_ms: int, ttl_ms: int) -> bool:
    """Healthy and known: could take runs if it had a free slot."""
    return (
        snap.health is Health.AVAILABLE
        and snap.has_model
        and not snap.benched
        and is_fresh(snap, now_ms, ttl_ms)
        and snap.effective_capacity is not None
        and snap.effective_capacity > 0
    )


def all_refused(snapshots: Iterable[ProviderSnapshot], now_ms: int, ttl_ms: int, back_by_ms: int | None = None) -> bool:
    """True when every provider answered its latest probe and none can take the model's runs
    (unavailable, not serving the model, or benched for it). Providers with no fresh heartbeat are
    not known to be down, so they keep a run waiting; so do those benched because they were too busy
    (back when their Retry-After ends: a busy hosted API's one 429 failed every run waiting), if
    that bench ends by `back_by_ms` (None: whenever it ends; a run's deadline: one that ends after it
    cannot serve the run)."""
    snaps = list(snapshots)
    return bool(snaps) and all(
        is_fresh(s, now_ms, ttl_ms)
        and (s.health is Health.UNAVAILABLE or not s.has_model or (s.benched and not (
            s.busy and (back_by_ms is None or (s.bench_until_ms is not None and s.bench_until_ms <= back_by_ms)))))
        for s in snaps
    )


def retry_after_s(snapshots: Iterable[ProviderSnapshot], now_ms: int, ttl_ms: int, most_s: int) -> int:
    """When a caller refused because no provider of the model takes runs should try again, in whole
    seconds: when the first bench ends, if a bench is all that keeps each of them out (they take runs
    then, probes or not); else in 1 s (a probe may find one back at any moment). At most `most_s`."""
    ends = []
    for s in snapshots:
        back = replace(s, benched=False)
        if not s.benched or s.bench_until_ms is None or s.drained or not is_available(back, now_ms, ttl_ms):
            return 1
        ends.append(s.bench_until_ms)
    return min(max(1, -(-(min(ends) - now_ms) // 1000)), most_s) if ends else 1


def has_free_slot(snap: ProviderSnapshot) -> bool:
    capacity = snap.effective_capacity
    return capacity is not None and snap.in_flight < capacity


def candidate_class(snap: ProviderSnapshot, now_ms: int, ttl_ms: int, avoid: frozenset[str] = frozenset(),
                    exclude: frozenset[str] = frozenset()) -> int | None:
    """Whether a provider may take a run whatever its load: 0 (yes), 1 (only when no class-0
    provider has a free slot: the run failed there before) or None (no: not available, drained,
    or excluded). With `_rank`, the whole policy: the dispatch script applies the same two to the
    live state when it reserves the slot (`common.scripts.DISPATCH`)."""
    if not is_available(snap, now_ms, ttl_ms) or snap.drained or snap.provider_id in exclude:
        return None
    return 1 if snap.provider_id in avoid else 0


#: `why_not` of a provider that would take a run now
FREE_NOW = "has a free slot now"


def why_not(snap: ProviderSnapshot, now_ms: int, ttl_ms: int) -> str:
    """Why a provider takes no run now, in a few words (for a run that timed out in its queue):
    `no heartbeat`, `unavailable`, `missing the model`, `benched` (with why, for a busy one), `drained or
    cordoned`, `capacity 0`, or
    `full (n of c)` (it may be free by the time this is read)."""
    if snap.beats_from is not None:
        return f"its heartbeat comes from node {snap.beats_from}, not this config's"
    if not is_fresh(snap, now_ms, ttl_ms):
        return "no heartbeat"
    if snap.health is not Health.AVAILABLE:
        return snap.health.value
    if not snap.has_model:
        return "missing the model"
    if snap.benched:
        return "benched: it answered too busy or out of quota (429, 503, 402, key limit)" if snap.busy else "benched"
    if snap.drained:
        return "drained or cordoned"
    capacity = snap.effective_capacity
    if not capacity:
        return "capacity 0"
    return f"full ({snap.in_flight} of {capacity})" if snap.in_flight >= capacity else FREE_NOW


def _rank(snap: ProviderSnapshot) -> tuple[Fraction, int, str]:
    capacity = snap.effective_capacity
    assert capacity
    return (Fraction(snap.in_flight, capacity), -capacity, snap.provider_id)


def select_provider(
    snapshots: Iterable[ProviderSnapshot], now_ms: int, ttl_ms: int, avoid: frozenset[str] = frozenset(),
    exclude: frozenset[str] = frozenset(),
) -> ProviderSnapshot | None:
    """The provider a run should go to now, or None if no provider can take it: among those with a
    class and a free slot, the lowest class, then the lowest rank."""
    ranked = [(cls, _rank(s), s) for s in snapshots
              if (cls := candidate_class(s, now_ms, ttl_ms, avoid, exclude)) is not None and has_free_slot(s)]
    return min(ranked, key=lambda r: (r[0], r[1]))[2] if ranked else None
