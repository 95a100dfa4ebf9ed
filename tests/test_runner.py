"""One attempt on a worker, against a real Redis with a scripted adapter: where a failed run may go
next, opening chunks held back until real output, what the attempt tells the provider's health,
and the probe lock that keeps runs off a provider while a disturbing probe is out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.codec import Unpackable, pack, unpack
from common.config import Config, ProviderConfig, parse_config
from common.policy import Health, why_not
from common.redisconn import Backoff, now_ms
from common.redisline import new_line_of
from common.scripts import Scripts
from common.snapshots import read_snapshots
from common.wire import ErrorCode, ErrorInfo, RunKind, cancelled_by_caller
from gateway.errors import ApiError
from gateway.runs import RunClient
from scheduler.core import GATEWAY_GONE, Scheduler
from tests.conftest import async_wait_until
from tests.test_scheduler import MODEL, beat, make_config, submit, waiting_runs
from workers import metrics as worker_metrics
from workers import runner as runner_module
from workers.adapters.base import DOWN, LastRead, ProbeResult, ProviderError, Retry, not_taken
from workers.adapters.cli import CliAdapter
from workers.adapters.openai_compat import completion_tokens_named, max_tokens_only
from workers.runner import LeaseLost, Runner, refuses_max_completion_tokens

if TYPE_CHECKING:
    from workers.arq_worker import WakeWorker

ROLE = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                        "finish_reason": None}]}
TEXT = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                        "finish_reason": None}]}


class Scripted:
    """A provider that streams the given reads, then raises `error` (if any)."""

    def __init__(self, reads: list[list[dict[str, Any]]], error: ProviderError | None = None) -> None:
        self.reads = reads
        self.error = error
        self.calls = 0

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.calls += 1
        if self.error:
            raise self.error
        return {"object": "chat.completion", "choices": []}

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        self.calls += 1
        for read in self.reads:
            yield read
        if self.error:
            raise self.error

    async def probe(self) -> ProbeResult:
        return ProbeResult(Health.AVAILABLE, strikes=0)

    async def close(self) -> None:
        return None


class Endless(Scripted):
    """A provider whose answer never comes (whole or streamed): `began` once a request is under way."""

    def __init__(self) -> None:
        super().__init__([])
        self.began = asyncio.Event()

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.began.set()
        await asyncio.Event().wait()
        raise AssertionError("never answers")

    async def stream(self, kind: RunKind, body: dict[str, Any],
                     request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        self.began.set()
        await asyncio.Event().wait()
        yield []


async def start_one(redis: Redis, capacities: dict[str, int], stream: bool = True,
                    max_attempts: int = 3) -> tuple[Scheduler, str]:
    config = make_config(capacities, queue={"max_queue": 10, "queue_timeout_ms": 60_000,
                                            "max_attempts": max_attempts})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    if stream:
        await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    return sched, run_id


def node_worker(redis_url: str, runner: Runner | None, **options: Any) -> WakeWorker:
    """A `WakeWorker` of node n-a over the services' own connection pool, with its scripts and its
    wake list's line ready as its `main` makes them (`runner` None: no job may reach a runner)."""
    from arq.worker import func

    from workers.arq_worker import WakeWorker, arq_redis
    from workers.service import run_job

    worker = WakeWorker(functions=[func(run_job, name=keys.JOB_FUNCTION)], queue_name=keys.node_queue("n-a"),
                        wake_key=keys.node_wake("n-a"), runner=lambda: cast(Runner, runner),
                        redis_pool=arq_redis(redis_url), handle_signals=False, **options)
    worker._scripts = Scripts(worker.pool)
    worker._wake_line = new_line_of(worker.pool, "wake")
    return worker


async def chosen_and_other(redis: Redis, run_id: str) -> tuple[str, str]:
    """(the provider the run was dispatched to, the other of a and b)."""
    provider = (await fields(redis, keys.run_record(run_id), "provider"))[0]
    assert provider in ("a", "b")
    return provider, "b" if provider == "a" else "a"


async def events(redis: Redis, run_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f[b"type"].decode(), unpack(f[b"data"])) for _, f in await redis.xrange(keys.run_events(run_id))]


async def fields(redis: Redis, key: str, *names: str) -> list[str | None]:
    return [v.decode() if v else None for v in await redis.hmget(key, *names)]


async def test_opening_chunks_wait_for_output_so_a_stream_cut_before_it_is_tried_again(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    cut = ProviderError("provider a: the stream was cut short ([DONE] without a finish_reason)", retry=Retry.ANY)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[ROLE]], cut)})
    assert await runner.execute(run_id) == "requeued:ok"
    kinds = [k for k, _ in await events(redis, run_id)]
    assert "delta" not in kinds and kinds[-1] == "requeued"  # the caller saw nothing: it may be tried again
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["queued", None]


@pytest.mark.parametrize("batch_ms", [0, 10])
async def test_an_opening_with_usage_cut_before_output_is_tried_again(redis: Redis, batch_ms: int) -> None:
    """An opening chunk that carries `usage` (vLLM's and SGLang's `continuous_usage_stats`), the
    caller asking for usage (as every Responses stream does), then the provider broke off: the
    caller saw no output, so the run goes back to its queue (it failed there, usage counted as
    output)."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3},
                         runtime={"stream_batch_ms": batch_ms})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), mapping={"stream": "1", "body": pack(
        {"model": MODEL, "messages": [], "stream": True, "stream_options": {"include_usage": True}})})
    await sched.dispatch_all()
    opening = {**ROLE, "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}
    cut = ProviderError("provider a: the stream ended before [DONE]", retry=Retry.ANY)
    runner = Runner(redis, config, "n-a", {"a": Scripted([[opening]], cut)})
    assert await runner.execute(run_id) == "requeued:ok"
    kinds = [k for k, _ in await events(redis, run_id)]
    assert "delta" not in kinds and kinds[-1] == "requeued"
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["queued", None]


async def test_an_opening_chunk_goes_out_with_the_first_output(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[ROLE], [TEXT]])})
    assert (await runner.execute(run_id)).startswith("completed")
    deltas = [d["chunks"] for k, d in await events(redis, run_id) if k == "delta"]
    assert deltas == [[ROLE, TEXT]]


async def test_a_stream_with_no_output_says_it_had_no_deltas(redis: Redis) -> None:
    """A streamed run's `completed` says how many deltas there were (README, "Following a run's
    events"), also none: a provider's empty stream ended with no `deltas` at all."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([])})
    assert await runner.execute(run_id) == "completed:ok"
    assert (await events(redis, run_id))[-1] == ("completed", {"deltas": 0})


async def test_a_cancel_that_interrupts_an_emit_redis_ran_says_the_output_went_out(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel (here a dead gateway's, as the scheduler's `orphans` sweep records it) that reaches the
    run's task while it waits for the reply of an `emit` Redis ran: its delta went out, but the
    attempt never heard so, and its `failed` event said `before_output: true` after that delta
    (the reaper's and `end_cancelled`'s read the record's `output`)."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], [text("b")]])})
    why = ErrorInfo(ErrorCode.UNAVAILABLE, GATEWAY_GONE)
    real_call = runner.scripts.call

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        result = await real_call(name, run_keys, args)
        if name == "emit":  # (the reply on its way as the cancel comes: the task is cancelled at its next await)
            runner.cancel(run_id, why)
            await asyncio.sleep(0)
        return result

    monkeypatch.setattr(runner.scripts, "call", call)
    assert await runner.execute(run_id) == "cancelled:ok"
    kinds = [k for k, _ in await events(redis, run_id)]
    assert kinds[-2:] == ["delta", "failed"]
    assert (await events(redis, run_id))[-1][1] == {**why.to_wire(), "before_output": False}
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["cancelled", "1"]
    usage = await redis.hgetall(keys.usage_total("anonymous"))  # (the chunk that went out counts)
    assert usage.get(f"completion_tokens:{MODEL}".encode()) == b"1", usage


async def test_a_stop_that_interrupts_an_emit_redis_ran_fails_the_run_not_requeues_it(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker stops (its grace over) while a run's task waits for the reply of an `emit` Redis
    ran: the attempt, not knowing of its output, asked for a requeue, and the run was put back with
    a delta out and a `requeued` after it (the reaper never requeues a run with output). It fails,
    `worker_lost`, `before_output: false`, and its key counts the output that went out (it counted
    none)."""
    sched, run_id = await start_one(redis, {"a": 1})
    await stopped_after_its_first_emit(Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], [text("b")]])}),
                                       run_id, monkeypatch)
    kinds = [k for k, _ in await events(redis, run_id)]
    assert kinds[-2:] == ["delta", "failed"], kinds
    failed = (await events(redis, run_id))[-1][1]
    assert failed["code"] == "worker_lost" and failed["before_output"] is False
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["failed", "1"]
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0 and await redis.zcard(keys.leases("a")) == 0
    # (its key counts the chunk of output its caller got, as the emit recorded it: the attempt knew of none)
    usage = await redis.hgetall(keys.usage_total("anonymous"))
    assert usage.get(f"completion_tokens:{MODEL}".encode()) == b"1", usage


async def stopped_after_its_first_emit(runner: Runner, run_id: str, monkeypatch: pytest.MonkeyPatch,
                                      first: Callable[[], Awaitable[Any]] | None = None) -> None:
    """`runner` runs `run_id`, and the worker stops (its grace over: the run's task cancelled) while
    the reply of the run's first `emit`, which Redis ran, is on its way (after `first`, if given)."""
    real_call = runner.scripts.call
    stopped: list[bool] = []

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        result = await real_call(name, run_keys, args)
        if name == "emit" and not stopped:
            if first is not None:
                await first()
            task = asyncio.current_task()
            assert task is not None
            stopped.append(task.cancel())
            await asyncio.sleep(0)
        return result

    monkeypatch.setattr(runner.scripts, "call", call)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(runner.execute(run_id))


def before_scripts(runner: Runner, monkeypatch: pytest.MonkeyPatch, before: Callable[[str], None]) -> None:
    """`before(name)` is called before each script the runner calls from now on (what it raises, the
    call raises: it never reaches Redis)."""
    real_call = runner.scripts.call

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        before(name)
        return await real_call(name, run_keys, args)

    monkeypatch.setattr(runner.scripts, "call", call)


def script_calls(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the scripts the runner calls from now on, in order."""
    names: list[str] = []
    before_scripts(runner, monkeypatch, names.append)
    return names


async def test_a_stream_s_last_reads_go_out_with_its_end_in_one_redis_call(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a",
                    {"a": Scripted([[ROLE, TEXT], LastRead([text("b")]), LastRead([text("c")])])})
    called = script_calls(runner, monkeypatch)
    assert await runner.execute(run_id) == "completed:ok"
    assert called == ["start", "emit", "finish"]
    assert [k for k, _ in await events(redis, run_id)][-3:] == ["delta", "delta", "completed"]
    assert await deltas(redis, run_id) == [[ROLE, TEXT], [text("b"), text("c")]]
    # (each delta says its number, the end how many there were: the gateway finds one Redis lost or holds twice)
    assert [(d.get("n"), d.get("deltas")) for _, d in (await events(redis, run_id))[-3:]] == [
        (1, None), (2, None), (None, 2)]
    # (and its attempt, a number as `started` says it)
    assert [d.get("a") for _, d in (await events(redis, run_id))[-3:-1]] == [1, 1]
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["completed", "1"]


async def test_a_run_s_write_tried_again_through_an_outage_warns_once_not_each_try(
        redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every running run logged a WARNING at each try while Redis was down or read-only: 14-17 lines
    a second from a worker of 12 streams (a fault review). Its first failure warns; the tries after
    it are DEBUG."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    monkeypatch.setattr(runner_module, "Backoff", lambda *args, **kwargs: Backoff(first=0.001, cap=0.001))
    real_call = runner.scripts.call
    refused = 0

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        nonlocal refused
        if name == "emit" and refused < 5:
            refused += 1
            raise RedisConnectionError("Connection refused")
        return await real_call(name, run_keys, args)

    monkeypatch.setattr(runner.scripts, "call", call)
    with caplog.at_level(logging.DEBUG, "iop.worker"):
        assert (await runner.execute(run_id)).startswith("completed")
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "Redis unavailable while" in r.getMessage()]
    assert refused == 5 and [level for level, _ in said] == ["WARNING"] + ["DEBUG"] * 4, said


async def test_a_lease_renewal_refused_through_an_outage_warns_once_not_each_try(
        redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each running run's renewal logged a WARNING every third of the lease while Redis was away."""
    from tests.test_cancel import StallingAdapter, dispatched_run

    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=600)  # (renewed every 200 ms)
    runner = Runner(redis, client.config, "n-a", {"a": StallingAdapter()})
    renewals = 0

    def before(name: str) -> None:
        nonlocal renewals
        if name == "renew":
            renewals += 1
            if renewals <= 4:
                raise RedisConnectionError("Connection refused")

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    async def renewed_again() -> bool:
        return renewals > 5

    before_scripts(runner, monkeypatch, before)
    with caplog.at_level(logging.DEBUG, "iop.worker"):
        execution = asyncio.create_task(runner.execute(run_id))
        await async_wait_until(running, what="the run to start")
        await redis.zadd(keys.leases("a"), {run_id: now_ms() + 60_000}, xx=True)  # (it outlives the refusals)
        await async_wait_until(renewed_again, what="renewals after the refused ones")
        assert await client.cancel(run_id, MODEL, "enough") == "signalled"
        assert await execution == "cancelled:ok"
    said = [r.levelname for r in caplog.records if "lease renewal failed" in r.getMessage()]
    assert said == ["WARNING"] + ["DEBUG"] * 3, said


class _Back:
    """A worker's watch for Redis answering again (`common.comeback.Comeback`), told by the test."""

    def __init__(self) -> None:
        self.back = asyncio.Event()

    async def pause(self, backoff: Backoff) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(backoff.take()):
                await self.back.wait()


async def test_a_lease_renewal_refused_in_an_outage_is_made_again_when_redis_answers_not_a_period_later(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault review: a renewal refused while Redis was away (restarted with AOF, a failover) was
    tried again only a third of `lease_ttl_ms` later. A lease with less than that left when Redis
    came back expired meanwhile: a scheduler reaped it and the live stream failed `worker_lost`
    (3 s of Redis restart with 5 s leases, real processes), though the README lets an outage up to
    the lease ride out. It is made again once Redis answers."""
    from tests.test_cancel import StallingAdapter, dispatched_run

    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=9_000)  # (renewed every 3 s)
    back = _Back()
    runner = Runner(redis, client.config, "n-a", {"a": StallingAdapter()}, comeback=back)  # type: ignore[arg-type]
    refused = 0

    def before(name: str) -> None:
        nonlocal refused
        if name == "renew" and not back.back.is_set():
            refused += 1
            raise RedisConnectionError("Connection refused")

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    before_scripts(runner, monkeypatch, before)
    execution = asyncio.create_task(runner.execute(run_id))
    try:
        await async_wait_until(running, what="the run to start")
        await async_wait_until(lambda: asyncio.sleep(0, refused >= 1), what="a renewal refused")
        # what the lease has left when Redis answers again: less than a renewal's period
        left_until = now_ms() + 2_500
        await redis.zadd(keys.leases("a"), {run_id: left_until}, xx=True)
        back.back.set()

        async def renewed() -> bool:
            score = await redis.zscore(keys.leases("a"), run_id)
            return score is not None and score > left_until

        await async_wait_until(renewed, timeout=10, what="the lease renewed once Redis answered")
        assert not execution.done()
        assert await client.cancel(run_id, MODEL, "enough") == "signalled"
        assert await execution == "cancelled:ok"
    finally:
        execution.cancel()
        await asyncio.gather(execution, return_exceptions=True)


async def test_a_provider_sending_on_after_its_last_read_gets_no_more_held_than_max_opening(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    after = [LastRead([text(str(n))]) for n in range(runner_module.MAX_OPENING + 6)]
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], *after])})
    called = script_calls(runner, monkeypatch)
    assert await runner.execute(run_id) == "completed:ok"
    assert called == ["start", "emit", "emit", "finish"]
    assert [len(d) for d in await deltas(redis, run_id)] == [1, runner_module.MAX_OPENING, 6]


async def test_a_stream_found_cut_after_its_last_read_shows_that_read_before_the_error(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    cut = ProviderError("provider a: the stream was cut short ([DONE] without a finish_reason)", retry=Retry.ANY)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], LastRead([text("b")])], cut)})
    assert (await runner.execute(run_id)).startswith("failed")  # (output went out: not tried again)
    assert await deltas(redis, run_id) == [[TEXT], [text("b")]]
    assert (await events(redis, run_id))[-1][0] == "failed"


@pytest.mark.parametrize("batch_ms", [0, 1])
async def test_a_stream_s_last_read_past_max_events_per_run_fails_the_run_as_an_emit_would(
        redis: Redis, batch_ms: int) -> None:
    config = make_config({"a": 1}, runtime={"max_events_per_run": 10, "stream_batch_ms": batch_ms})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    room = 10 - await redis.xlen(keys.run_events(run_id)) - 1  # (the `started` event comes first)
    paced = Paced([*([text(str(n))] for n in range(room)), LastRead([text("z")])])
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    run = asyncio.create_task(runner.execute(run_id))
    for n, gate in enumerate(paced.gates):  # each read goes out alone
        gate.set()
        if n < room:
            await async_wait_until(partial(_delta_count, redis, run_id, n + 1), what=f"read {n} out")
    assert (await run).startswith("failed")
    assert await fields(redis, keys.run_record(run_id), "error_code") == ["output_too_large"]
    assert len(await deltas(redis, run_id)) == room and (await events(redis, run_id))[-1][0] == "failed"


class Paced:
    """A provider whose reads come when the test lets them: read k once `gates[k]` is set."""

    def __init__(self, reads: list[list[dict[str, Any]]], error: ProviderError | None = None) -> None:
        """`error`: raised after the last read, once the gate after the last read's is set."""
        self.reads = reads
        self.error = error
        self.gates = [asyncio.Event() for _ in range(len(reads) + (error is not None))]
        self.asked = 0  # reads asked for so far (the runner is done with those before)
        self.closed = False

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        try:
            for n, read in enumerate(self.reads):
                self.asked = n + 1
                await self.gates[n].wait()
                yield read
            if self.error is not None:
                self.asked += 1
                await self.gates[-1].wait()
                raise self.error
        finally:
            self.closed = True

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        raise AssertionError("the runs here are streamed")

    async def probe(self) -> ProbeResult:
        return ProbeResult(Health.AVAILABLE, strikes=0)

    async def close(self) -> None:
        return None


def text(t: str) -> dict[str, Any]:
    return {**TEXT, "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}


async def start_batched(redis: Redis, batch_ms: int) -> tuple[Scheduler, str]:
    config = make_config({"a": 1}, runtime={"stream_batch_ms": batch_ms})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    return sched, run_id


async def deltas(redis: Redis, run_id: str) -> list[list[dict[str, Any]]]:
    return [d["chunks"] for k, d in await events(redis, run_id) if k == "delta"]


async def test_with_stream_batch_ms_a_stream_s_last_read_goes_out_with_its_end(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    sched, run_id = await start_batched(redis, 10_000)
    paced = Paced([[ROLE, text("a")], LastRead([text("b")])])
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    called = script_calls(runner, monkeypatch)
    run = asyncio.create_task(runner.execute(run_id))
    paced.gates[0].set()
    await async_wait_until(partial(_delta_count, redis, run_id, 1), what="the first output, at once")
    paced.gates[1].set()
    assert await run == "completed:ok"
    assert called == ["start", "emit", "finish"]
    assert await deltas(redis, run_id) == [[ROLE, text("a")], [text("b")]]


async def test_with_stream_batch_ms_the_first_output_goes_at_once_and_later_output_together(redis: Redis) -> None:
    sched, run_id = await start_batched(redis, 10_000)
    paced = Paced([[ROLE, text("a")], [text("b")], [text("c")], [{**text("d"), "usage": None}]])
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    run = asyncio.create_task(runner.execute(run_id))
    paced.gates[0].set()

    async def first_out() -> bool:
        return await deltas(redis, run_id) == [[ROLE, text("a")]]

    await async_wait_until(first_out, what="the first output, at once")
    for n in (1, 2):
        paced.gates[n].set()
        await async_wait_until(partial(_asked, paced, n + 2), what=f"read {n} taken")
    assert await deltas(redis, run_id) == [[ROLE, text("a")]]  # held: less than stream_batch_ms since
    paced.gates[3].set()  # the last read: the stream ends, and what is held goes out at once
    assert (await run).startswith("completed")
    assert await deltas(redis, run_id) == [[ROLE, text("a")], [text("b"), text("c"), text("d")]]


async def _asked(paced: Paced, n: int) -> bool:
    return paced.asked >= n


async def _delta_count(redis: Redis, run_id: str, n: int) -> bool:
    return len(await deltas(redis, run_id)) >= n


async def test_held_output_goes_out_after_stream_batch_ms_even_if_the_provider_says_nothing_more(
        redis: Redis) -> None:
    sched, run_id = await start_batched(redis, 50)
    paced = Paced([[text("a")], [text("b")], [text("c")]])
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    run = asyncio.create_task(runner.execute(run_id))
    paced.gates[0].set()
    paced.gates[1].set()  # (comes within the window, or after it: either way it goes out without read 2)

    async def both_out() -> bool:
        return [c for d in await deltas(redis, run_id) for c in d] == [text("a"), text("b")]

    await async_wait_until(both_out, what="the held output, at stream_batch_ms")
    assert paced.asked == 3 and not paced.gates[2].is_set()  # while the provider's next read is still out
    paced.gates[2].set()
    assert (await run).startswith("completed")
    assert [c for d in await deltas(redis, run_id) for c in d] == [text("a"), text("b"), text("c")]


async def cancelled_while_held(redis: Redis, first: list[dict[str, Any]]) -> tuple[str, Paced]:
    """A batched stream whose first read (`first`) went out and whose second is held, cancelled:
    (its run id, its provider)."""
    sched, run_id = await start_batched(redis, 10_000)
    paced = Paced([first, [text("b")], [text("c")]])
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    run = asyncio.create_task(runner.execute(run_id))
    paced.gates[0].set()
    await async_wait_until(lambda: _delta_count(redis, run_id, 1), what="the first output")
    paced.gates[1].set()
    await async_wait_until(lambda: _asked(paced, 3), what="read 1 taken and held")
    assert runner.cancel(run_id, ErrorInfo(ErrorCode.CANCELLED, "cancelled by the caller"))
    assert (await run).startswith("cancelled")
    return run_id, paced


async def test_a_run_cancelled_while_output_is_held_ends_and_closes_the_provider_stream(redis: Redis) -> None:
    run_id, paced = await cancelled_while_held(redis, [text("a")])
    assert paced.closed  # the request to the provider was closed
    assert await deltas(redis, run_id) == [[text("a")]]  # (what was held never reached the caller)


async def counted_tokens(redis: Redis) -> tuple[int, int]:
    """(prompt, completion) tokens counted for every key, for good (`iop:usage-total:*`)."""
    prompt = completion = 0
    for total in await redis.keys(keys.usage_total("") + "*"):
        for field, value in (await redis.hgetall(total)).items():
            if field.startswith(b"prompt_tokens:"):
                prompt += int(value)
            elif field.startswith(b"completion_tokens:"):
                completion += int(value)
    return prompt, completion


async def test_a_run_cancelled_after_output_counts_the_tokens_its_caller_got(redis: Redis) -> None:
    """A caller that left just before its stream's end (no usage chunk yet) had its tokens counted
    as none: one completion token is counted for each output chunk it got (not what was held)."""
    run_id, _ = await cancelled_while_held(redis, [ROLE, text("a")])
    assert await deltas(redis, run_id) == [[ROLE, text("a")]]
    assert await counted_tokens(redis) == (0, 1)  # ("a"; not the opening, nor the held "b")


async def test_a_completed_stream_without_usage_counts_its_output_chunks(redis: Redis) -> None:
    """llama-cpp-python's streams carry no usage: such a run counted no tokens, less than a caller
    who left before its end (a review)."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[ROLE], [TEXT], [TEXT, TEXT]])})
    assert (await runner.execute(run_id)).startswith("completed")
    assert await counted_tokens(redis) == (0, 3)


def choice_chunk(i: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": i, "delta": delta, "finish_reason": finish}]}


def legacy_chunk(t: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": finish}]}


@pytest.mark.parametrize("case", ["one choice", "two choices", "legacy"])
async def test_a_stream_without_usage_counts_only_its_chunks_of_output(redis: Redis, case: str) -> None:
    """A choice's opening and its finish chunk (vLLM's, empty content) carry no output: each counted
    a completion token once the output had begun, 7 for two choices of two tokens each (a review)."""
    reads = {
        "one choice": [[ROLE], [text("a")], [text("b")], [choice_chunk(0, {"content": ""}, "stop")]],
        "two choices": [[choice_chunk(0, {"role": "assistant"}), choice_chunk(0, {"content": "a"})],
                        [choice_chunk(1, {"role": "assistant"})], [choice_chunk(1, {"content": "b"})],
                        [choice_chunk(0, {"content": "c"})], [choice_chunk(1, {"content": "d"})],
                        [choice_chunk(0, {}, "stop")], [choice_chunk(1, {}, "stop")]],
        "legacy": [[legacy_chunk("a")], [legacy_chunk("b")], [legacy_chunk("", "stop")]],
    }[case]
    sched, run_id = await start_one(redis, {"a": 1})
    assert (await Runner(redis, sched.config, "n-a", {"a": Scripted(reads)}).execute(run_id)).startswith("completed")
    assert await counted_tokens(redis) == (0, 4 if case == "two choices" else 2)


@pytest.mark.parametrize("batch_ms", [0, 10])
async def test_a_stream_broken_off_after_output_counts_its_last_usage_or_its_chunks(
        redis: Redis, batch_ms: int) -> None:
    """The provider broke off after output (the run fails): the usage its stream carried last
    (vLLM's continuous_usage_stats) is counted, and at least a token for each output chunk."""
    config = make_config({"a": 1}, runtime={"stream_batch_ms": batch_ms})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    with_usage = {**TEXT, "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}
    cut = ProviderError("provider a: the stream ended before [DONE]", retry=Retry.ANY)
    paced = Paced([[ROLE], [with_usage], [TEXT], [TEXT]], cut)
    run = asyncio.create_task(Runner(redis, config, "n-a", {"a": paced}).execute(run_id))
    paced.gates[0].set()
    paced.gates[1].set()
    await async_wait_until(lambda: _delta_count(redis, run_id, 1), what="the first output")
    for gate in paced.gates[2:]:
        gate.set()
    assert (await run).startswith("failed")
    assert await counted_tokens(redis) == (7, 3)


async def test_output_held_when_the_provider_fails_reaches_the_caller_before_the_error(redis: Redis) -> None:
    sched, run_id = await start_batched(redis, 10_000)
    broke = ProviderError("provider a: the stream ended before [DONE]", retry=Retry.ANY, strikes=1)
    paced = Paced([[text("a")], [text("b")]], broke)
    runner = Runner(redis, sched.config, "n-a", {"a": paced})
    run = asyncio.create_task(runner.execute(run_id))
    paced.gates[0].set()
    await async_wait_until(lambda: _delta_count(redis, run_id, 1), what="the first output")
    paced.gates[1].set()
    paced.gates[2].set()
    assert (await run).startswith("failed")  # (output went out: it is not tried again)
    assert await deltas(redis, run_id) == [[text("a")], [text("b")]]
    assert (await events(redis, run_id))[-1][0] == "failed"


async def test_so_many_opening_chunks_go_out_without_waiting_for_output(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    reads = [[ROLE]] * (runner_module.MAX_OPENING + 6) + [[TEXT]]
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted(reads)})
    assert (await runner.execute(run_id)).startswith("completed")
    sent = await deltas(redis, run_id)
    assert sent[0] == [ROLE] * runner_module.MAX_OPENING  # held no further
    assert [c for d in sent for c in d] == [ROLE] * (runner_module.MAX_OPENING + 6) + [TEXT]


async def test_a_server_error_goes_back_only_when_another_provider_is_available(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    err = ProviderError(f"provider {provider} answered 500: boom", status=500, retry=Retry.ELSEWHERE)
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], err)})
    assert await runner.execute(run_id) == "requeued:ok"
    entry = (await redis.xrange(keys.runs_stream(MODEL)))[0][1]
    assert entry[b"exclude"] == b"1" and entry[b"tried"] == provider.encode()
    # the scheduler sends it to the other provider only, even with the first one free
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "provider", "state") == [other, "dispatched"]

    # the other one fails the same way: nowhere left to go, the run fails with that error
    err = ProviderError(f"provider {other} answered 500: boom", status=500, retry=Retry.ELSEWHERE)
    runner = Runner(redis, sched.config, f"n-{other}", {other: Scripted([], err)})
    assert (await runner.execute(run_id)).startswith("failed")
    assert await fields(redis, keys.run_record(run_id), "state", "error_message") == [
        "failed", f"provider {other} answered 500: boom"]


@pytest.mark.parametrize("lacks", ["provider", "model", "provider anywhere"])
async def test_a_run_a_worker_of_another_config_cannot_serve_goes_back_to_its_queue(redis: Redis, lacks: str) -> None:
    """The scheduler's config and the worker's differ (a rollout half done: the provider moved to
    another node, or the model left): the run is queued again while it has attempts, as a lost
    one, then fails saying which the worker lacks; not a provider's fault (no suspect, no strike).
    It failed at once, blaming the provider ("not served by node")."""
    sched, run_id = await start_one(redis, {"a": 1}, max_attempts=2)
    config = sched.config
    adapters: dict[str, Any] = {"a": Scripted([[TEXT]])}
    if lacks == "provider":
        adapters = {}
    elif lacks == "provider anywhere":  # (renamed in the worker's config: z)
        adapters = {}
        config = parse_config({"models": [{"id": MODEL, "providers": {"z": "z-name"}}],
                               "nodes": [{"id": "n-a", "providers": [{"id": "z", "type": "vllm", "capacity": 1,
                                                                      "base_url": "http://127.0.0.1:9",
                                                                      "models": ["z-name"]}]}]})
    else:
        config = parse_config({"models": [{"id": "another", "providers": {"a": "a-name"}}],
                               "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "vllm", "capacity": 1,
                                                                      "base_url": "http://127.0.0.1:9",
                                                                      "models": ["a-name"]}]}]})
    why = (f"model '{MODEL}' is not in the config of node n-a's worker" if lacks == "model"
           else "provider a is not on node n-a in its worker's config")  # (the model is there, z its provider)
    assert await Runner(redis, config, "n-a", adapters).execute(run_id) == "requeued:ok"
    assert await fields(redis, keys.run_record(run_id), "state", "suspects") == ["queued", None]
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert (await Runner(redis, config, "n-a", adapters).execute(run_id)).startswith("failed")
    assert await fields(redis, keys.run_record(run_id), "state", "error_code", "error_message") == [
        "failed", "service_unavailable", why]
    assert await redis.hget(keys.heartbeat("a"), "fails") in (None, b"0")


async def test_a_server_error_fails_at_once_when_only_providers_that_would_refuse_the_run_are_left(
        redis: Redis) -> None:
    """The other provider is available but would refuse the run (its record's `refuse`, from
    `gateway.refusals`): nothing is left to try, so the run fails with the error now, not sent back
    to wait in its queue for a provider it never goes to."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    await redis.hset(keys.run_record(run_id), "refuse", other)
    err = ProviderError(f"provider {provider} answered 500: boom", status=500, retry=Retry.ELSEWHERE)
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], err)})
    assert (await runner.execute(run_id)).startswith("failed")
    assert await fields(redis, keys.run_record(run_id), "state", "error_message") == [
        "failed", f"provider {provider} answered 500: boom"]


@pytest.mark.parametrize("gone", ["unavailable", "drained", "cordoned", "capacity 0"])
async def test_a_server_error_with_no_available_provider_left_fails_at_once(redis: Redis, gone: str) -> None:
    """(A drained provider, a cordoned node, a capacity of 0: the run sent back for it would wait
    in its queue until its timeout, not get the error.)"""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    if gone == "unavailable":
        await redis.hset(keys.heartbeat(other), "health", "unavailable")
    elif gone == "drained":
        await redis.set(keys.drained(other), "1")
    elif gone == "cordoned":
        await redis.set(keys.cordoned(f"n-{other}"), "1")
    else:
        await redis.set(keys.capacity_override(other), "0")
    err = ProviderError(f"provider {provider} answered 503: overloaded", status=503, retry=Retry.ELSEWHERE)
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], err)})
    assert (await runner.execute(run_id)).startswith("failed")
    assert await redis.xlen(keys.runs_stream(MODEL)) == 0


@pytest.mark.parametrize("status", [500, 429])
async def test_a_requeued_run_whose_other_providers_went_down_fails_instead_of_waiting(redis: Redis,
                                                                                      status: int) -> None:
    """(After a busy provider's 429, the caller's answer is a busy one's too: a 503 that says when to
    try again; found by a review, it was a bare 502.)"""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    err = ProviderError(f"provider {provider} answered {status}: boom", status=status, retry=Retry.ELSEWHERE)
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], err)})
    assert await runner.execute(run_id) == "requeued:ok"
    await redis.hset(keys.heartbeat(other), "health", "unavailable")  # between requeue and dispatch
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    state, message = await fields(redis, keys.run_record(run_id), "state", "error_message")
    failed = ErrorInfo.from_wire([data for kind, data in await events(redis, run_id) if kind == "failed"][0])
    answer = ApiError.from_info(failed)
    assert state == "failed" and message == (f"{provider} could not serve the run (a server error, too busy, no answer "
                                             f"in time, or a request it does not take) and no other provider of model "
                                             f"'{MODEL}' is available")
    assert (answer.status, answer.headers.get("Retry-After")) == ((503, "1") if status == 429 else (502, None))


async def test_a_request_a_cli_provider_does_not_take_goes_to_another_provider_with_no_strike(
        redis: Redis) -> None:
    """A chat with tools that landed on a cli provider (it would have dropped them) goes to the
    model's other provider, and tells nothing of the cli provider's health; where no other is left,
    the caller gets the refusal as its 400, naming the field."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1}, stream=False)
    record = keys.run_record(run_id)
    body = unpack(await redis.hget(record, "body"))
    body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    await redis.hset(record, "body", pack(body))
    provider, other = await chosen_and_other(redis, run_id)

    def cli(pid: str) -> CliAdapter:
        return CliAdapter(ProviderConfig.model_validate(
            {"id": pid, "type": "cli", "command": ["iop-never-run"], "capacity": 1, "models": [f"{pid}-name"]}))

    struck: list[str] = []
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: cli(provider)}, on_strike=struck.append)
    assert await runner.execute(run_id) == "requeued:ok"
    entry = (await redis.xrange(keys.runs_stream(MODEL)))[0][1]
    assert entry[b"exclude"] == b"1" and entry[b"tried"] == provider.encode()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, record, "provider", "state") == [other, "dispatched"]

    runner = Runner(redis, sched.config, f"n-{other}", {other: cli(other)}, on_strike=struck.append)
    assert (await runner.execute(run_id)).startswith("failed")
    assert await fields(redis, record, "state", "error_message") == [
        "failed", f"provider {other}: a cli provider does not call tools"]
    failed = [data for etype, data in await events(redis, run_id) if etype == "failed"]
    assert failed[-1]["status"] == 400 and failed[-1]["detail"]["param"] == "tools"
    assert struck == [] and await fields(redis, keys.heartbeat(provider), "fails") == [None]


async def test_attempts_leave_their_evidence_in_the_heartbeat(redis: Redis) -> None:
    struck: list[str] = []
    lived: list[str] = []
    sched, run_id = await start_one(redis, {"a": 1}, max_attempts=1)
    refused = ProviderError("provider a: connection refused", retry=Retry.ANY, strikes=DOWN)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([], refused)}, on_strike=struck.append,
                    on_life=lived.append)
    assert (await runner.execute(run_id)).startswith("failed")
    assert await fields(redis, keys.heartbeat("a"), "fails", "fail_reason") == [
        str(DOWN), "provider a: connection refused"]
    assert struck == ["a"] and lived == []
    # down now, not at the next beat: a run put back is not dispatched there meanwhile
    assert await fields(redis, keys.heartbeat("a"), "health", "reason") == [
        "unavailable", "provider a: connection refused"]

    await beat(redis, sched.config)
    sched, run_id = await start_one(redis, {"a": 1})
    # (down since it was dispatched: a run from before a server's restart that ends well)
    await redis.hset(keys.heartbeat("a"), mapping={"fails": DOWN, "health": "unavailable", "reason": "refused"})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])}, on_strike=struck.append,
                    on_life=lived.append)
    assert (await runner.execute(run_id)).startswith("completed")
    fails, ok_ms = await fields(redis, keys.heartbeat("a"), "fails", "ok_ms")
    assert fails == "0" and ok_ms is not None and lived == ["a"]
    assert await redis.hmget(keys.heartbeat("a"), "health", "reason") == [b"available", b""]

    # a strike short of DOWN leaves the health to the beat's judgement (available, a sign of life seen)
    sched, run_id = await start_one(redis, {"a": 1}, max_attempts=1)
    reset = ProviderError("provider a: the connection was reset", retry=Retry.ANY, strikes=1)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([], reset)})
    assert (await runner.execute(run_id)).startswith("failed")
    assert await fields(redis, keys.heartbeat("a"), "fails", "health") == ["1", "available"]


async def test_a_run_s_end_writes_a_sign_of_life_only_when_the_last_is_older_than_a_quarter_probe_interval(
        redis: Redis) -> None:
    """A busy provider costs a read per run, not a write; a strike is always reset; the probe
    interval (5 s by default) decides how fresh is fresh (1 s at most)."""
    async def end_one(ok_ms: int | None, fails: int = 0) -> str | None:
        sched, run_id = await start_one(redis, {"a": 1}, max_attempts=1)
        hb = keys.heartbeat("a")
        if ok_ms is not None:
            await redis.hset(hb, mapping={"ok_ms": ok_ms, "fails": fails})
        runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
        assert (await runner.execute(run_id)).startswith("completed")
        ok, left = await fields(redis, hb, "ok_ms", "fails")
        assert left == "0"
        await redis.flushdb()
        return ok

    now = await redis.time()
    now_ms = now[0] * 1000 + now[1] // 1000
    assert await end_one(now_ms - 300) == str(now_ms - 300)  # fresh: left as it was
    assert int(await end_one(now_ms - 5000) or 0) >= now_ms  # older than 1 s: written
    assert int(await end_one(now_ms - 300, fails=2) or 0) >= now_ms  # strikes: written, and reset
    assert int(await end_one(None) or 0) >= now_ms  # none yet: written


async def test_no_run_is_dispatched_while_a_disturbing_probe_is_out(redis: Redis) -> None:
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000})
    await beat(redis, config)
    scripts = Scripts(redis)
    probe_keys = [keys.heartbeat("a"), keys.leases("a"), keys.probing("a")]
    assert await scripts.call("probe", probe_keys, [1000, 1, 5000, 60_000, 3, 1000]) == 1
    assert await scripts.call("probe", probe_keys, [1000, 1, 5000, 60_000, 3, 1000]) == 0  # claimed already
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "state") == ["queued"]
    await scripts.call("probed", [keys.heartbeat("a"), keys.probing("a")],
                       ["ok", 0, "", "available", '["a-name"]', keys.SCHEDULER_SIGNALS])
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "state") == ["dispatched"]
    # and with the run in flight, no exclusive probe is claimed, however old the evidence
    await redis.hset(keys.heartbeat("a"), mapping={"ok_ms": 0, "probe_ms": 0})
    assert await scripts.call("probe", probe_keys, [1000, 1, 5000, 60_000, 3, 1000]) == 0
    assert await scripts.call("probe", probe_keys, [1000, 0, 5000, 60_000, 3, 1000]) == 1  # a harmless probe may go


async def test_a_provider_runs_took_down_is_probed_at_once_however_recent_its_last_sign_of_life(
        redis: Redis) -> None:
    """Strikes from runs say "check now": one caller's request that breaks every server's answer
    (sent again by its client) took a model's providers down until their next probe interval."""
    config = make_config({"a": 1})
    await beat(redis, config)
    scripts = Scripts(redis)
    probe_keys = [keys.heartbeat("a"), keys.leases("a"), keys.probing("a")]
    now = await redis.time()
    now_ms = now[0] * 1000 + now[1] // 1000
    args = [60_000, 0, 5000, 60_000, 3, 1000]  # probe interval 60 s, 1 s once down
    # alive a moment ago, two strikes since: not down, so no probe before the interval
    await redis.hset(keys.heartbeat("a"), mapping={"ok_ms": now_ms - 10, "probe_ms": 0, "fails": 2,
                                                   "fail_ms": now_ms})
    assert await scripts.call("probe", probe_keys, args) == 0
    # the third strike takes it down: probed at once, then again after the down interval
    await redis.hset(keys.heartbeat("a"), mapping={"fails": 3})
    assert await scripts.call("probe", probe_keys, args) == 1
    assert await scripts.call("probe", probe_keys, args) == 0
    await redis.hset(keys.heartbeat("a"), mapping={"probe_ms": now_ms - 1500})
    assert await scripts.call("probe", probe_keys, args) == 1
    # the probe passed (a sign of life resets the strikes): back to the interval
    await scripts.call("probed", [keys.heartbeat("a"), keys.probing("a")],
                       ["ok", 0, "", "available", "-", keys.SCHEDULER_SIGNALS])
    await redis.hset(keys.heartbeat("a"), mapping={"probe_ms": now_ms - 1500})
    assert await scripts.call("probe", probe_keys, args) == 0


async def test_a_run_whose_lease_is_gone_is_left_to_the_reaper_not_cancelled(redis: Redis) -> None:
    from tests.test_cancel import StallingAdapter, dispatched_run

    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=150)
    adapter = StallingAdapter()
    runner = Runner(redis, client.config, "n-a", {"a": adapter})
    execution = asyncio.create_task(runner.execute(run_id))

    async def running() -> bool:
        return bool(await redis.hget(keys.run_record(run_id), "state") == b"running")

    await async_wait_until(running, what="the run to start")
    await redis.zrem(keys.leases("a"), run_id)  # as if its lease had expired and been taken
    assert await execution == "lease_lost" and adapter.closed.is_set()
    assert await redis.hget(keys.run_record(run_id), "state") == b"running"  # untouched: the reaper's now


async def test_a_run_s_record_and_events_expire_at_every_step(redis: Redis) -> None:
    # Only enqueue, dispatch and the end of an attempt set the TTLs; start and each event leave
    # them: the one dispatch set outlasts the attempt (run_ttl_s > queue + execution timeouts).
    from tests.test_cancel import StallingAdapter, dispatched_run

    client, sched, run_id = await dispatched_run(redis, lease_ttl_ms=600)  # renewal sees the cancel
    ttl_s = client.config.runtime.run_ttl_s
    record, run_events = keys.run_record(run_id), keys.run_events(run_id)

    async def ttls() -> list[int]:
        return [await redis.ttl(record), await redis.ttl(run_events)]

    assert all(0 < t <= ttl_s for t in await ttls())  # dispatched
    execution = asyncio.create_task(Runner(redis, client.config, "n-a", {"a": StallingAdapter()}).execute(run_id))

    async def running() -> bool:
        return bool(await redis.hget(record, "state") == b"running")

    await async_wait_until(running, what="the run to start")
    assert all(0 < t <= ttl_s for t in await ttls())  # running
    await redis.expire(record, 100)
    await redis.expire(run_events, 100)
    assert await client.cancel(run_id, MODEL, "enough") == "signalled"
    assert await execution == "cancelled:ok"
    assert all(ttl_s - 5 < t <= ttl_s for t in await ttls())  # its end set them again


async def test_a_worker_takes_a_job_and_its_run_ends_with_the_job_off_the_queue(redis: Redis,
                                                                               redis_url: str) -> None:
    """The `take` script claims the job and starts the run in one trip; `finish` takes the job
    off the node's queue (before a requeue: the next dispatch queues a job of the same id)."""
    from arq.constants import in_progress_key_prefix


    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    assert await redis.zscore(keys.node_queue("n-a"), run_id) is not None
    err = ProviderError("provider a: connection refused", retry=Retry.ANY, strikes=1)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([], err)})
    worker = node_worker(redis_url, runner)
    try:
        await worker.claim_and_start([run_id, "run_unknown"])
        assert list(worker.tasks) == [run_id]
        assert await worker.tasks[run_id] == "requeued:ok"
        assert await redis.zscore(keys.node_queue("n-a"), run_id) is None  # off the queue ...
        assert not await redis.exists(in_progress_key_prefix + run_id)
        assert await fields(redis, keys.run_record(run_id), "state", "attempts") == ["queued", "1"]
        await sched.read_new(block_ms=10)
        await sched.dispatch_all()  # ... so the next attempt's job is queued and stays
        assert await redis.zscore(keys.node_queue("n-a"), run_id) is not None
        assert await fields(redis, keys.run_record(run_id), "state", "attempts") == ["dispatched", "2"]
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_full_worker_whose_job_just_ended_gets_its_slot_back(redis_url: str) -> None:
    """The race that stuck a one-slot worker for good (seen in the keep-alive end-to-end test about
    one run in eight): a job's task ends while the worker waits on it with a timeout, so the
    worker sees no running task but still counts the slot taken until the task's done callback
    runs. Its wait step must give the event loop a turn for that callback."""


    worker = node_worker(redis_url, None, max_jobs=1)  # no job reaches a runner
    try:
        await worker.sem.acquire()
        worker.job_counter = 1  # as `claim_and_start` counts a job; its task is done, its callback pending
        asyncio.get_running_loop().call_soon(worker._release_sem_dec_counter_on_complete)
        assert await worker._wait_for_work() is True
        assert worker.job_counter == 0  # the slot is back: the next wait takes a job
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_non_stream_run_s_answer_is_its_output(redis: Redis) -> None:
    """A completed non-stream run sent its caller the answer (its `completed` event): its record says
    `output` as a stream's does (the runs API showed `output: false` for it; found in an audit)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([])})
    assert (await runner.execute(run_id)).startswith("completed")
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["completed", "1"]


class NoStreamOptions(Scripted):
    """A provider that refuses `stream_options` as an older Azure OpenAI does."""

    def __init__(self) -> None:
        super().__init__([[ROLE, text("a")], [text("b")]])
        self.bodies: list[dict[str, Any]] = []

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        self.bodies.append(dict(body))
        if "stream_options" in body:
            raise ProviderError("provider a answered 400: Unrecognized request argument supplied: stream_options",
                                status=400, detail={"message": "Unrecognized request argument supplied: "
                                                    "stream_options", "param": None}, retry=Retry.NO, strikes=0)
        async for read in super().stream(kind, body, request_id):
            yield read


@pytest.mark.parametrize("batch_ms", [0, 10])
async def test_a_provider_that_refuses_the_stream_options_iop_adds_streams_without_them(
        redis: Redis, batch_ms: int) -> None:
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3},
                         runtime={"stream_batch_ms": batch_ms})
    client, sched, run_ids = await waiting_runs(redis, config, 4)
    # (what iop sends anyway, as every Responses stream does: a hosted API's 400 was its answer)
    await redis.hset(keys.run_record(run_ids[2]), "body", pack(
        {"model": MODEL, "messages": [], "stream_options": {"include_usage": True}}))
    await redis.hset(keys.run_record(run_ids[3]), "body", pack(
        {"model": MODEL, "messages": [], "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    provider = NoStreamOptions()
    runner = Runner(redis, config, "n-a", {"a": provider})
    for run_id in run_ids:
        await redis.hset(keys.run_record(run_id), "stream", "1")
    for n, run_id in enumerate(run_ids):
        await sched.dispatch_all()
        outcome = await runner.execute(run_id)
        if n < 3:  # asked again without them, and from then on
            assert outcome.startswith("completed"), outcome
            assert [c for chunks in await deltas(redis, run_id) for c in chunks] == [ROLE, text("a"), text("b")]
        else:  # the caller's own stream_options: its provider's 400 is its answer
            assert outcome.startswith("failed"), outcome
    assert ["stream_options" in body for body in provider.bodies] == [True, False, False, False, True]
    assert runner.no_stream_options == {"a"}
    await client.close()


async def test_a_caller_asking_only_for_usage_is_answered_by_a_provider_that_refuses_stream_options(
        redis: Redis) -> None:
    """A Responses stream asks for usage (`{"include_usage": true}`, what iop sends anyway): a hosted
    API that refuses `stream_options` answered it 400 (a hosted-API audit); it is asked again without."""
    config = make_config({"a": 1})
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await redis.hset(keys.run_record(run_id), mapping={"stream": "1", "body": pack(
        {"model": MODEL, "messages": [], "stream_options": {"include_usage": True}})})
    await sched.dispatch_all()
    provider = NoStreamOptions()
    assert (await Runner(redis, config, "n-a", {"a": provider}).execute(run_id)).startswith("completed")
    assert ["stream_options" in body for body in provider.bodies] == [True, False]
    await client.close()


class CallersFault(Scripted):
    """A provider whose 400 names `stream_options` only because of what the caller sent."""

    def __init__(self, message: str) -> None:
        super().__init__([])
        self.message = message

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        self.calls += 1
        raise ProviderError(f"provider a answered 400: {self.message}", status=400,
                            detail={"message": self.message}, retry=Retry.NO, strikes=0)
        yield []


@pytest.mark.parametrize("message", [
    "[{'type': 'int_parsing', 'loc': ('body', 'max_tokens'), 'input': 'stream_options'}]",  # vLLM echoes the input
    "Unrecognized request argument supplied: x stream_options"])  # a field the caller named so
async def test_a_400_that_names_stream_options_for_the_caller_s_sake_leaves_them_on(
        redis: Redis, message: str) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    provider = CallersFault(message)
    runner = Runner(redis, sched.config, "n-a", {"a": provider})
    assert (await runner.execute(run_id)).startswith("failed")
    assert runner.no_stream_options == set() and provider.calls in (1, 2)  # (asked again at most once)


#: OpenAI's answer to `max_tokens` on its reasoning models (o1, o3, gpt-5), as seen in its clients' issues
NOT_MAX_TOKENS = {"message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                             "'max_completion_tokens' instead.", "type": "invalid_request_error", "param": "max_tokens",
                  "code": "unsupported_parameter"}


USAGE = {"object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


class CompletionTokensOnly(Scripted):
    """A provider whose model takes the limit only as `max_completion_tokens`; `error`: its refusal."""

    def __init__(self, error: dict[str, Any] = NOT_MAX_TOKENS) -> None:
        super().__init__([[ROLE, text("a")], [text("b"), USAGE]])
        self.refusal = error
        self.bodies: list[dict[str, Any]] = []

    def _check(self, body: dict[str, Any]) -> None:
        self.bodies.append(dict(body))
        if "max_tokens" in body:
            raise ProviderError(f"provider a answered 400: {self.refusal['message']}", status=400, detail=self.refusal,
                                retry=Retry.NO, strikes=0)

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self._check(body)
        return await super().complete(kind, body, request_id)

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        self._check(body)
        async for read in super().stream(kind, body, request_id):
            yield read


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_that_refuses_max_tokens_is_asked_with_max_completion_tokens_and_from_then_on(
        redis: Redis, stream: bool) -> None:
    """OpenAI's reasoning models refuse `max_tokens` (the name every other server takes, which iop
    gives a model's cap and a Response's `max_output_tokens`): the run is asked again at once with
    the limit as `max_completion_tokens`, and later runs of that model go so from the start."""
    config = make_config({"a": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    client, sched, run_ids = await waiting_runs(redis, config, 3)
    asked: list[dict[str, Any]] = [{"max_tokens": 5}, {"max_tokens": 7, "max_completion_tokens": None},
                                   {"max_tokens": None}]
    for run_id, limit in zip(run_ids, asked, strict=True):
        await redis.hset(keys.run_record(run_id), mapping={
            "stream": "1" if stream else "0", "body": pack({"model": MODEL, "messages": [], **limit})})
    provider = CompletionTokensOnly()
    runner = Runner(redis, config, "n-a", {"a": provider})
    for run_id in run_ids:
        await sched.dispatch_all()
        assert (await runner.execute(run_id)).startswith("completed")
    assert [{k: v for k, v in b.items() if k.startswith("max_")} for b in provider.bodies] == [
        {"max_tokens": 5}, {"max_completion_tokens": 5},  # asked again at once
        {"max_completion_tokens": 7},  # then so from the start (a null `max_completion_tokens` gives way)
        {}]  # (an unset `max_tokens` is left out)
    assert runner.completion_tokens_only == {("a", "a-name")}
    if stream:  # (its caller asked for no usage: asked again, it gets none either)
        assert [c for chunks in await deltas(redis, run_ids[0]) for c in chunks] == [ROLE, text("a"), text("b")]
    await client.close()


@pytest.mark.parametrize("refusal", [
    {"message": "max_tokens is too large: 100000. This model supports at most 16384 completion tokens, whereas you "
                "provided 100000.", "type": "invalid_request_error", "param": "max_tokens", "code": None},
    {"message": "'max_tokens' must be at least 1", "param": "max_tokens", "code": "invalid_value"}])
async def test_a_400_about_the_value_of_max_tokens_is_the_callers_answer(redis: Redis,
                                                                         refusal: dict[str, Any]) -> None:
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.hset(keys.run_record(run_id), "body", pack({"model": MODEL, "messages": [], "max_tokens": 100_000}))
    provider = CompletionTokensOnly(refusal)
    runner = Runner(redis, sched.config, "n-a", {"a": provider})
    assert (await runner.execute(run_id)).startswith("failed")
    assert len(provider.bodies) == 1 and runner.completion_tokens_only == set()
    ((_, data),) = [e for e in await events(redis, run_id) if e[0] == "failed"]
    assert data["status"] == 400 and data["detail"] == refusal


@pytest.mark.parametrize(("body", "named"), [
    ({"max_tokens": 3}, {"max_completion_tokens": 3}),
    ({"max_tokens": 3, "max_completion_tokens": 2}, {"max_completion_tokens": 2}),  # (it wins, as vLLM reads them)
    ({"max_tokens": 3, "max_completion_tokens": None}, {"max_completion_tokens": 3}),
    ({"max_tokens": None}, {}),
    ({"max_completion_tokens": 4}, {"max_completion_tokens": 4}),
    ({}, {})])
def test_max_tokens_as_max_completion_tokens(body: dict[str, Any], named: dict[str, Any]) -> None:
    original = {"model": "m", **body}
    assert completion_tokens_named(original) == {"model": "m", **named}
    assert original == {"model": "m", **body}  # (the run's own body is not changed)


@pytest.mark.parametrize(("body", "named"), [
    ({"max_completion_tokens": 3}, {"max_tokens": 3}),
    ({"max_completion_tokens": 3, "max_tokens": 5}, {"max_tokens": 3}),  # (it wins, as vLLM reads them)
    ({"max_completion_tokens": None, "max_tokens": 5}, {"max_tokens": 5}),
    ({"max_completion_tokens": None}, {}),
    ({"max_tokens": 4}, {"max_tokens": 4}),
    ({}, {})])
def test_max_completion_tokens_as_max_tokens_alone(body: dict[str, Any], named: dict[str, Any]) -> None:
    original = {"model": "m", **body}
    assert max_tokens_only(original) == {"model": "m", **named}
    assert original == {"model": "m", **body}  # (the run's own body is not changed)


#: Mistral's 422 for the official clients' name of the limit (editor-code-assistant/eca#231), as iop reads it
MISTRAL_422 = ('{"detail": [{"type": "extra_forbidden", "loc": ["body", "max_completion_tokens"], '
               '"msg": "Extra inputs are not permitted", "input": 32000}]}')


@pytest.mark.parametrize(("status", "message", "param", "refused"), [
    (422, MISTRAL_422, None, True),
    (400, "Unrecognized request argument supplied: max_completion_tokens", None, True),
    (400, "max_completion_tokens is too large: 100000. This model supports at most 16384", "max_completion_tokens",
     False),  # (the caller's value: its answer, not asked again under the other name)
    (500, MISTRAL_422, None, False),
    # (the caller's words that a server echoes: nothing of what it knows)
    (422, '{"detail":[{"type":"string_type","loc":["body","messages",0,"content"],"msg":"Input should be a valid '
          'string","input":"is an unexpected max_completion_tokens my fault?"}]}', None, False)])
def test_a_refusal_of_the_name_max_completion_tokens(status: int, message: str, param: str | None,
                                                      refused: bool) -> None:
    exc = ProviderError(f"provider a answered {status}: {message}", status=status,
                        detail={"message": message, "param": param}, retry=Retry.NO, strikes=0)
    assert refuses_max_completion_tokens(exc) is refused


class WrongUsage(Scripted):
    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return {"object": "chat.completion", "choices": [],
                "usage": {"prompt_tokens": "3", "completion_tokens": 2, "total_tokens": -5}}


async def test_a_non_stream_answer_s_usage_of_the_wrong_type_reaches_the_caller_as_numbers(redis: Redis) -> None:
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    runner = Runner(redis, sched.config, "n-a", {"a": WrongUsage([])})
    assert (await runner.execute(run_id)).startswith("completed")
    ((_, data),) = [e for e in await events(redis, run_id) if e[0] == "completed"]
    assert data["response"]["usage"] == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}


async def test_an_attempt_that_fails_after_its_run_went_on_without_it_does_not_say_requeued(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """A worker paused past its lease (SIGSTOP) ends its attempt after the run was reaped and tried
    again: its finish records nothing (`stale`), and its log says so instead of "requeued" (found
    by a hostile-provider audit)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)

    class Overtaken(Scripted):
        async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
            await redis.hset(keys.run_record(run_id), "attempts", "2")  # (the reaper's requeue and a new start)
            raise ProviderError("provider a: sent nothing for 3000 ms", retry=Retry.ANY, strikes=1)

    runner = Runner(redis, sched.config, "n-a", {"a": Overtaken([])})
    with caplog.at_level(logging.INFO, "iop.worker"):
        assert await runner.execute(run_id) == "requeued:stale"
    said = [r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage()]
    assert said == ["attempt 1 failed, but its run had gone on without it (stale): provider a: sent nothing "
                    "for 3000 ms"]


async def test_an_attempt_whose_end_redis_never_took_says_so(
        redis: Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis did not answer the finish for as long as the lease could live (paused): the log says
    that, not that the run went on without the attempt (found by a stalled-Redis audit)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)

    class Failing(Scripted):
        async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
            raise ProviderError("provider a: sent nothing for 3000 ms", retry=Retry.ANY, strikes=1)

    runner = Runner(redis, sched.config, "n-a", {"a": Failing([])})
    call_while_leased = runner._call_while_leased

    async def unanswered(att: Any, script: str, *args: Any) -> Any:
        if script == "finish":
            raise LeaseLost(att.run_id)
        return await call_while_leased(att, script, *args)

    monkeypatch.setattr(runner, "_call_while_leased", unanswered)
    with caplog.at_level(logging.INFO, "iop.worker"):
        assert await runner.execute(run_id) == "unrecorded"
    said = [r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage()]
    assert said == ["attempt 1 failed (provider a: sent nothing for 3000 ms), and its end could not be recorded: "
                    "Redis did not answer while its lease could live; the scheduler takes the run back when the "
                    "lease lapses"]


async def dispatched_runs(redis: Redis, n: int) -> tuple[Runner, list[str]]:
    """n runs dispatched to node n-a (provider a, n slots), oldest first, and a runner of the node
    whose provider stalls."""
    from tests.test_cancel import StallingAdapter

    config = make_config({"a": n}, queue={"max_queue": 10, "queue_timeout_ms": 60_000})
    _, sched, run_ids = await waiting_runs(redis, config, n)
    await sched.dispatch_all()
    return Runner(redis, config, "n-a", {"a": StallingAdapter()}), run_ids


async def stop_runs(worker: WakeWorker) -> None:
    for task in worker.tasks.values():
        task.cancel()
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    await worker.pool.aclose(close_connection_pool=True)


async def test_a_woken_worker_takes_as_many_jobs_as_it_has_free_slots_at_once_oldest_first(
        redis: Redis, redis_url: str) -> None:
    """Under load jobs queue up on a node's wake list faster than one pop each: a worker woken by
    one takes as many as it has free slots with it, in the same `take_woken` call, oldest first."""
    runner, (first, second, third) = await dispatched_runs(redis, 3)
    worker = node_worker(redis_url, runner, max_jobs=3)
    try:
        await worker.sem.acquire()
        worker.job_counter = 1  # one slot busy: two free
        assert await worker._wait_for_work() is False
        assert sorted(worker.tasks) == sorted([first, second]) and worker.job_counter == 3
        assert await fields(redis, keys.run_record(first), "state") == ["running"]
        assert await redis.lrange(keys.node_wake("n-a"), 0, -1) == [third.encode()]  # for a sibling with room
    finally:
        await stop_runs(worker)


async def test_a_woken_worker_takes_its_job_in_the_round_trip_of_its_wake_up(redis: Redis, redis_url: str) -> None:
    """The `take_woken` script goes out with the blocking `BLMOVE` and Redis runs it once the id is
    moved: the worker is woken with its run started, one round trip (its line's connection sent
    two commands, and nothing else was sent between)."""
    runner, (run_id,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner, max_jobs=2, poll_delay=5)
    await redis.delete(keys.node_wake("n-a"))
    sent: list[tuple[Any, ...]] = []
    try:
        line = worker._wake_line
        assert line is not None
        original = line.execute_many

        async def execute_many(commands: Any, block_s: float = 0.0) -> list[Any]:
            sent.append(tuple(c[0] for c in commands))
            return await original(commands, block_s)

        line.execute_many = execute_many  # type: ignore[method-assign]
        waiting = asyncio.create_task(worker._wait_for_work())

        async def blocked() -> bool:
            return int((await redis.info("clients"))["blocked_clients"]) == 1

        await async_wait_until(blocked, what="the worker to block on its wake list")
        assert await fields(redis, keys.run_record(run_id), "state") == ["dispatched"]
        await redis.lpush(keys.node_wake("n-a"), run_id)  # as `dispatch` does
        assert await waiting is False
        assert list(worker.tasks) == [run_id] and sent == [("BLMOVE", "EVALSHA")]
        assert await fields(redis, keys.run_record(run_id), "state") == ["running"]
    finally:
        await stop_runs(worker)


async def test_a_run_s_next_attempt_on_the_same_worker_runs_though_its_last_attempt_s_task_is_kept(
        redis: Redis, redis_url: str) -> None:
    """Job id = run id for every attempt: a run tried again on the worker that ran its last attempt
    comes while that attempt's ended task is still in `tasks` (it is forgotten at the next wait,
    and the worker was already blocked on its wake list). The new attempt must run, not be taken
    for the one that ran (found by a hostile-provider audit: the run was started and never run, and
    ended `worker_lost` at its lease)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    cut = ProviderError("provider a: the connection was reset", retry=Retry.ANY, strikes=1)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([], cut)})
    worker = node_worker(redis_url, runner, poll_delay=5)
    try:
        assert await worker._wait_for_work() is False
        first = worker.tasks[run_id]
        assert await first == "requeued:ok"
        await sched.read_new(block_ms=10)
        await sched.dispatch_all()  # the same provider, the same node, the same job id
        taken, woken, _ = await worker._take_woken(1)  # (what the worker's wait does, after its forget)
        assert woken and [t[:2] for t in taken] == [[run_id.encode(), b"ok"]]
        await worker._start(taken)
        assert worker.tasks[run_id] is not first
        assert (await worker.tasks[run_id]).startswith("requeued")  # the second attempt ran
        assert await fields(redis, keys.run_record(run_id), "attempts") == ["2"]
    finally:
        await stop_runs(worker)


async def test_a_new_attempt_whose_last_attempt_s_task_is_still_ending_here_runs_after_it(
        redis: Redis, redis_url: str) -> None:
    """The last attempt's `finish` landed (the run was queued again and dispatched back here) but its
    task has not returned yet (the reply was lost; it retries): the new attempt must run once that
    task ends, not be taken for it (it was started in Redis and never run; found in review)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([])})
    worker = node_worker(redis_url, runner, poll_delay=5)
    ending = asyncio.Event()
    previous = asyncio.get_running_loop().create_task(ending.wait())  # (stands for the last attempt's task)
    worker.tasks[run_id], worker._attempts[run_id] = previous, b"0"
    try:
        taken, woken, _ = await worker._take_woken(1)
        assert woken and [t[:2] for t in taken] == [[run_id.encode(), b"ok"]]
        await worker._start(taken)
        new = worker.tasks[run_id]
        assert new is not previous and not new.done()
        ending.set()
        assert (await new).startswith("completed")
        assert await fields(redis, keys.run_record(run_id), "state") == ["completed"]
    finally:
        await stop_runs(worker)


async def test_a_run_a_late_take_answer_started_runs_only_if_it_still_holds_its_lease(
        redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`take_woken` runs in Redis when the id comes, whatever the worker does: a worker paused
    (SIGSTOP) while it waited got, on resuming, the answer of a start made long before, whose lease
    had gone and whose run went on elsewhere. It called the provider for it again (found by a
    worker fault audit). An answer that comes later than the wait can last has its leases checked
    first."""
    from workers import arq_worker

    runner, (run_id,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner, poll_delay=0.2)
    clock = [1000.0]
    monkeypatch.setattr(arq_worker, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    send_after = worker._scripts.send_after

    async def paused(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        answer = await send_after(*args, **kwargs)
        await redis.zadd(keys.leases("a"), {run_id: 1})  # its lease went meanwhile (and the reaper requeues it)
        clock[0] += 60  # the worker was stopped for a minute
        return answer

    monkeypatch.setattr(worker._scripts, "send_after", paused)
    try:
        with caplog.at_level(logging.WARNING, "iop.worker"):
            assert await worker._wait_for_work() is False
        assert worker.tasks == {} and worker.job_counter == 0  # not run here
        assert "its lease went while this worker was paused" in caplog.text
        clock[0] += 0.1  # (an answer in time: not checked)
        await redis.zadd(keys.leases("a"), {run_id: 2**50})
        await redis.hset(keys.run_record(run_id), "state", "dispatched")
        await redis.delete(f"arq:in-progress:{run_id}")
        await redis.lpush(keys.node_wake("n-a"), run_id)
        monkeypatch.setattr(worker._scripts, "send_after", send_after)
        assert await worker._wait_for_work() is False and list(worker.tasks) == [run_id]
    finally:
        await stop_runs(worker)


async def test_a_started_run_calls_its_provider_before_the_worker_pops_its_wake_list_again(
        redis: Redis, redis_url: str) -> None:
    """The worker's next blocking pop is not on a new run's way: the run goes first."""
    runner, (run_id,) = await dispatched_runs(redis, 1)
    worker = node_worker(redis_url, runner, max_jobs=3)
    ran: list[str] = []

    async def run(job_id: str) -> None:
        ran.append(job_id)  # (a run's first step: the provider call goes out here)

    async def start(taken: list[Any]) -> None:
        for started in taken:
            worker.tasks[started[0].decode()] = asyncio.get_running_loop().create_task(run(started[0].decode()))

    worker._start = start  # type: ignore[method-assign]
    try:
        assert await worker._wait_for_work() is False
        assert ran == [run_id]  # before the worker came back to pop again
    finally:
        await stop_runs(worker)


def finish_fails(runner: Runner, monkeypatch: pytest.MonkeyPatch, times: int | None) -> list[int]:
    """The runner's `finish` script calls fail as if Redis were away, `times` times (None: every
    time); the others go through. Returns the count of failures so far (a one-item list)."""
    failures = [0]

    def away(name: str) -> None:
        if name == "finish" and (times is None or failures[0] < times):
            failures[0] += 1
            raise RedisConnectionError("Redis is away")

    before_scripts(runner, monkeypatch, away)
    return failures


async def test_a_run_s_end_is_recorded_however_many_tries_redis_takes_while_the_lease_lives(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # Redis away for 12 tries (more than the 8 the end once had), then back: the slot comes back.
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    failures = finish_fails(runner, monkeypatch, times=12)

    async def no_pause(self: Backoff) -> None:  # the clock need not move: the lease is far off
        return None

    monkeypatch.setattr(Backoff, "pause", no_pause)
    assert await runner.execute(run_id) == "completed:ok" and failures == [12]
    assert await redis.zcard(keys.leases("a")) == 0


async def test_a_run_s_end_is_given_up_once_its_lease_could_have_expired(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
    finish_fails(runner, monkeypatch, times=None)
    clock = [0.0]

    async def pause(self: Backoff) -> None:  # each pause moves the clock by a second
        clock[0] += 1.0

    monkeypatch.setattr(Backoff, "pause", pause)
    monkeypatch.setattr(runner_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # the runner's clock only
    assert await runner.execute(run_id) == "unrecorded"
    assert clock[0] > sched.config.runtime.lease_ttl_ms / 1000  # it tried for as long as the lease lived


async def test_a_runs_end_leaves_its_keys_in_flight_set_and_counts_its_day_with_a_ttl(redis: Redis) -> None:
    """`enqueue` marks whether it put the run in its key's in-flight set (`limited`); the run's end
    takes it out when it did (and when the record predates the mark), and counts the run in the
    key's day, whose hash has its TTL from its first count on."""
    from common.auth import Principal, Role
    from gateway.runs import RunClient
    from tests.test_scheduler import request

    config = make_config({"a": 3}, queue={"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3})
    await beat(redis, config)
    client = RunClient(redis, config)
    model = config.model(MODEL)
    assert model is not None
    limited, unlimited, older = (Principal(name, Role.CALLER, max_in_flight=limit)
                                 for name, limit in (("team-a", 5), ("team-b", None), ("team-c", 5)))
    runs = {who.name: (await client.submit(model, request(), who))[0] for who in (limited, unlimited, older)}
    assert await fields(redis, keys.run_record(runs["team-a"]), "limited") == ["1"]
    assert await fields(redis, keys.run_record(runs["team-b"]), "limited") == ["0"]
    assert not await redis.exists(keys.key_in_flight("team-b"))
    await redis.hdel(keys.run_record(runs["team-c"]), "limited")  # as an earlier version wrote it
    sched = Scheduler(redis, config)
    await sched.ensure_groups()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    runner = Runner(redis, config, "n-a", {"a": Scripted([])})
    for run_id in runs.values():
        assert (await runner.execute(run_id)).startswith("completed")
    for name in ("team-a", "team-c"):
        assert await redis.zcard(keys.key_in_flight(name)) == 0  # out of the set at its end
    day = [k for k in await redis.keys(keys.usage_day("team-a", "*"))]
    assert len(day) == 1 and await redis.hget(day[0], f"runs:{MODEL}") == b"1"
    assert keys.USAGE_RETENTION_S - 60 < await redis.ttl(day[0]) <= keys.USAGE_RETENTION_S
    await client.close()


async def test_a_job_whose_run_cannot_start_leaves_no_in_progress_marker(redis: Redis, redis_url: str) -> None:
    """`take` marks a job in progress as it starts the run; a run it cannot start (its caller left
    between dispatch and start) leaves the queue with no marker left behind."""
    from arq.constants import in_progress_key_prefix

    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    await redis.hset(keys.run_record(run_id), "cancel", "1")
    worker = node_worker(redis_url, Runner(redis, sched.config, "n-a", {"a": Scripted([])}))
    try:
        await worker.claim_and_start([run_id])
        assert worker.tasks == {}
        assert await fields(redis, keys.run_record(run_id), "state") == ["cancelled"]
        assert await redis.zscore(keys.node_queue("n-a"), run_id) is None
        assert not await redis.exists(in_progress_key_prefix + run_id)
        assert await redis.zcard(keys.leases("a")) == 0
    finally:
        await worker.pool.aclose(close_connection_pool=True)


async def test_a_keys_in_flight_set_lives_as_long_as_its_longest_lived_run(redis: Redis) -> None:
    """The set's TTL only grows: a run of a quick model queued after a run of a slow one must not
    cut the set's life short (it expired under the slow run, and the key went past its
    max_in_flight)."""
    from common.auth import Principal, Role
    from common.config import parse_config
    from gateway.runs import RunClient
    from tests.test_scheduler import request

    config = parse_config({
        "models": [{"id": model, "providers": {"a": "a-name"},
                    "queue": {"queue_timeout_ms": timeout_ms, "execution_timeout_ms": timeout_ms, "max_attempts": 1}}
                   for model, timeout_ms in (("slow", 600_000), ("quick", 1_000))],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                               "capacity": 1, "models": ["a-name"]}]}],
    })
    await beat(redis, config)
    client = RunClient(redis, config)
    who = Principal("team-a", Role.CALLER, max_in_flight=5)
    slow, quick = config.model("slow"), config.model("quick")
    assert slow is not None and quick is not None
    await client.submit(slow, request(), who)
    lives = await redis.pttl(keys.key_in_flight("team-a"))
    assert lives > 1_200_000  # (2 x 600 s + the gateway's grace)
    await client.submit(quick, request(), who)
    assert await redis.pttl(keys.key_in_flight("team-a")) > lives - 60_000  # not cut to the quick one's ~32 s
    assert await redis.zcard(keys.key_in_flight("team-a")) == 2
    await client.close()


# ------------------------------------------------------------------ blame: failed here, served elsewhere
async def failed_on_a_then_on_b(redis: Redis, error: Callable[[str], ProviderError],
                                b_serves: bool = True, config: Config | None = None) -> tuple[str, list[str]]:
    """A run that fails on a (chosen first: the tie-break), goes back to its queue and is then
    dispatched to b, which serves it or fails it too: (its end, the scripts b's runner called; its
    runners read `config`, when given, rather than the scheduler's)."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    assert await chosen_and_other(redis, run_id) == ("a", "b")
    first = Runner(redis, config or sched.config, "n-a", {"a": Scripted([], error("a"))})
    assert await first.execute(run_id) == "requeued:ok"
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert (await fields(redis, keys.run_record(run_id), "provider"))[0] == "b"
    second = Runner(redis, config or sched.config, "n-b",
                    {"b": Scripted([[TEXT]], None if b_serves else error("b"))})
    called: list[str] = []
    before_scripts(second, pytest.MonkeyPatch(), called.append)
    return await second.execute(run_id), called


def server_error(provider: str) -> ProviderError:
    return ProviderError(f"provider {provider} answered 500: boom", status=500, retry=Retry.ELSEWHERE)


async def test_a_provider_whose_runs_another_then_served_three_times_in_a_row_is_benched(redis: Redis) -> None:
    """A server whose health endpoint answers while its runs fail (found by a hostile-provider audit:
    it stayed in rotation, every run there cost a failed attempt first, or a whole read timeout).
    Benched for the model only: its health, and its other served names, are not touched (a review
    of a first version that benched the whole provider: one model's failures cut another off)."""
    hb = keys.heartbeat("a")
    for n in (1, 2):
        assert (await failed_on_a_then_on_b(redis, server_error))[0].startswith("completed")
        assert await fields(redis, hb, "blame:a-name", "bench:a-name") == [str(n), None]
    outcome, called = await failed_on_a_then_on_b(redis, server_error)
    assert outcome.startswith("completed") and called.count("blame") == 1
    blame, until, health = await fields(redis, hb, "blame:a-name", "bench:a-name", "health")
    assert blame == "2" and until is not None and int(until) > now_ms() + 25_000 and health == "available"
    assert await fields(redis, keys.heartbeat("b"), "blame:b-name", "bench:b-name") == [None, None]
    now = now_ms()
    snaps = {s.provider_id: s for s in await read_snapshots(redis, {"a": "a-name", "b": "b-name"}, now, "n-{}".format)}
    assert snaps["a"].benched and not snaps["b"].benched and why_not(snaps["a"], now, 60_000) == "benched"
    assert not (await read_snapshots(redis, {"a": "another-name"}, now, "n-{}".format))[0].benched
    # the next run goes to b, though a is idle and first by the tie-break
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    assert await chosen_and_other(redis, run_id) == ("b", "a")
    # once its bench is out, a takes runs again; one it serves starts its count over
    await redis.hset(hb, "bench:a-name", now_ms() - 1)
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    assert await chosen_and_other(redis, run_id) == ("a", "b")
    assert (await Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])}).execute(run_id)).startswith(
        "completed")
    assert await fields(redis, hb, "blame:a-name") == [None]


async def test_a_provider_another_model_runs_there_alone_under_the_same_name_is_not_benched(redis: Redis) -> None:
    """A bench is kept per served name: a second model that a alone serves under the same name
    (`solo`, a-name on a) was cut off by the first's blame, 503 `no_available_provider` ("a: benched")
    for `bench_ms` though a served its runs (a new operator's pool: a model with a fallback and one
    without, on the same engine). Blame never benches a model's only provider for it, so runs failed
    there and served elsewhere bench no name that such a model has there."""
    data = {"models": [{"id": MODEL, "providers": {"a": "a-name", "b": "b-name"}},
                       {"id": "solo", "providers": {"a": "a-name"}}],
            "nodes": [{"id": f"n-{p}", "providers": [{"id": p, "type": "vllm", "base_url": "http://127.0.0.1:9",
                                                      "capacity": 1, "models": [f"{p}-name"]}]} for p in "ab"],
            "queue": {"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 3}}
    for _ in range(3):
        outcome, called = await failed_on_a_then_on_b(redis, server_error, config=parse_config(data))
        assert outcome.startswith("completed")
    assert await fields(redis, keys.heartbeat("a"), "bench:a-name") == [None]
    now = now_ms()
    assert not (await read_snapshots(redis, {"a": "a-name"}, now, "n-{}".format))[0].benched


@pytest.mark.parametrize("case", ["fails everywhere", "busy", "caller's request", "served first time"])
async def test_what_blames_no_provider(redis: Redis, case: str) -> None:
    """A request that fails on every provider (one caller's, not the servers'), a busy provider's
    429 or 503, a request a provider's adapter cannot carry, a run served at its first try. (A busy
    one is benched for the second it was too busy for, not blamed: its next run goes elsewhere, so
    it is tried once.)"""
    for _ in range(1 if case == "busy" else 3):
        if case == "fails everywhere":
            outcome, called = await failed_on_a_then_on_b(redis, server_error, b_serves=False)
            assert outcome.startswith("failed")
        elif case == "busy":
            outcome, called = await failed_on_a_then_on_b(redis, lambda p: ProviderError(
                f"provider {p} answered 429: slow down", status=429, retry=Retry.ELSEWHERE))
            assert outcome.startswith("completed") and called.count("blame") == 1
        elif case == "caller's request":
            outcome, called = await failed_on_a_then_on_b(
                redis, lambda p: not_taken(p, "'tools' is not taken", "tools"))
            assert outcome.startswith("completed") and called.count("blame") == 1
        else:
            sched, run_id = await start_one(redis, {"a": 1, "b": 1})
            runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT]])})
            called = []
            before_scripts(runner, pytest.MonkeyPatch(), called.append)
            assert (await runner.execute(run_id)).startswith("completed")
            assert "blame" not in called  # (no call for a run tried once)
    blame, bench = await fields(redis, keys.heartbeat("a"), "blame:a-name", "bench:a-name")
    assert blame is None  # (busy: benched for the second it asked to be left alone, not blamed)
    assert (bench is not None) is (case == "busy")


async def test_a_provider_too_busy_is_left_alone_for_the_model_as_long_as_it_asked(redis: Redis) -> None:
    """A hosted API answering 429 `Retry-After: 30` took every new run first (nothing in flight there:
    the least loaded), 194 a second, keeping its key at its rate limit: it is benched for the model
    until then, so runs go elsewhere meanwhile."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    busy = ProviderError(f"provider {provider} answered 429: slow down", status=429, retry=Retry.ELSEWHERE,
                         retry_after_s=30)
    before = now_ms()
    assert await Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], busy)}).execute(
        run_id) == "requeued:ok"
    until = int((await fields(redis, keys.heartbeat(provider), f"bench:{provider}-name"))[0] or 0)
    assert before + 30_000 <= until <= now_ms() + 30_000
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "provider") == [other]


async def test_a_run_requeued_off_a_busy_provider_does_not_hold_up_the_runs_behind_it(redis: Redis) -> None:
    """A run that one provider was too busy for goes back to its queue for the other, which is then
    benched for its own Retry-After (60 s): the run may go to that one alone, and waiting for it held
    every run behind it up (FIFO) until its bench or its queue timeout ended, the first provider back
    and idle meanwhile (a review, with two hosted APIs at their rate limits). It fails now, as before
    busy was not down, and the runs behind it go to the first."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider, other = await chosen_and_other(redis, run_id)
    busy = ProviderError(f"provider {provider} answered 429: slow down", status=429, retry=Retry.ELSEWHERE,
                         retry_after_s=1)
    assert await Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], busy)}).execute(
        run_id) == "requeued:ok"
    client, (behind,) = RunClient(redis, sched.config), await submit(RunClient(redis, sched.config), 1)
    await redis.hdel(keys.heartbeat(provider), f"bench:{provider}-name")  # (its second passed)
    until = now_ms() + 60_000  # (the other answered another run 429, Retry-After: 60)
    await redis.hset(keys.heartbeat(other), mapping={f"bench:{other}-name": until, f"busy:{other}-name": until})
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "state") == ["failed"]
    assert await fields(redis, keys.run_record(behind), "state", "provider") == ["dispatched", provider]
    await client.close()


async def test_a_busy_provider_s_retry_after_reaches_the_failed_event(redis: Redis) -> None:
    """(What the caller's 503 says in `Retry-After`: `ErrorInfo.retry_after_s`, from the provider's own.)"""
    sched, run_id = await start_one(redis, {"a": 1})
    busy = ProviderError("provider a answered 429: slow down", status=429, retry=Retry.ELSEWHERE, retry_after_s=7)
    assert (await Runner(redis, sched.config, "n-a", {"a": Scripted([], busy)}).execute(run_id)).startswith("failed")
    failed = [data for kind, data in await events(redis, run_id) if kind == "failed"]
    assert len(failed) == 1 and ErrorInfo.from_wire(failed[0]).retry_after_s == 7


async def test_a_refused_connection_takes_its_provider_down_and_is_no_blame_besides(redis: Redis) -> None:
    """A server killed and restarted: its refused runs went to another provider, each a blame, and it
    was benched for 30 s once back (found by an operator's catalog check; the README's blame list
    has no refused connection). Its strikes took it down at once already."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1})
    provider = str((await fields(redis, keys.run_record(run_id), "provider"))[0])
    refused = ProviderError(f"provider {provider}: connection refused", retry=Retry.ANY, strikes=DOWN)
    runner = Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], refused)})
    assert await runner.execute(run_id) == "requeued:ok"
    assert await fields(redis, keys.run_record(run_id), "state", "suspects") == ["queued", None]
    server_error = ProviderError(f"provider {provider}: the server closed the connection", retry=Retry.ANY,
                                 strikes=1)
    await sched.read_new(block_ms=10)
    await beat(redis, sched.config)
    await sched.dispatch_all()
    again = str((await fields(redis, keys.run_record(run_id), "provider"))[0])
    runner = Runner(redis, sched.config, f"n-{again}", {again: Scripted([], server_error)})
    assert await runner.execute(run_id) == "requeued:ok"
    assert await fields(redis, keys.run_record(run_id), "suspects") == [again]  # (a dropped one still is)


async def test_an_attempt_whose_end_was_not_recorded_counts_as_lost(redis: Redis) -> None:
    """`iop_worker_runs_total` counted an attempt `completed` whose end `finish` refused (its lease was
    reaped meanwhile, the run requeued or failed): two runs made three completions."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)

    class Overtaken(Scripted):
        async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
            await redis.hset(keys.run_record(run_id), "attempts", "99")  # (as after a reap and a new dispatch)
            return await super().complete(kind, body, request_id)

    before = {o: worker_metrics.runs(MODEL, "a", o)._value.get() for o in ("completed", "lost")}
    assert await Runner(redis, sched.config, "n-a", {"a": Overtaken([])}).execute(run_id) == "completed:stale"
    after = {o: worker_metrics.runs(MODEL, "a", o)._value.get() for o in ("completed", "lost")}
    assert after == {"completed": before["completed"], "lost": before["lost"] + 1}


@pytest.mark.parametrize("error, repeats", [
    (ProviderError("provider a: llm exited with status 1: Error: 529 upstream overloaded", strikes=0), False),
    (runner_module.cannot_carry("a", Unpackable("an integer beyond 64 bits")), True),
], ids=["a-tool-that-failed", "an-answer-iop-cannot-carry"])
async def test_only_a_failure_that_would_repeat_tells_the_caller_not_to_retry(
        redis: Redis, error: ProviderError, repeats: bool) -> None:
    """A failure iop does not try again (`Retry.NO`) is not one the caller's own try would repeat:
    a CLI tool that exited with an error (its upstream overloaded, say) may well answer the next
    time, and the official clients try a 502 twice more; only an answer iop cannot carry says
    `x-should-retry: false` (every `Retry.NO` said it: the client gave up at the first failure)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([], error)})
    assert (await runner.execute(run_id)).startswith("failed")
    failed = (await events(redis, run_id))[-1][1]
    assert failed.get("repeats", False) is repeats
    told = ApiError.from_info(ErrorInfo.from_wire(failed)).headers.get("x-should-retry")
    assert told == ("false" if repeats else None)


@pytest.mark.parametrize(("queued", "worker", "refusal"), [(1, 3, False), (1, 3, True), (2, 1, False)])
async def test_a_run_is_tried_by_its_own_max_attempts_not_its_worker_s(redis: Redis, queued: int, worker: int,
                                                                       refusal: bool) -> None:
    """A rollout of a new `max_attempts`: the run's record has the limit its queueing wrote, by which
    the start of its last attempt takes its body out of the record (`_START`) and the reaper puts it
    back or fails it (README: by its own `max_attempts`, whichever config). A worker of the new config
    counted by its own: one of 3 put a run queued with 1 back after a 500 (or after a refusal of what
    the provider cannot do, which uses up no attempt, without the body it had lost), and the next
    attempt had no body: the caller got a 502, "the worker failed ending the run (KeyError)"; one of 1
    failed a run queued with 2 at its first 500."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1}, max_attempts=queued)
    provider, other = await chosen_and_other(redis, run_id)
    config = make_config({"a": 1, "b": 1}, queue={"max_queue": 10, "queue_timeout_ms": 60_000,
                                                   "max_attempts": worker})
    err = not_taken(provider, "a cli provider does not call tools", "tools") if refusal else \
        ProviderError(f"provider {provider} answered 500: boom", status=500, retry=Retry.ELSEWHERE)
    outcome = await Runner(redis, config, f"n-{provider}", {provider: Scripted([], err)}).execute(run_id)
    if queued == 1 and not refusal:  # (its last attempt: the error is the caller's answer)
        assert outcome == "failed:ok"
        assert await fields(redis, keys.run_record(run_id), "error_message") == [f"provider {provider} answered "
                                                                                 "500: boom"]
        return
    assert outcome == "requeued:ok"
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "provider") == [other]
    assert await Runner(redis, config, f"n-{other}", {other: Scripted([[TEXT]])}).execute(run_id) == "completed:ok"


@pytest.mark.parametrize("max_attempts", [2, 3])
async def test_a_refusal_as_unable_goes_back_to_a_provider_tried_before_never_to_the_one_that_refused(
        redis: Redis, max_attempts: int) -> None:
    """The run's first provider broke off (a retry, an attempt used), the other refused it as unable
    (`not_taken`: none used), and no provider was left that it was not tried on: the caller got that
    refusal, with attempts left. It goes back to the first (`requeue_unable_back`: the record's
    `unable_by` names the one that refused it), which serves it; with `max_attempts: 2` too (the refusal
    gave its attempt back). The one that refused it is never chosen again, and a refusal by it again (a
    scheduler that does not read `unable_by`) ends the run with it, so it goes round between the two no
    more."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1}, max_attempts=max_attempts)
    first, other = await chosen_and_other(redis, run_id)
    broke = ProviderError(f"provider {first}: the server closed the connection", retry=Retry.ANY, strikes=1)
    assert await Runner(redis, sched.config, f"n-{first}", {first: Scripted([], broke)}).execute(
        run_id) == "requeued:ok"
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "provider") == [other]
    refusal = not_taken(other, "'top_k' is not taken", "top_k")
    assert await Runner(redis, sched.config, f"n-{other}", {other: Scripted([], refusal)}).execute(
        run_id) == "requeued:ok"
    record = keys.run_record(run_id)
    assert await fields(redis, record, "unable", "unable_by", "state") == ["1", other, "queued"]
    [(_, entry)] = await redis.xrange(keys.runs_stream(MODEL))
    assert entry.get(b"exclude") is None and entry[b"unable_by"] == other.encode()
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, record, "provider", "attempts") == [first, "3"]
    assert await Runner(redis, sched.config, f"n-{first}", {first: Scripted([[TEXT]])}).execute(
        run_id) == "completed:ok"

    # a scheduler that does not read `unable_by` sends the next such run back to the one that refused it
    sched, run_id = await start_one(redis, {"a": 1, "b": 1}, max_attempts=max_attempts)
    record = keys.run_record(run_id)
    provider, other = await chosen_and_other(redis, run_id)
    await redis.hset(record, mapping={"tried": f"{other},{provider}", "unable_by": provider, "unable": 1,
                                      "attempts": 2})
    refusal = not_taken(provider, "'top_k' is not taken", "top_k")
    assert await Runner(redis, sched.config, f"n-{provider}", {provider: Scripted([], refusal)}).execute(
        run_id) == "failed:ok"
    assert await fields(redis, record, "error_message", "unable_by") == [refusal.message, provider]


@pytest.mark.parametrize(("status", "message"), [(500, "boom"), (429, "rate limited")])
async def test_a_refusal_as_unable_never_goes_back_to_a_provider_that_answered_a_server_error(
        redis: Redis, status: int, message: str) -> None:
    """A 5xx or a 429 is tried again only on another provider, each at most once (its retry excludes the
    providers tried: `requeue_elsewhere`). The other then refused the run as unable, and none is left
    that it was not tried on: it does not go back to the first (`requeue_unable_back` avoids, not
    excludes), but ends with that refusal, as before there was a way back."""
    sched, run_id = await start_one(redis, {"a": 1, "b": 1}, max_attempts=3)
    first, other = await chosen_and_other(redis, run_id)
    err = ProviderError(f"provider {first} answered {status}: {message}", status=status, retry=Retry.ELSEWHERE)
    assert await Runner(redis, sched.config, f"n-{first}", {first: Scripted([], err)}).execute(
        run_id) == "requeued:ok"
    await sched.read_new(block_ms=10)
    await sched.dispatch_all()
    assert await fields(redis, keys.run_record(run_id), "provider") == [other]
    # (the 429's bench, its Retry-After, has passed by the time the other answers)
    benched = [f for f in await redis.hkeys(keys.heartbeat(first)) if f.startswith((b"bench:", b"busy:"))]
    if benched:
        await redis.hdel(keys.heartbeat(first), *benched)
    refusal = not_taken(other, "'top_k' is not taken", "top_k")
    assert await Runner(redis, sched.config, f"n-{other}", {other: Scripted([], refusal)}).execute(
        run_id) == "failed:ok"
    assert await fields(redis, keys.run_record(run_id), "state", "error_message") == ["failed", refusal.message]


async def test_a_model_cap_is_fitted_at_most_refits_times_however_often_the_server_refuses(redis: Redis) -> None:
    """A server that refuses each smaller cap again, always saying it has a token less room, is asked
    `REFITS` times more, then its refusal is the answer: the refit never goes on for good."""
    caps: list[int] = []

    async def refuse(att: Any, adapter: Any, kind: RunKind, body: dict[str, Any], stream: bool) -> str:
        cap = body["max_tokens"]
        caps.append(cap)
        raise ProviderError(f"provider a answered 400: Requested token count exceeds the model's maximum context "
                            f"length of {10 + cap - 1} tokens. You requested a total of {10 + cap} tokens: 10 "
                            f"tokens from the input messages and {cap} tokens for the completion.",
                            status=400, retry=Retry.NO, strikes=0)

    runner = Runner(redis, make_config({"a": 1}), "n-a", {})
    runner._answer_named = refuse  # type: ignore[method-assign]
    att = SimpleNamespace(output=False, provider_id="a", log=dict)
    with pytest.raises(ProviderError, match="maximum context length"):
        await runner._answer(att, None, RunKind.CHAT, {"messages": [], "max_tokens": 100}, False,  # type: ignore[arg-type]
                             capped=True)
    assert caps == [100 - n for n in range(runner_module.REFITS + 1)]


async def test_an_attempt_s_log_lines_name_its_provider(redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """An operator reading "attempt 1 failed, requeued: the worker shut down during the run" must see
    where it ran: every line about an attempt carries its provider (`provider=` in text, a field in
    JSON), not only those whose message happens to name it (found by an operator's day in front of
    two llama.cpp servers: a worker's SIGTERM past its grace said no provider)."""
    sched, run_id = await start_one(redis, {"a": 1}, stream=False)
    adapter = Endless()
    runner = Runner(redis, sched.config, "n-a", {"a": adapter})
    with caplog.at_level(logging.INFO, "iop.worker"):
        task = asyncio.create_task(runner.execute(run_id))
        await asyncio.wait_for(adapter.began.wait(), 10)
        task.cancel()  # (the worker's stop past its grace cancels its runs' tasks so)
        with pytest.raises(asyncio.CancelledError):
            await task
    said = [r for r in caplog.records if "worker shut down" in r.getMessage()]
    assert [getattr(r, "provider", None) for r in said] == ["a"]
    assert all(getattr(r, "provider", None) == "a" for r in caplog.records if getattr(r, "run", None) == run_id)


async def test_a_cancel_s_log_line_names_the_provider_the_run_was_on(
        redis: Redis, caplog: pytest.LogCaptureFixture) -> None:
    """"cancel requested" (a caller left mid-stream) says where the run was, as every other line about
    an attempt does."""
    from workers.runner import Attempt
    from workers.service import _cancel

    runner = Runner(redis, make_config({"a": 2}), "n-a", {})
    task = asyncio.create_task(asyncio.Event().wait())
    runner.running["r1"] = (Attempt("r1", "m:1", "a", "1", 3, key="team-a"), task)
    await redis.hset(keys.run_record("r1"), mapping={"state": "running", "cancel": "1"})
    try:
        with caplog.at_level(logging.INFO, "iop.worker"):
            await _cancel(runner, "r1")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    [said] = [r for r in caplog.records if r.getMessage() == "cancel requested"]
    assert (getattr(said, "run", None), getattr(said, "provider", None), getattr(said, "key", None)) == (
        "r1", "a", "team-a")


class Fails(Scripted):
    """A provider whose every request fails with `error` (a whole answer or a stream)."""

    def __init__(self, error: ProviderError) -> None:
        super().__init__([])
        self.failure = error

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        raise self.failure

    async def stream(self, kind: RunKind, body: dict[str, Any],
                     request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        raise self.failure
        yield []


@pytest.mark.parametrize("silent", [True, False])
async def test_a_llamacpp_non_stream_run_whose_server_went_silent_marks_it_busy_for_read_timeout_ms(
        redis: Redis, silent: bool) -> None:
    """A non-stream request to llama-cpp-python that iop gave up because the server sent nothing
    for `read_timeout_ms` goes on there for nobody, as one whose caller left: its heartbeat says
    so (`busy_until_ms`), or the next probe would wait behind it, time out and take a busy server
    down. A server that answered (a 500 here) generates nothing more: not marked."""
    import aiohttp

    from workers.adapters.failures import transport_error
    config = parse_config({
        "models": [{"id": MODEL, "providers": {"a": "a-name"}}],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "llamacpp", "base_url": "http://127.0.0.1:9",
                                                "capacity": 1, "models": ["a-name"], "read_timeout_ms": 90_000}]}],
        "queue": {"max_queue": 10, "queue_timeout_ms": 60_000, "max_attempts": 1},
    })
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    error = (transport_error("a", aiohttp.SocketTimeoutError(), connect_ms=1000, read_ms=90_000) if silent
             else ProviderError("provider a: answered 500", status=500, retry=Retry.ELSEWHERE, strikes=0))
    runner = Runner(redis, config, "n-a", {"a": Fails(error)})
    before = now_ms()
    assert (await runner.execute(run_id)).startswith("failed")
    until = await redis.hget(keys.heartbeat("a"), "busy_until_ms")
    await client.close()
    if silent:
        assert until is not None and before + 90_000 <= int(until) <= now_ms() + 90_000
    else:
        assert until is None


@pytest.mark.parametrize("stream", [False, True])
async def test_a_llamacpp_non_stream_run_given_up_marks_its_server_busy_for_read_timeout_ms(
        redis: Redis, stream: bool) -> None:
    """A non-stream request to llama-cpp-python goes on for nobody once iop gives it up (its caller
    left, here): the provider's heartbeat says until when it may (`read_timeout_ms` from then), so
    that no health probe waits on it and takes a busy server down. A stream stops at once: nothing."""
    config = parse_config({
        "models": [{"id": MODEL, "providers": {"a": "a-name"}}],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "llamacpp", "base_url": "http://127.0.0.1:9",
                                                "capacity": 1, "models": ["a-name"], "read_timeout_ms": 90_000}]}],
        "queue": {"max_queue": 10, "queue_timeout_ms": 60_000},
    })
    client, sched, (run_id,) = await waiting_runs(redis, config, 1)
    if stream:
        await redis.hset(keys.run_record(run_id), "stream", "1")
    await sched.dispatch_all()
    adapter = Endless()
    runner = Runner(redis, config, "n-a", {"a": adapter})
    task = asyncio.create_task(runner.execute(run_id))
    await asyncio.wait_for(adapter.began.wait(), 10)
    before = now_ms()
    assert runner.cancel(run_id, cancelled_by_caller())
    assert (await task).startswith("cancelled")
    until = await redis.hget(keys.heartbeat("a"), "busy_until_ms")
    await client.close()
    if stream:
        assert until is None
    else:
        assert until is not None and before + 90_000 <= int(until) <= now_ms() + 90_000


async def test_more_output_read_at_once_than_an_event_holds_goes_as_several_in_order(redis: Redis) -> None:
    """A provider that sends faster than it is read gives the worker thousands of chunks in one
    read: they go as several deltas of at most `EVENT_BYTES` each (packed), numbered in turn, every
    chunk once and in order. (One of 374 KB had each caller that read slowly hold ~2.5 MB in its
    gateway, which holds at least one event a caller.)"""
    from workers.runner import EVENT_BYTES
    sched, run_id = await start_one(redis, {"a": 1})
    read = [text(f"token {i:05d} " + "x" * 60) for i in range(4000)]
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([read, [text("end")]])})
    assert await runner.execute(run_id) == "completed:ok"
    stored = [(f[b"type"], f[b"data"]) for _, f in await redis.xrange(keys.run_events(run_id))]
    deltas = [unpack(data) for etype, data in stored if etype == b"delta"]
    sizes = [len(data) for etype, data in stored if etype == b"delta"]
    assert len(deltas) > 4 and max(sizes) <= EVENT_BYTES, sizes
    assert [d["n"] for d in deltas] == list(range(1, len(deltas) + 1))
    got = [c for d in deltas for c in d["chunks"]]
    assert got == [*read, text("end")]
    assert unpack(stored[-1][1])["deltas"] == len(deltas)


async def test_a_run_whose_cancel_was_asked_while_its_output_went_out_unheard_counts_that_output(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its caller asked for the cancel (the record's `cancel`, as a DELETE writes it) while the reply
    of an `emit` Redis ran was on its way, and the worker stopped before it heard of either: the run
    ends cancelled, as asked, and its key counts the chunk of output that went out (it counted
    none: the attempt knew of none)."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[TEXT], [text("b")]])})
    await stopped_after_its_first_emit(runner, run_id, monkeypatch,
                                       first=lambda: redis.hset(keys.run_record(run_id), "cancel", "1"))
    assert await fields(redis, keys.run_record(run_id), "state", "output") == ["cancelled", "1"]
    usage = await redis.hgetall(keys.usage_total("anonymous"))
    assert usage.get(f"completion_tokens:{MODEL}".encode()) == b"1", usage


async def test_a_run_cancelled_while_a_later_emit_went_out_unheard_counts_every_chunk_its_caller_got(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first output was heard; the cancel (a DELETE, its caller leaving) came while the reply of
    a later `emit` Redis ran was on its way: its key counts every chunk that went out, as the record's
    `out_chunks` says (it counted the attempt's, one emit short: a cancel through the runs API in the
    middle of 40,000 unpaced tokens counted 12,355 of the 14,269 chunks its callers got)."""
    sched, run_id = await start_one(redis, {"a": 1})
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[text("a")], [text("b")], [text("c")]])})
    real_call = runner.scripts.call
    emits: list[str] = []

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        result = await real_call(name, run_keys, args)
        if name == "emit":
            emits.append(name)
            if len(emits) == 2:
                await redis.hset(keys.run_record(run_id), "cancel", "1")
                assert runner.cancel(run_id, cancelled_by_caller())
                await asyncio.sleep(0)
        return result

    monkeypatch.setattr(runner.scripts, "call", call)
    assert (await runner.execute(run_id)).startswith("cancelled")
    assert await deltas(redis, run_id) == [[text("a")], [text("b")]]
    assert await counted_tokens(redis) == (0, 2)


async def test_a_run_cancelled_before_its_last_read_went_out_counts_no_completion_tokens_of_it(
        redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpaced provider's last read holds hundreds of chunks and its usage: a cancel (a DELETE)
    that came after it was read and before it went out counted the whole answer's completion tokens
    (2,000 for a caller that got 1,227 chunks), not the chunks the caller got. The prompt tokens it
    says still count."""
    sched, run_id = await start_one(redis, {"a": 1})
    last = [text("b"), text("c"), text("d"),
            {**USAGE, "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}]
    runner = Runner(redis, sched.config, "n-a", {"a": Scripted([[text("a")], last])})
    real_call = runner.scripts.call
    emits: list[str] = []

    async def call(name: str, run_keys: Any, args: Any) -> Any:
        if name == "emit":
            emits.append(name)
            if len(emits) == 2:  # (the cancel comes before this emit is sent)
                await redis.hset(keys.run_record(run_id), "cancel", "1")
                assert runner.cancel(run_id, cancelled_by_caller())
                await asyncio.sleep(0)
        return await real_call(name, run_keys, args)

    monkeypatch.setattr(runner.scripts, "call", call)
    assert (await runner.execute(run_id)).startswith("cancelled")
    assert await deltas(redis, run_id) == [[text("a")]]
    assert await counted_tokens(redis) == (1, 1)
