"""Reading provider snapshots (heartbeat + live leases) from Redis in one round trip."""

from __future__ import annotations

from collections.abc import Sequence

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


async def read_snapshots(redis: Redis, provider_ids: Sequence[str], now_ms: int) -> list[ProviderSnapshot]:
    """One pipeline: each provider's heartbeat fields and its count of live leases."""
    pipe = redis.pipeline(transaction=False)
    for pid in provider_ids:
        pipe.hmget(keys.heartbeat(pid), "health", "capacity", "ts_ms")
        pipe.zcount(keys.leases(pid), f"({now_ms}", "+inf")
    replies = await pipe.execute()
    snaps = []
    for i, pid in enumerate(provider_ids):
        health, capacity, ts = replies[2 * i]
        snaps.append(ProviderSnapshot(
            provider_id=pid,
            health=_health(health),
            capacity=_int(capacity),
            in_flight=int(replies[2 * i + 1]),
            heartbeat_ms=_int(ts),
        ))
    return snaps
