"""A run sent on a pooled connection that the provider broke goes again on a new one.

A server on raw sockets keeps each connection open after its answer (HTTP/1.1 keep-alive) and
breaks it when the next request comes on it: it closes it, or resets it, without a byte of an
answer. That is what a server's idle timeout racing a request looks like, and what
llama-cpp-python's server does to the connection of a stream it ended before any event. The
worker's one HTTP client pools its connections, so the second run of a provider takes the broken
one: it must be sent again on a new connection and succeed, while a request that breaks so on a
new connection stays the provider's failure (sent once)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from common.config import ProviderConfig
from common.wire import RunKind
from tests.fakes.raw_http import RawHttp
from workers.adapters import sending
from workers.adapters.base import ProviderError, Retry
from workers.adapters.ollama import OllamaAdapter
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.adapters.sending import MAX_SENDS
from workers.service import provider_session

SERVED = "m-served"
ANSWER = {"id": "x", "object": "chat.completion", "created": 1, "model": SERVED,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": SERVED,
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
OLLAMA = {"model": SERVED, "message": {"role": "assistant", "content": "hi"}, "done": True, "done_reason": "stop",
          "prompt_eval_count": 1, "eval_count": 1}


@dataclass
class KeepAlive(RawHttp):
    """Answers `answered` requests on each connection, keeping it open, then breaks it when the
    next request on it comes (`how`: "close" or "reset"); `answered` 0 breaks every request."""

    answered: int = 1
    #: "close", "reset", or "partial" (the start of a head, then close)
    how: str = "close"
    #: the streams it answers end before any event (a head and an empty body, in one write), as
    #: llama-cpp-python's server answers a streamed prompt beyond its context
    empty_streams: bool = False
    #: the paths of the requests read, the connections made, and how many it broke
    requests: list[str] = field(default_factory=list)
    connections: int = 0
    broken: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length))
                self.requests.append(path)
                if served >= self.answered:
                    self.broken += 1
                    if self.how == "reset":  # (SO_LINGER 0: the close sends a reset)
                        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                   struct.pack("ii", 1, 0))
                    elif self.how == "partial":
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                        await writer.drain()
                    return
                served += 1
                if self.empty_streams and body.get("stream") is True:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
                    continue
                writer.write(_answer(path, body.get("stream") is True))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass


def _answer(path: str, stream: bool) -> bytes:
    if path == "/api/chat":
        body, kind = json.dumps(OLLAMA).encode() + b"\n", "application/json"
    elif stream:
        body, kind = b"data: " + json.dumps(CHUNK).encode() + b"\n\ndata: [DONE]\n\n", "text/event-stream"
    else:
        body, kind = json.dumps(ANSWER).encode(), "application/json"
    return f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    client = provider_session()
    yield client
    await client.close()


def provider(url: str, kind: str = "vllm") -> ProviderConfig:
    return ProviderConfig.model_validate({"id": "p-ka", "type": kind, "base_url": url, "capacity": 1,
                                          "models": [SERVED]})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], **extra}


async def _text(adapter: OpenAICompatAdapter | OllamaAdapter, stream: bool, run: str) -> str:
    if not stream:
        answer = await adapter.complete(RunKind.CHAT, chat(), run)
        return str(answer["choices"][0]["message"]["content"])
    text = ""
    async for chunks in adapter.stream(RunKind.CHAT, chat(stream=True), run):
        text += "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return text


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_on_a_pooled_connection_the_server_broke_goes_again_on_a_new_one(
        session: aiohttp.ClientSession, how: str, stream: bool) -> None:
    server = KeepAlive(answered=1, how=how)
    adapter = OpenAICompatAdapter(provider(await server.start()), session)
    try:
        assert [await _text(adapter, stream, f"run_{i}") for i in range(3)] == ["hi", "hi", "hi"]
    finally:
        await server.stop()
    # each run after the first took the pooled connection, found it broken, and went on a new one
    assert server.broken == 2 and server.connections == 3 and len(server.requests) == 5


async def test_an_ollama_run_on_a_broken_pooled_connection_goes_again_too(session: aiohttp.ClientSession) -> None:
    server = KeepAlive(answered=1, how="reset")
    adapter = OllamaAdapter(provider(await server.start(), "ollama"), session)
    try:
        assert [await _text(adapter, False, f"run_{i}") for i in range(2)] == ["hi", "hi"]
    finally:
        await server.stop()
    assert server.broken == 1 and server.requests == ["/api/chat"] * 3


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_run_that_breaks_on_a_new_connection_is_the_provider_s_failure_sent_once(
        session: aiohttp.ClientSession, how: str) -> None:
    server = KeepAlive(answered=0, how=how)
    adapter = OpenAICompatAdapter(provider(await server.start()), session)
    try:
        with pytest.raises(ProviderError) as failed:
            await adapter.complete(RunKind.CHAT, chat(), "run_1")
    finally:
        await server.stop()
    assert server.requests == ["/v1/chat/completions"]
    assert failed.value.retry is Retry.ANY and failed.value.strikes == 1
    assert failed.value.message in ("provider p-ka: the server closed the connection",
                                     "provider p-ka: connection error (connection reset by peer)")


async def test_a_pool_of_broken_connections_is_sent_at_most_max_sends_times(session: aiohttp.ClientSession) -> None:
    """Every connection answers once, then breaks: with more broken ones in the pool than
    `MAX_SENDS`, a run gives up after that many tries (each closing the one it took)."""
    server = KeepAlive(answered=1, how="reset")
    adapter = OpenAICompatAdapter(provider(await server.start()), session)
    try:
        await asyncio.gather(*(adapter.complete(RunKind.CHAT, chat(), f"run_{i}") for i in range(MAX_SENDS + 1)))
        assert server.connections == MAX_SENDS + 1  # (the pool now holds that many, each broken by the server)
        with pytest.raises(ProviderError):
            await adapter.complete(RunKind.CHAT, chat(), "run_last")
    finally:
        await server.stop()
    assert server.broken == MAX_SENDS and len(server.requests) == MAX_SENDS + 1 + MAX_SENDS


@pytest.mark.parametrize("how", ["partial", "late"])
async def test_a_run_whose_pooled_connection_broke_after_the_server_may_have_taken_it_is_not_sent_again(
        session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Sending it again could run it twice: the server began to answer (`partial`: part of a head,
    then it closed), or the break came later than `RESEND_WITHIN_S` after the run went out, not
    the race with an idle close (`late`: here the window is made 0, so every break is late)."""
    if how == "late":
        monkeypatch.setattr(sending, "RESEND_WITHIN_S", 0.0)
    server = KeepAlive(answered=1, how="partial" if how == "partial" else "close")
    adapter = OpenAICompatAdapter(provider(await server.start()), session)
    try:
        assert await _text(adapter, False, "run_1") == "hi"
        with pytest.raises(ProviderError):
            await adapter.complete(RunKind.CHAT, chat(), "run_2")
    finally:
        await server.stop()
    assert server.broken == 1 and len(server.requests) == 2


async def test_the_connection_of_a_stream_that_ended_before_any_event_serves_no_other_run(
        session: aiohttp.ClientSession) -> None:
    """Its head and empty body came in one write: aiohttp gave the connection back to the pool
    before the adapter saw the end. The next run goes on a new connection, not on that one (which
    this server would break, as llama-cpp-python's does)."""
    server = KeepAlive(answered=1, how="reset", empty_streams=True)
    adapter = OpenAICompatAdapter(provider(await server.start()), session)
    try:
        with pytest.raises(ProviderError, match="the stream ended before any event"):
            await _text(adapter, True, "run_1")
        assert await _text(adapter, False, "run_2") == "hi"
    finally:
        await server.stop()
    assert server.broken == 0 and server.connections == 2 and len(server.requests) == 2


@dataclass
class Twice(RawHttp):
    """Answers each request with its own prompt (kept alive), and the first answer twice, as a
    server or proxy that repeats an answer: the copy goes out when `send_copy` is set (`split`: its
    first 20 bytes then, part of its head, the rest before the next answer on that connection)."""

    requests: int = 0
    connections: int = 0
    send_copy: asyncio.Event = field(default_factory=asyncio.Event)
    split: bool = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        rest = b""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = json.loads(await reader.readexactly(length))
                self.requests += 1
                prompt = body["messages"][0]["content"]
                stream = body.get("stream") is True
                chunk = {**CHUNK, "choices": [{"index": 0, "delta": {"content": prompt}, "finish_reason": "stop"}]}
                answer = {**ANSWER, "choices": [{"index": 0, "message": {"role": "assistant", "content": prompt},
                                                 "finish_reason": "stop"}]}
                payload = (b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n" if stream
                           else json.dumps(answer).encode())
                kind = "text/event-stream" if stream else "application/json"
                out = f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                writer.write(rest + out + payload)
                rest = b""
                await writer.drain()
                if self.requests == 1:
                    await self.send_copy.wait()
                    copy = out + payload
                    cut = 20 if self.split else len(copy)
                    writer.write(copy[:cut])
                    await writer.drain()
                    rest = copy[cut:]
        except (ConnectionError, asyncio.IncompleteReadError):
            pass


@pytest.mark.parametrize("split", [False, True], ids=["whole copy", "part of its head"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_pooled_connection_that_got_an_answer_nobody_asked_for_serves_no_other_run(
        session: aiohttp.ClientSession, stream: bool, split: bool, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp reads bytes that come on a connection in the pool as the answer to the next request
    sent on it: the second run would get the first run's answer (another caller's text), or, when
    only part of its head came, fail as "not valid HTTP". It goes on a new connection instead."""
    server = Twice(split=split)
    adapter = OpenAICompatAdapter(provider(await server.start()), session)

    async def ask(prompt: str) -> str:
        if not stream:
            answer = await adapter.complete(RunKind.CHAT, chat(messages=[{"role": "user", "content": prompt}]), "r")
            return str(answer["choices"][0]["message"]["content"])
        text = ""
        async for chunks in adapter.stream(RunKind.CHAT, chat(messages=[{"role": "user", "content": prompt}],
                                                              stream=True), "r"):
            text += "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        return text

    try:
        assert await ask("the first caller's") == "the first caller's"
        pooled = sending.sent_on()
        assert pooled is not None and not pooled.should_close  # (back in the pool, its answer read)
        came = asyncio.Event()
        received = pooled.data_received

        def noted(data: bytes) -> None:  # (the copy read into the pooled connection)
            received(data)
            came.set()

        pooled.data_received = noted  # type: ignore[method-assign]
        server.send_copy.set()
        await asyncio.wait_for(came.wait(), 5)
        assert await ask("the second caller's") == "the second caller's"
        # From then on its connections are not kept: a copy that comes a moment later than this one,
        # after the next request went out, would be read as that request's answer.
        assert await ask("the third caller's") == "the third caller's"
        assert await ask("the fourth caller's") == "the fourth caller's"
    finally:
        await server.stop()
    assert server.requests == 4 and server.connections == 4
    assert [r.getMessage().endswith("its connections are no longer kept between runs") for r in caplog.records
            if r.name == "iop.worker"] == [True]
