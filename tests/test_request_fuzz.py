"""Property-based fuzzing of the request schemas (hypothesis).

Bodies are drawn from the shapes of the three OpenAI requests (chat `messages`, completion
`prompt`, embeddings `input`, `model`, `stream`, `stream_options`), each part mostly right and
sometimes any JSON at all, with what Python parses but a run cannot carry mixed in: lone
surrogates, integers outside msgpack's range, numbers that overflow a float, deep nesting, and
bytes that are not JSON. Two properties:

- `parse_request` either accepts a body (and the queued msgpack is that body) or raises a 400
  `ApiError`; never anything else.
- The real `iop gateway` process answers every such request that it must not queue with an
  OpenAI-shaped 4xx, never a 5xx, and queues nothing for it, while a provider is available (so
  a valid request would be queued: `test_a_valid_request_is_queued_so_the_fuzz_check_can_fail`).
"""

from __future__ import annotations

import http.client
import json
import socket
import zlib
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis as sync_redis
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from common.codec import unpack
from common.wire import ErrorCode, RunKind
from gateway.errors import ApiError
from gateway.refusals import Refusal, refusing
from gateway.requests import ParsedRequest, parse_request
from tests.conftest import Stack, wait_until

MODEL = "qwen3.6:35b"
PATHS = {RunKind.CHAT: "/v1/chat/completions", RunKind.COMPLETION: "/v1/completions",
         RunKind.EMBEDDING: "/v1/embeddings"}
PROMPT_FIELD = {RunKind.CHAT: "messages", RunKind.COMPLETION: "prompt", RunKind.EMBEDDING: "input"}

# Any Unicode text, lone surrogates included (hypothesis leaves them out unless told).
TEXT = st.text(st.characters(exclude_categories=()), max_size=8)
INTS = (st.integers() | st.integers(min_value=2**64 - 2, max_value=2**64 + 2)
        | st.integers(min_value=-(2**63) - 2, max_value=-(2**63) + 2))
SCALARS = st.none() | st.booleans() | INTS | st.floats(allow_nan=False, allow_infinity=False) | TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                        max_leaves=12)
# What a run can carry: text without surrogates, integers msgpack holds.
SAFE_TEXT = st.text(max_size=8)
SAFE_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
SAFE_JSON = st.recursive(st.none() | st.booleans() | SAFE_INTS | st.floats(allow_nan=False, allow_infinity=False)
                         | SAFE_TEXT,
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SAFE_TEXT, inner, max_size=3),
                         max_leaves=8)

# Request bodies as the schemas describe them.
ROLE = st.sampled_from(["system", "user", "assistant", "tool"])
CONTENT = SAFE_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SAFE_TEXT}), max_size=2)
MESSAGE = st.fixed_dictionaries({"role": ROLE}, optional={"content": CONTENT, "name": SAFE_TEXT})
TOKENS = st.lists(SAFE_INTS, min_size=1, max_size=3)
PROMPTS: dict[RunKind, st.SearchStrategy[Any]] = {
    RunKind.CHAT: st.lists(MESSAGE, min_size=1, max_size=3),
    RunKind.COMPLETION: SAFE_TEXT | st.lists(SAFE_TEXT, min_size=1, max_size=3) | TOKENS
    | st.lists(TOKENS, min_size=1, max_size=2),
    RunKind.EMBEDDING: SAFE_TEXT | st.lists(SAFE_TEXT, min_size=1, max_size=3) | TOKENS
    | st.lists(TOKENS, min_size=1, max_size=2),
}
#: JSON text Python parses into something a run cannot carry, or refuses outright.
ODD_VALUES = (st.sampled_from(["1e400", "-1e999", str(2**64), str(-(2**63) - 1), "NaN", "Infinity", '"\\udfff"',
                               '{"\\ud800": 1}'])
              | st.integers(min_value=0, max_value=1_500).map(lambda n: "[" * n + "]" * n))


def valid_bodies(kind: RunKind) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"model": st.sampled_from([MODEL, "no-such-model"]), PROMPT_FIELD[kind]: PROMPTS[kind]},
        optional={"stream": st.booleans() if kind is not RunKind.EMBEDDING else st.just(False),
                  "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                  "temperature": st.floats(0, 2), "seed": SAFE_INTS, "metadata": SAFE_JSON})


def _with(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    return {**body, field: value}


def _splice(body: dict[str, Any], raw_value: str) -> bytes:
    """`body` as JSON with one more field whose value is `raw_value`, as written."""
    text = json.dumps(body)
    return (text[:-1] + (", " if body else "") + f'"odd": {raw_value}' + "}").encode()


def raw_bodies(kind: RunKind) -> st.SearchStrategy[bytes]:
    valid = valid_bodies(kind)
    fields = st.sampled_from(["model", PROMPT_FIELD[kind], "stream", "stream_options", "seed", "metadata"])
    return st.one_of(
        valid.map(lambda b: json.dumps(b).encode()),
        st.builds(_with, valid, fields, ANY_JSON).map(lambda b: json.dumps(b).encode()),  # one field anything
        st.builds(_splice, valid, ODD_VALUES),
        ANY_JSON.map(lambda v: json.dumps(v).encode()),
        valid.map(lambda b: json.dumps(b).encode()[:-1]),  # cut short
        st.binary(max_size=48),
    )


KIND_AND_BODY = st.sampled_from(list(RunKind)).flatmap(lambda k: st.tuples(st.just(k), raw_bodies(k)))


def parsed_or_400(parse: Callable[[], ParsedRequest]) -> ParsedRequest | None:
    """What `parse` made of a body, or None when it refused it, as it must: a 400 `ApiError`
    whose body is JSON (anything else it raises fails the test). Counts each kind for hypothesis."""
    try:
        parsed = parse()
    except ApiError as err:
        event("rejected")
        assert err.status == 400 and err.code is ErrorCode.INVALID_REQUEST, err.body()
        json.dumps(err.body())
        return None
    event("accepted")
    return parsed


@given(KIND_AND_BODY)
@settings(max_examples=400)
def test_parsing_any_body_accepts_it_or_is_a_400(kind_and_raw: tuple[RunKind, bytes]) -> None:
    kind, raw = kind_and_raw
    parsed = parsed_or_400(lambda: parse_request(kind, raw))
    if parsed is not None:
        assert parsed.packed is not None and unpack(parsed.packed) == parsed.body


def _queues_it(kind: RunKind, raw: bytes) -> bool:
    """Whether the gateway would queue this body (valid, and for the configured model)."""
    try:
        return parse_request(kind, raw).model == MODEL
    except ApiError:
        return False


def _config() -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"max_body_bytes": 4096},
    }


@pytest.fixture
def gateway(stack: Stack, redis_url: str) -> Iterator[tuple[str, int]]:
    stack.write_config(_config())
    url = urlsplit(stack.gateway())
    client = sync_redis.Redis.from_url(redis_url)
    # An available provider: a valid request for the model would be queued.
    client.hset("iop:provider:p", mapping={"health": "available", "capacity": 1})
    client.close()
    assert url.hostname is not None and url.port is not None
    yield url.hostname, url.port


def _nothing_queued(redis_url: str) -> bool:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        return bool(client.xlen(f"iop:runs:{MODEL}") == 0 and not client.keys("iop:run:*"))
    finally:
        client.close()


ENCODINGS = st.sampled_from([None, "identity", "gzip", "deflate", "br", "x-unknown"])


def _encoded(raw: bytes, encoding: str | None, compress: bool) -> bytes:
    if compress and encoding == "deflate":
        return zlib.compress(raw)
    if compress and encoding == "gzip":
        c = zlib.compressobj(wbits=31)
        return c.compress(raw) + c.flush()
    return raw


@given(kind_and_raw=KIND_AND_BODY, content_type=st.sampled_from(["application/json", "text/plain", "", "x/y; a=b"]),
       encoding=ENCODINGS, compress=st.booleans())
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_gateway_answers_bad_requests_with_a_4xx_and_queues_nothing(
        gateway: tuple[str, int], redis_url: str, kind_and_raw: tuple[RunKind, bytes], content_type: str,
        encoding: str | None, compress: bool) -> None:
    kind, raw = kind_and_raw
    assume(not _queues_it(kind, raw))  # a valid request would wait for its run: not what is checked here
    headers = {"Content-Type": content_type} if content_type else {}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    conn = http.client.HTTPConnection(*gateway, timeout=30)
    try:
        conn.request("POST", PATHS[kind], body=_encoded(raw, encoding, compress), headers=headers)
        resp = conn.getresponse()
        status, text = resp.status, resp.read()
    finally:
        conn.close()
    event(f"status {status}")
    assert 400 <= status < 500, (status, text)
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert _nothing_queued(redis_url)


def test_a_valid_request_is_queued_so_the_fuzz_check_can_fail(gateway: tuple[str, int], redis_url: str) -> None:
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert _queues_it(RunKind.CHAT, raw)
    with socket.create_connection(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        wait_until(lambda: not _nothing_queued(redis_url), what="the valid run to be queued")
    # The caller left: its run leaves the queue (its record stays, cancelled, for run_ttl_s).
    client = sync_redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: client.xlen(f"iop:runs:{MODEL}") == 0, what="the abandoned run to leave the queue")
        [record] = client.keys("iop:run:*")
        assert client.hget(record, "state") == b"cancelled"
    finally:
        client.close()


@given(KIND_AND_BODY)
@settings(max_examples=400)
def test_the_providers_that_would_refuse_any_accepted_body_are_told_without_an_error(
        kind_and_raw: tuple[RunKind, bytes]) -> None:
    """`gateway.refusals` writes each accepted request as Ollama's and a CLI tool's adapters would:
    it names the providers that would refuse it, or all of them refuse it (a 400), never anything
    else (a 500)."""
    kind, raw = kind_and_raw
    parsed = parsed_or_400(lambda: parse_request(kind, raw))
    if parsed is None:
        return
    for types in ({"c": "cli", "o": "ollama", "v": "vllm"}, {"o": "ollama"}, {"c": "cli"}):
        try:
            refused = refusing(parsed.kind, parsed.body, parsed.stream, types)
        except Refusal as refusal:
            event("refused everywhere")
            assert str(refusal)
            continue
        assert set(refused) <= set(types) - {"v"} and len(refused) < len(types)
