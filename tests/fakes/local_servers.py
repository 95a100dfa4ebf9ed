"""Answers of the real Ollama and llama.cpp's own `llama-server`, byte for byte where it matters, each
under a path of its own on one port (a provider's `base_url` names it: `…/ollama`, `…/single-a`,
`…/router`), so that one test pool holds several servers.

Where each answer comes from (the servers' own source, read for this; versions: Ollama at
v0.33.0-rc2, commit fb3076099; llama-server at llama.cpp commit 0c1e57098, the source vendored in
the llama-cpp-python 0.3.36 sdist, `tools/server/`):

Ollama (`/ollama`):
- `repeat`: a generation Ollama stops itself. Its runner (llama-server since Ollama 0.30: "runner:
  Remove CGO engines, use llama-server exclusively") is read by `llamaServerRunner.Completion`,
  which returns nil, no error and no last response, when the same token (whitespace trimmed) came
  31 times in a row (llm/llama_server.go:1692-1703, `return ctx.Err()` with the context alive; the
  same guard was in llm/server.go before, v0.12.0 among them), and likewise when llama-server's
  stream ends on an error event, which its `llamaServerCompletionResponse` has no field for
  (llama_server.go:1469-1475). The handler's channel then closes with no `done` response
  (server/routes.go:2746-2938): streamed, the lines already sent and a body that ends whole
  (`streamResponse`, routes.go:2097-2140: gin ends the chunked body); whole, the last partial with
  the text gathered and `"done": false`, a 200 (`writeChatResponse`, routes.go:2387-2433). Go's
  `json.Marshal` of `api.ChatResponse` (api/types.go:520-564: `done_reason` and the counts
  omitted when empty).
- `ok`: a whole answer, streamed or not, `done_reason: "stop"`.
- `GET /api/tags`: what it has (server/routes.go `ListHandler`).

llama-server, one model (`/single-a`, `/single-b`: two servers started alike, `-a
qwen3-8b,chat-default -c 64 --parallel 2`):
- `GET /health`: `{"status":"ok"}` (server-context.cpp:4635-4646).
- `GET /v1/models`: the model under one name, the smallest of its aliases (they are a
  `std::set`: common/common.h:509, common/arg.cpp:3010-3020; server-context.cpp:1353-1365), and
  every alias under `aliases` (server-context.cpp:4524-4578; nlohmann's JSON, keys sorted). It
  takes a request under any name (it does not read `model` to pick one).
- `POST /v1/completions` with a list of prompts, one over its context (64 tokens; a token a word
  here): each prompt is a task of its own (server-context.cpp:4290-4323); with `--parallel 2` both
  start in one step, the first prompt's slot sends the event that makes the HTTP side send its
  200 (server-context.cpp:3397-3406, a `text_completion` chunk with `"text": ""`), and the second's
  size check fails after it (server-context.cpp:3186-3194: `exceed_context_size_error`, 400,
  with `n_prompt_tokens` and `n_ctx`, server-task.cpp:1501-1508, server-common.cpp:36-78). An error
  after the first result is sent as `data: {"error": …}` and ends the stream, no `[DONE]`
  (server-context.cpp:4470-4474, 4396-4405; only a first result that is an error is answered
  whole, 4371-4374). Whole, the same error is the answer, its `code` the
  status (server-context.cpp:4330-4338, 4224-4227): a 400.
- `n` over its `--parallel`: a 400 (`n_cmpl`, alias `n`, has hard limits 1 to `n_parallel`,
  server-schema.cpp:62-65; a value outside them throws, 580-605, and the request's task is not
  made: server-context.cpp:4296, 4324-4327).
- anything else: a plain answer.

llama-server in router mode (`/router`, `--models-dir`): `GET /v1/models` lists what it has, each
with its `status` (server-models.cpp:2021-2096); a run for a model it does not have (deleted with
`DELETE /models?model=…`, server-models.cpp:2181-2193, or gone from its presets at a `?reload`) is
a 400 `model '…' not found` (`router_validate_model`, server-models.cpp:1859-1868, `res_err`
1854-1857). `remove(name)` (`LocalServers.router_models`) is that deletion.

Calls are counted per (path, served name) (`calls`). It runs on its own event loop in a thread."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from aiohttp import web

from tests.fakes.serving import ThreadedServer

Json = dict[str, Any]

CALLS = web.AppKey("calls", Counter)
NAME = web.AppKey("name", str)
ROUTER_MODELS = web.AppKey("router_models", list[str])

#: the names llama-server is given with `-a qwen3-8b,chat-default`: it lists the smallest as the id
ALIASES = ["chat-default", "qwen3-8b"]
#: its context (`-c 64`)
N_CTX = 64
#: its slots (`--parallel 2`): the most choices `n` may ask for
PARALLEL = 2
CREATED_AT = "2026-08-21T18:48:22.123456789Z"
FINGERPRINT = "b1-0c1e570"


def _nlohmann(obj: Any) -> bytes:
    """JSON as llama-server writes it (nlohmann's `dump()`: compact, object keys sorted)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def _go(obj: Any) -> bytes:
    """JSON as Go's `json.Marshal` writes it (compact, fields in their struct's order)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def _chunked(request: web.Request, content_type: str, *parts: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    await resp.write_eof()
    return resp


# ------------------------------------------------------------------ Ollama

def _ollama_line(model: str, content: str, done: bool = False, **extra: Any) -> Json:
    line: Json = {"model": model, "created_at": CREATED_AT, "message": {"role": "assistant", "content": content},
                  "done": done}
    line.update(extra)
    return line


async def _ollama_tags(request: web.Request) -> web.Response:
    models = [{"name": n, "model": n, "modified_at": "2026-08-01T10:00:00.000000000Z", "size": 91739413,
               "digest": "9077fe9d2ae1a4a41a868836b56b8163731a8fe16621397028c2c76f838c6907",
               "details": {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                           "parameter_size": "134.52M", "quantization_level": "Q4_1"}}
              for n in ("repeat:latest", "ok:latest", "notools:latest")]
    return web.Response(body=_go({"models": models}), content_type="application/json")


async def _ollama_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model = body["model"]
    request.app[CALLS][model] += 1
    stream = body.get("stream", True) is not False
    if model == "notools" and body.get("tools"):
        # a model whose template has no tools: server/routes.go:211-212 (`"%s %w"`, the model's name and
        # images.go:43-45's "does not support" "tools"), answered 400 by handleScheduleError (:3109-3110)
        return web.Response(status=400, body=_go({"error": f"{model} does not support tools"}),
                            content_type="application/json", charset="utf-8")
    if model == "repeat":
        # the tokens before the guard stopped it: a word, then whitespace until the 31st repeat
        tokens = ["Sure"] + [" "] * 31
        if stream:
            return await _chunked(request, "application/x-ndjson",
                                  *(_go(_ollama_line(model, t)) + b"\n" for t in tokens))
        return web.Response(body=_go(_ollama_line(model, "".join(tokens))), content_type="application/json",
                            charset="utf-8")
    done = _ollama_line(model, "", True, done_reason="stop", total_duration=51234567, load_duration=1234567,
                        prompt_eval_count=12, prompt_eval_duration=2345678, eval_count=2, eval_duration=3456789)
    if stream:
        return await _chunked(request, "application/x-ndjson", _go(_ollama_line(model, "hello")) + b"\n",
                              _go(_ollama_line(model, " there")) + b"\n", _go(done) + b"\n")
    done["message"]["content"] = "hello there"
    return web.Response(body=_go(done), content_type="application/json", charset="utf-8")


# ------------------------------------------------------------------ llama-server

def _error(message: str, kind: str, code: int, **extra: Any) -> Json:
    return {"code": code, "message": message, "type": kind, **extra}


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=_nlohmann({"status": "ok"}), content_type="application/json", charset="utf-8")


async def _single_models(request: web.Request) -> web.Response:
    name = ALIASES[0]  # (the set's first)
    card = {"id": name, "aliases": ALIASES, "tags": [], "object": "model", "created": 1790833449,
            "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx": N_CTX, "n_ctx_train": 8192, "n_embd": 576,
                     "n_params": 134515008, "size": 91739413, "ftype": "Q4_1"}}
    ollama_card = {"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                   "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                   "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                               "parameter_size": "", "quantization_level": ""}}
    return web.Response(body=_nlohmann({"models": [ollama_card], "object": "list", "data": [card]}),
                        content_type="application/json", charset="utf-8")


def _sse(obj: Any) -> bytes:
    return b"data: " + _nlohmann(obj) + b"\n\n"


def _chat_chunk(delta: Json, finish_reason: str | None = None) -> Json:
    return {"choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta}], "created": 1790833449,
            "id": "chatcmpl-Qx7rTq2Lb1", "model": ALIASES[0], "system_fingerprint": FINGERPRINT,
            "object": "chat.completion.chunk"}


async def _plain_chat(request: web.Request, body: Json, model: str) -> web.StreamResponse:
    usage = {"completion_tokens": 2, "prompt_tokens": 12, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 0}}
    if body.get("stream"):
        parts = [_sse(_chat_chunk({"role": "assistant", "content": None})),
                 _sse(_chat_chunk({"content": "hello"})), _sse(_chat_chunk({"content": " there"})),
                 _sse(_chat_chunk({}, "stop"))]
        if isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"):
            parts.append(_sse({**_chat_chunk({}), "choices": [], "usage": usage}))
        return await _chunked(request, "text/event-stream", *parts, b"data: [DONE]\n\n")
    answer = {"choices": [{"finish_reason": "stop", "index": 0,
                           "message": {"role": "assistant", "content": "hello there"}}],
              "created": 1790833449, "model": model, "system_fingerprint": FINGERPRINT,
              "object": "chat.completion", "usage": usage, "id": "chatcmpl-Qx7rTq2Lb1"}
    return web.Response(body=_nlohmann(answer), content_type="application/json", charset="utf-8")


async def _single_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[CALLS][body.get("model")] += 1
    n = body.get("n")
    if isinstance(n, int) and not 1 <= n <= PARALLEL:
        return web.Response(status=400, body=_nlohmann({"error": _error(
            f"Field 'n': Value must be between 1 <= value <= {PARALLEL}, but got {n}", "invalid_request_error",
            400)}), content_type="application/json", charset="utf-8")
    return await _plain_chat(request, body, ALIASES[0])


async def _single_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[CALLS][body.get("model")] += 1
    prompts = body["prompt"] if isinstance(body.get("prompt"), list) else [body.get("prompt")]
    sizes = [len(str(p).split()) + 1 for p in prompts]  # (a token a word, and the BOS)
    over = next((i for i, n in enumerate(sizes) if n >= N_CTX), None)
    if over is not None:
        error = _error(f"request ({sizes[over]} tokens) exceeds the available context size ({N_CTX} tokens), "
                       "try increasing it", "exceed_context_size_error", 400, n_prompt_tokens=sizes[over], n_ctx=N_CTX)
        if body.get("stream") and over > 0:
            begin = {"choices": [{"finish_reason": None, "index": 0, "logprobs": None, "text": ""}],
                     "created": 1790833449, "id": "chatcmpl-Qx7rTq2Lb1", "model": ALIASES[0],
                     "object": "text_completion", "system_fingerprint": FINGERPRINT}
            return await _chunked(request, "text/event-stream", _sse(begin), _sse({"error": error}))
        return web.Response(status=400, body=_nlohmann({"error": error}), content_type="application/json",
                            charset="utf-8")
    choices = [{"finish_reason": "stop", "index": i, "logprobs": None, "text": " hello"} for i in range(len(prompts))]
    answer = {"choices": choices, "created": 1790833449, "model": ALIASES[0], "system_fingerprint": FINGERPRINT,
              "object": "text_completion", "usage": {"completion_tokens": 1, "prompt_tokens": sizes[0],
                                                     "total_tokens": sizes[0] + 1},
              "id": "chatcmpl-Qx7rTq2Lb1"}
    if body.get("stream"):
        chunks = [{**answer, "choices": [c]} for c in choices]
        return await _chunked(request, "text/event-stream", *map(_sse, chunks), b"data: [DONE]\n\n")
    return web.Response(body=_nlohmann(answer), content_type="application/json", charset="utf-8")


async def _router_models(request: web.Request) -> web.Response:
    cards = [{"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
              "created": 1790833449, "status": {"value": "loaded", "args": ["llama-server", "--port", "39211"]},
              "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
              "source": "cache", "can_remove": True}
             for name in request.app[ROUTER_MODELS]]
    return web.Response(body=_nlohmann({"data": cards, "object": "list"}), content_type="application/json",
                        charset="utf-8")


async def _router_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    name = body.get("model") or ""
    request.app[CALLS][name] += 1
    if name not in request.app[ROUTER_MODELS]:
        return web.Response(status=400, body=_nlohmann({"error": _error(
            f"model '{name}' not found", "invalid_request_error", 400)}), content_type="application/json",
            charset="utf-8")
    return await _plain_chat(request, body, name)


class LocalServers(ThreadedServer):
    def __init__(self) -> None:
        super().__init__()
        #: (server path, served name) -> calls
        self.calls: dict[str, Counter[str]] = {}
        #: what the router has (a test deletes one, as `DELETE /models?model=…` does)
        self.router_models: list[str] = ["router-ok", "router-gone"]

    def _app(self, name: str) -> web.Application:
        app = web.Application()
        app[NAME] = name
        app[CALLS] = self.calls.setdefault(name, Counter())
        if name == "ollama":
            app.router.add_get("/api/tags", _ollama_tags)
            app.router.add_post("/api/chat", _ollama_chat)
        elif name == "router":
            app[ROUTER_MODELS] = self.router_models
            app.router.add_get("/health", _health)
            app.router.add_get("/v1/models", _router_models)
            app.router.add_post("/v1/chat/completions", _router_chat)
        else:
            app.router.add_get("/health", _health)
            app.router.add_get("/v1/models", _single_models)
            app.router.add_post("/v1/chat/completions", _single_chat)
            app.router.add_post("/v1/completions", _single_completions)
        return app

    def app(self) -> web.Application:
        root = web.Application()
        for name in ("ollama", "single-a", "single-b", "router"):
            root.add_subapp(f"/{name}", self._app(name))
        return root
