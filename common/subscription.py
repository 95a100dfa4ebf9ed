"""The messages of a Redis pub/sub subscription, with a connection that died in silence noticed.

A subscribed connection only ever reads, so nothing tells it that its peer is gone: a NAT or a load
balancer that dropped an idle mapping, or a network path cut with both ends up, leaves it waiting
for messages that go nowhere while Redis, which still sees the connection (or a proxy's), goes on
publishing to it. A PING after every quiet spell asks for an answer; none within the reply timeout
and the subscription is dead: redis-py's TimeoutError is raised, which callers treat as Redis away
(they subscribe again on a new connection, and catch up on what they may have missed). A connection
that broke and that redis-py's retry made again and subscribed again by itself raises a
ConnectionError too: what was published in between went to nobody, and the caller must catch up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redisline import REPLY_TIMEOUT_S

#: How long a subscription may hear nothing before it asks Redis for a sign of life (a PING).
QUIET_S = 5.0


class _Reconnects:
    """Counts the connects of a subscription's connection after the first (redis-py's retry makes
    the connection again and subscribes again by itself, without a word to the listener)."""

    def __init__(self) -> None:
        self.count = 0

    def connected(self, _connection: Any) -> None:
        self.count += 1


async def subscribe(pubsub: PubSub, *channels: str, reply_s: float | None = None) -> None:
    """Subscribe `pubsub` to `channels`, and return once Redis has applied it. redis-py's own
    `subscribe` returns as soon as the command is sent, so a look at Redis on another connection
    right after it may be answered first, and what is published between the two then reaches
    nobody (a worker's cancel went unheard till its lease's renewal). Redis sends one confirmation
    a channel, in order, before anything published after it. None within `reply_s` (the pool's
    reply timeout by default): RedisTimeoutError."""
    await pubsub.subscribe(*channels)
    left = len(set(channels))
    reply = _reply_s(pubsub, reply_s)
    try:
        async with asyncio.timeout(reply):  # (redis-py's own wait can swallow a cancellation)
            while left:
                message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=None)
                if message is not None and message["type"] == "subscribe":
                    left -= 1
    except TimeoutError:
        raise RedisTimeoutError(f"Redis did not confirm a subscription within {reply:g} s") from None


def _reply_s(pubsub: PubSub, reply_s: float | None) -> float:
    return float(reply_s or pubsub.connection_pool.connection_kwargs.get("socket_timeout") or REPLY_TIMEOUT_S)


async def messages(pubsub: PubSub, *, quiet_s: float | None = None,
                   reply_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
    """Each message published on `pubsub`'s channels, in order (subscribe first, with `subscribe`). After `quiet_s`
    (`QUIET_S` by default) with none, a PING; if nothing at all comes within `reply_s` after it
    (the pool's reply timeout, a URL's `?socket_timeout=`, by default), RedisTimeoutError. Once
    its connection was made again, RedisConnectionError."""
    quiet = QUIET_S if quiet_s is None else quiet_s
    reply = _reply_s(pubsub, reply_s)
    reconnects = _Reconnects()
    connection = pubsub.connection
    if connection is not None:  # (a method, which redis-py holds weakly: `reconnects` lives as long as this)
        connection.register_connect_callback(reconnects.connected)
    pinged_at: float | None = None
    try:
        while True:
            wait = quiet if pinged_at is None else max(0.0, pinged_at + reply - time.monotonic())
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
            if reconnects.count:  # (what was published while it was down went to nobody: say so)
                raise RedisConnectionError("the subscription's connection broke (redis-py made it again: what was "
                                           "published meanwhile is lost)")
            if message is None:
                if pinged_at is None:
                    await pubsub.ping()
                    pinged_at = time.monotonic()
                elif time.monotonic() >= pinged_at + reply:
                    raise RedisTimeoutError(f"Redis did not answer a PING on a subscription within {reply:g} s")
                continue
            pinged_at = None  # (anything from Redis shows the connection alive)
            if message["type"] != "pong":
                yield message
    finally:
        if connection is not None:
            connection.deregister_connect_callback(reconnects.connected)
