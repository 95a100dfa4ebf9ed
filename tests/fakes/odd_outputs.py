"""An OpenAI-compatible server whose chat completions, legacy completions and embeddings come back the
odd ways real servers answer them, each under a served name of its own (`CHAT_ANSWERS`, `CHAT_STREAMS`,
`ANSWERS`, `STREAMS`, `EMBEDDINGS`), so one pool of one provider serves every case.

Where each shape comes from (the servers' source, read for this):
- Ollama's `/v1` layer (openai/openai.go, `CompleteChunkChoice`): a choice has no `logprobs` (Go's
  `omitempty` of a nil pointer), `system_fingerprint: "fp_ollama"`; its usage chunk has `choices: []`.
- vLLM (entrypoints/openai/protocol.py, `CompletionResponseChoice`, `CompletionStreamResponse`,
  `UsageInfo`): extra `stop_reason`, `prompt_logprobs`, `kv_transfer_params`; `prompt_tokens_details:
  null` in usage; every streamed chunk dumped with `"usage": null` when usage is asked for; its
  embeddings answer has `id`, `created` and `completion_tokens: 0`.
- Hugging Face TGI (router/src/lib.rs, `CompletionComplete`): its own finish reasons (`eos_token`,
  `stop_sequence`), `id: ""`.
- Chat, the same servers: Ollama's `/v1` (`ChunkChoice`, `Choice`) has no `logprobs` in its choices
  and no `refusal` in its messages; vLLM's whole answer is `ChatCompletionResponse.model_dump()`
  (chat_completion/protocol.py): `annotations`, `function_call`, `system_fingerprint` of null, its
  `ChatCompletionLogProbs` has `content` only; TGI's message that calls a tool has no `content`, and
  gives the arguments as an object (huggingface/text-generation-inference#2136, #2461; llama-server
  did too for a while, ggml-org/llama.cpp#20198); TGI's logprobs have no `refusal`, their tokens no
  `bytes` (router/src/lib.rs, `ChatCompletionLogprob`).
- SGLang (entrypoints/openai/protocol.py): its pydantic models dumped whole, every null field with
  them: a chunk's delta has `role` and `tool_calls` null, `matched_stop` beside `finish_reason`.
- What other servers and proxies send short of that: no `object`, `id`, `created`, `model`, `index`,
  `text: null`, a `finish_reason` of null in a whole answer, usage missing or partial, embeddings
  without `object` or `index`, or with their `index` out of order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.fakes.serving import ThreadedServer

Json = dict[str, Any]


def _usage(prompt: int = 2, completion: int = 1) -> Json:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


#: served name -> the whole legacy completion it answers (given the served name)
ANSWERS: dict[str, Callable[[str], Json]] = {
    "c-ollama": lambda m: {"id": "cmpl-123", "object": "text_completion", "created": 1790000000, "model": m,
                           "system_fingerprint": "fp_ollama",
                           "choices": [{"text": "hi", "index": 0, "finish_reason": "stop"}], "usage": _usage()},
    "c-bare": lambda m: {"choices": [{"text": "hi"}]},
    "c-tgi": lambda m: {"object": "text_completion", "id": "", "created": 1790000000, "model": m,
                        "system_fingerprint": "3.3.4-native",
                        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "eos_token"}],
                        "usage": _usage()},
    "c-vllm-n2": lambda m: {"id": "cmpl-v", "object": "text_completion", "created": 1790000000, "model": m,
                            "choices": [{"index": 1, "text": "second", "logprobs": None, "finish_reason": "length",
                                         "stop_reason": None, "prompt_logprobs": None},
                                        {"index": 0, "text": "first", "logprobs": None, "finish_reason": "stop",
                                         "stop_reason": None, "prompt_logprobs": None}],
                            "usage": {**_usage(2, 4), "prompt_tokens_details": None}, "kv_transfer_params": None},
    "c-text-null": lambda m: {"id": "cmpl-t", "object": "text_completion", "created": 1790000000, "model": m,
                              "choices": [{"index": 0, "text": None, "logprobs": None, "finish_reason": "stop"}]},
    "c-finish-null": lambda m: {"id": "cmpl-f", "object": "text_completion", "created": 1790000000, "model": m,
                                "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]},
    "c-usage-partial": lambda m: {"id": "cmpl-u", "object": "text_completion", "created": 1790000000, "model": m,
                                  "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 2, "total_tokens": 3, "cost": 0.001}},
    "c-finish-error": lambda m: {"id": "cmpl-e", "object": "text_completion", "created": 1790000000, "model": m,
                                 "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "error"}]},
    "c-index5": lambda m: {"id": "cmpl-5", "object": "text_completion", "created": 1790000000, "model": m,
                           "choices": [{"index": 5, "text": "hi", "logprobs": None, "finish_reason": "stop"}]},
}


def _chunk(m: str, text: str, finish: str | None) -> Json:
    return {"id": "cmpl-s", "object": "text_completion", "created": 1790000000, "model": m,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


#: served name -> the chunks of its streamed legacy completion (then `[DONE]`)
STREAMS: dict[str, Callable[[str], list[Json]]] = {
    "s-bare": lambda m: [{"choices": [{"text": "hel"}]}, {"choices": [{"text": "lo", "finish_reason": "stop"}]}],
    "s-ollama": lambda m: [
        {"id": "cmpl-1", "object": "text_completion", "created": 1790000000, "model": m,
         "system_fingerprint": "fp_ollama", "choices": [{"text": "hel", "index": 0, "finish_reason": None}]},
        {"id": "cmpl-1", "object": "text_completion", "created": 1790000000, "model": m,
         "system_fingerprint": "fp_ollama", "choices": [{"text": "lo", "index": 0, "finish_reason": "stop"}]},
        {"id": "cmpl-1", "object": "text_completion", "created": 1790000000, "model": m,
         "system_fingerprint": "fp_ollama", "choices": [], "usage": _usage()}],
    "s-vllm": lambda m: [
        {**_chunk(m, "hel", None), "usage": None}, {**_chunk(m, "lo", "length"), "usage": None},
        {"id": "cmpl-s", "object": "text_completion", "created": 1790000000, "model": m, "choices": [],
         "usage": {**_usage(), "prompt_tokens_details": None}}],
    "s-tgi": lambda m: [{**_chunk(m, "hel", None), "id": ""}, {**_chunk(m, "lo", "eos_token"), "id": ""}],
    "s-text-null": lambda m: [_chunk(m, "hello", None), {**_chunk(m, "", "stop"),
                                                          "choices": [{"index": 0, "text": None,
                                                                       "logprobs": None, "finish_reason": "stop"}]}],
    # (one choice asked for, numbered 5; and an id and created that change midway)
    "s-index5": lambda m: [{**_chunk(m, "hel", None), "choices": [{"index": 5, "text": "hel", "finish_reason": None}]},
                           {**_chunk(m, "lo", None), "choices": [{"index": 5, "text": "lo", "finish_reason": "stop"}]}],
    "s-ids": lambda m: [{**_chunk(m, "hel", None), "id": "cmpl-a", "created": 1790000000},
                        {**_chunk(m, "lo", "stop"), "id": "cmpl-b", "created": 1790000007}],
}


def _vectors(n: int) -> list[list[float]]:
    return [[0.5 + i, -0.25] for i in range(n)]


#: served name -> its embeddings answer for `n` inputs
EMBEDDINGS: dict[str, Callable[[str, int], Json]] = {
    "e-bare": lambda m, n: {"data": [{"embedding": v} for v in _vectors(n)]},
    "e-reversed": lambda m, n: {"object": "list", "model": m, "usage": {"prompt_tokens": n, "total_tokens": n},
                                "data": [{"object": "embedding", "index": i, "embedding": v}
                                         for i, v in reversed(list(enumerate(_vectors(n))))]},
    "e-vllm": lambda m, n: {"id": "embd-x", "object": "list", "created": 1790000000, "model": m,
                            "data": [{"index": i, "object": "embedding", "embedding": v}
                                     for i, v in enumerate(_vectors(n))],
                            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                      "prompt_tokens_details": None}},
    "e-total-only": lambda m, n: {"object": "list", "model": m, "usage": {"total_tokens": n},
                                  "data": [{"object": "embedding", "index": i, "embedding": v}
                                           for i, v in enumerate(_vectors(n))]},
}


def _message(content: str | None = "hi", **more: Any) -> Json:
    return {"role": "assistant", "content": content, **more}


def _vllm_message(content: str) -> Json:
    """A message as vLLM's whole answer dumps it (`ChatMessage.model_dump()`: every field, null or not)."""
    return _message(content, refusal=None, annotations=None, audio=None, function_call=None, tool_calls=[],
                    reasoning_content=None)


def _vllm_logprobs(token: str) -> Json:
    """vLLM's `ChatCompletionLogProbs`: `content` only (OpenAI's has `refusal` too)."""
    return {"content": [{"token": token, "logprob": -0.25, "bytes": list(token.encode()), "top_logprobs": []}]}


#: served name -> the whole chat completion it answers (given the served name)
CHAT_ANSWERS: dict[str, Callable[[str], Json]] = {
    # (SGLang's `ChatCompletionResponse.model_dump()`: `tool_calls` null, usage details null)
    "ch-sglang": lambda m: {"id": "x", "object": "chat.completion", "created": 1790000000, "model": m,
                            "choices": [{"index": 0, "message": _message(reasoning_content=None, tool_calls=None),
                                         "logprobs": None, "finish_reason": "stop", "matched_stop": 1}],
                            "usage": {**_usage(), "prompt_tokens_details": None, "reasoning_tokens": 0},
                            "metadata": {"weight_version": "default"}},
    "ch-bare": lambda m: {"choices": [{"message": {"content": "hi"}}]},
    "ch-ollama": lambda m: {"id": "chatcmpl-123", "object": "chat.completion", "created": 1790000000, "model": m,
                            "system_fingerprint": "fp_ollama",
                            "choices": [{"index": 0, "message": _message(), "finish_reason": "stop"}],
                            "usage": _usage()},
    "ch-tgi": lambda m: {"object": "chat.completion", "id": "", "created": 1790000000, "model": m,
                         "system_fingerprint": "3.3.4-native",
                         "choices": [{"index": 0, "message": _message(), "logprobs": None,
                                      "finish_reason": "eos_token"}], "usage": _usage()},
    "ch-tgi-old": lambda m: {"object": "text_completion", "id": "", "created": 1790000000, "model": m,
                             "system_fingerprint": "1.4.0-native",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                          "finish_reason": "eos_token", "logprobs": {"content": [
                                              {"token": "hi", "logprob": -0.25,
                                               "top_logprobs": [{"token": "hi", "logprob": -0.25}]}]}}],
                             "usage": _usage()},
    "ch-tgi-tools": lambda m: {"object": "chat.completion", "id": "", "created": 1790000000, "model": m,
                               "choices": [{"index": 0, "logprobs": None, "finish_reason": "eos_token",
                                            "message": {"role": "assistant", "tool_calls": [
                                                {"id": "0", "function": {"description": None, "name": "weather",
                                                                         "arguments": {"city": "Paris"}}}]}}],
                               "usage": _usage()},
    "ch-vllm-n2": lambda m: {"id": "chatcmpl-v", "object": "chat.completion", "created": 1790000000, "model": m,
                             "choices": [{"index": 1, "message": _vllm_message("second"), "logprobs": None,
                                          "finish_reason": "length", "stop_reason": None, "token_ids": None},
                                         {"index": 0, "message": _vllm_message("first"),
                                          "logprobs": _vllm_logprobs("first"), "finish_reason": "stop",
                                          "stop_reason": None, "token_ids": None}],
                             "service_tier": None, "system_fingerprint": None, "prompt_logprobs": None,
                             "prompt_token_ids": None, "kv_transfer_params": None,
                             "usage": {**_usage(2, 4), "prompt_tokens_details": None}},
    "ch-refusal": lambda m: {"id": "chatcmpl-r", "object": "chat.completion", "created": 1790000000, "model": m,
                             "choices": [{"index": 0, "message": _message(None, refusal="I cannot."),
                                          "logprobs": None, "finish_reason": "stop"}]},
    "ch-finish-error": lambda m: {"id": "chatcmpl-e", "object": "chat.completion", "created": 1790000000,
                                  "model": m, "choices": [{"index": 0, "message": _vllm_message(""),
                                                           "logprobs": None, "finish_reason": "error"}]},
    "ch-index5": lambda m: {"id": "chatcmpl-5", "object": "chat.completion", "created": 1790000000, "model": m,
                            "choices": [{"index": 5, "message": _message(), "logprobs": None,
                                         "finish_reason": "stop"}]},
}


def _chat_chunk(m: str, delta: Json, finish: str | None, index: int = 0, **more: Any) -> Json:
    return {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1790000000, "model": m,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}], **more}


def _vllm_chunk(m: str, delta: Json, finish: str | None, index: int = 0) -> Json:
    """vLLM's chunk, usage asked for (iop always asks): `"usage": null`, its logprobs without `refusal`."""
    chunk = _chat_chunk(m, delta, finish, index, usage=None)
    chunk["choices"][0]["logprobs"] = _vllm_logprobs(delta.get("content") or "")
    return chunk


def _sglang_chunk(m: str, delta: Json, finish: str | None) -> Json:
    """SGLang's chunk (`ChatCompletionStreamResponse.model_dump_json()`, every field null or not): a
    delta's `role` and `tool_calls` null, `matched_stop`, `"usage": null`."""
    chunk = _chat_chunk(m, {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta},
                        finish, usage=None)
    chunk["choices"][0]["matched_stop"] = None
    return chunk


def _ollama_chunk(m: str, content: str, finish: str | None) -> Json:
    """Ollama's `/v1` chunk: no `logprobs`; every delta has the role."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1790000000, "model": m,
            "system_fingerprint": "fp_ollama",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": finish}]}


#: the tool call a streamed one comes to, in vLLM's deltas
CALL: Json = {"id": "chatcmpl-tool-1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}

#: served name -> the chunks of its streamed chat completion (then `[DONE]`)
CHAT_STREAMS: dict[str, Callable[[str], list[Json]]] = {
    "chs-bare": lambda m: [{"choices": [{"delta": {"content": "hel"}}]},
                           {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}],
    "chs-ollama": lambda m: [
        _ollama_chunk(m, "hel", None), _ollama_chunk(m, "lo", None), _ollama_chunk(m, "", "stop"),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1790000000, "model": m,
         "system_fingerprint": "fp_ollama", "choices": [], "usage": _usage()}],
    "chs-vllm": lambda m: [
        _vllm_chunk(m, {"role": "assistant", "content": ""}, None), _vllm_chunk(m, {"content": "hel"}, None),
        _vllm_chunk(m, {"content": "lo"}, None), _vllm_chunk(m, {"content": ""}, "length"),
        {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1790000000, "model": m, "choices": [],
         "usage": {**_usage(), "prompt_tokens_details": None}}],
    "chs-vllm-n2": lambda m: [
        _vllm_chunk(m, {"role": "assistant", "content": ""}, None, 0),
        _vllm_chunk(m, {"role": "assistant", "content": ""}, None, 1),
        _vllm_chunk(m, {"content": "hello"}, None, 1), _vllm_chunk(m, {"content": "hel"}, None, 0),
        _vllm_chunk(m, {"content": "lo"}, "stop", 0), _vllm_chunk(m, {"content": ""}, "stop", 1),
        {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1790000000, "model": m, "choices": [],
         "usage": {**_usage(2, 3), "prompt_tokens_details": None}}],
    "chs-tgi": lambda m: [{**_chat_chunk(m, {"role": "assistant", "content": "hel"}, None), "id": "",
                           "object": "text_completion", "system_fingerprint": "1.4.0-native"},
                          {**_chat_chunk(m, {"role": "assistant", "content": "lo"}, "eos_token"), "id": "",
                           "object": "text_completion", "system_fingerprint": "1.4.0-native"}],
    "chs-tools": lambda m: [
        _vllm_chunk(m, {"role": "assistant", "content": ""}, None),
        _vllm_chunk(m, {"tool_calls": [{"index": 0, "id": CALL["id"], "type": "function",
                                        "function": {"name": "weather", "arguments": ""}}]}, None),
        _vllm_chunk(m, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, None),
        _vllm_chunk(m, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, None),
        _vllm_chunk(m, {"content": ""}, "tool_calls")],
    "chs-sglang": lambda m: [_sglang_chunk(m, {"role": "assistant", "content": ""}, None),
                             _sglang_chunk(m, {"content": "hel"}, None), _sglang_chunk(m, {"content": "lo"}, None),
                             _sglang_chunk(m, {}, "stop")],
    "chs-finish-error": lambda m: [_vllm_chunk(m, {"role": "assistant", "content": ""}, None),
                                   _vllm_chunk(m, {"content": ""}, "error")],
    # (one choice asked for, numbered 5 by its server; and an id and created that change midway)
    "chs-index5": lambda m: [_chat_chunk(m, {"role": "assistant", "content": ""}, None, 5),
                             _chat_chunk(m, {"content": "hel"}, None, 5), _chat_chunk(m, {"content": "lo"}, "stop", 5)],
    # (Azure's first chunk: its prompt's filter results, an empty id and a created of 0)
    "chs-azure": lambda m: [{"choices": [], "created": 0, "id": "", "model": "", "object": "",
                             "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}]},
                            _chat_chunk(m, {"role": "assistant", "content": "hel"}, None),
                            _chat_chunk(m, {"content": "lo"}, "stop")],
    "chs-ids": lambda m: [{**_chat_chunk(m, {"role": "assistant", "content": "hel"}, None), "id": "chatcmpl-a"},
                          {**_chat_chunk(m, {"content": "lo"}, None), "id": "chatcmpl-b", "created": 1790000007},
                          {**_chat_chunk(m, {}, "stop"), "id": "chatcmpl-c", "created": 1790000009}],
}

#: served name -> the chunks of a streamed chat completion with more choices than the one asked for (then `[DONE]`)
EXTRA_CHOICE_STREAMS: dict[str, Callable[[str], list[Json]]] = {
    "chs-extra-choice": lambda m: [_chat_chunk(m, {"role": "assistant", "content": "hel"}, None, 0),
                                   _chat_chunk(m, {"role": "assistant", "content": "lo"}, None, 1),
                                   _chat_chunk(m, {}, "stop", 0), _chat_chunk(m, {}, "stop", 1)],
}
#: and of a streamed legacy completion so
EXTRA_CHOICE_TEXT_STREAMS: dict[str, Callable[[str], list[Json]]] = {
    "s-extra-choice": lambda m: [{**_chunk(m, "hel", None), "choices": [{"index": 3, "text": "hel"}]},
                                 {**_chunk(m, "lo", None), "choices": [{"index": 4, "text": "lo"}]},
                                 _chunk(m, "", "stop")],
}
#: and whole answers so: a chat completion's and a legacy completion's
EXTRA_CHOICE_ANSWERS: dict[str, Callable[[str], Json]] = {
    "ch-extra-choice": lambda m: {**CHAT_ANSWERS["ch-ollama"](m), "choices": [
        {"index": i, "message": _message(), "finish_reason": "stop"} for i in range(2)]},
    "c-extra-choice": lambda m: {**ANSWERS["c-ollama"](m), "choices": [
        {"index": i, "text": "hi", "finish_reason": "stop"} for i in range(2)]},
}

#: a whole chat completion of more tool calls than a Response holds items (`MAX_OUTPUT_ITEMS`, 1024)
MANY_CALLS = "ch-many-calls"
MANY_ITEMS_ANSWERS: dict[str, Callable[[str], Json]] = {
    MANY_CALLS: lambda m: {**CHAT_ANSWERS["ch-ollama"](m), "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": _message(None, tool_calls=[{**CALL, "id": f"call_{i}"} for i in range(1100)])}]},
}

SERVED = [*ANSWERS, *STREAMS, *EMBEDDINGS, *CHAT_ANSWERS, *CHAT_STREAMS, *EXTRA_CHOICE_STREAMS,
          *EXTRA_CHOICE_TEXT_STREAMS, *EXTRA_CHOICE_ANSWERS, *MANY_ITEMS_ANSWERS]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _answer(request: web.Request, answers: dict[str, Any], streams: dict[str, Any]) -> web.StreamResponse:
    """The answer `answers` (whole) or `streams` (streamed) has for the served name asked for."""
    body = await request.json()
    served = body["model"]
    if not body.get("stream"):
        return web.json_response(answers[served](served))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in streams[served](served):
        await resp.write(sse(chunk))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class OddServer(ThreadedServer):
    """Serves every name of `SERVED`: `/v1/completions` from `ANSWERS` (whole) and `STREAMS`
    (streamed), `/v1/chat/completions` from `CHAT_ANSWERS` and `CHAT_STREAMS`, `/v1/embeddings` from
    `EMBEDDINGS`."""

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": s, "object": "model"} for s in SERVED]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await _answer(request, {**ANSWERS, **EXTRA_CHOICE_ANSWERS}, {**STREAMS, **EXTRA_CHOICE_TEXT_STREAMS})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await _answer(request, {**CHAT_ANSWERS, **EXTRA_CHOICE_ANSWERS, **MANY_ITEMS_ANSWERS},
                             {**CHAT_STREAMS, **EXTRA_CHOICE_STREAMS})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return web.json_response(EMBEDDINGS[body["model"]](body["model"], len(inputs)))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        return app
