"""Failure texts are one line, say what failed and where, and never show a repr or an address."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import yarl
from aiohttp import web

from common.config import ProviderConfig
from common.wire import ErrorCode, RunKind
from workers.adapters.base import DOWN, ProviderError, Retry
from workers.adapters.failures import (
    NO_STRIKE,
    asked_wait_s,
    describe,
    one_line,
    parse_retry_after,
    probe_failure,
    redact,
    redacted,
    transport_error,
    url_secrets,
)
from workers.adapters.openai_compat import OpenAICompatAdapter

NOW_S = 1_780_000_000.0  # (a fixed clock: Fri, 28 May 2026 20:26:40 GMT)


@pytest.mark.parametrize(("header", "seconds"), [
    ("7", 7), (" 0 ", 0), ("60", 60), ("61", 60), ("99999999999999999999", 60), ("00007", 7), ("0000", 0),
    ("Fri, 28 May 2026 20:26:50 GMT", 10), ("Fri, 28 May 2026 20:26:40 GMT", 0),
    ("Fri, 28 May 2026 20:20:00 GMT", 0),  # (a date gone by: now)
    ("Sat, 29 May 2026 20:26:40 GMT", 60),
    ("Fri May 28 20:26:45 2026", 5),  # (asctime's form: GMT, as HTTP has it)
    (None, None), ("", None), ("-3", None), ("1.5", None), ("soon", None), ("٣", None),  # (an Arabic-Indic 3)
    # (found by a review: dates beyond what Python holds raised OverflowError, which failed the run)
    ("Wed, 21 Oct 2099 07:28:00 +99999999999999999999", None), ("Wed, 21 Oct 99999999999999999999 07:28:00 GMT", None),
])
def test_a_retry_after_header_is_seconds_within_a_minute(header: str | None, seconds: int | None) -> None:
    assert parse_retry_after(header, NOW_S) == seconds


GEMINI_429 = {"code": 429, "message": "You exceeded your current quota", "status": "RESOURCE_EXHAUSTED", "details": [
    {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "45.837906927s"}]}


@pytest.mark.parametrize(("headers", "detail", "seconds"), [
    ({"retry-after-ms": "5000"}, None, 5),  # (Azure OpenAI's, alone)
    ({"retry-after-ms": "1500", "Retry-After": "1"}, None, 2),  # (the official clients read it first)
    ({"retry-after-ms": "6"}, None, 1), ({"retry-after-ms": "0"}, None, 0), ({"retry-after-ms": "86400000"}, None, 60),
    ({"retry-after-ms": "soon", "Retry-After": "7"}, None, 7),  # (not a number: the next that says)
    ({"retry-after-ms": "-5"}, None, None), ({"retry-after-ms": "1e9"}, None, None),
    ({"retry-after-ms": "٣"}, None, None),  # (an Arabic-Indic 3)
    # (a wait of more digits than a double holds exactly is the longest kept, as a Retry-After of as many
    # seconds is: it was none, and the provider that asked for 10^30 ms was asked again a second later)
    ({"retry-after-ms": "1" + "0" * 30}, None, 60), ({"retry-after-ms": "9" * 16, "Retry-After": "3"}, None, 60),
    ({"retry-after-ms": "0" * 20 + "5000"}, None, 5),
    ({}, {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "9" * 16 + "s"}]}, 60),
    ({}, {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1e309s"}]}, None),
    ({"Retry-After": "7"}, GEMINI_429, 7),  # (a header first)
    ({}, GEMINI_429, 46), (None, GEMINI_429, 46),  # (Gemini's, in its error only)
    ({}, {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "90s"}]}, 60),
    ({}, {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "34"}]}, None),
    ({}, {"details": [{"@type": "other", "retryDelay": "3s"}, "junk", None]}, None),
    ({}, {"details": "47s"}, None), ({}, None, None), (None, None, None),
])
def test_a_busy_providers_wait_is_read_as_hosted_apis_say_it(headers: dict[str, str] | None,
                                                              detail: dict[str, Any] | None,
                                                              seconds: int | None) -> None:
    assert asked_wait_s(headers, detail, NOW_S) == seconds


def test_one_line_flattens_cleans_and_cuts() -> None:
    assert one_line("a\n  b\r\n\tc") == "a b c"
    assert one_line("bad \x00\x07 bytes \ufffd\ufffd here") == "bad ? bytes ? here"
    assert one_line("x" * 600) == "x" * 499 + "…"
    assert one_line("y" * 600 + "the end", tail=True) == "…" + ("y" * 600 + "the end")[-499:]
    assert one_line("") == ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def failure_of(url: str, timeout: aiohttp.ClientTimeout) -> BaseException:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(url, timeout=timeout) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return exc
    raise AssertionError("the request did not fail")


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """`app` served on a free port of 127.0.0.1 while inside: its `host:port`."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def misbehaving() -> AsyncIterator[str]:
    """A server whose /hang never answers and whose /cut breaks off a chunked body."""
    released = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await released.wait()
        return web.Response()

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b"partial")
        assert request.transport is not None
        request.transport.close()
        return resp

    app = web.Application()
    app.router.add_get("/hang", hang)
    app.router.add_get("/cut", cut)
    async with serving(app) as address:
        yield f"http://{address}"
        released.set()


async def test_real_transport_failures_read_as_one_plain_line(misbehaving: str) -> None:
    port = free_port()
    refused = await failure_of(f"http://127.0.0.1:{port}/x", aiohttp.ClientTimeout(total=5))
    assert describe(refused) == ("connection refused", DOWN)
    hung = await failure_of(misbehaving + "/hang", aiohttp.ClientTimeout(sock_read=0.05))
    assert describe(hung, read_ms=50) == ("sent nothing for 50 ms", 1)
    assert describe(hung, total_ms=2000) == ("no answer within 2000 ms", 1)
    cut = await failure_of(misbehaving + "/cut", aiohttp.ClientTimeout(total=5))
    # it was answering when it broke off: alive, so no strike (and no sign of life either)
    assert describe(cut) == ("the response broke off before it was complete", NO_STRIKE)
    assert transport_error("p", cut, connect_ms=1, read_ms=1).strikes is None
    assert probe_failure("GET /health", cut, 2000).strikes == 1  # a probe that breaks off is odd: one strike
    for exc in (refused, hung, cut):
        reason = probe_failure("GET /health", exc, 2000).reason
        assert reason.startswith("GET /health: ") and "127.0.0.1" not in reason and str(port) not in reason
        error = transport_error("vllm-a", exc, connect_ms=5000, read_ms=50)
        # (a provider that took the request and went silent is likely still at it: not it again)
        assert error.message.startswith("provider vllm-a: ")
        assert error.retry is (Retry.ELSEWHERE if exc is hung else Retry.ANY)
        assert error.code is (ErrorCode.PROVIDER_TIMEOUT if exc is hung else ErrorCode.PROVIDER_ERROR)
        assert "127.0.0.1" not in error.message and str(port) not in error.message
        assert not any(t in error.message for t in ("Error", "<", "Connection", "ConnectionKey"))  # no repr


def test_garbage_from_a_provider_that_answered_goes_elsewhere() -> None:
    error = transport_error("p", ValueError("Expecting value: line 1 column 1 (char 0)"), connect_ms=1, read_ms=1)
    assert error.message == "provider p: the answer was not valid JSON"
    assert error.retry is Retry.ELSEWHERE and error.strikes == 0


def basic(url: str) -> str:
    """The `Authorization` value aiohttp itself sends for the credentials in `url`."""
    auth = aiohttp.BasicAuth.from_url(yarl.URL(url))
    assert auth is not None
    return auth.encode().removeprefix("Basic ")


@pytest.mark.parametrize(("url", "password"), [
    ("http://alice:hunter2secret@127.0.0.1:8000/v1", "hunter2secret"),
    ("https://svc%2Duser:p%40ss%2Fw%C3%A9rd%2B@api.example.com", "p@ss/wérd+"),
    ("http://:only-a-password-7f3@host:1", "only-a-password-7f3"),
])
def test_every_form_of_url_credentials_is_redacted(url: str, password: str) -> None:
    secrets = url_secrets(url)
    token = basic(url)
    written = url.split("//", 1)[1].rsplit("@", 1)[0]  # the userinfo as written
    user = yarl.URL(url).user or ""
    echoes = [
        f"invalid credentials in Authorization: Basic {token}",  # the header aiohttp built
        f"token {token.rstrip('=')} refused",  # echoed without its padding
        f"bad password {password}",  # decoded
        f"login {written} failed",  # the whole userinfo as written (percent-encoded)
        f"login {user}:{password} failed",  # ... and decoded
        f"quoted {yarl.URL.build(scheme='http', host='h', user=user, password=password)}",  # re-encoded
    ]
    for echo in echoes:
        shown = redact(echo, secrets)
        assert token.rstrip("=") not in shown and password not in shown and written not in shown, shown
        assert "[redacted]" in shown
    assert redact("nothing secret here", secrets) == "nothing secret here"
    assert url_secrets("http://127.0.0.1:8000/v1") == [] and url_secrets(None) == []


def test_a_secret_cut_by_the_length_limit_leaves_no_part_of_it() -> None:
    url = "http://alice:hunter2secret@127.0.0.1:8000"
    token = basic(url)
    for keep in (6, 12, len(token) - 1):
        cut = one_line("x" * (499 - keep) + f"{token} and more", 500)
        assert cut.endswith(token[:keep] + "…")
        assert redact(cut, url_secrets(url)).endswith("x[redacted]…")
    tail = one_line(f"{token}" + "y" * 490, 500, tail=True)  # the tail a tool's stderr is cut to
    assert tail.startswith("…" + token[-9:])
    assert redact(tail, url_secrets(url)).startswith("…[redacted]y")


def test_the_detail_is_redacted_even_where_json_escapes_the_secret() -> None:
    url = 'http://bob:p%22w%5C%C3%A9-91@h'  # the password is p"w\é-91
    exc = ProviderError("provider p answered 401: nope", status=401, retry=Retry.NO, strikes=0,
                        detail={"message": 'no p"w\\é-91 here', "p\"w\\é-91": ["p\"w\\é-91"]},
                        code=ErrorCode.INVALID_REQUEST)
    clean = redacted(exc, url_secrets(url))
    assert clean.detail == {"message": "no [redacted] here", "[redacted]": ["[redacted]"]}
    assert (clean.status, clean.retry, clean.strikes, clean.code) == (401, Retry.NO, 0, ErrorCode.INVALID_REQUEST)
    assert redacted(clean, url_secrets(url)) is clean  # nothing left to redact: the same error


@pytest.fixture
async def echoing() -> AsyncIterator[str]:
    """An API that answers 401 with the Authorization header it got, as JSON on chat and as
    plain text on completions."""

    async def chat(request: web.Request) -> web.Response:
        got = request.headers.get("Authorization", "")
        return web.json_response({"error": {"message": f"invalid Authorization header {got!r}",
                                            "type": "invalid_request_error", "param": got, "code": None}},
                                 status=401)

    async def text(request: web.Request) -> web.Response:
        return web.Response(text=f"401 Unauthorized: you sent {request.headers.get('Authorization')}", status=401)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", text)
    async with serving(app) as address:
        yield address


async def test_a_provider_echoing_the_basic_header_of_its_url_shows_no_credential(echoing: str) -> None:
    url = f"http://alice:hunter2secret@{echoing}/v1"
    token = basic(url)
    provider = ProviderConfig.model_validate(
        {"id": "hosted-x", "type": "openai_api", "base_url": url, "capacity": 1, "models": ["m"]})
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        adapter = OpenAICompatAdapter(provider, session)
        failures: list[ProviderError] = []
        for kind, request in ((RunKind.CHAT, body), (RunKind.COMPLETION, {"model": "m", "prompt": "hi"})):
            with pytest.raises(ProviderError) as err:
                await adapter.complete(kind, request, "run_1")
            failures.append(err.value)
            with pytest.raises(ProviderError) as err:
                async for _ in adapter.stream(kind, {**request, "stream": True}, "run_2"):
                    pass
            failures.append(err.value)
    for failure in failures:
        shown = failure.message + json.dumps(failure.detail)
        assert failure.message.startswith("provider hosted-x answered 401: ") and "Basic [redacted]" in shown
        assert token not in shown and "hunter2secret" not in shown and "alice" not in shown, shown
