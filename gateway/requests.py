"""Validation of OpenAI request bodies. Pure: bytes in, `ParsedRequest` or `ApiError` out.

Only what the gateway itself needs is checked (the model, the prompt the kind requires,
`stream`, `stream_options`) and what any body must be to be queued (`gateway.body_limits`:
depth, finite numbers, text and integers msgpack can hold); every other field passes through
to the provider untouched.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common import choices, jsonio
from common.codec import pack
from common.config import RuntimeConfig
from common.wire import RunKind
from gateway.body_limits import depth_problem, too_many_containers, wire_problem
from gateway.errors import ApiError, invalid
from gateway.responses_places import Origin
from gateway.responses_request import to_chat

#: The run routes (POST) and the kind of run each asks for.
RUN_ROUTES = {"/v1/chat/completions": RunKind.CHAT, "/v1/completions": RunKind.COMPLETION,
              "/v1/embeddings": RunKind.EMBEDDING}
#: OpenAI's Responses API: a chat completion run, its request and answer translated
#: (`gateway.responses_request`, `gateway.responses_output`)
RESPONSES_PATH = "/v1/responses"
#: each run route's `endpoint` label in the metrics
ENDPOINTS = {**{path: kind.value for path, kind in RUN_ROUTES.items()}, RESPONSES_PATH: "responses"}

DEFAULT_MAX_DEPTH: int = RuntimeConfig().max_json_depth
DEFAULT_MAX_CONTAINERS: int = RuntimeConfig().max_json_containers
DEFAULT_MAX_CHOICES: int = RuntimeConfig().max_choices
DEFAULT_MAX_INPUTS: int = RuntimeConfig().max_inputs


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: RunKind
    model: str
    stream: bool
    body: dict[str, Any]
    #: the body as msgpack, as it is queued (None: not packed yet)
    packed: bytes | None = None
    #: a Responses API request's fields that its answer repeats (None: not such a request)
    echo: dict[str, Any] | None = None
    #: where each message of a Responses API request's chat completion came from
    origins: tuple[Origin, ...] = ()


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and choices.only(value, int)


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's `json` takes them, JSON has no such values."""


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not valid JSON")


def _check_prompt(body: dict[str, Any]) -> None:
    if "prompt" not in body:
        raise invalid("'prompt' is required", "prompt")
    prompt = body["prompt"]
    ok = (
        isinstance(prompt, str)
        or (isinstance(prompt, list) and prompt and (
            choices.only(prompt, str)
            or _is_token_list(prompt)
            or all(_is_token_list(p) for p in prompt)
        ))
    )
    if prompt == []:
        raise invalid("'prompt' must not be an empty list", "prompt")
    if not ok:
        raise invalid("'prompt' must be a string, a list of strings, or a list of token ids", "prompt")


def _check_messages(body: dict[str, Any]) -> None:
    if "messages" not in body:
        raise invalid("'messages' is required", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"'messages[{i}]' must be an object", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise invalid(f"'messages[{i}].role' must be a string", f"messages[{i}].role")


def _check_input(body: dict[str, Any]) -> None:
    if "input" not in body:
        raise invalid("'input' is required", "input")
    value = body["input"]
    ok = isinstance(value, str) or (isinstance(value, list) and value and (
        choices.only(value, str) or _is_token_list(value) or all(_is_token_list(v) for v in value)
    ))
    if value == []:
        raise invalid("'input' must not be an empty list", "input")
    if not ok:
        raise invalid("'input' must be a string, a list of strings, or a list of token ids", "input")


def _check_stream(body: dict[str, Any], kind: RunKind) -> bool:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    stream = bool(stream)
    if stream and kind is RunKind.EMBEDDING:
        raise invalid("embeddings cannot be streamed", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        if "include_usage" in options and not isinstance(options["include_usage"], bool):
            raise invalid("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
        if not stream:  # (as OpenAI and vLLM answer: a server would ignore it, or refuse it)
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream


_CHECKS = {RunKind.CHAT: _check_messages, RunKind.COMPLETION: _check_prompt, RunKind.EMBEDDING: _check_input}


def _not_text(raw: bytes, exc: UnicodeDecodeError) -> str:
    """Why a body is not text, in plain words (Python's codec message quotes the byte and names
    the codec): its encoding and the offset of the first byte at fault."""
    at = exc.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
    return f"it is not valid {exc.encoding.upper()} text (at byte {at})"


def _pack(body: dict[str, Any]) -> bytes:
    """The body as it is queued; what msgpack cannot hold (a lone surrogate, an integer outside
    [-2**63, 2**64)) is the caller's fault, named by `wire_problem`."""
    try:
        return pack(body)
    except (UnicodeEncodeError, OverflowError, ValueError, TypeError) as exc:
        problem = wire_problem(body)
        if problem is None:
            raise invalid(f"the request body cannot be stored: {exc}") from None
        raise invalid(problem.message, problem.param) from None


def query_value(request: web.Request, name: str, default: str | None = None) -> str | None:
    """The value of query parameter `name` (`default` when absent); one given twice is a 400, not
    its first value taken silently (`?key=a&key=b` asked for two keys' usage, and got one's)."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise invalid(f"{name}: given {len(values)} times; give it once", name)
    return values[0] if values else default


def json_object(raw: bytes, max_depth: int, max_containers: int = DEFAULT_MAX_CONTAINERS) -> dict[str, Any]:
    """A request body as a JSON object, as every route that takes one reads it; else a 400 that
    says why: more than `max_containers` arrays and objects (before it is parsed), not UTF-8
    (where), not JSON (the parser's words), NaN or Infinity, nested deeper than `max_depth`
    (where), or not an object. Python's own advice (an integer of more digits than it converts) is
    not passed on."""
    if too_many_containers(raw, max_containers):
        raise invalid(f"the request body holds more than {max_containers} JSON arrays and objects "
                      "(runtime.max_json_containers)")
    try:
        body = jsonio.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {_not_text(raw, exc)}") from None
    except (json.JSONDecodeError, _NotJson) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise invalid("the request body is not valid JSON") from None
    except RecursionError:
        raise invalid(f"the request body is nested deeper than {max_depth} levels (runtime.max_json_depth)") \
            from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    problem = depth_problem(body, max_depth)
    if problem is not None:
        raise invalid(problem.message, problem.param)
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string", "model")
    return model


def parse_request(kind: RunKind, raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH,
                  max_containers: int = DEFAULT_MAX_CONTAINERS, max_choices: int = DEFAULT_MAX_CHOICES,
                  max_inputs: int = DEFAULT_MAX_INPUTS) -> ParsedRequest:
    body = json_object(raw, max_depth, max_containers)
    model = _model(body)
    try:
        _CHECKS[kind](body)
        stream = _check_stream(body, kind)
        if (too_much := choices.problem(kind, body, max_choices, max_inputs)) is not None:
            raise invalid(*too_much)
        packed = _pack(body)
    except ApiError as exc:
        exc.model = model  # (the gateway's metrics count it under the model, if it is one)
        raise
    return ParsedRequest(kind=kind, model=model, stream=stream, body=body, packed=packed)


def parse_responses(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH,
                    max_containers: int = DEFAULT_MAX_CONTAINERS) -> ParsedRequest:
    """A Responses API request as the chat completion run it becomes."""
    body = json_object(raw, max_depth, max_containers)
    model = _model(body)
    try:
        stream = _check_stream(body, RunKind.CHAT)
        problem = wire_problem(body)  # (before it is translated: `param` names the caller's own field)
        if problem is not None:
            raise invalid(problem.message, problem.param)
        translated = to_chat(body, stream)
        packed = _pack(translated.chat)
    except ApiError as exc:
        exc.model = model
        raise
    return ParsedRequest(kind=RunKind.CHAT, model=model, stream=stream, body=translated.chat, packed=packed,
                         echo=translated.echo, origins=translated.origins)
