"""`common.comeback`: a loop's pause after Redis went away is cut short once Redis answers again,
and only then (a loop that failed while Redis answered does not spin). Against a real Redis that is
stopped and started again."""

from __future__ import annotations

import asyncio

import pytest

from common import keys
from common.comeback import Comeback
from common.redisconn import Backoff, connect
from gateway import take_back
from gateway.runs import RunClient
from iop.embedded_redis import RedisServer
from scheduler import core
from tests.conftest import async_wait_until, paused
from tests.test_scheduler import MODEL, beat, make_config, submit
from workers import runner as runner_module
from workers.runner import Attempt, Runner
from workers.service import HEARTBEATS_CTX, RUNNER_CTX, build_worker

#: a pause no test waits out: the 15 s of `async_wait_until` / `wait_for` end first
LONG = Backoff(first=600.0, cap=600.0)


async def test_a_pause_ends_when_redis_answers_again_not_when_its_backoff_does() -> None:
    server = RedisServer().start()
    client = connect(server.url)
    comeback = Comeback(client)
    answered: list[bool] = []
    comeback.when_answered(answered.append)
    try:
        server.stop(kill=True)
        pausing = asyncio.create_task(comeback.pause(LONG))
        await async_wait_until(lambda: asyncio.sleep(0, comeback.refused >= 2), what="PINGs refused")
        assert not pausing.done()
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(pausing, 15)
        assert answered == [True]
    finally:
        await comeback.close()
        await client.aclose()
        server.cleanup()


async def test_a_redis_that_answers_at_once_cuts_no_pause_short(redis_url: str) -> None:
    """The loop failed for another reason than Redis being away (a READONLY replica, a slow
    command's timeout): waking it at once would make it spin."""
    client = connect(redis_url)
    comeback = Comeback(client)
    answered: list[bool] = []
    comeback.when_answered(answered.append)
    try:
        back = comeback.watch()
        await async_wait_until(lambda: asyncio.sleep(0, bool(answered)), what="the PING answered")
        assert answered == [False] and not back.is_set() and comeback.refused == 0
        pausing = asyncio.create_task(comeback.pause(Backoff(first=600.0)))
        await async_wait_until(lambda: asyncio.sleep(0, len(answered) == 2), what="the next watch's PING")
        await asyncio.sleep(0)
        assert not pausing.done()  # (still in its backoff)
        pausing.cancel()
        await asyncio.gather(pausing, return_exceptions=True)
    finally:
        await comeback.close()
        await client.aclose()


async def test_a_closed_watch_starts_no_other() -> None:
    client = connect("redis://127.0.0.1:1")  # (nothing listens: every PING refused)
    comeback = Comeback(client)
    comeback.watch()
    await async_wait_until(lambda: asyncio.sleep(0, comeback.refused >= 1), what="a PING refused")
    await comeback.close()
    assert comeback._task is not None and comeback._task.done()
    back = comeback.watch()
    assert comeback._task.done() and not back.is_set()  # (none started: a process stopping leaves no task
    await client.aclose()  # behind; and no set event, which would end every pause at once)


async def test_a_scheduler_loop_resumes_when_redis_answers_again_not_when_its_backoff_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After 10 s without Redis, a run queued 0.06 s after it was back completed 1.6 s later: the
    scheduler's loops (and the worker's, and the gateway's reader) were pausing up to their backoff's
    cap. With their pauses cut short: 0.07-0.13 s (`tests/test_faults.py`'s stack, three runs). Here
    the loop's backoff is ten minutes: only the comeback can end it."""
    monkeypatch.setattr(core, "Backoff", lambda *args, **kwargs: Backoff(first=600.0, cap=600.0))
    server = RedisServer().start()
    client = connect(server.url)
    comeback = Comeback(client)
    through = asyncio.Event()

    async def step() -> None:
        await client.ping()
        through.set()
        await asyncio.Event().wait()

    server.stop(kill=True)
    loop = asyncio.create_task(core._forever("intake", step, comeback))
    try:
        await async_wait_until(lambda: asyncio.sleep(0, comeback.refused >= 1), what="Redis found away")
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(through.wait(), 15)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await comeback.close()
        await client.aclose()
        server.cleanup()


async def test_a_run_s_write_through_an_outage_goes_on_when_redis_answers_not_when_its_backoff_ends(
        monkeypatch: pytest.MonkeyPatch, own_redis: RedisServer) -> None:
    """A run's writes (its output, its end) ride out an outage in `_call_while_leased`, whose pauses
    grew to 1 s: its held-back output reached the caller up to a second after Redis was back. Here
    the backoff is ten minutes: only the worker's comeback can end it."""
    monkeypatch.setattr(runner_module, "Backoff", lambda *args, **kwargs: LONG)
    client = connect(own_redis.url + "?socket_timeout=0.5")
    comeback = Comeback(client)
    runner = Runner(client, make_config({"a": 1}), "n-a", {}, comeback=comeback)
    await runner.scripts.load()
    try:
        await write_through_a_pause(own_redis, runner, comeback)
    finally:
        await comeback.close()
        await client.aclose()


async def write_through_a_pause(server: RedisServer, runner: Runner, comeback: Comeback) -> None:
    """A run's write made while `server` is paused: it goes on once Redis answers (within 15 s: only
    `comeback` can end the tests' ten-minute backoff)."""
    att = Attempt("run_out", MODEL, "a", "1", max_attempts=1)
    with paused(server):
        writing = asyncio.create_task(runner._call_while_leased(
            att, "emit", [keys.run_record(att.run_id), keys.run_events(att.run_id)],
            [att.attempt, "delta", b"", 100, att.run_id, 1], "emitting"))
        await async_wait_until(lambda: asyncio.sleep(0, comeback.refused >= 1), what="Redis found away")
        assert not writing.done()
    await asyncio.wait_for(writing, 15)


async def test_kept_cancels_go_out_when_redis_answers_not_when_their_backoff_ends(
        monkeypatch: pytest.MonkeyPatch, own_redis: RedisServer) -> None:
    """The gateway's kept cancels (`gateway.take_back`) were tried again up to 2 s apart: a run
    whose caller left during an outage went on for nobody that long after Redis was back."""
    monkeypatch.setattr(take_back, "Backoff", lambda *args, **kwargs: LONG)
    config = make_config({"a": 1})
    client = RunClient(connect(own_redis.url + "?socket_timeout=0.5"), config)
    await beat(client.redis, config)
    [run_id] = await submit(client, 1)  # (queued: no scheduler runs)
    try:
        with paused(own_redis):
            await client.leave(run_id, MODEL)
            assert len(client.take_back) == 1
            await async_wait_until(lambda: asyncio.sleep(0, client.hub.comeback.refused >= 1),
                                   what="Redis found away")
        await async_wait_until(lambda: asyncio.sleep(0, len(client.take_back) == 0), what="the cancel sent")
        assert await client.redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    finally:
        await client.close()
        await client.redis.aclose()


async def test_a_run_s_write_in_the_worker_s_stop_grace_goes_on_when_redis_answers(
        monkeypatch: pytest.MonkeyPatch, own_redis: RedisServer) -> None:
    """`serve` stops the heartbeats first on SIGTERM, then gives the runs their grace (and 5 s more to
    record their end): the watch was the heartbeats' own and closed with them, so a run's writes
    through an outage in that grace waited out their backoff again (its output 0.77-0.82 s late
    after Redis was back, 0.03-0.09 s outside a stop). Here the backoff is ten minutes."""
    monkeypatch.setattr(runner_module, "Backoff", lambda *args, **kwargs: LONG)
    worker = build_worker(make_config({"a": 1}), own_redis.url + "?socket_timeout=0.5", "n-a")
    await worker.on_startup(worker.ctx)  # type: ignore[misc]
    runner: Runner = worker.ctx[RUNNER_CTX]
    beating: asyncio.Task[None] = worker.ctx[HEARTBEATS_CTX]
    await async_wait_until(lambda: runner.redis.exists(keys.heartbeat("a")), what="the heartbeats running")
    beating.cancel()  # (as `serve` does at once, before the runs' grace)
    await asyncio.gather(beating, return_exceptions=True)
    assert runner.comeback is not None
    try:
        await write_through_a_pause(own_redis, runner, runner.comeback)
    finally:
        await worker.on_shutdown(worker.ctx)  # type: ignore[misc]
        await worker.pool.aclose()
