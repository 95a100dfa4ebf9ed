"""A subscription whose connection died in silence is noticed (`common.subscription`), and the
worker's cancel listener subscribes again and catches up on the cancels it did not hear. Real
Redis, real TCP: a relay that turns open connections into black holes (`tests.blackhole`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
import redis as sync_redis
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys, subscription
from common.comeback import Comeback
from common.redisconn import KEEPALIVE, Backoff, connect
from common.redisline import line_of
from common.subscription import messages
from iop.embedded_redis import RedisServer
from tests.blackhole import Blackhole
from tests.conftest import async_wait_until, paused
from workers import service
from workers.runner import Runner


@pytest.fixture
def hole(redis_server: RedisServer) -> Iterator[Blackhole]:
    relay = Blackhole("127.0.0.1", redis_server.port)
    yield relay
    relay.close()


@pytest.fixture
async def via_hole(hole: Blackhole) -> AsyncIterator[Redis]:
    client = connect(hole.url() + "/0?socket_timeout=1")
    yield client
    await client.aclose()


async def _subscribed(r: sync_redis.Redis, channel: str, n: int) -> None:
    """Redis counts `n` subscribers of `channel` (SUBSCRIBE is not answered before it takes effect,
    and through the relay it may still be on its way)."""
    await async_wait_until(lambda: asyncio.to_thread(lambda: r.pubsub_numsub(channel)[0][1] == n),
                           what=f"{n} subscribers of {channel}")


def _pings(url: str) -> int:
    with sync_redis.Redis.from_url(url) as r:
        return int(r.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))


async def test_a_quiet_subscription_pings_and_lives_on_and_a_message_still_arrives(
        redis_url: str, via_hole: Redis) -> None:
    pubsub = via_hole.pubsub()
    await pubsub.subscribe("news")
    got = asyncio.ensure_future(anext(messages(pubsub, quiet_s=0.05)))
    try:
        before = _pings(redis_url)
        await async_wait_until(lambda: asyncio.to_thread(lambda: _pings(redis_url) >= before + 3),
                               what="three quiet spells, each with a PING")
        assert not got.done()  # (answered: no error, and no pong handed over as a message)
        with sync_redis.Redis.from_url(redis_url) as r:
            assert r.publish("news", b"hello") == 1
        message = await asyncio.wait_for(got, 10)
        assert (message["channel"], message["data"]) == (b"news", b"hello")
    finally:
        got.cancel()
        await pubsub.aclose()


async def test_a_subscription_whose_connection_turned_into_a_black_hole_fails(
        redis_url: str, hole: Blackhole, via_hole: Redis) -> None:
    pubsub = via_hole.pubsub()
    await pubsub.subscribe("news")
    stream = messages(pubsub, quiet_s=0.05)
    try:
        with sync_redis.Redis.from_url(redis_url) as r:
            await _subscribed(r, "news", 1)
            r.publish("news", b"one")
            first = await asyncio.wait_for(anext(stream), 10)
            assert first["data"] == b"one"
            assert hole.cut() >= 1
            # Redis still has the subscriber (the relay holds its end), and publishes to nobody
            assert r.publish("news", b"two") == 1
        with pytest.raises(RedisTimeoutError, match="did not answer a PING on a subscription within 1 s"):
            await asyncio.wait_for(anext(stream), 10)
    finally:
        await pubsub.aclose()


async def test_a_subscription_to_a_redis_that_stopped_answering_fails(own_redis: RedisServer) -> None:
    client = connect(own_redis.url + "?socket_timeout=1")
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe("news")
        with paused(own_redis), pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(anext(messages(pubsub, quiet_s=0.05)), 10)
    finally:
        await pubsub.aclose()
        await client.aclose()


class _Attempt:
    def __init__(self) -> None:
        self.cancelled: object | None = None
        self.model_id = "m"

    def log(self) -> dict[str, str]:
        return {"model": self.model_id, "provider": "a"}


class _Comeback:
    """What the cancel listener uses of the worker's `Comeback`: its pause, counted (each a lost
    subscription), as long as the backoff's."""

    def __init__(self) -> None:
        self.losses = 0

    async def pause(self, backoff: Backoff) -> None:
        self.losses += 1
        await backoff.pause()


class _Runner:
    """What the cancel listener uses of a `Runner`: its runs, its Redis, and `cancel`."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.running: dict[str, tuple[_Attempt, Any]] = {}
        self.cancels: list[str] = []
        #: the worker's watch for Redis answering again, as the listener uses it
        self.comeback = _Comeback()

    async def why_cancelled(self, run_id: str) -> object:
        return "why"

    def heard_cancel(self, run_id: str) -> None:  # (a cancel of a run not running here: kept, `Runner.heard_cancel`)
        return None

    def cancel(self, run_id: str, why: object) -> bool:
        self.cancels.append(run_id)
        self.running[run_id][0].cancelled = why
        return True


@asynccontextmanager
async def listening(runner: _Runner) -> AsyncIterator[tuple[str, asyncio.Future[None]]]:
    """The worker's cancel listener of node-a, on `runner`, for the block: (its channel, its task)."""
    task = asyncio.ensure_future(service._listen_cancels(cast(Runner, runner), "node-a",
                                                         cast(Comeback, runner.comeback)))
    try:
        yield keys.node_cancel("node-a"), task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@asynccontextmanager
async def listening_at(redis_url: str) -> AsyncIterator[tuple[_Runner, sync_redis.Redis, str, asyncio.Future[None]]]:
    """`listening` on a runner of its own over a client of `redis_url`, with a plain client beside:
    (the runner, the plain client, the channel, the listener's task)."""
    client = connect(redis_url)
    runner = _Runner(client)
    try:
        with sync_redis.Redis.from_url(redis_url) as r:
            async with listening(runner) as (channel, task):
                yield runner, r, channel, task
    finally:
        await client.aclose()


async def heard(runner: _Runner, *run_ids: str) -> None:
    await async_wait_until(lambda: asyncio.sleep(0, runner.cancels[-len(run_ids):] == list(run_ids)),
                           what=f"cancels of {run_ids} heard")


async def test_the_cancel_listener_subscribes_again_and_cancels_what_it_did_not_hear(
        redis_url: str, hole: Blackhole, via_hole: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscription, "QUIET_S", 0.05)
    runner = _Runner(via_hole)
    with sync_redis.Redis.from_url(redis_url) as r:
        async with listening(runner) as (channel, _):
            await _subscribed(r, channel, 1)
            runner.running["run_heard"] = (_Attempt(), None)
            r.publish(channel, b"run_heard")
            await heard(runner, "run_heard")
            assert runner.comeback.losses == 0

            hole.cut()
            runner.running["run_unheard"] = (_Attempt(), None)
            r.hset(keys.run_record("run_unheard"), "cancel", "1")
            assert r.publish(channel, b"run_unheard") == 1  # (to the dead subscription: lost)
            # the dead subscription is noticed, a new one made, and the run's record read
            await _subscribed(r, channel, 2)  # (the dead one still counted by Redis)
            await heard(runner, "run_heard", "run_unheard")
            assert runner.comeback.losses >= 1  # (the heartbeats beat once Redis answers: it may have lost them)
            runner.running["run_later"] = (_Attempt(), None)
            r.publish(channel, b"run_later")
            await heard(runner, "run_later")


async def test_every_connection_to_redis_has_short_tcp_keepalive(redis_url: str) -> None:
    client = connect(redis_url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe("news")
        line = line_of(client)
        assert line is not None
        await line.execute("PING")
        assert line._link is not None
        conn = await client.connection_pool.get_connection()
        try:
            socks = [c._writer.get_extra_info("socket") for c in (conn, pubsub.connection, line._link.conn)]
        finally:
            await client.connection_pool.release(conn)
        for sock in socks:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            for name, value in KEEPALIVE.items():
                assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name)) == value, name
    finally:
        await pubsub.aclose()
        await client.aclose()


def _following(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set when the cancel listener starts to read its subscription's messages."""
    following = asyncio.Event()
    real = subscription.messages

    def noted(pubsub: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        following.set()
        return real(pubsub, **kwargs)

    monkeypatch.setattr(service, "messages", noted)
    return following


async def test_a_subscription_redis_py_made_again_by_itself_still_catches_up(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found by a review: a connection that broke (a failover, a proxy's reset, `CLIENT KILL`) was
    made again and subscribed again by redis-py's retry without a word, so the listener never
    caught up on the cancel published in between (left to the lease renewal, or to a PING that
    happened to fail). The quiet spell before a PING is made long here: it is not what notices."""
    monkeypatch.setattr(subscription, "QUIET_S", 60.0)
    caplog.set_level(logging.WARNING, "iop.worker")
    following = _following(monkeypatch)
    async with listening_at(redis_url) as (runner, r, channel, _):
        await asyncio.wait_for(following.wait(), 10)  # (its subscription made, and its look taken)
        runner.running["run_unheard"] = (_Attempt(), None)
        # (the test's loop waits on these calls: the cancel goes out while nobody listens)
        assert r.client_kill_filter(_type="pubsub") == 1
        r.hset(keys.run_record("run_unheard"), "cancel", "1")
        assert r.publish(channel, b"run_unheard") == 0
        await heard(runner, "run_unheard")
        said = [record.getMessage() for record in caplog.records]
        assert said == ["cancel listener: Redis unavailable (the subscription's connection broke (redis-py "
                        "made it again: what was published meanwhile is lost)); subscribing again"], said
        runner.running["run_later"] = (_Attempt(), None)
        await _subscribed(r, channel, 1)
        r.publish(channel, b"run_later")
        await heard(runner, "run_later")


async def test_the_cancel_listener_outlives_an_error_reply(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis whose snapshot failed (MISCONF) answers even a subscription's PING with an error: the
    listener's task ended with it, and the worker heard no cancel again."""
    calls = 0

    async def refusing_once(pubsub: Any) -> AsyncIterator[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
                                "persist to disk")
        async for message in subscription.messages(pubsub):
            yield message

    monkeypatch.setattr(service, "messages", refusing_once)
    async with listening_at(redis_url) as (runner, r, channel, task):
        await async_wait_until(lambda: asyncio.sleep(0, calls == 2), what="subscribed again after the error")
        runner.running["run_later"] = (_Attempt(), None)
        r.publish(channel, b"run_later")
        await heard(runner, "run_later")
        assert not task.done()


async def test_a_stray_message_does_not_end_the_cancel_listener(redis_url: str) -> None:
    """Found by a review: a message that is not UTF-8 on the node's cancel channel ended the
    listener's task, and the worker never heard a cancel again."""
    async with listening_at(redis_url) as (runner, r, channel, task):
        await _subscribed(r, channel, 1)
        r.publish(channel, b"\xff\xfe")  # (not a run id)
        runner.running["run_later"] = (_Attempt(), None)
        r.publish(channel, b"run_later")
        await heard(runner, "run_later")
        assert not task.done()


async def _sent(hole: Blackhole, since: int, what: bytes) -> None:
    """`what` went into the relay after its first `since` bytes (a command sent, maybe held there)."""
    await async_wait_until(lambda: asyncio.sleep(0, what in bytes(hole.received[since:])), what=f"{what!r} sent")


async def test_subscribe_returns_once_redis_applied_the_subscription(
        redis_url: str, hole: Blackhole, via_hole: Redis) -> None:
    """redis-py's own `subscribe` returns once the command is sent; `subscription.subscribe` only
    once Redis confirmed each channel, so that what is published after it reaches the subscriber."""
    pubsub = via_hole.pubsub()
    try:
        await subscription.subscribe(pubsub, "warm")
        since = len(hole.received)
        hole.hold(b"news")
        pubsub2 = via_hole.pubsub()
        done = asyncio.ensure_future(subscription.subscribe(pubsub2, "news", "more", "news"))
        try:
            await _sent(hole, since, b"SUBSCRIBE")
            with sync_redis.Redis.from_url(redis_url) as r:
                assert r.publish("news", b"lost") == 0  # (not applied yet: held on its way)
                assert not done.done()
                hole.release()
                await asyncio.wait_for(done, 10)
                assert r.publish("news", b"heard") == 1
            message = await asyncio.wait_for(anext(messages(pubsub2)), 10)
            assert (message["channel"], message["data"]) == (b"news", b"heard")
        finally:
            done.cancel()
            await pubsub2.aclose()
    finally:
        hole.release()
        await pubsub.aclose()


async def test_subscribe_unconfirmed_within_the_reply_timeout_fails(hole: Blackhole, via_hole: Redis) -> None:
    hole.hold(b"SUBSCRIBE")
    pubsub = via_hole.pubsub()
    try:
        with pytest.raises(RedisTimeoutError, match="Redis did not confirm a subscription within 0.2 s"):
            await asyncio.wait_for(subscription.subscribe(pubsub, "news", reply_s=0.2), 10)
    finally:
        hole.release()
        await pubsub.aclose()


async def test_a_cancel_published_while_the_subscription_is_on_its_way_is_heard(
        redis_url: str, hole: Blackhole, via_hole: Redis) -> None:
    """Found in CI (a fault test's flake): the cancel listener subscribed and at once read the
    runs' records on another connection, which Redis may answer before it applies SUBSCRIBE: a
    cancel set and published in between reached nobody and was read nowhere, till the lease's
    renewal. Here the subscription is held on its way while the cancel goes out."""
    runner = _Runner(via_hole)
    runner.running["run_early"] = (_Attempt(), None)
    since = len(hole.received)
    hole.hold(b"SUBSCRIBE")
    try:
        with sync_redis.Redis.from_url(redis_url) as r:
            async with listening(runner) as (channel, _):
                await _sent(hole, since, b"SUBSCRIBE")
                r.hset(keys.run_record("run_early"), "cancel", "1")
                assert r.publish(channel, b"run_early") == 0  # (nobody subscribed yet)
                hole.release()
                await heard(runner, "run_early")
                assert runner.comeback.losses == 0
    finally:
        hole.release()
