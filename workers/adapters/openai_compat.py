"""The OpenAI-compatible family: vLLM, SGLang, llama.cpp, Lemonade and hosted `openai_api` providers.

Bodies go to the provider as they came (only `model` was rewritten, by the scheduler), so
unknown fields (`tools`, `response_format`, `logprobs`, ...) pass through, and streamed
chunks (tool-call deltas, usage) come back as the provider sent them.

Where the API lives: `base_url` ending in `/v1` (`http://h:8000/v1`, `http://h:8000/api/v1`)
is the API root as it is; otherwise the type's path is appended (`/v1`; Lemonade `/api/v1`).
`api_path` overrides that (`api_path: /openai/v1`).

Probes per type: vLLM, SGLang and llama.cpp `GET /health` (server root), Lemonade
`GET <api>/health`, then `GET <api>/models` for the models it serves; `openai_api` only the
model list. A llama-server router (its model cards have a `status`) is asked `GET /props`
whether it loads a model a run names, once if it does, at each probe if it does not
(`--no-models-autoload`): such a one serves only the models it lists loaded (`_router_serves`).
vLLM is also asked `GET /is_sleeping` (asleep or paused: unavailable; a 404, a server not in
dev mode, is not asked again). `probe_path` replaces the health endpoint. A health endpoint that
does not exist (404, 405, 501; llama-cpp-python has none) is remembered, and the model list
alone decides.
Probes send no `X-Request-Id`; runs send the run's UUID (`common.wire.upstream_request_id`).

An API key is read from the environment variable named by `api_key_env` at each request.
It never appears in errors or probe reasons: the provider's echo of it there is redacted (its
output, a completion's text, is the caller's as it came).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from common import jsonio, token_cap
from common.choices import inputs
from common.chunks import choice_marks, choices_usable
from common.config import ProviderConfig
from common.policy import Health
from common.provider_types import PROBE_DISTURBS
from common.runlog import run_fields
from common.wire import ErrorCode, RunKind, callers_fault
from workers.adapters import answer_shapes, sending
from workers.adapters.base import (
    DEFAULT_LIMITS,
    LastRead,
    ProbeResult,
    ProviderError,
    ReadLimits,
    Retry,
    not_taken,
)
from workers.adapters.credentials import Credentials
from workers.adapters.embeddings import PER_TOKEN, embeddings_problem, in_base64, in_numbers
from workers.adapters.failures import (
    MAX_FIELD_CHARS,
    another_may,
    answered_error,
    callers_retry,
    model_gone,
    one_line,
    probe_answered,
    probe_failure,
    redact,
    redacted,
    transport_error,
)
from workers.adapters.proxies import Proxy
from workers.adapters.reading import (
    Breaks,
    LineSplitter,
    NonObjects,
    ReadWatch,
    error_body,
    error_text,
    is_redirect,
    parse_json,
    probe_said,
    read_at_most,
    read_whole,
    redirect_error,
    redirect_probe,
    without_traceback,
)
from workers.adapters.silence import SharedCheck, SilenceWatch

log = logging.getLogger("iop.worker")

PATHS = {RunKind.CHAT: "/chat/completions", RunKind.COMPLETION: "/completions", RunKind.EMBEDDING: "/embeddings"}


#: the path of the OpenAI API on a server of each type, when base_url does not say
DEFAULT_API_PATH = {"lemonade": "/api/v1"}
#: types whose health endpoint lives at the server root rather than under the API root
ROOT_HEALTH = frozenset({"vllm", "sglang", "llamacpp"})
#: types with a health endpoint at all (a hosted API has only its model list)
HAS_HEALTH = ROOT_HEALTH | {"lemonade"}
#: what a llama.cpp server without a health endpoint says to the check of a silent whole answer
NO_HEALTH = ProbeResult(Health.UNKNOWN, "no health endpoint")
#: a health endpoint answering one of these does not exist: the model list decides alone
NO_SUCH_ENDPOINT = frozenset({404, 405, 501})
#: vLLM's sleep state, at the server root (`--enable-sleep-mode` with `VLLM_SERVER_DEV_MODE=1`): asleep
#: or paused, it still answers `/health` and takes requests, and holds them until it is woken
SLEEP_PATH = "/is_sleeping"
#: The prefix of a model's resource name in Google's APIs, which Gemini's OpenAI-compatible model list
#: gives its ids (`models/gemini-2.0-flash`), where its runs take the model's name alone
GOOGLE_MODEL_PREFIX = "models/"
#: How long a stream whose every choice has its finish_reason waits for what may still come (the
#: usage chunk, [DONE]): a provider that sends neither and keeps its connection open has answered
#: whole, and its caller is not kept waiting for `read_timeout_ms`, then failed.
FINISHED_GRACE_S = 2.0


def all_ended(seen: set[int], ended: set[int], choices: int) -> bool:
    """Every choice seen, and at least `choices` of them, came with its finish_reason: the answer is whole."""
    return bool(ended) and len(ended) >= max(choices, len(seen))


def api_root(base_url: str, provider_type: str = "vllm", api_path: str | None = None) -> str:
    """`http://host:8000` and `http://host:8000/v1` both mean the API under /v1."""
    root = base_url.rstrip("/")
    if api_path is not None:
        return root + api_path.rstrip("/")
    return root if root.endswith("/v1") else root + DEFAULT_API_PATH.get(provider_type, "/v1")


def server_root(base_url: str, api_path: str | None = None) -> str:
    """The server itself, where vLLM and SGLang answer `/health`."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") if api_path is None else root


def health_url(provider: ProviderConfig) -> str | None:
    """Where the provider's health endpoint is: `probe_path` on its host, else the type's own."""
    assert provider.base_url
    if provider.probe_path is not None:
        parts = urlsplit(provider.base_url)
        return f"{parts.scheme}://{parts.netloc}{provider.probe_path}"
    if provider.type in ROOT_HEALTH:
        return server_root(provider.base_url, provider.api_path) + "/health"
    if provider.type in HAS_HEALTH:
        return api_root(provider.base_url, provider.type, provider.api_path) + "/health"
    return None


def for_llamacpp(body: dict[str, Any]) -> dict[str, Any]:
    """A request as llama.cpp's servers all take it (`schema_as_json_object`, `max_tokens_named`,
    `developer_as_system`); the run's own body is not changed."""
    return developer_as_system(max_tokens_named(schema_as_json_object(body)))


def developer_as_system(body: dict[str, Any]) -> dict[str, Any]:
    """`developer` messages (OpenAI's name for system instructions since its reasoning models, which
    its newer clients and agent libraries send) as `system` ones: llama-cpp-python refuses the role
    (a 500 for the caller's request)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(isinstance(m, dict) and m.get("role") == "developer"
                                                 for m in messages):
        return body
    return {**body, "messages": [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer"
                                 else m for m in messages]}


def max_tokens_named(body: dict[str, Any]) -> dict[str, Any]:
    """A `max_completion_tokens` (OpenAI's name since `max_tokens` was deprecated, which the
    official clients send) as `max_tokens`: llama-cpp-python knows only `max_tokens`, and a limit
    under the other name was ignored (3 asked, 538 generated; its server generates to the end of its
    context). It wins over a `max_tokens` sent too (`null` included, as clients and wrappers send an
    unset one), as vLLM reads the two. llama.cpp's own server takes both."""
    found = token_cap.asked(body)
    if found is None or found[0] != "max_completion_tokens" or body.get("max_tokens") == found[1]:
        return body
    return {**body, "max_tokens": found[1]}


def completion_tokens_named(body: dict[str, Any]) -> dict[str, Any]:
    """A chat request's `max_tokens` as `max_completion_tokens`, for a model that refuses the older
    name: OpenAI's reasoning models answer it with a 400 ("Unsupported parameter: 'max_tokens' is not
    supported with this model. Use 'max_completion_tokens' instead."). A `max_completion_tokens` sent
    too wins, as vLLM reads the two; a `max_tokens` of `null` goes too. The run's own body is not
    changed."""
    if "max_tokens" not in body:
        return body
    renamed = {k: v for k, v in body.items() if k != "max_tokens"}
    if renamed.get("max_completion_tokens") is None and body["max_tokens"] is not None:
        renamed["max_completion_tokens"] = body["max_tokens"]
    return renamed


def max_tokens_only(body: dict[str, Any]) -> dict[str, Any]:
    """A chat request's `max_completion_tokens` as `max_tokens` alone, for a server that does not know
    the newer name: Mistral answers it with a 422 (pydantic's `extra_forbidden`, "Extra inputs are not
    permitted"). It wins over a `max_tokens` sent too, as vLLM reads the two; a `max_completion_tokens`
    of `null` goes, and leaves `max_tokens` as it was. The run's own body is not changed."""
    if "max_completion_tokens" not in body:
        return body
    renamed = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    if body["max_completion_tokens"] is not None:
        renamed["max_tokens"] = body["max_completion_tokens"]
    return renamed


def schema_as_json_object(body: dict[str, Any]) -> dict[str, Any]:
    """A `response_format` of type `json_schema` as llama.cpp's servers all take it: `json_object`
    with the `schema` (llama-cpp-python knows only `text` and `json_object`, and answered a
    `json_schema` with a 500; llama.cpp's own server takes both). Any other body as it is."""
    fmt = body.get("response_format")
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict)
            and isinstance(fmt["json_schema"].get("schema"), dict)):
        return body
    return {**body, "response_format": {"type": "json_object", "schema": fmt["json_schema"]["schema"]}}


def choices_asked(kind: RunKind, body: dict[str, Any]) -> int:
    """How many choices a request asks for: `n` for each prompt (a legacy completion's `prompt`
    may be a list of them)."""
    return per_prompt(body.get("n")) * (inputs(body.get("prompt")) if kind is RunKind.COMPLETION else 1)


def per_prompt(n: Any) -> int:
    """How many choices a request's `n` asks for, as a server reads it (`2`, `2.0` or `"2"`: 2);
    1 when it says nothing a server would take."""
    if isinstance(n, bool) or not isinstance(n, (int, float, str)):
        return 1
    try:
        number = float(n)
        asked = int(number)
    except (ValueError, OverflowError):
        return 1
    return asked if asked == number and asked > 0 else 1


def _error_detail(payload: Any) -> dict[str, Any] | None:
    """The error object of an error answer: its `error` (`error_in`), also in an array of one (Gemini's
    OpenAI-compatible endpoint answers `[{"error": {"code": 400, "message": …, "status": …}}]`)."""
    if isinstance(payload, list) and len(payload) == 1:
        payload = payload[0]
    error = error_in(payload)
    return error if isinstance(error, dict) else None


def error_in(payload: Any) -> Any:
    """The error an answer or a chunk carries, if any: its `error` (an object or a string), or the
    answer itself when it is one in the flat shape of vLLM before 0.10 and SGLang
    (`{"object": "error", "message": …, "type": …, "code": 404}`)."""
    if not isinstance(payload, dict):
        return None
    if payload.get("error"):
        return payload["error"]
    return payload if payload.get("object") == "error" else None


def _status(value: Any) -> int | None:
    """`value` if it is an HTTP error status (an integer from 400 to 599), else None."""
    return value if type(value) is int and 400 <= value < 600 else None


def said_status(error: Any, provider_type: str) -> int | None:
    """The HTTP status of an error a provider sent in its stream (or in a 200 answer), where its
    server means one: Lemonade's `status_code` (its streaming proxy puts the backend's status
    there, having sent its 200 already); SGLang's `code` (before any output its stream carries an
    error only for an abort that has a status: 400 for a request its scheduler refuses, 503 for one
    it has no room for, `--max-queued-requests`); llama-server's `code`, the status it answers the
    same error with when it comes first (a prompt of a legacy completion's list over its context,
    after another prompt's stream began: 400 `exceed_context_size_error`; llama-cpp-python's server
    sends no error event); vLLM's `code` of a 4xx that names a `param` (a `VLLMValidationError`
    raised as its engine takes the request, after the 200), and of a 5xx (a `GenerationError`'s: 503
    for a request it refuses while paused, vllm/v1/engine/core.py `_reject_add_while_paused`; older
    versions never sent one). Else None: older vLLM versions gave 400 to every fault of their streams,
    their engine's among them, with no `param` (`vllm_unsure`)."""
    if not isinstance(error, dict):
        return None
    status = _status(error.get("status_code"))
    if status is not None:
        return status
    code = _status(error.get("code"))
    if code is None or provider_type in ("sglang", "llamacpp"):
        return code
    param = error.get("param")
    return code if provider_type == "vllm" and (code >= 500 or (isinstance(param, str) and param)) else None


def vllm_unsure(error: Any, provider_type: str) -> int | None:
    """The 4xx of an error in a vLLM stream that names no `param`, in the shape of vLLM 0.10 and later
    (no `"object": "error"`), or None. vLLM 0.34 gives its stream's errors the status it answers the same
    request with whole (`create_error_response` of the exception, entrypoints/serve/exception_handling/
    error_response.py:39-96): a 4xx is a request it refuses, though not always with a `param` (a
    `VLLMValidationError` its engine raises after the 200: a JSON schema xgrammar cannot take,
    sampling_params.py `_validate_structured_outputs`; an engine-side refusal, v1/engine/core.py
    `_handle_request_validation_error`, whose `RequestError` keeps the message only). Older versions
    gave 400 to every fault of their streams, their engine's too: so another provider of the model is
    tried first, and the caller gets the 400 when none is left (`Retry.UNABLE`), not a 502."""
    if provider_type != "vllm" or not isinstance(error, dict) or error.get("object") == "error":
        return None
    code = _status(error.get("code"))
    return code if code is not None and code < 500 and said_status(error, provider_type) is None else None


def sent_error(provider_id: str, error: Any, error_chars: int, provider_type: str = "",
               served: str | None = None) -> ProviderError:
    """The error a provider sent in its stream or in a 200 answer: not a strike (it answered; one whose
    server says it is a 5xx shows nothing either way, as answered whole), and
    the run may go to another provider if nothing reached its caller yet; but one whose server says
    it is the caller's (`said_status`: a 4xx of the caller's) is the caller's answer, as the same
    request's whole answer is: passed through with its status and never tried again. A 404 or 403
    that says this provider has not the `served` model (`model_gone`) is not the caller's, in a
    stream as in an answer (Lemonade's stream gives its backend's status). A vLLM 4xx that names no
    `param` (`vllm_unsure`) goes to another provider first and is the caller's when none is left; any
    other keeps the status its server said, as answered whole (a 503: busy)."""
    text = error_text(error, error_chars)
    status = said_status(error, provider_type)
    unsure = vllm_unsure(error, provider_type)
    said = status if status is not None else unsure
    # (whose `code` says 404 or 403, whatever its server: a hosted API's, OpenRouter's, a vLLM's without a
    # `param`, whose `code` is no status of the caller's, still says which model it lacks)
    gone = status if status is not None else _status(error.get("code")) if isinstance(error, dict) else None
    if gone is not None and isinstance(error, dict) and model_gone(gone, text, error, served):
        # (nothing either way, as answered whole: a sign of life would put off the probe that finds
        # the model gone from its list, and every run of it would be sent there first)
        return ProviderError(f"provider {provider_id} sent an error: {text}", detail=error, retry=Retry.ELSEWHERE,
                             strikes=None)
    if said is not None and callers_fault(said, text) and isinstance(error, dict):
        detail = {**error, **{name: one_line(value, MAX_FIELD_CHARS) for name in ("type", "param", "code")
                              if isinstance(value := error.get(name), str)}, "message": text}
        return ProviderError(f"provider {provider_id} sent an error: {text}", status=said, detail=detail,
                             retry=callers_retry(said, text) if status is not None else Retry.UNABLE, strikes=0)
    # (its status kept: a 503 says the provider is busy, as answered whole: benched, not blamed, and the
    # caller's 503 says when to try again. A 5xx shows nothing of its health either way, as answered whole:
    # taken for a sign of life, a paused vLLM answering each run so was never probed, and so never found
    # paused by its `/is_sleeping`)
    return ProviderError(f"provider {provider_id} sent an error: {text}", status=status,
                         detail=error if isinstance(error, dict) else None, retry=Retry.ELSEWHERE,
                         strikes=None if status is not None and status >= 500 else 0)


#: how llama-server refuses an `n` over its `--parallel` slots (`Field 'n': Value must be between 1 <=
#: value <= 4, but got 6`): another server of the model, with more slots, may serve it
N_OVER_SLOTS = "Field 'n': Value must be between "
#: how vLLM refuses `n` > 1 at temperature 0 (`SamplingParams._verify_greedy_sampling`, sampling_params.py:
#: 773-777 in 0.34: "n must be 1 when using greedy sampling, got 2."), which OpenAI and SGLang serve: another
#: server of the model may
N_GREEDY = "n must be 1 when using greedy sampling"


#: a llama-server router started with `--no-models-autoload` asked for a model it lists but has not
#: loaded (tools/server/server-models.cpp `router_validate_model`): its operator's to load
ROUTER_NOT_LOADED = "model is not loaded"
#: where a llama-server router says whether it loads a model a request names (`models_autoload`),
#: at the server root
PROPS_PATH = "/props"
#: the `status.value`s of a router's model that it serves as it is, without loading it: loaded, or
#: put to sleep by `--sleep-idle-seconds` (a request wakes it). Not `loading`: its server answers
#: 503 until it is ready; nor `unloaded` (failed or not), `downloading`, `downloaded`.
ROUTER_SERVES = frozenset({"loaded", "sleeping"})


def router_status(card: dict[str, Any]) -> str | None:
    """A model card's `status.value`: a llama-server router lists each of its models with one
    (`loaded`, `unloaded`, `loading`, …); a single-model server and llama-cpp-python's list none."""
    status = card.get("status")
    value = status.get("value") if isinstance(status, dict) else None
    return value if isinstance(value, str) else None


def loads_none(props: Any) -> bool:
    """Whether a llama-server router's `GET /props` says it loads no model on its own
    (`--no-models-autoload`: `"models_autoload": false`). Anything else (its default, a server that
    says nothing of it) keeps every model it lists."""
    return isinstance(props, dict) and props.get("role") == "router" and props.get("models_autoload") is False


def router_lacks(message: str, served: Any) -> bool:
    """Whether a llama-server in router mode (`--models-dir`, `--models-preset`) said, with its 400,
    that it has not the model: `model 'm' not found` (one deleted, or gone from its presets, since
    it was listed), or `model name=m is not running` (unloaded between its load and the request:
    the name is the model's own, maybe not the alias asked for), or `model is not loaded` (listed,
    but not loaded by a router that loads none on its own). As a 404 naming the served model
    is, that is the provider's matter: another provider may serve the run."""
    return (isinstance(served, str) and message == f"model '{served}' not found") or \
        (message.startswith("model name=") and message.endswith(" is not running")) or \
        message == ROUTER_NOT_LOADED


#: The finish_reason of a run its server aborted itself (vLLM: shut down with its default
#: `--shutdown-timeout 0`, put to sleep or paused; SGLang: `/abort_request`): no answer.
ABORTED = "abort"


def aborted(obj: dict[str, Any]) -> bool:
    """Whether an answer or a chunk has a choice that the server aborted (`ABORTED`)."""
    for c in obj.get("choices") or ():  # (a loop, not any() of a generator: every streamed chunk, ~0.1 us less)
        if isinstance(c, dict) and c.get("finish_reason") == ABORTED:
            return True
    return False


def aborted_error(provider_id: str) -> ProviderError:
    """A run its server aborted: not an answer for the caller (a whole one would be empty or cut
    short, its finish_reason one OpenAI has not), and nothing said of the server's health; another
    provider may serve it, not this one (asleep or paused, it would hold the run until woken)."""
    return ProviderError(f"provider {provider_id} aborted the request itself (finish_reason \"abort\": it was "
                         "shut down, put to sleep or paused)", retry=Retry.ELSEWHERE, strikes=None)


class SSEParser:
    """Splits an SSE byte stream into `data:` payloads; keeps partial lines between reads.

    `[DONE]` ends the stream: nothing after it is read. A chunk that carries an error (`error_in`),
    or the data of an `event: error`, is the provider's error (`failed`: the chunks read before
    it, in the same read, are returned first); a chunk that is not a JSON object is dropped, and
    so is an empty `data:` line. A line that is not JSON, or one past its limit, is an error
    (`breaks`: after output, the chunks before it in its read are returned first). A byte-order
    mark that opens the stream is not part of it.

    Every server seen sends an event's JSON on one `data:` line, so a line that holds a whole JSON
    text is a chunk at once (a server that ends its events with one line end is read too). A line
    that opens an object or array and only runs out before its end (`_runs_out`) begins an event
    split over several `data:` lines: they are joined with LF, as the SSE standard says, up to the
    blank line that ends the event, within `limits.line_bytes` together (`end`: the stream ended
    first). The data of an `event: error` is taken as it comes: its first line ends the stream."""

    def __init__(self, provider_id: str, limits: ReadLimits, request_id: str = "", model: str | None = None,
                 provider_type: str = "", shape: Callable[[dict[str, Any]], None] | None = None) -> None:
        """`shape`: makes each chunk what OpenAI's streams have, in place (a ProviderError it raises
        is the provider's error, as an error chunk is)."""
        self.provider_id = provider_id
        self.shape = shape
        self.provider_type = provider_type
        #: the model's name on this provider (`model_gone`)
        self.served = model
        self.limits = limits
        self.lines = LineSplitter(provider_id, limits)
        self.non_objects = NonObjects(provider_id, request_id, model)
        self.done = False
        #: the provider's error chunk, once one came: nothing after it is read
        self.failed: ProviderError | None = None
        self.breaks = Breaks()
        #: whether a read's chunks end the answer (every choice finished): an error after them in
        #: their read is held, not raised (`Breaks.read`)
        self.whole: Callable[[list[dict[str, Any]]], bool] | None = None
        #: the `event:` of the event being read (until the blank line that ends it)
        self._event = b""
        self._opening = True
        #: the `data:` lines, joined, of an event whose first line was not a whole JSON text (one
        #: buffer, not a list: a hostile provider's million tiny lines take what their bytes take)
        self._split: bytearray | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The chunks of a read; an error after some of them is held in `breaks` (`Breaks`)."""
        if self.done or self.failed or self.breaks.stopped:
            return []
        return self.breaks.read(lambda chunks: self._read(self.lines.feed(data), chunks), self.whole)

    def end(self) -> list[dict[str, Any]]:
        """The stream ended. An event whose blank line never came is read if its data is whole
        JSON (a last usage chunk, say); one cut short is dropped, as the SSE standard drops an
        event it did not see end, and so is a last line without its line end: the stream was cut
        short (the adapter says so, unless its answer was whole)."""
        chunks: list[dict[str, Any]] = []
        held, self._split = self._split, None
        if held is not None and not (self.done or self.failed):
            try:
                self._take(bytes(held), chunks, joined=True)
            except ValueError:
                pass
        return chunks

    def _read(self, lines: Iterator[bytes], chunks: list[dict[str, Any]]) -> None:
        for line in lines:
            if self._opening:  # (the stream's first line, whatever reads it came in)
                self._opening = False
                line = line.removeprefix(codecs.BOM_UTF8)
            if not line:  # a blank line ends an event
                if self._split is not None:
                    payload, self._split = bytes(self._split), None
                    if self._take(payload, chunks, joined=True):
                        return
                self._event = b""
                continue
            line = line.strip()
            if not line.startswith(b"data:"):
                if line.startswith(b"event:"):
                    self._event = line[6:].strip()
                continue
            payload = line[5:].strip()
            if self._split is None:
                if self._take(payload, chunks, joined=False):
                    return
            elif payload == b"[DONE]":  # (no JSON goes on so: the held line was cut, by a server
                raise ValueError("an event's JSON was cut short by [DONE]")  # that ends events with one line end)
            else:
                self._hold(payload)

    def _take(self, payload: bytes, chunks: list[dict[str, Any]], joined: bool) -> bool:
        """Read one event's data into `chunks`; True when it ends the stream ([DONE], an error).
        Data that opens a JSON object or array and only runs out (`joined` False) is held for the
        event's next `data:` lines. The data of an `event: error` is the error at once, whatever
        it holds (the stream ends there: no line after it is waited for)."""
        if self._event == b"error":
            self.failed = sent_error(self.provider_id, _said(payload, self.provider_id), self.limits.error_chars,
                                     self.provider_type, self.served)
            return True
        if payload == b"[DONE]":
            self.done = True
            return True
        if not payload:
            return False
        try:
            obj = parse_json(payload, self.provider_id)
        except ValueError as exc:
            if joined or payload[:1] not in (b"{", b"[") or not _runs_out(exc):
                raise
            self._hold(payload)
            return False
        error = error_in(obj)
        if error:
            self.failed = sent_error(self.provider_id, error, self.limits.error_chars, self.provider_type,
                                     self.served)
            return True
        if not isinstance(obj, dict) or not choices_usable(obj):
            self.non_objects.drop(obj)
            return False
        if aborted(obj):
            self.failed = aborted_error(self.provider_id)
            return True
        if self.shape is not None:
            try:
                self.shape(obj)
            except ProviderError as exc:
                self.failed = exc
                return True
        chunks.append(obj)
        return False

    def _hold(self, payload: bytes) -> None:
        if self._split is None:
            self._split = bytearray(payload)
        else:
            self._split += b"\n" + payload
        if len(self._split) > self.limits.line_bytes:
            raise self.limits.too_large(self.provider_id, "an event", self.limits.line_bytes)


def _runs_out(exc: ValueError) -> bool:
    """Whether JSON that did not parse only ran out: its error is at its end, so more lines may
    complete it (a JSON text split at its line ends is cut between tokens, never inside one). A
    line that is wrong before its end (`{overloaded}`, an unclosed string, bytes that are not
    UTF-8) fails at once, as any line that is not JSON."""
    return isinstance(exc, json.JSONDecodeError) and exc.pos >= len(exc.doc.rstrip())


def _said(payload: bytes, provider_id: str) -> Any:
    """What the data of an `event: error` says: its JSON's error, or the JSON, or the text."""
    try:
        said = parse_json(payload, provider_id) if payload else None
    except ValueError:
        return payload.decode(errors="replace")
    return error_in(said) or said or "an error it did not describe"


class OpenAICompatAdapter:
    def __init__(self, provider: ProviderConfig, session: aiohttp.ClientSession,
                 limits: ReadLimits = DEFAULT_LIMITS, proxy: Proxy | None = None) -> None:
        """`proxy`: the HTTP proxy its requests go through (`workers.adapters.proxies`), or none."""
        assert provider.base_url
        self.provider = provider
        self.session = session
        self.limits = limits
        self.credentials = Credentials(provider, proxy)
        self.root = api_root(provider.base_url, provider.type, provider.api_path)
        #: None once the server showed it has no health endpoint (the model list decides)
        self.health_url = health_url(provider)
        #: vLLM's `/is_sleeping`; None for other types, and once the server showed it has none
        self.sleep_url = (server_root(provider.base_url, provider.api_path) + SLEEP_PATH
                          if provider.type == "vllm" else None)
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=provider.connect_timeout_ms / 1000,
            sock_read=provider.read_timeout_ms / 1000,
        )
        #: the longest a read of an answer may take (`ReadWatch`: aiohttp's `sock_read` may be dropped)
        self.read_s = provider.read_timeout_ms / 1000
        #: a llama-server router's `GET /props` (`llamacpp` only)
        self.props_url = server_root(provider.base_url, provider.api_path) + PROPS_PATH
        #: whether the llama-server router there loads a model a run names: None until a probe finds
        #: a router, and again after a probe that failed (it may have been started anew, with other
        #: flags); False at once when a run there is refused as not loaded, and asked again at each
        #: probe while False
        self.router_autoload: bool | None = None
        #: a whole answer's head is waited for while the server's health check passes (`silence`):
        #: its probe, or where that disturbs a run (llama-cpp-python's model list) its health endpoint alone
        self.health_alone = provider.type in PROBE_DISTURBS
        #: that check, one for every silent whole answer here (`SharedCheck`)
        self.silence_check = SharedCheck(self._health_alone if self.health_alone else self.probe, self.read_s / 2)

    def _secrets(self) -> list[str]:
        return self.credentials.secrets()

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets())

    def _clean(self, exc: ProviderError) -> ProviderError:
        return redacted(exc, self._secrets())

    async def _raise_for(self, resp: aiohttp.ClientResponse, served: Any) -> None:
        """An error answer: a 4xx is the caller's (passed through, alive evidence); a 5xx, a 429 or
        a 404 naming the `served` model may go better on another provider."""
        if is_redirect(resp.status):
            raise redirect_error(self.provider.id, resp)
        if resp.status < 400:
            return
        text = await error_body(resp)
        try:  # (its object is passed on to the caller: no deeper than any answer)
            payload = parse_json(text.encode(), self.provider.id)
        except (ValueError, ProviderError):
            payload = None
        detail = _error_detail(payload)
        if isinstance(payload, dict) and isinstance(payload.get("detail"), str):
            text = payload["detail"]  # (FastAPI's error shape: its text, not the JSON around it)
        if detail is not None and detail.get("message"):  # (a message that is not text is shown as JSON)
            message = error_text(detail, self.limits.error_chars)
        elif detail is not None:  # (an error object without a message: its type, not the whole body)
            kind = detail.get("type")
            message = one_line(f"{kind if isinstance(kind, str) and kind else 'an error'} without a message",
                               self.limits.error_chars)
        else:
            message = one_line(without_traceback(text) or resp.reason or "no error text", self.limits.error_chars)
        if self.provider.type == "llamacpp" and resp.status == 400 and router_lacks(message, served):
            if message == ROUTER_NOT_LOADED:  # (it loads none itself: probes count only what it loaded)
                self.router_autoload = False
            raise ProviderError(f"provider {self.provider.id} answered 400: {message}", retry=Retry.ELSEWHERE,
                                strikes=None)
        error = answered_error(self.provider.id, resp.status, message, detail,
                               served if isinstance(served, str) else None, resp.headers)
        if (self.provider.type == "llamacpp" and resp.status == 400 and message.startswith(N_OVER_SLOTS)) or (
                self.provider.type == "vllm" and resp.status == 400 and message.startswith(N_GREEDY)):
            error = another_may(error)  # (a server with more slots takes it; one that serves n > 1 greedy)
        try:
            raise error
        finally:  # (held by this frame, which its traceback holds: a cycle left to the collector)
            del error

    def _post(self, kind: RunKind, body: dict[str, Any], run_id: str, *, may_load: bool = True,
              watch: SilenceWatch | None = None) -> Any:
        """POST a run's request; `may_load`: its server may load the model before it answers (the
        head's `load_timeout_ms`), false for one asked again once the server answered the same;
        `watch`: the head is waited for until it ends the wait."""
        if self.provider.type == "llamacpp":
            body = for_llamacpp(body)
        return sending.post(self.session, self.root + PATHS[kind], data=jsonio.dumps(body),
                            timeout=self.timeout,
                            head_wait_s=sending.NO_END if watch is not None else
                            self.provider.head_wait_s if may_load else None,
                            sent=watch.sent if watch is not None else None, allow_redirects=False,
                            **self.credentials.options(run_id, json_body=True))

    def _failed(self, exc: BaseException) -> ProviderError:
        return self._clean(transport_error(self.provider.id, exc, proxy=self.credentials.via.url,
                                           connect_ms=self.provider.connect_timeout_ms,
                                           read_ms=self.provider.read_timeout_ms))

    async def _whole(self, kind: RunKind, body: dict[str, Any], request_id: str) -> Any:
        """A whole answer's JSON. Its head is waited for while the server's health check passes
        (`silence`): its probe, or on llama.cpp its health endpoint alone (`_health_alone`)."""
        # (none on llama-cpp-python's server, which has no health endpoint: the silence ends the wait)
        watch = None if self.health_alone and self.health_url is None else \
            SilenceWatch(self.silence_check, self.provider.head_wait_s or self.read_s, self.read_s)
        try:
            async with self._post(kind, body, request_id, watch=watch) as resp:
                if watch is not None:
                    watch.close()
                await self._raise_for(resp, body.get("model"))
                return parse_json(await read_whole(resp, self.provider.id, self.limits, self.read_s), self.provider.id)
        except asyncio.CancelledError:
            if watch is None or not watch.ended_it():
                raise
            assert watch.failed is not None
            silent_ms = round((self.provider.head_wait_s or self.read_s) * 1000)
            then = "" if watch.failed is NO_HEALTH else \
                f" or more, and its health check then failed ({watch.failed.reason})"
            raise ProviderError(f"provider {self.provider.id}: sent nothing{' of its answer' if then else ''} for "
                                f"{silent_ms} ms{then}", retry=Retry.ELSEWHERE, strikes=1,
                                code=ErrorCode.PROVIDER_TIMEOUT) from None
        finally:
            if watch is not None:
                watch.close()

    async def _health_alone(self) -> ProbeResult:
        """A llama.cpp server's check while a whole answer is silent: its health endpoint alone.
        `llama-server` answers it beside its generations; llama-cpp-python's server has none
        (`NO_HEALTH`: the silence ends the wait, as it did), and its model list waits for the
        generation and may cut it short (`PROBE_DISTURBS`)."""
        if self.health_url is None:
            return NO_HEALTH
        status, said, failed = await self._get(self.health_url)
        if failed is not None:
            return failed
        if status in NO_SUCH_ENDPOINT and self.provider.probe_path is None:
            self.health_url = None  # (as the probe learns it: the model list decides from now on)
            return NO_HEALTH
        if status != 200:
            return probe_answered(f"GET {urlsplit(self.health_url).path}", status, said)
        return ProbeResult(Health.AVAILABLE, "", None, strikes=0)

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        try:
            data = await self._whole(kind, body, request_id)
        except ProviderError as exc:
            if exc.code is ErrorCode.OUTPUT_TOO_LARGE and kind is RunKind.EMBEDDING \
                    and body.get("encoding_format") != "base64":
                exc = ProviderError(f"{exc.message}: embeddings as encoding_format base64 take about a third of "
                                    "the bytes, or send fewer inputs", retry=exc.retry, strikes=exc.strikes,
                                    code=exc.code)
            raise self._clean(exc) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise self._failed(exc) from None
        if not isinstance(data, dict):
            raise ProviderError(f"provider {self.provider.id} answered with JSON that is not an object",
                                retry=Retry.ELSEWHERE, strikes=0)
        error = error_in(data)
        if error:  # (a 200 that carries only an error: never a completion for the caller)
            model = body.get("model")
            raise self._clean(sent_error(self.provider.id, error, self.limits.error_chars, self.provider.type,
                                         model if isinstance(model, str) else None))
        if not choices_usable(data):
            raise ProviderError(f"provider {self.provider.id} answered with choices that are not a list of objects, "
                                "each delta or message an object", retry=Retry.ELSEWHERE, strikes=0)
        if aborted(data):
            raise aborted_error(self.provider.id)
        if kind is not RunKind.EMBEDDING and not data.get("choices"):  # (a caller's client reads choices[0])
            raise ProviderError(f"provider {self.provider.id} answered with no choices", retry=Retry.ELSEWHERE,
                                strikes=0)
        if kind is not RunKind.EMBEDDING and len(data["choices"]) > (asked := choices_asked(kind, body)):
            raise answer_shapes.too_many_choices(self.provider.id, asked)
        decoded: dict[int, bytes] = {}  # (each base64 embedding's bytes, decoded once)
        problem = embeddings_problem(data, inputs(body.get("input")), decoded) if kind is RunKind.EMBEDDING else None
        if problem:
            raise ProviderError(f"provider {self.provider.id} answered embeddings {problem}", retry=Retry.ELSEWHERE,
                                strikes=0)
        if kind is RunKind.EMBEDDING:  # (a server that ignores the field answers numbers, or base64)
            if body.get("encoding_format") == "base64":
                self._in_base64(data)
            else:
                in_numbers(data, decoded)
            answer_shapes.embeddings(data)
        elif kind is RunKind.COMPLETION:
            answer_shapes.completion(data, request_id, int(time.time()), self.provider.id)
        else:
            answer_shapes.chat(data, request_id, int(time.time()), self.provider.id, body.get("functions") is not None)
        return data

    def _in_base64(self, data: dict[str, Any]) -> None:
        """An embeddings answer in base64, as its caller asked; else the error of one base64 cannot
        carry. One vector per token (a model without pooling) is the caller's 400 naming the field,
        unless another provider of the model pools: floats still come."""
        why = in_base64(data)
        if why == PER_TOKEN:
            error = not_taken(self.provider.id, f"the model answers {why} (its server pools none), which "
                              "encoding_format 'base64' cannot carry: ask for encoding_format 'float' (the "
                              "openai clients ask for base64 unless told)", "encoding_format")
            error.strikes = 0  # (it answered)
            raise self._clean(error)
        if why is not None:
            raise ProviderError(f"provider {self.provider.id} answered {why}", retry=Retry.ELSEWHERE, strikes=0)

    async def stream(self, kind: RunKind, body: dict[str, Any], request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        model = body.get("model")
        created = int(time.time())
        shape: Callable[[dict[str, Any]], None] | None = None
        #: the choices asked for: a stream's are numbered 0 to `choices`-1 (`answer_shapes.ChoiceIndices`)
        choices = choices_asked(kind, body)
        if kind is RunKind.CHAT:  # (every chunk of every chat stream: a fast path for one already right)
            shape = answer_shapes.chat_chunks(request_id, created, self.provider.id, choices,
                                              body.get("functions") is not None)
        elif kind is RunKind.COMPLETION:
            shape = answer_shapes.completion_chunks(request_id, created, self.provider.id, choices)
        parser = SSEParser(self.provider.id, self.limits, request_id, model if isinstance(model, str) else None,
                           self.provider.type, shape)
        #: every choice finished: the answer is whole
        finished = False
        #: the choices seen, and those that came with a finish_reason: once every one seen has, and
        #: at least `n`, what may still come is a usage chunk and [DONE], each within `FINISHED_GRACE_S`
        seen: set[int] = set()
        ended: set[int] = set()

        def whole(chunks: list[dict[str, Any]]) -> bool:
            """`chunks` finish every choice (with those before them)."""
            every, done = set(seen), set(ended)
            for chunk in chunks:
                marks = choice_marks(chunk)
                every.update(marks[0])
                done.update(marks[1])
            return all_ended(every, done, choices)

        parser.whole = whole
        #: nothing but blanks read yet (`head`): the first byte tells a JSON answer from events
        opening = True
        head = b""
        try:
            async with self._post(kind, body, request_id) as resp, ReadWatch(self.read_s) as watch:
                connection = sending.sent_on()
                await self._raise_for(resp, body.get("model"))
                #: when the grace ends (loop time), from the moment every choice had finished: bytes the
                #: provider sends meanwhile (a ping, an empty chunk) do not move it
                grace_ends: float | None = None
                while True:
                    if len(ended) < max(choices, len(seen)):  # (a choice still runs: no grace yet, or again)
                        grace_ends = None
                    elif grace_ends is None:
                        grace_ends = asyncio.get_running_loop().time() + FINISHED_GRACE_S
                    if grace_ends is None:
                        watch.reading = True  # (`watch.read`, inline: a coroutine less a read)
                        data = await resp.content.readany()
                        watch.reading = False
                        watch.reads += 1
                    else:
                        try:
                            async with asyncio.timeout_at(grace_ends):
                                data = await watch.read(resp.content.readany())
                        except TimeoutError:  # whole, though the provider neither said [DONE] nor closed
                            resp.close()
                            break
                    if not data:
                        if not (parser.done or finished):  # (cut short: its connection serves no other run)
                            sending.drop(self.session, connection)
                        chunks = parser.end()  # (an event the server did not end)
                    else:
                        if opening and not codecs.BOM_UTF8.startswith(head := head + data):  # (a BOM begun: wait)
                            start = head.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
                            head = b""  # (only blanks, or it is decided: nothing to keep)
                            if start:
                                opening = False
                                if start[:1] in (b"{", b"["):  # (whatever its Content-Type: Foundry Local's say JSON)
                                    raise await self._not_a_stream(resp, start, parser.served)
                                if start[:1] == b"<":  # (a page: a proxy's, a web UI's; never events)
                                    raise self._a_page(resp)
                        chunks = parser.feed(data)
                    if chunks:
                        for chunk in chunks:
                            every, done = choice_marks(chunk)
                            seen.update(every)
                            ended.update(done)
                        finished = all_ended(seen, ended, choices)
                        passing = parser.breaks.passing(chunks)
                        # (once every choice finished, what may follow is a usage chunk and [DONE])
                        yield LastRead(passing) if parser.done or finished else passing
                    if parser.failed:
                        raise parser.failed
                    if parser.breaks.broken:
                        if not (finished and isinstance(parser.breaks.broken, ValueError)):
                            raise parser.breaks.take()  # (not held in a local: it and this frame would hold each other)
                        parser.breaks.take()
                        self._garbled_after_whole(request_id, model)  # (the answer is whole: kept)
                        resp.close()
                        break
                    if not data:
                        break
                    if parser.done:
                        # the answer is whole: whatever the provider sends after [DONE] is not
                        # read, and a connection it keeps open is not waited on
                        if not resp.content.at_eof():
                            resp.close()
                        break
        except ProviderError as exc:
            raise self._clean(exc) from None
        except aiohttp.ClientPayloadError as exc:
            if not finished:  # broken only after a finish_reason: the whole answer came
                raise self._failed(exc) from None
            tail = parser.end()  # (a last event the server did not end: its usage chunk, say)
            if tail:
                yield tail
        except ValueError as exc:
            if not finished:
                raise self._failed(exc) from None
            self._garbled_after_whole(request_id, model)  # (its own read: nothing of the answer in it)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed(exc) from None
        if not parser.done and not finished and opening:
            # llama-cpp-python ends so a stream whose prompt is beyond its context: an answer of its
            # own (it would give it again), not a server in trouble (it took three strikes a run)
            empty = ProviderError(f"provider {self.provider.id}: the stream ended before any event", strikes=None,
                                  retry=Retry.ELSEWHERE)
            raise (await self._refusal_of(kind, body, request_id) or empty) if self.provider.type == "llamacpp" \
                else empty
        if not parser.done and not finished:
            # (a stream that ended after its finish_reason without [DONE] is whole: it is kept)
            raise ProviderError(f"provider {self.provider.id}: the stream ended before [DONE]", retry=Retry.ANY,
                                strikes=1)
        if not (ended and len(ended) >= len(seen)):
            # llama-cpp-python ends a stream this way when another request interrupts it. (After
            # [DONE], every choice sent is enough: a server that ignores `n`, as llama-cpp-python's
            # does, sends one; a stream that broke off needs every choice asked for.)
            which = "a finish_reason for every choice" if ended else "a finish_reason"
            raise ProviderError(f"provider {self.provider.id}: the stream was cut short ([DONE] without {which})",
                                retry=Retry.ANY)

    def _garbled_after_whole(self, request_id: str, model: Any) -> None:
        """A line that is no event after every choice had its finish_reason (`data: [done]`, say):
        the answer came whole, and is kept (it was a 502 after all of it); the rest is not read."""
        log.warning("provider %s sent a line that is not an event of JSON after the whole answer; the answer is "
                    "kept, the rest of its stream not read", self.provider.id,
                    extra=run_fields(request_id, model if isinstance(model, str) else None, provider=self.provider.id))

    async def _refusal_of(self, kind: RunKind, body: dict[str, Any], request_id: str) -> ProviderError | None:
        """Why a llama.cpp server ended a stream before any event, if it was the caller's request:
        llama-cpp-python's answers 200 and then nothing to a stream it refuses once begun (a prompt
        beyond its context above all), and a 400 saying why to the same asked for whole. So it is
        asked again so, for one token: its 400 (`context_length_exceeded`) is the caller's answer,
        not a 502 that the official clients send twice more; its 5xx says what failed (`invalid
        literal for int()`), where the stream said nothing. A whole answer, or none: None."""
        whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        try:  # (its server just answered the stream: the model is loaded, and its head is due within a read)
            async with self._post(kind, {**whole, "max_tokens": 1}, request_id, may_load=False) as resp:
                await self._raise_for(resp, body.get("model"))
        except ProviderError as exc:
            return self._clean(exc) if exc.status is not None else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return None

    async def _not_a_stream(self, resp: aiohttp.ClientResponse, first: bytes, served: str | None) -> ProviderError:
        """A stream asked for and one JSON answer given (it begins with `first`, where events begin
        with a field name): its error if it carries one (some servers answer an error so), else an
        answer iop cannot pass on as a stream. Neither is a strike."""
        rest = await read_at_most(resp, self.limits.response_bytes)  # (its Content-Length counts `first` too)
        if rest is None or len(first) + len(rest) > self.limits.response_bytes:
            raise self.limits.too_large(self.provider.id, "an answer", self.limits.response_bytes)
        error = error_in(parse_json(first + rest, self.provider.id))
        if error:
            return sent_error(self.provider.id, error, self.limits.error_chars, self.provider.type, served)
        return ProviderError(f"provider {self.provider.id} answered a stream request with one JSON answer, not "
                             "server-sent events", retry=Retry.ELSEWHERE, strikes=0)

    def _a_page(self, resp: aiohttp.ClientResponse) -> ProviderError:
        """A stream asked for and a page (HTML, XML) given: what a proxy or a web UI at `base_url`
        answers, as the whole answer's "not valid JSON" is: no strike, and another provider may
        serve the run (events that never came were read as a stream cut short: a strike an
        attempt, and every attempt on it)."""
        return ProviderError(f"provider {self.provider.id} answered a stream request with a page "
                             f"({one_line(resp.content_type, 100)}), not "
                             "server-sent events", retry=Retry.ELSEWHERE, strikes=0)

    async def _get(self, url: str) -> tuple[int, Any, ProbeResult | None]:
        """GET a probe URL: (status, its JSON or None, None), (an error status, what its body says,
        None), or the result that ends the probe.
        At most `limits.probe_limit` bytes are read; a redirect is not followed."""
        timeout = aiohttp.ClientTimeout(total=self.provider.probe_timeout_ms / 1000)
        path = urlsplit(url).path
        limit = self.limits.probe_limit
        try:
            async with self.session.get(url, timeout=timeout, allow_redirects=False,
                                        **self.credentials.options(None)) as resp:
                if is_redirect(resp.status):
                    return resp.status, None, redirect_probe(path, resp, self._secrets())
                if resp.status != 200:
                    return resp.status, self._redact(await probe_said(resp)), None
                data = await read_at_most(resp, limit)
                if data is None:
                    resp.close()
                    return 200, None, ProbeResult(Health.UNKNOWN, f"GET {path} answered more than {limit} bytes")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            failed = probe_failure(f"GET {path}", exc, self.provider.probe_timeout_ms, self.credentials.via.url)
            return 0, None, replace(failed, reason=self._redact(failed.reason))
        try:
            return 200, parse_json(data, self.provider.id), None
        except ValueError:
            return 200, None, None
        except ProviderError:
            return 200, None, ProbeResult(Health.UNKNOWN, f"GET {path} answered 200 with JSON nested too deep")

    async def _asleep(self) -> ProbeResult | None:
        """The probe's result when vLLM says it is asleep or paused (`SLEEP_PATH`): unavailable, as
        every run sent there would wait for `read_timeout_ms`. A server without the endpoint (not in
        dev mode: 404) is not asked again; one that does not answer it is judged as if it had none."""
        assert self.sleep_url is not None
        status, said, failed = await self._get(self.sleep_url)
        if failed is None and status in NO_SUCH_ENDPOINT:
            self.sleep_url = None
        elif failed is None and status == 200 and isinstance(said, dict) and said.get("is_sleeping") is True:
            return ProbeResult(Health.UNAVAILABLE, f"GET {SLEEP_PATH}: it is asleep or paused, and would hold every "
                               "run until woken (POST /wake_up, or /resume)")
        return None

    async def probe(self) -> ProbeResult:
        """`_probe`; a probe that failed forgets what a llama-server router said of loading models (it
        may have been started anew, with other flags)."""
        result = await self._probe()
        if result.health is not Health.AVAILABLE:
            self.router_autoload = None
        return result

    async def _router_serves(self, cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The cards of the models a llama.cpp server serves as it is. A llama-server router
        (`--models-dir`, `--models-preset`: its cards have a `status`) lists every model it has,
        loaded or not; by default it loads one a run names, so all count, but started with
        `--no-models-autoload` it refuses a run of one it has not loaded (`model is not loaded`), so
        only those it has loaded (or put to sleep) count. Whether it loads is asked of its `GET
        /props` when a probe first finds a router (`router_autoload`), and again at each probe while
        it said it loads none: started anew with its default between two probes (no probe failed),
        it would otherwise keep the models it has not loaded unlisted, and no run would ever load
        them (one that loads them says so no other way). One that loads them is not asked again: a
        run it refuses as not loaded says it stopped. A server that answers nothing there keeps
        what it was last known to serve, and is asked again at the next probe; one that answers an
        error keeps every model when nothing is known of it, but not once it said it loads none (an
        error is no word that it loads them)."""
        if not any(router_status(m) is not None for m in cards):
            self.router_autoload = None  # (no router, or none any more: asked again if one comes)
            return cards
        if self.router_autoload is not True:
            status, said, failed = await self._get(self.props_url)
            if failed is None and (status == 200 or self.router_autoload is None):
                self.router_autoload = not (status == 200 and loads_none(said))
            elif self.router_autoload is None:
                return cards
        return cards if self.router_autoload else [m for m in cards if router_status(m) in ROUTER_SERVES]

    async def _probe(self) -> ProbeResult:
        """Its health endpoint, if it has one, then its model list. A model list of OpenAI's shape,
        or a bare array of model objects (Together AI's); one page of a longer list (`has_more`) is
        not all it serves: as a list it cannot give (None), so no served name is missing from it, and so
        is the list of an API whose config says it does not list every name it takes (`models_listed:
        false`: Azure's lists models, not deployments; OpenRouter's leaves out `:nitro`). A
        hosted API (`openai_api`) whose `probe_path` (set in the config) answered 200 and that has no
        model list (404, 405, 501) lists none: one without `GET /models` could never be used. A hosted
        API's `models/<name>` (Gemini's) lists `<name>` too, the name its runs take."""
        health_said = False
        if self.health_url is not None:
            status, said, failed = await self._get(self.health_url)
            if failed is not None:
                return failed
            if status in NO_SUCH_ENDPOINT and self.provider.probe_path is None:
                self.health_url = None  # this server has none: the model list decides from now on
            elif status != 200:
                return probe_answered(f"GET {urlsplit(self.health_url).path}", status, said)
            else:  # (a hosted API only: vLLM's, SGLang's, llama.cpp's and Lemonade's 404 there is a wrong URL)
                health_said = self.provider.probe_path is not None and self.provider.type == "openai_api"
        if self.sleep_url is not None:
            asleep = await self._asleep()
            if asleep is not None:
                return asleep
        models_path = urlsplit(self.root).path + "/models"
        status, data, failed = await self._get(self.root + "/models")
        if failed is not None:
            return failed
        if status in NO_SUCH_ENDPOINT and health_said:
            return ProbeResult(Health.AVAILABLE, "", None, strikes=0)
        if status != 200:
            return probe_answered(f"GET {models_path}", status, data)
        listed = data.get("data") if isinstance(data, dict) else data
        if not isinstance(listed, list):
            return ProbeResult(Health.UNKNOWN, f"GET {models_path} answered 200 but not with a model list")
        if (isinstance(data, dict) and data.get("has_more") is True) or not self.provider.models_listed:
            return ProbeResult(Health.AVAILABLE, "", None, strikes=0)
        cards = [m for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if self.provider.type == "llamacpp":
            cards = await self._router_serves(cards)
        if self.provider.type == "sglang":  # (an adapter is taken only as `base:adapter`, and listed as `adapter`:
            # that name alone runs the base model, so the adapter is listed under the name SGLang takes only)
            models = [f"{m['parent']}:{m['id']}" if isinstance(m.get("parent"), str) and m["parent"] else m["id"]
                      for m in cards]
        else:
            models = [m["id"] for m in cards]
        if self.provider.type == "llamacpp":  # (llama-server lists one of its `-a a,b` names as the id, the
            # smallest, and every one under `aliases`: it takes each of them)
            models = list(dict.fromkeys(models + [alias for m in cards if isinstance(m.get("aliases"), list)
                                                  for alias in m["aliases"] if isinstance(alias, str) and alias]))
        if self.provider.type == "openai_api":  # (Gemini's endpoint lists `models/gemini-2.0-flash`, and its runs
            # take `gemini-2.0-flash`, as its docs send it: the name without the resource prefix is listed too)
            models = list(dict.fromkeys(models + [m.removeprefix(GOOGLE_MODEL_PREFIX) for m in models
                                                  if m.startswith(GOOGLE_MODEL_PREFIX)
                                                  and len(m) > len(GOOGLE_MODEL_PREFIX)]))
        return ProbeResult(Health.AVAILABLE, "", models, strikes=0)

    async def close(self) -> None:
        return None
