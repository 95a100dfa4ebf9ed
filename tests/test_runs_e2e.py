"""The runs API against real processes: a finished run's record and events, and cancelling a
run while a provider is executing it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis as sync_redis

from common import keys
from tests.conftest import Stack
from tests.conftest import async_wait_until as until
from tests.sse import read_all
from tests.test_e2e import sim_stats, start_pool

pytestmark = pytest.mark.e2e


def test_a_finished_run_shows_where_it_ran_and_replays_its_events(stack: Stack) -> None:
    gateway, _ = start_pool(stack, {"vllm-a": 2})
    client = stack.openai(gateway)
    raw = client.chat.completions.with_raw_response.create(
        model="qwen3.6:35b", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == "tok0 tok1 tok2 "
    run_id = raw.headers["x-iop-run-id"]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{gateway}/v1/runs/{run_id}") as resp:
                view = await resp.json()
            async with session.get(f"{gateway}/v1/runs/{run_id}/events") as resp:
                messages = await read_all(resp)
        assert view["state"] == "completed" and view["model"] == "qwen3.6:35b"
        assert (view["provider"], view["node"], view["target"], view["attempts"]) == (
            "vllm-a", "node-vllm-a", "vllm-a-served", 1)
        assert view["created_ms"] <= view["dispatched_ms"] <= view["started_ms"] <= view["finished_ms"]
        assert view["error"] is None
        kinds = [m.event for m in messages]
        assert kinds[:2] == ["dispatched", "started"] and kinds[-1] == "completed"
        assert set(kinds[2:-1]) == {"delta"}
        streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                           for m in messages if m.event == "delta" for c in m.data["chunks"] if c["choices"])
        assert streamed == text
        # each delta says its number and its attempt as numbers, the attempt as `started` says it
        started = next(m.data for m in messages if m.event == "started")
        numbered = [(m.data["n"], m.data["a"]) for m in messages if m.event == "delta"]
        assert numbered == [(i, started["attempt"]) for i in range(1, len(numbered) + 1)]
        assert all(type(n) is int and type(a) is int for n, a in numbered)

    asyncio.run(scenario())
    r = sync_redis.Redis.from_url(stack.redis_url)
    ttl = 3600  # runtime.run_ttl_s default
    assert 0 < r.ttl(keys.run_record(run_id)) <= ttl and 0 < r.ttl(keys.run_events(run_id)) <= ttl
    r.close()


def test_delete_of_a_running_run_aborts_it_and_frees_the_slot(stack: Stack) -> None:
    gateway, urls = start_pool(stack, {"only": 1})
    r = sync_redis.Redis.from_url(stack.redis_url)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                    "sim": {"ttft_ms": 600_000}}
            caller = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=body))

            async def running_run() -> str | None:
                ids = r.zrange(keys.leases("only"), 0, -1)
                if not ids:
                    return None
                async with session.get(f"{gateway}/v1/runs/{ids[0].decode()}") as resp:
                    view = await resp.json()
                stats = await sim_stats(session, urls["only"])
                return str(view["id"]) if view["state"] == "running" and stats["current"] == 1 else None

            run_id = await until(running_run, what="the run to be running at the provider")
            async with session.delete(f"{gateway}/v1/runs/{run_id}") as resp:
                assert resp.status == 200
                view = await resp.json()
            assert view["state"] == "cancelled" and view["error"]["code"] == "cancelled"
            assert view["error"]["message"] == "cancelled through the runs API"  # (not "by the caller")
            assert r.zcard(keys.leases("only")) == 0
            resp = await caller
            # The caller hears it: a 499, or an error event if its stream had begun.
            text = await resp.text()
            assert resp.status in (200, 499) and '"code":"cancelled"' in text.replace(" ", "")

            async def provider_idle() -> bool:
                return bool((await sim_stats(session, urls["only"]))["current"] == 0)

            await until(provider_idle, what="the provider to see the request aborted")

    asyncio.run(scenario())
    r.close()
