"""The messages of a Redis pub/sub subscription, with a connection that died in silence noticed.

A subscribed connection only ever reads, so nothing tells it that its peer is gone: a NAT or a load
balancer that dropped an idle mapping, or a network path cut with both ends up, leaves it waiting
for messages that go nowhere while Redis, which still sees the connection (or a proxy's), goes on
publishing to it. A PING after every quiet spell asks for an answer; none within the reply timeout
and the subscription is dead: redis-py's TimeoutError is raised, which callers treat as Redis away
(they subscribe again on a new connection, and catch up on what they may have missed)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redisline import REPLY_TIMEOUT_S

#: How long a subscription may hear nothing before it asks Redis for a sign of life (a PING).
QUIET_S = 5.0


async def messages(pubsub: PubSub, *, quiet_s: float | None = None,
                   reply_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
    """Each message published on `pubsub`'s channels, in order (subscribe first). After `quiet_s`
    (`QUIET_S` by default) with none, a PING; if nothing at all comes within `reply_s` after it
    (the pool's reply timeout, a URL's `?socket_timeout=`, by default), RedisTimeoutError."""
    if quiet_s is None:
        quiet_s = QUIET_S
    if reply_s is None:
        reply_s = float(pubsub.connection_pool.connection_kwargs.get("socket_timeout") or REPLY_TIMEOUT_S)
    pinged_at: float | None = None
    while True:
        wait = quiet_s if pinged_at is None else max(0.0, pinged_at + reply_s - time.monotonic())
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
        if message is None:
            if pinged_at is None:
                await pubsub.ping()
                pinged_at = time.monotonic()
            elif time.monotonic() >= pinged_at + reply_s:
                raise RedisTimeoutError(f"Redis did not answer a PING on a subscription within {reply_s:g} s")
            continue
        pinged_at = None  # (anything from Redis shows the connection alive)
        if message["type"] != "pong":
            yield message
