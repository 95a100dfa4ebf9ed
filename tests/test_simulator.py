"""Tests for the OpenAI-compatible simulator, over real HTTP on an ephemeral port."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from openai.types import Completion, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from iop import sim_schema
from iop.simulator import (
    EMBEDDING_DIMS,
    SimOptions,
    add_arguments,
    embedding_vector,
    options_from_args,
    serve,
    start_server,
)

JsonObject = dict[str, Any]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
DEADLINE_S = 10.0


@dataclass
class Sim:
    url: str
    http: aiohttp.ClientSession

    async def post_json(self, path: str, body: JsonObject, **kwargs: Any) -> tuple[int, JsonObject]:
        async with self.http.post(self.url + path, json=body, **kwargs) as resp:
            return resp.status, await resp.json()

    async def get_json(self, path: str) -> JsonObject:
        async with self.http.get(self.url + path) as resp:
            assert resp.status == 200
            data: JsonObject = await resp.json()
            return data

    async def stream(self, path: str, body: JsonObject) -> list[str]:
        """POST a streaming request and return the raw SSE ``data:`` payloads."""
        async with self.http.post(self.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return parse_sse(await resp.text())

    async def wait_stats(self, predicate: Callable[[JsonObject], bool]) -> JsonObject:
        """Poll /stats until ``predicate`` holds, failing after a deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while True:
            stats = await self.get_json("/stats")
            if predicate(stats):
                return stats
            assert loop.time() < deadline, f"/stats never reached the expected state: {stats}"
            await asyncio.sleep(0.01)


def parse_sse(text: str) -> list[str]:
    events = [event for event in text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events
    return [event.removeprefix("data: ") for event in events]


def chat_body(model: str = "sim-model", **extra: Any) -> JsonObject:
    return {"model": model, "messages": [{"role": "user", "content": "hello there simulator"}], **extra}


def text_body(model: str = "sim-model", **extra: Any) -> JsonObject:
    return {"model": model, "prompt": "one two three four", **extra}


def expected_text(tokens: int) -> str:
    return "".join(f"tok{i} " for i in range(tokens))


SimFactory = Callable[..., Awaitable[Sim]]


@pytest.fixture
async def make_sim() -> AsyncIterator[SimFactory]:
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def factory(**options: Any) -> Sim:
            runner, url = await start_server(SimOptions(**{"tokens": 4, **options}))
            stack.push_async_callback(runner.cleanup)
            return Sim(url, http)

        yield factory


@pytest.fixture
async def sim(make_sim: SimFactory) -> Sim:
    return await make_sim(models=("sim-model", "other-model"))


# --------------------------------------------------------------------------- plain endpoints


async def test_models_and_health(sim: Sim) -> None:
    listing = await sim.get_json("/v1/models")
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["sim-model", "other-model"]
    for entry in listing["data"]:
        Model.model_validate(entry)
        assert entry["object"] == "model" and entry["owned_by"] == "iop-simulator"
    async with sim.http.get(sim.url + "/health") as resp:
        assert resp.status == 200


# --------------------------------------------------------------------------- non-streaming


async def test_chat_completion(sim: Sim) -> None:
    status, data = await sim.post_json(CHAT, chat_body())
    assert status == 200
    completion = ChatCompletion.model_validate(data)
    assert completion.object == "chat.completion" and completion.model == "sim-model"
    (choice,) = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected_text(4), "refusal": None}
    assert choice["logprobs"] is None and choice["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


async def test_text_completion(sim: Sim) -> None:
    status, data = await sim.post_json(TEXT, text_body("other-model"))
    assert status == 200
    completion = Completion.model_validate(data)
    assert completion.object == "text_completion" and completion.model == "other-model"
    (choice,) = data["choices"]
    assert choice == {"index": 0, "text": expected_text(4), "logprobs": None, "finish_reason": "stop"}
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


@pytest.mark.parametrize("limit_field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_truncates(sim: Sim, limit_field: str) -> None:
    _, data = await sim.post_json(CHAT, {**chat_body(), limit_field: 2})
    assert data["choices"][0]["message"]["content"] == expected_text(2)
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2


async def test_a_legacy_completion_reads_only_max_tokens_as_vllm_does(sim: Sim) -> None:
    _, data = await sim.post_json(TEXT, text_body(max_completion_tokens=2))
    assert data["choices"][0]["text"] == expected_text(4)
    _, data = await sim.post_json(TEXT, text_body(max_completion_tokens=3, max_tokens=2))
    assert data["choices"][0]["text"] == expected_text(2)


async def test_a_body_the_gateway_lets_in_is_taken(sim: Sim) -> None:
    """(aiohttp's own 1 MiB answered with a 413 what a gateway's default 8 MiB let in)"""
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "a " * 2_000_000}])).encode()
    json_type = {"Content-Type": "application/json"}
    async with sim.http.post(sim.url + CHAT, data=io.BytesIO(big), headers=json_type) as resp:
        status, data = resp.status, await resp.json()
    assert status == 200 and data["choices"][0]["message"]["content"] == expected_text(4)


async def test_max_tokens_above_output_length_stops_naturally(sim: Sim) -> None:
    _, data = await sim.post_json(TEXT, text_body(max_tokens=100))
    assert data["choices"][0]["text"] == expected_text(4)
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_sim_override_tokens(sim: Sim) -> None:
    _, data = await sim.post_json(CHAT, chat_body(sim={"tokens": 7}))
    assert data["choices"][0]["message"]["content"] == expected_text(7)


async def test_n_choices_a_prompt_as_vllm_makes_them(sim: Sim) -> None:
    _, data = await sim.post_json(CHAT, chat_body(n=3))
    ChatCompletion.model_validate(data)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in data["choices"]} == {expected_text(4)}
    assert data["usage"]["completion_tokens"] == 12
    _, data = await sim.post_json(TEXT, text_body(prompt=["a", "b c"], n=2))
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3] and data["usage"]["completion_tokens"] == 16
    _, data = await sim.post_json(TEXT, text_body(prompt=[1, 2, 3]))  # (one prompt of token ids)
    assert len(data["choices"]) == 1
    _, data = await sim.post_json(TEXT, text_body(prompt=[[1, 2], [3]]))  # (two)
    assert len(data["choices"]) == 2
    events = await sim.stream(TEXT, text_body(prompt=["a", "b"], stream_options={"include_usage": True}))
    chunks = [json.loads(event) for event in events[:-1]]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == expected_text(4) and mine[-1]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 8


# --------------------------------------------------------------------------- streaming


async def test_chat_stream(sim: Sim) -> None:
    events = await sim.stream(CHAT, chat_body("other-model"))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "other-model"
        assert "usage" not in chunk
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert content == expected_text(4)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 5 + ["stop"]
    assert chunks[-1]["choices"][0]["delta"] == {}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize(("choice", "called"), [("required", "get_weather"), ("auto", None), (None, None),
                                                ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
async def test_a_tool_choice_that_asks_for_a_call_gets_one(sim: Sim, choice: Any, called: str | None) -> None:
    """A demo through `iop dev` showed no tool call however it asked (a new user's review): a
    `tool_choice` of "required" calls the first tool, one that names a function calls it; "auto" is
    a model's decision, and the simulator answers text."""
    body = chat_body(n=2, tools=TOOLS, **({} if choice is None else {"tool_choice": choice}))
    status, data = await sim.post_json(CHAT, body)
    assert status == 200
    ChatCompletion.model_validate(data)
    for place, choice_out in enumerate(data["choices"]):
        message = choice_out["message"]
        if called is None:
            assert message["content"] == expected_text(4) and "tool_calls" not in message
            assert choice_out["finish_reason"] == "stop"
            continue
        assert message["content"] is None and choice_out["finish_reason"] == "tool_calls"
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["function"] == {"name": called, "arguments": "{}"}
        assert call["id"].startswith("call_") and call["id"].endswith(f"_{place}")
    assert data["usage"]["completion_tokens"] == (4 if called is None else 2) * 2


async def test_a_streamed_tool_call_comes_as_vllm_streams_one(sim: Sim) -> None:
    body = chat_body(tools=TOOLS, tool_choice="required", stream_options={"include_usage": True})
    events = await sim.stream(CHAT, body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == "{}" and {c["index"] for c in calls} == {0}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert usage_chunk["usage"]["completion_tokens"] == 2


async def test_chat_stream_include_usage(sim: Sim) -> None:
    body = chat_body(max_tokens=3, stream_options={"include_usage": True})
    events = await sim.stream(CHAT, body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = [json.loads(event) for event in events[:-1]]
    assert all(chunk["usage"] is None for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    ChatCompletionChunk.model_validate(usage_chunk)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_text_stream(sim: Sim) -> None:
    events = await sim.stream(TEXT, text_body(stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == "sim-model"
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    # OpenAI's Completion type has no null finish_reason, which mid-stream chunks carry (as OpenAI's do)
    Completion.model_validate(text_chunks[-1])
    Completion.model_validate(usage_chunk)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in text_chunks[:-1])
    assert "".join(chunk["choices"][0]["text"] for chunk in text_chunks) == expected_text(4)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


# --------------------------------------------------------------------------- errors


async def test_unknown_model_is_404(sim: Sim) -> None:
    status, data = await sim.post_json(CHAT, chat_body("no-such-model"))
    assert status == 404
    error = data["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "no-such-model" in error["message"]


async def test_malformed_json_is_400(sim: Sim) -> None:
    headers = {"Content-Type": "application/json"}
    async with sim.http.post(sim.url + CHAT, data=b"{not json", headers=headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        (CHAT, {"model": "sim-model"}, "messages"),
        (TEXT, {"model": "sim-model"}, "prompt"),
        (CHAT, chat_body(max_tokens=0), "max_tokens"),
        (CHAT, chat_body(stream="yes"), "stream"),
        (CHAT, chat_body(n=0), "n"),
        (TEXT, text_body(n="2"), "n"),
        (TEXT, text_body(n=128, prompt=["a"] * 33), "n"),  # (4,224 choices: over the simulator's 4,096)
        (CHAT, chat_body(sim={"tokens": "many"}), "sim.tokens"),
        (CHAT, chat_body(sim={"bogus": 1}), "sim.bogus"),
        (CHAT, chat_body(sim={"ttft_ms": -1}), "sim"),
        ("/v1/embeddings", {"model": "sim-model", "input": 3}, "input"),
    ],
)
async def test_invalid_request_is_400(sim: Sim, path: str, body: JsonObject, param: str) -> None:
    status, data = await sim.post_json(path, body)
    assert status == 400
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["param"] == param


@pytest.mark.parametrize(("status", "error_type"), [(503, "server_error"), (429, "requests")])
async def test_injected_failure_via_sim_override(sim: Sim, status: int, error_type: str) -> None:
    for path, body in ((CHAT, chat_body(stream=True)), (TEXT, text_body())):
        got, data = await sim.post_json(path, {**body, "sim": {"fail_status": status}})
        assert got == status
        assert data["error"]["type"] == error_type and "Simulated failure" in data["error"]["message"]


async def test_fail_rate_fails_every_request(make_sim: SimFactory) -> None:
    sim = await make_sim(fail_rate=1.0, fail_status=502, seed=1)
    status, data = await sim.post_json(CHAT, chat_body())
    assert status == 502 and data["error"]["type"] == "server_error"
    stats = await sim.get_json("/stats")
    assert stats["requests"][0]["completed"] is False


async def test_fail_after_tokens_aborts_stream(sim: Sim) -> None:
    body = chat_body(stream=True, sim={"tokens": 10, "fail_after_tokens": 2})
    received = b""
    async with sim.http.post(sim.url + CHAT, json=body) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for data in resp.content.iter_any():
                received += data
    events = parse_sse(received.decode())
    assert "[DONE]" not in events
    chunks = [json.loads(event) for event in events]
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert content == expected_text(2)
    stats = await sim.get_json("/stats")
    (record,) = stats["requests"]
    assert record["completed"] is False and record["disconnected"] is False
    assert stats["disconnects"] == 0


async def test_fail_after_tokens_drops_non_streaming_request(make_sim: SimFactory) -> None:
    sim = await make_sim(fail_after_tokens=1)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await sim.post_json(TEXT, text_body())


# --------------------------------------------------------------------------- stats


async def test_stats_count_by_model_and_record_request_ids(sim: Sim) -> None:
    await sim.post_json(CHAT, chat_body(), headers={"X-Request-Id": "req-1"})
    await sim.post_json(TEXT, text_body("other-model"), headers={"X-Request-Id": "req-2"})
    await sim.stream(CHAT, chat_body("other-model"))
    await sim.post_json(CHAT, chat_body("missing-model"))
    stats = await sim.get_json("/stats")
    assert stats["total"] == 4 and stats["current"] == 0 and stats["max_concurrent"] == 1
    assert stats["by_model"] == {"sim-model": 1, "other-model": 2, "missing-model": 1}
    durations = [r.pop("duration_ms") for r in stats["requests"]]
    began = [r.pop("began_at") for r in stats["requests"]]
    assert began == sorted(began) and all(abs(time.time() - b) < 3600 for b in began)  # (Unix time, in order)
    assert all(isinstance(d, float) and d >= 0 for d in durations)
    assert stats["busy_ms"] >= sum(durations) - 0.01
    assert stats["requests"] == [
        {"model": "sim-model", "request_id": "req-1", "path": CHAT, "stream": False,
         "disconnected": False, "completed": True},
        {"model": "other-model", "request_id": "req-2", "path": TEXT, "stream": False,
         "disconnected": False, "completed": True},
        {"model": "other-model", "request_id": None, "path": CHAT, "stream": True,
         "disconnected": False, "completed": True},
        {"model": "missing-model", "request_id": None, "path": CHAT, "stream": False,
         "disconnected": False, "completed": False},
    ]


async def test_stats_reset(sim: Sim) -> None:
    await sim.post_json(CHAT, chat_body())
    async with sim.http.post(sim.url + "/stats/reset") as resp:
        assert resp.status == 200
    stats = await sim.get_json("/stats")
    assert stats == {
        "total": 0, "max_concurrent": 0, "current": 0, "by_model": {}, "requests": [], "disconnects": 0,
        "busy_ms": 0.0,
    }


async def open_held_streams(sim: Sim, count: int) -> list[aiohttp.ClientResponse]:
    """Start ``count`` streams whose first token never comes within the test."""
    body = chat_body(stream=True, sim={"ttft_ms": 600_000})
    responses = [await sim.http.post(sim.url + CHAT, json=body) for _ in range(count)]
    assert all(resp.status == 200 for resp in responses)
    return responses


async def test_max_concurrent_and_disconnects(sim: Sim) -> None:
    responses = await open_held_streams(sim, 3)
    stats = await sim.wait_stats(lambda s: s["current"] == 3)
    assert stats["max_concurrent"] == 3 and stats["disconnects"] == 0
    for resp in responses:
        resp.close()
    stats = await sim.wait_stats(lambda s: s["current"] == 0 and s["disconnects"] == 3)
    assert stats["max_concurrent"] == 3
    assert all(r["disconnected"] and not r["completed"] for r in stats["requests"])


async def test_client_disconnect_mid_stream_is_counted(sim: Sim) -> None:
    body = chat_body(stream=True, sim={"ttft_ms": 600_000})
    headers = {"X-Request-Id": "gone"}
    async with sim.http.post(sim.url + CHAT, json=body, headers=headers) as resp:
        first = json.loads(parse_sse((await resp.content.readuntil(b"\n\n")).decode())[0])
        assert first["choices"][0]["delta"]["role"] == "assistant"
        resp.close()
    stats = await sim.wait_stats(lambda s: s["disconnects"] == 1 and s["current"] == 0)
    (record,) = stats["requests"]
    assert record["request_id"] == "gone" and record["disconnected"] and not record["completed"]


# --------------------------------------------------------------------------- embeddings


async def test_embeddings(sim: Sim) -> None:
    status, data = await sim.post_json("/v1/embeddings", {"model": "sim-model", "input": ["a b", "c"]})
    assert status == 200
    response = CreateEmbeddingResponse.model_validate(data)
    assert response.model == "sim-model" and response.usage.prompt_tokens == 3
    vectors = [item.embedding for item in response.data]
    assert [item.index for item in response.data] == [0, 1]
    assert all(len(vector) == EMBEDDING_DIMS for vector in vectors)
    assert vectors == [embedding_vector("a b"), embedding_vector("c")]
    _, single = await sim.post_json("/v1/embeddings", {"model": "sim-model", "input": "a b"})
    assert single["data"][0]["embedding"] == vectors[0]
    # token ids, one input or several, as OpenAI takes them (a token each)
    _, tokens = await sim.post_json("/v1/embeddings", {"model": "sim-model", "input": [1, 2, 3]})
    assert [item["embedding"] for item in tokens["data"]] == [embedding_vector("1 2 3")]
    assert tokens["usage"]["prompt_tokens"] == 3
    _, lists = await sim.post_json("/v1/embeddings", {"model": "sim-model", "input": [[1, 2], [3]]})
    assert [item["embedding"] for item in lists["data"]] == [embedding_vector("1 2"), embedding_vector("3")]
    bad_inputs: list[list[Any]] = [[], [[]], [1, "a"], [[1], "a"], [1.5]]
    for bad in bad_inputs:
        status, error = await sim.post_json("/v1/embeddings", {"model": "sim-model", "input": bad})
        assert status == 400 and error["error"]["param"] == "input", bad


async def test_embeddings_base64(sim: Sim) -> None:
    body = {"model": "sim-model", "input": "a b", "encoding_format": "base64"}
    _, data = await sim.post_json("/v1/embeddings", body)
    raw = base64.b64decode(data["data"][0]["embedding"])
    decoded = struct.unpack(f"<{EMBEDDING_DIMS}f", raw)
    assert decoded == pytest.approx(embedding_vector("a b"), rel=1e-6)


# --------------------------------------------------------------------------- real OpenAI client


async def test_openai_client_round_trip(sim: Sim) -> None:
    async with AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model", "other-model"]
        chat = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content == expected_text(2)
        stream = await client.chat.completions.create(
            model="other-model", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
        parts = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == expected_text(4)
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 4
        embedding = await client.embeddings.create(model="sim-model", input="a b")
        assert embedding.data[0].embedding == pytest.approx(embedding_vector("a b"), rel=1e-6)


# --------------------------------------------------------------------------- serve() and the CLI helpers


async def test_serve_prints_its_url_and_stops_on_cancel(capsys: pytest.CaptureFixture[str]) -> None:
    task = asyncio.create_task(serve(SimOptions(port=0)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    output = ""
    while "\n" not in output:
        assert not task.done() and loop.time() < deadline, "serve() never announced itself"
        await asyncio.sleep(0.01)
        output += capsys.readouterr().out
    line = output.strip()
    prefix = "iop simulator listening on http://127.0.0.1:"
    assert line.startswith(prefix) and int(line.removeprefix(prefix)) > 0
    url = line.removeprefix("iop simulator listening on ")
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
        assert resp.status == 200
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_options_from_args() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])) == SimOptions()
    args = parser.parse_args([
        "--host", "0.0.0.0", "--port", "8001", "--models", "a, b", "--ttft-ms", "5", "--itl-ms", "1.5",
        "--tokens", "32", "--fail-rate", "0.25", "--fail-status", "429", "--fail-retry-after", "7",
        "--fail-after-tokens", "3", "--seed", "7",
    ])
    assert options_from_args(args) == SimOptions(
        host="0.0.0.0", port=8001, models=("a", "b"), ttft_ms=5, itl_ms=1.5, tokens=32, fail_rate=0.25,
        fail_status=429, fail_retry_after="7", fail_after_tokens=3, seed=7,
    )


@pytest.mark.parametrize(
    "argv",
    [["--fail-rate", "2"], ["--tokens", "-1"], ["--models", ","], ["--port", "x"], ["--fail-status", "200"],
     ["--fail-retry-after", "1\n2"]],
)
def test_invalid_arguments_are_rejected(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


async def test_the_api_is_also_served_under_api_v1_like_lemonade(sim: Sim) -> None:
    status, body = await sim.post_json("/api/v1/chat/completions", chat_body())
    assert status == 200 and body["object"] == "chat.completion"
    for path in ("/api/v1/models", "/api/v1/health", "/v1/health"):
        async with sim.http.get(sim.url + path) as resp:
            assert resp.status == 200, path


def test_options_that_cannot_serve_say_so_in_one_line(tmp_path: Path) -> None:
    """Found by a review: a TLS option given alone, a certificate that cannot be read, and a port in use
    each ended the simulator with a traceback."""
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT

    def run(*args: str) -> tuple[int, list[str]]:
        done = subprocess.run([sys.executable, "-m", "iop", "simulator", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        return done.returncode, done.stderr.strip().splitlines()

    assert run("--tls-cert", str(tmp_path / "x.crt")) == (
        2, ["iop simulator: error: --tls-cert and --tls-key go together: give both or neither"])
    missing = str(tmp_path / "x.crt")
    assert run("--tls-cert", missing, "--tls-key", missing) == (
        1, [f"error: cannot serve https with --tls-cert {missing} and --tls-key {missing}: No such file or directory"])
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert run("--port", str(port)) == (1, [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"])


class _Node(BaseModel):
    """A schema that refers to itself (pydantic's `$defs` and `$ref`)."""

    name: str
    children: list[_Node]
    parent: _Node | None = None


@pytest.mark.parametrize("schema", [
    {"type": "object"},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}, "b": {"type": ["null", "number"],
                                                                                   "exclusiveMaximum": -1}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2},
    {"type": "string", "minLength": 9, "maxLength": 12},
    {"type": "integer", "maximum": -2.5}, {"type": "integer", "exclusiveMinimum": 3.5, "exclusiveMaximum": 5},
    {"type": "string", "format": "date-time"},
    {"anyOf": [{"type": "null"}, {"const": 7}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
               {"properties": {"b": {"type": "integer", "maximum": -5}}, "required": ["b"]}]},
    _Node.model_json_schema(),
])
def test_the_structured_output_is_json_its_schema_takes(schema: JsonObject) -> None:
    from jsonschema import Draft202012Validator

    value = sim_schema.example(schema)
    Draft202012Validator(schema).validate(value)
    assert "".join(sim_schema.tokens_of(json.dumps(value))) == json.dumps(value)


def _nested_arrays(depth: int) -> JsonObject:
    schema: JsonObject = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "minItems": 64, "items": schema}
    return schema


@pytest.mark.parametrize("schema", [
    _nested_arrays(5),  # (10⁹ values asked for)
    {"type": "string", "minLength": 10**9},
    {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
        f"q{j}": {"type": "string", "minLength": 100_000} for j in range(300)}} for i in range(300)}},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "allOf": [{"$ref": "#/$defs/a"}]},  # (hung: a loop of `$ref`s)
    {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
], ids=["arrays-of-arrays", "a-gigabyte-string", "wide-and-long", "all-of-a-ref-to-itself", "a-ref-to-all-of-itself"])
def test_a_schema_that_asks_for_too_much_gets_a_bounded_answer(schema: JsonObject) -> None:
    """A caller's schema costs the simulator bounded work: the first hung it (10⁹ values), the
    second took a GB, the fourth looped for good. Past `MOST_VALUES` (64 characters of text counting
    as one) the rest is null."""
    text = json.dumps(sim_schema.example(schema))
    assert len(text) <= 64 * sim_schema.MOST_VALUES + 16 * sim_schema.MOST_VALUES + sim_schema.MOST_TEXT, len(text)


async def test_a_response_format_or_a_tool_s_parameters_get_json_they_take(sim: Sim) -> None:
    """The `openai` client's parse helpers read the answer with the caller's pydantic model: text, or `{}`
    for every tool, made them raise (tests/test_e2e.py has them through iop)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
              "required": ["city", "days"], "additionalProperties": False}
    formatted = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    status, data = await sim.post_json(CHAT, formatted)
    assert status == 200 and json.loads(data["choices"][0]["message"]["content"]) == {"city": "tok0", "days": 1}
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == len(sim_schema.tokens_of(data["choices"][0]["message"]["content"]))
    events = await sim.stream(CHAT, formatted)
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert json.loads(text) == {"city": "tok0", "days": 1}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    status, data = await sim.post_json(CHAT, chat_body(tools=tools, tool_choice="required"))
    assert json.loads(data["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "tok0",
                                                                                                    "days": 1}
