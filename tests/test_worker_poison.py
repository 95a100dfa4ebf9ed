"""A provider's answer cannot take a worker down: an answer msgpack cannot hold (an integer beyond
64 bits, a lone surrogate), one that breaks the worker's own code (a RecursionError from JSON
nested too deep), usage counts beyond Redis's counters, or an error object holding such values
fails the run with a one-line `provider_error`, releases its slot, and leaves the job's task
ending normally, so the worker's loop (which calls `task.result()`) goes on and serves the next
run. Against a real Redis, through the node's `WakeWorker` and a `Runner`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from common import keys
from common.api_error import ApiError
from common.chunks import MAX_COUNTED_TOKENS
from common.codec import Unpackable, pack
from common.wire import ErrorInfo, RunKind
from tests.test_runner import ROLE, TEXT, Scripted, events, fields, node_worker, start_one
from tests.test_scheduler import MODEL
from workers.adapters.base import ProviderError, Retry
from workers.runner import Runner

BIG = 2**70
#: the same chunk as `TEXT`, with what the provider put in it
SEEDED = {**TEXT, "seed": BIG}
SURROGATE = {**TEXT, "choices": [{"index": 0, "delta": {"content": "hi \ud800"}, "finish_reason": None}]}
COMPLETION = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                        "finish_reason": "stop"}]}


def deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


class Poisoned(Scripted):
    """A provider whose first call answers with `reads` (a stream) or `response` (non-stream),
    then raises `error` if any; every later call answers as a sound provider does."""

    def __init__(self, reads: list[list[dict[str, Any]]] | None = None, response: dict[str, Any] | None = None,
                 error: BaseException | None = None) -> None:
        super().__init__(reads or [])
        self.poison = error
        self.response = response

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.calls += 1
        if self.calls > 1:
            return COMPLETION
        if self.poison:
            raise self.poison
        assert self.response is not None
        return self.response

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        if self.calls:
            self.calls += 1
            yield [ROLE]
            yield [TEXT]
            return
        async for read in super().stream(kind, body, request_id):
            yield read
        if self.poison:
            raise self.poison


async def fails_on_a_worker(redis_url: str, runner: Runner, run_id: str) -> None:
    """Run the run on a worker of node n-a: it fails, and its task (which the worker's loop
    collects) raises nothing."""
    worker = node_worker(redis_url, runner)
    try:
        await worker.claim_and_start([run_id])
        assert (await worker.tasks[run_id]).startswith("failed")
        worker._forget_finished()
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def through_worker(redis: Redis, redis_url: str, adapter: Poisoned, stream: bool,
                         caplog: pytest.LogCaptureFixture | None = None) -> tuple[str, str]:
    """Run one run of `adapter` through a worker of node n-a, then an ordinary one on the same
    worker and runner. Returns (the first run's id, what its task returned)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=stream)
    runner = Runner(redis, sched.config, "n-a", {"a": adapter})
    worker = node_worker(redis_url, runner)
    try:
        await worker.claim_and_start([run_id])
        task = worker.tasks[run_id]
        await asyncio.wait([task])
        outcome = task.result()  # no exception leaves the task ...
        worker._forget_finished()  # ... so the worker's loop, which calls it too, goes on
        assert run_id not in worker.tasks
        assert await redis.zcard(keys.leases("a")) == 0  # the slot is back

        # the next run on the same worker and runner is served
        _, next_id = await start_one(redis, {"a": 1}, stream=stream)
        await worker.claim_and_start([next_id])
        assert (await worker.tasks[next_id]).startswith("completed")
        assert await fields(redis, keys.run_record(next_id), "state") == ["completed"]
        assert await redis.zcard(keys.leases("a")) == 0
    finally:
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await worker.pool.aclose(close_connection_pool=True)
    return run_id, outcome


async def assert_failed(redis: Redis, run_id: str, *phrases: str, before_output: bool = True) -> dict[str, Any]:
    """The run failed with a one-line provider_error, not tried again; returns its failed event."""
    state, code, message, attempts = await fields(redis, keys.run_record(run_id), "state", "error_code",
                                                  "error_message", "attempts")
    assert (state, code, attempts) == ("failed", "provider_error", "1")
    assert message is not None and "\n" not in message and "Traceback" not in message
    assert message.startswith("provider a")
    for phrase in phrases:
        assert phrase in message
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0
    kinds = [k for k, _ in await events(redis, run_id)]
    assert "requeued" not in kinds and kinds[-1] == "failed"
    failed = (await events(redis, run_id))[-1][1]
    assert failed["code"] == "provider_error" and failed["message"] == message
    assert failed["before_output"] is before_output
    # (it would fail the same way anywhere: the caller's client is told not to try it again)
    assert ApiError.from_info(ErrorInfo.from_wire(failed)).headers.get("x-should-retry") == "false"
    return failed


@pytest.mark.parametrize("reads, phrase", [
    ([[SEEDED]], "an integer beyond 64 bits"),
    ([[SURROGATE]], "lone UTF-16 surrogate"),
    ([[ROLE], [{**TEXT, "x": deep(3000)}]], "nested deeper than"),
], ids=["big-int", "lone-surrogate", "nested-too-deep"])
async def test_a_streamed_chunk_msgpack_cannot_hold_fails_the_run_not_the_worker(
        redis: Redis, redis_url: str, reads: list[list[dict[str, Any]]], phrase: str) -> None:
    run_id, outcome = await through_worker(redis, redis_url, Poisoned(reads), stream=True)
    assert outcome.startswith("failed")
    await assert_failed(redis, run_id, "sent an answer iop cannot carry", phrase)


async def test_a_chunk_msgpack_cannot_hold_after_output_ends_the_stream_with_an_error(
        redis: Redis, redis_url: str) -> None:
    run_id, outcome = await through_worker(redis, redis_url, Poisoned([[TEXT], [SEEDED]]), stream=True)
    assert outcome.startswith("failed")
    await assert_failed(redis, run_id, "an integer beyond 64 bits", before_output=False)
    assert [d["chunks"] for k, d in await events(redis, run_id) if k == "delta"] == [[TEXT]]


@pytest.mark.parametrize("response, phrase", [
    ({**COMPLETION, "seed": BIG}, "an integer beyond 64 bits"),
    ({**COMPLETION, "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi \ud800"}}]},
     "lone UTF-16 surrogate"),
    ({**COMPLETION, "usage": {"prompt_tokens": BIG, "completion_tokens": 1}}, "an integer beyond 64 bits"),
], ids=["big-int", "lone-surrogate", "big-usage"])
async def test_a_response_msgpack_cannot_hold_fails_the_run_with_why_instead(
        redis: Redis, redis_url: str, response: dict[str, Any], phrase: str) -> None:
    run_id, outcome = await through_worker(redis, redis_url, Poisoned(response=response), stream=False)
    assert outcome.startswith("failed")
    await assert_failed(redis, run_id, "sent an answer iop cannot carry", phrase)
    assert "completed" not in [k for k, _ in await events(redis, run_id)]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_an_unexpected_error_in_the_attempt_fails_the_run_and_is_logged_once(
        redis: Redis, redis_url: str, caplog: pytest.LogCaptureFixture, stream: bool) -> None:
    """A RecursionError (an adapter parsing JSON nested ~3000 deep) is nothing the runner
    foresees: the run fails at once, naming the provider and the exception's class only."""
    caplog.set_level(logging.INFO, logger="iop.worker")
    adapter = Poisoned([[ROLE]], response=COMPLETION, error=RecursionError("maximum recursion depth exceeded"))
    run_id, outcome = await through_worker(redis, redis_url, adapter, stream=stream)
    assert outcome.startswith("failed")
    await assert_failed(redis, run_id, "the worker could not handle its answer (RecursionError)")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # the traceback, once, in the log ...
    assert getattr(errors[0], "run", None) == run_id  # ... with the run's fields
    assert adapter.calls == 2  # not tried again: the second call is the next run's


async def test_usage_beyond_redis_s_counters_is_capped_and_the_run_completes(redis: Redis, redis_url: str) -> None:
    """A streamed run whose caller did not ask for usage: the provider's count (packable, but past
    what HINCRBY takes) reaches only the `finish` script, which must not break on it."""
    usage = {**TEXT, "choices": [], "usage": {"prompt_tokens": 2**63 - 1, "completion_tokens": BIG}}
    run_id, outcome = await through_worker(redis, redis_url, Poisoned([[TEXT], [usage]]), stream=True)
    assert outcome == "completed:ok"
    assert await fields(redis, keys.run_record(run_id), "state") == ["completed"]
    assert 0 < await redis.ttl(keys.run_record(run_id))  # the whole end ran (it sets the TTL last)
    totals = await redis.keys(keys.usage_total("") + "*")
    assert totals  # the run's usage was counted for its key ...
    counted = {k.split(b":")[0]: int(v) for total in totals for k, v in (await redis.hgetall(total)).items()
               if k.startswith(b"prompt_tokens") or k.startswith(b"completion_tokens")}
    # ... capped, a run at most MAX_COUNTED_TOKENS; the ordinary run after it streamed one chunk of
    # output and no usage: one completion token
    assert counted == {b"prompt_tokens": MAX_COUNTED_TOKENS, b"completion_tokens": MAX_COUNTED_TOKENS + 1}


async def test_a_provider_error_holding_values_msgpack_cannot_hold_still_ends_the_run(
        redis: Redis, redis_url: str) -> None:
    """A 4xx whose error object holds a huge integer and whose text a lone surrogate: the run
    fails with that error, its text made valid and the object left out."""
    err = ProviderError("provider a answered 400: bad \ud800", status=400, retry=Retry.NO, strikes=0,
                        detail={"message": "bad", "code": BIG})
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Poisoned(error=err)})
    await fails_on_a_worker(redis_url, runner, run_id)
    assert await fields(redis, keys.run_record(run_id), "state", "error_code", "error_message") == [
        "failed", "provider_error", "provider a answered 400: bad \\ud800"]
    failed = (await events(redis, run_id))[-1][1]
    assert failed["status"] == 400 and failed["detail"] is None
    assert await redis.zcard(keys.leases("a")) == 0


@pytest.mark.parametrize("value, phrase", [
    (2**64, "an integer beyond 64 bits"),
    (-(2**63) - 1, "an integer beyond 64 bits"),
    ({"k": "a \udfff"}, "lone UTF-16 surrogate"),
    ({"a \ud800": 1}, "lone UTF-16 surrogate"),
    (deep(3000), "nested deeper than 1024 levels"),
], ids=["above", "below", "value", "key", "deep"])
def test_pack_names_what_msgpack_cannot_hold_in_plain_words(value: Any, phrase: str) -> None:
    with pytest.raises(Unpackable) as caught:
        pack(value)
    assert str(caught.value).startswith(phrase.split(" (")[0]) or phrase in str(caught.value)
    assert "'" not in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)  # (the gateway's `_pack` catches ValueError)


def test_pack_still_holds_the_edges_and_refuses_unknown_types_as_before() -> None:
    assert pack([2**64 - 1, -(2**63), (1, 2), frozenset({3})])
    with pytest.raises(TypeError, match="cannot serialise object"):
        pack(object())


async def test_a_run_whose_failure_cannot_be_handled_still_ends_and_the_task_returns(
        redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last net: ending the attempt raised itself (here the look for another provider, as a
    Redis that drops the connection does): the run is failed plainly, its slot comes back."""
    sched, run_id = await start_one(redis, {"a": 1})
    err = ProviderError("provider a answered 500: boom", status=500, retry=Retry.ELSEWHERE, strikes=1)
    runner = Runner(redis, sched.config, "n-a", {"a": Poisoned(error=err)})

    async def broken(att: Any) -> bool:
        raise KeyError("boom")

    monkeypatch.setattr(runner, "_other_available", broken)
    await fails_on_a_worker(redis_url, runner, run_id)
    state, code, message = await fields(redis, keys.run_record(run_id), "state", "error_code", "error_message")
    assert (state, code) == ("failed", "provider_error")
    assert message == "provider a: the worker failed ending the run (KeyError)"
    assert await redis.zcard(keys.leases("a")) == 0
