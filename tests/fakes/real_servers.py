"""Answers of the real vLLM, SGLang and Lemonade servers, byte for byte where it matters, chosen by
the served name a run asks for (its part before the first `@`, so that two providers of one model
can ask for the same behaviour under names of their own: `vllm-logprobs@a`, `vllm-logprobs@b`).

Where each answer comes from (the servers' own source, read for this; versions: vLLM 0.34.0 and
SGLang 0.5.23 as published on PyPI, Lemonade at its commit e385039ed):

- `vllm-logprobs`: a request vLLM's API server takes and its engine refuses when it adds it,
  `top_logprobs` over `--max-logprobs` (20 by default). `SamplingParams._validate_logprobs`
  (vllm/sampling_params.py:935-940) raises a `VLLMValidationError` with `parameter="logprobs"`
  from `AsyncLLM.add_request` (vllm/v1/engine/async_llm.py:411, via input_processor.py:149), which
  runs in the stream's first iteration, after the 200 went out: the stream generator
  (vllm/entrypoints/openai/chat_completion/serving.py:962-964) yields `create_error_response(e)`
  (vllm/entrypoints/serve/exception_handling/error_response.py:43-46: BadRequestError, 400, the
  parameter; the message with its `(parameter=…, value=…)` tail, vllm/exceptions.py:49-56), framed
  `data: …\\n\\n` and followed by `data: [DONE]` (serving.py:497-508). Whole, the same exception
  reaches the app's handler (register.py:32, handlers/exception.py:23-24): a 400 with that object.
- `vllm-abort`: a request vLLM aborted itself: its engine's shutdown at SIGTERM with the default
  `--shutdown-timeout 0` (vllm/v1/engine/core.py:1886-1903), `POST /sleep` (mode `abort` by
  default, serve/dev/sleep/api_router.py:30) or a pause. Its outputs end with finish_reason
  `abort` (vllm/v1/engine/__init__.py:37), passed on as it is: streamed, a last chunk whose delta
  is empty (chat_completion/serving.py:749-760, 805-822); whole, a 200 answer with that
  finish_reason (serving.py:1074, tool_calls_utils.py:53).
- `sglang-too-long`: a prompt the tokenizer manager lets through (only `>= context_len` is refused
  there, tokenizer_manager.py:1338) and the scheduler refuses (`>= max_req_input_len`, which is
  `min(context_len - 1, kv pool - 1) - 5`, tp_worker.py:568-572; managers/utils.py:272-287;
  scheduler.py:3246-3254: `set_finish_with_abort`, status 400). Streamed: the 200 went out with the
  first chunk, which is the abort's error (serving_chat.py:2568-2578: type the status's name,
  `create_streaming_error_response`, serving_base.py:223-237: the flat object under `error`,
  `json.dumps` spacing), then the usage chunk iop asked for and `data: [DONE]`
  (serving_chat.py:2765-2805). Whole, `_handle_abort_finish_reason` raises a ValueError
  (tokenizer_manager.py:1916-1918): a 400 in SGLang's flat error shape (serving_chat.py:2818-2819,
  serving_base.py:205-221).
- `lemonade-ctx`: a prompt over the loaded llama-server's context. llama-server answers 400
  (`exceed_context_size_error`, with `n_prompt_tokens` and `n_ctx`); Lemonade has already
  committed its stream's 200, so its streaming proxy sends that error object as an event with the
  backend's `status_code` added, and no `[DONE]` (src/cpp/server/streaming_proxy.cpp:217-247:
  "A backend's own error object carries no transport status, so adapters downstream would have
  to guess one"; nlohmann's JSON, keys sorted). Whole, the backend's status and
  `context_length_exceeded` (wrapped_server.cpp:114-149).
- `lemonade-pinned`: a model Lemonade cannot load because every loaded model of its pool is
  pinned (`max_loaded_models` reached): `SlotsPinnedException` (src/cpp/include/lemon/
  error_types.h:60-66, router.cpp:295-297), answered by `create_model_error` as 409
  `slots_pinned_error` (server.cpp:2385-2393, 222-226, 3726-3737). Another Lemonade may well
  serve the model.
- `base`, `my-lora`: SGLang's `/v1/models` with a LoRA adapter: the adapter listed by its own name,
  its base as `parent` (http_server.py:1993-2022). SGLang takes the adapter only as
  `base:adapter` in `model` (serving_base.py:40-59); the listed name alone runs the base model
  (`_resolve_lora_path`, serving_base.py:61-77: no `:`, no adapter).
- `sglang-total`: SGLang in front of a prompt of 30000 tokens, its context 32768: with no
  `max_tokens` it generates to the end of its context (the scheduler bounds `max_new_tokens` by
  what is left, scheduler.py:2693-2715); with one, the tokenizer manager refuses a total over
  the context (`validate_total_tokens`, always on: tokenizer_manager.py:606, 1353-1378), a 400
  (serving_chat.py:2818-2819).
- `sglang-total-052`: the same before SGLang 0.5.23: 0.5.2 refuses a total equal to its context too
  (`>= _max_req_len`, tokenizer_manager.py:467).
- `ok`: a plain answer, streamed or whole.
- `vllm-greedy`: vLLM asked for `n` > 1 at temperature 0: `SamplingParams.__post_init__` refuses it
  before any stream (sampling_params.py:619-624, `_verify_greedy_sampling` 773-777: a
  VLLMValidationError without parameter), a 400 `BadRequestError`.
- `vllm-notools`: a vLLM started without `--enable-auto-tool-choice`: a request with `tools` (its
  `tool_choice` then `auto`, chat_completion/protocol.py:990-993) is refused before any stream with a
  400 naming the flags (renderers/online_renderer.py:271-281, `create_error_response`: BadRequestError,
  no param). A request that fails validation (a content part of a type chat does not take) gets a
  400 that echoes the part, in the form of pydantic's validation error (`input_value=…`; the
  wording around it not vLLM's byte for byte).
- `sglang-queue-full`: SGLang with `--max-queued-requests` reached: its scheduler aborts the new
  request with 503 "The request queue is full." (managers/scheduler.py:3552-3586,
  `_abort_on_queued_limit`; the same status for `SGLANG_REQ_WAITING_TIMEOUT`, 3605-3621).
  Streamed: the abort is the stream's first chunk, so the 200 went out with it (serving_chat.py:
  2422-2439, the kick-start catches only a ValueError; 2568-2578: type the status's name), then
  the usage chunk iop asked for and `data: [DONE]` (2765-2805). Whole: `_handle_abort_finish_reason`
  raises an HTTPException for any status but 400 (tokenizer_manager.py:1916-1921), answered in
  SGLang's flat shape with the status as its type (serving_base.py:119-122, 205-221).
- `vllm-paused`: vLLM paused (`POST /pause`, mode `abort` or `wait`, its default `abort`): its engine
  refuses each new request with a retryable `RequestError` (v1/engine/core.py:2002-2020,
  `_reject_add_while_paused`, "Generation is paused. Please retry after it resumes."; 2455-2464),
  a `RetryableRequestError` (outputs.py:30-35; exceptions.py:139-144, 503). Streamed, after the 200:
  `except GenerationError` yields it with type `InternalServerError` and its 503
  (chat_completion/serving.py:958-961, framed at 497-508, then `data: [DONE]`). Whole: the app's
  handler answers 503 `ServiceUnavailableError` (exception_handling/error_response.py:60-67,
  handlers/vllm_error.py:361-369).
- `vllm-schema`: a `response_format` JSON schema vLLM's front end takes and xgrammar cannot
  (`validate_xgrammar_grammar`, v1/structured_output/backend_xgrammar.py:531-536, called by
  `SamplingParams.verify` from `AsyncLLM.add_request`, after the 200): a `VLLMValidationError`
  with no parameter, so the stream's error has `"param": null` and the 400 (error_response.py:
  43-46; chat_completion/serving.py:962-964), then `data: [DONE]`. Whole: the same 400.

`RealServers(asleep=True)` is a vLLM put to sleep (`POST /sleep`, or paused): its `/health` still
answers 200 (serve/instrumentator/health.py:22-33: only a dead engine is a 503) and its model list
is the same, but it takes requests and leaves them waiting until it is woken (v1/engine/core.py:
1100-1101: "Requests are still accepted but not processed"); `GET /is_sleeping` says so
(serve/dev/sleep/api_router.py:62-65, `{"is_sleeping": true}`; the engine's `is_sleeping` is true
when paused too, core.py:1202-1204), and `{"is_sleeping": false}` once woken (`asleep` is a
list of one: a test puts it to sleep and wakes it). `RealServers()` is one without
`VLLM_SERVER_DEV_MODE`, where that route is not mounted (launchers/api_server/routers.py:46-49):
`/is_sleeping` is vLLM's JSON 404 (exception_handling/handlers/http.py:24-31).

Calls are counted per served name (`calls`). It runs on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from aiohttp import web

from tests.fakes.serving import ThreadedServer

CALLS = web.AppKey("calls", Counter)
#: [asleep] of a vLLM in dev mode (`/is_sleeping` mounted), [] without it
ASLEEP = web.AppKey("asleep", list[bool])

#: vLLM: `str(VLLMValidationError(...))` of a `top_logprobs` of 25 with `--max-logprobs 20`
VLLM_LOGPROBS = {"error": {"message": "Requested sample logprobs of 25, which is greater than max allowed: 20 "
                                      "(parameter=logprobs, value=25)",
                           "type": "BadRequestError", "param": "logprobs", "code": 400}}
SGLANG_TOO_LONG = ("Input length (8183 tokens) exceeds the maximum allowed length (8181 tokens). "
                   "Use a shorter input or enable --allow-auto-truncate.")
#: SGLang's scheduler's abort of a request its waiting queue has no room for
SGLANG_QUEUE_FULL = "The request queue is full."
#: vLLM: a request its engine refuses while paused (a `RetryableRequestError`, 503)
VLLM_PAUSED = "Generation is paused. Please retry after it resumes."
#: vLLM started without tool parsing, asked with `tools`
VLLM_NO_TOOLS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
#: vLLM: `str(VLLMValidationError(...))` of a schema xgrammar does not take (no parameter: no tail)
VLLM_SCHEMA = "The provided JSON schema contains features not supported by xgrammar."
LEMONADE_CTX = {"error": {"code": 400, "message": "request (9000 tokens) exceeds the available context size "
                                                  "(8192 tokens), try increasing it",
                          "n_ctx": 8192, "n_prompt_tokens": 9000, "status_code": 400,
                          "type": "exceed_context_size_error"}}
LEMONADE_PINNED = {"error": {"code": "slots_pinned_error",
                             "message": "All loaded models of type standard/llm are pinned. Unload a model first.",
                             "param": "model", "requested_model": "Qwen3-4B-GGUF", "type": "slots_pinned_error"}}


def _compact(obj: object) -> bytes:
    """JSON as pydantic's `model_dump_json`, starlette's JSONResponse, orjson and nlohmann write it."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _chunk(model: str, choice: dict[str, object]) -> bytes:
    return b"data: " + _compact({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                                 "model": model, "choices": [choice]}) + b"\n\n"


def _usage_chunk(model: str) -> bytes:
    return b"data: " + _compact({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                                 "choices": [], "usage": {"prompt_tokens": 5, "total_tokens": 5,
                                                          "completion_tokens": 0}}) + b"\n\n"


def _whole(model: str, content: str, finish_reason: str) -> web.Response:
    return web.Response(body=_compact({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None,
                                             "annotations": None, "audio": None, "function_call": None,
                                             "tool_calls": [], "reasoning": None},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None, "token_ids": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 5, "total_tokens": 5 + len(content.split()),
                  "completion_tokens": len(content.split()), "prompt_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}),
        content_type="application/json")


async def _sglang_refusal(request: web.Request, served: str, stream: bool, status: int, message: str,
                          stream_type: str, whole_type: str) -> web.StreamResponse:
    """SGLang's refusal in its flat error shape: in a stream (after its 200) an error chunk of the
    status's name as `type`, then the usage chunk and `[DONE]`; whole, the answer with its status."""
    if stream:
        error = {"object": "error", "message": message, "type": stream_type, "param": None, "code": status}
        return await _events(request, f"data: {json.dumps({'error': error})}\n\n".encode(), _usage_chunk(served),
                             b"data: [DONE]\n\n")
    flat = {"object": "error", "message": message, "type": whole_type, "param": None, "code": status}
    return web.Response(status=status, body=_compact(flat), content_type="application/json")


async def _events(request: web.Request, *parts: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    names = ["ok", "asleep", "vllm-logprobs@a", "vllm-logprobs@b", "vllm-abort@a", "sglang-too-long@a",
             "sglang-too-long@b", "lemonade-ctx@a", "lemonade-pinned@a", "sglang-total@a", "sglang-total-052@a",
             "sglang-queue-full@a", "sglang-queue-full@b", "vllm-paused@a", "vllm-paused@b", "vllm-schema@a",
             "vllm-schema@b", "vllm-notools@a", "vllm-greedy@a"]
    cards = [{"id": n, "object": "model", "created": 1, "owned_by": "vllm", "root": n, "parent": None}
             for n in names]
    cards += [{"id": "base", "object": "model", "created": 1, "owned_by": "sglang", "root": "base", "parent": None,
               "max_model_len": 8192},
              {"id": "my-lora", "object": "model", "created": 1, "owned_by": "sglang", "root": "/loras/my-lora",
               "parent": "base", "max_model_len": None}]
    return web.Response(body=_compact({"object": "list", "data": cards}), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _is_sleeping(request: web.Request) -> web.Response:
    if request.app[ASLEEP]:  # (dev mode)
        return web.Response(body=_compact({"is_sleeping": request.app[ASLEEP][0]}), content_type="application/json")
    return web.Response(status=404, body=_compact({"error": {"message": "Not Found", "type": "Not Found",
                                                             "param": None, "code": 404}}),
                        content_type="application/json")


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    served = body["model"]
    request.app[CALLS][served] += 1
    if request.app[ASLEEP] == [True]:  # (held until woken: never, here)
        await asyncio.Event().wait()
    kind = served.split("@")[0]
    stream = bool(body.get("stream"))
    if kind == "vllm-logprobs":
        if stream:
            return await _events(request, b"data: " + _compact(VLLM_LOGPROBS) + b"\n\n", b"data: [DONE]\n\n")
        return web.Response(status=400, body=_compact(VLLM_LOGPROBS), content_type="application/json")
    if kind == "sglang-too-long":
        return await _sglang_refusal(request, served, stream, 400, SGLANG_TOO_LONG, "BAD_REQUEST", "BadRequestError")
    if kind == "sglang-queue-full":
        return await _sglang_refusal(request, served, stream, 503, SGLANG_QUEUE_FULL, "SERVICE_UNAVAILABLE", "503")
    if kind == "vllm-paused":
        if stream:
            paused = {"error": {"message": VLLM_PAUSED, "type": "InternalServerError", "param": None, "code": 503}}
            return await _events(request, b"data: " + _compact(paused) + b"\n\n", b"data: [DONE]\n\n")
        refusal = {"error": {"message": VLLM_PAUSED, "type": "ServiceUnavailableError", "param": None, "code": 503}}
        return web.Response(status=503, body=_compact(refusal), content_type="application/json")
    if kind == "vllm-schema":
        refused = {"error": {"message": VLLM_SCHEMA, "type": "BadRequestError", "param": None, "code": 400}}
        if stream:
            return await _events(request, b"data: " + _compact(refused) + b"\n\n", b"data: [DONE]\n\n")
        return web.Response(status=400, body=_compact(refused), content_type="application/json")
    parts = [part for message in body.get("messages") or [] if isinstance(message.get("content"), list)
             for part in message["content"]]
    if kind == "vllm-notools" and any(part.get("type") == "input_text" for part in parts):
        invalid = next(part for part in parts if part.get("type") == "input_text")
        echo = {"error": {"message": "1 validation error for ChatCompletionRequest\nmessages.0.content.list[...].0\n"
                                     "  Input tag 'input_text' found using 'type' does not match any of the expected "
                                     f"tags [type=union_tag_invalid, input_value={invalid!r}, input_type=dict]",
                          "type": "BadRequestError", "param": None, "code": 400}}
        return web.Response(status=400, body=_compact(echo), content_type="application/json")
    if kind == "vllm-notools" and body.get("tools"):
        notools = {"error": {"message": VLLM_NO_TOOLS, "type": "BadRequestError", "param": None, "code": 400}}
        return web.Response(status=400, body=_compact(notools), content_type="application/json")
    if kind == "vllm-greedy" and body.get("temperature") == 0 and (body.get("n") or 1) > 1:
        greedy = {"error": {"message": f"n must be 1 when using greedy sampling, got {body['n']}.",
                            "type": "BadRequestError", "param": None, "code": 400}}
        return web.Response(status=400, body=_compact(greedy), content_type="application/json")
    if kind == "lemonade-ctx":
        if stream:
            return await _events(request, b"data: " + _compact(LEMONADE_CTX) + b"\n\n")
        whole = {"error": {"code": "context_length_exceeded", "message": LEMONADE_CTX["error"]["message"],
                           "status_code": 400, "type": "invalid_request_error"}}
        return web.Response(status=400, body=_compact(whole), content_type="application/json")
    if kind in ("sglang-total", "sglang-total-052"):
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        # (SGLang 0.5.2 refuses a total equal to its context too: `>= _max_req_len`, tokenizer_manager.py:467)
        if asked is not None and 30000 + asked > 32768 - (kind == "sglang-total-052"):
            message = (f"Requested token count exceeds the model's maximum context length of 32768 tokens. You "
                       f"requested a total of {30000 + asked} tokens: 30000 tokens from the input messages and "
                       f"{asked} tokens for the completion. Please reduce the number of tokens in the input "
                       f"messages or the completion to fit within the limit.")
            flat = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.Response(status=400, body=_compact(flat), content_type="application/json")
        if stream:  # (the refusal above comes before any chunk: whole for a stream too, serving_chat.py:2422-2428)
            return await _events(
                request,
                _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
                _chunk(served, {"index": 0, "delta": {"content": "a long answer"}, "finish_reason": None}),
                _chunk(served, {"index": 0, "delta": {}, "finish_reason": "length"}),
                _usage_chunk(served), b"data: [DONE]\n\n")
        return _whole(served, "a long answer", "length")
    if kind == "lemonade-pinned":
        return web.Response(status=409, body=_compact(LEMONADE_PINNED), content_type="application/json")
    if kind == "vllm-abort":
        if stream:
            return await _events(
                request,
                _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}),
                _chunk(served, {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort",
                                "stop_reason": None, "token_ids": None, "weight_versions": None}),
                _usage_chunk(served), b"data: [DONE]\n\n")
        return _whole(served, "", "abort")
    # `ok`, and SGLang's base model or its adapter (`base:my-lora`); the adapter's name alone is the base
    content = "from the adapter" if served == "base:my-lora" else "from the base model" if kind in (
        "base", "my-lora") else "hello there"
    if stream:
        return await _events(
            request,
            _chunk(served, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
            _chunk(served, {"index": 0, "delta": {"content": content}, "finish_reason": None}),
            _chunk(served, {"index": 0, "delta": {}, "finish_reason": "stop"}),
            _usage_chunk(served), b"data: [DONE]\n\n")
    return _whole(served, content, "stop")


class RealServers(ThreadedServer):
    def __init__(self, asleep: bool | None = None) -> None:
        #: []: not in dev mode (no `/is_sleeping`); else [whether it is asleep], changed by tests
        self.asleep: list[bool] = [] if asleep is None else [asleep]
        super().__init__()
        self.calls: Counter[str] = Counter()

    def app(self) -> web.Application:
        app = web.Application()
        app[CALLS] = self.calls
        app[ASLEEP] = self.asleep
        app.router.add_get("/health", _health)
        app.router.add_get("/is_sleeping", _is_sleeping)
        app.router.add_get("/api/v1/health", _health)
        app.router.add_get("/v1/models", _models)
        app.router.add_get("/api/v1/models", _models)
        app.router.add_post("/v1/chat/completions", _chat)
        app.router.add_post("/api/v1/chat/completions", _chat)
        return app
