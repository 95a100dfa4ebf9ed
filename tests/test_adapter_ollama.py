"""The Ollama adapter against a fake Ollama (native NDJSON API) on port 0: OpenAI-shaped
chunks, answers, finish reasons and usage; tool calls; embeddings; errors; cancellation;
health transitions of the `/api/tags` probe."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from common.config import ProviderConfig
from common.policy import Health
from common.wire import ErrorCode, RunKind, upstream_request_id
from tests.fakes.ollama_server import FakeOllama, FakeState
from tests.openapi import validate
from tests.test_failures import serving
from workers.adapters import ollama_wire as wire
from workers.adapters.base import LastRead, ProviderError, Retry
from workers.adapters.failures import key_secrets
from workers.adapters.ollama import OllamaAdapter, observed_names, server_root

SERVED = "llama3:latest"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOllama]:
    server = FakeOllama(FakeState(models=[SERVED, "nomic-embed-text:latest"]))
    await server.start()
    yield server
    await server.stop()


def provider(url: str, **extra: Any) -> ProviderConfig:
    return ProviderConfig.model_validate(
        {"id": "ollama-b", "type": "ollama", "base_url": url, "capacity": 2, "models": [SERVED], **extra})


@pytest.fixture
def adapter(fake: FakeOllama, session: aiohttp.ClientSession) -> OllamaAdapter:
    return OllamaAdapter(provider(fake.url), session)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "why is the sky blue"}], **extra}


async def collect(adapter: OllamaAdapter, kind: RunKind, body: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [reads async for reads in adapter.stream(kind, body, "run_1")]


def test_server_root_and_observed_names() -> None:
    assert server_root("http://h:11434/") == "http://h:11434"
    assert server_root("http://h:11434/v1") == server_root("http://h:11434/api") == "http://h:11434"
    tags = {"models": [{"name": "llama3:latest", "model": "llama3:latest"}, {"name": "qwen3:8b-q4_K_M"}]}
    assert observed_names(tags) == ["llama3:latest", "qwen3:8b-q4_K_M", "llama3"]
    assert observed_names({"models": []}) == []
    assert observed_names({"nope": 1}) is None and observed_names([1]) is None


async def test_chat_stream_maps_deltas_finish_reason_and_usage(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    reads = await collect(adapter, RunKind.CHAT, chat(stream=True, stream_options={"include_usage": True},
                                                      temperature=0.2, stop="\n\n", seed=7))
    chunks = [c for read in reads for c in read]
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
        assert c["model"] == SERVED and c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-run_1"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "tok0 tok1 tok2 tok3 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert [isinstance(r, LastRead) for r in reads] == [False] * (len(reads) - 1) + [True]  # (`done` came in it)

    sent = fake.state.records[-1]
    assert sent["path"] == "/api/chat" and sent["model"] == SERVED
    assert sent["request_id"] == upstream_request_id("run_1")
    assert sent["body"]["stream"] is True
    assert sent["body"]["options"] == {"temperature": 0.2, "stop": ["\n\n"], "seed": 7}
    assert sent["body"]["messages"] == [{"role": "user", "content": "why is the sky blue"}]
    assert "stream_options" not in sent["body"]


async def test_no_usage_chunk_unless_asked(adapter: OllamaAdapter) -> None:
    chunks = [c for read in await collect(adapter, RunKind.CHAT, chat(stream=True)) for c in read]
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


async def test_chat_whole_answer_with_length_limit(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    answer = await adapter.complete(RunKind.CHAT, chat(max_tokens=2), "run_2")
    validate("CreateChatCompletionResponse", answer)
    assert answer["object"] == "chat.completion" and answer["model"] == SERVED
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 ", "refusal": None}
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    sent = fake.state.records[-1]["body"]  # (asked for as a stream: each line shows Ollama at work)
    assert sent["stream"] is True and sent["options"] == {"num_predict": 2}


async def test_text_completion_stream_and_whole(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    body = {"model": SERVED, "prompt": "Once upon", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = [c for read in await collect(adapter, RunKind.COMPLETION, body) for c in read]
    assert fake.state.records[-1]["path"] == "/api/generate"
    assert fake.state.records[-1]["body"]["prompt"] == "Once upon"
    validate("CreateCompletionResponse", chunks[-2])  # (OpenAI has no schema of its own for text chunks)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "tok0 tok1 tok2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3

    answer = await adapter.complete(RunKind.COMPLETION, {"model": SERVED, "prompt": ["Once upon"]}, "run_3")
    validate("CreateCompletionResponse", answer)
    assert answer["choices"][0]["text"] == "tok0 tok1 tok2 tok3 " and answer["choices"][0]["finish_reason"] == "stop"


async def test_log_probabilities_are_asked_for_and_come_back_openai_shaped(
        adapter: OllamaAdapter, fake: FakeOllama) -> None:
    """Ollama 0.12.11 and later: `logprobs`/`top_logprobs` in the native request, each line's
    tokens in its answer (a whole answer's all together)."""
    text = ["tok0 ", "tok1 ", "tok2 "]
    reads = await collect(adapter, RunKind.CHAT, chat(stream=True, max_tokens=3, logprobs=True, top_logprobs=2))
    assert fake.state.records[-1]["body"]["logprobs"] is True and fake.state.records[-1]["body"]["top_logprobs"] == 2
    chunks = [c for read in reads for c in read]
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)
    said = [lp for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
            for lp in c["choices"][0]["logprobs"]["content"]]
    assert [lp["token"] for lp in said] == text and said[0]["bytes"] == list(b"tok0 ")
    assert [a["token"] for a in said[1]["top_logprobs"]] == ["tok1 ", "other"]

    answer = await adapter.complete(RunKind.CHAT, chat(max_tokens=3, logprobs=True), "run_2")
    validate("CreateChatCompletionResponse", answer)
    content = answer["choices"][0]["logprobs"]["content"]
    assert [lp["token"] for lp in content] == text and all(lp["top_logprobs"] == [] for lp in content)
    assert fake.state.records[-1]["body"]["logprobs"] is True and "top_logprobs" not in fake.state.records[-1]["body"]

    # a legacy completion's `logprobs: k`: k alternatives at each token, in that API's own shape
    body = {"model": SERVED, "prompt": "Once upon", "max_tokens": 3, "logprobs": 1}
    answer = await adapter.complete(RunKind.COMPLETION, body, "run_3")
    validate("CreateCompletionResponse", answer)
    assert fake.state.records[-1]["body"]["logprobs"] is True and fake.state.records[-1]["body"]["top_logprobs"] == 1
    assert answer["choices"][0]["logprobs"] == {
        "tokens": text, "token_logprobs": [-0.25, -0.5, -0.75],
        "top_logprobs": [{"tok0 ": -0.25}, {"tok1 ": -0.5}, {"tok2 ": -0.75}], "text_offset": [9, 14, 19]}
    streamed = [c for read in await collect(adapter, RunKind.COMPLETION, {**body, "stream": True}) for c in read]
    offsets = [o for c in streamed if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [9, 14, 19]  # (from the prompt's start, as OpenAI's and llama.cpp's; over the stream's lines)

    plain = await adapter.complete(RunKind.CHAT, chat(max_tokens=1, logprobs=False, top_logprobs=3), "run_4")
    assert plain["choices"][0]["logprobs"] is None and "logprobs" not in fake.state.records[-1]["body"]


def test_log_probabilities_of_the_wrong_type_are_left_out() -> None:
    from workers.adapters import ollama_wire as wire

    line = {"logprobs": [{"token": 5, "logprob": -1.0}, {"token": "a", "logprob": "low"}, "x",
                         {"token": "b", "logprob": True},
                         {"token": "ok", "logprob": -1, "bytes": ["no"], "top_logprobs": [{"token": "z"}, 3]}]}
    assert wire.Logprobs(RunKind.CHAT, {}).of(line) == {
        "content": [{"token": "ok", "logprob": -1.0, "bytes": list(b"ok"), "top_logprobs": []}], "refusal": None}
    assert wire.Logprobs(RunKind.CHAT, {}).of({"logprobs": {"token": "a"}}) is None
    assert wire.Logprobs(RunKind.CHAT, {}).of({"logprobs": [None]}) is None
    with pytest.raises(wire.UnsupportedRequest, match="'logprobs' of a completion"):
        wire.request(RunKind.COMPLETION, {"model": SERVED, "prompt": "x", "logprobs": "2"}, False)
    # (an empty prompt only loads the model: `done_reason` "load", no text, which read as an empty
    # completion that stopped; another provider may generate from it, else it is the caller's 400)
    for prompt in ("", [""]):
        with pytest.raises(wire.UnsupportedRequest, match="generates nothing for an empty prompt") as err:
            wire.request(RunKind.COMPLETION, {"model": SERVED, "prompt": prompt}, False)
        assert err.value.param == "prompt"


async def test_tool_calls_come_back_openai_shaped(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"model": SERVED, "messages": history, "tools": tools, "stream": True}
    chunks = [c for read in await collect(adapter, RunKind.CHAT, body) for c in read]
    sent = fake.state.records[-1]["body"]
    assert sent["tools"] == tools
    assert sent["messages"][1]["tool_calls"] == [{"id": "c1", "function": {"name": "weather",
                                                                           "arguments": {"city": "Oslo"}}}]
    # (a tool result names its tool, from the call it answers: OpenAI's has only the call's id)
    assert sent["messages"][2] == {"role": "tool", "content": "sunny", "tool_name": "weather", "tool_call_id": "c1"}
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls == [{"id": "call_run_1_0", "type": "function", "index": 0,
                      "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    for c in chunks:
        validate("CreateChatCompletionStreamResponse", c)

    answer = await adapter.complete(RunKind.CHAT, {**body, "stream": False}, "run_4")
    validate("CreateChatCompletionResponse", answer)
    # tool_choice "none": the model must call no tool, so it is not given any
    await adapter.complete(RunKind.CHAT, {**body, "stream": False, "tool_choice": "none"}, "run_4b")
    assert "tools" not in fake.state.records[-1]["body"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    # a named function, or `allowed_tools`: only those are offered (Ollama cannot be made to call one)
    clock = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    for choice, offered in (({"type": "function", "function": {"name": "clock"}}, [clock]),
                            ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                                {"type": "function", "function": {"name": "weather"}}]}}, tools),
                            ({"type": "function", "function": {"name": "absent"}}, [*tools, clock]),
                            ("required", [*tools, clock])):
        await adapter.complete(RunKind.CHAT, {**body, "stream": False, "tools": [*tools, clock],
                                              "tool_choice": choice}, "run_4c")
        assert fake.state.records[-1]["body"]["tools"] == offered, choice
    assert json.loads(answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


async def test_native_fields_and_formats(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    image = "data:image/png;base64,iVBORw0KGgo="
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                keep_alive="10m", options={"num_ctx": 4096, "temperature": 0.9}, temperature=0.1,
                user="u-1", messages=[{"role": "user", "content": [
                    {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": image}}]}])
    await adapter.complete(RunKind.CHAT, body, "run_5")
    sent = fake.state.records[-1]["body"]
    assert sent["format"] == schema and sent["keep_alive"] == "10m"
    assert sent["options"] == {"temperature": 0.9, "num_ctx": 4096}  # the caller's native options win
    assert sent["messages"] == [{"role": "user", "content": "what is", "images": ["iVBORw0KGgo="]}]
    assert "user" not in sent  # (an OpenAI field with no Ollama meaning)
    await adapter.complete(RunKind.CHAT, chat(response_format={"type": "json_object"}), "run_6")
    assert fake.state.records[-1]["body"]["format"] == "json"


async def test_embeddings(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    body = {"model": "nomic-embed-text:latest", "input": ["one two", "three"]}
    answer = await adapter.complete(RunKind.EMBEDDING, body, "run_7")
    validate("CreateEmbeddingResponse", answer)
    assert fake.state.records[-1]["path"] == "/api/embed"
    assert [d["embedding"] for d in answer["data"]] == [[7.0, 0.5, -0.25, 1.0], [5.0, 0.5, -0.25, 1.0]]
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    encoded = await adapter.complete(RunKind.EMBEDDING, {**body, "input": "x", "encoding_format": "base64"}, "r")
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack("<4f", raw)) == [1.0, 0.5, -0.25, 1.0]
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, {**body, "input": [[1, 2, 3]]}, "r")
    # (what Ollama cannot take: another provider of the model may, and it says nothing of its health)
    assert err.value.status == 400 and err.value.retry is Retry.UNABLE and err.value.strikes is None


async def test_errors_say_whether_another_attempt_could_succeed(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(model="missing:7b"), "r")
    # (a model the node's Ollama does not have: the pool's fault, another provider may have it)
    assert err.value.status is None and err.value.retry is Retry.ELSEWHERE and err.value.strikes is None
    assert "missing:7b" in err.value.message

    for n in (2, 2.0):  # (a server that takes `n` reads both as 2)
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, chat(n=n), "r")
        assert err.value.status == 400 and err.value.retry is Retry.UNABLE and err.value.strikes is None
        assert err.value.detail is not None and err.value.detail["param"] == "n"
        assert err.value.detail["code"] == "invalid_request_error"  # (as a cli provider's, and the gateway's own)

    fake.state.fail_status = 503
    with pytest.raises(ProviderError) as err:
        await collect(adapter, RunKind.CHAT, chat(stream=True))
    assert err.value.status == 503 and err.value.retryable and err.value.detail is None
    assert err.value.retry_after_s is None
    fake.state.fail_retry_after = "3"  # (a busy server's wait, in seconds: the caller's 503 says it)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    assert err.value.status == 503 and err.value.retry_after_s == 3
    fake.state.fail_status = fake.state.fail_retry_after = None

    fake.state.error_after = 2
    reads: list[list[dict[str, Any]]] = []
    with pytest.raises(ProviderError) as err:
        async for read in adapter.stream(RunKind.CHAT, chat(stream=True), "r"):
            reads.append(read)
    assert "runner crashed" in err.value.message
    assert "".join(c["choices"][0]["delta"].get("content", "") for r in reads for c in r) == "tok0 tok1 "


async def test_connection_refused_is_retryable(session: aiohttp.ClientSession) -> None:
    server = FakeOllama()
    url = await server.start()
    await server.stop()
    adapter = OllamaAdapter(provider(url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "r")
    assert err.value.retryable and err.value.status is None


async def test_cancelling_a_stream_closes_the_request_at_the_fake(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    fake.state.hang_after = 1
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in adapter.stream(RunKind.CHAT, chat(stream=True), "run_c"):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fake.state.disconnected.wait(), 10)
    assert fake.state.records[-1]["disconnected"] and not fake.state.records[-1]["completed"]


async def test_probe_transitions_available_unavailable_available(adapter: OllamaAdapter, fake: FakeOllama) -> None:
    probe = await adapter.probe()
    assert probe.health is Health.AVAILABLE and probe.reason == ""
    assert probe.models is not None and {"llama3:latest", "llama3", "nomic-embed-text"} <= set(probe.models)

    fake.state.tags_status = 500
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == "GET /api/tags answered 500 (not now)"
    fake.state.tags_status = 200
    assert (await adapter.probe()).health is Health.AVAILABLE

    port = fake.port
    await fake.stop()
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.reason == "GET /api/tags: connection refused"
    await fake.start(port)
    assert (await adapter.probe()).health is Health.AVAILABLE

    fake.state.models = ["other:1b"]
    probe = await adapter.probe()
    assert probe.health is Health.AVAILABLE and probe.models == ["other:1b"]  # the scheduler gates on this


def test_fields_of_the_wrong_type_in_an_answer_never_reach_the_caller_as_python_reprs() -> None:
    """(found by a hostile-provider audit: `{"py": "repr"}` came out as the text "{'py': 'repr'}")"""
    from workers.adapters import ollama_wire as wire

    odd: dict[str, Any] = {"message": {"content": {"py": "repr"}, "thinking": ["a"],
                       "tool_calls": [{"function": {"name": 5, "arguments": {"x": float("nan")}}},
                                      {"function": "not an object"}]},
           "prompt_eval_count": True, "eval_count": -3}
    assert wire.text_of(RunKind.CHAT, odd) == "" and wire.thinking_of(odd) == ""
    assert wire.text_of(RunKind.COMPLETION, {"response": 42}) == ""
    assert wire.tool_calls_of(odd, "run_1") == ([], 2)  # (no name: no call a client could run)
    odd["message"]["tool_calls"][0]["function"]["name"] = "f"
    calls, dropped = wire.tool_calls_of(odd, "run_1")
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x":null}'}] and dropped == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": None}
    assert wire.usage_of(odd) == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for vectors in ([["a", "b"]], [5], [{"x": 1}]):
        for encoding in ("float", "base64"):
            with pytest.raises(wire.BadAnswer, match="not a list of numbers"):
                wire.embeddings_response({"model": "m", "encoding_format": encoding}, {"embeddings": vectors})
    for vector in ([1e39], [10**40]):  # (OverflowError and struct.error escaped the adapter)
        with pytest.raises(wire.BadAnswer, match="beyond 32-bit floats"):
            wire.embeddings_response({"model": "m", "encoding_format": "base64"}, {"embeddings": [vector]})


@pytest.mark.parametrize("depth", [200, 5000])
def test_tool_call_arguments_nested_too_deep_are_the_callers_400_naming_them(depth: int) -> None:
    """(a hostile caller's audit: 5,000 levels in an earlier turn's arguments were a RecursionError
    in the worker, a 502 blamed on the provider, and a traceback in its log)"""
    from workers.adapters import ollama_wire as wire

    calls: list[dict[str, Any]] = [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "d", "type": "function", "function": {"name": "f", "arguments": "[" * depth + "]" * depth}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}]}
    with pytest.raises(wire.UnsupportedRequest, match="nest deeper than 128 levels") as err:
        wire.request(RunKind.CHAT, body, stream=False)
    assert err.value.param == "messages[1].tool_calls[1].function.arguments"
    for text, native_args in [('{"a": [1, {"b": 2}]}', {"a": [1, {"b": 2}]}), ("null", {}), ("", {}), ("{", {})]:
        calls[1]["function"]["arguments"] = text  # ("null" was refused as too deep: a review)
        _, native = wire.request(RunKind.CHAT, body, stream=False)
        assert native["messages"][1]["tool_calls"][1]["function"]["arguments"] == native_args


@pytest.mark.parametrize(("content", "message", "param"), [
    ([{"type": "text", "text": "a"}, {"type": "text", "text": {"x": 1}}], "a text part's text must be a string",
     "messages[0].content[1].text"),
    ({"type": "text", "text": "a"}, "a message's content must be a string or a list of content parts",
     "messages[0].content"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
     "Ollama takes images only as base64 data URLs", "messages[0].content[0].image_url"),
    # (audio and files went nowhere: the model answered without them)
    ([{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}],
     "Ollama takes text and images, not a 'input_audio' part", "messages[0].content[1]"),
    ([{"type": "file", "file": {"file_data": "QUJD", "filename": "a.pdf"}}],
     "Ollama takes text and images, not a 'file' part", "messages[0].content[0]"),
])
def test_content_ollama_cannot_be_given_is_the_callers_400_naming_it(content: Any, message: str, param: str) -> None:
    """(a hostile caller's audit: a text part's object went to the model as a Python repr, and
    content of another type as nothing)"""
    from workers.adapters import ollama_wire as wire

    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}]}
    with pytest.raises(wire.UnsupportedRequest, match=re.escape(message)) as err:
        wire.request(RunKind.CHAT, body, stream=False)
    assert err.value.param == param
    body["messages"][0]["content"] = [{"type": "text", "text": "a"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                                      {"type": "text", "text": "b"}]
    _, native = wire.request(RunKind.CHAT, body, stream=False)
    assert native["messages"][0]["content"] == "a\nb" and native["messages"][0]["images"] == ["QUJD"]


@pytest.mark.parametrize(("part", "shown"), [
    ({"type": True, "text": "a"}, "not a true part"),
    ({"type": 1.5}, "not a 1.5 part"),
    ({"type": {"a": None}}, 'not a {"a": null} part'),
    ({"type": None, "text": "a"}, "not a part without a type"),
    ("a", "content parts as objects, not 'a'"),
])
def test_a_part_of_a_type_ollama_does_not_take_is_named_as_json_not_as_python_writes_it(part: Any, shown: str) -> None:
    """(a hostile caller's audit: the part's type, or the part itself, was shown as Python writes it,
    `'True'`, `'1.5'` as if text, `{'a': None}`, and a part that is not an object as an `'untyped'` one)"""
    from workers.adapters import ollama_wire as wire

    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    with pytest.raises(wire.UnsupportedRequest) as err:
        wire.request(RunKind.CHAT, body, stream=False)
    assert shown in str(err.value) and "True" not in str(err.value) and "None" not in str(err.value)
    assert err.value.param == "messages[0].content[0]"


def test_a_developer_message_goes_as_system() -> None:
    """(OpenAI's newer name for the system role, which the `openai` SDKs and agents send: Ollama's
    chat templates know system, user, assistant and tool)"""
    from workers.adapters import ollama_wire as wire

    body: dict[str, Any] = {"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                                    {"role": "user", "content": "hi"}]}
    _, native = wire.request(RunKind.CHAT, body, stream=False)
    assert [m["role"] for m in native["messages"]] == ["system", "user"]
    # (an assistant's refusal part, replayed in the history, is its text)
    body["messages"].append({"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]})
    _, native = wire.request(RunKind.CHAT, body, stream=False)
    assert native["messages"][-1] == {"role": "assistant", "content": "I can't"}


async def test_a_key_and_the_config_s_headers_go_with_runs_and_probes(
        fake: FakeOllama, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """ollama.com's API takes a bearer key, and so does an Ollama behind a proxy that wants one: the
    key (`api_key_env`) was not sent, and every run got the 401."""
    monkeypatch.setenv("IOP_TEST_OLLAMA_KEY", "ok-secret-key")
    adapter = OllamaAdapter(provider(fake.url, api_key_env="IOP_TEST_OLLAMA_KEY"), session)
    assert (await adapter.probe()).health is Health.AVAILABLE
    await adapter.complete(RunKind.CHAT, {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}, "r1")
    assert fake.state.tags_authorizations[-1] == "Bearer ok-secret-key"
    assert fake.state.records[-1]["authorization"] == "Bearer ok-secret-key"
    # (what no error text shows, as for the OpenAI family: the key, and its forms within base64)
    assert adapter.credentials.secrets() == key_secrets("ok-secret-key") and "ok-secret-key" in key_secrets(
        "ok-secret-key")


async def test_the_answer_s_head_may_take_the_load_timeout_more_and_the_body_s_reads_not(
        session: aiohttp.ClientSession) -> None:
    """Ollama sends nothing, its head included, while it loads the model, and aborts the load when
    the client leaves: the head may take `load_timeout_ms` more than `read_timeout_ms` (it was
    `read_timeout_ms`: a load longer than that was never done, each run aborting it). Past both, the
    run is a `provider_timeout` saying so; once the head came, the body's reads have
    `read_timeout_ms` again."""
    released = asyncio.Event()
    went_silent = asyncio.Event()

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        if (await request.json())["model"] == "loads-forever":
            await released.wait()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"model":"m","message":{"role":"assistant","content":"hi"},"done":false}\n')
        went_silent.set()
        await released.wait()
        return resp

    app = web.Application()
    app.router.add_post("/api/chat", chat_handler)
    async with serving(app) as address:
        adapter = OllamaAdapter(provider(f"http://{address}", read_timeout_ms=100, load_timeout_ms=150), session)
        with pytest.raises(ProviderError) as raised:
            await collect(adapter, RunKind.CHAT, chat(model="loads-forever"))
        assert raised.value.message.startswith("provider ollama-b: began no answer within 250 ms"), raised.value
        assert raised.value.code is ErrorCode.PROVIDER_TIMEOUT and raised.value.retry is Retry.ELSEWHERE
        with pytest.raises(ProviderError) as raised:
            await collect(adapter, RunKind.CHAT, chat())
        assert went_silent.is_set()
        assert raised.value.message == "provider ollama-b: sent nothing for 100 ms", raised.value
        released.set()


def test_an_error_ollama_passed_on_from_llama_server_is_read_as_llama_server_said_it() -> None:
    """Ollama gives llama-server's error answer as the text of its own, whole or in a stream's line:
    its object is the error; any other text (Ollama's own, or llama-server's with Ollama's note of
    running out of memory after it) stays as it is."""
    inner = {"code": 500, "message": "failed to decode the batch", "type": "server_error"}
    assert wire.runner_error(json.dumps({"error": inner})) == inner
    for error in ('{"error":{"code":500,"message":""}}\nmodel requires more system memory', "{not json}",
                  '{"error":"text"}', '{"detail":{"message":"m"}}', "runner crashed", {"message": "m"}, None):
        assert wire.runner_error(error) == error


@pytest.mark.parametrize(("asked", "think"), [
    ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "minimal"}, "low"),
    ({"reasoning_effort": "low"}, "low"), ({"reasoning_effort": "medium"}, "medium"),
    ({"reasoning_effort": "high"}, "high"), ({"reasoning_effort": "max"}, "max"),
    ({"reasoning_effort": "xhigh"}, "max"),
    # (`reasoning.effort`, as a Responses request's chat sends it too, comes first)
    ({"reasoning": {"effort": "low"}, "reasoning_effort": "high"}, "low"),
    # (the caller's own `think` wins; an effort Ollama has no word for is dropped, as before)
    ({"reasoning_effort": "high", "think": False}, False), ({"reasoning_effort": "unheard-of"}, None),
    ({"reasoning_effort": None}, None),
])
def test_a_chat_s_reasoning_effort_goes_as_ollama_s_think(asked: dict[str, Any], think: Any) -> None:
    """OpenAI's `reasoning_effort` is Ollama's `think`: its own OpenAI layer maps it so (openai/openai.go
    `thinkFromReasoningEffort` and `FromChatRequest` at Ollama fb3076099: `reasoning.effort` first, else
    `reasoning_effort`; none -> false, minimal -> "low", low/medium/high/max as they are, xhigh -> "max").
    Dropped, a caller's `"none"` left a thinking model thinking, and `"high"` was the model's default."""
    _, native = wire.request(RunKind.CHAT, chat(**asked), stream=False)
    assert native.get("think") == think
    assert "reasoning_effort" not in native and "reasoning" not in native


def test_earlier_tool_calls_and_their_results_keep_their_ids() -> None:
    """Ollama's messages carry tool call ids: a call's `id` and a result's `tool_call_id` (api/types.go
    `ToolCall.ID`, `Message.ToolCallID` at Ollama fb3076099), which its own OpenAI layer passes on as
    they came (openai/openai.go `FromCompletionToolCall`, `FromChatRequest`) and its chat templates and
    renderers read (template/template.go `convertMessagesForTemplate`: `.ToolCalls[].ID`, `.ToolCallID`;
    model/renderers/cohere.go numbers each result by the call its id answers). Dropped, the results of
    two calls in one turn were told apart by nothing but their tool's name."""
    history = [{"role": "user", "content": "weather in Oslo and Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                   {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                   {"type": "function", "function": {"name": "clock", "arguments": "{}"}}]},  # (one without)
               {"role": "tool", "tool_call_id": "c2", "content": "rain"},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    _, native = wire.request(RunKind.CHAT, chat(messages=history), stream=False)
    assert native["messages"][1]["tool_calls"] == [
        {"id": "c1", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
        {"id": "c2", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "clock", "arguments": {}}}]
    assert native["messages"][2:] == [
        {"role": "tool", "content": "rain", "tool_name": "weather", "tool_call_id": "c2"},
        {"role": "tool", "content": "sunny", "tool_name": "weather", "tool_call_id": "c1"}]


def test_an_earlier_turn_s_reasoning_goes_as_its_thinking() -> None:
    """An assistant turn replayed with its reasoning gives it to Ollama as the message's `thinking`, as
    Ollama's own OpenAI layer does with a message's `reasoning` (openai/openai.go `FromChatRequest`:
    `Thinking: msg.Reasoning`, at Ollama fb3076099), which a thinking model's template renders back
    (gpt-oss's reasoning before its tool call, say). `reasoning_content` is the name iop itself gives
    Ollama's thinking in its answers (and vLLM's), so a client that replays iop's answer sends that."""
    call = {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
    for said, thinking in (({"reasoning_content": "the user wants the time"}, "the user wants the time"),
                           ({"reasoning": "first", "reasoning_content": "second"}, "first"),
                           ({"reasoning_content": ""}, None), ({"reasoning_content": ["not text"]}, None)):
        history = [{"role": "user", "content": "time?"},
                   {"role": "assistant", "content": None, "tool_calls": [call], **said},
                   {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
        _, native = wire.request(RunKind.CHAT, chat(messages=history), stream=False)
        assert native["messages"][1].get("thinking") == thinking, said
        assert not {"reasoning", "reasoning_content"} & set(native["messages"][1])


@pytest.mark.parametrize("message, runners", [
    ('do embedding request: Post "http://127.0.0.1:40123/v1/embeddings": EOF', True),
    ("llama-server process no longer running: exit status 2 ", True),
    ('Post "http://127.0.0.1:40123/tokenize": dial tcp 127.0.0.1:40123: connect: connection refused', True),
    ("unexpected server status: llm server loading model", True),
    ("embedding contains NaN or Inf values", True),
    ("no slots available after 10 retries", True),
    ("the input length exceeds the context length", False),
    ("input exceeds maximum context length and cannot be truncated further", False),
    ("invalid input type", False),
    ("json: cannot unmarshal string into Go struct field EmbedRequest.truncate of type bool", False),
])
def test_which_of_ollama_s_embedding_400s_are_its_runner_s_failures(message: str, runners: bool) -> None:
    """`/api/embed` answers 400 to every error of an embedding (server/routes.go:1000-1014): those its
    runner's failures say (llm/llama_server.go's `Embedding`, `getServerStatus`, `tokenize`) are the
    server's fault; its checks of the request (an input over the context, a field's type) the caller's."""
    assert bool(wire.EMBED_RUNNER_FAILED.match(message)) is runners


def test_an_empty_embedding_input_is_not_for_ollama() -> None:
    """`/api/embed` takes `""` for no input, and answers a 200 with no embeddings (routes.go:823-826,
    862-865): the caller's 400 naming `input`, not a request to send."""
    with pytest.raises(wire.UnsupportedRequest) as caught:
        wire.request(RunKind.EMBEDDING, {"model": "m", "input": ""}, stream=False)
    assert caught.value.param == "input"
    assert wire.request(RunKind.EMBEDDING, {"model": "m", "input": [""]}, stream=False)[1]["input"] == [""]


async def test_a_legacy_completion_s_echo_puts_the_prompt_before_the_answer(adapter: OllamaAdapter,
                                                                              fake: FakeOllama) -> None:
    """`echo: true` asks for the prompt before the answer's text, as OpenAI's and vLLM's give it (vLLM's
    stream: with the first token's text, serving_completion.py's `completion_stream_generator`). Ollama's
    `/api/generate` has no `echo` (api/types.go `GenerateRequest`): it was dropped, and the caller got the
    answer alone."""
    body = {"model": SERVED, "prompt": "Once upon", "max_tokens": 2, "echo": True}
    answer = await adapter.complete(RunKind.COMPLETION, body, "run_e")
    validate("CreateCompletionResponse", answer)
    assert answer["choices"][0]["text"] == "Once upontok0 tok1 "
    assert "echo" not in fake.state.records[-1]["body"]
    chunks = [c for read in await collect(adapter, RunKind.COMPLETION, {**body, "stream": True}) for c in read]
    assert chunks[0]["choices"][0]["text"] == "Once upontok0 "
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Once upontok0 tok1 "
    # (the prompt's own log probabilities, which echo adds to the answer's, Ollama cannot give)
    with pytest.raises(wire.UnsupportedRequest) as caught:
        wire.request(RunKind.COMPLETION, {**body, "logprobs": 1}, stream=False)
    assert caught.value.param == "echo"
    assert wire.request(RunKind.COMPLETION, {**body, "echo": False, "logprobs": 1}, stream=False)[1]["logprobs"]
