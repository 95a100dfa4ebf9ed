"""A provider that misbehaves meets every limit of a run (real processes, a real Redis): each
case ends with a clear OpenAI-shaped error, the slot back, the request body gone from Redis, and
the run's Redis memory under the documented bound."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from gateway.responses_output import MAX_OUTPUT_ITEMS
from tests.conftest import Stack, wait_until
from tests.fakes.misbehaving import NAMES, Misbehaving
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

LIMITS = {"max_output_bytes": 64 * 1024, "max_response_bytes": 256 * 1024, "max_line_bytes": 16 * 1024,
          "max_error_chars": 200, "max_events_per_run": 1000}
#: what a run may hold in Redis at most: its output, and what events, record and keys cost besides
RUN_BOUND_BYTES = LIMITS["max_output_bytes"] + 64 * 1024


@pytest.fixture
def misbehaving(stack: Stack) -> Iterator[str]:
    with Misbehaving() as server:
        yield server.url
        # The worker goes before the server it talks to, also when a test's setup failed: a probe
        # connecting while the server stops would leave a socket no one closes (a ResourceWarning
        # that failed this module in CI).
        stack.stop_all()


@pytest.fixture
def gateway(stack: Stack, misbehaving: str) -> str:
    return pool(stack, misbehaving, LIMITS)


def pool(stack: Stack, misbehaving: str, limits: dict[str, int]) -> str:
    """A provider for each misbehaviour, the runtime's limits `limits`; the gateway's URL."""
    stack.write_config({
        "models": [{"id": name, "providers": {f"p-{name}": name}} for name in NAMES],
        "nodes": [{"id": "n1", "providers": [
            {"id": f"p-{name}", "type": "vllm", "base_url": misbehaving, "capacity": 2, "models": [name]}
            for name in NAMES]}],
        "runtime": {**FAST_RUNTIME, **limits},
        "queue": {"max_attempts": 1},
    })
    stack.scheduler()
    stack.worker("n1")
    url = stack.gateway()
    wait_available(stack.redis_url, [f"p-{name}" for name in NAMES])
    return url


async def ask(gateway: str, model: str, stream: bool) -> tuple[int, Any, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "x" * 1000}], "stream": stream}
    async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions", json=body) as resp:
        text = await resp.text()
        if resp.status == 502 and "output_too_large" in text:  # (another try would only repeat it)
            assert resp.headers.get("x-should-retry") == "false", resp.headers
        return resp.status, resp.headers.get("X-IOP-Run-Id"), text


def settled(stack: Stack, run_id: str, provider: str) -> dict[str, Any]:
    """The run once its slot is back: its state, whether its body is still in Redis, its memory."""
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        wait_until(lambda: r.zcard(f"iop:leases:{provider}") == 0, what="the slot to come back")
        return {"state": r.hget(f"iop:run:{run_id}", "state"), "body": r.hexists(f"iop:run:{run_id}", "body"),
                "bytes": sum(r.memory_usage(k) or 0 for k in (f"iop:run:{run_id}", f"iop:events:{run_id}"))}
    finally:
        r.close()


def test_an_endless_stream_ends_at_the_output_limit(stack: Stack, gateway: str) -> None:
    """What was sent stays sent, then the error; or, when the worker's first read already passed the
    limit (a loaded machine: the provider wrote much before the worker read), nothing was sent and
    the answer is a 502 with the same error. Either way the run ends failed, its memory bounded."""
    status, run_id, text = asyncio.run(ask(gateway, "endless", True))
    if status == 502:
        assert json.loads(text)["error"]["code"] == "output_too_large" and "max_output_bytes" in text
    else:
        assert status == 200 and "word0 " in text  # what was sent stays sent ...
        assert '"code":"output_too_large"' in text and "max_output_bytes" in text  # ... then the error
    run = settled(stack, run_id, "p-endless")
    assert run["state"] == b"failed" and not run["body"] and run["bytes"] < RUN_BOUND_BYTES, run


def test_an_endless_responses_stream_ends_at_the_output_limit(stack: Stack, gateway: str) -> None:
    """What a Responses stream holds in the gateway (its output, for its last events) is bounded
    by the same limit: the stream ends with `error` and `response.failed`, the text sent so far in
    its incomplete item (or, when the worker's first read already passed the limit, nothing was
    sent and the answer is a 502)."""
    async def responses() -> tuple[int, str]:
        body = {"model": "endless", "input": "x", "stream": True}
        async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/responses", json=body) as resp:
            return resp.status, await resp.text()

    status, text = asyncio.run(responses())
    if status == 502:  # (the worker's first read already passed the limit: nothing had been sent)
        assert json.loads(text)["error"]["code"] == "output_too_large"
        return
    events = [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if "data: " in block]
    assert status == 200 and [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "output_too_large" and "max_output_bytes" in events[-2]["message"]
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    item = events[-1]["response"]["output"][0]
    assert sent.startswith("word0 ") and item["status"] == "incomplete" and item["content"][0]["text"] == sent
    assert len(sent.encode()) <= LIMITS["max_output_bytes"]


def test_a_responses_stream_of_more_output_items_than_a_response_holds_ends_there(stack: Stack,
                                                                                 misbehaving: str) -> None:
    """A provider whose every chunk has reasoning and text opened two output items a chunk, each with
    its events: 14 MB from it reached the caller as 287 MB, and the gateway held 170 MB more for
    the Response (a hostile-provider review). Past `MAX_OUTPUT_ITEMS` the stream ends with
    `output_too_large`, and the run is cancelled: its slot comes back. (The output limit is raised
    for it: that many items' chunks pass the other tests' 64 KiB.)"""
    gateway = pool(stack, misbehaving, {**LIMITS, "max_output_bytes": 4 * 1024 * 1024, "max_events_per_run": 100_000})
    async def responses() -> tuple[int, str, str]:
        body = {"model": "alternating", "input": "x", "stream": True}
        async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/responses", json=body) as resp:
            return resp.status, resp.headers["X-IOP-Run-Id"], await resp.text()

    status, run_id, text = asyncio.run(responses())
    events = [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if "data: " in block]
    assert status == 200 and [e["type"] for e in events[-2:]] == ["error", "response.failed"], text[-500:]
    assert events[-2]["code"] == "output_too_large" and f"more than {MAX_OUTPUT_ITEMS} output items" in (
        events[-2]["message"])
    output = events[-1]["response"]["output"]
    assert len(output) == MAX_OUTPUT_ITEMS and {item["status"] for item in output[:-1]} == {"completed"}
    assert sum(e["type"] == "response.output_item.added" for e in events) == MAX_OUTPUT_ITEMS
    run = settled(stack, run_id, "p-alternating")
    assert run["state"] == b"cancelled", run


@pytest.mark.parametrize(("model", "message"), [
    ("huge", "provider p-huge sent an answer over 262144 bytes (runtime.max_response_bytes)"),
    ("no-newline", "provider p-no-newline sent a line over 16384 bytes (runtime.max_line_bytes)"),
])
def test_a_provider_answer_or_line_past_its_limit_is_output_too_large(stack: Stack, gateway: str, model: str,
                                                                      message: str) -> None:
    status, run_id, text = asyncio.run(ask(gateway, model, model == "no-newline"))
    assert status == 502, text
    assert f'"message":"{message}"' in text.replace(": ", ":") and "output_too_large" in text
    run = settled(stack, run_id, f"p-{model}")
    assert run["state"] == b"failed" and not run["body"] and run["bytes"] < RUN_BOUND_BYTES, run


def test_a_whole_answer_past_the_output_limit_is_output_too_large(stack: Stack, gateway: str) -> None:
    """A whole answer is output too, held in Redis for run_ttl_s: one under the response limit but
    over the output limit was kept whole (a 14 MB one with log probabilities was 70 MB as OpenAI's)."""
    status, run_id, text = asyncio.run(ask(gateway, "big-whole", False))
    assert status == 502, text
    assert "output_too_large" in text and "max_output_bytes (65536 bytes)" in text
    run = settled(stack, run_id, "p-big-whole")
    assert run["state"] == b"failed" and not run["body"] and run["bytes"] < RUN_BOUND_BYTES, run


def test_garbage_is_a_short_plain_error(stack: Stack, gateway: str) -> None:
    status, _, text = asyncio.run(ask(gateway, "garbage", False))
    assert status == 502 and "provider p-garbage: the answer was not valid JSON" in text
    status, run_id, text = asyncio.run(ask(gateway, "garbage-error", False))
    error = json.loads(text)["error"]
    prefix = "provider p-garbage-error answered 500: "
    assert status == 502 and error["code"] == "provider_error" and error["message"].startswith(prefix)
    assert len(error["message"]) <= len(prefix) + LIMITS["max_error_chars"] and "\n" not in error["message"]
    run = settled(stack, run_id, "p-garbage-error")
    assert run["state"] == b"failed" and not run["body"], run
