"""Pure tests of request-body validation (gateway/requests.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.wire import ErrorCode, RunKind
from gateway.errors import ApiError
from gateway.requests import ParsedRequest, parse_request

CHAT = RunKind.CHAT
COMPLETION = RunKind.COMPLETION
EMBEDDING = RunKind.EMBEDDING

MESSAGES = [{"role": "user", "content": "hi"}]
#: a minimal valid body per kind
MINIMAL: dict[RunKind, dict[str, Any]] = {
    CHAT: {"model": "m", "messages": MESSAGES},
    COMPLETION: {"model": "m", "prompt": "hi"},
    EMBEDDING: {"model": "m", "input": "hi"},
}


def body(kind: RunKind, **fields: Any) -> bytes:
    """The minimal valid body of `kind` with `fields` set (a value of ... removes the field)."""
    data = dict(MINIMAL[kind])
    for key, value in fields.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    return json.dumps(data).encode()


def rejected(kind: RunKind, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, raw)
    return info.value


# (id, kind, raw body, expected param, fragment of the message)
INVALID: list[tuple[str, RunKind, bytes, str | None, str]] = [
    ("invalid-json", CHAT, b'{"model": "m",', None, "not valid JSON"),
    ("empty-body", CHAT, b"", None, "not valid JSON"),
    ("invalid-utf8", CHAT, b'{"model": "\xff\xfe\xfa"}', None, "not valid JSON"),
    ("invalid-utf8-completion", COMPLETION, b'{"model": "m", "prompt": "\xc3\x28"}', None, "not valid JSON"),
    ("body-is-array", CHAT, b"[]", None, "must be a JSON object"),
    ("body-is-string", COMPLETION, b'"hello"', None, "must be a JSON object"),
    ("body-is-null", EMBEDDING, b"null", None, "must be a JSON object"),
    ("body-is-number", CHAT, b"42", None, "must be a JSON object"),
    # model
    ("model-missing", CHAT, body(CHAT, model=...), "model", "'model' is required"),
    ("model-empty", COMPLETION, body(COMPLETION, model=""), "model", "non-empty string"),
    ("model-null", EMBEDDING, body(EMBEDDING, model=None), "model", "non-empty string"),
    ("model-number", CHAT, body(CHAT, model=3), "model", "non-empty string"),
    ("model-list", CHAT, body(CHAT, model=["m"]), "model", "non-empty string"),
    # chat messages
    ("messages-missing", CHAT, body(CHAT, messages=...), "messages", "'messages' is required"),
    ("messages-empty", CHAT, body(CHAT, messages=[]), "messages", "non-empty array"),
    ("messages-object", CHAT, body(CHAT, messages={"role": "user"}), "messages", "non-empty array"),
    ("messages-string", CHAT, body(CHAT, messages="hi"), "messages", "non-empty array"),
    ("messages-null", CHAT, body(CHAT, messages=None), "messages", "non-empty array"),
    ("message-not-object", CHAT, body(CHAT, messages=[*MESSAGES, "hi"]), "messages[1]", "must be an object"),
    ("message-is-list", CHAT, body(CHAT, messages=[["user", "hi"]]), "messages[0]", "must be an object"),
    ("message-role-missing", CHAT, body(CHAT, messages=[{"content": "hi"}]), "messages[0].role",
     "must be a string"),
    ("message-role-number", CHAT, body(CHAT, messages=[*MESSAGES, {"role": 1, "content": "x"}]),
     "messages[1].role", "must be a string"),
    ("message-role-null", CHAT, body(CHAT, messages=[{"role": None, "content": "x"}]), "messages[0].role",
     "must be a string"),
    # completion prompt
    ("prompt-missing", COMPLETION, body(COMPLETION, prompt=...), "prompt", "'prompt' is required"),
    ("prompt-dict", COMPLETION, body(COMPLETION, prompt={"text": "hi"}), "prompt", "must be a string"),
    ("prompt-empty-list", COMPLETION, body(COMPLETION, prompt=[]), "prompt", "must not be an empty list"),
    ("prompt-mixed-list", COMPLETION, body(COMPLETION, prompt=["a", 1]), "prompt", "must be a string"),
    ("prompt-mixed-nested", COMPLETION, body(COMPLETION, prompt=[[1, 2], "a"]), "prompt", "must be a string"),
    ("prompt-number", COMPLETION, body(COMPLETION, prompt=5), "prompt", "must be a string"),
    ("prompt-null", COMPLETION, body(COMPLETION, prompt=None), "prompt", "must be a string"),
    ("prompt-bools-are-not-tokens", COMPLETION, body(COMPLETION, prompt=[True, False]), "prompt",
     "must be a string"),
    ("prompt-floats-are-not-tokens", COMPLETION, body(COMPLETION, prompt=[1.5, 2.0]), "prompt",
     "must be a string"),
    ("prompt-token-list-with-string", COMPLETION, body(COMPLETION, prompt=[[1, "a"]]), "prompt",
     "must be a string"),
    # embeddings input
    ("input-missing", EMBEDDING, body(EMBEDDING, input=...), "input", "'input' is required"),
    ("input-dict", EMBEDDING, body(EMBEDDING, input={"a": 1}), "input", "must be a string"),
    ("input-empty-list", EMBEDDING, body(EMBEDDING, input=[]), "input", "must not be an empty list"),
    ("input-mixed-list", EMBEDDING, body(EMBEDDING, input=["a", 1]), "input", "must be a string"),
    ("input-null", EMBEDDING, body(EMBEDDING, input=None), "input", "must be a string"),
    # stream
    ("stream-string", CHAT, body(CHAT, stream="true"), "stream", "must be a boolean"),
    ("stream-number", COMPLETION, body(COMPLETION, stream=1), "stream", "must be a boolean"),
    ("stream-on-embeddings", EMBEDDING, body(EMBEDDING, stream=True), "stream", "cannot be streamed"),
    ("stream-non-bool-on-embeddings", EMBEDDING, body(EMBEDDING, stream="yes"), "stream",
     "must be a boolean"),
    ("stream-options-list", CHAT, body(CHAT, stream=True, stream_options=["include_usage"]), "stream_options",
     "must be an object"),
    ("stream-options-string", COMPLETION, body(COMPLETION, stream_options="x"), "stream_options",
     "must be an object"),
    ("include-usage-string", CHAT, body(CHAT, stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage", "must be a boolean"),
    ("include-usage-null", CHAT, body(CHAT, stream=True, stream_options={"include_usage": None}),
     "stream_options.include_usage", "must be a boolean"),
    ("include-usage-number", COMPLETION, body(COMPLETION, stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage", "must be a boolean"),
    # (OpenAI answers so: "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    ("stream-options-without-stream", CHAT, body(CHAT, stream_options={"include_usage": True}), "stream_options",
     "only allowed when 'stream' is true"),
    ("stream-options-stream-false", COMPLETION, body(COMPLETION, stream=False, stream_options={}), "stream_options",
     "only allowed when 'stream' is true"),
    ("stream-options-on-embeddings", EMBEDDING, body(EMBEDDING, stream_options={"include_usage": True}),
     "stream_options", "only allowed when 'stream' is true"),
]


@pytest.mark.parametrize(("kind", "raw", "param", "fragment"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_request(kind: RunKind, raw: bytes, param: str | None, fragment: str) -> None:
    err = rejected(kind, raw)
    assert err.status == 400
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.param == param
    assert fragment in err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": param,
                  "code": "invalid_request_error"}
    }


def test_invalid_json_message_names_the_problem() -> None:
    err = rejected(CHAT, b'{"model": "m",')
    assert err.message.startswith("the request body is not valid JSON: ")
    assert len(err.message) > len("the request body is not valid JSON: ")


@pytest.mark.parametrize(("raw", "at"), [
    (b'{"model": "\xff\xfe\xfa"}', 11),
    (b'{"model": "m", "prompt": "\xc3\x28"}', 26),
    (b'\xef\xbb\xbf{"model": "\xff"}', 14),  # after a byte-order mark: still the offset in the body
], ids=["invalid-start-byte", "invalid-continuation-byte", "after-a-bom"])
def test_a_body_that_is_not_utf8_is_told_in_plain_words_with_the_offset(raw: bytes, at: int) -> None:
    err = rejected(COMPLETION, raw)
    assert raw[at] >= 0x80
    assert err.message == f"the request body is not valid JSON: it is not valid UTF-8 text (at byte {at})"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_body_in_utf16_or_utf32_is_not_json_here(encoding: str) -> None:
    """The README's error table: a body that is not UTF-8 is a 400 (Python's json would read
    these)."""
    err = rejected(CHAT, '{"model": "m", "messages": [{"role": "user", "content": "x"}]}'.encode(encoding))
    assert err.message.startswith("the request body is not valid JSON: ")


def test_model_is_checked_before_the_prompt() -> None:
    assert rejected(CHAT, b"{}").param == "model"
    assert rejected(COMPLETION, b'{"prompt": 5}').param == "model"


def test_each_kind_checks_only_its_own_field() -> None:
    # a chat body is not a valid completion, and the other way round
    assert rejected(COMPLETION, body(CHAT)).param == "prompt"
    assert rejected(EMBEDDING, body(COMPLETION)).param == "input"
    assert rejected(CHAT, body(EMBEDDING)).param == "messages"


# (id, kind, body)
VALID: list[tuple[str, RunKind, dict[str, Any]]] = [
    ("chat-minimal", CHAT, MINIMAL[CHAT]),
    ("chat-with-everything", CHAT, {
        "model": "qwen3.6:35b",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "s", "schema": {"type": "object"}}},
        "temperature": 0.2, "top_p": 1, "max_tokens": 64, "seed": 7, "n": 1, "stop": ["\n"],
        "logit_bias": {"50256": -100}, "user": "u-1", "metadata": {"nested": {"deep": [1, 2, {"x": None}]}},
        "vendor_extension": {"a": [True, False]},
        "stream": True, "stream_options": {"include_usage": True},
    }),
    ("chat-stream-null", CHAT, {"model": "m", "messages": MESSAGES, "stream": None}),
    ("chat-stream-options-null-without-stream", CHAT, {"model": "m", "messages": MESSAGES,
                                                       "stream_options": None}),
    ("chat-stream-options-empty", CHAT, {"model": "m", "messages": MESSAGES, "stream": True,
                                         "stream_options": {}}),
    ("chat-stream-options-unknown-key", CHAT, {"model": "m", "messages": MESSAGES, "stream": True,
                                               "stream_options": {"something": 1}}),
    ("completion-str", COMPLETION, {"model": "m", "prompt": "once upon"}),
    ("completion-empty-str", COMPLETION, {"model": "m", "prompt": ""}),
    ("completion-list-of-str", COMPLETION, {"model": "m", "prompt": ["a", "b"]}),
    ("completion-token-ids", COMPLETION, {"model": "m", "prompt": [1, 2, 3]}),
    ("completion-list-of-token-ids", COMPLETION, {"model": "m", "prompt": [[1, 2], [3]]}),
    ("completion-with-extras", COMPLETION, {"model": "m", "prompt": "x", "echo": True, "logprobs": 2,
                                            "suffix": "end", "best_of": 2, "stream": False}),
    ("embedding-str", EMBEDDING, {"model": "m", "input": "text"}),
    ("embedding-list-of-str", EMBEDDING, {"model": "m", "input": ["a", "b"]}),
    ("embedding-token-ids", EMBEDDING, {"model": "m", "input": [1, 2]}),
    ("embedding-list-of-token-ids", EMBEDDING, {"model": "m", "input": [[1], [2, 3]]}),
    ("embedding-stream-false", EMBEDDING, {"model": "m", "input": "x", "stream": False,
                                           "encoding_format": "float", "dimensions": 256}),
]


@pytest.mark.parametrize(("kind", "data"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_body_passes_through_untouched(kind: RunKind, data: dict[str, Any]) -> None:
    raw = json.dumps(data).encode()
    parsed = parse_request(kind, raw)
    assert isinstance(parsed, ParsedRequest)
    assert parsed.kind is kind
    assert parsed.model == data["model"]
    assert parsed.stream is bool(data.get("stream"))
    assert parsed.body == data
    assert json.dumps(parsed.body) == json.dumps(data)  # same keys in the same order


def test_utf8_content_is_decoded() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "안녕 🙂"}]},
                     ensure_ascii=False).encode("utf-8")
    parsed = parse_request(CHAT, raw)
    assert parsed.body["messages"][0]["content"] == "안녕 🙂"


@pytest.mark.parametrize(("kind", "stream"), [(CHAT, True), (CHAT, False), (COMPLETION, True),
                                              (COMPLETION, False), (EMBEDDING, False)])
def test_stream_flag(kind: RunKind, stream: bool) -> None:
    assert parse_request(kind, body(kind, stream=stream)).stream is stream
    assert parse_request(kind, body(kind)).stream is False


@pytest.mark.parametrize(("kind", "raw", "param"), [
    (COMPLETION, body(COMPLETION, prompt=[[]]), "prompt"),
    (COMPLETION, body(COMPLETION, prompt=[[1], []]), "prompt"),
    (EMBEDDING, body(EMBEDDING, input=[[1], []]), "input"),
    (CHAT, b'{"model": "m", "messages": [{"role": "user"}], "temperature": NaN}', None),
    (CHAT, b'{"model": "m", "messages": [{"role": "user"}], "top_p": Infinity}', None),
])
def test_empty_token_lists_and_non_json_numbers_are_rejected(kind: RunKind, raw: bytes, param: str | None) -> None:
    err = rejected(kind, raw)
    assert err.status == 400 and err.param == param


def nested(depth: int) -> str:
    """JSON arrays nested `depth` levels deep."""
    return "[" * depth + "]" * depth


# (id, raw body, expected param, fragment of the message): JSON that Python parses but a run cannot carry
UNREPRESENTABLE: list[tuple[str, bytes, str | None, str]] = [
    # parsed (orjson reads up to 1,024 levels): the path where the limit was passed is named
    ("nested-1000", b'{"model": "m", "messages": [{"role": "user"}], "x": ' + nested(1000).encode() + b"}",
     "x" + "[0]" * 63, "nested deeper than 64 levels"),
    # too deep to parse at all: no path
    ("nested-2000", b'{"model": "m", "messages": [{"role": "user"}], "x": ' + nested(2000).encode() + b"}",
     None, "nested deeper than 64 levels"),
    ("nested-15000", b'{"model": "m", "x": ' + nested(15_000).encode() + b"}", None,
     "nested deeper than 64 levels"),
    ("nested-65", b'{"model": "m", "messages": [{"role": "user"}], "x": ' + nested(64).encode() + b"}",
     "x" + "[0]" * 63, "nested deeper than 64 levels"),
    ("lone-surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content", "lone UTF-16 surrogate"),
    ("lone-low-surrogate-in-a-list", b'{"model": "m", "messages": [{"role": "user"}], "stop": ["a", "\\udfff"]}',
     "stop[1]", "lone UTF-16 surrogate"),
    ("lone-surrogate-in-a-key", b'{"model": "m", "messages": [{"role": "user"}], "meta": {"\\ud800": 1}}',
     "meta.\\ud800", "object key holds a lone UTF-16 surrogate"),
    ("lone-surrogate-model", b'{"model": "\\ud83d", "messages": [{"role": "user"}]}', "model",
     "lone UTF-16 surrogate"),
    ("int-2**64", b'{"model": "m", "messages": [{"role": "user"}], "seed": 18446744073709551616}', "seed",
     "integer is out of range"),
    ("int-below-int64", b'{"model": "m", "messages": [{"role": "user"}], "seed": -9223372036854775809}', "seed",
     "integer is out of range"),
    ("huge-int-in-tokens", b'{"model": "m", "messages": [{"role": "user"}], "logit_bias": {"1": '
     + str(10**40).encode() + b"}}", "logit_bias.1", "integer is out of range"),
    ("float-overflow", b'{"model": "m", "messages": [{"role": "user"}], "temperature": 1e400}', "temperature",
     "too large to be represented as a 64-bit float"),
    ("negative-float-overflow-in-a-list", b'{"model": "m", "messages": [{"role": "user"}], "x": [1.5, -1e999]}',
     "x[1]", "too large to be represented as a 64-bit float"),
]


@pytest.mark.parametrize(("raw", "param", "fragment"), [c[1:] for c in UNREPRESENTABLE],
                         ids=[c[0] for c in UNREPRESENTABLE])
def test_json_a_run_cannot_carry_is_a_400_naming_the_problem(raw: bytes, param: str | None, fragment: str) -> None:
    err = rejected(CHAT, raw)
    assert err.status == 400 and err.code is ErrorCode.INVALID_REQUEST
    assert err.param == param
    assert fragment in err.message
    json.dumps(err.body())  # the answer itself can be sent


@pytest.mark.parametrize(("value", "ok"), [
    (2**64 - 1, True), (2**64, False), (-(2**63), True), (-(2**63) - 1, False),
])
def test_integer_range_is_exactly_what_msgpack_holds(value: int, ok: bool) -> None:
    raw = body(CHAT, seed=value)
    if ok:
        assert parse_request(CHAT, raw).body["seed"] == value
    else:
        assert rejected(CHAT, raw).param == "seed"


@pytest.mark.parametrize("limit", [2, 8, 64, 256])
def test_depth_limit_is_exact(limit: int) -> None:
    # the body is level 1, "x" level 2: arrays nested limit - 1 deep fill it exactly
    fits = '{"model": "m", "messages": [{"role": "user"}], "x": ' + nested(limit - 1) + "}"
    too_deep = '{"model": "m", "messages": [{"role": "user"}], "x": ' + nested(limit) + "}"
    if limit >= 3:  # `messages[0]` itself is level 3
        assert parse_request(CHAT, fits.encode(), max_depth=limit).body["x"]
    err = rejected_with(CHAT, too_deep.encode(), max_depth=limit)
    assert err.status == 400 and f"deeper than {limit} levels" in err.message


def rejected_with(kind: RunKind, raw: bytes, **options: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, raw, **options)
    return info.value


@pytest.mark.parametrize("container", [b"[]", b"{}", b"[0]"])
def test_more_arrays_and_objects_than_the_limit_are_refused_before_parsing(container: bytes) -> None:
    """Parsing and walking a body cost a few microseconds an array or object: a hostile caller's
    7.7 MiB of `[]` (8 KiB gzipped) held the gateway's one thread for 5 s. Those outside strings
    are counted on the raw text first; brackets inside strings (escaped quotes too) count nothing."""
    def with_x(n: int, item: bytes) -> bytes:
        return b'{"model": "m", "messages": [{"role": "user"}], "x": [' + b",".join([item] * n) + b"]}"

    err = rejected_with(CHAT, with_x(97, container), max_containers=100)  # (4 of the body's own, 97 in x)
    assert err.status == 400 and err.param is None
    assert err.message == "the request body holds more than 100 JSON arrays and objects (runtime.max_json_containers)"
    assert parse_request(CHAT, with_x(96, container), max_containers=100).body["x"][0] is not None
    text = '[{\\"quoted\\": [1]}, "' + "[" * 500 + '" ' + "{" * 500
    many_in_text = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    assert parse_request(CHAT, many_in_text, max_containers=4).body["messages"][0]["content"] == text


@pytest.mark.parametrize(("raw", "over"), [
    (b'{"a": "[[[", "b": [[]]}', False),  # (brackets in a string count nothing)
    (b'{"a": "\\\\", "b": [[[[]]]]}', True),  # (an escaped backslash ends no string)
    (b'{"a": "\\"[[[[[[", "b": 1}', False),  # (an escaped quote ends no string)
    (b"[" * 5 + b'\\"' * 200_000, True),  # (quotes that open strings never ended: read once,
    (b"[" * 5 + b'\\"' * 200_000 + b"\\", True),  # not again from each quote inside: 31 s a
    (b'["' + b"[" * 200_000, False),  # 80 KB before; what follows a string never ended is in it)
    (b"[" * 5 + b'""' * 1000, True),  # (empty strings hide nothing)
    (b'["a""[[[[[", "[", {"[": "{"}]', False),  # (one string's end next to the next's start)
    (b'["\\\\\\"[[[[[", [[[[', True),  # (an escaped backslash, then an escaped quote)
])
def test_containers_are_counted_outside_strings_in_one_read_of_the_text(raw: bytes, over: bool) -> None:
    from gateway.body_limits import too_many_containers

    assert too_many_containers(raw, 4) is over


def test_the_queued_body_is_the_parsed_body() -> None:
    from common.codec import unpack

    data = {"model": "m", "messages": [{"role": "user", "content": "안녕 🙂"}], "seed": 2**64 - 1,
            "temperature": 1e308, "x": [None, True, -(2**63)]}
    parsed = parse_request(CHAT, json.dumps(data, ensure_ascii=False).encode())
    assert parsed.packed is not None and unpack(parsed.packed) == data


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"x": [0] * 1000 + ["\ud800", 2**64]}, "x[1000]", "lone UTF-16 surrogate"),
    ({"x": [0] * 1000 + [2**64, "\ud800"]}, "x[1000]", "integer is out of range"),
    ({"x": [True, -(2**63) - 1, None, 1.5]}, "x[1]", "integer is out of range"),
    ({"x": ["a", "\ud83d", "\ude00"]}, "x[1]", "lone UTF-16 surrogate"),  # (two halves are not a pair)
    ({"x": {"a": 1, "\udfff": 2}}, "x.\\udfff", "object key holds a lone UTF-16 surrogate"),
    ({"x": [[0] * 10, {"y": [0, 2**70]}]}, "x[1].y[1]", "integer is out of range"),
])
def test_a_body_is_checked_for_the_wire_in_bulk(monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], param: str,
                                               fragment: str) -> None:
    """Each container's scalars are checked at once, one by one only where a fault is: one by one
    in Python, 4 million numbers held the gateway's thread for 4-6 s, in every Responses request
    (checked before it is translated) and in a chat request with a fault anywhere; the fault found
    is the first of its container."""
    from gateway import body_limits

    checked: list[Any] = []
    one = body_limits._scalar_problem

    def counted(value: Any, place: body_limits.Place) -> body_limits.Problem | None:
        checked.append(value)
        return one(value, place)

    monkeypatch.setattr(body_limits, "_scalar_problem", counted)
    assert body_limits.wire_problem({"x": list(range(100_000)), "y": ["é"] * 100_000, "z": [None, 1.5] * 1000}) is None
    assert checked == []
    problem = body_limits.wire_problem(body)
    assert problem is not None and problem.param == param and fragment in problem.message
    assert len(checked) <= 1


@pytest.mark.parametrize(("kind", "body"), [
    (RunKind.COMPLETION, {"prompt": [7] * 100_000}),
    (RunKind.COMPLETION, {"prompt": ["a"] * 100_000}),
    (RunKind.COMPLETION, {"prompt": [7] * 100_000 + ["a"]}),
    (RunKind.EMBEDDING, {"input": [7] * 100_000}),
    (RunKind.EMBEDDING, {"input": ["a"] * 100_000}),
])
def test_a_long_prompt_is_typed_in_bulk(monkeypatch: pytest.MonkeyPatch, kind: RunKind, body: dict[str, Any]) -> None:
    """A prompt's or an input's items are typed at once (`map(type)`), not with an `isinstance` an
    item: 4 million token ids took 0.3 s of the gateway's thread that way, on top of the parse."""
    import builtins

    from common import choices
    from gateway import requests

    calls = [0]

    def counted(value: Any, kinds: Any) -> bool:
        calls[0] += 1
        return builtins.isinstance(value, kinds)

    for module in (requests, choices):
        monkeypatch.setattr(module, "isinstance", counted, raising=False)
    try:
        parse_request(kind, json.dumps({"model": "m", **body}).encode())
    except ApiError as exc:
        assert exc.status == 400  # (too many inputs, or a list of text and numbers)
    assert calls[0] < 100
