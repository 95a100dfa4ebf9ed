"""The operator routes and the load history against a hostile caller: bodies nested past
`runtime.max_json_depth`, digits that are digits to `str.isdigit` but not to `int` (or not ASCII),
stream ids Redis refuses, fields a route does not take, and values Python would show as `True`,
`None` or `inf`. Each is a 400 naming the field (or a clean answer), never a 500, and changes
nothing. Real Redis, the real gateway app on port 0."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from common import keys
from common.control import Action, Change, apply
from tests.openapi import validate
from tests.test_admin_api import OPEN, beat, call
from tests.test_catalog_api import serve

CAPACITY = "/v1/admin/providers/vllm-a/capacity"


def nested(levels: int) -> bytes:
    """`{"capacity": [[…]]}` with `levels` levels in all (the object is the first)."""
    return b'{"capacity":' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


def assert_400(status: int, error: dict[str, Any], param: str | None) -> str:
    assert status == 400, error
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "invalid_request_error" and error["error"]["param"] == param, error
    message: str = error["error"]["message"]
    return message


@pytest.mark.parametrize("path", ["providers/vllm-a/capacity", "providers/vllm-a/drain", "nodes/gpu-1/cordon"])
async def test_a_body_nested_past_the_recursion_limit_is_a_400(redis: Redis, redis_url: str, path: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("POST", f"{base}/v1/admin/{path}", raw=nested(10_000))
    message = assert_400(status, error, None)
    assert "nested deeper than 64 levels (runtime.max_json_depth)" in message
    assert await redis.keys("iop:*") == []


async def test_a_body_nested_past_max_json_depth_is_a_400_naming_where(redis: Redis, redis_url: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("POST", base + CAPACITY, raw=nested(65))  # parses, but one level too deep
        message = assert_400(status, error, "capacity" + "[0]" * 63)
        assert "nested deeper than 64 levels" in message
        drain = base + "/v1/admin/providers/vllm-a/drain"
        status, error, _ = await call("POST", drain, raw=b'{"x":' + nested(65) + b"}")
        assert_400(status, error, "x" + ".capacity" + "[0]" * 62)
    assert await redis.keys("iop:*") == []


@pytest.mark.parametrize(("raw", "param", "says", "not_says"), [
    (b'{"capacity": true}', "capacity", "capacity: true is not a whole number", "True"),
    (b'{"capacity": null}', "capacity", "capacity: null is not a whole number", "None"),
    (b'{"capacity": 1e400}', "capacity", "too large to be represented as a 64-bit float", "inf"),
    (b'{"capacity": [1, false]}', "capacity", "capacity: [1, false] is not a whole number", "False"),
    (b'{"capacity": {"n": null}}', "capacity", 'capacity: {"n": null} is not a whole number', "None"),
    (b'{"capacity": 2, "for": true}', "for", "for: true is not a duration", "True"),
    (b'{"capacity": 2, "for": 1e400}', "for", "too large to be represented as a 64-bit float", "inf"),
    (b'{"capacity": NaN}', None, "NaN is not valid JSON", "nan"),
    (b'{"capacity": -Infinity}', None, "-Infinity is not valid JSON", "inf,"),
])
async def test_messages_show_the_json_value_not_python_s(redis: Redis, redis_url: str, raw: bytes,
                                                        param: str | None, says: str, not_says: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("POST", base + CAPACITY, raw=raw)
    message = assert_400(status, error, param)
    assert says in message and not_says not in message
    assert await redis.keys("iop:*") == []


@pytest.mark.parametrize(("body", "param"), [
    ({"capacity": "\u00b2"}, "capacity"),  # superscript two: isdigit() yet int() refuses it
    ({"capacity": "\u0661"}, "capacity"),  # Arabic-Indic one: int() reads it as 1
    ({"capacity": " 2"}, "capacity"),
    ({"capacity": "9" * 5000}, "capacity"),  # more digits than int() converts
    ({"capacity": 2, "for": "\u0661h"}, "for"),
    ({"capacity": 2, "for": " 1h"}, "for"),
    ({"capacity": 2, "for": "1h\n"}, "for"),
    ({"capacity": 2, "for": "1h "}, "for"),
    ({"capacity": 2, "for": "9" * 5000 + "s"}, "for"),
])
async def test_only_ascii_digits_count_and_nothing_around_them(redis: Redis, redis_url: str, body: Any,
                                                               param: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("POST", base + CAPACITY, body=body)
    assert_400(status, error, param)
    assert await redis.keys("iop:*") == []


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "providers/vllm-a/drain"), ("POST", "providers/vllm-a/undrain"),
    ("POST", "nodes/gpu-1/cordon"), ("POST", "nodes/gpu-1/uncordon"), ("DELETE", "providers/vllm-a/capacity"),
])
async def test_a_route_without_fields_refuses_any_field_but_takes_an_empty_body(
        redis: Redis, redis_url: str, method: str, path: str) -> None:
    await beat(redis, OPEN)
    async with serve(OPEN, redis_url) as base:
        url = f"{base}/v1/admin/{path}"
        status, error, _ = await call(method, url, body={"x": 1})
        message = assert_400(status, error, "x")
        assert "unknown field 'x': this route takes no fields" in message
        status, error, _ = await call(method, url, body={"for": "1h", "capacity": 2})
        assert_400(status, error, "capacity")  # the first in order
        assert not await redis.exists(keys.AUDIT_STREAM)  # nothing was changed
        for empty in (b"", b"{}", b" { } "):
            status, answer, _ = await call(method, url, raw=empty)
            assert status == 200 and answer["object"] == "control.change", (empty, answer)


@pytest.mark.parametrize(("query", "param"), [
    ("limit=\u00b2", "limit"), ("limit=\u0661", "limit"), ("limit=" + "9" * 5000, "limit"),
    ("before=1-", "before"), ("before=\u00b2", "before"), ("before=\u0661", "before"), ("before=1-\u0661", "before"),
    ("before=" + "9" * 5000, "before"), ("before=1-" + "9" * 5000, "before"),
])
async def test_bad_audit_pages_are_a_400_naming_the_parameter(redis: Redis, redis_url: str, query: str,
                                                              param: str) -> None:
    await apply(redis, OPEN, Change(Action.DRAIN, "vllm-a", "ops"))
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("GET", f"{base}/v1/admin/audit?{query}")
    assert_400(status, error, param)


async def test_a_page_before_the_first_possible_id_is_empty(redis: Redis, redis_url: str) -> None:
    await apply(redis, OPEN, Change(Action.DRAIN, "vllm-a", "ops"))
    async with serve(OPEN, redis_url) as base:
        for before in ("0-0", "0", "0-1", "00-0"):
            status, page, _ = await call("GET", f"{base}/v1/admin/audit?before={before}")
            assert status == 200 and page == {"object": "list", "data": []}, before
        status, page, _ = await call("GET", f"{base}/v1/admin/audit?before=18446744073709551615-18446744073709551615")
        assert status == 200 and [e["action"] for e in page["data"]] == ["drain"]


@pytest.mark.parametrize("since", ["\u00b2", "\u0661", "9" * 5000])
async def test_a_bad_history_since_is_a_400(redis_url: str, since: str) -> None:
    async with serve(OPEN, redis_url) as base:
        status, error, _ = await call("GET", f"{base}/v1/catalog/history?since={since}")
    assert_400(status, error, "since")
