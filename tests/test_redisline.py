"""`common.redisline`: many commands in flight over one connection, against a real Redis."""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import AsyncIterator
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redisconn import client_options, connect
from common.redisline import BIG_ARGUMENT, Line, line_of, new_line_of, pack_command
from common.scripts import SHAS, Scripts
from iop.embedded_redis import RedisServer
from tests.conftest import async_wait_until, paused


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    r = connect(redis_url, client_name="iop-line-test")
    yield r
    await r.aclose()


def line(client: Redis) -> Line:
    found = line_of(client)
    assert found is not None
    return found


async def named_connections(client: Redis, name: str = "iop-line-test") -> int:
    return sum(1 for c in await client.client_list() if c.get("name") == name)


ARGUMENTS = st.one_of(st.binary(max_size=2 * BIG_ARGUMENT), st.text(max_size=200), st.integers(),
                      st.floats(allow_nan=False))


@given(st.lists(ARGUMENTS, max_size=12))
def test_a_command_is_packed_as_redis_py_packs_it(args: list[object]) -> None:
    command = ("EVALSHA", *args)
    assert b"".join(pack_command(command)) == b"".join(Connection().pack_command(*command))


def test_an_argument_of_no_redis_type_is_refused_as_redis_py_refuses_it() -> None:
    for bad in (True, None, [1], {"a": 1}):
        with pytest.raises(DataError):
            pack_command(("SET", "k", bad))


async def test_a_client_made_from_a_url_has_lines(redis_url: str) -> None:
    """(A URL that asks for RESP3, whose replies the lines and the services' readers do not take,
    is refused: test_redisconn.)"""
    plain = connect(redis_url)
    try:
        assert line_of(plain) is not None and new_line_of(plain, "test") is not None
        assert await Scripts(plain).call("watch", ["iop:run:none"], ["gw"]) == 0
    finally:
        await plain.aclose()


async def test_each_caller_gets_its_own_reply_and_an_error_reply_only_its_own(client: Redis) -> None:
    lined = line(client)

    async def echo(i: int) -> bytes:
        if i % 50 == 7:
            return await lined.execute("INCR", "not-a-number")  # type: ignore[no-any-return]
        return await lined.execute("ECHO", f"reply {i}")  # type: ignore[no-any-return]

    await client.set("not-a-number", "x")
    replies = await asyncio.gather(*(echo(i) for i in range(500)), return_exceptions=True)
    for i, reply in enumerate(replies):
        if i % 50 == 7:
            assert isinstance(reply, ResponseError) and "not an integer" in str(reply)
        else:
            assert reply == f"reply {i}".encode()


async def test_commands_of_many_tasks_share_one_connection(client: Redis) -> None:
    lined = line(client)
    await asyncio.gather(*(lined.execute("INCR", "n") for _ in range(200)))
    assert await client.get("n") == b"200"
    # the line's one connection, however many called at once, named for CLIENT LIST
    assert await named_connections(client, "iop-line-test:scripts") == 1


async def test_execute_many_answers_in_order_with_error_replies_in_place(client: Redis) -> None:
    await client.set("s", "x")
    replies = await line(client).execute_many([("SET", "a", "1"), ("INCR", "s"), ("GET", "a")])
    assert replies[0] is True or replies[0] == b"OK"
    assert isinstance(replies[1], ResponseError)
    # with no traceback: it would hold the frame that holds the replies, a cycle only the garbage
    # collector frees, and the commands sent with it (a request's body) until then
    assert replies[1].__traceback__ is None
    assert replies[2] == b"1"


async def test_a_caller_that_leaves_does_not_put_the_connection_out_of_step(client: Redis) -> None:
    """The command of a cancelled caller is made; its reply is read and dropped, and the next
    callers get their own replies."""
    lined = line(client)
    slow = asyncio.create_task(lined.execute("BLPOP", "never", "0.2"))  # answers after 0.2 s
    after = asyncio.create_task(lined.execute("ECHO", "mine"))
    await asyncio.sleep(0)  # both sent
    slow.cancel()
    assert await after == b"mine"
    assert (await asyncio.gather(slow, return_exceptions=True))[0].__class__ is asyncio.CancelledError
    assert [await lined.execute("ECHO", str(i)) for i in range(3)] == [b"0", b"1", b"2"]


async def test_closing_the_client_closes_the_line_and_a_later_command_opens_it_again(redis_url: str) -> None:
    r = connect(redis_url, client_name="iop-line-test")
    lined = line(r)
    await lined.execute("PING")
    watcher = Redis.from_url(redis_url)
    try:
        names = [c.get("name") for c in await watcher.client_list()]
        assert names.count("iop-line-test:scripts") == 1
        await r.aclose()

        async def closed() -> bool:  # (Redis reads the close after the client made it: the CI saw it late)
            return [c.get("name") for c in await watcher.client_list()].count("iop-line-test:scripts") == 0

        await async_wait_until(closed, what="Redis to see the line closed")
        assert await lined.execute("ECHO", "again") == b"again"
        await r.aclose()
    finally:
        await watcher.aclose()


async def test_commands_ride_out_a_redis_restart_and_fail_clearly_while_it_is_away() -> None:
    server = RedisServer().start()
    r = connect(server.url)
    lined = line(r)
    try:
        assert await lined.execute("SET", "k", "1")
        server.stop(kill=True)
        with pytest.raises(RedisConnectionError):  # after the pool's retries
            await lined.execute("GET", "k")
        server.start()
        assert await lined.execute("ECHO", "back") == b"back"  # a new connection
        replies = await asyncio.gather(*(lined.execute("INCR", "c") for _ in range(50)))
        assert sorted(replies) == list(range(1, 51))
    finally:
        await r.aclose()
        server.cleanup()


async def test_a_redis_that_stops_answering_fails_waiting_commands_after_the_reply_timeout_and_serves_them_when_back(
        ) -> None:
    """Commands on the line, on redis-py's path and on a connection made while it is paused each
    fail with a TimeoutError after the URL's `socket_timeout` (they waited for good before); a
    resumed server is used again. (The 10 s bound is the test's: with no timeout they hang.)"""
    server = RedisServer().start()
    r = connect(server.url + "?socket_timeout=0.3")
    lined = line(r)
    try:
        assert await lined.execute("SET", "k", "1")
        assert await r.get("k") == b"1"  # (a pooled connection, made before the pause)
        with paused(server):
            fresh = connect(server.url + "?socket_timeout=0.3")
            calls = [*(lined.execute("INCR", "n") for _ in range(3)), r.get("k"), fresh.ping()]
            failed = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            await fresh.aclose()
        assert [type(e) for e in failed] == [RedisTimeoutError] * 5, failed
        assert "did not answer within 0.3 s" in str(failed[0])
        assert await lined.execute("ECHO", "back") == b"back"  # (a new connection)
        assert await r.get("k") == b"1"
    finally:
        await r.aclose()
        server.cleanup()


async def test_a_blocking_read_has_its_block_time_before_the_reply_timeout_counts(redis_url: str) -> None:
    r = connect(redis_url + "?socket_timeout=0.2")
    reads = new_line_of(r, "reads")
    assert reads is not None
    try:
        assert await reads.execute("BLPOP", "never", "0.5", block_s=0.5) is None  # (waited 0.5 s for nothing)
        with pytest.raises(RedisTimeoutError):  # the same read, not said to block: Redis seems stuck
            await reads.execute("BLPOP", "never", "0.5")
        assert await reads.execute("ECHO", "next") == b"next"
    finally:
        await r.aclose()


async def test_a_command_after_a_blocking_read_answered_early_has_its_own_deadline(own_redis: RedisServer) -> None:
    """Found by a review: the one timer was armed for the blocking read's deadline (its block time
    and the reply timeout); answered at once, it left that timer armed, and the next command, on a
    paused Redis, failed that late, not after the reply timeout."""
    r = connect(own_redis.url + "?socket_timeout=0.5")
    inbox = new_line_of(r, "inbox")
    assert inbox is not None
    try:
        await r.xadd("s", {"f": "v"})
        assert await inbox.execute("XREAD", "BLOCK", 60_000, "STREAMS", "s", "0", block_s=60.0)  # (at once)
        link = inbox._link
        assert link is not None
        with paused(own_redis):
            ping = asyncio.ensure_future(inbox.execute("PING"))
            await async_wait_until(lambda: asyncio.sleep(0, bool(link.deadlines)), what="the PING sent")
            assert link.timer is not None and link.timer.when() == link.deadlines[0]  # (the PING's, not the read's)
            with pytest.raises(RedisTimeoutError):
                await ping
    finally:
        await r.aclose()


@pytest.mark.parametrize("second_block_s", [0.05, 0.6])
async def test_a_command_behind_a_read_that_blocks_past_the_reply_timeout_is_not_failed(
        redis_url: str, second_block_s: float) -> None:
    """Its reply could not come before the read's: its own time (reply timeout and block time)
    counts from the read's reply. (Found by a review: a plain command behind the read proves
    nothing, Redis answers it in the same write; a blocking one does.)"""
    r = connect(redis_url + "?socket_timeout=0.3")
    reads = new_line_of(r, "reads")
    assert reads is not None
    try:
        first = asyncio.ensure_future(reads.execute("BLPOP", "never", "0.9", block_s=0.9))
        second = asyncio.ensure_future(reads.execute("BLPOP", "never", str(second_block_s), block_s=second_block_s))
        assert await first is None
        assert await second is None  # (answered 0.9 s + its block time after it was sent)
    finally:
        await r.aclose()


async def test_a_command_that_timed_out_is_not_sent_again() -> None:
    """It may have run (an INCR must not count twice); a lost connection is still retried."""
    retry = client_options()["retry"]
    calls: list[Exception] = []

    async def failing(error: Exception) -> None:
        calls.append(error)
        raise error

    async def nothing(error: Exception) -> None:
        return None

    with pytest.raises(RedisTimeoutError):
        await retry.call_with_retry(partial(failing, RedisTimeoutError("slow")), nothing)
    assert len(calls) == 1
    with pytest.raises(RedisConnectionError):
        await retry.call_with_retry(partial(failing, RedisConnectionError("lost")), nothing)
    assert len(calls) == 1 + 4  # (the first try and 3 retries)


async def test_a_connection_lost_with_commands_in_flight_fails_them_all_and_the_next_reconnect(
        client: Redis, redis_url: str) -> None:
    """A connection killed under its callers: each in-flight command is tried again on a new
    connection by the pool's retry (so all succeed here), none hangs."""
    lined = line(client)
    before = await lined.execute("CLIENT", "ID")
    killer = Redis.from_url(redis_url)
    try:
        calls = [asyncio.create_task(lined.execute("INCR", "k")) for _ in range(20)]
        await asyncio.sleep(0)
        await killer.client_kill_filter(_type="normal", skipme=True)
        replies = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert all(isinstance(r, int) for r in replies)
        # (a command that ran before the kill and lost its reply ran again: INCR is not idempotent)
        assert int(await killer.get("k") or 0) >= len(replies)
        assert await lined.execute("ECHO", "next") == b"next"
        assert await lined.execute("CLIENT", "ID") != before  # the kill hit the line's connection
    finally:
        await killer.aclose()


async def test_a_batch_with_a_command_that_cannot_be_packed_sends_none_of_it(client: Redis) -> None:
    """As a redis-py pipeline: every command is packed before one is sent. (Found in review: the
    commands before the bad one ran.)"""
    with pytest.raises(DataError):
        await line(client).execute_many([("SET", "a", "1"), ("SET", "b", None)])
    assert await line(client).execute("ECHO", "after") == b"after"  # (a later command's turn has come)
    assert await client.get("a") is None


async def test_a_blocking_read_whose_caller_left_takes_nothing_that_comes_later(client: Redis) -> None:
    """A BLMPOP left running on a blocking line would pop the next job for nobody: its connection
    is closed instead, and the server drops the read. (Found in review.)"""
    wake = new_line_of(client, "wake")
    assert wake is not None
    before = await wake.execute("CLIENT", "ID")
    waiter = asyncio.create_task(wake.execute("BLMPOP", 5, 1, "wake", "LEFT", "COUNT", 5))

    async def blocked() -> bool:
        return int((await client.info("clients"))["blocked_clients"]) == 1

    await async_wait_until(blocked, what="the BLMPOP to block")
    waiter.cancel()
    assert (await asyncio.gather(waiter, return_exceptions=True))[0].__class__ is asyncio.CancelledError

    async def unblocked() -> bool:
        return int((await client.info("clients"))["blocked_clients"]) == 0

    await async_wait_until(unblocked, what="the server to drop the abandoned BLMPOP")
    await client.rpush("wake", "job-1")
    assert await wake.execute("BLMPOP", 1, 1, "wake", "LEFT", "COUNT", 5) == [b"wake", [b"job-1"]]
    assert await wake.execute("CLIENT", "ID") != before  # on a new connection


async def test_a_blocking_read_sent_with_a_command_after_it_whose_caller_left_runs_neither(client: Redis) -> None:
    """The same for a blocking read sent together with a command that follows it (a worker's
    `BLMOVE` and its `take_woken`): the server drops both with the connection."""
    wake = new_line_of(client, "wake")
    assert wake is not None
    waiter = asyncio.create_task(wake.execute_many([("BLMOVE", "wake", "mine", "RIGHT", "LEFT", 5),
                                                    ("RPUSH", "after", "ran")]))

    async def blocked(n: int) -> bool:
        return int((await client.info("clients"))["blocked_clients"]) == n

    await async_wait_until(partial(blocked, 1), what="the BLMOVE to block")
    waiter.cancel()
    assert (await asyncio.gather(waiter, return_exceptions=True))[0].__class__ is asyncio.CancelledError
    await async_wait_until(partial(blocked, 0), what="the server to drop the abandoned BLMOVE")
    await client.rpush("wake", "job-1")
    assert await client.lrange("wake", 0, -1) == [b"job-1"] and not await client.exists("mine", "after")


async def test_scripts_redis_forgot_are_loaded_again_over_the_line_not_one_pool_connection_each(
        client: Redis, redis: Redis) -> None:
    """After a Redis restart (here its SCRIPT FLUSH), every call in flight finds its script missing
    and loads the scripts again: over the client's line, as the calls go, not on a connection of
    the pool each. Before, each concurrent load took one (11 for these 20 calls), and the pool kept them: a soak
    saw a worker hold 12 more connections after a Redis restart, idle from then on."""
    scripts = Scripts(client)
    assert await scripts.call("watch", ["iop:run:none"], ["gw"]) == 0
    await redis.script_flush()
    answers = await asyncio.gather(*(scripts.call("watch", ["iop:run:none"], ["gw"]) for _ in range(20)))
    assert answers == [0] * 20
    assert await named_connections(redis) == 0  # (the line's is `iop-line-test:scripts`)
    assert await redis.script_exists(*SHAS.values()) == [True] * len(SHAS)


async def test_a_reply_that_came_while_this_process_was_paused_is_its_answer_not_a_timeout(redis_url: str) -> None:
    """Found in a chaos soak (real processes, one SIGSTOPped 6-14 s at a time): a worker, a gateway
    or a scheduler resumed after a pause longer than `socket_timeout` logged `Redis ... did not
    answer within 5 s (socket_timeout)`, closed its connection and failed the commands in flight,
    though Redis had answered them at once. The timer of their deadline, overdue, ran in the
    resumed loop's first turn, before the reader that had their replies. Here the loop is held
    (as SIGSTOP holds it) until the reply is in the socket and past its deadline."""
    r = connect(redis_url + "?socket_timeout=0.2")
    lined = line(r)
    try:
        assert await lined.execute("PING") == b"PONG"  # (connected)
        link = lined._link
        assert link is not None
        echo = link.send(pack_command(["ECHO", "late"]), 0.0)
        link.flush()  # (written now, before the loop's next turn: then the loop is held)
        sock = link.conn._writer.transport.get_extra_info("socket")
        loop = asyncio.get_running_loop()
        held_until = time.monotonic() + 10
        held_past = link.deadlines[0] + 2.5  # (as a pause of seconds holds it)
        while not select.select([sock], [], [], 0.05)[0] or loop.time() <= held_past:  # (the loop held)
            assert time.monotonic() < held_until, "no reply within 10 s"
        assert await echo == b"late"
        assert lined._link is link  # (the connection kept)
    finally:
        await r.aclose()
