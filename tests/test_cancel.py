"""Cancellation that cannot be lost: a caller who leaves between dispatch and start, or
whose cancel message never reaches the worker, still gets its run cancelled and its slot
back (real Redis, in-process scheduler and runner, a fake adapter)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from common import keys
from common.policy import Health
from common.redisconn import now_ms
from common.wire import ErrorCode, ErrorInfo, RunKind, RunState
from gateway.requests import ParsedRequest
from gateway.runs import UNANSWERED, RunClient
from scheduler.core import GATEWAY_GONE, Scheduler
from tests.conftest import async_wait_until, redis_full
from tests.test_scheduler import MODEL, beat, make_config, request, waiting_runs
from workers import metrics
from workers.adapters.base import ProbeResult, ProviderError, Retry
from workers.runner import Runner


class StallingAdapter:
    """A provider that accepts the request and never answers."""

    def __init__(self) -> None:
        self.calls = 0
        self.closed = asyncio.Event()

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.calls += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.closed.set()
        raise AssertionError("unreachable")

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        yield [await self.complete(kind, body, request_id)]

    async def probe(self) -> ProbeResult:
        return ProbeResult(Health.AVAILABLE)

    async def close(self) -> None:
        return None


async def dispatched_run(redis: Redis, lease_ttl_ms: int = 15_000) -> tuple[RunClient, Scheduler, str]:
    config = make_config({"a": 1}, runtime={"lease_ttl_ms": lease_ttl_ms})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    assert await redis.hget(keys.run_record(run_id), "state") == b"dispatched"
    return client, sched, run_id


async def test_a_cancel_between_dispatch_and_start_ends_the_run_at_start(redis: Redis,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    client, sched, run_id = await dispatched_run(redis)
    assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"  # no worker yet
    adapter = StallingAdapter()
    runner = Runner(redis, client.config, "n-a", {"a": adapter})
    with caplog.at_level(logging.INFO, logger="iop.worker"):
        assert await runner.execute(run_id) == "cancelled"
    # (callers leave: no WARNING for it in the worker's log)
    assert [r.levelname for r in caplog.records if r.getMessage() == "not started (cancelled)"] == ["INFO"]
    assert adapter.calls == 0
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message") == [
        b"cancelled", b"cancelled through the runs API"]
    assert await redis.zcard(keys.leases("a")) == 0
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].type == "failed" and events[-1].data["code"] == "cancelled"
    assert ErrorInfo.from_wire(events[-1].data).message == "cancelled through the runs API"


async def test_the_first_reason_a_run_was_cancelled_for_is_the_one_it_ends_with(redis: Redis) -> None:
    client, sched, run_id = await dispatched_run(redis)
    assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
    assert await client.cancel(run_id, MODEL, "the caller went away") == "signalled"  # (its caller then left)
    runner = Runner(redis, client.config, "n-a", {"a": StallingAdapter()})
    assert await runner.execute(run_id) == "cancelled"
    await client.close()
    assert await redis.hget(keys.run_record(run_id), "error_message") == b"cancelled through the runs API"


async def test_a_cancel_recorded_by_an_earlier_version_ends_the_run_as_by_the_caller(redis: Redis) -> None:
    client, sched, run_id = await dispatched_run(redis)
    await redis.hset(keys.run_record(run_id), "cancel", "1")  # (no cancel_reason: written before there was one)
    runner = Runner(redis, client.config, "n-a", {"a": StallingAdapter()})
    assert await runner.execute(run_id) == "cancelled"
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert ErrorInfo.from_wire(events[-1].data).message == "cancelled by the caller"


async def test_a_cancelled_run_whose_worker_never_came_is_reaped_as_cancelled(redis: Redis) -> None:
    client, sched, run_id = await dispatched_run(redis)
    await client.cancel(run_id, MODEL, "the caller went away")
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})  # move the clock past the lease
    assert await sched.reap_expired_leases() == 1
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message") == [
        b"cancelled", b"the caller went away"]
    events = [e async for e in client.events(run_id)]
    assert ErrorInfo.from_wire(events[-1].data).message == "the caller went away"
    await client.close()
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0  # not put back in the queue


async def test_a_cancelled_run_reaped_after_output_says_its_output_went_out(redis: Redis) -> None:
    client, sched, run_id = await dispatched_run(redis)
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "output": "1"})  # (as a delta makes it)
    await client.cancel(run_id, MODEL, "the caller went away")
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})
    assert await sched.reap_expired_leases() == 1
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].data["code"] == "cancelled" and events[-1].data["before_output"] is False


async def test_a_cancel_recorded_by_an_earlier_version_reaped_after_output_says_its_output_went_out(
        redis: Redis) -> None:
    """A record with no `cancel_reason` (an earlier version's cancel) ends as cancelled by the caller:
    reaped after output, its `failed` event said `before_output: true` (the default data)."""
    client, sched, run_id = await dispatched_run(redis)
    await redis.hset(keys.run_record(run_id), mapping={"state": "running", "output": "1", "cancel": "1"})
    await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})
    assert await sched.reap_expired_leases() == 1
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].data["code"] == "cancelled" and events[-1].data["message"] == "cancelled by the caller"
    assert events[-1].data["before_output"] is False


async def test_a_running_run_notices_a_cancel_whose_message_was_lost(redis: Redis) -> None:
    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=150)
    adapter = StallingAdapter()
    runner = Runner(redis, client.config, "n-a", {"a": adapter})
    execution = asyncio.create_task(runner.execute(run_id))

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    await async_wait_until(running, what="the run to start")
    # The cancel message goes out while no worker listens: only the flag in the run remains.
    assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
    assert (await execution).startswith("cancelled")
    assert adapter.closed.is_set()
    # (it ends with the reason it was cancelled for, not always "by the caller")
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message") == [
        b"cancelled", b"cancelled through the runs API"]
    assert await redis.zcard(keys.leases("a")) == 0


async def test_a_cancel_that_the_lease_renewal_also_finds_ends_the_run_once(redis: Redis) -> None:
    """The cancel message and the lease's renewal (which sees the run's cancel flag) both cancel
    the run: the second, coming while the run records its end, cancelled that too, the job's
    task ended cancelled, and the worker's loop stopped with it (its process exited 0 with no
    error; found against a real llama.cpp server, 3 of 7 callers who gave up)."""
    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=150)
    adapter = StallingAdapter()
    runner = Runner(redis, client.config, "n-a", {"a": adapter})
    renewal_saw_it = asyncio.Event()
    call, reason_of = runner.scripts.call, runner.why_cancelled

    async def slow_end(name: str, script_keys: Any, args: Any) -> Any:
        if name == "finish":  # the run records its end only once the renewal saw the cancel too
            await asyncio.wait_for(renewal_saw_it.wait(), 10)
        return await call(name, script_keys, args)

    async def reason(run_id: str) -> ErrorInfo:  # (what the renewal reads when it finds the cancel flag)
        try:
            return await reason_of(run_id)
        finally:
            renewal_saw_it.set()

    runner.scripts.call = slow_end  # type: ignore[method-assign,assignment]
    runner.why_cancelled = reason  # type: ignore[method-assign]
    execution = asyncio.create_task(runner.execute(run_id))

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    await async_wait_until(running, what="the run to start")
    assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
    # (the cancel message, as the listener hears it)
    assert runner.cancel(run_id, ErrorInfo(ErrorCode.CANCELLED, "cancelled through the runs API"))
    assert (await execution).startswith("cancelled")
    assert not execution.cancelled()
    assert await redis.hget(keys.run_record(run_id), "state") == b"cancelled"


async def test_a_full_redis_still_takes_cancels_and_ends(redis: Redis) -> None:
    """At `maxmemory` a cancel of a queued run, the cancel flag of a running one, a lease's
    renewal and a run's end go through: a caller who leaves does not keep a run going for nobody,
    nor a full Redis full. (The flag and the renewal were refused before; a queued run's cancel
    and a run's end went through already, their first write frees.)"""
    config = make_config({"a": 1}, runtime={"lease_ttl_ms": 15_000})
    client, sched, (running_id, queued_id) = await waiting_runs(redis, config, 2)
    await sched.dispatch_all()
    adapter = StallingAdapter()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    execution = asyncio.create_task(runner.execute(running_id))

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(running_id), "state") == b"running")

    await async_wait_until(running, what="the run to start")
    async with redis_full(redis):
        with pytest.raises(OutOfMemoryError):  # (the engine is full: a new run is refused)
            await redis.set("iop:test:grow", "x")
        assert await client.cancel(queued_id, MODEL, "the caller went away") == "ok"
        assert await client.cancel(running_id, MODEL, "the caller went away") == "signalled"
        lease = [running_id, 15_000, b"1"]
        assert await runner.scripts.call("renew", [keys.leases("a"), keys.run_record(running_id)], lease) == 2
        assert runner.cancel(running_id, ErrorInfo(ErrorCode.CANCELLED, "the caller went away"))
        assert (await execution).startswith("cancelled")  # its end (`finish`) went through
    assert await redis.hget(keys.run_record(queued_id), "state") == b"cancelled"
    assert await redis.hget(keys.run_record(running_id), "state") == b"cancelled"
    assert await redis.zcard(keys.leases("a")) == 0


class FailingAdapter(StallingAdapter):
    """A provider that answers a server error."""

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        raise ProviderError("provider a answered 500: boom", status=500, retry=Retry.NO, strikes=None)


async def test_a_cancel_while_a_failed_run_records_its_end_does_not_cancel_that(redis: Redis) -> None:
    """The cancel came while the run recorded its failure: raised into that, it ended the job's
    task cancelled and left the run `running` on its lease (found by a review)."""
    client, sched, run_id = await dispatched_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": FailingAdapter()})
    ending, cancelled = asyncio.Event(), asyncio.Event()
    call = runner.scripts.call

    async def slow_end(name: str, script_keys: Any, args: Any) -> Any:
        if name == "finish":  # the caller leaves while the failure is being recorded
            ending.set()
            await asyncio.wait_for(cancelled.wait(), 10)
        return await call(name, script_keys, args)

    runner.scripts.call = slow_end  # type: ignore[method-assign,assignment]
    execution = asyncio.create_task(runner.execute(run_id))
    await asyncio.wait_for(ending.wait(), 10)
    assert await client.cancel(run_id, MODEL, "the caller went away") == "signalled"
    # (the cancel message, as the listener hears it)
    assert runner.cancel(run_id, ErrorInfo(ErrorCode.CANCELLED, "the caller went away"))
    cancelled.set()
    # (recorded before its end was, the cancel is how it ends: a failure that may be tried again would
    # have put a cancelled run back in its queue; a review)
    assert (await execution) == "cancelled:cancel_asked"
    assert not execution.cancelled()
    assert await redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    assert await redis.zcard(keys.leases("a")) == 0


class AnsweringAdapter(StallingAdapter):
    """A provider that answers at once: a whole answer, or a stream of one chunk."""

    CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                             "finish_reason": None}]}

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                          "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        yield [self.CHUNK]  # (two reads: the first goes out as it comes, the last with the run's end)
        yield [self.CHUNK]


def cancelled_before_the_end_is_recorded(runner: Runner, client: RunClient, run_id: str,
                                         before: str = "finish") -> None:
    """The run's cancel (a DELETE) comes once its provider answered, while its worker has not heard
    of it (frozen, or the message is still on its way): only the record's flag says so. `before`:
    the script the cancel comes just before (`emit`: a stream's first output)."""
    call = runner.scripts.call

    async def cancel_first(name: str, script_keys: Any, args: Any) -> Any:
        if name == before:
            assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
        return await call(name, script_keys, args)

    runner.scripts.call = cancel_first  # type: ignore[method-assign,assignment]


async def test_a_run_cancelled_before_its_answer_went_out_ends_cancelled_not_completed(redis: Redis) -> None:
    """A DELETE answered 202 (its worker, stopped, had not heard of it); the worker went on, found
    the provider's answer and recorded the run `completed`, its answer delivered (found by a
    helper). A cancel asked before any of the answer went out now ends the run cancelled."""
    client, sched, run_id = await dispatched_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": AnsweringAdapter()})
    cancelled_before_the_end_is_recorded(runner, client, run_id)
    assert await runner.execute(run_id) == "cancelled:cancel_asked"
    assert await redis.hmget(keys.run_record(run_id), "state", "error_code", "error_message", "output") == [
        b"cancelled", b"cancelled", b"cancelled through the runs API", None]
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert [e.type for e in events] == ["dispatched", "started", "failed"]
    assert ErrorInfo.from_wire(events[-1].data).message == "cancelled through the runs API"
    assert await redis.zcard(keys.leases("a")) == 0


async def stream_run(redis: Redis) -> tuple[RunClient, str]:
    config = make_config({"a": 1})
    client, sched, _ = await waiting_runs(redis, config, 0)
    model = config.model(MODEL)
    assert model is not None
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    run_id, _ = await client.submit(model, ParsedRequest(RunKind.CHAT, MODEL, True, body))
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    return client, run_id


async def test_a_stream_cancelled_before_its_first_output_went_out_ends_cancelled(redis: Redis) -> None:
    """The same for a stream, whose first output goes out before its end (`emit`): it went out, and
    the run completed (a review of the fix above, which covered whole answers only)."""
    client, run_id = await stream_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": AnsweringAdapter()})
    cancelled_before_the_end_is_recorded(runner, client, run_id, before="emit")
    assert await runner.execute(run_id) == "cancelled:ok"
    assert await redis.hmget(keys.run_record(run_id), "state", "error_message", "output") == [
        b"cancelled", b"cancelled through the runs API", None]
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert [e.type for e in events] == ["dispatched", "started", "failed"]
    assert events[-1].data["code"] == "cancelled" and events[-1].data["before_output"] is True
    assert await redis.zcard(keys.leases("a")) == 0


class RetryableFailure(AnsweringAdapter):
    """A provider whose whole answer fails before any output, in a way tried again."""

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        raise ProviderError("provider a answered 503", status=503, retry=Retry.ANY, strikes=0)


async def test_a_cancel_its_worker_did_not_hear_ends_a_requeued_attempt_cancelled(redis: Redis) -> None:
    """The attempt failed, to be tried again, after a DELETE its worker had not heard of: the run was
    put back in its queue with its cancel flag, holding a place there (and its key's in-flight count)
    until it timed out (a review)."""
    client, sched, run_id = await dispatched_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": RetryableFailure()})
    cancelled_before_the_end_is_recorded(runner, client, run_id)
    assert await runner.execute(run_id) == "cancelled:cancel_asked"
    assert await redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0 and await redis.zcard(keys.leases("a")) == 0
    await client.close()


async def test_a_cancel_heard_as_the_stream_s_first_output_is_refused_does_not_cancel_the_job(redis: Redis) -> None:
    """The cancel message came in the turn after `emit` said the run was cancelled: it cancelled the
    job's task, which arq logs as a bug (a review)."""
    client, run_id = await stream_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": AnsweringAdapter()})
    call = runner.scripts.call

    async def cancel_heard_at_once(name: str, script_keys: Any, args: Any) -> Any:
        if name != "emit":
            return await call(name, script_keys, args)
        assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
        reply = await call(name, script_keys, args)
        asyncio.get_running_loop().call_soon(runner.cancel, run_id, ErrorInfo(ErrorCode.CANCELLED, "heard"))
        return reply

    runner.scripts.call = cancel_heard_at_once  # type: ignore[method-assign,assignment]
    execution = asyncio.create_task(runner.execute(run_id))
    await asyncio.wait([execution], timeout=10)
    assert not execution.cancelled() and execution.result() == "cancelled:ok"
    assert await redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    await client.close()


async def test_a_run_ended_cancelled_is_counted_so_when_a_lost_reply_makes_its_end_again(redis: Redis) -> None:
    """`finish` ended the run cancelled, its reply was lost, and the call made again answered the
    run's state: the attempt was counted completed (a review)."""
    client, sched, run_id = await dispatched_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": AnsweringAdapter()})
    call = runner.scripts.call
    lost: list[Any] = []

    async def reply_lost_once(name: str, script_keys: Any, args: Any) -> Any:
        if name == "finish" and not lost:
            assert await client.cancel(run_id, MODEL, "cancelled through the runs API") == "signalled"
        reply = await call(name, script_keys, args)
        if name == "finish" and not lost:
            lost.append(reply)
            raise RedisConnectionError("the connection dropped as the reply came")
        return reply

    runner.scripts.call = reply_lost_once  # type: ignore[method-assign,assignment]
    before = {o: metrics.RUNS.labels(MODEL, "a", o)._value.get() for o in ("completed", "cancelled")}
    assert await runner.execute(run_id) == "cancelled:cancelled"
    assert lost == [b"cancel_asked"]
    assert {o: metrics.RUNS.labels(MODEL, "a", o)._value.get() - before[o] for o in before} == {
        "completed": 0, "cancelled": 1}
    await client.close()


async def test_a_stream_whose_output_went_out_before_its_cancel_still_completes(redis: Redis) -> None:
    """Once part of the answer went out, its end does too: the caller has the rest of what it saw."""
    client, run_id = await stream_run(redis)
    runner = Runner(redis, client.config, "n-a", {"a": AnsweringAdapter()})
    cancelled_before_the_end_is_recorded(runner, client, run_id)
    assert await runner.execute(run_id) == "completed:ok"
    assert await redis.hmget(keys.run_record(run_id), "state", "output") == [b"completed", b"1"]
    await client.close()


class GatedAdapter(StallingAdapter):
    """A provider whose first output comes once `go` is set, then nothing more."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        await self.go.wait()
        yield [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                                "finish_reason": None}]}]
        await asyncio.Event().wait()


async def test_output_that_waits_out_a_full_redis_still_ends_at_the_execution_timeout(redis: Redis) -> None:
    """A running run's output waits for as long as Redis is full (its lease renewed meanwhile),
    but no longer than its `execution_timeout_ms`: then it ends, failed, while Redis is still full."""
    config = make_config({"a": 1}, queue={"execution_timeout_ms": 1000, "max_attempts": 1},
                         runtime={"lease_ttl_ms": 300})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    adapter = GatedAdapter()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    execution = asyncio.create_task(runner.execute(run_id))

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    await async_wait_until(running, what="the run to start")
    async with redis_full(redis):
        adapter.go.set()  # (its first output is refused, and waits)
        assert (await execution).startswith("failed")
        assert await redis.hmget(keys.run_record(run_id), "state", "error_code") == [b"failed", b"execution_timeout"]
    assert await redis.zcard(keys.leases("a")) == 0


async def test_a_cancel_redis_cannot_take_is_tried_again_until_the_run_would_have_ended_then_given_up(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The gateway's background cancel (a caller that left, a queueing that timed out) is bounded:
    past the run's follow deadline it would have ended anyway, and the gateway stops trying."""
    import logging

    from common.redisconn import connect
    from iop.embedded_redis import free_port

    client = RunClient(connect(f"redis://127.0.0.1:{free_port()}/0"), make_config({"a": 1}))  # (nothing listens)
    monkeypatch.setattr(client, "follow_deadline_s", lambda model_id: 0.3)
    try:
        with caplog.at_level(logging.WARNING, "iop.gateway"):
            await client.leave("run_gone", MODEL)  # (its first try fails: the rest go on in the background)

            async def given_up() -> bool:
                return client.take_back.task is not None and client.take_back.task.done() and not client.take_back

            await async_wait_until(given_up, what="the background cancel to give up")
        said = [r.getMessage() for r in caplog.records]
        assert said[0].startswith("could not cancel yet") and said[-1].startswith("could not cancel: "), said
        assert client.take_back.given_up == 1  # (iop_gateway_cancels_abandoned_total{reason="deadline"})
    finally:
        await client.close()
        await client.redis.aclose()


async def test_a_take_back_that_reaches_redis_before_its_queueing_leaves_nothing_queued(redis: Redis) -> None:
    """The gateway's queueing timed out (its caller heard 503) and its cancel went out on another
    connection: a Redis that resumes runs both, in no set order. A cancel that finds no run records
    it cancelled, so the queueing, run after it, finds the run there and queues nothing (it was
    queued, to run for nobody). A cancel of a run the gateway did not queue leaves nothing behind."""
    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    assert await client.cancel("run_other", MODEL, "cancelled through the runs API") == "missing"
    assert not await redis.exists(keys.run_record("run_other"))

    assert await client.cancel("run_late", MODEL, UNANSWERED, ours=True) == "missing"
    run_id, _ = await client.submit(model, request(), run_id="run_late")  # (the queueing, run late)
    assert run_id == "run_late"
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    assert await redis.hmget(keys.run_record(run_id), "state", "error_code", "error_message", "model") == [
        b"cancelled", b"cancelled", UNANSWERED.encode(), MODEL.encode()]
    assert 0 < await redis.ttl(keys.run_record(run_id)) <= config.runtime.run_ttl_s
    [(_, event)] = await redis.xrange(keys.run_events(run_id))  # (its end, as any run's: the runs API replays it)
    assert event[b"type"] == b"failed" and 0 < await redis.ttl(keys.run_events(run_id))
    await client.close()


class CutAfterCancel(StallingAdapter):
    """A stream that sends a chunk of output (or none), then breaks off once the test says."""

    def __init__(self, output: bool) -> None:
        super().__init__()
        self.output = output
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        if self.output:
            yield [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}]
        self.waiting.set()  # (what came before is out: the runner asked for the next read)
        await self.go.wait()
        raise ProviderError("the provider broke off")


@pytest.mark.parametrize(("path", "output"), [("start", False), ("reap", False), ("reap", True),
                                              ("finish", False), ("finish", True)])
async def test_a_cancelled_runs_failed_event_holds_what_a_workers_own_does(redis: Redis, path: str,
                                                                            output: bool) -> None:
    """A dead gateway's run (the scheduler's `orphans` sweep) ended cancelled by a script (at its
    start, by the reaper, or at its worker's end of an attempt that had not heard of the cancel): its
    `failed` event carries the worker's `ErrorInfo.to_wire()` keys (`status` and `detail` were
    missing) and `before_output` exactly when no output went out."""
    config = make_config({"a": 1})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    stream = ParsedRequest(RunKind.CHAT, MODEL, True, {"model": MODEL, "stream": True,
                                                       "messages": [{"role": "user", "content": "x"}]})
    run_id = (await client.submit(model, stream))[0]
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    why = ErrorInfo(ErrorCode.UNAVAILABLE, GATEWAY_GONE)

    async def cancel() -> None:  # (as `cancel_orphans` does)
        assert await sched.scripts.call("drop_queued", *sched._drop_call(
            MODEL, run_id, RunState.CANCELLED, why, abort_running=True)) == b"signalled"

    if path == "start":
        await cancel()
        assert await Runner(redis, config, "n-a", {"a": StallingAdapter()}).execute(run_id) == "cancelled"
    elif path == "reap":
        await redis.hset(keys.run_record(run_id), mapping={"state": "running", **({"output": "1"} if output else {})})
        await cancel()
        await redis.zadd(keys.leases("a"), {run_id: now_ms() - 1})
        assert await sched.reap_expired_leases() == 1
    else:  # (its worker did not hear of the cancel: the message was lost)
        adapter = CutAfterCancel(output)
        task = asyncio.create_task(Runner(redis, config, "n-a", {"a": adapter}).execute(run_id))
        await asyncio.wait_for(adapter.waiting.wait(), 10)
        await cancel()
        adapter.go.set()
        assert (await asyncio.wait_for(task, 10)).endswith(":cancel_asked")
    assert await redis.hget(keys.run_record(run_id), "state") == b"cancelled"
    events = [e async for e in client.events(run_id)]
    await client.close()
    assert events[-1].type == "failed"
    assert events[-1].data == ErrorInfo(ErrorCode.UNAVAILABLE, GATEWAY_GONE, before_output=not output).to_wire()
