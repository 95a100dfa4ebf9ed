"""Redis connections for the services: reconnect by themselves, with backoff."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: What a lost or restarting Redis raises; services back off and go on.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def client_options() -> dict[str, Any]:
    """What every service's Redis connections add to their URL: retry a dropped command a few
    times with exponential backoff, a connect timeout, TCP keepalive. Everything else, TLS
    included (`rediss://…?ssl_ca_certs=…`), comes from the URL, the same for every service."""
    return {
        "decode_responses": False,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.02), retries=3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "socket_connect_timeout": 2.0,
        "socket_keepalive": True,
        "health_check_interval": 0,
    }


def connect(url: str, *, max_connections: int | None = None) -> Redis:
    """A client with `client_options`."""
    return Redis.from_url(url, max_connections=max_connections, **client_options())


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
