"""Failures make no reference cycles that hold what a request carried.

Services collect garbage every 5,000 allocations, not 700 (`common.lifecycle.tune_gc`): garbage
that only the collector frees lives longer, and a cycle through an exception's traceback holds
every frame on its way (the request, its body, what a provider sent). Each case here fails once,
with the collector off, then asks the collector what it would find (`gc.DEBUG_SAVEALL`): no
exception and nothing holding the 512 KiB the request or the provider carried."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from redis.asyncio import Redis

from common import keys
from common.codec import pack
from common.config import Config, parse_config
from tests.conftest import redis_full
from tests.test_gateway_hostile import post_chat, serve
from tests.test_scheduler import MODEL, beat, waiting_runs
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.runner import Runner
from workers.service import provider_session

BIG = "y" * (1 << 19)


def left_behind() -> list[str]:
    """What the collector finds that only it would free: the exceptions among it, and what holds
    a string or bytes as large as half of `BIG`."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [f"exception {type(o).__name__}" for o in gc.garbage if isinstance(o, BaseException)]
        found += [f"{type(o).__name__} holding {len(r)} bytes" for o in gc.garbage for r in gc.get_referents(o)
                  if isinstance(r, (bytes, bytearray, str)) and len(r) >= len(BIG) // 2]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


async def once_without_collector(action: Callable[[], Awaitable[Any]]) -> list[str]:
    gc.collect()
    gc.disable()
    try:
        await action()
        await asyncio.sleep(0.05)  # (what the failure set off elsewhere ends)
        return left_behind()
    finally:
        gc.enable()


@pytest.fixture
async def provider() -> AsyncIterator[str]:
    """A provider failing in each way, by path: `/400/v1/...`, `/500/...`, `/garbage/...`."""
    async def answer_400(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, status=400)

    async def answer_500(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=500, text="boom " + BIG)

    async def garbage(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="not json" + BIG, content_type="application/json")

    app = web.Application(client_max_size=4 << 20)
    for name, handler in (("400", answer_400), ("500", answer_500), ("garbage", garbage)):
        app.router.add_post(f"/{name}/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def config(base_url: str, stream_batch_ms: int = 0) -> Config:
    return parse_config({
        "models": [{"id": MODEL, "providers": {"a": "a-name"}}],
        "nodes": [{"id": "n-a", "providers": [{"id": "a", "type": "vllm", "base_url": base_url, "capacity": 4,
                                               "models": ["a-name"]}]}],
        "queue": {"max_queue": 100, "queue_timeout_ms": 60_000, "max_attempts": 1},
        "runtime": {"stream_batch_ms": stream_batch_ms, "max_body_bytes": 4 << 20},
    })


@pytest.mark.parametrize("answer", ["400", "500", "garbage"])
@pytest.mark.parametrize(("stream", "batch_ms"), [(False, 0), (True, 0), (True, 20)],
                         ids=["whole", "stream", "stream-batched"])
async def test_a_run_its_provider_fails_leaves_nothing_for_the_collector(
        redis: Redis, provider: str, answer: str, stream: bool, batch_ms: int) -> None:
    # (a batched stream's failure was raised from a local of the frame its traceback holds)
    cfg = config(f"{provider}/{answer}", batch_ms)
    session = provider_session()
    runner = Runner(redis, cfg, "n-a", {"a": OpenAICompatAdapter(cfg.provider("a"), session)})

    async def fail_once() -> None:
        client, sched, (run_id,) = await waiting_runs(redis, cfg, 1)
        await redis.hset(keys.run_record(run_id), mapping={
            "stream": "1" if stream else "0",
            "body": pack({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": BIG}]})})
        await sched.dispatch_all()
        assert (await runner.execute(run_id)).startswith("failed")
        await client.close()
        await redis.flushall()

    try:
        await fail_once()  # (what a first run makes once: connections, scripts loaded)
        assert await once_without_collector(fail_once) == []
    finally:
        await session.close()


def delta_event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "a-name", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": None}]}).encode() + b"\n\n"


@pytest.mark.parametrize("batch_ms", [0, 20], ids=["stream", "stream-batched"])
async def test_a_stream_garbled_after_output_leaves_nothing_for_the_collector(redis: Redis, batch_ms: int) -> None:
    """The chunks before a garbled line reach the caller, then its error: the parser holds the
    error meanwhile, which must not leave it and the frames it came through holding each other
    (a review found the held error's traceback holding its parser)."""
    emitted = asyncio.Event()

    async def garbled(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(delta_event("a "))
        await emitted.wait()  # (the caller has output: the next read's error is held behind its chunks)
        await resp.write(delta_event("b " + BIG) + b"data: {overloaded}\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", garbled)
    site = web.AppRunner(app)
    await site.setup()
    await web.TCPSite(site, "127.0.0.1", 0).start()
    cfg = config(f"http://127.0.0.1:{site.addresses[0][1]}", batch_ms)
    session = provider_session()
    runner = Runner(redis, cfg, "n-a", {"a": OpenAICompatAdapter(cfg.provider("a"), session)})
    emit = runner._emit

    async def emitting(*args: Any) -> None:
        await emit(*args)
        emitted.set()

    runner._emit = emitting  # type: ignore[method-assign,assignment]

    async def fail_once() -> None:
        emitted.clear()
        client, sched, (run_id,) = await waiting_runs(redis, cfg, 1)
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        await redis.hset(keys.run_record(run_id), mapping={"stream": "1", "body": pack(body)})
        await sched.dispatch_all()
        assert (await runner.execute(run_id)).startswith("failed")
        events = [f[b"type"] for _, f in await redis.xrange(keys.run_events(run_id))]
        assert events.count(b"delta") >= 1 and events[-1] == b"failed", events
        deltas = [f[b"data"] for _, f in await redis.xrange(keys.run_events(run_id)) if f[b"type"] == b"delta"]
        assert b"b " in b"".join(deltas)  # the chunk before the garbled line went out
        await client.close()
        await redis.flushall()

    try:
        await fail_once()
        assert await once_without_collector(fail_once) == []
    finally:
        await session.close()
        await site.cleanup()


def big_chat(stream: bool) -> bytes:
    """A chat completion request carrying `BIG`."""
    return json.dumps({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": BIG}]}).encode()


async def test_a_streamed_run_that_fails_before_output_leaves_nothing_for_the_collector(
        redis: Redis, redis_url: str, provider: str) -> None:
    # (the gateway raised the run's error from a local of the frame its traceback holds)
    cfg = config(f"{provider}/400")
    await beat(redis, cfg)
    site, gateway = await serve(cfg, redis_url)
    session = provider_session()
    runner = Runner(redis, cfg, "n-a", {"a": OpenAICompatAdapter(cfg.provider("a"), session)})
    from scheduler.core import Scheduler
    sched = Scheduler(redis, cfg)
    await sched.ensure_groups()

    async def work() -> None:
        while True:
            await sched.read_new(block_ms=10)
            await sched.dispatch_all()
            for run_id in [m.decode() for m in await redis.zrange(keys.node_queue("n-a"), 0, -1)]:
                if await redis.hget(keys.run_record(run_id), "state") == b"dispatched":
                    await runner.execute(run_id)

    worker = asyncio.create_task(work())

    async def fail_once() -> None:
        answer = await post_chat(gateway, big_chat(stream=True))
        assert answer.status == 400, answer.body[:300]

    try:
        await fail_once()
        assert await once_without_collector(fail_once) == []
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await session.close()
        await site.cleanup()


async def test_a_request_refused_while_redis_is_full_leaves_nothing_for_the_collector(
        redis: Redis, redis_url: str) -> None:
    # (the script batch's futures and frames held the error, whose traceback holds them)
    cfg = config("http://127.0.0.1:9")
    await beat(redis, cfg)
    site, gateway = await serve(cfg, redis_url)

    async def refused_once() -> None:
        answer = await post_chat(gateway, big_chat(stream=False))
        assert answer.status == 503 and b"maxmemory" not in answer.body, answer.body[:300]

    try:
        async with redis_full(redis):
            await refused_once()
            assert await once_without_collector(refused_once) == []
    finally:
        await site.cleanup()
