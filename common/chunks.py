"""What a streamed OpenAI chunk carries, for the worker (what counts as output) and the gateway
(time to first token), and how a run's `delta` events carry chunks.

A `delta` event's data holds its chunks as the caller's SSE text, written once by the worker:
`sse` (bytes: a `data: {chunk}\n\n` line a chunk, each chunk saying the caller's model id), and
`text: true` on the run's first event whose chunks carry generated output (for the time to first
token). The gateway writes `sse` to a streaming caller as it is; whoever wants the chunks as
objects (the runs API, `iop runs`) reads them back with `delta_chunks`. Events written the
earlier way (`chunks`: a list of chunk objects, by a worker of an earlier version during an
upgrade) read the same.
"""

from __future__ import annotations

from typing import Any

import orjson

from common.codec import BIG_INT, SURROGATE, Unpackable
from common.jsonio import dumps, loads

#: How many objects and arrays a chunk written as JSON may nest, itself included (orjson's limit).
JSON_DEPTH = 254

#: Fields of a chunk's `delta` that carry generated output.
OUTPUT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call", "refusal")


def carries_output(chunk: Any) -> bool:
    """Generated text, reasoning or a tool call (the opening `role` delta carries none)."""
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and any(delta.get(f) for f in OUTPUT_FIELDS)):
            return True
    return False


def finishes(chunk: Any) -> bool:
    """A choice of the chunk ends with a `finish_reason`."""
    return isinstance(chunk, dict) and any(
        isinstance(c, dict) and c.get("finish_reason") for c in chunk.get("choices") or ())


def is_preamble(chunk: Any) -> bool:
    """Nothing but an opening: no output, no finish, no usage. A stream cut short after such
    chunks has shown the caller nothing, so it may still be tried again."""
    return not (carries_output(chunk) or finishes(chunk) or (isinstance(chunk, dict) and chunk.get("usage")))


def wants_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`: the stream ends with a chunk carrying only usage."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_in(chunks: list[Any]) -> dict[str, Any] | None:
    """The last `usage` object the chunks carry, if any."""
    found = None
    for chunk in chunks:
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if isinstance(usage, dict):
            found = usage
    return found


def without_usage(chunks: list[Any]) -> list[Any]:
    """The chunks as a caller that did not ask for usage gets them: no `usage` field, and no
    chunk that carried only usage (`choices: []`). The chunks are changed in place (a provider
    asked for usage puts `"usage": null` in every chunk: no copy of each)."""
    out = []
    for chunk in chunks:
        if isinstance(chunk, dict) and "usage" in chunk:
            if chunk.get("choices") == []:
                continue
            del chunk["usage"]
        out.append(chunk)
    return out


def token_counts(usage: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a `usage` object; 0 for what it lacks."""
    if not isinstance(usage, dict):
        return 0, 0

    def count(name: str) -> int:
        value = usage.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    return count("prompt_tokens"), count("completion_tokens")


def with_model(obj: Any, model_id: str) -> Any:
    """The caller always sees the model id it sent, never a provider's served name: every
    response and chunk (a dict) says `model`, whether the provider's had one or not."""
    if isinstance(obj, dict):
        obj["model"] = model_id
    return obj


def as_sse(chunks: list[Any], model_id: str) -> bytes:
    """The chunks as SSE lines, each (a dict) saying `model_id`. A chunk JSON cannot carry exactly
    raises `Unpackable`, naming what: an integer beyond 64 bits, a lone surrogate, nesting deeper
    than `JSON_DEPTH`."""
    try:
        return b"".join([b"data: " + orjson.dumps({**c, "model": model_id} if isinstance(c, dict) else c) + b"\n\n"
                         for c in chunks])
    except TypeError as exc:  # (orjson.JSONEncodeError)
        text = str(exc)
        if "64-bit" in text:
            raise Unpackable(BIG_INT) from None
        if "surrogate" in text:
            raise Unpackable(SURROGATE) from None
        if "Recursion" in text:
            raise Unpackable(f"data nested deeper than {JSON_DEPTH} levels") from None
        raise Unpackable(text.rstrip(".")) from None


def delta_data(chunks: list[Any], model_id: str, text_sent: bool) -> dict[str, Any]:
    """The data of a `delta` event holding these chunks (`as_sse`: `Unpackable` for a chunk JSON
    cannot carry exactly); marked `text` when they carry output and no earlier one did
    (`text_sent`)."""
    data: dict[str, Any] = {"sse": as_sse(chunks, model_id)}
    if not text_sent and any(carries_output(c) for c in chunks):
        data["text"] = True
    return data


def delta_sse(data: dict[str, Any], model_id: str) -> bytes:
    """A `delta` event's chunks as the caller's SSE lines."""
    sse = data.get("sse")
    if isinstance(sse, bytes):
        return sse
    return b"".join([b"data: " + dumps(with_model(c, model_id)) + b"\n\n" for c in data.get("chunks") or ()])


def delta_chunks(data: dict[str, Any], model_id: str) -> list[Any]:
    """A `delta` event's chunks as objects, each saying `model_id`."""
    sse = data.get("sse")
    if isinstance(sse, bytes):
        return [loads(line[len(b"data: "):]) for line in sse.split(b"\n\n") if line]
    return [with_model(c, model_id) for c in data.get("chunks") or ()]


def delta_has_text(data: dict[str, Any]) -> bool:
    """Whether a `delta` event is marked as holding its run's first generated output."""
    if "sse" in data:
        return data.get("text") is True
    return any(carries_output(c) for c in data.get("chunks") or ())
