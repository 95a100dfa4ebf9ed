"""Redis connections for the services: reconnect by themselves, with backoff."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: What a lost or restarting Redis raises; services back off and go on.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def connect(url: str, *, max_connections: int | None = None) -> Redis:
    """A client that retries a dropped command a few times with exponential backoff."""
    return Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.02), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        socket_connect_timeout=2.0,
        socket_keepalive=True,
        health_check_interval=0,
        max_connections=max_connections,
    )


class Backoff:
    """The pause between retries while Redis is away: doubles from `first` up to `cap`,
    and starts over after a success (`reset`)."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def reset(self) -> None:
        self.delay = self.first

    async def pause(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def text(value: bytes | str | None) -> str | None:
    """Decode a Redis reply that holds a plain string."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def as_text_map(raw: dict[bytes, bytes]) -> dict[str, str]:
    """HGETALL reply of a plain-string hash, decoded."""
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
