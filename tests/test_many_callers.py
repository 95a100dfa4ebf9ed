"""Thousands of callers per gateway: every waiting caller is served by the gateway's one event
reader, over a fixed few Redis connections however many wait; each gets exactly its own events;
a stream that waits in its queue is kept alive with SSE comments, and an error after those went
out comes in the stream, OpenAI-shaped, then [DONE] (the openai client parses it all)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest
import redis as sync_redis

from tests.conftest import Stack, async_wait_until
from tests.test_e2e import FAST_RUNTIME, pool_config, wait_available

pytestmark = pytest.mark.e2e

CALLERS = 1000
POOL = 16  # the gateway's Redis pool (runtime.redis_max_connections): far fewer than the callers


def gateway_connections(redis_url: str) -> Counter[str]:
    """The gateway's connections by name: its pool's (`iop-gateway`), its inbox listener's and its
    scripts' (`common.redisline`)."""
    with sync_redis.Redis.from_url(redis_url) as r:
        return Counter(c["name"] for c in r.client_list() if c.get("name", "").startswith("iop-gateway"))


async def one_caller(session: aiohttp.ClientSession, gateway: str, n: int) -> tuple[int, set[str], str]:
    """A stream of `n` tokens: (tokens it got, the chunk ids it saw, how it ended)."""
    body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "max_tokens": n}
    tokens, ids, last = 0, set(), ""
    async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last != "[DONE]":
                chunk = json.loads(last)
                ids.add(chunk["id"])
                tokens += sum(1 for c in chunk["choices"] if c["delta"].get("content"))
    return tokens, ids, last


def test_a_thousand_waiting_callers_share_a_fixed_few_redis_connections(stack: Stack) -> None:
    urls = {p: stack.simulator([f"{p}-served"], "--ttft-ms", "300", "--itl-ms", "5") for p in ("a", "b")}
    config = pool_config({p: (f"n-{p}", url, 50) for p, url in urls.items()}, queue={"max_queue": CALLERS})
    config["runtime"] = {**FAST_RUNTIME, "redis_max_connections": POOL}
    stack.write_config(config)
    stack.scheduler()
    for p in urls:
        stack.worker(f"n-{p}")
    gateway = stack.gateway()
    wait_available(stack.redis_url, list(urls))
    peak: Counter[str] = Counter()

    async def scenario() -> list[tuple[int, set[str], str]]:
        nonlocal peak
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
            calls = [asyncio.create_task(one_caller(session, gateway, 1 + i % 8)) for i in range(CALLERS)]
            while not all(c.done() for c in calls):
                peak |= await asyncio.to_thread(gateway_connections, stack.redis_url)
                await asyncio.wait(calls, timeout=0.2)
            return [c.result() for c in calls]

    results = asyncio.run(scenario())
    for i, (tokens, ids, last) in enumerate(results):
        assert (tokens, last) == (1 + i % 8, "[DONE]"), (i, tokens, last)  # its own length, whole
        assert len(ids) == 1, ids  # every chunk from its own run
    assert len({next(iter(ids)) for _, ids, _ in results}) == CALLERS  # no two callers got one run
    # one listener and one connection for every caller's scripts, and at most the pool for the rest
    assert peak["iop-gateway:inbox"] == 1 and peak["iop-gateway:scripts"] == 1, peak
    assert peak["iop-gateway"] <= POOL, peak


def test_a_stream_waiting_in_its_queue_is_kept_alive_then_answered_or_told(stack: Stack) -> None:
    url = stack.simulator(["only-served"], "--ttft-ms", "50")
    config = pool_config({"only": ("n1", url, 1)}, queue={"queue_timeout_ms": 2500})
    config["runtime"] = {**FAST_RUNTIME, "stream_keepalive_ms": 300}
    stack.write_config(config)
    stack.scheduler()
    stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["only"])

    async def scenario() -> tuple[list[str], list[str], list[Any]]:
        async with aiohttp.ClientSession() as session:

            async def hold(ttft_ms: int) -> asyncio.Task[aiohttp.ClientResponse]:
                """A run that takes the provider's one slot for `ttft_ms`; returns once it has it."""
                task = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json={
                    "model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                    "sim": {"ttft_ms": ttft_ms}}))

                async def busy() -> bool:
                    async with session.get(url + "/stats") as resp:
                        return bool((await resp.json())["current"] == 1)

                await async_wait_until(busy, what="the holder at the provider")
                return task

            async def raw_stream() -> list[str]:
                body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                        "max_tokens": 2}
                async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    return [line.decode().rstrip("\n") async for line in resp.content if line.strip()]

            holder = await hold(1500)
            served = await raw_stream()  # waits ~1.5 s behind the holder, then is served
            (await holder).release()
            holder = await hold(6000)
            timed_out = await raw_stream()  # waits past queue_timeout_ms behind the holder
            (await holder).release()
            holder = await hold(1500)
            async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
                stream = await client.chat.completions.create(
                    model="qwen3.6:35b", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True)
                chunks = [c async for c in stream]
            (await holder).release()
            return served, timed_out, chunks

    served, timed_out, chunks = asyncio.run(scenario())
    assert served[0] == ": keep-alive" and served.count(": keep-alive") >= 2, served
    assert served[-1] == "data: [DONE]" and any('"content":"tok0 "' in line for line in served)
    assert timed_out[0] == ": keep-alive" and timed_out[-1] == "data: [DONE]", timed_out
    assert '"code":"queue_timeout"' in timed_out[-2], timed_out
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 "
