"""`/metrics` of the gateway, a scheduler and a worker, as real processes, after real runs."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
import redis as sync_redis
from prometheus_client.parser import text_string_to_metric_families

from common import keys
from tests.conftest import Proc, Stack
from tests.conftest import async_wait_until as until
from tests.test_e2e import pool_config, sim_stats, wait_available

pytestmark = pytest.mark.e2e

MODEL = "qwen3.6:35b"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def with_metrics(stack: Stack, name: str, *args: str) -> tuple[Proc, str]:
    proc = stack.start(name, *args, "--metrics-port", "0", "--metrics-host", "127.0.0.1")
    return proc, proc.wait_for_line(r"metrics on (http://\S+)").group(1)


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_each_process_exposes_what_it_owns_and_counters_move(stack: Stack) -> None:
    url = stack.simulator(["only-served"])
    stack.write_config(pool_config({"only": ("n1", url, 1)}, queue={"max_queue": 8, "queue_timeout_ms": 60_000}))
    sched_proc, sched = with_metrics(stack, "scheduler", "scheduler")
    sched_proc.wait_for_line(r"iop scheduler \S+ running")
    worker_proc, worker = with_metrics(stack, "worker", "worker", "--node", "n1")
    worker_proc.wait_for_line(r"worker for queue \S+ started")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["only"])
    client = stack.openai(gateway)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            before = await scrape(session, gateway + "/metrics")
            for stream in (False, True, True):
                await asyncio.to_thread(_chat, client, stream)
            with pytest.raises(openai.NotFoundError):
                await asyncio.to_thread(_chat, client, False, "nope")
            for bad in ({"model": MODEL, "messages": []}, {"model": "nope", "messages": []},
                        {"model": 5, "messages": []}):  # (a bad body to a model served here: that model's)
                async with session.post(gateway + "/v1/chat/completions", json=bad) as resp:
                    assert resp.status == 400

            g = await scrape(session, gateway + "/metrics")
            ok = dict(model=MODEL, endpoint="chat", status="200")
            assert value(g, "iop_gateway_requests_total", **ok) - value(before, "iop_gateway_requests_total", **ok) == 3
            assert value(g, "iop_gateway_requests_total", model="-", endpoint="chat", status="404") >= 1
            assert value(g, "iop_gateway_requests_total", model=MODEL, endpoint="chat", status="400") == 1
            assert value(g, "iop_gateway_requests_total", model="-", endpoint="chat", status="400") == 2
            assert value(g, "iop_gateway_request_duration_seconds_count", model=MODEL, endpoint="chat") >= 3
            assert value(g, "iop_gateway_time_to_first_token_seconds_count", model=MODEL) >= 2
            assert value(g, "iop_gateway_time_to_first_token_seconds_bucket", model=MODEL, le="+Inf") >= 2

            s = await scrape(session, sched)
            assert value(s, "iop_scheduler_dispatch_total", model=MODEL, outcome="ok") == 3
            assert value(s, "iop_scheduler_dispatch_latency_seconds_count", model=MODEL) == 3
            # one at a time, each run was dispatched by the script sent with the read that found it
            assert value(s, "iop_scheduler_dispatch_pending_runs_total") == 3
            assert value(s, "iop_scheduler_dispatch_pending_calls_total") >= 3
            assert value(s, "iop_queue_depth", model=MODEL) == 0
            assert value(s, "iop_queue_oldest_age_seconds", model=MODEL) == 0
            assert {"iop_queue_depth", "iop_scheduler_waiting_runs"} <= names(s)

            w = await scrape(session, worker)
            assert value(w, "iop_worker_runs_total", model=MODEL, provider="only", outcome="completed") == 3
            assert value(w, "iop_worker_run_duration_seconds_count", model=MODEL, provider="only") == 3
            assert value(w, "iop_provider_capacity", provider="only", node="n1") == 1
            assert value(w, "iop_provider_in_flight", provider="only", node="n1") == 0
            assert value(w, "iop_provider_health", provider="only", node="n1", state="available") == 1
            assert value(w, "iop_provider_health", provider="only", node="n1", state="unavailable") == 0

            # One run holds the only slot; two more wait: the queue gauges and in_flight show it.
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                    "sim": {"ttft_ms": 600_000}}
            holder = asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=body))

            async def busy() -> bool:
                return bool((await sim_stats(session, url))["current"] == 1)

            await until(busy, what="the slot to be taken")
            waiting = [asyncio.create_task(session.post(gateway + "/v1/chat/completions", json=body))
                       for _ in range(2)]

            async def queued() -> Samples | None:
                # (the queue's depth is its stream's length; the waiting runs, those the replica
                # has read from it: a run just queued is in the first a moment before the second)
                s = await scrape(session, sched)
                both = value(s, "iop_queue_depth", model=MODEL) == value(s, "iop_scheduler_waiting_runs", model=MODEL)
                return s if both and value(s, "iop_queue_depth", model=MODEL) == 2 else None

            s = await until(queued, what="two queued runs in the scheduler's metrics")
            assert value(s, "iop_queue_oldest_age_seconds", model=MODEL) >= 0
            assert value(s, "iop_scheduler_waiting_runs", model=MODEL) == 2
            w = await scrape(session, worker)
            assert value(w, "iop_provider_in_flight", provider="only", node="n1") == 1
            # Cancel all three through the runs API; each caller gets its answer.
            r = sync_redis.Redis.from_url(stack.redis_url)
            run_ids = [f[b"run"].decode() for _, f in r.xrange(keys.runs_stream(MODEL))]
            run_ids += [m.decode() for m in r.zrange(keys.leases("only"), 0, -1)]
            r.close()
            assert len(run_ids) == 3
            for run_id in run_ids:
                async with session.delete(f"{gateway}/v1/runs/{run_id}") as resp:
                    assert (await resp.json())["state"] == "cancelled"
            for task in (holder, *waiting):
                resp = await task
                await resp.read()
                resp.release()

            async def drained() -> bool:
                s = await scrape(session, sched)
                return value(s, "iop_queue_depth", model=MODEL) == 0

            await until(drained, what="the cancelled runs to leave the queue")

    asyncio.run(scenario())


def _chat(client: openai.OpenAI, stream: bool, model: str = MODEL) -> Any:
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    if stream:
        return list(client.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True))
    return client.chat.completions.create(model=model, messages=messages, max_tokens=2)


def test_the_metrics_port_also_answers_healthz_and_readyz(stack: Stack) -> None:
    url = stack.simulator(["only-served"])
    stack.write_config(pool_config({"only": ("n1", url, 1)}))
    _, sched = with_metrics(stack, "scheduler", "scheduler")
    _, worker = with_metrics(stack, "worker", "worker", "--node", "n1")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            for metrics_url in (sched, worker):
                base = metrics_url.removesuffix("/metrics")
                for path in ("/healthz", "/readyz"):
                    async with session.get(base + path) as resp:
                        assert resp.status == 200, base + path

    asyncio.run(scenario())


async def test_the_metrics_port_answers_errors_in_openai_s_shape() -> None:
    """As the gateway's: an unknown path, a method it does not take, not ready (it was plain text,
    and a bare {"status": "not ready"})."""
    from prometheus_client import CollectorRegistry

    from common.metrics_http import start_metrics_server
    from tests.openapi import validate

    async def not_ready() -> bool:
        return False

    server = await start_metrics_server(CollectorRegistry(), "127.0.0.1", 0, ready=not_ready)
    base = server.url.removesuffix("/metrics")
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, status, code, says in (
                    ("GET", "/nope", 404, "not_found", "Invalid URL (GET /nope): this port serves GET /metrics"),
                    ("POST", "/metrics", 405, "method_not_allowed", "POST /metrics is not allowed: it takes GET"),
                    ("GET", "/readyz", 503, "service_unavailable", "not ready: Redis is unreachable")):
                async with session.request(method, base + path) as resp:
                    body = await resp.json()
                    assert resp.status == status, body
                    validate("ErrorResponse", body)
                    assert body["error"]["code"] == code and body["error"]["message"].startswith(says), body
                    assert resp.headers["X-Request-Id"].startswith("req_")
            async with session.get(base + "/healthz") as resp:
                assert resp.status == 200
    finally:
        await server.close()


async def test_a_scrape_whose_redis_read_is_refused_answers_with_the_last_values(
        caplog: pytest.LogCaptureFixture) -> None:
    """A key of iop's of another type (an operator's `SET iop:drain:p1 x` as a hash, another app's):
    Redis answers WRONGTYPE, and the scheduler's and worker's /metrics answered 500 with a traceback
    at every scrape (operator's audit). Now a warning, and the values it has."""
    from prometheus_client import CollectorRegistry, Gauge
    from redis.exceptions import ResponseError

    from common.metrics_http import start_metrics_server

    registry = CollectorRegistry()
    Gauge("iop_test_value", "a value", registry=registry).set(7)

    async def refused() -> None:
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    server = await start_metrics_server(registry, "127.0.0.1", 0, refresh=refused)
    try:
        async with aiohttp.ClientSession() as session, session.get(server.url) as resp:
            assert resp.status == 200 and "iop_test_value 7.0" in await resp.text()
    finally:
        await server.close()
    assert any("Redis refused a read (WRONGTYPE Operation" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)
