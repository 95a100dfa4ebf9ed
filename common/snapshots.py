"""Reading provider snapshots (heartbeat, live leases, operator control) from Redis in one round trip."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from redis.asyncio import Redis

from common import keys
from common.policy import Health, ProviderSnapshot, capacity_override, why_not
from common.redisconn import REDIS_UNUSABLE


def _health(value: bytes | None) -> Health:
    try:
        return Health(value.decode()) if value else Health.UNKNOWN
    except ValueError:
        return Health.UNKNOWN


def _int(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _lists(observed: bytes | None, served: str) -> bool:
    """Whether a provider's observed model list allows `served` (no list: assume it does)."""
    if not observed:
        return True
    try:
        names = json.loads(observed)
    except ValueError:
        return True
    return not isinstance(names, list) or served in names


async def read_snapshots(redis: Redis, targets: Mapping[str, str], now_ms: int,
                         node_of: Callable[[str], str]) -> list[ProviderSnapshot]:
    """One pipeline: each provider's heartbeat fields (its bench for the model's served name there
    too), its count of live leases, and what an operator set for it (a drain, its node's cordon, a
    capacity override). A heartbeat its config places on another node counts as none.

    targets: provider id -> the served name the model has there; node_of: provider id -> its node."""
    pipe = redis.pipeline(transaction=False)
    for pid, served in targets.items():
        pipe.hmget(keys.heartbeat(pid), "health", "capacity", "ts_ms", "observed_models", keys.BENCH_FIELD + served,
                   "node", keys.BUSY_FIELD + served)
        pipe.zcount(keys.leases(pid), f"({now_ms}", "+inf")
        # (one MGET, as the dispatch scripts read them: a key of another type, written by hand, is none)
        pipe.mget(keys.drained(pid), keys.cordoned(node_of(pid)), keys.capacity_override(pid))
    replies = await pipe.execute()
    snaps = []
    for i, (pid, served) in enumerate(targets.items()):
        beat, in_flight, (drain, cordon, override) = replies[3 * i:3 * i + 3]
        health, capacity, ts, observed, bench, node, busy = beat
        # (a heartbeat from another node than the config's: the provider moved there in a config this
        # reader does not run yet; as no heartbeat, it keeps a run waiting, not sent where it is not)
        beats_from = node.decode(errors="replace") if node is not None else None
        here = beats_from is None or beats_from == node_of(pid)
        snaps.append(ProviderSnapshot(
            provider_id=pid,
            health=_health(health),
            capacity=_int(capacity),
            in_flight=int(in_flight),
            heartbeat_ms=_int(ts) if here else None,
            has_model=_lists(observed, served),
            drained=drain is not None or cordon is not None,
            capacity_override=capacity_override(override),
            benched=(_int(bench) or 0) > now_ms,
            bench_until_ms=_int(bench),
            busy=bench is not None and busy == bench,
            beats_from=None if here else beats_from,
        ))
    return snaps


#: what a provider whose adapter would refuse a run is, for that run (`gateway.refusals`)
WOULD_REFUSE = "would refuse the request"
#: what a provider the run never goes to again is, for that run (it answered it a 5xx, a 429 or a
#: redirect, or refused it as unable, or a retry that goes only elsewhere left it)
NOT_AGAIN = "not asked again after it failed this run"


def each_why(snaps: list[ProviderSnapshot], now_ms: int, ttl_ms: int, refuse: frozenset[str] = frozenset(),
             excluded: frozenset[str] = frozenset()) -> str:
    """` (vllm-a: drained or cordoned, vllm-b: full (4 of 4))`: what each provider says now
    (`common.policy.why_not`; those in `refuse`: that they would refuse the run; those in `excluded`,
    that the run failed there and never goes back: not that it has a free slot), in the order of
    their ids; '' for none."""
    ordered = sorted(snaps, key=lambda s: s.provider_id)
    shown = ", ".join(f"{s.provider_id}: " + (WOULD_REFUSE if s.provider_id in refuse else NOT_AGAIN
                                               if s.provider_id in excluded else why_not(s, now_ms, ttl_ms))
                      for s in ordered)
    return f" ({shown})" if shown else ""


async def why_none(redis: Redis, targets: Mapping[str, str], now_ms: int, node_of: Callable[[str], str],
                   ttl_ms: int, refuse: frozenset[str] = frozenset(), excluded: frozenset[str] = frozenset()) -> str:
    """`each_why` of a model's providers read now, for a run that none took (so a caller and an
    operator see the drain, the cordon or the health behind it); '' if Redis cannot say."""
    try:
        snaps = await read_snapshots(redis, targets, now_ms, node_of)
    except REDIS_UNUSABLE:
        return ""
    return each_why(snaps, now_ms, ttl_ms, refuse, excluded)
