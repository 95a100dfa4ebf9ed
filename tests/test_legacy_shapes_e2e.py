"""Chat completions, legacy completions and embeddings from an OpenAI-compatible provider that answers
them the odd ways real servers do (`tests.fakes.odd_outputs`), through real iop processes and a real
Redis: every 200 the caller gets fits OpenAI's schema (`CreateChatCompletionResponse`,
`CreateChatCompletionStreamResponse`, `CreateCompletionResponse`, `CreateEmbeddingResponse`) and the
official client's own types, streamed or whole; what cannot be repaired is the provider's error."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from tests.conftest import Stack
from tests.fakes.odd_outputs import (
    ANSWERS,
    CALL,
    CHAT_ANSWERS,
    CHAT_STREAMS,
    EMBEDDINGS,
    MANY_CALLS,
    SERVED,
    STREAMS,
    OddServer,
)
from tests.openapi import validate
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

#: what OpenAI's schema allows as a legacy completion's finish_reason
REASONS = ("stop", "length", "content_filter")
#: and as a chat completion's
CHAT_REASONS = (*REASONS, "tool_calls", "function_call")


def start(stack: Stack, server: OddServer) -> str:
    """One provider serving every odd case, each a model of the same name; scheduler, worker, gateway."""
    stack.write_config({"models": [{"id": s, "providers": {"odd": s}} for s in SERVED],
                        "nodes": [{"id": "n1", "providers": [{"id": "odd", "type": "openai_api",
                                                              "base_url": server.url + "/v1", "capacity": 4,
                                                              "models": SERVED}]}],
                        "runtime": FAST_RUNTIME, "queue": {"max_attempts": 1}})
    stack.scheduler()
    stack.worker("n1")
    url = stack.gateway()
    wait_available(stack.redis_url, ["odd"])
    return url


def problems_of_completion(body: dict[str, Any], chunk: bool = False) -> list[str]:
    """What OpenAI's schema and the client's own types find wrong with a legacy completion (a chunk:
    its null finish_reasons, which OpenAI's streams have and its schema has not, taken as they are)."""
    found = []
    if chunk:  # (a copy with each null finish_reason as "stop": the rest is checked as a whole answer is)
        body = {**body, "choices": [{**c, "finish_reason": c.get("finish_reason") or "stop"}
                                    if isinstance(c, dict) and "finish_reason" in c else c
                                    for c in body.get("choices") or []]}
    try:
        validate("CreateCompletionResponse", body)
    except Exception as exc:  # jsonschema.ValidationError
        found.append(f"schema: {str(exc).splitlines()[0][:160]}")
    try:
        Completion.model_validate(body)
    except Exception as exc:  # pydantic.ValidationError
        found.append(f"client types: {str(exc).splitlines()[0][:160]}")
    return found


async def test_whole_legacy_completions_and_embeddings_fit_openai_s_schema_and_client(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        await _whole(stack, session)


async def _whole(stack: Stack, session: aiohttp.ClientSession) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        client = stack.openai(gateway)
        bad: dict[str, Any] = {}
        for served in ANSWERS:
            n = 2 if served.endswith("-n2") else 1
            asked = {"model": served, "prompt": "hi", "n": n}
            async with session.post(gateway + "/v1/completions", json=asked) as resp:
                status, body = resp.status, await resp.json()
            if served == "c-finish-error":  # a run its server says failed: the provider's error, no answer
                if status != 502 or body.get("error", {}).get("code") != "provider_error":
                    bad[served] = (status, body)
                continue
            found = problems_of_completion(body) if status == 200 else [f"status {status}: {body}"]
            if not found:
                parsed = client.completions.create(model=served, prompt="hi", n=n)
                if [c.index for c in parsed.choices] != list(range(n)) or not all(
                        isinstance(c.text, str) and c.finish_reason in REASONS for c in parsed.choices):
                    found.append(f"client read {parsed.choices}")
                if parsed.usage is not None and not isinstance(parsed.usage.completion_tokens, int):
                    found.append(f"client read usage {parsed.usage}")
            if found:
                bad[served] = found
        for served in EMBEDDINGS:
            async with session.post(gateway + "/v1/embeddings", json={"model": served, "input": ["a", "b", "c"],
                                                                      "encoding_format": "float"}) as resp:
                answer = await resp.json()
            found = []
            try:
                validate("CreateEmbeddingResponse", answer)
            except Exception as exc:
                found.append(f"schema: {str(exc).splitlines()[0][:160]}")
            try:
                CreateEmbeddingResponse.model_validate(answer)
            except Exception as exc:
                found.append(f"client types: {str(exc).splitlines()[0][:160]}")
            embedded = client.embeddings.create(model=served, input=["a", "b", "c"])  # (base64, the client's own)
            if [d.index for d in embedded.data] != [0, 1, 2] or \
                    [round(d.embedding[0], 3) for d in embedded.data] != [0.5, 1.5, 2.5]:
                found.append(f"client read {[(d.index, d.embedding) for d in embedded.data]}")
            if not isinstance(getattr(embedded.usage, "prompt_tokens", None), int):
                found.append(f"client read usage {embedded.usage}")
            if found:
                bad[served] = found
        assert bad == {}, json.dumps(bad, indent=1, default=str)


async def test_streamed_legacy_completions_fit_openai_s_schema_and_client(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        await _streamed(stack, session)


async def _streamed(stack: Stack, session: aiohttp.ClientSession) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        client = stack.openai(gateway)
        bad: dict[str, Any] = {}
        for served in STREAMS:
            for usage in (False, True):
                body = {"model": served, "prompt": "hi", "stream": True,
                        **({"stream_options": {"include_usage": True}} if usage else {})}
                async with session.post(gateway + "/v1/completions", json=body) as resp:
                    lines = [line.strip() for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: ")]
                assert lines[-1] == b"data: [DONE]", (served, lines)
                chunks = [json.loads(line[6:]) for line in lines[:-1]]
                found = [p for c in chunks for p in problems_of_completion(c, chunk=True)]
                if any("error" in c for c in chunks):
                    found.append(f"an error: {chunks}")
                text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
                reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
                if text != "hello" or reasons[-1] not in REASONS or any(r not in (None, *REASONS) for r in reasons):
                    found.append(f"text {text!r}, finish_reasons {reasons}")
                if usage != any(isinstance(c.get("usage"), dict) for c in chunks) and served in ("s-ollama", "s-vllm"):
                    found.append("usage where not asked for, or none where asked for and sent")
                streamed = list(client.completions.create(model=served, prompt="hi", stream=True,
                                                          stream_options={"include_usage": True} if usage else None))
                ids = {c.id for c in streamed}
                if len(ids) != 1 or not all(isinstance(c.created, int) and c.object == "text_completion"
                                            for c in streamed):
                    found.append(f"client read {[c.model_dump() for c in streamed]}")
                if found:
                    bad[f"{served} include_usage={usage}"] = found
        assert bad == {}, json.dumps(bad, indent=1, default=str)


def test_openai_client_reads_the_error_of_a_run_its_server_failed(stack: Stack) -> None:
    """A legacy completion whose server says it ended in error (vLLM's `finish_reason: "error"`) is no
    answer: the caller's client raises the provider's error."""
    with OddServer() as server:
        client = stack.openai(start(stack, server))
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="c-finish-error", prompt="hi")
        assert caught.value.status_code == 502


def problems_of_chat(body: dict[str, Any], chunk: bool = False) -> list[str]:
    """What OpenAI's schema and the client's own types find wrong with a chat completion or chunk."""
    found = []
    try:
        validate("CreateChatCompletionStreamResponse" if chunk else "CreateChatCompletionResponse", body)
    except Exception as exc:  # jsonschema.ValidationError
        found.append(f"schema: {str(exc).splitlines()[0][:160]}")
    try:
        (ChatCompletionChunk if chunk else ChatCompletion).model_validate(body)
    except Exception as exc:  # pydantic.ValidationError
        found.append(f"client types: {str(exc).splitlines()[0][:160]}")
    return found


async def test_whole_chat_completions_fit_openai_s_schema_and_client(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        await _whole_chat(stack, session)


async def _whole_chat(stack: Stack, session: aiohttp.ClientSession) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        client = stack.openai(gateway)
        bad: dict[str, Any] = {}
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        for served in CHAT_ANSWERS:
            n = 2 if served.endswith("-n2") else 1
            async with session.post(gateway + "/v1/chat/completions",
                                    json={"model": served, "messages": messages, "n": n}) as resp:
                status, body = resp.status, await resp.json()
            if served == "ch-finish-error":  # a run its server says failed: the provider's error, no answer
                if status != 502 or body.get("error", {}).get("code") != "provider_error":
                    bad[served] = (status, body)
                continue
            found = problems_of_chat(body) if status == 200 else [f"status {status}: {body}"]
            if not found:
                parsed = client.chat.completions.create(model=served, messages=messages, n=n)
                choices = parsed.choices
                if [c.index for c in choices] != list(range(n)) or not all(
                        c.finish_reason in CHAT_REASONS and c.message.role == "assistant" for c in choices):
                    found.append(f"client read {parsed.choices}")
                said = [c.message.content for c in choices]
                expected = {"ch-vllm-n2": ["first", "second"], "ch-tgi-tools": [None], "ch-refusal": [None]}
                if said != expected.get(served, ["hi"]):
                    found.append(f"contents {said}")
                if served == "ch-tgi-tools":
                    calls = choices[0].message.tool_calls or []
                    if [(c.id, c.type, c.function.name, json.loads(c.function.arguments)) for c in calls
                            if c.type == "function"] != [("0", "function", "weather", {"city": "Paris"})]:
                        found.append(f"tool calls {calls}")
                if served == "ch-refusal" and choices[0].message.refusal != "I cannot.":
                    found.append(f"refusal {choices[0].message.refusal!r}")
                if parsed.usage is not None and not isinstance(parsed.usage.completion_tokens, int):
                    found.append(f"client read usage {parsed.usage}")
            if found:
                bad[served] = found
        assert bad == {}, json.dumps(bad, indent=1, default=str)


async def test_streamed_chat_completions_fit_openai_s_schema_and_client(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        await _streamed_chat(stack, session)


async def _streamed_chat(stack: Stack, session: aiohttp.ClientSession) -> None:
    with OddServer() as server:
        gateway = start(stack, server)
        client = stack.openai(gateway)
        bad: dict[str, Any] = {}
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        for served in CHAT_STREAMS:
            n = 2 if served.endswith("-n2") else 1
            for usage in (False, True):
                body = {"model": served, "messages": messages, "stream": True, "n": n,
                        **({"stream_options": {"include_usage": True}} if usage else {})}
                async with session.post(gateway + "/v1/chat/completions", json=body) as resp:
                    status, raw = resp.status, await resp.read()
                if served == "chs-finish-error":  # (before any output: the error keeps its status)
                    if status != 502 or b"provider_error" not in raw:
                        bad[f"{served} include_usage={usage}"] = (status, raw.decode())
                    continue
                lines = [line.strip() for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
                assert lines[-1] == b"data: [DONE]", (served, lines)
                chunks = [json.loads(line[6:]) for line in lines[:-1]]
                found = [p for c in chunks for p in problems_of_chat(c, chunk=True)]
                if any("error" in c for c in chunks):
                    found.append(f"an error: {chunks}")
                if any("usage" in c and not isinstance(c["usage"], dict) for c in chunks):
                    found.append("a usage that is not one")
                choices = [c for ch in chunks for c in ch.get("choices") or ()]  # (as read before they were whole)
                texts = ["".join((c.get("delta") or {}).get("content") or "" for c in choices
                                 if c.get("index", 0) == i) for i in range(n)]
                reasons = [c.get("finish_reason") for c in choices]
                ended = [r for r in reasons if r is not None]
                wanted = "" if served == "chs-tools" else "hello"
                if texts != [wanted] * n or len(ended) != n or any(r not in CHAT_REASONS for r in ended):
                    found.append(f"texts {texts}, finish_reasons {reasons}")
                if served == "chs-tools":
                    deltas = [d for c in choices for d in (c.get("delta") or {}).get("tool_calls") or ()]
                    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
                    if (deltas[0]["id"], deltas[0]["function"]["name"], arguments, ended) != (
                            CALL["id"], "weather", CALL["function"]["arguments"], ["tool_calls"]):
                        found.append(f"tool call deltas {deltas}, finish {ended}")
                if usage != any(isinstance(c.get("usage"), dict) for c in chunks) and \
                        served in ("chs-ollama", "chs-vllm", "chs-vllm-n2"):
                    found.append("usage where not asked for, or none where asked for and sent")
                streamed = list(client.chat.completions.create(
                    model=served, messages=messages, stream=True, n=n,
                    stream_options={"include_usage": True} if usage else None))
                if len({c.id for c in streamed}) != 1 or len({c.created for c in streamed}) != 1 or not all(
                        c.object == "chat.completion.chunk" for c in streamed):
                    found.append(f"client read {[c.model_dump() for c in streamed]}")
                if found:
                    bad[f"{served} include_usage={usage}"] = found
        assert bad == {}, json.dumps(bad, indent=1, default=str)


def test_openai_client_reads_the_error_of_a_chat_run_its_server_failed(stack: Stack) -> None:
    """A chat completion whose server says it ended in error (vLLM's `finish_reason: "error"`), whole
    or streamed, is no answer: the caller's client raises the provider's error."""
    with OddServer() as server:
        client = stack.openai(start(stack, server))
        for served, stream in (("ch-finish-error", False), ("chs-finish-error", True)):
            with pytest.raises(openai.APIStatusError) as caught:
                answer = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "hi"}],
                                                        stream=stream)
                if isinstance(answer, openai.Stream):
                    list(answer)
            assert caught.value.status_code == 502


def test_a_whole_answer_of_too_many_items_for_a_response_is_said_where_its_run_completed(stack: Stack) -> None:
    """A whole chat answer of 1,100 tool calls makes a Response of more than 1,024 items: the caller
    gets 502 `output_too_large`, while its run had completed (the runs API says so: the provider's
    answer came whole). The gateway said nothing of it; a WARNING names the run and says so."""
    with OddServer() as server:
        url = start(stack, server)
        with pytest.raises(openai.APIStatusError) as caught:
            stack.openai(url).responses.create(model=MANY_CALLS, input="hi")
        assert caught.value.status_code == 502 and caught.value.code == "output_too_large"
        run_id = caught.value.response.headers["x-iop-run-id"]
        with urllib.request.urlopen(f"{url}/v1/runs/{run_id}") as resp:
            assert json.load(resp)["state"] == "completed"
        gateway = next(p for p in stack.procs if p.name == "gateway")
        gateway.wait_for_line(r"WARNING .*more than 1024 output items.*its caller got output_too_large; the run had "
                              rf"ended before \(completed: the runs API says so.*run={run_id}")
