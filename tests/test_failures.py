"""Failure texts are one line, say what failed and where, and never show a repr or an address."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from workers.adapters.base import DOWN, Retry
from workers.adapters.failures import NO_STRIKE, describe, one_line, probe_failure, transport_error


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
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    released.set()
    await runner.cleanup()


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
        assert error.message.startswith("provider vllm-a: ") and error.retry is Retry.ANY
        assert "127.0.0.1" not in error.message and str(port) not in error.message
        assert not any(t in error.message for t in ("Error", "<", "Connection", "ConnectionKey"))  # no repr


def test_garbage_from_a_provider_that_answered_goes_elsewhere() -> None:
    error = transport_error("p", ValueError("Expecting value: line 1 column 1 (char 0)"), connect_ms=1, read_ms=1)
    assert error.message == "provider p: the answer was not valid JSON"
    assert error.retry is Retry.ELSEWHERE and error.strikes == 0
