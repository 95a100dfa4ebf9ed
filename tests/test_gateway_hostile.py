"""The gateway against a hostile caller, in process on port 0 with the connections `iop gateway`
serves (`GuardedSite`) and a real Redis, driven with raw sockets: what the HTTP parser refuses
is answered and logged without a byte of the request (an API key in a broken header stays
secret), every answer is OpenAI-shaped JSON on one line, a body announced over the limit is
refused before it is read, and nothing a caller sends is echoed back at length."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from aiohttp import web
from redis.asyncio import Redis

from common.config import Config, parse_config
from gateway.admission import ConnectionGuard, ConnectionLimits
from gateway.app import build_app
from gateway.connections import GuardedSite

MODEL = "m"
SECRET = "iop-SECRET-0123456789"
#: Longest any single wait in these tests may take; far below the body timeout they run with.
DEADLINE_S = 20.0
#: A limit never reached in a test: an answer that waits for it shows as a test timeout.
NEVER_MS = 120_000
#: runtime.max_body_bytes by default
DEFAULT_MAX_BODY = 8 * 1024 * 1024


def config(**runtime: int) -> Config:
    return parse_config({
        "models": [{"id": MODEL, "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"header_timeout_ms": NEVER_MS, "body_timeout_ms": NEVER_MS, "idle_timeout_ms": NEVER_MS,
                    **runtime},
    })


@dataclass
class Gateway:
    host: str
    port: int


async def serve(cfg: Config, redis_url: str) -> tuple[web.AppRunner, Gateway]:
    runner = web.AppRunner(build_app(cfg, redis_url), handler_cancellation=True, access_log=None)
    await runner.setup()
    guard = ConnectionGuard(ConnectionLimits.from_runtime(cfg.runtime))
    site = GuardedSite(runner, "127.0.0.1", 0, guard, access_log=None)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, Gateway(host, port)


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Gateway]:
    runner, gw = await serve(config(), redis_url)
    yield gw
    await runner.cleanup()


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        err: dict[str, Any] = json.loads(self.body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        message = err["message"]
        assert isinstance(message, str) and "\n" not in message and "b'" not in message
        assert "bytearray" not in message and "^" not in message
        return err


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One whole response with a Content-Length (a 100 Continue before it is returned as one too)."""
    async with asyncio.timeout(DEADLINE_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Response(int(status_line.split()[1]), headers, body)


async def closed(reader: asyncio.StreamReader) -> bool:
    """The gateway closes the connection (what it sends until then is dropped)."""
    try:
        async with asyncio.timeout(DEADLINE_S):
            while await reader.read(65536):
                pass
    except ConnectionResetError:
        pass
    return True


async def exchange(gw: Gateway, raw: bytes) -> tuple[Response, bytes]:
    """Send `raw`, read the answer and all the gateway sends until it closes; (answer, every byte)."""
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(DEADLINE_S):
            data = await reader.read()
    finally:
        writer.close()
    assert data, "the connection closed without an answer"
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return Response(int(status_line.split()[1]), headers, body), data


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


BROKEN_HEADERS = {
    "space-before-colon": f"Authorization : Bearer {SECRET}".encode(),
    "over-8-KiB": f"Authorization: Bearer {SECRET}".encode() + b"x" * 9000,
    "control-character": f"Authorization: Bearer {SECRET}\x01".encode(),
}


@pytest.mark.parametrize("header", list(BROKEN_HEADERS.values()), ids=list(BROKEN_HEADERS))
async def test_a_header_the_parser_refuses_is_neither_echoed_nor_logged(
        gateway: Gateway, caplog: pytest.LogCaptureFixture, header: bytes) -> None:
    caplog.set_level(logging.DEBUG)
    raw = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + header + b"\r\n\r\n"
    resp, everything = await exchange(gateway, raw)
    assert resp.status == 400
    err = resp.error()
    assert err["code"] == "invalid_request_error"
    assert err["message"].startswith("the request could not be parsed as HTTP/1.1: ")
    assert "header" in err["message"]
    assert SECRET.encode() not in everything and b"Bearer" not in everything
    assert "unparsable request from 127.0.0.1" in logged(caplog)
    assert SECRET not in logged(caplog) and "Bearer" not in logged(caplog)


@pytest.mark.parametrize(("raw", "problem"), [
    (f"GARBAGE-{SECRET}\r\n\r\n".encode(), "the request line is malformed"),
    (f"GET /v1/mo\x01{SECRET} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode(), "the request line is malformed"),
    (f"GET / HTTP/9.{SECRET}\r\nHost: localhost\r\n\r\n".encode(), "the request line is malformed"),
    (f"GET /{SECRET}".encode() + b"a" * 9000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n", "over 8190 bytes"),
    (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1{SECRET}\r\n\r\n".encode(),
     "the Content-Length header is malformed"),
    (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz{SECRET}\r\n".encode(),
     "the chunked body is malformed"),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", "the Host header is missing"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
     "appears more than once"),
    (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + SECRET.encode(), "HTTPS"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip\r\n\r\n",
     "the Transfer-Encoding header is malformed"),  # (it was "the Content-Length header is malformed")
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
     "both a Content-Length and a Transfer-Encoding header"),
    # (the count was said nowhere: "it has too many headers", and the README named no limit)
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(128)) + b"\r\n",
     "more than 128 header lines"),
], ids=["not-http", "control-character-in-path", "bad-version", "request-line-over-8-KiB", "bad-content-length",
        "bad-chunk-size", "no-host", "duplicate-content-length", "tls", "transfer-encoding-gzip", "cl-and-te",
        "129-headers"])
async def test_every_parser_fault_is_told_in_words_of_its_own_without_the_request(
        gateway: Gateway, caplog: pytest.LogCaptureFixture, raw: bytes, problem: str) -> None:
    caplog.set_level(logging.DEBUG)
    resp, everything = await exchange(gateway, raw)
    assert resp.status == 400
    err = resp.error()
    assert err["code"] == "invalid_request_error" and problem in err["message"], err["message"]
    assert SECRET.encode() not in everything
    assert SECRET not in logged(caplog) and "b'" not in logged(caplog)


@pytest.mark.parametrize(("size", "refused"), [(8190, False), (8191, True)])
async def test_the_8190_bytes_of_the_readme_bound_the_request_target_and_a_header_value(
        gateway: Gateway, size: int, refused: bool) -> None:
    """(a hostile caller's audit: the README said "a header line or the request line over 8190
    bytes" is refused, but aiohttp's bound leaves out the method, the version and a header's
    name: lines of 8195 and 8203 bytes were served)"""
    target = b"/v1/models?" + b"a" * (size - len("/v1/models?"))
    line = b"GET " + target + b" HTTP/1.1"
    resp, _ = await exchange(gateway, line + b"\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert (resp.status == 400) is refused and len(line) > 8190
    header = b"X-Pad: " + b"v" * size
    resp, _ = await exchange(gateway, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n" + header
                             + b"\r\nConnection: close\r\n\r\n")
    assert (resp.status == 400) is refused and len(header) > 8190
    if refused:
        assert "over 8190 bytes" in resp.error()["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/no/such/path"])
async def test_an_expectation_other_than_100_continue_gets_an_openai_shaped_417(gateway: Gateway, path: str) -> None:
    resp, _ = await exchange(gateway, f"GET {path} HTTP/1.1\r\nHost: localhost\r\nExpect: foo\r\n\r\n".encode())
    assert resp.status == 417
    err = resp.error()
    assert err["code"] == "invalid_request_error" and err["param"] == "Expect" and "100-continue" in err["message"]


async def test_expect_100_continue_is_answered_and_the_body_then_read(gateway: Gateway) -> None:
    body = json.dumps({"model": "no-such", "messages": [{"role": "user", "content": "hi"}]}).encode()
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        assert (await read_response(reader)).status == 100  # sent before the body is
        writer.write(body)
        resp = await read_response(reader)
        assert resp.status == 404 and resp.error()["code"] == "model_not_found"
    finally:
        writer.close()


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100-continue"])
async def test_a_body_announced_over_the_limit_gets_413_before_it_is_read(gateway: Gateway, expect: bool) -> None:
    """The body timeout is far off: an answer that waited for the body would time the test out."""
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     + (b"Expect: 100-continue\r\n" if expect else b"")
                     + b"Content-Length: 9000000\r\n\r\n" + (b"" if expect else b"{}"))
        await writer.drain()
        resp = await read_response(reader)  # no 100 Continue first: the body is not wanted
        assert resp.status == 413
        err = resp.error()
        assert err["code"] == "request_too_large" and "runtime.max_body_bytes" in err["message"]
        assert await closed(reader)
    finally:
        writer.close()


async def test_a_client_that_sends_its_whole_body_over_the_limit_reads_the_413_not_a_reset(gateway: Gateway) -> None:
    """The gateway answers before reading the body; closing with it unread would send a reset,
    which can reach the client before the answer (the official client then sees a broken
    connection and retries). The answer is followed by the end of the gateway's side, and the
    body is read and dropped meanwhile (found by a hostile-caller audit)."""
    for _ in range(3):
        reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
        try:
            body = b"x" * (DEFAULT_MAX_BODY + 1)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            resp = await read_response(reader)
            assert resp.status == 413 and resp.error()["code"] == "request_too_large"
            assert await reader.read() == b""  # then the end, not a reset
        finally:
            writer.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_bodies_being_read_hold_at_most_their_budget_and_past_it_a_body_gets_503(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    """(a hostile caller's audit: 40 connections each sending 8 MiB but its last byte held the
    gateway's memory at 576 MB; max_connections of them, 4096, would have held ~50 GB) What is
    counted is what was sent beyond each body's first bytes: a small body gets through whatever
    the large ones hold, and a length announced takes nothing."""
    from gateway import connections

    monkeypatch.setattr(connections, "BODIES_BUDGET", 64 * 1024)
    monkeypatch.setattr(connections, "FREE_BODY_BYTES", 1024)
    runner, gw = await serve(config(max_body_bytes=40 * 1024), redis_url)
    part = b"x" * (30 * 1024)

    def head(size: int, close: bool = False) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                + (b"Connection: close\r\n" if close else b"")
                + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % size))

    def piece(data: bytes, last: bool = False) -> bytes:
        framed = b"%x\r\n" % len(data) + data + b"\r\n" if chunked else data
        return framed + (b"0\r\n\r\n" if chunked and last else b"")

    held = []
    try:
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(head(40 * 1024))  # announced, nothing sent: takes nothing
        held.append((reader, writer))
        for _ in range(2):  # two bodies of 30 KiB, each but its end sent: 58 KiB of the 64 counted
            reader, writer = await asyncio.open_connection(gw.host, gw.port)
            writer.write(head(len(part) + 2) + piece(b'"' + part))
            await writer.drain()
            held.append((reader, writer))
        async with asyncio.timeout(DEADLINE_S):
            while True:  # a third does not fit: refused as its bytes come, not waited for until the body timeout
                reader, writer = await asyncio.open_connection(gw.host, gw.port)
                try:
                    writer.write(head(len(part) + 2) + piece(b'"' + part))
                    await writer.drain()
                    try:  # (the two before it may not have been read yet: then it fits, and is let end)
                        async with asyncio.timeout(0.5):
                            resp = await read_response(reader)
                    except TimeoutError:
                        writer.write(piece(b'"', last=True))
                        assert (await read_response(reader)).status == 400
                        continue
                    assert resp.status == 503 and resp.headers.get("retry-after") == "1"
                    err = resp.error()
                    assert err["code"] == "service_unavailable" and "request bodies" in err["message"], err
                    assert await closed(reader)
                    break
                finally:
                    writer.close()
        small = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'
        resp, _ = await exchange(gw, head(len(small), close=True) + piece(small, last=True))
        assert resp.status == 404  # a small body still gets through: read, parsed, answered
        for reader, writer in held[1:]:  # the bodies held end: each is answered, and gives its room back
            writer.write(piece(b'"', last=True))
            await writer.drain()
            assert (await read_response(reader)).status == 400  # (a JSON string, not an object)
            writer.close()
        resp, _ = await exchange(gw, head(len(part) + 2, close=True) + piece(b'"' + part) + piece(b'"', last=True))
        assert resp.status == 400
    finally:
        for _, writer in held:
            writer.close()
        await runner.cleanup()


async def test_a_chunked_body_over_the_limit_gets_iop_s_413_and_the_connection_closes(gateway: Gateway) -> None:
    """No length declared: the body is counted as it comes (it was aiohttp's own wording)."""
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(DEFAULT_MAX_BODY // len(chunk)):  # the limit exactly
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        writer.write(b"1\r\nx\r\n")  # one byte past it, and no end (nothing unread is left to reset the close)
        await writer.drain()
        resp = await read_response(reader)
        assert resp.status == 413
        assert resp.error() == {"message": f"request body is too large: more than {DEFAULT_MAX_BODY} bytes "
                                           "(runtime.max_body_bytes)", "type": "invalid_request_error",
                                "param": None, "code": "request_too_large"}
        assert await closed(reader)
    finally:
        writer.close()


async def post_chat(gateway: Gateway, body: bytes) -> Response:
    """A chat completion request with exactly this body, on a socket of its own."""
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return await read_response(reader)
    finally:
        writer.close()


async def test_a_body_that_is_not_utf8_is_told_where_in_plain_words(gateway: Gateway) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}'
    resp = await post_chat(gateway, body)
    assert resp.status == 400
    at = body.index(b"\xff")
    assert resp.error()["message"] == f"the request body is not valid JSON: it is not valid UTF-8 text (at byte {at})"


async def test_an_unknown_model_id_is_echoed_cut_short(gateway: Gateway) -> None:
    model = "M" * 1_000_000
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    resp = await post_chat(gateway, json.dumps(body).encode())
    assert resp.status == 404
    err = resp.error()
    assert err["code"] == "model_not_found" and err["message"] == f'the model "{"M" * 256}…" does not exist'


async def readyz(cfg: Config, redis_url: str) -> Response:
    runner, gw = await serve(cfg, redis_url)
    try:
        reader, writer = await asyncio.open_connection(gw.host, gw.port)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        resp = await read_response(reader)
        writer.close()
    finally:
        await runner.cleanup()
    return resp


async def test_readyz_with_redis_down_says_so_without_its_address(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)  # a port nobody serves on then
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    resp = await readyz(config(), f"redis://127.0.0.1:{port}/0")
    assert resp.status == 503
    err = resp.error()
    assert err["code"] == "service_unavailable" and err["message"] == "not ready: Redis is unreachable"
    assert any(r.levelno == logging.WARNING and "not ready" in r.getMessage() and str(port) in r.getMessage()
               for r in caplog.records), "the detail is logged"


@asynccontextmanager
async def acl_user(redis_url: str, name: str, *rules: str) -> AsyncIterator[str]:
    """A Redis user with `rules` (`ACL SETUSER`) for the block: the URL that logs in as it."""
    user = f"{name}-{uuid.uuid4().hex[:8]}"
    admin = Redis.from_url(redis_url)
    await admin.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)
    parts = urlsplit(redis_url)
    try:
        yield urlunsplit((parts.scheme, f"{user}:pw@{parts.netloc}", parts.path, "", ""))
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()


async def test_readyz_when_redis_answers_with_an_error_is_503_not_500(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A user that may not PING: Redis answers NOPERM, which is no outage."""
    caplog.set_level(logging.DEBUG)
    async with acl_user(redis_url, "iop-no-ping", "~*", "+@all", "-ping") as url:
        resp = await readyz(config(), url)
    assert resp.status == 503
    err = resp.error()
    assert err["code"] == "service_unavailable" and err["message"].startswith("not ready: Redis answered with an error")
    assert any(r.levelno == logging.WARNING and "not ready" in r.getMessage() for r in caplog.records)


async def test_readyz_is_503_for_a_redis_user_that_may_not_read_iops_keys(redis_url: str) -> None:
    async with acl_user(redis_url, "iop-other-keys", "~other:*", "&*", "+@all") as url:
        resp = await readyz(config(), url)
    assert resp.status == 503 and resp.error()["message"].startswith("not ready: Redis answered with an error")


async def test_a_command_redis_refuses_is_a_503_saying_so_not_a_500(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """An ACL user that may not run scripts: /readyz's PING passes, and every run's script was
    refused with NOPERM, which came out as 500 `internal_error`. It is a 503 now, and the log says why."""
    async with acl_user(redis_url, "iop-no-scripts", "~*", "&*", "+@all", "-@scripting") as url:
        runner, gw = await serve(config(), url)
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            resp = await post_chat(gw, json.dumps(body).encode())
            ready = await readyz(config(), url)  # (it checked PING alone, and said ready)
        finally:
            await runner.cleanup()
    assert resp.status == 503, resp.body
    err = resp.error()
    assert err["code"] == "service_unavailable" and "Redis) refused" in err["message"], err
    assert resp.headers.get("retry-after") == "5"
    assert ready.status == 503 and ready.error()["message"].startswith("not ready: Redis answered with an error")
    said = logged(caplog)
    assert any(r.levelno == logging.ERROR and "no permissions" in r.getMessage() for r in caplog.records), said
