"""Pure tests of the OpenAI-shaped errors (gateway/errors.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from common.api_error import RETRY_AFTER_MS_HEADER, spread
from common.shown import printable, quoted
from common.wire import ErrorCode, ErrorInfo, busy, callers_fault
from gateway.errors import STATUS, ApiError, from_status, invalid
from tests.openapi import validate

ERROR_KEYS = {"message", "type", "param", "code"}


def test_every_error_code_has_a_status() -> None:
    assert set(STATUS) == set(ErrorCode)
    for code, status in STATUS.items():
        assert 400 <= status <= 599, code


@pytest.mark.parametrize(("code", "status"), [
    # DESIGN.md, "HTTP surface"
    (ErrorCode.INVALID_REQUEST, 400),
    (ErrorCode.MODEL_NOT_FOUND, 404),
    (ErrorCode.QUEUE_FULL, 429),
    (ErrorCode.NO_AVAILABLE_PROVIDER, 503),
    (ErrorCode.QUEUE_TIMEOUT, 504),
    (ErrorCode.PROVIDER_ERROR, 502),
    (ErrorCode.REQUEST_TOO_LARGE, 413),
    (ErrorCode.REQUEST_TIMEOUT, 408),
    (ErrorCode.UNAVAILABLE, 503),
    (ErrorCode.INTERNAL, 500),
])
def test_documented_statuses(code: ErrorCode, status: int) -> None:
    assert STATUS[code] == status
    assert ApiError(code, "x").status == status


@pytest.mark.parametrize("code", list(ErrorCode))
def test_body_shape_for_every_code(code: ErrorCode) -> None:
    err = ApiError(code, f"failed: {code.value}")
    body = err.body()
    assert list(body) == ["error"]
    assert set(body["error"]) == ERROR_KEYS
    assert body["error"]["message"] == f"failed: {code.value}"
    assert body["error"]["code"] == code.value
    assert body["error"]["param"] is None
    expected_type = "invalid_request_error" if STATUS[code] < 500 else "server_error"
    if code is ErrorCode.RATE_LIMIT_EXCEEDED:
        expected_type = "requests"  # as OpenAI's own 429 for a limit on requests
    if code is ErrorCode.QUEUE_FULL:
        expected_type = "server_error"  # (the pool is overloaded: not the request's fault)
    assert body["error"]["type"] == expected_type
    json.dumps(body)  # serialisable


def test_invalid_helper() -> None:
    err = invalid("'messages' is required", "messages")
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.status == 400
    assert str(err) == "'messages' is required"
    assert err.body() == {"error": {"message": "'messages' is required", "type": "invalid_request_error",
                                    "param": "messages", "code": "invalid_request_error"}}
    assert invalid("bad").param is None


def test_explicit_status_and_headers() -> None:
    err = ApiError(ErrorCode.QUEUE_FULL, "queue full", headers={"Retry-After": "1"})
    assert err.status == 429
    assert err.headers == {"Retry-After": "1"}
    err = ApiError(ErrorCode.INVALID_REQUEST, "gone", status=410)
    assert err.status == 410
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert ApiError(ErrorCode.INTERNAL, "x").headers == {}


def test_response_carries_status_headers_and_body() -> None:
    err = ApiError(ErrorCode.QUEUE_FULL, "the queue of model m is full", headers={"Retry-After": "2"})
    assert err.body()["error"]["type"] == "server_error"  # (not the request's fault: the pool is busy)
    resp = err.response()
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "2"
    assert resp.content_type == "application/json"
    assert resp.text is not None
    assert json.loads(resp.text) == err.body()


PROVIDER_DETAIL: dict[str, Any] = {
    "message": "This model's maximum context length is 4096 tokens.",
    "type": "BadRequestError",
    "param": "messages",
    "code": "context_length_exceeded",
}


@pytest.mark.parametrize("status", [401, 403, 407, 409])
def test_a_provider_s_4xx_that_is_the_pool_s_fault_is_a_502(status: int) -> None:
    """Its refusal of iop's own credentials: the caller's key and request were fine, so the caller
    does not get the provider's 401 (its client would take its own key for refused; found by a
    hostile-provider audit). Nor its 409, a conflict with its own state (Lemonade: every slot
    pinned). (Its rate limit: a 503, below.)"""
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider a answered 401: bad key", status=status,
                     detail=PROVIDER_DETAIL)
    err = ApiError.from_info(info)
    assert err.status == 502 and err.body()["error"]["message"] == "provider a answered 401: bad key"


@pytest.mark.parametrize("status", [400, 404, 413, 422, 499])
def test_from_info_passes_provider_4xx_through(status: int) -> None:
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider said no", status=status,
                     detail={**PROVIDER_DETAIL, "extra": "dropped"})
    err = ApiError.from_info(info)
    assert err.status == status
    assert err.code is ErrorCode.PROVIDER_ERROR
    assert err.body() == {"error": PROVIDER_DETAIL}


def test_from_info_4xx_detail_missing_fields_fall_back() -> None:
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider said no", status=400,
                     detail={"message": "bad field"})
    body = ApiError.from_info(info).body()
    assert body == {"error": {"message": "bad field", "type": "invalid_request_error", "param": None,
                              "code": "provider_error"}}


@pytest.mark.parametrize("detail", [None, {}, {"message": 5}, {"error": {"message": "nested"}}])
def test_from_info_4xx_without_usable_detail_uses_own_message(detail: dict[str, Any] | None) -> None:
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider answered 422", status=422, detail=detail)
    err = ApiError.from_info(info)
    assert err.status == 422
    assert err.body() == {"error": {"message": "provider answered 422", "type": "invalid_request_error",
                                    "param": None, "code": "provider_error"}}


@pytest.mark.parametrize("status", [500, 502, 504, None, 302])
def test_from_info_provider_non_4xx_maps_to_502(status: int | None) -> None:
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider failed", status=status, detail=PROVIDER_DETAIL)
    err = ApiError.from_info(info)
    assert err.status == 502
    # the provider's own body is not passed through for a server error
    assert err.body() == {"error": {"message": "provider failed", "type": "server_error", "param": None,
                                    "code": "provider_error"}}


@pytest.mark.parametrize("code", [ErrorCode.QUEUE_TIMEOUT, ErrorCode.EXECUTION_TIMEOUT, ErrorCode.WORKER_LOST,
                                  ErrorCode.NO_AVAILABLE_PROVIDER, ErrorCode.CANCELLED, ErrorCode.PROVIDER_TIMEOUT])
def test_from_info_run_failures_use_their_status(code: ErrorCode) -> None:
    err = ApiError.from_info(ErrorInfo(code, "nope"))
    assert err.status == STATUS[code]
    # (another try would wait as long again, or run as long again: the official clients are told not to)
    assert (err.headers.get("x-should-retry") == "false") is (code in (
        ErrorCode.QUEUE_TIMEOUT, ErrorCode.EXECUTION_TIMEOUT, ErrorCode.PROVIDER_TIMEOUT))
    assert err.body()["error"]["code"] == code.value
    assert err.body()["error"]["message"] == "nope"


def test_a_run_the_pool_let_go_says_when_to_send_it_again() -> None:
    """Its gateway paused past its liveness (the scheduler cancelled its runs), or Redis lost part
    of its output: a 503 with `Retry-After`, as a stopping gateway's (a chaos soak: it had none)."""
    err = ApiError.from_info(ErrorInfo.from_wire(ErrorInfo(ErrorCode.UNAVAILABLE, "send the request again").to_wire()))
    assert (err.status, err.headers) == (503, {"Retry-After": "1"})


@pytest.mark.parametrize(("status", "retry_after_s", "expected"), [(429, 7, "7"), (503, None, "1"), (503, 0, "1")])
def test_a_provider_too_busy_for_the_run_is_a_503_that_says_when(status: int, retry_after_s: int | None,
                                                                  expected: str) -> None:
    """Its rate limit or overload, on the last provider tried: the pool is busy, not the caller's
    request at fault (no 429: the caller's client would take its own key for limited), and the
    caller's client waits what the provider asked for (`Retry-After`) before it tries again."""
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, f"provider a answered {status}: busy", status=status,
                     detail=PROVIDER_DETAIL, retry_after_s=retry_after_s)
    err = ApiError.from_info(ErrorInfo.from_wire(info.to_wire()))
    assert (err.status, err.headers) == (503, {"Retry-After": expected})
    assert err.body() == {"error": {"message": f"provider a answered {status}: busy", "type": "server_error",
                                    "param": None, "code": "provider_error"}}


@pytest.mark.parametrize("said", [-1, 61, "7", 7.0, True])
def test_a_retry_after_on_the_wire_that_iop_would_not_write_is_dropped(said: Any) -> None:
    wire = {**ErrorInfo(ErrorCode.PROVIDER_ERROR, "busy", status=429).to_wire(), "retry_after_s": said}
    assert ErrorInfo.from_wire(wire).retry_after_s is None


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_run_failed_because_every_provider_went_down_says_when_to_retry(code: ErrorCode) -> None:
    """A run whose model's providers all went down while it waited gets `Retry-After` as a request
    the gateway refuses itself for the same reason does (found by a caller's audit: the first call
    after the only provider died got none, the next ones did); no other run failure says a time, but
    one the pool let go (`test_a_run_the_pool_let_go_says_when_to_send_it_again`)."""
    headers = ApiError.from_info(ErrorInfo(code, "nope")).headers
    assert ("Retry-After" in headers) is (code in (ErrorCode.NO_AVAILABLE_PROVIDER, ErrorCode.UNAVAILABLE))
    if "Retry-After" in headers:
        assert headers["Retry-After"] == "1"


def test_a_raw_response_is_a_whole_http_response_with_the_same_body() -> None:
    err = ApiError(ErrorCode.UNAVAILABLE, "full", headers={"Retry-After": "1"})
    head, _, body = err.raw_response().partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    ids = [line for line in lines[1:] if line.startswith("X-Request-Id: ")]
    assert len(ids) == 1 and re.fullmatch(r"X-Request-Id: req_[0-9a-f]{32}", ids[0])  # (each answer its own)
    spreads = [line for line in lines[1:] if line.startswith("retry-after-ms: ")]
    assert len(spreads) == 1 and 1000 <= int(spreads[0].partition(": ")[2]) < 2000
    assert {"Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close",
            "Retry-After: 1"} == set(lines[1:]) - set(ids) - set(spreads)
    assert json.loads(body) == err.body()
    assert ids[0] not in err.raw_response().decode()


@pytest.mark.parametrize(("after", "low", "high"), [("1", 1000, 2000), ("3", 3000, 6000), ("30", 30_000, 35_000),
                                                    ("58", 58_000, 60_001), ("60", 60_000, 60_001)])
def test_a_wait_said_in_seconds_is_said_again_in_milliseconds_spread_over_up_to_as_many_more(
        after: str, low: int, high: int) -> None:
    """Callers refused together (a full queue, no provider available) all came back at the second
    `Retry-After` said, to be mostly refused again: `retry-after-ms`, which the official clients
    read first, adds a random part (never past 60 s in all: a client takes a longer one for none)."""
    seen = {int(spread({"Retry-After": after})[RETRY_AFTER_MS_HEADER]) for _ in range(300)}
    assert all(low <= ms < high for ms in seen), seen
    assert len(seen) > 1 or low == 60_000  # (spread, not one wait for all)


@pytest.mark.parametrize("headers", [{}, {"Retry-After": "0"}, {"Retry-After": "61"}, {"Retry-After": "soon"},
                                     {"Retry-After": "1", "retry-after-ms": "1500"}])
def test_no_spread_where_there_is_no_wait_in_seconds_to_spread_or_one_in_milliseconds_already(
        headers: dict[str, str]) -> None:
    assert spread(headers) == headers


@pytest.mark.parametrize(("status", "code"), [(400, "invalid_request_error"), (404, "not_found"),
                                              (405, "method_not_allowed"), (413, "request_too_large"),
                                              (431, "invalid_request_error"), (500, "internal_error")])
def test_statuses_aiohttp_gives_alone_get_a_code(status: int, code: str) -> None:
    err = from_status(status, "x")
    assert err.status == status and err.body()["error"]["code"] == code


@pytest.mark.parametrize(("given", "shown"), [
    ({"code": 400, "param": None}, {"code": "400", "param": None}),  # vLLM's code is the status
    ({"code": None, "param": None}, {"code": None, "param": None}),  # as OpenAI's own often is
    ({"code": True, "param": ["a"]}, {"code": "provider_error", "param": None}),
    ({"code": "", "param": "temperature"}, {"code": "provider_error", "param": "temperature"}),
    ({"type": 123}, {"type": "invalid_request_error", "code": "provider_error", "param": None}),  # (was "123")
    ({"type": [[1]]}, {"type": "invalid_request_error", "code": "provider_error", "param": None}),
])
def test_a_provider_4xx_s_code_and_param_are_passed_as_openai_s_schema_has_them(
        given: dict[str, Any], shown: dict[str, Any]) -> None:
    """A string or null each: what is neither is made one (a number in digits) or left out."""
    info = ErrorInfo(ErrorCode.PROVIDER_ERROR, "provider said no", status=400,
                     detail={"message": "no", "type": "BadRequestError", **given})
    body = ApiError.from_info(info).body()
    assert body == {"error": {"message": "no", "type": "BadRequestError", **shown}}
    validate("ErrorResponse", body)


@pytest.mark.parametrize(("sent", "shown"), [
    ("qwen3.6:35b", '"qwen3.6:35b"'),
    ("it's", '"it\'s"'),  # (one kind of quotes, whatever the text holds: a repr changed them)
    ('say "hi"', '"say \\"hi\\""'),
    ("a\nb\x1b[31m", '"a\\nb\\u001b[31m"'),  # no line break, no terminal escape reaches a log
    ("smollm2\x00", '"smollm2\\u0000"'),
    ("\udcff", '"\\udcff"'),  # a byte that was not UTF-8: escaped, so the answer can be encoded
    ("模型", '"模型"'),
    ("\x9b31m\x7f", '"\\u009b31m\\u007f"'),  # C1 controls and DEL, which json.dumps leaves as they are
    ("a\u2028b\u202ec", '"a\\u2028b\\u202ec"'),  # a line separator, a bidirectional override
    # (invisible format characters were shown as they are: "the model "qwen3.6:35b" does not exist"
    # for a name with a zero-width space, one the key may use to all eyes)
    ("qwen3.6:35b\u200b", '"qwen3.6:35b\\u200b"'),
    ("\ufeffa\u00adb\u2060c\u200d", '"\\ufeffa\\u00adb\\u2060c\\u200d"'),
    ("a\U000e0041", '"a\\udb40\\udc41"'),  # a tag character (invisible text), as JSON escapes it
    ("a\u00a0b é", '"a\u00a0b é"'),  # a no-break space and a letter are seen: as they are
    ("M" * 300, '"' + "M" * 256 + '…"'),
])
def test_a_caller_s_text_in_a_message_is_quoted_escaped_and_cut(sent: str, shown: str) -> None:
    assert quoted(sent) == shown
    assert "\n" not in quoted(sent) and quoted(sent).encode()  # one line, and valid UTF-8


@pytest.mark.parametrize(("sent", "shown"), [
    ("a\nb\x1b[31m\x9b", "a\\u000ab\\u001b[31m\\u009b"),
    ("p\u200bq\ufeff\u2066", "p\\u200bq\\ufeff\\u2066"),  # (a zero-width space and a BOM were left as they are)
    ("模型 x", "模型 x"),
])
def test_text_for_a_terminal_cell_escapes_what_forges_a_line_or_cannot_be_seen(sent: str, shown: str) -> None:
    assert printable(sent) == shown


def test_a_cancelled_run_s_499_has_a_reason_phrase() -> None:
    """499 is nginx's, in no registry: aiohttp sends `HTTP/1.1 499 ` with an empty phrase unless told."""
    response = ApiError(ErrorCode.CANCELLED, "cancelled by the caller").response()
    assert (response.status, response.reason) == (499, "Client Closed Request")
    assert ApiError(ErrorCode.CANCELLED, "x").raw_response().startswith(b"HTTP/1.1 499 Client Closed Request\r\n")
    assert ApiError(ErrorCode.UNAVAILABLE, "x").response().reason == "Service Unavailable"


AFFORD = ("This request requires more credits, or fewer max_tokens. You requested up to {} tokens, but can only "
          "afford {}. To increase, visit https://openrouter.ai/settings/credits and upgrade to a paid account")


@pytest.mark.parametrize(("message", "callers"), [
    (AFFORD.format(16384, 3919), True),  # (a request of fewer tokens is served)
    (AFFORD.format(32000, 0), False),  # (none is: the key is out of credits)
    ("Insufficient credits. This account never purchased credits.", False),
    ("Insufficient Balance", False),
])
def test_a_402_is_the_callers_only_for_a_request_larger_than_the_credits_left_pay_for(message: str,
                                                                                     callers: bool) -> None:
    assert callers_fault(402, f"provider or answered 402: {message}") is callers
    assert busy(402, f"provider or answered 402: {message}") is not callers
    answer = ApiError.from_info(ErrorInfo(ErrorCode.PROVIDER_ERROR, f"provider or answered 402: {message}",
                                          status=402, detail={"message": message, "code": 402}))
    assert answer.status == (402 if callers else 503)


@pytest.mark.parametrize(("message", "limit"), [
    ("Key limit exceeded (monthly limit). Manage it using https://openrouter.ai/settings/keys", True),
    ("Key limit exceeded (total limit). Manage it using https://openrouter.ai/settings/keys", True),
    ("Invalid API key", False),  # (a refused key: a strike, and the hint to check api_key_env)
])
def test_a_403_saying_iops_key_reached_its_spending_limit_is_an_account_out_of_credits(message: str,
                                                                                      limit: bool) -> None:
    """OpenRouter's 403 for a key past the limit its owner set on it is no refusal of the key: the
    provider is left alone a minute for the model (a 503 with `Retry-After: 60` when none other is
    left), not struck down for every model it serves with a hint to check its `api_key_env`."""
    from workers.adapters.failures import answered_error

    err = answered_error("or", 403, message, {"message": message, "code": 403})
    assert busy(403, f"provider or answered 403: {message}") is limit and not callers_fault(403, message)
    assert (err.strikes, err.retry_after_s, "api_key_env" in err.message) == ((0, 60, False) if limit
                                                                               else (1, None, True))
    answer = ApiError.from_info(ErrorInfo(ErrorCode.PROVIDER_ERROR, err.message, status=403,
                                          retry_after_s=err.retry_after_s))
    assert (answer.status, answer.headers.get("Retry-After") if answer.headers else None) == (
        (503, "60") if limit else (502, None))
