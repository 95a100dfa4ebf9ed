"""The gateway's Redis connections: a bounded pool that closes the connections it stopped needing.

A caller that waits for its run holds one pooled connection at a time (a blocking XREAD), so a
pool as large as `runtime.max_connections` (`runtime.redis_max_connections`, the same by default)
never makes a caller wait for one. A smaller pool spares Redis's `maxclients`; requests beyond it
then take turns, first come first served, and one that waits longer than `POOL_WAIT_S` gets 503
`service_unavailable`. After a burst, every connection left unused for a whole
`runtime.idle_timeout_ms` is closed, so the pool shrinks back to what the load needs.

With a Sentinel URL the same pool is built over redis-py's Sentinel-managed pool
(`SentinelTrimmedPool`): each new connection goes to the primary the sentinels name, and after a
failover the idle connections to the old primary are dropped as soon as one reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from common.redisconn import SentinelPool, connection_pool
from common.redisline import LinedPool

log = logging.getLogger("iop.gateway")

#: How long a request waits for a free pooled connection before it gets 503.
POOL_WAIT_S = 5.0


class TrimmedPool(LinedPool):
    """At most `max_connections` connections, handed out in the order they were asked for (a
    fair semaphore: redis-py's blocking pool lets a task that releases and asks again at once
    starve the others), and closed once unused for a while (`trim`)."""

    _available_connections: list[AbstractConnection]  # the pool's own, most recently released last
    _in_use_connections: set[AbstractConnection]
    _lock: asyncio.Lock

    def __init__(self, *args: Any, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, max_connections=max_connections, **kwargs)
        self._turns = asyncio.Semaphore(max_connections)
        self._released_at: weakref.WeakKeyDictionary[AbstractConnection, float] = weakref.WeakKeyDictionary()

    async def get_connection(self, *_: Any, **__: Any) -> AbstractConnection:
        """redis-py's own steps, after waiting for a turn; every way out gives the turn back."""
        try:
            async with asyncio.timeout(POOL_WAIT_S):
                await self._turns.acquire()
        except TimeoutError:
            raise RedisConnectionError(f"no Redis connection became free within {POOL_WAIT_S:g} s "
                                       f"(runtime.redis_max_connections = {self.max_connections})") from None
        try:
            async with self._lock:
                connection: AbstractConnection = self.get_available_connection()
        except BaseException:
            self._turns.release()
            raise
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        self._released_at[connection] = time.monotonic()
        try:
            await super().release(connection)
        finally:
            self._turns.release()

    @property
    def open_connections(self) -> int:
        return len(self._available_connections) + len(self._in_use_connections)

    async def trim(self, idle_s: float) -> int:
        """Close the connections that nobody took since at least `idle_s` ago; returns how many."""
        cutoff = time.monotonic() - idle_s
        idle = [c for c in self._available_connections if self._released_at.get(c, cutoff) <= cutoff]
        if idle:
            closing = set(idle)
            self._available_connections[:] = [c for c in self._available_connections if c not in closing]
        await asyncio.gather(*(c.disconnect() for c in idle), return_exceptions=True)
        return len(idle)


class SentinelTrimmedPool(TrimmedPool, SentinelPool):
    """A `TrimmedPool` of connections to the primary that the sentinels name."""


def gateway_redis(url: str, max_connections: int) -> tuple[Redis, TrimmedPool]:
    """The gateway's client over a pool of at most `max_connections` connections."""
    pool: TrimmedPool = connection_pool(url, max_connections=max_connections, pool_class=TrimmedPool,
                                        sentinel_pool_class=SentinelTrimmedPool, client_name="iop-gateway")
    return Redis.from_pool(pool), pool


async def trim_forever(pool: TrimmedPool, idle_s: float) -> None:
    """Every half `idle_s`, close the connections unused for `idle_s`."""
    while True:
        await asyncio.sleep(idle_s / 2)
        closed = await pool.trim(idle_s)
        if closed:
            log.info("closed %d idle Redis connections (%d left open)", closed, pool.open_connections)
