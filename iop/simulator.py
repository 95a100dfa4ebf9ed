"""OpenAI-compatible fake LLM server ("simulator") for demos, tests and benchmarks.

It serves ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` with
deterministic output (``"tok0 tok1 ..."``), configurable latency (time to first token, inter-token
latency) and injected failures, plus ``/stats`` to observe what a gateway actually sent it.

A request body may carry an object field ``"sim"`` overriding options for that request only:
``ttft_ms``, ``itl_ms``, ``tokens``, ``fail_rate``, ``fail_status``, ``fail_retry_after`` and
``fail_after_tokens``. Giving ``fail_status`` there makes that request fail with that status (and
the ``Retry-After`` header ``fail_retry_after``, when given, as a busy server's 429 or 503 has).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import signal
import ssl
import struct
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from aiohttp import web
from aiohttp.typedefs import Handler

from common.listening import cannot_listen
from iop.sim_schema import response_format_text, tokens_of, tool_arguments

JsonObject = dict[str, Any]

OWNER = "iop-simulator"
API_ROOTS = ("/v1", "/api/v1")
EMBEDDING_DIMS = 8
MAX_RECORDS = 100_000  # per-request records kept by /stats (counters stay exact beyond this)
SHUTDOWN_TIMEOUT_S = 0.5  # grace for in-flight requests on stop (aiohttp may wait twice this)


def _require(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 0
    models: tuple[str, ...] = ("sim-model",)
    ttft_ms: float = 0
    itl_ms: float = 0
    tokens: int = 16
    fail_rate: float = 0.0
    fail_status: int = 500
    #: the `Retry-After` header of an injected error (none when None)
    fail_retry_after: str | None = None
    fail_after_tokens: int | None = None
    seed: int | None = None
    #: how long /health and /models take to answer while a request is in flight (a busy server)
    busy_probe_ms: float = 0
    #: models whose chat completions refuse `max_tokens`, as OpenAI's reasoning models do (they
    #: take only `max_completion_tokens`)
    completion_tokens_only: tuple[str, ...] = ()
    #: serve https with this certificate (PEM, its chain after it) and private key: both or neither
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.models) and all(self.models), "models", "must be a non-empty list of names")
        _require(0 <= self.port <= 65535, "port", "must be in 0..65535")
        _require(math.isfinite(self.ttft_ms) and self.ttft_ms >= 0, "ttft_ms", "must be >= 0")
        _require(math.isfinite(self.itl_ms) and self.itl_ms >= 0, "itl_ms", "must be >= 0")
        _require(self.tokens >= 0, "tokens", "must be >= 0")
        _require(0.0 <= self.fail_rate <= 1.0, "fail_rate", "must be in [0, 1]")
        _require(400 <= self.fail_status <= 599, "fail_status", "must be an HTTP error status (400..599)")
        _require(self.fail_retry_after is None or _header_value(self.fail_retry_after), "fail_retry_after",
                 "must be a printable header value of at most 100 characters")
        _require(
            self.fail_after_tokens is None or self.fail_after_tokens >= 0, "fail_after_tokens", "must be >= 0"
        )
        _require(math.isfinite(self.busy_probe_ms) and self.busy_probe_ms >= 0, "busy_probe_ms", "must be >= 0")
        _require((self.tls_cert is None) == (self.tls_key is None), "tls_cert", "and tls_key go together")


def _header_value(text: str) -> bool:
    return text.isprintable() and len(text) <= 100


# --------------------------------------------------------------------------- command line


def _cli_type(convert: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """Wrap ``convert`` so that both parse errors and SimOptions rules surface as argparse errors."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
            SimOptions(**{name: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse


def _parse_models(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimOptions()
    parser.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    parser.add_argument("--port", type=_cli_type(int, "port"), default=d.port, help="port (0 = any free)")
    parser.add_argument(
        "--models", type=_cli_type(_parse_models, "models"), default=d.models,
        help=f"comma-separated model names to serve (default {','.join(d.models)})",
    )
    parser.add_argument("--ttft-ms", type=_cli_type(float, "ttft_ms"), default=d.ttft_ms,
                        help="time to first token in ms")
    parser.add_argument("--itl-ms", type=_cli_type(float, "itl_ms"), default=d.itl_ms,
                        help="inter-token latency in ms")
    parser.add_argument("--tokens", type=_cli_type(int, "tokens"), default=d.tokens,
                        help=f"output length in tokens (default {d.tokens})")
    parser.add_argument("--fail-rate", type=_cli_type(float, "fail_rate"), default=d.fail_rate,
                        help="fraction of requests answered with an error")
    parser.add_argument("--fail-status", type=_cli_type(int, "fail_status"), default=d.fail_status,
                        help=f"HTTP status of injected errors (default {d.fail_status})")
    parser.add_argument("--fail-retry-after", type=_cli_type(str, "fail_retry_after"), default=d.fail_retry_after,
                        help="Retry-After header of injected errors (seconds or an HTTP date; default none)")
    parser.add_argument("--fail-after-tokens", type=_cli_type(int, "fail_after_tokens"), default=None,
                        help="drop the connection after this many output tokens (simulated crash)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for --fail-rate")
    parser.add_argument("--busy-probe-ms", type=_cli_type(float, "busy_probe_ms"), default=d.busy_probe_ms,
                        help="how long /health and /models take while a request is in flight (a busy server)")
    parser.add_argument("--completion-tokens-only", type=_parse_models, default=d.completion_tokens_only,
                        help="comma-separated models whose chat completions refuse max_tokens with OpenAI's 400, "
                             "as its reasoning models do (they take max_completion_tokens)")
    parser.add_argument("--tls-cert", default=None, help="serve https with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")


def options_from_args(ns: argparse.Namespace) -> SimOptions:
    return SimOptions(
        host=ns.host, port=ns.port, models=tuple(ns.models), ttft_ms=ns.ttft_ms, itl_ms=ns.itl_ms,
        tokens=ns.tokens, fail_rate=ns.fail_rate, fail_status=ns.fail_status,
        fail_retry_after=ns.fail_retry_after, fail_after_tokens=ns.fail_after_tokens, seed=ns.seed,
        busy_probe_ms=ns.busy_probe_ms,
        completion_tokens_only=tuple(ns.completion_tokens_only), tls_cert=ns.tls_cert, tls_key=ns.tls_key,
    )


# --------------------------------------------------------------------------- errors


def _error_kind(status: int) -> tuple[str, str | None]:
    if status >= 500:
        return "server_error", None
    if status == 429:
        return "requests", "rate_limit_exceeded"
    return "invalid_request_error", None


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> web.Response:
        kind, default_code = _error_kind(self.status)
        code = self.code or default_code
        error = {"message": self.message, "type": kind, "param": self.param, "code": code}
        return web.json_response({"error": error}, status=self.status, headers=self.headers)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@web.middleware
async def _api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()


# --------------------------------------------------------------------------- stats


@dataclass(eq=False)
class RequestRecord:
    path: str
    request_id: str | None
    model: str | None = None
    stream: bool = False
    disconnected: bool = False
    completed: bool = False
    epoch: int = 0
    started: float = field(default_factory=time.monotonic)
    duration_ms: float | None = None
    #: when it began, as Unix time (to line it up with other processes' logs)
    began_at: float = field(default_factory=time.time)

    def as_json(self) -> JsonObject:
        return {
            "model": self.model, "request_id": self.request_id, "path": self.path, "stream": self.stream,
            "disconnected": self.disconnected, "completed": self.completed, "duration_ms": self.duration_ms,
            "began_at": round(self.began_at, 3),
        }


@dataclass
class SimStats:
    total: int = 0
    current: int = 0
    max_concurrent: int = 0
    disconnects: int = 0
    busy_ms: float = 0.0  # sum of the durations of finished requests
    by_model: Counter[str] = field(default_factory=Counter)
    requests: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))
    epoch: int = 0  # bumped by reset() so in-flight requests from before don't count afterwards

    def begin(self, record: RequestRecord) -> None:
        record.epoch = self.epoch
        self.total += 1
        self.current += 1
        self.max_concurrent = max(self.max_concurrent, self.current)
        self.requests.append(record)

    def end(self, record: RequestRecord) -> None:
        self.current -= 1
        record.duration_ms = (time.monotonic() - record.started) * 1000
        if record.epoch == self.epoch:
            self.busy_ms += record.duration_ms

    def identify(self, record: RequestRecord, model: str, stream: bool) -> None:
        record.model, record.stream = model, stream
        if record.epoch == self.epoch:
            self.by_model[model] += 1

    def mark_disconnected(self, record: RequestRecord) -> None:
        if record.disconnected:
            return
        record.disconnected = True
        if record.epoch == self.epoch:
            self.disconnects += 1

    def reset(self) -> None:
        """Zero everything; ``current`` is a gauge of in-flight requests and is kept."""
        self.epoch += 1
        self.total = self.disconnects = 0
        self.busy_ms = 0.0
        self.max_concurrent = self.current
        self.by_model.clear()
        self.requests.clear()

    def as_json(self) -> JsonObject:
        return {
            "total": self.total, "max_concurrent": self.max_concurrent, "current": self.current,
            "by_model": dict(self.by_model), "requests": [r.as_json() for r in self.requests],
            "disconnects": self.disconnects, "busy_ms": round(self.busy_ms, 3),
        }


OPTIONS_KEY = web.AppKey("options", SimOptions)
STATS_KEY = web.AppKey("stats", SimStats)
RNG_KEY = web.AppKey("rng", random.Random)
STARTED_KEY = web.AppKey("started", int)

TrackedHandler = Callable[[web.Request, RequestRecord], Awaitable[web.StreamResponse]]


def _tracked(handle: TrackedHandler) -> Handler:
    """Count the request in /stats while it runs; a cancelled handler means the client went away."""

    async def handler(request: web.Request) -> web.StreamResponse:
        stats = request.app[STATS_KEY]
        record = RequestRecord(path=request.path, request_id=request.headers.get("X-Request-Id"))
        stats.begin(record)
        try:
            return await handle(request, record)
        except asyncio.CancelledError:
            stats.mark_disconnected(record)
            raise
        finally:
            stats.end(record)

    return handler


# --------------------------------------------------------------------------- request parsing


async def _read_body(request: web.Request) -> JsonObject:
    try:
        body = await request.json(loads=json.loads)
    except (ValueError, UnicodeDecodeError):
        raise _bad_request("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise _bad_request("The request body must be a JSON object.")
    return body


def _requested_model(body: JsonObject) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad_request("You must provide a model parameter.", "model")
    return model


def _check_served(opts: SimOptions, model: str) -> None:
    if model not in opts.models:
        message = f"The model `{model}` does not exist or you do not have access to it."
        raise ApiError(404, message, param="model", code="model_not_found")


def _stream_flags(body: JsonObject) -> tuple[bool, bool]:
    """Return (stream, include_usage)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad_request("'stream' must be a boolean.", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _bad_request("'stream_options' must be an object.", "stream_options")
    return stream, stream and stream_options.get("include_usage") is True


_OVERRIDE_CHECKS: dict[str, Callable[[object], bool]] = {
    "ttft_ms": _is_number,
    "itl_ms": _is_number,
    "tokens": _is_int,
    "fail_rate": _is_number,
    "fail_status": _is_int,
    "fail_retry_after": lambda v: v is None or (isinstance(v, str) and _header_value(v)),
    "fail_after_tokens": lambda v: v is None or _is_int(v),
}


def _request_options(opts: SimOptions, body: JsonObject) -> tuple[SimOptions, bool]:
    """Apply the body's ``"sim"`` overrides; return (options, forced failure)."""
    sim = body.get("sim")
    if sim is None:
        return opts, False
    if not isinstance(sim, dict):
        raise _bad_request("'sim' must be an object.", "sim")
    for key, value in sim.items():
        check = _OVERRIDE_CHECKS.get(key)
        if check is None or not check(value):
            raise _bad_request(f"Invalid simulator override sim.{key}={value!r}.", f"sim.{key}")
    try:
        return dataclasses.replace(opts, **sim), "fail_status" in sim
    except ValueError as exc:
        raise _bad_request(f"Invalid simulator override: {exc}.", "sim") from None


#: the largest request body taken: the most a gateway's `runtime.max_body_bytes` may be (aiohttp's
#: own 1 MiB answered a run the gateway let in with a 413; vLLM's server has no limit of its own)
MAX_BODY_BYTES = 512 * 1024 * 1024
#: the most choices an answer may have (`n` times a legacy completion's prompts; through a gateway
#: each may be up to its `runtime.max_choices` and `max_inputs`: 128 x 2048)
MAX_CHOICES = 4096


def _max_tokens(body: JsonObject, keys: tuple[str, ...]) -> int | None:
    limits: list[int] = []
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise _bad_request(f"'{key}' must be a positive integer.", key)
        limits.append(value)
    return min(limits, default=None)


def _choices(body: JsonObject, legacy: bool) -> int:
    """How many choices an answer has, as vLLM makes them: `n` a prompt, for each prompt of a
    legacy completion's list (strings, or token lists; one list of tokens is one prompt)."""
    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n) or n < 1:
        raise _bad_request("'n' must be a positive integer.", "n")
    prompt = body.get("prompt")
    prompts = len(prompt) if legacy and isinstance(prompt, list) and prompt and not _is_int(prompt[0]) else 1
    choices: int = n * prompts
    if choices > MAX_CHOICES:
        raise _bad_request(f"The simulator makes at most {MAX_CHOICES} choices a request (n times the prompts).", "n")
    return choices


def _count_words(value: object) -> int:
    """Rough token count: words of strings, one per token id, text of content parts."""
    if isinstance(value, str):
        return len(value.split())
    if _is_int(value):
        return 1
    if isinstance(value, list):
        return sum(_count_words(item) for item in value)
    if isinstance(value, dict):
        return _count_words(value.get("text"))
    return 0


def _chat_prompt_tokens(body: JsonObject) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise _bad_request("'messages' must be a non-empty array of message objects.", "messages")
    return sum(_count_words(message.get("content")) for message in messages)


def _text_prompt_tokens(body: JsonObject) -> int:
    prompt = body.get("prompt")
    if not isinstance(prompt, str | list):
        raise _bad_request("'prompt' must be a string or an array.", "prompt")
    return _count_words(prompt)


def _maybe_fail(app: web.Application, opts: SimOptions, forced: bool) -> None:
    rng = app[RNG_KEY]
    if forced or (opts.fail_rate > 0 and rng.random() < opts.fail_rate):
        status = opts.fail_status
        raise ApiError(status, f"Simulated failure (status {status}) from the iop simulator.",
                       headers=None if opts.fail_retry_after is None else {"Retry-After": opts.fail_retry_after})


# --------------------------------------------------------------------------- generation


def token_text(index: int) -> str:
    return f"tok{index} "


@dataclass(frozen=True)
class _Plan:
    tokens: int
    finish_reason: str
    ttft_s: float
    itl_s: float
    fail_after: int | None
    prompt_tokens: int

    @classmethod
    def make(cls, opts: SimOptions, limit: int | None, prompt_tokens: int) -> _Plan:
        # Like vLLM: reaching max_tokens is "length" even if the natural output was exactly that long.
        truncated = limit is not None and limit <= opts.tokens
        return cls(
            tokens=min(opts.tokens, limit) if limit is not None else opts.tokens,
            finish_reason="length" if truncated else "stop",
            ttft_s=opts.ttft_ms / 1000, itl_s=opts.itl_ms / 1000,
            fail_after=opts.fail_after_tokens, prompt_tokens=prompt_tokens,
        )

    def delay_before(self, index: int) -> float:
        return self.ttft_s if index == 0 else self.itl_s

    def aborts_at(self, index: int) -> bool:
        return self.fail_after is not None and index >= self.fail_after

    def usage(self, choices: int = 1) -> JsonObject:
        completion = self.tokens * choices
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


class _Format:
    """Builds the OpenAI response objects of one endpoint."""

    id_prefix: ClassVar[str]
    full_object: ClassVar[str]
    chunk_object: ClassVar[str]
    #: the fields read as the output limit (the smaller wins)
    limit_fields: ClassVar[tuple[str, ...]] = ("max_tokens", "max_completion_tokens")

    def __init__(self, model: str, include_usage: bool, choices: int = 1) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        #: how many choices the answer has (`n`, times the prompts of a legacy completion)
        self.choices = choices

    def _envelope(self, obj: str, choices: list[JsonObject]) -> JsonObject:
        return {
            "id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
        }

    def chunk(self, choice: JsonObject, index: int) -> JsonObject:
        out = self._envelope(self.chunk_object, [{"index": index, **choice, "logprobs": None}])
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: JsonObject) -> JsonObject:
        return {**self._envelope(self.chunk_object, []), "usage": usage}

    def full(self, text: str, finish_reason: str, usage: JsonObject) -> JsonObject:
        choices = [{"index": i, **self.full_choice(text, i), "logprobs": None, "finish_reason": finish_reason}
                   for i in range(self.choices)]
        return {**self._envelope(self.full_object, choices), "usage": usage}

    @staticmethod
    def prompt_tokens(body: JsonObject) -> int:
        raise NotImplementedError

    def opening_chunks(self) -> list[JsonObject]:
        return []

    def piece(self, index: int) -> str:
        """What the stream's `index`th token chunk carries."""
        return token_text(index)

    def token_chunk(self, text: str, index: int) -> JsonObject:
        raise NotImplementedError

    def finish_chunk(self, finish_reason: str, index: int) -> JsonObject:
        raise NotImplementedError

    def full_choice(self, text: str, index: int) -> JsonObject:
        raise NotImplementedError


#: the arguments of a tool call whose function has no `parameters`
TOOL_ARGUMENTS = "{}"


class _ChatFormat(_Format):
    id_prefix = "chatcmpl"
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    #: the function each choice calls instead of answering text (`called_tool`), else None
    tool: str | None = None
    #: that call's arguments (`sim_schema.tool_arguments`: what its `parameters` take)
    arguments: str = TOOL_ARGUMENTS
    #: the tokens of the JSON a `response_format` asked for (`sim_schema`), else None (text)
    json_tokens: list[str] | None = None

    @staticmethod
    def prompt_tokens(body: JsonObject) -> int:
        return _chat_prompt_tokens(body)

    def opening_chunks(self) -> list[JsonObject]:
        return [self.chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, i)
                for i in range(self.choices)]

    def _call(self, index: int) -> JsonObject:
        return {"id": f"call_{self.id.removeprefix('chatcmpl-')[:24]}_{index}", "type": "function",
                "function": {"name": self.tool, "arguments": self.arguments}}

    def piece(self, index: int) -> str:
        if self.tool is not None:  # (a call's name and id first, its arguments after, as vLLM streams one)
            return self.arguments if index else ""
        if self.json_tokens is not None:
            return self.json_tokens[index]
        return token_text(index)

    def token_chunk(self, text: str, index: int) -> JsonObject:
        if self.tool is None:
            return self.chunk({"delta": {"content": text}, "finish_reason": None}, index)
        if text:
            return self.chunk({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": text}}]},
                               "finish_reason": None}, index)
        return self.chunk({"delta": {"tool_calls": [{"index": 0, **self._call(index), "function": {
            "name": self.tool, "arguments": ""}}]}, "finish_reason": None}, index)

    def finish_chunk(self, finish_reason: str, index: int) -> JsonObject:
        return self.chunk({"delta": {}, "finish_reason": finish_reason}, index)

    def full_choice(self, text: str, index: int) -> JsonObject:
        if self.tool is not None:
            return {"message": {"role": "assistant", "content": None, "refusal": None,
                                "tool_calls": [self._call(index)]}}
        return {"message": {"role": "assistant", "content": text, "refusal": None}}


def called_tool(body: JsonObject) -> str | None:
    """The function a chat request makes the simulator call: the one its `tool_choice` names, or
    its first tool's with `tool_choice` "required"; None (text) otherwise, "auto" included (a
    model decides that, and the simulator is no model)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(function := choice.get("function"), dict) \
            and isinstance(function.get("name"), str):
        return str(function["name"])
    first = tools[0].get("function") if isinstance(tools[0], dict) else None
    if choice == "required" and isinstance(first, dict) and isinstance(first.get("name"), str):
        return str(first["name"])
    return None


class _TextFormat(_Format):
    id_prefix = "cmpl"
    full_object = "text_completion"
    chunk_object = "text_completion"
    #: as vLLM: `max_completion_tokens` is no field of a legacy completion
    limit_fields = ("max_tokens",)

    @staticmethod
    def prompt_tokens(body: JsonObject) -> int:
        return _text_prompt_tokens(body)

    def token_chunk(self, text: str, index: int) -> JsonObject:
        return self.chunk({"text": text, "finish_reason": None}, index)

    def finish_chunk(self, finish_reason: str, index: int) -> JsonObject:
        return self.chunk({"text": "", "finish_reason": finish_reason}, index)

    def full_choice(self, text: str, index: int) -> JsonObject:
        return {"text": text}


def _sse(payload: JsonObject | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _pause(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def _abort_connection(request: web.Request) -> None:
    """Drop the TCP connection without finishing the response, like a crashing provider."""
    if request.transport is not None:
        request.transport.abort()


async def _emit_stream(resp: web.StreamResponse, plan: _Plan, fmt: _Format, request: web.Request) -> bool:
    """Write the SSE stream; return False if it was deliberately aborted."""
    for chunk in fmt.opening_chunks():
        await resp.write(_sse(chunk))
    for index in range(plan.tokens):
        if plan.aborts_at(index):
            _abort_connection(request)
            return False
        await _pause(plan.delay_before(index))
        for choice in range(fmt.choices):  # (as vLLM: a chunk a choice)
            await resp.write(_sse(fmt.token_chunk(fmt.piece(index), choice)))
    for choice in range(fmt.choices):
        await resp.write(_sse(fmt.finish_chunk(plan.finish_reason, choice)))
    if fmt.include_usage:
        await resp.write(_sse(fmt.usage_chunk(plan.usage(fmt.choices))))
    await resp.write(_sse("[DONE]"))
    await resp.write_eof()
    return True


async def _stream(
    request: web.Request, record: RequestRecord, plan: _Plan, fmt: _Format
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        record.completed = await _emit_stream(resp, plan, fmt, request)
    except ConnectionResetError:
        request.app[STATS_KEY].mark_disconnected(record)
    return resp


async def _respond(
    request: web.Request, record: RequestRecord, plan: _Plan, fmt: _Format
) -> web.StreamResponse:
    produced = plan.tokens if plan.fail_after is None else min(plan.tokens, plan.fail_after)
    await _pause(sum(plan.delay_before(index) for index in range(produced)))
    if produced < plan.tokens:
        _abort_connection(request)
        return web.Response(status=500)
    text = "".join(fmt.piece(index) for index in range(plan.tokens))
    record.completed = True
    return web.json_response(fmt.full(text, plan.finish_reason, plan.usage(fmt.choices)))


def _completion_handler(fmt_type: type[_Format]) -> Handler:
    async def handle(request: web.Request, record: RequestRecord) -> web.StreamResponse:
        app = request.app
        body = await _read_body(request)
        model = _requested_model(body)
        stream, include_usage = _stream_flags(body)
        app[STATS_KEY].identify(record, model, stream)
        _check_served(app[OPTIONS_KEY], model)
        opts, forced_failure = _request_options(app[OPTIONS_KEY], body)
        if fmt_type is _ChatFormat and model in opts.completion_tokens_only and body.get("max_tokens") is not None:
            raise ApiError(400, "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                                "'max_completion_tokens' instead.", param="max_tokens", code="unsupported_parameter")
        limit = _max_tokens(body, fmt_type.limit_fields)
        plan = _Plan.make(opts, limit, fmt_type.prompt_tokens(body))
        _maybe_fail(app, opts, forced_failure)
        fmt = fmt_type(model, include_usage, _choices(body, fmt_type is _TextFormat))
        if isinstance(fmt, _ChatFormat) and (tool := called_tool(body)) is not None:
            fmt.tool = tool  # (its name, then its arguments: two tokens, whatever the request's limit)
            fmt.arguments = tool_arguments(body, tool)
            plan = replace(plan, tokens=2, finish_reason="tool_calls")
        elif isinstance(fmt, _ChatFormat) and (json_text := response_format_text(body, opts.tokens)) is not None:
            fmt.json_tokens = tokens_of(json_text)  # (as long as the JSON is, cut at the limit as text is)
            plan = _Plan.make(replace(opts, tokens=len(fmt.json_tokens)), limit, plan.prompt_tokens)
        if stream:
            return await _stream(request, record, plan, fmt)
        return await _respond(request, record, plan, fmt)

    return _tracked(handle)


# --------------------------------------------------------------------------- embeddings


def embedding_vector(text: str) -> list[float]:
    """A deterministic unit vector of EMBEDDING_DIMS floats derived from the text."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(word / 0xFFFFFFFF) * 2 - 1 for word in struct.unpack(f"<{EMBEDDING_DIMS}I", digest)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _embedding_inputs(body: JsonObject) -> list[str]:
    """The texts to embed: a string, strings, token ids (one input) or lists of them, as OpenAI
    takes them; an input of token ids is embedded as its ids written out (`"1 2 3"`)."""
    value = body.get("input")
    if _is_tokens(value):
        value = [value]
    inputs = [value] if isinstance(value, str) else value
    if isinstance(inputs, list) and inputs and all(_is_tokens(item) for item in inputs):
        inputs = [" ".join(map(str, item)) for item in inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(item, str) for item in inputs):
        raise _bad_request("'input' must be a string, an array of strings, an array of token ids, or an array "
                           "of arrays of token ids.", "input")
    return inputs


def _is_tokens(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(v) for v in value)


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def _encoding_format(body: JsonObject) -> str:
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        raise _bad_request("'encoding_format' must be 'float' or 'base64'.", "encoding_format")
    return str(encoding_format)


async def _embeddings(request: web.Request, record: RequestRecord) -> web.StreamResponse:
    app = request.app
    body = await _read_body(request)
    model = _requested_model(body)
    app[STATS_KEY].identify(record, model, False)
    _check_served(app[OPTIONS_KEY], model)
    opts, forced_failure = _request_options(app[OPTIONS_KEY], body)
    inputs, encoding_format = _embedding_inputs(body), _encoding_format(body)
    _maybe_fail(app, opts, forced_failure)
    await _pause(opts.ttft_ms / 1000)
    vectors = [_encode_embedding(embedding_vector(text), encoding_format) for text in inputs]
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)]
    prompt_tokens = _count_words(inputs)
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    record.completed = True
    return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})


# --------------------------------------------------------------------------- plain endpoints


async def _busy_pause(request: web.Request) -> None:
    """A busy server answers its probes late (`busy_probe_ms` while a request is in flight)."""
    if request.app[STATS_KEY].current:
        await _pause(request.app[OPTIONS_KEY].busy_probe_ms / 1000)


async def _models(request: web.Request) -> web.Response:
    await _busy_pause(request)
    created = request.app[STARTED_KEY]
    data = [
        {"id": model, "object": "model", "created": created, "owned_by": OWNER}
        for model in request.app[OPTIONS_KEY].models
    ]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    await _busy_pause(request)
    return web.Response()


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS_KEY].as_json())


async def _stats_reset(request: web.Request) -> web.Response:
    stats = request.app[STATS_KEY]
    stats.reset()
    return web.json_response(stats.as_json())


# --------------------------------------------------------------------------- app and server


def build_app(opts: SimOptions) -> web.Application:
    app = web.Application(middlewares=[_api_errors], client_max_size=MAX_BODY_BYTES)
    app[OPTIONS_KEY] = opts
    app[STATS_KEY] = SimStats()
    app[RNG_KEY] = random.Random(opts.seed)
    app[STARTED_KEY] = int(time.time())
    app.router.add_get("/health", _health)
    # The OpenAI API under /v1 (vLLM, SGLang, hosted APIs) and under /api/v1 (Lemonade).
    for root in API_ROOTS:
        app.router.add_get(f"{root}/models", _models)
        app.router.add_get(f"{root}/health", _health)
        app.router.add_post(f"{root}/chat/completions", _completion_handler(_ChatFormat))
        app.router.add_post(f"{root}/completions", _completion_handler(_TextFormat))
        app.router.add_post(f"{root}/embeddings", _tracked(_embeddings))
    app.router.add_get("/stats", _stats)
    app.router.add_post("/stats/reset", _stats_reset)
    return app


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def start_server(opts: SimOptions) -> tuple[web.AppRunner, str]:
    """Start the simulator; return its runner (call ``cleanup()`` to stop) and base URL."""
    runner = web.AppRunner(
        build_app(opts), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    tls: ssl.SSLContext | None = None
    try:
        if opts.tls_cert is not None:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                tls.load_cert_chain(opts.tls_cert, opts.tls_key)
            except OSError as exc:  # (ssl.SSLError is one: a key that is not the certificate's, say)
                raise SystemExit(f"error: cannot serve https with --tls-cert {opts.tls_cert} and --tls-key "
                                 f"{opts.tls_key}: {getattr(exc, 'reason', None) or exc.strerror or exc}") from None
        try:
            await web.TCPSite(runner, opts.host, opts.port, ssl_context=tls).start()
        except OSError as exc:
            raise cannot_listen("", opts.host, opts.port, exc) from None
    except BaseException:
        await runner.cleanup()
        raise
    port = int(runner.addresses[0][1])
    return runner, _url(opts.host, port, "https" if tls else "http")


async def _wait_for_stop_signal() -> None:
    """Wait for SIGINT/SIGTERM (or cancellation), restoring the previous handlers afterwards."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    with contextlib.ExitStack() as restore:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # no signal support here (Windows, non-main thread): rely on cancellation
            if previous is not None:
                restore.callback(signal.signal, sig, previous)
            restore.callback(loop.remove_signal_handler, sig)
        await stop.wait()


async def serve(opts: SimOptions) -> None:
    runner, url = await start_server(opts)
    try:
        print(f"iop simulator listening on {url}", flush=True)
        await _wait_for_stop_signal()
    finally:
        await runner.cleanup()


def run(opts: SimOptions) -> None:
    asyncio.run(serve(opts))
