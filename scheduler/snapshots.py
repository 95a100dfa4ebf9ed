"""Reading provider snapshots (heartbeat + live leases) from Redis in one round trip."""

from __future__ import annotations

import json
from collections.abc import Mapping

from redis.asyncio import Redis

from common import keys
from common.policy import Health, ProviderSnapshot


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


async def read_snapshots(redis: Redis, targets: Mapping[str, str], now_ms: int) -> list[ProviderSnapshot]:
    """One pipeline: each provider's heartbeat fields and its count of live leases.

    targets: provider id -> the served name the model has there."""
    pipe = redis.pipeline(transaction=False)
    for pid in targets:
        pipe.hmget(keys.heartbeat(pid), "health", "capacity", "ts_ms", "observed_models")
        pipe.zcount(keys.leases(pid), f"({now_ms}", "+inf")
    replies = await pipe.execute()
    snaps = []
    for i, (pid, served) in enumerate(targets.items()):
        health, capacity, ts, observed = replies[2 * i]
        snaps.append(ProviderSnapshot(
            provider_id=pid,
            health=_health(health),
            capacity=_int(capacity),
            in_flight=int(replies[2 * i + 1]),
            heartbeat_ms=_int(ts),
            has_model=_lists(observed, served),
        ))
    return snaps
