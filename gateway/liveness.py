"""The gateway says it lives, so that a scheduler can cancel the runs of a dead gateway's callers
(the `orphans` script): its `keys.gateway_alive` key kept fresh, and its id in `keys.GATEWAYS`
(a gateway the hash does not name is presumed alive, whatever its key)."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.redisconn import now_ms

log = logging.getLogger("iop.gateway")


async def beat(redis: Redis, gateway_id: str, ttl_ms: int) -> None:
    """Refresh the liveness key (`PEXPIRE`, which Redis takes even when full); when it is not
    there (the first beat, a Redis that restarted empty, a gateway that stalled past its TTL), set
    it anew; and name the gateway in the hash whenever it is not."""
    alive = keys.gateway_alive(gateway_id)
    if not await redis.pexpire(alive, ttl_ms):
        await redis.set(alive, now_ms(), px=ttl_ms)
        await redis.hset(keys.GATEWAYS, gateway_id, now_ms())
    elif not await redis.hexists(keys.GATEWAYS, gateway_id):  # (its naming failed, or a scheduler
        await redis.hset(keys.GATEWAYS, gateway_id, now_ms())  # forgot it as it set its key anew)


async def beat_forever(redis: Redis, gateway_id: str, ttl_ms: int) -> None:
    """Beat every third of `ttl_ms` until cancelled; Redis out of reach is logged, not fatal."""
    while True:
        try:
            await beat(redis, gateway_id, ttl_ms)
        except (RedisError, OSError) as exc:
            log.warning("could not say the gateway lives (its callers' runs are cancelled if this lasts "
                        "runtime.gateway_liveness_ms, %d ms): %s", ttl_ms, exc)
        await asyncio.sleep(ttl_ms / 3000)


async def forget(redis: Redis, gateway_id: str) -> None:
    """A gateway that stops: no longer named (its runs are its own to end, at its stop)."""
    try:
        await redis.hdel(keys.GATEWAYS, gateway_id)
        await redis.delete(keys.gateway_alive(gateway_id))
    except (RedisError, OSError) as exc:
        log.warning("could not forget the gateway: %s", exc)
