"""How much one request may ask for (`runtime.max_choices`, `runtime.max_inputs`): the pure rule,
and the gateway's 400 over real HTTP and a real Redis, with nothing queued."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from common import choices, keys
from common.config import ConfigError, parse_config
from common.wire import RunKind
from gateway.app import build_app
from tests.conftest import async_wait_until
from tests.openapi import validate
from tests.test_scheduler import beat

MODEL = "m"
CHAT, COMPLETION, EMBEDDING = RunKind.CHAT, RunKind.COMPLETION, RunKind.EMBEDDING


@pytest.mark.parametrize(("kind", "body", "fault"), [
    (CHAT, {}, None),
    (CHAT, {"n": None}, None),  # (an unset one, as clients send it)
    (CHAT, {"n": 1}, None),
    (CHAT, {"n": 4}, None),
    (CHAT, {"n": 5}, "n"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"n": -1}, "n"),
    (CHAT, {"n": True}, "n"),
    (CHAT, {"n": 2.0}, "n"),
    (CHAT, {"n": "2"}, "n"),
    (CHAT, {"n": 2**70}, "n"),
    (CHAT, {"best_of": 50}, "best_of"),  # (vLLM's chat completions take it too)
    (CHAT, {"best_of": 4}, None),
    (COMPLETION, {"prompt": "x", "n": 4, "best_of": 4}, None),
    (COMPLETION, {"prompt": "x", "best_of": 5}, "best_of"),
    (COMPLETION, {"prompt": ["a", "b", "c"], "n": 4}, None),
    (COMPLETION, {"prompt": ["a", "b", "c", "d"]}, "prompt"),
    (COMPLETION, {"prompt": [[1, 2], [3], [4], [5]]}, "prompt"),
    (COMPLETION, {"prompt": list(range(100))}, None),  # (one prompt of token ids)
    (EMBEDDING, {"input": ["a"] * 3}, None),
    (EMBEDDING, {"input": ["a"] * 4}, "input"),
    (EMBEDDING, {"input": "x", "n": 99}, None),  # (embeddings have no choices)
])
def test_choices_are_whole_numbers_within_the_limit_and_inputs_at_most_the_limit(
        kind: RunKind, body: dict[str, Any], fault: str | None) -> None:
    found = choices.problem(kind, body, max_choices=4, max_inputs=3)
    assert (found and found[1]) == fault


def test_the_message_says_the_limit_and_the_setting() -> None:
    assert choices.problem(CHAT, {"n": 9}, 4, 3) == (
        "'n' must be a whole number from 1 to 4 (runtime.max_choices)", "n")
    assert choices.problem(EMBEDDING, {"input": ["a"] * 5}, 4, 3) == (
        "'input' holds 5 inputs; at most 3 are served a request (runtime.max_inputs)", "input")


@pytest.mark.parametrize(("field", "value", "fault"), [
    ("max_choices", 0, "Input should be greater than or equal to 1"),
    ("max_choices", 10_001, "Input should be less than or equal to 10000"),
    ("max_inputs", 0, "Input should be greater than or equal to 1"),
])
def test_the_limits_are_counts(field: str, value: int, fault: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_config({field: value}))
    assert err.value.errors == [f"runtime.{field}: {fault}"]


def test_the_defaults_are_openais_own_limits() -> None:
    runtime = parse_config(_config({})).runtime
    assert (runtime.max_choices, runtime.max_inputs) == (128, 2048)


def _config(runtime: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"id": MODEL, "providers": {"p": "p-served"}}],
            "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                                  "capacity": 1, "models": ["p-served"]}]}],
            "runtime": runtime}


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[str]:
    server = TestServer(build_app(parse_config(_config({"max_choices": 2, "max_inputs": 3})), redis_url), port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n",
     "'n' must be a whole number from 1 to 2 (runtime.max_choices)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0, "stream": True}, "n",
     "'n' must be a whole number from 1 to 2 (runtime.max_choices)"),
    ("/v1/completions", {"prompt": "x", "best_of": 100000}, "best_of",
     "'best_of' must be a whole number from 1 to 2 (runtime.max_choices)"),
    ("/v1/completions", {"prompt": ["a"] * 4}, "prompt",
     "'prompt' holds 4 inputs; at most 3 are served a request (runtime.max_inputs)"),
    ("/v1/embeddings", {"input": ["a"] * 100000}, "input",
     "'input' holds 100000 inputs; at most 3 are served a request (runtime.max_inputs)"),
])
async def test_the_gateway_refuses_more_and_queues_nothing(gateway: str, redis_url: str, path: str,
                                                           body: dict[str, Any], param: str, message: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(gateway + path, data=json.dumps({"model": MODEL, **body})) \
            as resp:
        answer = await resp.json()
    assert resp.status == 400
    validate("ErrorResponse", answer)
    assert answer["error"]["param"] == param
    assert answer["error"]["message"] == message
    redis = Redis.from_url(redis_url)
    try:
        assert await redis.keys(keys.run_record("*")) == []
    finally:
        await redis.aclose()


async def test_as_many_as_the_limits_allow_are_queued(gateway: str, redis_url: str) -> None:
    """At the limits the run is queued (nothing serves it here: the caller leaves once it is)."""
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "best_of": 2}
    redis = Redis.from_url(redis_url)
    await beat(redis, parse_config(_config({})))  # (a provider available: the gateway queues for it)
    async with aiohttp.ClientSession() as http:
        async def ask() -> None:
            async with http.post(gateway + "/v1/completions", data=json.dumps(body)) as resp:
                await resp.read()

        call = asyncio.create_task(ask())
        try:
            queued = await async_wait_until(lambda: redis.xlen(keys.runs_stream(MODEL)), what="the run queued")
        finally:
            call.cancel()
            await redis.aclose()
    assert queued == 1
