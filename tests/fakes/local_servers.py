"""Answers of the real Ollama and llama.cpp's own `llama-server`, byte for byte where it matters, each
under a path of its own on one port (a provider's `base_url` names it: `…/ollama`, `…/single-a`,
`…/router`, `…/router-manual`), so that one test pool holds several servers.

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
- `slow`: a generation that takes longer than a provider's `read_timeout_ms` in all, a token at a time.
  Streamed, each line goes out as its token comes (`streamResponse`, routes.go:2097-2140); whole,
  nothing, its head included, until the last, then the answer (`writeChatResponse`, routes.go:2387-2433,
  gathers every response of the channel first).
- `cold`: a model not loaded yet, which takes `OLLAMA_LOAD_S` to load. Ollama sends nothing, not even
  its head, until the model is loaded and the first line is out (`streamResponse` writes the head
  with the first line, routes.go:2097-2140; whole, `c.JSON` at the end, 2387-2433), and a client
  that leaves meanwhile aborts the load ("client connection closed before llama-server finished
  loading, aborting load", llm/llama_server.go:1298-1302, the runner expired, server/sched.go:731-737):
  the next request loads it from the start (`loads`: started, aborted, loaded).
- any model: an option of the wrong type (`options`, or a field iop maps into them, such as
  `temperature`) is refused by `Options.FromMap` (api/types.go:991-1090: `option "x" must be of type
  float32`), an error `scheduleRunner` returns (server/routes.go:217-220) and `handleScheduleError`
  answers 500, its default (routes.go:3107-3119), before any line.
- any model, asked with `"truncate": false` for a prompt over the context (`N_CTX`, a token a word): Ollama
  leaves the prompt whole (`completionPrompt`'s caller, llm/llama_server.go:280-282) and llama-server
  refuses it (400 `exceed_context_size_error`, as `/single-a` does); Ollama passes that answer on as the
  text of its own error (`statusErrorMessage`, llama_server.go:1648-1655, 1782-1794), with its status,
  before any line (server/routes.go:2927-2932, 2097-2140).
- `cloud-signed-out`, `cloud-disabled`, `cloud-not-here`: cloud models (pulled, a manifest naming a
  remote host: `/api/tags` lists them as it lists the others), which this Ollama cannot run: it is not
  signed in to ollama.com, whose 401 it passes on as `{"error":"unauthorized","signin_url":…}`
  (server/routes.go:2583-2597, api/client.go:239-243); cloud is disabled (`OLLAMA_NO_CLOUD`), a 403
  (routes.go:2518-2522, internal/cloud/policy.go:7-25, `cloudErrRemoteInferenceUnavailable` routes.go:59);
  the remote host is not in `OLLAMA_REMOTES`, a 400 (routes.go:2531-2535). Each before any line.
- `POST /api/embed` (`EmbedHandler`, server/routes.go:795-1024): an empty `input` (`""`) is no input
  (823-826), answered once the model is loaded with a 200 and no embeddings (862-865). Every error of
  an input's embedding that is no `api.StatusError` is answered 400 (1000-1014), whatever it is: the
  runner's own failures among them (`llamaServerRunner.Embedding`, llm/llama_server.go:2338-2433), a
  runner that died while it embedded (`embed-dead`: `do embedding request: Post "…": EOF`, 2371, the
  error of Go's HTTP client), one gone before it (`getServerStatus`, 1192-1198: its process exited), or
  one that cannot tokenize (Go's `Post "…"` error, or `tokenize error: …`, 2515). An input over the
  context with `"truncate": false` is its 400 too (`the input length exceeds the context length`,
  933-941), the caller's. Else `embed-ok` embeds each input, `prompt_eval_count` its words.
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

llama-server in router mode (`/router`, `--models-dir`; `/router-manual`, the same started with
`--no-models-autoload`, common/arg.cpp:3663-3669), each a `Router` (`LocalServers.routers`):
- `GET /v1/models` (and `/models`, server.cpp:256-257) lists what it has, each card with its `status`
  (server-models.cpp:2021-2096): `{"args": [...], "preset": "[name]\nmodel = …\n\n", "value": …}`, the
  value one of `server_model_status_to_string`'s (server-models.h:52-62: `unloaded`, `loading`,
  `loaded`, `sleeping`, …); a card of a running model has the child's own keys merged in (`meta`,
  server-models.cpp:2083-2090, the child's `get_res_model_info`, server-context.cpp:4524-4545).
- `GET /props` without `?model=`: the router's own (server-models.cpp:1931-1956: `role` `router`,
  `models_autoload`, …); with it, the model's server's, validated as a run is (1958-1970).
- a run (`POST /v1/chat/completions`) is validated by `router_validate_model` (server-models.cpp:
  1859-1876, answered by `res_err`, 1854-1857, a 400): a model it does not have (deleted with
  `DELETE /models?model=…`, 2181-2193, or gone from its presets at a `?reload`) is `model '…' not
  found`; one it has that is not running (`is_running`: loaded, loading or sleeping, server-models.h:
  94-96) is `model is not loaded` when it loads none on its own (`is_autoload`, 1878-1885: the flag,
  or the request's `?autoload=`), else it is loaded first (`ensure_model_ready`, 1430-1547). A model
  still loading is proxied to its server, which answers 503 `Loading model` until it is ready
  (server-http.cpp:307-324).
- `POST /models/load` (server-models.cpp:2003-2019): 404 `model is not found` for a model it does not
  have, 400 `model is already running`, else `{"success":true}` at once, the model `loading`
  (`load`, 1144) until its server says it is ready (`loaded`, 1652-1660): here after `LOAD_S`.
  `POST /models/unload` (2097-2113) is the way back.
`Router.remove(name)` is that deletion.

Calls are counted per (path, served name) (`calls`), and a server's `GET`s per path there too
(`GET /props`). It runs on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from aiohttp import web

from tests.fakes.serving import ThreadedServer

Json = dict[str, Any]

CALLS = web.AppKey("calls", Counter)
#: Ollama's loads of `cold`: "started", "aborted" (its client left), "loaded"
LOADS = web.AppKey("loads", Counter)
NAME = web.AppKey("name", str)

#: the names llama-server is given with `-a qwen3-8b,chat-default`: it lists the smallest as the id
ALIASES = ["chat-default", "qwen3-8b"]
#: its context (`-c 64`)
N_CTX = 64
#: its slots (`--parallel 2`): the most choices `n` may ask for
PARALLEL = 2
CREATED_AT = "2026-08-21T18:48:22.123456789Z"
FINGERPRINT = "b1-0c1e570"
#: Ollama's answers to a run of a cloud model it cannot run (status, body), by the served name
CLOUD: dict[str, tuple[int, Json]] = {
    "cloud-signed-out": (401, {"error": "unauthorized",
                               "signin_url": "https://ollama.com/connect?name=box-2&key=c3NoLWVkMjU1MTkgQUFBQQ"}),
    "cloud-disabled": (403, {"error": "ollama cloud is disabled: remote model is unavailable"}),
    "cloud-not-here": (400, {"error": "this server cannot run this remote model"}),
}
#: how long Ollama takes to load the model `cold`
OLLAMA_LOAD_S = 1.5
#: the model `slow`: its tokens, and the time each takes
SLOW_LINES = 8
SLOW_GAP_S = 0.25
#: how long a router's model takes to load (`POST /models/load` to its server saying it is ready)
LOAD_S = 0.05


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
              for n in ("repeat:latest", "ok:latest", "notools:latest", "cold:latest", "slow:latest", *EMBED,
                        *CLOUD)]
    return web.Response(body=_go({"models": models}), content_type="application/json")


#: Ollama's options by the kind of their field in `api.Options` (api/types.go:568-596)
OLLAMA_INTEGERS = frozenset({"num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch",
                             "num_gpu", "main_gpu", "num_thread", "draft_num_predict"})
OLLAMA_FLOATS = frozenset({"top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                           "frequency_penalty"})


def _ollama_option_refused(options: Any) -> str | None:
    """What `Options.FromMap` says of the first option of the wrong type (None: none is); unknown ones
    it only logs. (JSON numbers are Go's float64, which its integer fields take too.)"""
    for key, value in (options or {}).items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None:
            continue
        if key in OLLAMA_INTEGERS and not number:
            return f'option "{key}" must be of type integer'
        if key in OLLAMA_FLOATS and not number:
            return f'option "{key}" must be of type float32'
        if key == "use_mmap" and not isinstance(value, bool):
            return f'option "{key}" must be of type boolean'
        if key == "stop" and not isinstance(value, list):
            return f'option "{key}" must be of type array'
    return None


async def _ollama_chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model = body["model"]
    request.app[CALLS][model] += 1
    if model in CLOUD:
        status, answer = CLOUD[model]
        return web.Response(status=status, body=_go(answer), content_type="application/json", charset="utf-8")
    refused = _ollama_option_refused(body.get("options"))
    if refused is not None:
        return web.Response(status=500, body=_go({"error": refused}), content_type="application/json",
                            charset="utf-8")
    size = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) + 1
    if body.get("truncate") is False and size >= N_CTX:
        error = _error(f"request ({size} tokens) exceeds the available context size ({N_CTX} tokens), try "
                       "increasing it", "exceed_context_size_error", 400, n_prompt_tokens=size, n_ctx=N_CTX)
        return web.Response(status=400, body=_go({"error": _nlohmann({"error": error}).decode()}),
                            content_type="application/json", charset="utf-8")
    stream = body.get("stream", True) is not False
    if model == "notools" and body.get("tools"):
        # a model whose template has no tools: server/routes.go:211-212 (`"%s %w"`, the model's name and
        # images.go:43-45's "does not support" "tools"), answered 400 by handleScheduleError (:3109-3110)
        return web.Response(status=400, body=_go({"error": f"{model} does not support tools"}),
                            content_type="application/json", charset="utf-8")
    loads = request.app[LOADS]
    if model == "cold" and not loads["loaded"]:
        loads["started"] += 1
        try:
            await asyncio.sleep(OLLAMA_LOAD_S)  # (the load: nothing goes out meanwhile)
        except asyncio.CancelledError:  # (the client left: Ollama aborts the load)
            loads["aborted"] += 1
            raise
        loads["loaded"] += 1
    if model == "slow":
        # a generation of `SLOW_LINES` tokens, one every `SLOW_GAP_S`: streamed, each line as it comes;
        # whole, nothing (its head included) until the last, then the answer with every token's text
        tokens = [f"t{i} " for i in range(SLOW_LINES)]
        done = _ollama_line(model, "", True, done_reason="stop", prompt_eval_count=12, eval_count=SLOW_LINES)
        if not stream:
            await asyncio.sleep(SLOW_GAP_S * SLOW_LINES)
            done["message"]["content"] = "".join(tokens)
            return web.Response(body=_go(done), content_type="application/json", charset="utf-8")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        for i, token in enumerate(tokens):
            await asyncio.sleep(SLOW_GAP_S)
            if i == 0:
                await resp.prepare(request)
            await resp.write(_go(_ollama_line(model, token)) + b"\n")
        await resp.write(_go(done) + b"\n")
        await resp.write_eof()
        return resp
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


#: Ollama's embedding models: `embed-dead`'s runner dies while it embeds, `embed-ok`'s embeds
EMBED = ("embed-dead", "embed-ok")
#: the runner's port, in the error of Go's HTTP client that Ollama passes on
RUNNER_PORT = 40123


async def _ollama_embed(request: web.Request) -> web.Response:
    body = await request.json()
    model, given = body["model"], body.get("input")
    request.app[CALLS][model] += 1
    inputs = [given] if isinstance(given, str) and given else given if isinstance(given, list) else []
    if not inputs:
        return web.Response(body=_go({"model": model, "embeddings": []}), content_type="application/json",
                            charset="utf-8")
    if body.get("truncate") is False and any(len(text.split()) + 1 > N_CTX for text in inputs):
        return web.Response(status=400, body=_go({"error": "the input length exceeds the context length"}),
                            content_type="application/json", charset="utf-8")
    if model == "embed-dead":
        error = f'do embedding request: Post "http://127.0.0.1:{RUNNER_PORT}/v1/embeddings": EOF'
        return web.Response(status=400, body=_go({"error": error}), content_type="application/json",
                            charset="utf-8")
    answer = {"model": model, "embeddings": [[0.6, 0.8] for _ in inputs], "total_duration": 1234567,
              "load_duration": 12345, "prompt_eval_count": sum(len(text.split()) for text in inputs)}
    return web.Response(body=_go(answer), content_type="application/json", charset="utf-8")


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


class Router:
    """What a llama-server router has: each model's `status.value`, and whether it loads a model a
    run names (`--models-autoload`, its default) or not (`--no-models-autoload`)."""

    def __init__(self, models: dict[str, str], autoload: bool = True, source: str = "cache") -> None:
        #: served name -> status value (`unloaded`, `loading`, `loaded`, `sleeping`)
        self.models = models
        self.autoload = autoload
        #: where its models come from: `cache` (the only ones `DELETE /models` removes), `models_dir`
        self.source = source
        #: the status its own `GET /props` answers with (a test's: 200 is the router's)
        self.props_status = 200

    def remove(self, name: str) -> None:
        """`DELETE /models?model=…`."""
        del self.models[name]

    def running(self, name: str) -> bool:
        return self.models[name] in ("loaded", "loading", "sleeping")

    def card(self, name: str) -> Json:
        port = "39211" if self.running(name) else "0"  # (a port is given when its server is started)
        status: Json = {"value": self.models[name], "args": ["llama-server", "--host", "127.0.0.1", "--model",
                                                             f"/models/{name}.gguf", "--port", port, "--alias", name],
                        "preset": f"[{name}]\nmodel = /models/{name}.gguf\n\n"}
        card: Json = {"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
                      "created": 1790833449, "status": status,
                      "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                      "source": self.source, "can_remove": self.source == "cache"}
        if self.running(name):  # (the child's own card's keys the router's lacks)
            card["meta"] = {"vocab_type": 2, "n_vocab": 49152, "n_ctx": N_CTX, "n_ctx_train": 8192, "n_embd": 576,
                            "n_params": 134515008, "size": 91739413, "ftype": "Q4_1"}
        return card

    def refusal(self, name: str, autoload: bool) -> web.Response | None:
        """`router_validate_model`'s 400, or None (the model loaded first if it may be)."""
        if not name:
            return _router_error("model name is missing from the request", "invalid_request_error", 400)
        if name not in self.models:
            return _router_error(f"model '{name}' not found", "invalid_request_error", 400)
        if not self.running(name):
            if not autoload:
                return _router_error("model is not loaded", "invalid_request_error", 400)
            self.models[name] = "loaded"  # (`ensure_model_ready`: the request waits for the load)
        return None

    def autoloads(self, request: web.Request) -> bool:
        asked = request.query.get("autoload", "")
        return self.autoload if not asked else asked in ("true", "1")


ROUTER = web.AppKey("router", Router)


def _router_error(message: str, kind: str, code: int) -> web.Response:
    return web.Response(status=code, body=_nlohmann({"error": _error(message, kind, code)}),
                        content_type="application/json", charset="utf-8")


def _json(obj: Any) -> web.Response:
    return web.Response(body=_nlohmann(obj), content_type="application/json", charset="utf-8")


async def _router_models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return _json({"data": [router.card(name) for name in list(router.models)], "object": "list"})


async def _router_props(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = request.query.get("model", "")
    if name:
        refused = router.refusal(name, router.autoloads(request))
        if refused is not None:
            return refused
        if router.models[name] == "loading":
            return _router_error("Loading model", "unavailable_error", 503)
        return _json({"model_alias": name, "model_path": f"/models/{name}.gguf", "build_info": FINGERPRINT})
    if router.props_status != 200:
        return _router_error("the test's error", "server_error", router.props_status)
    return _json({"role": "router", "max_instances": 4, "models_autoload": router.autoload,
                  "model_alias": "llama-server", "model_path": "none",
                  "default_generation_settings": {"params": {}, "n_ctx": 0}, "ui_settings": {},
                  "build_info": FINGERPRINT, "cors_proxy_enabled": False})


async def _router_chat(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    body = await request.json()
    name = body.get("model") or ""
    request.app[CALLS][name] += 1
    refused = router.refusal(name, router.autoloads(request))
    if refused is not None:
        return refused
    if router.models[name] == "loading":  # (its server answers nothing else until it is ready)
        return _router_error("Loading model", "unavailable_error", 503)
    if router.models[name] == "sleeping":  # (a request wakes it)
        router.models[name] = "loaded"
    return await _plain_chat(request, body, name)


async def _router_load(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = (await request.json()).get("model") or ""
    if name not in router.models:
        return _router_error("model is not found", "not_found_error", 404)
    if router.running(name):
        return _router_error("model is already running", "invalid_request_error", 400)
    router.models[name] = "loading"

    def ready() -> None:
        if router.models.get(name) == "loading":
            router.models[name] = "loaded"

    asyncio.get_running_loop().call_later(LOAD_S, ready)
    return _json({"success": True})


async def _router_unload(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = (await request.json()).get("model") or ""
    if name not in router.models:
        return _router_error("model is not found", "invalid_request_error", 400)
    if not router.running(name):
        return _router_error("model is not running", "invalid_request_error", 400)
    router.models[name] = "unloaded"
    return _json({"success": True})


@web.middleware
async def _count_gets(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.method == "GET":
        request.app[CALLS]["GET " + request.path.removeprefix("/" + request.app[NAME])] += 1
    response: web.StreamResponse = await handler(request)
    return response


class LocalServers(ThreadedServer):
    def __init__(self) -> None:
        super().__init__()
        #: (server path, served name) -> calls
        self.calls: dict[str, Counter[str]] = {}
        #: Ollama's loads of `cold` (`LOADS`)
        self.loads: Counter[str] = Counter()
        #: the routers, by server path: what each has (a test deletes one, as `DELETE /models?model=…`
        #: does), and whether it loads a model on its own
        self.routers: dict[str, Router] = {
            "router": Router({"router-ok": "loaded", "router-gone": "loaded"}),
            "router-manual": Router({"router-warm": "loaded", "router-cold": "unloaded", "router-asleep": "sleeping"},
                                    autoload=False, source="models_dir"),
        }

    def _app(self, name: str) -> web.Application:
        app = web.Application(middlewares=[_count_gets])
        app[NAME] = name
        app[CALLS] = self.calls.setdefault(name, Counter())
        if name == "ollama":
            app[LOADS] = self.loads
            app.router.add_get("/api/tags", _ollama_tags)
            app.router.add_post("/api/chat", _ollama_chat)
            app.router.add_post("/api/embed", _ollama_embed)
        elif name in self.routers:
            app[ROUTER] = self.routers[name]
            app.router.add_get("/health", _health)
            app.router.add_get("/props", _router_props)
            app.router.add_get("/models", _router_models)
            app.router.add_get("/v1/models", _router_models)
            app.router.add_post("/v1/chat/completions", _router_chat)
            app.router.add_post("/models/load", _router_load)
            app.router.add_post("/models/unload", _router_unload)
        else:
            app.router.add_get("/health", _health)
            app.router.add_get("/v1/models", _single_models)
            app.router.add_post("/v1/chat/completions", _single_chat)
            app.router.add_post("/v1/completions", _single_completions)
        return app

    def app(self) -> web.Application:
        root = web.Application()
        for name in ("ollama", "single-a", "single-b", *self.routers):
            root.add_subapp(f"/{name}", self._app(name))
        return root
