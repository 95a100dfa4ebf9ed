"""Answers the official Node.js `openai` client (npm `openai` 6.x) reads differently from the Python
one, through real iop processes and a real Redis, from a provider that answers as llama-cpp-python's
server 0.3.36 does (seen with a real one, driven by that client):

- **Embeddings, base64 by default.** The Node client asks for `encoding_format: base64` unless told,
  and turns each `embedding` into numbers with `Buffer.from(embedding, 'base64')`, without looking
  at what came. A list of numbers there became an empty or wrong vector, silently (a vector per
  token, from a model without pooling: `[]` for each input). The Python client leaves a list alone.
- **A tool call given twice.** That server gives a called tool both as `tool_calls` and as the
  legacy `function_call`, in its whole answer and in every streamed piece. The Node client's stream
  helper (`finalChatCompletion()`) keeps `function_call` and drops `tool_calls` when a message has
  both: the caller saw no tool call."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import Stack
from tests.fakes.serving import ThreadedServer
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

PER_TOKEN = "per-token.gguf"
CHAT = "chat.gguf"
ARGS = '{ "city": "Paris" }'


def _call(piece: str, first: bool) -> dict[str, Any]:
    """One streamed piece of the call as that server gives it: both forms, the legacy one naming the
    function on every piece."""
    call: dict[str, Any] = {"index": 0, "type": "function", "function": {"arguments": piece}}
    if first:
        call = {**call, "id": "call__0_get_weather_cmpl-1", "function": {"name": "get_weather", "arguments": piece}}
    return {"content": None, "function_call": {"name": "get_weather", "arguments": piece}, "tool_calls": [call]}


class LlamaLike(ThreadedServer):
    """llama-cpp-python 0.3.36's answers: embeddings one vector per token whatever `encoding_format`
    says; a forced tool call as `tool_calls` and `function_call` both. `functions` (the legacy form
    of `tools`) gets `function_call` alone."""

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": s, "object": "model"} for s in (PER_TOKEN, CHAT)]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return web.json_response({"object": "list", "model": body["model"], "usage": {"prompt_tokens": 3,
                                                                                      "total_tokens": 3},
                                  "data": [{"object": "embedding", "index": i,
                                            "embedding": [[0.5, -0.25], [1.5, 2.0]][: i + 1]}
                                           for i in range(len(inputs))]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        legacy = "functions" in body
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None,
                                       "function_call": {"name": "get_weather", "arguments": ARGS}}
            if not legacy:
                message["tool_calls"] = [{"id": "call__0_get_weather_cmpl-1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ARGS}}]
            return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "created": 1790000000,
                                      "model": body["model"], "usage": {"prompt_tokens": 3, "completion_tokens": 8,
                                                                        "total_tokens": 11},
                                      "choices": [{"index": 0, "logprobs": None, "message": message,
                                                   "finish_reason": "function_call" if legacy else "tool_calls"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": None}]
        for i, piece in enumerate(['{ "city', '": "Paris" }']):
            delta = _call(piece, i == 0)
            if legacy:
                del delta["tool_calls"]
            deltas.append(delta)
        for delta in deltas:
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1790000000,
                     "model": body["model"], "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                          "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1790000000, "model": body["model"],
               "choices": [{"index": 0, "delta": {}, "logprobs": None,
                            "finish_reason": "function_call" if legacy else "tool_calls"}]}
        await resp.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app


def start(stack: Stack, server: LlamaLike) -> str:
    stack.write_config({"models": [{"id": "embed", "providers": {"llama": PER_TOKEN}},
                                   {"id": "chat", "providers": {"llama": CHAT}}],
                        "nodes": [{"id": "n1", "providers": [{"id": "llama", "type": "llamacpp", "base_url": server.url,
                                                              "capacity": 2, "models": [PER_TOKEN, CHAT]}]}],
                        "runtime": FAST_RUNTIME, "queue": {"max_attempts": 1, "queue_timeout_ms": 5000}})
    stack.scheduler()
    stack.worker("n1")
    url = stack.gateway()
    wait_available(stack.redis_url, ["llama"])
    return url


async def test_embeddings_base64_cannot_carry_are_a_400_naming_encoding_format_not_numbers(stack: Stack) -> None:
    """Numbers where base64 was asked became `[]` in the Node client's default call. A vector per
    token is what base64 cannot carry: a 400 that says to ask for floats, which still come."""
    with LlamaLike() as server:
        gateway = start(stack, server)
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway + "/v1/embeddings", json={"model": "embed", "input": ["red", "blue sky"],
                                                                      "encoding_format": "base64"}) as resp:
                status, body = resp.status, await resp.json()
            assert status == 400, body
            error = body["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error", "invalid_request_error", "encoding_format"), error
            assert "one vector per token" in error["message"] and "'float'" in error["message"], error
            async with session.post(gateway + "/v1/embeddings", json={"model": "embed", "input": ["red", "blue sky"],
                                                                      "encoding_format": "float"}) as resp:
                status, body = resp.status, await resp.json()
            assert status == 200, body
            assert [d["embedding"] for d in body["data"]] == [[[0.5, -0.25]], [[0.5, -0.25], [1.5, 2.0]]]


def _deltas(raw: bytes) -> list[dict[str, Any]]:
    lines = [line for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]", lines
    return [c["delta"] for line in lines[:-1] for c in json.loads(line[6:])["choices"]]


async def test_a_tool_call_given_as_tool_calls_and_function_call_comes_as_tool_calls_alone(stack: Stack) -> None:
    """OpenAI's answers to `tools` never hold `function_call`; the Node client's stream helper kept it
    and dropped the `tool_calls` beside it. A request that used `functions` keeps its `function_call`."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with LlamaLike() as server:
        gateway = start(stack, server)
        async with aiohttp.ClientSession() as session:
            asked = {"model": "chat", "messages": messages, "tools": [tool],
                     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
            async with session.post(gateway + "/v1/chat/completions", json=asked) as resp:
                assert resp.status == 200, await resp.text()
                message = (await resp.json())["choices"][0]["message"]
            assert "function_call" not in message, message
            assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": ARGS}]
            async with session.post(gateway + "/v1/chat/completions", json={**asked, "stream": True}) as resp:
                assert resp.status == 200, await resp.text()
                deltas = _deltas(await resp.read())
            assert not [d for d in deltas if "function_call" in d], deltas
            assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])) == ARGS
            legacy = {"model": "chat", "messages": messages, "functions": [tool["function"]],
                      "function_call": {"name": "get_weather"}}
            async with session.post(gateway + "/v1/chat/completions", json=legacy) as resp:
                assert resp.status == 200, await resp.text()
                message = (await resp.json())["choices"][0]["message"]
            assert message["function_call"] == {"name": "get_weather", "arguments": ARGS}, message
            async with session.post(gateway + "/v1/chat/completions", json={**legacy, "stream": True}) as resp:
                assert resp.status == 200, await resp.text()
                deltas = _deltas(await resp.read())
            assert "".join(d["function_call"]["arguments"] for d in deltas if "function_call" in d) == ARGS
