"""Busy is not down, with real processes: a provider whose probes time out while it generates
keeps its callers (they wait their turn, none gets a 503), and a provider that dies while it
runs is marked unavailable by the runs' own failures, at once, without waiting for a probe."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
import redis as sync_redis

from tests.conftest import Stack, wait_until
from tests.test_e2e import FAST_RUNTIME, pool_config, wait_available

pytestmark = pytest.mark.e2e

ASK: list[Any] = [{"role": "user", "content": "x"}]


async def streamed_text(client: openai.AsyncOpenAI, **extra: Any) -> str:
    stream = await client.chat.completions.create(
        model="qwen3.6:35b", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=3, **extra)
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    return text


def test_a_provider_too_busy_to_answer_its_probes_keeps_its_callers(stack: Stack) -> None:
    # every probe of this server takes 3 s while it generates, far beyond probe_timeout_ms
    url = stack.simulator(["busy-served"], "--ttft-ms", "700", "--busy-probe-ms", "3000")
    config = pool_config({"busy": ("n1", url, 2)})
    config["nodes"][0]["providers"][0]["probe_timeout_ms"] = 100
    stack.write_config(config)
    stack.scheduler()
    worker = stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["busy"])

    async def six() -> list[str]:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(streamed_text(client) for _ in range(6)))

    assert asyncio.run(six()) == ["tok0 tok1 tok2 "] * 6  # three rounds of two, all served
    assert "provider busy is available" in worker.output()
    assert "is unavailable" not in worker.output()


def test_a_provider_that_dies_while_it_runs_is_down_at_once(stack: Stack) -> None:
    fast = {**FAST_RUNTIME, "probe_interval_ms": 60_000}  # no probe will notice: the runs must
    url = stack.simulator(["sim-served"], "--ttft-ms", "60000")
    sim = stack.procs[-1]
    config = pool_config({"sim": ("n1", url, 2)})
    config["runtime"] = fast
    stack.write_config(config)
    stack.scheduler()
    worker = stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["sim"])

    async def call() -> Exception | None:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
            try:
                await client.chat.completions.create(model="qwen3.6:35b",
                                                     messages=[{"role": "user", "content": "x"}])
            except openai.APIStatusError as exc:
                return exc
        return None

    async def scenario() -> Exception | None:
        task = asyncio.create_task(call())
        r = sync_redis.Redis.from_url(stack.redis_url)
        await asyncio.to_thread(wait_until, lambda: r.zcard("iop:leases:sim") == 1, what="the run to start")
        sim.stop()  # the server dies mid-run: the connection breaks, then reconnects are refused
        try:
            return await task
        finally:
            r.close()

    error = asyncio.run(scenario())
    assert isinstance(error, openai.APIStatusError) and error.status_code in (502, 503)
    r = sync_redis.Redis.from_url(stack.redis_url)
    wait_until(lambda: r.hget("iop:provider:sim", "health") == b"unavailable", timeout=10,
               what="the provider to be unavailable")
    reason = (r.hget("iop:provider:sim", "reason") or b"").decode()
    # The run's failure took it down; the probe that strikes call for at once (its interval is
    # 60 s here, so no other probe comes) may have found it refused since and said so last.
    assert reason in ("provider sim: connection refused", "provider sim: the server closed the connection",
                      "GET /health: connection refused"), reason
    r.close()
    worker.wait_for_line(r"provider sim is unavailable", timeout=10)  # (a log line may come 20 ms late)


def test_one_callers_request_that_breaks_every_answer_does_not_take_the_model_down(stack: Stack) -> None:
    """A request the servers drop the connection of (sent again by its client: three runs of
    three attempts) strikes its providers down; strikes say "check now", and a probe that passes
    brings them back at once, not at their next probe interval (60 s here: the model's other
    callers got 503 `no_available_provider` until then)."""
    urls = {pid: stack.simulator([f"{pid}-served"]) for pid in ("a", "b")}
    config = pool_config({pid: ("n1", url, 2) for pid, url in urls.items()})
    config["runtime"] = {**FAST_RUNTIME, "probe_interval_ms": 60_000}
    stack.write_config(config)
    stack.scheduler()
    worker = stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["a", "b"])

    async def poison() -> list[int]:
        statuses = []
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
            for _ in range(3):  # (the openai client's own two retries)
                try:
                    await client.chat.completions.create(model="qwen3.6:35b", messages=ASK,
                                                         extra_body={"sim": {"fail_after_tokens": 0}})
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
        return statuses

    # (502 provider_error; a call that came while both were down, 503 no_available_provider)
    assert set(asyncio.run(poison())) <= {502, 503}
    worker.wait_for_line(r"provider [ab] is unavailable", timeout=10)  # the strikes took one down ...
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:  # ... and its probe brought it back, long before its probe interval
        wait_until(lambda: all(r.hget(f"iop:provider:{pid}", "health") == b"available" for pid in urls),
                   timeout=10, what="both providers available again")
    finally:
        r.close()

    async def served() -> str | None:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
            reply = await client.chat.completions.create(model="qwen3.6:35b", messages=ASK, max_tokens=2)
            return reply.choices[0].message.content

    assert asyncio.run(served()) == "tok0 tok1 "


def test_a_provider_whose_health_answers_while_its_runs_fail_is_benched_for_that_model(stack: Stack) -> None:
    """Provider a's `/health` answers, but every run of qwen3.6:35b there fails (500): three runs in
    a row that b then served bench a for that model (found by a hostile-provider audit: it stayed
    `available` with no reason, and each run paid a failed attempt there first). The model's next
    runs go straight to b, and the catalog says why; a's other model, which only a serves, is not
    touched. Once the bench is out a takes the model's runs again, and the first that fails there
    benches it again at once."""
    bad = stack.simulator(["a-served", "solo-served"], "--fail-rate", "1", "--fail-status", "500")
    good = stack.simulator(["b-served"])
    config = pool_config({"a": ("n1", bad, 2), "b": ("n2", good, 2)})
    config["nodes"][0]["providers"][0]["models"].append("solo-served")
    config["models"].append({"id": "solo", "providers": {"a": "solo-served"}})
    config["runtime"] = {**FAST_RUNTIME, "bench_ms": 1500}
    stack.write_config(config)
    stack.scheduler()
    stack.worker("n1")
    stack.worker("n2")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["a", "b"])
    r = sync_redis.Redis.from_url(stack.redis_url, decode_responses=True)

    async def served(n: int) -> list[str]:
        async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
            return [(await client.chat.completions.create(model="qwen3.6:35b", messages=ASK, max_tokens=2)
                     ).choices[0].message.content or "" for _ in range(n)]

    async def tried(url: str) -> int:
        async with aiohttp.ClientSession() as session, session.get(url + "/stats") as resp:
            return int((await resp.json())["total"])

    async def placement() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(gateway + "/v1/catalog") as resp:
            catalog = await resp.json()
        model = next(m for m in catalog["models"] if m["id"] == "qwen3.6:35b")
        return next(p for p in model["providers"] if p["provider_id"] == "a")

    async def solo_status() -> int:
        async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions", json={
                "model": "solo", "messages": ASK, "sim": {"fail_rate": 0}}) as resp:
            return resp.status

    try:
        assert asyncio.run(served(3)) == ["tok0 tok1 "] * 3  # (each failed on a, then b served it)
        assert asyncio.run(tried(bad)) == 3
        where = asyncio.run(placement())
        assert where["reason"] == "benched" and where["detail"].startswith("3 runs of 'a-served' in a row failed")
        assert r.hget("iop:provider:a", "health") == "available"  # (its health is not what failed)
        assert asyncio.run(served(3)) == ["tok0 tok1 "] * 3
        assert asyncio.run(tried(bad)) == 3  # (straight to b, its probes passing all the while)
        assert asyncio.run(solo_status()) == 200  # (its other model, on a alone, is served there)
        assert asyncio.run(tried(bad)) == 4
        wait_until(lambda: asyncio.run(placement())["selectable"], timeout=10, what="a back once its bench is out")
        assert asyncio.run(served(1)) == ["tok0 tok1 "]
        assert asyncio.run(tried(bad)) == 5
        assert asyncio.run(placement())["reason"] == "benched"  # (one more failure: benched again)
    finally:
        r.close()
