"""What every provider of a model would refuse is refused by the gateway at once (pure, and over
real HTTP and Redis): a run asking for several choices of a model served only by Ollama and CLI
tools, tools or embeddings of one served only by CLI tools. Before, such a run waited its turn in
the queue, went to a worker, and got the same 400 there. And the providers of a model whose
adapter would refuse a run are named in its queue entry and record (`refuse`), so it goes only to
those that take it (`gateway.refusals`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from common.capabilities import refused_everywhere
from common.config import Config, parse_config
from common.wire import RunKind
from gateway.app import build_app
from gateway.refusals import Refusal, refusing
from tests.conftest import async_wait_until
from tests.openapi import validate
from tests.test_scheduler import beat

CHAT, COMPLETION, EMBEDDING = RunKind.CHAT, RunKind.COMPLETION, RunKind.EMBEDDING
OLLAMA, CLI, BOTH, MIXED = (frozenset({"ollama"}), frozenset({"cli"}), frozenset({"ollama", "cli"}),
                            frozenset({"ollama", "vllm"}))


@pytest.mark.parametrize(("kind", "body", "types", "field"), [
    (CHAT, {"n": 2}, OLLAMA, "n"),
    (CHAT, {"n": 2.0}, BOTH, "n"),  # (a server that takes `n` reads 2.0 as 2)
    (COMPLETION, {"n": 3}, CLI, "n"),
    (CHAT, {"n": 2}, MIXED, None),  # (vLLM takes it: the run goes there)
    (CHAT, {"n": 1}, OLLAMA, None),
    (CHAT, {"n": True}, OLLAMA, None),
    (CHAT, {"tools": [{"type": "function"}]}, CLI, "tools"),
    (CHAT, {"functions": [{"name": "f"}]}, CLI, "functions"),
    (CHAT, {"tools": []}, CLI, None),
    (COMPLETION, {"tools": [{"type": "function"}]}, CLI, "tools"),
    (CHAT, {"tools": [{"type": "function"}]}, BOTH, None),  # (Ollama calls tools)
    (EMBEDDING, {"input": "x"}, CLI, "model"),
    (EMBEDDING, {"input": "x"}, BOTH, None),
    (EMBEDDING, {"input": "x", "n": 2}, OLLAMA, None),
    (CHAT, {"n": 2}, frozenset(), None),
    (CHAT, {"response_format": {"type": "json_object"}}, CLI, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, CLI,
     "response_format"),
    (COMPLETION, {"response_format": {"type": "json_object"}}, CLI, "response_format"),
    (CHAT, {"response_format": {"type": "text"}}, CLI, None),
    (CHAT, {"response_format": {"type": "json_object"}}, BOTH, None),  # (Ollama takes a format)
])
def test_what_every_provider_would_refuse_names_its_field(kind: RunKind, body: dict[str, Any],
                                                          types: frozenset[str], field: str | None) -> None:
    refused = refused_everywhere(kind, body, "m", types)
    assert (refused and refused[1]) == field, refused
    if refused is not None:
        assert '"m"' in refused[0] and all(t in refused[0] for t in types)


def config() -> Config:
    def provider(pid: str, kind: str) -> dict[str, Any]:
        if kind == "cli":
            return {"id": pid, "type": "cli", "command": ["true"], "capacity": 1, "models": ["s"]}
        return {"id": pid, "type": kind, "base_url": "http://127.0.0.1:9", "capacity": 1, "models": ["s"]}

    return parse_config({
        "models": [{"id": "one-choice", "providers": {"o": "s", "c": "s"}},
                   {"id": "mixed", "providers": {"o": "s", "v": "s"}},
                   {"id": "cli-only", "providers": {"c": "s"}},
                   {"id": "ollama-only", "providers": {"o": "s"}}],
        "nodes": [{"id": "n1", "providers": [provider("o", "ollama"), provider("c", "cli"), provider("v", "vllm")]}],
    })


@pytest.fixture
async def gateway(redis_url: str, redis: Redis) -> AsyncIterator[str]:
    await beat(redis, config())
    server = TestServer(build_app(config(), redis_url), port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_the_gateway_refuses_at_once_what_no_provider_of_the_model_takes(gateway: str, redis: Redis) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway}/v1/chat/completions", json={"model": "one-choice", **chat}) as resp:
            body = await resp.json()
        assert resp.status == 400, body
        validate("ErrorResponse", body)
        assert body["error"]["param"] == "n" and "return one choice a request" in body["error"]["message"]
        assert await redis.keys("iop:run:*") == []  # nothing queued
        # a model with a provider that takes it: queued (no scheduler runs here: it waits)
        waiting = asyncio.create_task(http.post(f"{gateway}/v1/chat/completions", json={"model": "mixed", **chat}))

        async def queued() -> bool:
            return bool(await redis.xlen("iop:runs:mixed") == 1)

        try:
            await async_wait_until(queued, what="the run of the mixed model to be queued")
        finally:
            waiting.cancel()
        # (naming the provider that would refuse it, in its entry and its record: it never goes there)
        [(_, fields)] = await redis.xrange("iop:runs:mixed")
        assert fields[b"refuse"] == b"o"
        assert await redis.hget(b"iop:run:" + fields[b"run"], "refuse") == b"o"


async def test_a_json_format_of_a_model_served_only_by_cli_tools_is_refused_naming_the_callers_field(
        gateway: str, redis: Redis) -> None:
    """A tool's answer is what it prints: a JSON format asked of a model only CLI tools serve is a
    400 at once (it was passed over, and the caller got free text), naming the field as the caller
    sent it: `response_format` in a chat completion, `text.format` in a Responses API request."""
    said = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    calls: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": said},
         "response_format"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format")]
    async with aiohttp.ClientSession() as http:
        for path, request, field in calls:
            async with http.post(f"{gateway}{path}", json={"model": "cli-only", **request}) as resp:
                body = await resp.json()
            assert resp.status == 400, body
            validate("ErrorResponse", body)
            assert body["error"]["param"] == field and "JSON format" in body["error"]["message"]
    assert await redis.keys("iop:run:*") == []  # nothing queued


IMAGE_URL = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                          {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
SAID = [{"role": "user", "content": "hi"}]
TYPES = {"c": "cli", "o": "ollama", "v": "vllm"}


@pytest.mark.parametrize(("kind", "body", "types", "refused"), [
    (CHAT, {"model": "s", "messages": SAID}, TYPES, ()),
    (CHAT, {"model": "s", "messages": SAID, "n": 2}, TYPES, ("c", "o")),
    (CHAT, {"model": "s", "messages": IMAGE_URL}, TYPES, ("c", "o")),
    (CHAT, {"model": "s", "messages": SAID, "tools": [{"type": "function", "function": {"name": "f"}}]}, TYPES,
     ("c",)),
    (COMPLETION, {"model": "s", "prompt": [1, 2, 3]}, TYPES, ("c", "o")),
    # (Ollama's /api/generate only loads the model for an empty prompt: an empty `stop` completion)
    (COMPLETION, {"model": "s", "prompt": ""}, TYPES, ("o",)),
    (COMPLETION, {"model": "s", "prompt": [""]}, TYPES, ("o",)),
    (EMBEDDING, {"model": "s", "input": "x"}, TYPES, ("c",)),
    (CHAT, {"model": "s", "messages": SAID, "n": 2}, {"v": "vllm", "w": "sglang"}, ()),
])
def test_the_providers_whose_adapter_would_refuse_a_run_are_told_from_its_request(
        kind: RunKind, body: dict[str, Any], types: dict[str, str], refused: tuple[str, ...]) -> None:
    assert refusing(kind, body, False, types) == refused


def test_a_run_every_provider_would_refuse_is_the_first_refusal() -> None:
    with pytest.raises(Refusal) as refusal:
        refusing(CHAT, {"model": "s", "messages": IMAGE_URL}, False, {"o1": "ollama", "o2": "ollama"})
    assert refusal.value.param == "messages[0].content[1].image_url"
    assert str(refusal.value) == "Ollama takes images only as base64 data URLs"


async def test_a_run_every_provider_of_its_model_would_refuse_is_a_400_at_once(gateway: str, redis: Redis) -> None:
    """An image by URL to a model only Ollama and a CLI tool serve: the caller's 400 at once, naming
    the field (it was queued, and refused by each provider in turn until its attempts ran out)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway}/v1/chat/completions",
                             json={"model": "one-choice", "messages": IMAGE_URL}) as resp:
            body = await resp.json()
        assert resp.status == 400, body
        validate("ErrorResponse", body)
        assert body["error"]["param"] == "messages[0].content[1]"  # (c's, the first provider by id: a CLI tool's)
        assert await redis.xlen("iop:runs:one-choice") == 0


async def test_a_responses_request_every_provider_would_refuse_names_the_field_as_the_caller_wrote_it(
        gateway: str, redis: Redis) -> None:
    """A Responses request runs as a chat completion, whose `messages` its caller never wrote: the
    400 of a run every provider would refuse named `messages[1].content[1].image_url` where the
    caller had sent `input[0].content[1]` (after its `instructions`, the chat's first message)."""
    look = {"role": "user", "content": [{"type": "input_text", "text": "what is it"},
                                        {"type": "input_image", "image_url": "https://example.com/a.png"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    calls: list[tuple[str, dict[str, Any], str]] = [
        ("ollama-only", {"instructions": "be brief", "input": [look]}, "input[0].content[1].image_url"),
        ("cli-only", {"input": [{"role": "user", "content": "q"}, {"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}, "input[1].content[0]"),
        ("cli-only", {"instructions": "x", "input": [{"role": "user", "content": "q"}, call, {
            "type": "function_call_output", "call_id": "c1", "output": "r"}]}, "input[1]"),
    ]
    async with aiohttp.ClientSession() as http:
        for model, request, field in calls:
            async with http.post(f"{gateway}/v1/responses", json={"model": model, **request}) as resp:
                body = await resp.json()
            assert resp.status == 400, body
            validate("ErrorResponse", body)
            assert body["error"]["param"] == field, body
    assert await redis.keys("iop:run:*") == []  # nothing queued


def test_the_gateway_does_not_parse_the_arguments_of_earlier_tool_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """They are JSON text, out of reach of the body's limits on depth and containers: a few MiB of
    `[]` there took the gateway's one thread seconds to parse (the worker refuses one nested too
    deep, as before)."""
    from workers.adapters import ollama_wire

    def no_parse(*_: Any, **__: Any) -> Any:
        raise AssertionError("tool call arguments parsed in the gateway")

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    body = {"model": "s", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "x"}]}
    with pytest.raises(ollama_wire.UnsupportedRequest, match="nest deeper"):
        ollama_wire.request(CHAT, body, False)  # (the worker's writing)
    monkeypatch.setattr(json, "loads", no_parse)  # (the module ollama_wire parses them with)
    # (left to the worker; the cli provider refuses calls made before, which plain text cannot carry)
    assert refusing(CHAT, body, False, TYPES) == ("c",)
