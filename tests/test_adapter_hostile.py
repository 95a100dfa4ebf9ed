"""The adapters against hostile providers: raw-socket HTTP servers on port 0 that answer what no
well-behaved server would. An endless model list, a stream kept open (or going on) after its end
marker, chunks that are not objects or carry an error as a string, redirects to another host, and
JSON nested thousands deep. Each must end as a bounded read, a whole answer, or one clear
ProviderError; never a hang, a leak to another host, or an exception the runner does not know."""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import json
import logging
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from common.codec import Unpackable, pack
from common.config import ProviderConfig
from common.policy import Health
from common.wire import ErrorCode, RunKind
from gateway.responses import sse_chunks, with_model
from tests.conftest import async_wait_until as until
from tests.fakes.raw_http import RawHttp
from workers.adapters.base import DEFAULT_LIMITS, DOWN, ProviderError, ReadLimits, Retry
from workers.adapters.failures import body_text, callers_retry
from workers.adapters.ollama import OllamaAdapter
from workers.adapters.openai_compat import OpenAICompatAdapter, SSEParser, choices_asked
from workers.adapters.reading import MAX_DEPTH, LineSplitter, ReadWatch, parse_json
from workers.service import provider_session

SERVED = "m-served"
CHUNKED = "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Answer = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Raw(RawHttp):
    """Reads each connection's one request, lets `answers[path]` write whatever it likes (404 when
    none), then waits for the client to close the connection (`hold`) or closes it. Counts the
    connections the client closed."""

    answers: dict[str, Answer] = field(default_factory=dict)
    hold: bool = False
    requests: list[Request] = field(default_factory=list)
    disconnects: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            first, *lines = head.decode("latin-1").split("\r\n")
            method, path, _ = first.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            request = Request(method, path, headers, body)
            self.requests.append(request)
            answer = self.answers.get(path)
            if answer is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            else:
                await answer(request, writer)
            await writer.drain()
            if self.hold:
                while await reader.read(65536):
                    pass
                self.disconnects += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.disconnects += 1


@pytest.fixture
async def raw() -> AsyncIterator[Raw]:
    server = Raw()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def other() -> AsyncIterator[Raw]:
    """Another host a redirect points to: it must never be asked anything."""
    server = Raw()
    await server.start()
    yield server
    await server.stop()


def openai(url: str, **extra: Any) -> ProviderConfig:
    return ProviderConfig.model_validate({"id": "vllm-h", "type": "vllm", "base_url": url, "capacity": 1,
                                          "models": [SERVED], **extra})


def ollama(url: str, **extra: Any) -> ProviderConfig:
    return ProviderConfig.model_validate({"id": "ollama-h", "type": "ollama", "base_url": url, "capacity": 1,
                                          "models": [SERVED], **extra})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], **extra}


def whole(status: str, body: bytes, content_type: str = "application/json", extra: str = "") -> Answer:
    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                     f"{extra}Connection: close\r\n\r\n".encode() + body)
    return answer


def redirect(status: str, location: str) -> Answer:
    return whole(status, b"", "text/plain", f"Location: {location}\r\n")


def frame(part: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(part), part)


def chunked(parts: list[bytes], *, end: bool = True, content_type: str = "text/event-stream") -> Answer:
    """A chunked answer of `parts`; without `end` the last chunk never comes (the connection stays
    open for as long as the client keeps it)."""
    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n{CHUNKED}".encode())
        for part in parts:
            writer.write(frame(part))
            await writer.drain()
        if end:
            writer.write(b"0\r\n\r\n")
    return answer


def endless(first: bytes, item: bytes, most: int = 256 * 1024 * 1024, status: str = "200 OK") -> Answer:
    """A chunked answer that starts with `first` and repeats `item` until the client leaves (or
    `most` bytes, so a test of code that never stops cannot fill the machine)."""
    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{CHUNKED}".encode())
        block = first + item * (65536 // len(item))
        sent = 0
        while sent < most:
            writer.write(frame(block))
            await writer.drain()
            sent += len(block)
            block = item * (65536 // len(item))
    return answer


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def delta(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": SERVED,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def nd(obj: Any) -> bytes:
    return (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


def said(text: str, done: bool = False) -> dict[str, Any]:
    line: dict[str, Any] = {"model": SERVED, "message": {"role": "assistant", "content": text}, "done": done}
    if done:
        line.update(done_reason="stop", prompt_eval_count=3, eval_count=2)
    return line


async def collect(stream: AsyncIterator[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [c for read in [r async for r in stream] for c in read]


async def ask_chat(adapter: OpenAICompatAdapter | OllamaAdapter, stream: bool, run_id: str = "run_1") -> None:
    """A chat run to the end, streamed or whole (what it answered is not kept: the tests look at how it fails)."""
    if stream:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), run_id))
    else:
        await adapter.complete(RunKind.CHAT, chat(), run_id)


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


# ---------------------------------------------------------------------------------- probes


async def test_an_endless_model_list_is_a_failed_probe_not_a_memory_spike(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/health"] = whole("200 OK", b"{}")
    raw.answers["/v1/models"] = endless(b'{"object": "list", "data": [', b'{"id": "m", "object": "model"}, ')
    raw.hold = True
    limits = ReadLimits(probe_bytes=256 * 1024)
    adapter = OpenAICompatAdapter(openai(raw.url, probe_timeout_ms=3000), session, limits)
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN
    assert probe.reason == "GET /v1/models answered more than 262144 bytes"

    async def left() -> bool:
        return raw.disconnects >= 1

    await until(left, 5, "the probe to close its connection")


async def test_a_model_list_over_the_bound_by_its_length_is_not_read(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/tags"] = whole("200 OK", b'{"models": [' + b'{"name": "m:latest"},' * 20000 + b'{}]}')
    adapter = OllamaAdapter(ollama(raw.url), session, ReadLimits(probe_bytes=64 * 1024))
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN and probe.reason == "GET /api/tags answered more than 65536 bytes"


async def test_an_endless_ollama_tag_list_is_a_failed_probe(raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/tags"] = endless(b'{"models": [', b'{"name": "m:latest"}, ')
    raw.hold = True
    adapter = OllamaAdapter(ollama(raw.url, probe_timeout_ms=3000), session, ReadLimits(probe_bytes=128 * 1024))
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN and probe.reason == "GET /api/tags answered more than 131072 bytes"


async def test_the_probe_bound_is_never_above_the_answer_bound() -> None:
    assert ReadLimits().probe_limit == 4 * 1024 * 1024
    assert ReadLimits(response_bytes=1000).probe_limit == 1000


# ---------------------------------------------------------------------------------- end markers


async def test_a_stream_ends_at_done_though_the_provider_keeps_it_open(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("a ")), sse(delta("b", "stop")), sse(b"[DONE]")],
                                                  end=False)
    raw.hold = True
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=3000), session)
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1")), 10)
    assert text_of(chunks) == "a b"

    async def left() -> bool:
        return raw.disconnects >= 1

    await until(left, 5, "the adapter to close the connection")


async def test_an_ollama_stream_ends_at_done_though_the_server_keeps_it_open(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/chat"] = chunked([nd(said("a ")), nd(said("b")), nd(said("", done=True))], end=False,
                                       content_type="application/x-ndjson")
    raw.hold = True
    adapter = OllamaAdapter(ollama(raw.url, read_timeout_ms=3000), session)
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1")), 10)
    assert text_of(chunks) == "a b"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]

    async def left() -> bool:
        return raw.disconnects >= 1

    await until(left, 5, "the adapter to close the connection")


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "later-reads"])
async def test_nothing_after_done_reaches_the_caller(together: bool, raw: Raw,
                                                     session: aiohttp.ClientSession) -> None:
    after = [sse(delta("INJECTED-AFTER-DONE")), sse(delta("more", "stop")), b"data: " + b"x" * 70000 + b"\n\n"]
    parts = [sse(delta("ok", "stop")), sse(b"[DONE]"), *after]
    raw.answers["/v1/chat/completions"] = chunked([b"".join(parts)] if together else parts)
    limits = ReadLimits(line_bytes=65536)  # a line after [DONE] over the bound fails nothing
    adapter = OpenAICompatAdapter(openai(raw.url), session, limits)
    chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "ok" and "INJECTED" not in json.dumps(chunks)


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "later-reads"])
async def test_a_garbled_line_after_the_whole_answer_keeps_it(together: bool, raw: Raw, session: aiohttp.ClientSession,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A line that is no event once every choice had its finish_reason (`data: [done]`, lower case)
    failed the run after the whole answer had gone out: the caller got a 502 for it (a
    hostile-provider review). The answer is kept, the rest of the stream not read, and it is logged."""
    parts = [sse(delta("ok ")), sse(delta("done", "stop")), b"data: [done]\n\n", sse(delta("INJECTED"))]
    raw.answers["/v1/chat/completions"] = chunked([b"".join(parts)] if together else parts)
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with caplog.at_level(logging.WARNING, "iop.worker"):
        chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "ok done" and "INJECTED" not in json.dumps(chunks)
    assert [r.getMessage() for r in caplog.records if "after the whole answer" in r.getMessage()] == [
        "provider vllm-h sent a line that is not an event of JSON after the whole answer; the answer is kept, the rest "
        "of its stream not read"]
    garbled = [sse(delta("ok ")), b"data: [done]\n\n", sse(delta("done", "stop"))]  # (before the end: an error)
    raw.answers["/v1/chat/completions"] = chunked(garbled)
    with pytest.raises(ProviderError, match="not valid JSON"):
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_2"))


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "later-reads"])
async def test_nothing_after_ollama_done_reaches_the_caller(together: bool, raw: Raw,
                                                            session: aiohttp.ClientSession) -> None:
    parts = [nd(said("ok")), nd(said("", done=True)), nd(said("INJECTED-AFTER-DONE")), nd(said("", done=True))]
    raw.answers["/api/chat"] = chunked([b"".join(parts)] if together else parts,
                                       content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "ok" and "INJECTED" not in json.dumps(chunks)
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1


def gated(first: bytes, rest: bytes, gate: asyncio.Event, content_type: str) -> Answer:
    """A chunked answer: `first`, then `rest` once the caller has had what `first` gave (`gate`),
    so the two come in two reads."""
    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n{CHUNKED}".encode() + frame(first))
        await writer.drain()
        await gate.wait()
        writer.write(frame(rest) + b"0\r\n\r\n")
    return answer


@pytest.mark.parametrize("native", [False, True], ids=["openai", "ollama"])
async def test_chunks_before_a_garbled_line_in_its_read_reach_the_caller_then_the_error(
        native: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Once output went out, what came before a bad line in the same read goes out too, then the
    error: the caller's output is the provider's up to that line, with no gap (the chunks before it
    in its read were dropped)."""
    gate = asyncio.Event()
    line, garbled = (nd, b"{overloaded}\n") if native else (sse, b"data: {overloaded}\n\n")
    first, rest = line(said("a ") if native else delta("a ")), line(said("b ") if native else delta("b ")) + garbled
    path, content_type = ("/api/chat", "application/x-ndjson") if native else ("/v1/chat/completions",
                                                                             "text/event-stream")
    raw.answers[path] = gated(first, rest, gate, content_type)
    adapter = (OllamaAdapter(ollama(raw.url), session) if native
               else OpenAICompatAdapter(openai(raw.url), session))
    got: list[dict[str, Any]] = []
    with pytest.raises(ProviderError, match="not valid JSON"):
        async for chunks in adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"):
            got += chunks
            gate.set()
    assert text_of(got) == "a b "


def role_chunk() -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "model": SERVED,
            "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}


def test_a_bad_line_before_any_output_fails_the_read_at_once() -> None:
    """Before the caller saw output (an opening alone is none), the error is raised at once:
    nothing went out, the run may go elsewhere. After, the chunks before it come first and it is
    held (`breaks`), without the frames it came through, until the adapter takes it."""
    parser = SSEParser("p", ReadLimits())
    with pytest.raises(ValueError):
        parser.feed(sse(delta("a")) + b"data: {overloaded}\n\n")
    parser = SSEParser("p", ReadLimits(line_bytes=65536))
    assert parser.breaks.passing(parser.feed(sse(role_chunk()))) and not parser.breaks.shown
    with pytest.raises(ValueError):
        parser.feed(sse(delta("a")) + b"data: {overloaded}\n\n")
    parser = SSEParser("p", ReadLimits(line_bytes=65536))
    assert text_of(parser.breaks.passing(parser.feed(sse(delta("a"))))) == "a" and parser.breaks.shown
    assert text_of(parser.feed(sse(delta("b")) + b"data: " + b"x" * 70000 + b"\n\n" + sse(delta("c")))) == "b"
    held = parser.breaks.take()
    assert isinstance(held, ProviderError) and "over" in held.message and held.__traceback__ is None
    assert parser.breaks.broken is None and parser.feed(sse(delta("d"))) == []  # nothing after it is read


@pytest.mark.parametrize("native", [False, True], ids=["openai", "ollama"])
async def test_a_garbled_line_after_an_opening_alone_fails_before_any_output(
        native: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """An opening (a bare `role` chunk; Ollama's line without content) is no output: a garbled
    line in a later read still fails the stream with nothing but the opening given, so the run may
    be tried elsewhere (a review found the content before the garbled line going out, and the run
    failed for good)."""
    gate = asyncio.Event()
    if native:
        first, rest = nd(said("")), nd(said("b ")) + b"{overloaded}\n"
        path, content_type = "/api/chat", "application/x-ndjson"
    else:
        first, rest = sse(role_chunk()), sse(delta("b ")) + b"data: {overloaded}\n\n"
        path, content_type = "/v1/chat/completions", "text/event-stream"
    raw.answers[path] = gated(first, rest, gate, content_type)
    adapter = (OllamaAdapter(ollama(raw.url), session) if native
               else OpenAICompatAdapter(openai(raw.url), session))
    got: list[dict[str, Any]] = []
    if native:  # (a line without content gives the caller no chunk to wait for: one read or two)
        gate.set()
    with pytest.raises(ProviderError, match="not valid JSON"):
        async for chunks in adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"):
            got += chunks
            gate.set()
    assert text_of(got) == ""


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
async def test_a_stream_s_lines_may_end_in_lf_crlf_or_a_cr_alone(end: bytes, raw: Raw,
                                                               session: aiohttp.ClientSession) -> None:
    body = b"".join([sse(delta("a ")), b": ping\n\n", sse(delta("b", "stop")), sse(b"[DONE]")])
    raw.answers["/v1/chat/completions"] = chunked([body.replace(b"\n", end)])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "a b"


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_lines_are_the_same_however_the_reads_cut_them(end: bytes) -> None:
    """A CRLF cut between two reads is one line end, not two (an empty line would end an event)."""
    text = end.join([b"data: 1", b"", b"data: 22", b"", b": c", b"data: 333", b"", b"partial"])
    want = [b"data: 1", b"", b"data: 22", b"", b": c", b"data: 333", b""]
    for size in (1, 2, 3, len(text)):
        splitter = LineSplitter("p", ReadLimits())
        got = [line for i in range(0, len(text), size) for line in splitter.feed(text[i:i + size])]
        assert got == want, size
    splitter = LineSplitter("p", ReadLimits())  # a CR that ends a read ends its line at once
    assert list(splitter.feed(b"data: 1" + end)) == [b"data: 1"]
    assert list(splitter.feed(b"\ndata: 2\n")) == ([b"data: 2"] if end == b"\r" else [b"", b"data: 2"])  # (CR LF)


def test_a_line_dribbled_a_byte_a_read_grows_in_place() -> None:
    """Not copied whole at each read (found by a review: a 1 MiB line in 512-byte reads cost 0.3 s
    of a worker's CPU, and in 1-byte reads a hostile provider's line costs minutes)."""
    splitter = LineSplitter("p", ReadLimits())
    line = b"data: " + b"x" * 10_000
    list(splitter.feed(line[:1]))
    partial = splitter._buf
    for i in range(1, len(line)):
        assert list(splitter.feed(line[i:i + 1])) == []
        assert splitter._buf is partial  # (the same buffer, grown: no copy of what came before)
    assert list(splitter.feed(b"\n")) == [line]


@pytest.mark.timeout(30)
def test_a_line_dribbled_past_the_limit_is_refused_at_the_limit() -> None:
    splitter = LineSplitter("p", ReadLimits(line_bytes=1000))
    with pytest.raises(ProviderError, match="a line"):
        for _ in range(2000):
            list(splitter.feed(b"x"))


def test_a_cr_that_ends_a_read_ends_its_event_in_that_read() -> None:
    """Found by a review: a CR-only server's events came one read late (the CR was held as the
    first half of a CRLF), and its last split event was lost."""
    text = json.dumps(delta("A"), indent=1).encode().replace(b"\n", b"\rdata: ")
    parser = SSEParser("p", ReadLimits())
    assert text_of(parser.feed(b"data: " + text + b"\r\r")) == "A"


# ---------------------------------------------------------------------------------- odd chunks


async def test_chunks_that_are_not_objects_are_dropped_with_one_warning(
        raw: Raw, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    raw.answers["/v1/chat/completions"] = chunked([
        sse(delta("a ")), sse([1, 2, 3]), sse("a string"), sse(42), sse(None), sse(delta("b", "stop")),
        sse(b"[DONE]")])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with caplog.at_level(logging.WARNING, "iop.worker"):
        chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert all(isinstance(c, dict) for c in chunks) and text_of(chunks) == "a b"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["provider vllm-h sent a stream chunk that is not a JSON object (an array); dropped it, "
                        "and any more in this run"]


@pytest.mark.parametrize("choices", [{"index": 0}, "text", [5, None, "x"], [{"index": 0, "delta": "x"}],
                                     [{"index": 0, "delta": ["x"]}]],
                         ids=["object", "string", "mixed", "string-delta", "list-delta"])
async def test_chunks_whose_choices_are_not_a_list_of_objects_are_dropped_too(
        choices: Any, raw: Raw, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    """A caller's client indexes `choices[0].delta`: such a chunk would break it (they were passed
    on; found by a hostile-provider audit), and so would a `delta` that is not an object (the
    `openai` client's `chunk.choices[0].delta.content` raised AttributeError on `"delta": "x"`,
    passed on; found by a second one)."""
    raw.answers["/v1/chat/completions"] = chunked([
        sse(delta("a ")), sse({"object": "chat.completion.chunk", "choices": choices}), sse(delta("b", "stop")),
        sse(b"[DONE]")])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with caplog.at_level(logging.WARNING, "iop.worker"):
        chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "a b" and all(isinstance(c["choices"], list) for c in chunks)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "provider vllm-h sent a stream chunk whose choices are not a list of objects, each delta or message an "
        "object; dropped it, and any more in this run"]


@pytest.mark.parametrize("choices", [{"index": 0}, "text", [5, None, "x"], [{"index": 0, "message": "x"}],
                                     [{"index": 0, "message": 5}]],
                         ids=["object", "string", "mixed", "string-message", "number-message"])
async def test_an_answer_whose_choices_are_not_a_list_of_objects_is_a_provider_error(
        choices: Any, raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = whole("200 OK", json.dumps(
        {"object": "chat.completion", "model": SERVED, "choices": choices}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert err.value.message == ("provider vllm-h answered with choices that are not a list of objects, each delta "
                                 "or message an object")
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


BINARY = bytes(range(256)) * 4  # not UTF-8 (0x80 alone)
CONTROLS = b"\x01\x02\x00\x03gz" * 50  # UTF-8, but control characters


@pytest.mark.parametrize("body", [BINARY, CONTROLS], ids=["not-utf8", "controls"])
async def test_a_binary_error_body_is_named_not_shown(body: bytes, raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = whole("500 Internal Server Error", body, "application/octet-stream")
    raw.answers["/api/chat"] = whole("500 Internal Server Error", body, "application/octet-stream")
    for adapter in (OpenAICompatAdapter(openai(raw.url), session), OllamaAdapter(ollama(raw.url), session)):
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, chat(), "run_1")
        assert err.value.message.endswith("answered 500: a body that is not text"), err.value.message


def test_an_error_body_cut_inside_a_character_is_still_text() -> None:
    assert body_text("model “x”".encode()[:-1]) == "model “x"  # (the read stopped inside ”)
    assert body_text("échec : modèle introuvable\n".encode()) == "échec : modèle introuvable\n"


async def test_ollama_lines_that_are_not_objects_are_dropped_with_one_warning(
        raw: Raw, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    raw.answers["/api/chat"] = chunked([nd(said("a ")), nd("a string"), nd([1]), nd(said("", done=True))],
                                       content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    with caplog.at_level(logging.WARNING, "iop.worker"):
        chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "a "
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "provider ollama-h sent a stream chunk that is not a JSON object (a string); dropped it, and any more "
        "in this run"]


@pytest.mark.parametrize(("error", "said_text"), [
    ("a string error", "a string error"),
    (["a", "list"], '["a", "list"]'),
])
async def test_an_error_chunk_is_the_providers_error_whatever_its_shape(
        error: Any, said_text: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("a ")), sse({"error": error}),
                                                   sse(delta("b", "stop")), sse(b"[DONE]")])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == f"provider vllm-h sent an error: {said_text}"


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "later-reads"])
async def test_what_came_before_an_error_chunk_reaches_the_caller_first(together: bool, raw: Raw,
                                                                          session: aiohttp.ClientSession) -> None:
    """The output read with the error in the same read is not lost with it (found by an audit)."""
    openai_parts = [sse(delta("partial ")), sse({"error": {"message": "upstream broke"}}), sse(delta("after"))]
    ollama_parts = [nd(said("partial ")), nd({"error": "upstream broke"}), nd(said("after"))]
    raw.answers["/v1/chat/completions"] = chunked([b"".join(openai_parts)] if together else openai_parts)
    raw.answers["/api/chat"] = chunked([b"".join(ollama_parts)] if together else ollama_parts,
                                       content_type="application/x-ndjson")
    for adapter in (OpenAICompatAdapter(openai(raw.url), session), OllamaAdapter(ollama(raw.url), session)):
        got: list[dict[str, Any]] = []
        with pytest.raises(ProviderError) as err:
            async for read in adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"):
                got += read
        assert text_of(got) == "partial " and err.value.message.endswith("sent an error: upstream broke")


@pytest.mark.parametrize("ending", ["done", "broken"])
async def test_a_stream_whose_second_choice_never_finished_is_not_whole(
        ending: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """With n=2, one finish_reason is not the end: [DONE] or a broken connection before the other
    choice's is an error, not a whole answer (found by an audit)."""
    def choice(index: int, text: str, finish: str | None = None) -> bytes:
        return sse({"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]})

    parts = [choice(0, "a", "stop"), choice(1, " more")]
    if ending == "done":
        raw.answers["/v1/chat/completions"] = chunked([*parts, sse(b"[DONE]")])
    else:
        async def broken(request: Request, writer: asyncio.StreamWriter) -> None:
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{CHUNKED}".encode())
            writer.write(frame(b"".join(parts)) + b"5\r\nab")  # a chunk cut off: the connection breaks
            await writer.drain()
            writer.transport.abort()
        raw.answers["/v1/chat/completions"] = broken
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True, n=2), "run_1"))
    if ending == "done":
        assert err.value.message == ("provider vllm-h: the stream was cut short ([DONE] without a finish_reason "
                                     "for every choice)")


@pytest.mark.parametrize("events", [
    [sse({"error": {"message": "CUDA out of memory", "code": 500}})],
    [b'data: {"object": "error", "message": "CUDA out of memory", "type": "InternalServerError", "code": 500}\n\n'],
    [b'event: error\ndata: {"message": "CUDA out of memory"}\n\n'],
], ids=["error-field", "flat-vllm", "event-error"])
async def test_an_error_in_the_stream_says_its_message_and_may_go_to_another_provider(
        events: list[bytes], raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("")), *events, sse(delta("b", "stop"))])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider vllm-h sent an error: CUDA out of memory"
    assert err.value.retry is Retry.ELSEWHERE  # (before output: elsewhere)
    # (one whose server says it is a 5xx shows nothing of its health, as answered whole; else it answered)
    assert err.value.strikes == (None if b'"code": 500' in events[0] else 0)


def parsed(*reads: bytes) -> tuple[list[dict[str, Any]], ProviderError | None]:
    parser = SSEParser("p", ReadLimits())
    return [c for data in reads for c in parser.feed(data)], parser.failed


def test_an_error_event_is_an_error_whatever_its_data() -> None:
    """Found by a review: an `event: error` with empty data, or with `[DONE]`, went unseen."""
    for data in (b"", b"[DONE]", b"overloaded", b'{"message": "overloaded"}'):
        _, failed = parsed(b"event: error\n \ndata: " + data + b"\n\n")  # (a line of spaces is no blank line)
        assert failed is not None and failed.message.startswith("provider p sent an error: "), data
    chunks, failed = parsed(b"event: error\n\n" + sse(delta("a")))  # (the blank line ended that event)
    assert failed is None and text_of(chunks) == "a"


def test_a_byte_order_mark_cut_between_two_reads_loses_nothing() -> None:
    chunks, failed = parsed(b"\xef", b"\xbb\xbf" + sse(delta("A")))
    assert failed is None and text_of(chunks) == "A"


def test_an_error_in_the_stream_may_go_elsewhere_whatever_its_code() -> None:
    """vLLM gives code 400 to every fault of its stream, its engine's too (a second review): the
    code is no status, and another provider may serve the run."""
    _, failed = parsed(sse({"error": {"message": "CUDA error: an illegal memory access", "type": "BadRequestError",
                                      "code": 400}}))
    assert failed is not None and failed.status is None and failed.retry is Retry.ELSEWHERE


def test_an_event_split_over_data_lines_is_joined_as_the_sse_standard_says() -> None:
    """Three `data:` lines of one event are one JSON text, joined with LF (the `openai` client reads
    them so); the lines may come in different reads."""
    text = json.dumps(delta("a\nb"), indent=1).encode()  # (a JSON text over several lines)
    event = b"".join(b"data: " + line + b"\n" for line in text.split(b"\n")) + b"\n"
    chunks, failed = parsed(event[:40], event[40:] + sse(delta("c")))
    assert failed is None and text_of(chunks) == "a\nbc"


def test_done_while_an_event_is_held_fails_it_at_once() -> None:
    """A server that ends events with one line end, and a line cut between tokens: `[DONE]` cannot
    go on any JSON (a second review found the stream's every later line held, `[DONE]` too)."""
    parser = SSEParser("p", ReadLimits())
    with pytest.raises(ValueError, match="cut short by"):
        parser.feed(b'data: {"choices": [{"index": 0, "finish_reason": null\ndata: [DONE]\n')


def test_a_line_wrong_before_its_end_is_not_held_for_more() -> None:
    """Only JSON that runs out may go on in the next `data:` line: a garbled line fails at once, as
    before lines were joined (a review found a server that ends its events with one line end
    holding the run until `read_timeout_ms`, or failing it as over `max_line_bytes`)."""
    for garbled in (b"{overloaded}", b'{"a": "unclosed', b"{\xff}", b'{"a": 1}}'):
        parser = SSEParser("p", ReadLimits())
        with pytest.raises(ValueError):
            parser.feed(sse(delta("A")).replace(b"\n\n", b"\n") + b"data: " + garbled + b"\n")


def test_events_ended_by_one_line_end_are_read_each() -> None:
    chunks, failed = parsed(b"".join(b"data: " + json.dumps(delta(t)).encode() + b"\n" for t in "abc"))
    assert failed is None and text_of(chunks) == "abc"


def test_an_error_event_is_the_error_at_its_first_data_line() -> None:
    """Even one split over lines (its first line is all it says): nothing after it is waited for,
    so a server that keeps its connection open after it does not hold the run (a review found the
    run waiting out `read_timeout_ms`, and its error lost when the stream ended there)."""
    _, failed = parsed(b'event: error\ndata: {"error": {"message":\n')
    assert failed is not None and failed.message == 'provider p sent an error: {"error": {"message":'
    assert failed.retry is Retry.ELSEWHERE and failed.strikes == 0


def test_a_split_event_is_bounded_and_one_that_never_parses_fails() -> None:
    parser = SSEParser("p", ReadLimits(line_bytes=100))
    with pytest.raises(ProviderError, match="an event"):
        parser.feed(b"data: {\n" + b"\n".join(b"data: " + b"x" * 30 for _ in range(4)) + b"\n")
    with pytest.raises(ValueError):
        parsed(b'data: {"choices":\ndata: [\n\n')
    parser = SSEParser("p", ReadLimits())
    assert parser.feed(b'data: {"choices":\n') == []
    assert parser.end() == [] and not parser.done  # (the stream ended inside the event: cut short)
    parser = SSEParser("p", ReadLimits())  # (an event whole but for its blank line: read)
    assert parser.feed(b'data: {"choices":\ndata: [], "usage": {"total_tokens": 3}}\n') == []
    assert parser.end() == [{"choices": [], "usage": {"total_tokens": 3}}]


def test_an_event_of_600_000_tiny_data_lines_is_refused_at_the_limit() -> None:
    """Its lines are counted as they come (a sum over the held lines at each line made this
    quadratic: hours of a worker's CPU for one provider's answer), and held in one buffer."""
    parser = SSEParser("p", ReadLimits())  # (1 MiB)
    with pytest.raises(ProviderError, match="an event"):
        for _ in range(600):  # (600,000 lines, 1.2 MB held, joined)
            parser.feed(b"data: {\n" if parser._split is None else b"data: 1\n" * 1000)


@pytest.mark.parametrize("closing", ["terminated", "broken"])
async def test_a_last_split_event_without_its_blank_line_is_read_however_the_body_ends(
        closing: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """A whole answer, then a usage chunk split over lines with no blank line: it is read whether
    the body ends cleanly or breaks off (a second review found it lost when it broke off)."""
    usage = b'data: {"choices": [],\ndata: "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\n'

    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{CHUNKED}".encode())
        writer.write(frame(sse(delta("A", "stop"))) + frame(usage))
        if closing == "terminated":
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"5\r\nab")  # (a chunk cut off: the connection breaks)
        await writer.drain()
        writer.transport.abort()

    raw.answers["/v1/chat/completions"] = answer
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "A"  # (its usage as OpenAI's has it: its total too)
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


async def test_a_stream_that_ends_inside_a_split_event_fails_the_run(raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("A")), b'data: {"choices": [\n'])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider vllm-h: the stream ended before [DONE]"  # (as one cut mid-line)


async def test_a_byte_order_mark_and_empty_data_lines_lose_nothing(raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = chunked([
        b"\xef\xbb\xbf" + sse(delta("A")), b"data:\n\n", b"data: \n\n", sse(delta("B", "stop")), sse(b"[DONE]")])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    assert text_of(await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))) == "AB"


async def test_a_4xx_in_the_flat_shape_of_older_vllm_says_its_message(raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = whole("400 Bad Request", json.dumps(
        {"object": "error", "message": "max_tokens must be at least 1", "type": "BadRequestError",
         "param": "max_tokens", "code": 400}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert err.value.message == "provider vllm-h answered 400: max_tokens must be at least 1"
    assert err.value.detail is not None and err.value.detail["type"] == "BadRequestError"
    assert err.value.detail["param"] == "max_tokens"


@pytest.mark.parametrize(("body", "content_type", "pool_s"), [
    (b"404 page not found", "text/plain", True),  # (no error object: a path the server lacks, base_url wrong)
    (b'{"error": {"message": "Invalid URL (POST /v1/m-served-x/completions)"}}', "application/json", False),
    (b'{"error": {"message": "model \\"m-served\\" not found, try pulling it first"}}', "application/json", True),
], ids=["plain-text", "a-name-inside-another", "quoted"])
def test_which_404s_are_the_pool_s(body: bytes, content_type: str, pool_s: bool) -> None:
    """A 404 is the pool's fault when it names the served model as a word of its own, or is no error
    object at all (a second review: a wrong base_url's 404 went to the caller as a sign of life)."""
    from workers.adapters.failures import answered_error, names

    payload = json.loads(body) if content_type == "application/json" else None
    message = payload["error"]["message"] if payload else body.decode()
    err = answered_error("p", 404, message, payload["error"] if payload else None, SERVED)
    assert (err.retry is Retry.ELSEWHERE and err.status is None) == pool_s, (err.retry, err.status)
    assert names("The model `m-served` does not exist.", SERVED) and not names("m-served-2", SERVED)


@pytest.mark.parametrize(("error", "one_model_s"), [
    ({"message": "Project `proj_1` does not have access to model `m-served`", "type": "invalid_request_error",
      "code": "model_not_found"}, True),
    ({"message": "You are not allowed to sample from this model", "code": "model_not_found"}, True),
    ({"message": "The model m-served is not available to your organization"}, True),
    ({"message": "Incorrect API key provided", "code": "invalid_api_key"}, False),
], ids=["openai-project", "code-only", "names-it", "credentials"])
def test_a_403_about_one_model_is_no_strike_against_its_provider(error: dict[str, Any], one_model_s: bool) -> None:
    """A hosted API's key that may not use one model (OpenAI: 403 `model_not_found`): tried elsewhere
    with no strike, as a 404 naming the served model is; three such runs took the provider down for
    all its models (1,300 callers of another model got 503 in 2 s: a hosted-API audit). A refusal of
    iop's credentials is still a strike."""
    from workers.adapters.failures import answered_error

    err = answered_error("p", 403, error["message"], error, SERVED)
    assert err.retry is Retry.ELSEWHERE
    assert (err.strikes is None) is one_model_s and (err.strikes == 1) is not one_model_s


#: Azure OpenAI's answer to a run whose deployment (the served name) the resource does not have: a 404
#: that does not name it, its `code` saying so
AZURE_NO_DEPLOYMENT = {"code": "DeploymentNotFound", "message": "The API deployment for this resource does not "
                       "exist. If you created the deployment within the last 5 minutes, please wait a moment and "
                       "try again."}


def test_an_azure_deployment_not_found_is_the_pools_not_the_callers() -> None:
    """Azure's 404 `DeploymentNotFound` says the provider lacks the served model (its deployment), as a 404
    that names it does: another provider of the model may serve the run, and it is no sign of life. It was
    the caller's 404 (its message names no model): never tried elsewhere, and a sign of life, so every run
    sent there failed so while another provider was idle (Azure's model list lists models, not
    deployments: no probe finds it gone)."""
    from workers.adapters.failures import answered_error

    err = answered_error("p", 404, AZURE_NO_DEPLOYMENT["message"], dict(AZURE_NO_DEPLOYMENT), SERVED)
    assert (err.retry, err.status, err.strikes) == (Retry.ELSEWHERE, None, None)
    other = answered_error("p", 404, "no such file", {"message": "no such file", "code": "file_not_found"}, SERVED)
    assert (other.retry, other.status, other.strikes) == (Retry.NO, 404, 0)  # (the caller's: a file it named)


#: OpenRouter's moderation refusing a caller's input: a 403 whose message names the model by OpenRouter's
#: own slug (a dated one, not always the name asked for), `metadata` saying why
MODERATION_403 = {"code": 403, "message": "{model} requires moderation on OpenInference. Your input was flagged "
                  "for \"violence/graphic\". No credits were charged.",
                  "metadata": {"reasons": ["violence/graphic"], "flagged_input": "...",
                               "provider_name": "OpenInference", "model_slug": "{model}"}}


@pytest.mark.parametrize("model", [SERVED, SERVED + "-20260211"], ids=["names-it", "its-own-slug"])
def test_a_403_of_a_hosted_apis_moderation_is_the_callers_answer(model: str) -> None:
    """OpenRouter's moderation refuses a caller's input with a 403 ("… requires moderation on X. Your input
    was flagged for …"): the caller's own request, passed through with its status, never tried elsewhere,
    and no word on the provider's health. It read as a refusal of iop's credentials (a strike each: three
    flagged prompts took the provider down for all its models, the caller told 502 "check the provider's
    api_key_env", which the official clients send twice more), or, when it named the served model, as the
    provider lacking that model (tried elsewhere, the provider blamed, and benched, for what a caller sent)."""
    from common.api_error import ApiError
    from common.wire import ErrorInfo
    from workers.adapters.failures import answered_error
    from workers.adapters.openai_compat import sent_error

    error = json.loads(json.dumps(MODERATION_403).replace("{model}", model))
    err = answered_error("p", 403, error["message"], error, SERVED)
    assert (err.retry, err.status, err.strikes) == (Retry.NO, 403, 0)
    api = ApiError.from_info(ErrorInfo(err.code, err.message, status=err.status, detail=err.detail))
    assert api.status == 403 and api.body()["error"]["message"] == error["message"]
    # (the same sent in a stream with its status, as Lemonade's proxy gives it; a hosted API's stream gives
    # none, so its refusal stays what any error in such a stream is, and is no missing model either)
    said = sent_error("p", {**error, "status_code": 403}, 500, "lemonade", SERVED)
    assert (said.retry, said.status, said.strikes) == (Retry.NO, 403, 0)
    said = sent_error("p", error, 500, "openai_api", SERVED)
    assert (said.retry, said.strikes) == (Retry.ELSEWHERE, 0)


async def test_an_error_body_written_in_pieces_is_read_whole(raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by an audit: one read took only what had arrived, and the caller got `{"error": {"message"`."""
    body = json.dumps({"error": {"message": "temperature must be a number", "type": "BadRequestError",
                                 "param": "temperature", "code": None}}).encode()

    async def in_two_pieces(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                     "\r\nConnection: close\r\n\r\n".encode() + body[:20])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(body[20:])

    raw.answers["/v1/chat/completions"] = in_two_pieces
    raw.answers["/api/chat"] = in_two_pieces
    for adapter in (OpenAICompatAdapter(openai(raw.url), session), OllamaAdapter(ollama(raw.url), session)):
        with pytest.raises(ProviderError) as err:
            await adapter.complete(RunKind.CHAT, chat(), "run_1")
        assert "temperature must be a number" in err.value.message, err.value.message


async def test_a_passed_4xx_s_type_param_and_code_are_one_short_line_each(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by an audit: only its message was flattened and cut; 55 KB of the rest, newlines and
    escape bytes, reached the caller."""
    raw.answers["/v1/chat/completions"] = whole("400 Bad Request", json.dumps({"error": {
        "message": "bad", "type": "line1\nline2\r\x1b[31m" + "t" * 20_000, "param": "p\n" * 5_000,
        "code": "c" * 20_000}}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    detail = err.value.detail
    assert detail is not None and detail["type"].startswith("line1 line2 ?[31mttt")
    assert all(len(detail[name]) <= 200 and "\n" not in detail[name] for name in ("type", "param", "code"))


async def test_an_endless_error_body_is_read_to_its_bound(raw: Raw, session: aiohttp.ClientSession) -> None:
    """At most `MAX_ERROR_BODY` of an error answer is read; the message is cut to 500 characters."""
    raw.answers["/v1/chat/completions"] = endless(b'{"error": {"message": "', b"x",
                                                  status="500 Internal Server Error")
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await asyncio.wait_for(adapter.complete(RunKind.CHAT, chat(), "run_1"), 30)
    assert err.value.message.startswith('provider vllm-h answered 500: {"error": {"message": "xxx')
    assert len(err.value.message) < 600


async def test_an_error_body_that_trickles_is_read_for_a_bounded_time(
        raw: Raw, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error body that never ends: what came by `ERROR_BODY_S` is what is shown."""
    monkeypatch.setattr("workers.adapters.reading.ERROR_BODY_S", 0.2)

    async def trickle(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 1000"
                     b"\r\n\r\nengine stalled")  # (and nothing more, the connection held open)

    raw.answers["/v1/chat/completions"] = trickle
    raw.hold = True
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=60_000), session)
    with pytest.raises(ProviderError) as err:
        await asyncio.wait_for(adapter.complete(RunKind.CHAT, chat(), "run_1"), 30)
    assert err.value.message == "provider vllm-h answered 500: engine stalled"


async def test_a_404_that_names_the_served_model_is_the_pool_s_fault_and_no_sign_of_life(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """A provider that does not have the served name (it unloaded it): the caller asked for a model
    iop routes there, so it is not the caller's 404; nor does it show the provider alive, so its
    model list is probed again (found by an audit: every run went there and got 404). A 404 that
    does not name it (OpenAI's for a chat model on /v1/completions) is the caller's, as it was."""
    raw.answers["/v1/chat/completions"] = whole("404 Not Found", json.dumps(
        {"object": "error", "message": f"The model `{SERVED}` does not exist.", "type": "NotFoundError",
         "code": 404}).encode())
    raw.answers["/v1/completions"] = whole("404 Not Found", json.dumps({"error": {
        "message": "This is a chat model and not supported in the v1/completions endpoint.",
        "type": "invalid_request_error", "param": "model", "code": None}}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert err.value.message == f"provider vllm-h answered 404: The model `{SERVED}` does not exist."
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes is None and err.value.status is None
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.COMPLETION, {"model": SERVED, "prompt": "x"}, "run_2")
    assert err.value.status == 404 and err.value.retry is Retry.NO and err.value.strikes == 0
    assert err.value.detail is not None and err.value.detail["param"] == "model"


async def test_a_200_answer_that_is_an_error_is_the_provider_s_error_not_a_completion(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """A whole answer that carries only an error (found by an audit: the caller got it as a 200
    without choices, the run counted completed), from either family; and Ollama's answer that is
    not done."""
    raw.answers["/v1/chat/completions"] = whole("200 OK", b'{"error": {"message": "model crashed"}}')
    raw.answers["/api/chat"] = whole("200 OK", b'{"error": "model runner has unexpectedly stopped"}')
    raw.answers["/api/generate"] = whole("200 OK", json.dumps(
        {"model": SERVED, "response": "par", "done": False}).encode())
    said = {}
    for adapter, kind, body in ((OpenAICompatAdapter(openai(raw.url), session), RunKind.CHAT, chat()),
                                (OllamaAdapter(ollama(raw.url), session), RunKind.CHAT, chat()),
                                (OllamaAdapter(ollama(raw.url), session), RunKind.COMPLETION,
                                 {"model": SERVED, "prompt": "x"})):
        with pytest.raises(ProviderError) as err:
            await adapter.complete(kind, body, "run_1")
        assert err.value.retry is Retry.ELSEWHERE
        said[(type(adapter).__name__, kind.value)] = err.value.message
    assert said == {("OpenAICompatAdapter", "chat"): "provider vllm-h sent an error: model crashed",
                    ("OllamaAdapter", "chat"): "provider ollama-h sent an error: model runner has unexpectedly stopped",
                    ("OllamaAdapter", "completion"): "provider ollama-h answered before it was done"}


async def test_a_server_that_ignores_n_answers_whole_with_one_choice(raw: Raw, session: aiohttp.ClientSession) -> None:
    """llama-cpp-python's server drops `n`: its one choice and [DONE] are the whole answer (found by a
    review: the stream failed after its whole answer)."""
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("a ")), sse(delta("b", "stop")), sse(b"[DONE]")])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    assert text_of(await collect(adapter.stream(RunKind.CHAT, chat(stream=True, n=2), "run_1"))) == "a b"


async def test_a_stream_that_ends_before_any_event_is_no_strike(raw: Raw, session: aiohttp.ClientSession) -> None:
    """llama-cpp-python answers a streamed prompt beyond its context with a 200 and no events: the
    same again on every attempt, so not three attempts and three strikes that took the provider down
    for everyone (found against the real server)."""
    raw.answers["/v1/chat/completions"] = chunked([])
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider vllm-h: the stream ended before any event"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes is None


@pytest.mark.parametrize("answer", [
    whole("200 OK", b"", "application/x-ndjson"),
    chunked([], content_type="application/x-ndjson"),
    chunked([b"\n", b"  \r\n"], content_type="application/x-ndjson"),
    chunked([b"null\n", b"[]\n", b'"x"\n'], content_type="application/x-ndjson"),  # (dropped: found by a review)
    whole("204 No Content", b""),
], ids=["200-empty", "200-chunked-empty", "200-blanks", "200-no-objects", "204"])
async def test_an_ollama_answer_with_nothing_in_it_is_no_strike(answer: Answer, raw: Raw,
                                                               session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: an Ollama stream answered 200 with an empty body (or a 204)
    was "ended before it was done", a strike and another attempt anywhere: three calls to the same
    provider within milliseconds, and it was down. It is the provider's answer, as the OpenAI
    family's stream that ends before any event: tried on another provider only, no strike. So is the
    same answer to a whole request (asked for as a stream too)."""
    raw.answers["/api/chat"] = answer
    adapter = OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider ollama-h: the stream ended before any line"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes is None
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_2")
    assert err.value.message == "provider ollama-h answered with no JSON object"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_an_ollama_stream_that_ends_after_a_line_without_done_is_its_answer_not_a_strike(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by an audit against Ollama's source: a body that ends whole after lines, without
    `"done": true`, is what Ollama itself sends when its guard against a repeating token stops the
    generation (llm/llama_server.go:1692-1703, `return ctx.Err()`: nil) or when it drops its
    runner's error event (`llamaServerCompletionResponse` has no `error`): a healthy server's answer
    to that request. It was a strike and another attempt anywhere; whole, the same run was a 200
    that is not done, no strike and tried elsewhere only: now the stream is the same. A body cut
    short (no last chunk) is still a cut: the server's connection broke."""
    raw.answers["/api/chat"] = chunked([nd(said("a"))], content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider ollama-h: the stream ended before it was done"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0
    raw.answers["/api/chat"] = chunked([nd(said("a"))], end=False, content_type="application/x-ndjson")
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_2"))
    assert err.value.message == "provider ollama-h: the response broke off before it was complete"
    assert err.value.retry is Retry.ANY and err.value.strikes is None


def not_http(head: bytes) -> Answer:
    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
    return answer


@pytest.mark.parametrize("family", ["openai", "ollama"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("head", [
    b"\x1b[31mSSH-2.0-OpenSSH\r\n\x00\xff garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
], ids=["banner", "header-line-200KB"])
async def test_an_answer_that_is_not_http_is_a_strike_and_goes_elsewhere(
        family: str, stream: bool, head: bytes, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: another protocol's banner, or a header line past aiohttp's
    limit, was a strike and another attempt anywhere: the same garbage three times from the same
    provider for one run. It would answer the same again: another provider only; the strike stays
    (a provider that answers every run so goes down)."""
    path = "/v1/chat/completions" if family == "openai" else "/api/chat"
    raw.answers[path] = not_http(head)
    adapter = OpenAICompatAdapter(openai(raw.url), session) if family == "openai" else \
        OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await ask_chat(adapter, stream)
    assert err.value.message == f"provider {adapter.provider.id}: the answer was not valid HTTP"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 1


async def test_an_error_object_without_a_message_is_named_by_its_type(raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/completions"] = whole("500 Internal Server Error", json.dumps(
        {"error": {"message": "", "type": "internal_server_error", "param": None, "code": None}}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.COMPLETION, {"model": SERVED, "prompt": ["a", "b"]}, "run_1")
    assert err.value.message == "provider vllm-h answered 500: internal_server_error without a message"


@pytest.mark.parametrize("ending", ["broken", "closed"])
async def test_without_done_every_choice_asked_for_must_finish(ending: str, raw: Raw,
                                                               session: aiohttp.ClientSession) -> None:
    """Only [DONE] says that the choices sent are all there are (a second review: n=2 and a stream
    that broke off after the first choice's finish was taken for whole)."""
    first = sse(delta("a", "stop"))
    if ending == "closed":
        raw.answers["/v1/chat/completions"] = chunked([first])
    else:
        async def broken(request: Request, writer: asyncio.StreamWriter) -> None:
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{CHUNKED}".encode())
            writer.write(frame(first) + b"5\r\nab")
            await writer.drain()
            writer.transport.abort()
        raw.answers["/v1/chat/completions"] = broken
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError):
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True, n=2), "run_1"))


@pytest.mark.parametrize("opening", [b"\xef\xbb\xbf\n", b"\xef", b""], ids=["bom-newline", "bom-cut", "none"])
@pytest.mark.parametrize("answer", [b'{"error": {"message": "model crashed"}}', b'[{"error": "model crashed"}]'],
                         ids=["object", "array"])
async def test_a_json_answer_is_told_from_events_after_a_bom_or_blanks(
        opening: bytes, answer: bytes, raw: Raw, session: aiohttp.ClientSession) -> None:
    parts = [b"\xef", b"\xbb\xbf" + answer] if opening == b"\xef" else [opening, answer] if opening else [answer]
    raw.answers["/v1/chat/completions"] = chunked(parts, content_type="text/event-stream")
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.strikes in (0, None) and err.value.retry is Retry.ELSEWHERE, err.value.message


async def test_events_labelled_json_are_read_as_events(raw: Raw, session: aiohttp.ClientSession) -> None:
    """Microsoft's Foundry Local sends its events as `application/json`: the first byte decides."""
    raw.answers["/v1/chat/completions"] = chunked([b"\n" + sse(delta("a ")), sse(delta("b", "stop")),
                                                   sse(b"[DONE]")], content_type="application/json")
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    assert text_of(await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))) == "a b"


@pytest.mark.parametrize(("answer", "message"), [
    (b'{"error": {"message": "model crashed"}}', "provider vllm-h sent an error: model crashed"),
    (json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]}).encode(),
     "provider vllm-h answered a stream request with one JSON answer, not server-sent events")],
    ids=["error", "whole-answer"])
async def test_a_stream_answered_with_one_json_answer_is_no_strike(
        answer: bytes, message: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/v1/chat/completions"] = whole("200 OK", answer)
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == message
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0  # (it was struck, three times a run)


@pytest.mark.parametrize(("parts", "content_type"), [
    ([b"<!DOCTYPE html>\n<html><body><h1>502 Bad Gateway</h1></body></html>\n"], "text/html"),
    ([b"\r\n  ", b"<html><body>Sign in</body></html>"], "text/html; charset=utf-8"),
    ([b"<?xml version=\"1.0\"?><Error>AccessDenied</Error>"], "application/xml"),
], ids=["html", "html-after-blanks", "xml"])
async def test_a_stream_answered_with_a_page_is_no_strike_and_says_so(
        parts: list[bytes], content_type: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: a proxy's 200 HTML page to a stream request was "the stream
    ended before [DONE]", a strike and another attempt anywhere, so a sole provider was asked three
    times a run and taken down (the same page to a whole request: one attempt, no strike)."""
    raw.answers["/v1/chat/completions"] = chunked(parts, content_type=content_type)
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    kind = content_type.split(";")[0]
    assert err.value.message == f"provider vllm-h answered a stream request with a page ({kind}), not server-sent " \
                                "events"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_ollama_s_done_is_true_only_when_it_is_and_a_last_line_without_its_newline_counts(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by an audit: `"done": "false"` ended the stream (the rest was lost), and a final line
    without its newline left the stream "not done" after its output went out."""
    last = json.dumps(said("", done=True)).encode()  # (no newline after it)
    raw.answers["/api/chat"] = chunked([nd(said("A")), nd({**said("B"), "done": "false"}), nd(said("C")), last],
                                       content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert text_of(chunks) == "ABC"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]


@pytest.mark.parametrize(("data", "problem"), [
    ([{"object": "embedding", "index": 0, "embedding": [0.5, 1]}], "with 1 embeddings for 2 inputs"),
    ({"0": {"embedding": [0.5]}}, "whose data is not a list of objects"),
    ([{"index": 0, "embedding": None}, {"index": 1, "embedding": [1.0]}], "with an embedding that is neither numbers"),
    ([{"index": 0, "embedding": "not base64!"}, {"index": 1, "embedding": "AAAA"}],
     "with an embedding that is neither numbers"),
    ([{"index": 0, "embedding": [1.0, "x"]}, {"index": 1, "embedding": [1.0]}],
     "with an embedding that is neither numbers"),
    # (a hostile-provider review: 2 bytes are no 32-bit float, and the openai client's default call, which
    # asks for base64 and decodes it, raised ValueError "bytes length not a multiple of item size" on the 200)
    ([{"index": 0, "embedding": "AAAAAA=="}, {"index": 1, "embedding": "AAA="}],
     "with a base64 embedding of 2 bytes, not 32-bit floats"),
], ids=["too-few", "not-a-list", "null", "not-base64", "not-numbers", "not-floats"])
async def test_an_embeddings_answer_the_caller_s_client_would_fail_on_is_the_provider_s_error(
        data: Any, problem: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by an audit: one vector for two inputs came back as a 200."""
    answer = {"object": "list", "data": data, "model": SERVED}
    raw.answers["/v1/embeddings"] = whole("200 OK", json.dumps(answer).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": ["a", "b"]}, "run_1")
    assert err.value.message.startswith(f"provider vllm-h answered embeddings {problem}"), err.value.message
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


@pytest.mark.parametrize("family", ["openai", "ollama"])
@pytest.mark.parametrize("encoding", ["float", "base64"])
@pytest.mark.parametrize("number", [b"NaN", b"-Infinity", b"1e400", b"1" + b"0" * 400, b"[0.5, NaN]"],
                         ids=["nan", "infinity", "overflow", "integer-overflow", "nan-of-a-token"])
async def test_embeddings_that_are_not_finite_numbers_are_the_provider_s_error(
        family: str, encoding: str, number: bytes, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: `NaN`, `Infinity` and `1e400` (which JSON has not, and Python
    reads) came back as a 200 with null in the vector (float) or NaN and infinity inside its base64."""
    vector = b"[0.25, " + number + b", 1.0]"
    if family == "openai":
        raw.answers["/v1/embeddings"] = whole("200 OK", b'{"object": "list", "data": [{"object": "embedding", '
                                              b'"index": 0, "embedding": ' + vector + b"}]}")
        adapter: OpenAICompatAdapter | OllamaAdapter = OpenAICompatAdapter(openai(raw.url), session)
        said = "provider vllm-h answered embeddings with an embedding that is neither numbers nor base64"
    else:
        raw.answers["/api/embed"] = whole("200 OK", b'{"embeddings": [' + vector + b"]}")
        adapter = OllamaAdapter(ollama(raw.url), session)
        said = "provider ollama-h answered embeddings with an embedding that is not a list of numbers"
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": "a", "encoding_format": encoding}, "r")
    assert err.value.message == said
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_float_embeddings_over_the_answer_limit_say_which_setting_and_that_base64_is_smaller(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a caller audit: 1,000 inputs of 1,024 dimensions as floats pass 16 MiB (base64: a third)."""
    vectors = [{"object": "embedding", "index": i, "embedding": [0.123456789] * 256} for i in range(8)]
    raw.answers["/v1/embeddings"] = whole("200 OK", json.dumps({"object": "list", "data": vectors}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session, ReadLimits(response_bytes=4096))
    body = {"model": SERVED, "input": ["a"] * 8}
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, body, "run_1")
    assert err.value.message == ("provider vllm-h sent an answer over 4096 bytes (runtime.max_response_bytes): "
                                 "embeddings as encoding_format base64 take about a third of the bytes, or send "
                                 "fewer inputs")
    assert err.value.code is ErrorCode.OUTPUT_TOO_LARGE and err.value.retry is Retry.NO
    with pytest.raises(ProviderError) as err:  # (asked in base64 already: nothing more to say)
        await adapter.complete(RunKind.EMBEDDING, {**body, "encoding_format": "base64"}, "run_2")
    assert err.value.message == "provider vllm-h sent an answer over 4096 bytes (runtime.max_response_bytes)"


@pytest.mark.parametrize(("answer", "said"), [
    ({"object": "chat.completion"}, "answered with no choices"),
    ({"object": "chat.completion", "choices": []}, "answered with no choices"),
    ({"object": "chat.completion", "choices": None}, "answered with choices that are not a list of objects, each "
     "delta or message an object"),
], ids=["none", "empty", "null"])
async def test_a_whole_answer_with_no_choices_is_a_provider_error(
        answer: dict[str, Any], said: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a caller audit: it came as a 200, and the caller's `choices[0]` failed."""
    raw.answers["/v1/chat/completions"] = whole("200 OK", json.dumps(answer).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert err.value.message == f"provider vllm-h {said}"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_ollama_embeddings_short_of_the_inputs_are_the_provider_s_error(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/embed"] = whole("200 OK", json.dumps({"model": SERVED, "embeddings": [[0.5, 1.0]]}).encode())
    adapter = OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": ["a", "b"]}, "run_1")
    assert err.value.message == "provider ollama-h answered embeddings with 1 embeddings for 2 inputs"
    answer = await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": "a"}, "run_2")
    assert [d["embedding"] for d in answer["data"]] == [[0.5, 1.0]]


@pytest.mark.parametrize(("path", "body", "answer", "said"), [
    ("/api/chat", chat(), b"[1, 2]", "provider ollama-h answered with no JSON object"),
    ("/api/embed", {"model": SERVED, "input": "a"}, b'{"embeddings": [["a", "b"]]}',
     "provider ollama-h answered embeddings with an embedding that is not a list of numbers"),
    ("/api/embed", {"model": SERVED, "input": "a", "encoding_format": "base64"}, b'{"embeddings": [[1e300, 1.0]]}',
     "provider ollama-h answered embeddings with an embedding beyond 32-bit floats (base64's numbers)"),
    ("/api/embed", {"model": SERVED, "input": "a"}, b'{"embeddings": null}',
     "provider ollama-h answered embeddings without an 'embeddings' list"),
    ("/api/chat", chat(), b'{"done": true, "message": {', "provider ollama-h: the answer was not valid JSON"),
], ids=["not-an-object", "strings", "float32-overflow", "no-embeddings", "not-json"])
async def test_an_ollama_answer_that_is_json_but_not_an_answer_says_what_is_wrong(
        path: str, body: dict[str, Any], answer: bytes, said: str, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: each of these said "the answer was not valid JSON" (every
    ValueError did); only JSON that does not parse says so now. None is a strike (it answered)."""
    raw.answers[path] = whole("200 OK", answer)
    adapter = OllamaAdapter(ollama(raw.url), session)
    kind = RunKind.EMBEDDING if path == "/api/embed" else RunKind.CHAT
    with pytest.raises(ProviderError) as err:
        await adapter.complete(kind, body, "run_1")
    assert err.value.message == said
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_embeddings_of_each_token_are_taken(raw: Raw, session: aiohttp.ClientSession) -> None:
    """llama-cpp-python's server, for a model without pooling, gives a vector for each token."""
    data = [{"object": "embedding", "index": 0, "embedding": [[0.5, 1.0], [0.25, -1]]},
            {"object": "embedding", "index": 1, "embedding": [[1.0, 2.0]]}]
    raw.answers["/v1/embeddings"] = whole("200 OK", json.dumps({"object": "list", "data": data}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    answer = await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": ["red", "blue sky"]}, "run_1")
    assert answer["data"] == data


ODD_CALLS: list[Any] = [
    {"function": {"name": "f", "arguments": "not json {"}},
    {"function": {"name": 7, "arguments": {"x": 1}}},
    {"function": {"name": "", "arguments": {"x": 1}}},
    {"function": {"arguments": {"x": 1}}},
    {"function": None},
    None,
    "str",
    {"function": {"name": "g", "arguments": [1, 2]}},
    {"function": {"name": "h", "arguments": "[1, 2]"}},
    {"function": {"name": "i", "arguments": 5}},
]


def calls_line(calls: list[Any], done: bool = False) -> dict[str, Any]:
    line = said("", done)
    line["message"]["tool_calls"] = calls
    return line


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_ollama_tool_calls_that_are_none_are_dropped_with_one_warning(
        stream: bool, raw: Raw, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    """Found by a hostile-provider audit: calls named "" (a name that was a number, or none), arguments
    that were no JSON object's text ("not json {", "[1,2]"), and a call made up from a null entry
    reached the caller, whose client could run none of them. The good ones keep their order and
    their numbering; with none left, the finish_reason is not `tool_calls`."""
    good = [{"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": '{"y": 2}'}},
            {"function": {"name": "c"}}]
    mixed = [ODD_CALLS[0], good[0], *ODD_CALLS[1:6], good[1], *ODD_CALLS[6:], good[2]]
    adapter = OllamaAdapter(ollama(raw.url), session)
    for calls, kept in [(mixed, [("a", '{"x": 1}'), ("b", '{"y": 2}'), ("c", "{}")]), (ODD_CALLS, [])]:
        caplog.clear()
        if stream:  # (in two lines: the second line's numbering goes on from the first's good calls)
            half = len(calls) // 2
            raw.answers["/api/chat"] = chunked([nd(calls_line(calls[:half])), nd(calls_line(calls[half:])),
                                                nd(said("", done=True))], content_type="application/x-ndjson")
            chunks = await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
            got = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
            assert [t["index"] for t in got] == list(range(len(kept)))
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            line = calls_line(calls, done=True)
            raw.answers["/api/chat"] = whole("200 OK", json.dumps(line).encode())
            answer = await adapter.complete(RunKind.CHAT, chat(), "run_1")
            got = answer["choices"][0]["message"].get("tool_calls") or []
            finish = answer["choices"][0]["finish_reason"]
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in got] == kept
        assert [t["id"] for t in got] == [f"call_run_1_{i}" for i in range(len(kept))]
        assert finish == ("tool_calls" if kept else "stop")
        warnings = [r for r in caplog.records if "tool call" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelname == "WARNING", [r.getMessage() for r in warnings]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_legacy_completion_from_ollama_has_no_tool_calls(stream: bool, raw: Raw,
                                                                 session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: an `/api/generate` answer carrying a chat's tool calls gave
    the legacy completion the finish_reason `tool_calls`, which a `text_completion` has not."""
    calls = [{"function": {"name": "f", "arguments": {"x": 1}}}]
    line = {"model": SERVED, "response": "text", "message": {"role": "assistant", "tool_calls": calls}, "done": True,
            "done_reason": "stop"}
    adapter = OllamaAdapter(ollama(raw.url), session)
    body = {"model": SERVED, "prompt": "hi", "stream": stream}
    if stream:
        raw.answers["/api/generate"] = chunked([nd({**line, "done": False}), nd(line)],
                                               content_type="application/x-ndjson")
        chunks = await collect(adapter.stream(RunKind.COMPLETION, body, "run_1"))
        choices = [c["choices"][0] for c in chunks]
    else:
        raw.answers["/api/generate"] = whole("200 OK", json.dumps(line).encode())
        choices = (await adapter.complete(RunKind.COMPLETION, body, "run_1"))["choices"]
    assert choices[-1]["finish_reason"] == "stop"
    assert "".join(c["text"] for c in choices) == ("texttext" if stream else "text")
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_ollama_answer_that_is_not_utf_8_is_not_json_streamed_or_whole(
        stream: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """Found by a hostile-provider audit: the same bytes were a 502 in a stream line and taken, as
    U+FFFD, in a whole answer. JSON is UTF-8 (and Ollama writes nothing else): both are the 502."""
    line = b'{"model": "m-served", "message": {"role": "assistant", "content": "ab\xff\xfecd"}, "done": true}'
    raw.answers["/api/chat"] = chunked([line + b"\n"], content_type="application/x-ndjson") if stream else \
        whole("200 OK", line)
    adapter = OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await ask_chat(adapter, stream)
    assert err.value.message == "provider ollama-h: the answer was not valid JSON"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == 0


async def test_an_ollama_error_line_says_its_message_and_a_null_error_is_none(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/chat"] = chunked([nd(said("a ")), nd({"error": {"message": "out of memory"}})],
                                       content_type="application/x-ndjson")
    raw.answers["/api/generate"] = chunked([nd({"model": SERVED, "response": "a", "done": False, "error": None}),
                                            nd({"model": SERVED, "response": "", "done": True})],
                                           content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    with pytest.raises(ProviderError) as err:
        await collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1"))
    assert err.value.message == "provider ollama-h sent an error: out of memory"
    chunks = await collect(adapter.stream(RunKind.COMPLETION, {"model": SERVED, "prompt": "x", "stream": True},
                                          "run_2"))
    assert chunks[0]["choices"][0]["text"] == "a"


def test_every_chunk_and_response_says_the_callers_model() -> None:
    chunk: dict[str, Any] = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert with_model(chunk, "public-id")["model"] == "public-id"
    assert with_model({"model": "served/name", "choices": []}, "public-id")["model"] == "public-id"
    assert with_model([1, 2], "public-id") == [1, 2]
    assert json.loads(sse_chunks([{"choices": []}], "public-id")[len(b"data: "):])["model"] == "public-id"


# ---------------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", ["307 Temporary Redirect", "302 Found"])
async def test_a_run_is_never_sent_where_a_redirect_points(
        status: str, raw: Raw, other: Raw, session: aiohttp.ClientSession) -> None:
    location = other.url.replace("http://", "http://usr:pw-5e1f@") + "/v1/chat/completions?token=t0k"
    raw.answers["/v1/chat/completions"] = redirect(status, location)
    other.answers["/v1/chat/completions"] = whole("200 OK", json.dumps(
        {"object": "chat.completion", "model": SERVED, "choices": []}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    code = int(status.split()[0])
    for call in (adapter.complete(RunKind.CHAT, chat(), "run_1"),
                 collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_2"))):
        with pytest.raises(ProviderError) as err:
            await call
        assert err.value.message == (
            f"provider vllm-h answered {code} (a redirect to /v1/chat/completions on another server; iop does not "
            "follow redirects: fix base_url)")  # (no address: this text may reach a caller)
        assert err.value.status == code and err.value.retry is Retry.ELSEWHERE and err.value.strikes == DOWN
    assert other.requests == []


async def test_an_ollama_run_and_probe_never_follow_a_redirect(
        raw: Raw, other: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/api/chat"] = redirect("307 Temporary Redirect", other.url + "/api/chat")
    raw.answers["/api/tags"] = redirect("301 Moved Permanently", "/elsewhere/api/tags")
    other.answers["/api/chat"] = whole("200 OK", json.dumps(said("stolen", done=True)).encode())
    adapter = OllamaAdapter(ollama(raw.url), session)
    for call in (adapter.complete(RunKind.CHAT, chat(), "run_1"),
                 collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_2"))):
        with pytest.raises(ProviderError) as err:
            await call
        assert err.value.message == ("provider ollama-h answered 307 (a redirect to /api/chat on another server; iop "
                                     "does not follow redirects: fix base_url)")
        assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == DOWN
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.strikes == DOWN
    assert probe.reason == ("GET /api/tags answered 301 (a redirect to /elsewhere/api/tags; iop does not follow "
                            "redirects: fix base_url)")
    assert other.requests == [] and [r.path for r in raw.requests] == ["/api/chat", "/api/chat", "/api/tags"]


async def test_a_probe_never_follows_a_redirect(raw: Raw, other: Raw, session: aiohttp.ClientSession) -> None:
    raw.answers["/health"] = redirect("302 Found", other.url + "/health")
    other.answers["/health"] = whole("200 OK", b"{}")
    other.answers["/v1/models"] = whole("200 OK", json.dumps({"data": [{"id": SERVED}]}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    probe = await adapter.probe()
    assert probe.health is Health.UNAVAILABLE and probe.strikes == DOWN
    assert probe.reason == ("GET /health answered 302 (a redirect to /health on another server; iop does not follow "
                            "redirects: fix base_url)")
    assert other.requests == []


# ---------------------------------------------------------------------------------- deep JSON


async def too_deep_everywhere(adapter: OpenAICompatAdapter | OllamaAdapter, provider_id: str) -> ProviderError:
    """A chat answer and a streamed chunk nested too deep are the provider's error, not retried and
    no strike; returns the error of the embeddings call, whose 500 answer is nested too deep."""
    for call in (adapter.complete(RunKind.CHAT, chat(), "run_1"),
                 collect(adapter.stream(RunKind.COMPLETION, {"model": SERVED, "prompt": "x", "stream": True},
                                        "run_2"))):
        with pytest.raises(ProviderError) as err:
            await call
        assert err.value.message == f"provider {provider_id} sent JSON nested too deep"
        assert err.value.retry is Retry.NO and err.value.strikes == 0
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": "x"}, "run_3")
    return err.value


#: nested deeper than the worker takes (`MAX_DEPTH`), than the gateway's encoder writes (255; 1,000
#: was a 500 from the gateway), and than Python's parser reads
DEPTHS = [MAX_DEPTH + 1, 1_000, 3_000]


def deep(levels: int) -> bytes:
    return b"[" * (levels - 1) + b"]" * (levels - 1)  # (inside the object around it: `levels` in all)


def test_json_just_as_deep_as_allowed_is_taken() -> None:
    assert parse_json(b'{"choices": ' + deep(MAX_DEPTH) + b"}", "p") == {"choices": json.loads(deep(MAX_DEPTH))}


def test_the_shortest_json_nested_too_deep_is_refused() -> None:
    # (`parse_json` counts brackets only in text longer than twice `MAX_DEPTH`: the shortest too deep has
    # one byte more, and the shortest as deep as allowed is taken)
    shortest = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    assert len(shortest) == 2 * MAX_DEPTH + 2
    with pytest.raises(ProviderError):
        parse_json(shortest, "p")
    assert parse_json(shortest[1:-1], "p") == json.loads(shortest[1:-1])


@pytest.mark.parametrize("levels", DEPTHS)
async def test_json_nested_too_deep_is_a_provider_error(raw: Raw, session: aiohttp.ClientSession,
                                                        levels: int) -> None:
    nested = deep(levels)
    raw.answers["/v1/chat/completions"] = whole("200 OK", b'{"choices": ' + nested + b"}")
    raw.answers["/v1/completions"] = chunked([sse(delta("a ")), sse(b'{"choices": ' + nested + b"}")])
    raw.answers["/v1/embeddings"] = whole("500 Internal Server Error", b'{"error": ' + nested + b"}")
    raw.answers["/v1/models"] = whole("200 OK", b'{"data": ' + nested + b"}")
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    error = await too_deep_everywhere(adapter, "vllm-h")
    assert error.status == 500 and error.message.startswith("provider vllm-h answered 500: ")
    adapter.health_url = None
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN and probe.reason == "GET /v1/models answered 200 with JSON nested too deep"


@pytest.mark.parametrize("levels", DEPTHS)
async def test_ollama_json_nested_too_deep_is_a_provider_error(raw: Raw, session: aiohttp.ClientSession,
                                                               levels: int) -> None:
    nested = deep(levels)
    raw.answers["/api/chat"] = whole("200 OK", b'{"message": ' + nested + b"}")
    raw.answers["/api/generate"] = chunked([nd(b'{"response": ' + nested + b"}")], content_type="application/x-ndjson")
    raw.answers["/api/embed"] = whole("500 Internal Server Error", b'{"error": ' + nested + b"}")
    raw.answers["/api/tags"] = whole("200 OK", b'{"models": ' + nested + b"}")
    adapter = OllamaAdapter(ollama(raw.url), session)
    assert (await too_deep_everywhere(adapter, "ollama-h")).status == 500
    probe = await adapter.probe()
    assert probe.health is Health.UNKNOWN and probe.reason == "GET /api/tags answered 200 with JSON nested too deep"


# ---------------------------------------------------------------------------------- cookies


async def test_a_cookie_a_provider_sets_for_one_run_never_rides_along_on_the_next(raw: Raw) -> None:
    """The worker's one HTTP client serves every caller's runs: a provider's `Set-Cookie` (here
    addressed by host name, which a cookie jar would keep) is not sent back on a later run."""
    answer = {"id": "x", "object": "chat.completion", "model": SERVED,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    raw.answers["/v1/chat/completions"] = whole(
        "200 OK", json.dumps(answer).encode(), extra="Set-Cookie: session=caller-a; Path=/\r\n")
    session = provider_session()
    try:
        adapter = OpenAICompatAdapter(openai(raw.url.replace("127.0.0.1", "localhost")), session)
        for run in ("run_1", "run_2"):
            assert (await adapter.complete(RunKind.CHAT, chat(), run))["choices"][0]["message"]["content"] == "hi"
    finally:
        await session.close()
    assert len(raw.requests) == 2 and all("cookie" not in r.headers for r in raw.requests)
    # (the same client with a cookie jar would have sent it: the check can fail)
    jarred = aiohttp.ClientSession()
    try:
        adapter = OpenAICompatAdapter(openai(raw.url.replace("127.0.0.1", "localhost")), jarred)
        for run in ("run_3", "run_4"):
            await adapter.complete(RunKind.CHAT, chat(), run)
    finally:
        await jarred.close()
    assert raw.requests[3].headers.get("cookie") == "session=caller-a"


@pytest.mark.parametrize("usage", [False, True])
async def test_a_stream_whose_choices_all_finished_is_whole_though_no_done_comes_and_it_stays_open(
        raw: Raw, session: aiohttp.ClientSession, usage: bool) -> None:
    """After the finish_reason (and the usage chunk) a provider that neither says [DONE] nor
    closes has answered whole: not failed after `read_timeout_ms` (found by a hostile-provider
    audit: the caller waited out the read timeout, then got an error after its whole answer)."""
    tail = [sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})] if usage else []
    raw.answers["/v1/chat/completions"] = chunked([sse(delta("a ")), sse(delta("b", "stop")), *tail], end=False)
    raw.hold = True
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=60_000), session)
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1")), 30)
    assert text_of(chunks) == "a b" and (chunks[-1].get("usage") is not None) == usage

    async def left() -> bool:
        return raw.disconnects >= 1

    await until(left, 5, "the adapter to close the connection")


@pytest.mark.parametrize(("n", "seen_first"), [(2, False), (2.0, False), ("2", False), (2, True)])
async def test_a_stream_of_two_choices_waits_for_both_to_finish(raw: Raw, session: aiohttp.ClientSession,
                                                                monkeypatch: pytest.MonkeyPatch, n: Any,
                                                                seen_first: bool) -> None:
    """The grace after the finish_reason starts once every choice asked for (`n`, as a server reads
    it: 2, 2.0 or "2") and every choice seen has finished; not when the first one has. (A second
    choice where one was asked for is the provider's error: `answer_shapes.ChoiceIndices`.)"""
    monkeypatch.setattr("workers.adapters.openai_compat.FINISHED_GRACE_S", 0.05)

    def choice(index: int, text: str, finish: str | None = None) -> bytes:
        return sse({"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]})

    # (unseen first: only `n` says that a second choice is to come)
    first = [choice(1, "b"), choice(0, "a", "stop")] if seen_first else [choice(0, "a", "stop")]
    later = [choice(1, "c", "stop")] if seen_first else [choice(1, "b"), choice(1, "c", "stop")]
    opening = chunked(first, end=False)

    async def slow_second_choice(request: Request, writer: asyncio.StreamWriter) -> None:
        await opening(request, writer)
        await asyncio.sleep(0.5)  # (the model's time for the other choice: ten times the grace)
        writer.write(frame(b"".join(later)))

    raw.answers["/v1/chat/completions"] = slow_second_choice
    raw.hold = True
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=60_000), session)
    body = chat(stream=True, **({} if n is None else {"n": n}))
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.CHAT, body, "run_1")), 30)
    texts = sorted(c["choices"][0]["delta"]["content"] for c in chunks)
    assert texts == ["a", "b", "c"]


@pytest.mark.parametrize(("prompt", "n", "asked"), [
    ("one", None, 1), (["one", "two"], None, 2), (["one", "two"], 2, 4), ([[1, 2], [3]], "2", 4), ([1, 2, 3], 3, 3),
    ([], None, 1)])
def test_the_choices_asked_for_are_n_for_each_prompt(prompt: Any, n: Any, asked: int) -> None:
    body = {"model": SERVED, "prompt": prompt, **({} if n is None else {"n": n})}
    assert choices_asked(RunKind.COMPLETION, body) == asked
    assert choices_asked(RunKind.CHAT, {**body, "messages": []}) == (1 if n is None else int(n))


async def test_a_legacy_stream_of_two_prompts_waits_for_the_second_one_s_choice(
        raw: Raw, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of prompts has a choice for each: the first one's finish is not the end (found by an
    audit: the second prompt's choice was cut off, and the run said completed)."""
    monkeypatch.setattr("workers.adapters.openai_compat.FINISHED_GRACE_S", 0.05)

    def choice(index: int, text: str, finish: str | None = None) -> bytes:
        return sse({"object": "text_completion", "choices": [{"index": index, "text": text, "finish_reason": finish}]})

    opening = chunked([choice(0, "a", "length")], end=False)

    async def slow_second_prompt(request: Request, writer: asyncio.StreamWriter) -> None:
        await opening(request, writer)
        await asyncio.sleep(0.5)  # ten times the grace
        writer.write(frame(choice(1, "b", "length") + sse(b"[DONE]")))
        writer.write(b"0\r\n\r\n")

    raw.answers["/v1/completions"] = slow_second_prompt
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=60_000), session)
    body = {"model": SERVED, "prompt": ["short", "long"], "stream": True}
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.COMPLETION, body, "run_1")), 30)
    assert sorted(c["choices"][0]["text"] for c in chunks) == ["a", "b"]


@pytest.mark.parametrize("ping", [b": ping\n\n", b'data: {"choices": []}\n\n'])
async def test_the_grace_after_the_finish_is_not_kept_open_by_what_the_provider_sends_meanwhile(
        raw: Raw, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch, ping: bytes) -> None:
    """(a ping every so often re-armed the grace: the run lasted as long as the provider kept
    pinging; found by an audit)"""
    monkeypatch.setattr("workers.adapters.openai_compat.FINISHED_GRACE_S", 0.3)
    answer = chunked([sse(delta("a ")), sse(delta("b", "stop"))], end=False)

    async def pinging(request: Request, writer: asyncio.StreamWriter) -> None:
        await answer(request, writer)
        for _ in range(600):  # (a minute of pings, unless the client leaves)
            await asyncio.sleep(0.1)
            writer.write(frame(ping))
            await writer.drain()

    raw.answers["/v1/chat/completions"] = pinging
    raw.hold = True
    adapter = OpenAICompatAdapter(openai(raw.url, read_timeout_ms=60_000), session)
    chunks = await asyncio.wait_for(collect(adapter.stream(RunKind.CHAT, chat(stream=True), "run_1")), 30)
    assert text_of(chunks) == "a b"


async def test_embeddings_asked_in_base64_come_in_base64_from_a_server_that_ignores_the_field(
        raw: Raw, session: aiohttp.ClientSession) -> None:
    """(llama-cpp-python's server answers numbers whatever `encoding_format` says: a caller that
    asked for base64 got a list, found by an openai-client audit.) A caller that did not ask gets
    numbers. What base64 cannot carry is no answer to one that asked for it (the Node.js client
    reads numbers there as base64, silently: `[]`): vectors per token are the caller's 400 naming
    the field, unless another provider takes it; numbers beyond 32-bit floats the provider's error."""
    answers: dict[str, list[Any]] = {
        "a": [[0.5, -1.25, 3.0], [1.0, 2.0, 4.0]], "per-token": [[0.5, -1.25, 3.0], [[0.5, 1.0], [2.0, 4.0]]],
        "beyond": [[0.5, -1.25, 3.0], [1e300, 0.0]]}

    async def embeddings(request: Request, writer: asyncio.StreamWriter) -> None:
        vectors = answers[json.loads(request.body)["model"]]
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        await whole("200 OK", json.dumps({"object": "list", "data": data}).encode())(request, writer)

    raw.answers["/v1/embeddings"] = embeddings
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    body = {"model": "a", "input": ["a", "b"], "encoding_format": "base64"}
    answer = await adapter.complete(RunKind.EMBEDDING, body, "run_1")
    assert [struct.unpack("<3f", base64.b64decode(d["embedding"])) for d in answer["data"]] == [
        (0.5, -1.25, 3.0), (1.0, 2.0, 4.0)]
    for served, vectors in answers.items():
        answer = await adapter.complete(RunKind.EMBEDDING, {**body, "model": served, "encoding_format": "float"}, "r")
        assert [d["embedding"] for d in answer["data"]] == vectors
    with pytest.raises(ProviderError) as failed:
        await adapter.complete(RunKind.EMBEDDING, {**body, "model": "per-token"}, "run_2")
    assert (failed.value.status, failed.value.retry, failed.value.strikes) == (400, Retry.UNABLE, 0)
    assert failed.value.detail is not None and failed.value.detail["param"] == "encoding_format"
    with pytest.raises(ProviderError) as failed:
        await adapter.complete(RunKind.EMBEDDING, {**body, "model": "beyond"}, "run_3")
    assert (failed.value.status, failed.value.retry, failed.value.strikes) == (None, Retry.ELSEWHERE, 0)
    assert "beyond 32-bit floats" in failed.value.message


@pytest.mark.parametrize("asked", [{}, {"encoding_format": "float"}])
async def test_embeddings_asked_as_numbers_come_as_numbers_from_a_server_that_answers_base64(
        asked: dict[str, Any], raw: Raw, session: aiohttp.ClientSession) -> None:
    """The other way round (a hostile-provider review): a caller that asked for numbers, or did not say
    (OpenAI's default), got base64 text where its client's type has a list of floats. One holding a
    NaN, which JSON cannot carry, stays as it came."""
    packed = [base64.b64encode(struct.pack("<3f", *v)).decode() for v in ([0.5, -1.25, 3.0], [1.0, math.nan, 0.0])]
    raw.answers["/v1/embeddings"] = whole("200 OK", json.dumps({"object": "list", "model": SERVED, "data": [
        {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(packed)]}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    answer = await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": ["a", "b"], **asked}, "run_1")
    assert [d["embedding"] for d in answer["data"]] == [[0.5, -1.25, 3.0], packed[1]]


async def test_a_base64_embedding_given_back_as_numbers_is_decoded_once(
        raw: Raw, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its check (`embeddings_problem`) decoded it, and `in_numbers` decoded it again (a vector of
    4,096 is 22 KB of base64)."""
    packed = [base64.b64encode(struct.pack("<3f", *v)).decode() for v in ([0.5, -1.25, 3.0], [1.0, 2.0, 4.0])]
    raw.answers["/v1/embeddings"] = whole("200 OK", json.dumps({"object": "list", "model": SERVED, "data": [
        {"object": "embedding", "index": 1 - i, "embedding": v} for i, v in enumerate(packed)]}).encode())
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    decodes: list[object] = []
    real = binascii.a2b_base64

    def counted(data: Any, **kwargs: Any) -> bytes:
        decodes.append(data)
        return real(data, **kwargs)

    monkeypatch.setattr(binascii, "a2b_base64", counted)
    answer = await adapter.complete(RunKind.EMBEDDING, {"model": SERVED, "input": ["a", "b"]}, "run_1")
    assert [d["embedding"] for d in answer["data"]] == [[1.0, 2.0, 4.0], [0.5, -1.25, 3.0]]  # (in index order)
    assert len(decodes) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_does_not_decode_as_its_content_encoding_says_is_garbage_not_a_cut(
        stream: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """`Content-Encoding: gzip` on a plain body: the same request would get the same garbage, so
    it is not tried on this provider again (it was taken for a connection cut, and sent to the same
    provider up to `max_attempts` times, each a whole generation)."""
    if stream:
        raw.answers["/v1/chat/completions"] = whole("200 OK", sse(delta("hi", "stop")) + b"data: [DONE]\n\n",
                                                    "text/event-stream", "Content-Encoding: gzip\r\n")
    else:
        raw.answers["/v1/chat/completions"] = whole("200 OK", json.dumps({"choices": []}).encode(),
                                                    extra="Content-Encoding: gzip\r\n")
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as failed:
        await ask_chat(adapter, stream)
    assert failed.value.message == "provider vllm-h: its answer did not decode as its Content-Encoding (gzip) says"
    assert failed.value.retry is Retry.ELSEWHERE and failed.value.strikes == 0


async def test_a_gzip_answer_cut_short_is_still_a_cut(raw: Raw, session: aiohttp.ClientSession) -> None:
    body = gzip.compress(json.dumps({"choices": [], "pad": "x" * 5000}).encode())

    async def cut(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
    raw.answers["/v1/chat/completions"] = cut
    adapter = OpenAICompatAdapter(openai(raw.url), session)
    with pytest.raises(ProviderError) as failed:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert failed.value.message == "provider vllm-h: the response broke off before it was complete"
    assert failed.value.retry is Retry.ANY


@pytest.mark.parametrize("stream", [False, True])
async def test_an_ollama_logprob_beyond_any_float_is_carried_as_it_came_for_the_runner_to_refuse(
        stream: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """A logprob of 401 digits: float() of it raised OverflowError, which no one caught (the run
    failed through the runner's catch-all, "could not handle its answer (OverflowError)", with a
    traceback at ERROR). It stays an integer, which the runner refuses as it does the OpenAI
    family's (`cannot_carry`: "an integer beyond 64 bits", not tried again)."""
    big = 10 ** 400
    line = {**said("hi", done=True), "logprobs": [{"token": "hi", "logprob": big}]}
    raw.answers["/api/chat"] = whole("200 OK", nd(line), "application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session)
    if stream:
        answer: Any = await collect(adapter.stream(RunKind.CHAT, chat(stream=True, logprobs=True), "run_1"))
        logprobs = [c["choices"][0]["logprobs"] for c in answer if c.get("choices") and c["choices"][0].get("logprobs")]
    else:
        answer = await adapter.complete(RunKind.CHAT, chat(logprobs=True), "run_1")
        logprobs = [answer["choices"][0]["logprobs"]]
    assert logprobs[0]["content"][0]["logprob"] == big
    with pytest.raises(Unpackable, match="an integer beyond 64 bits"):
        pack(answer)


async def test_a_304_to_a_run_is_no_answer_not_a_redirect(raw: Raw, session: aiohttp.ClientSession) -> None:
    """A 304 (a cache before the server, say) points nowhere: not "a redirect without a Location"."""
    raw.answers["/v1/chat/completions"] = whole("304 Not Modified", b"")
    raw.answers["/v1/models"] = whole("304 Not Modified", b"")
    adapter = OpenAICompatAdapter(openai(raw.url, type="openai_api"), session)
    with pytest.raises(ProviderError) as err:
        await adapter.complete(RunKind.CHAT, chat(), "run_1")
    assert err.value.message == "provider vllm-h answered 304, which is no answer to a run or a probe (fix base_url)"
    assert err.value.retry is Retry.ELSEWHERE and err.value.strikes == DOWN
    probe = await adapter.probe()
    assert probe.reason == "GET /v1/models answered 304, which is no answer to a run or a probe (fix base_url)"


@dataclass
class SlowReader(RawHttp):
    """Reads a request's head, then its body `piece` bytes every `every_s` (`piece` 0: never),
    and answers once it has it all."""

    piece: int = 0
    every_s: float = 0.0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        if not self.piece:
            await asyncio.Event().wait()  # (until the client goes, or the test ends)
        while length:
            await asyncio.sleep(self.every_s)
            length -= len(await reader.readexactly(min(self.piece, length)))
        answer = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": SERVED, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "read"}, "finish_reason": "stop"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(answer)
                     + answer)
        await writer.drain()


@pytest.mark.parametrize("kind", ["openai", "ollama"])
async def test_a_server_that_reads_none_of_a_big_request_fails_it_within_the_read_timeout(kind: str) -> None:
    """aiohttp starts its read timeout once the body is out: a server that read none of a 6 MB
    prompt held the run until its execution timeout (600 s by default)."""
    server = SlowReader()
    url = await server.start()
    config = {"id": "p", "type": "vllm" if kind == "openai" else "ollama", "base_url": url, "capacity": 1,
              "models": [SERVED], "read_timeout_ms": 500}
    session = provider_session()
    adapter = (OpenAICompatAdapter if kind == "openai" else OllamaAdapter)(ProviderConfig.model_validate(config),
                                                                           session)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "x" * 32_000_000}]}
    try:
        with pytest.raises(ProviderError) as err:
            async with asyncio.timeout(10):  # (well past the read timeout)
                await adapter.complete(RunKind.CHAT, body, "r")
    finally:
        await session.close()
        await server.stop()
    assert err.value.message == "provider p: did not read the request for 500 ms"
    assert err.value.code is ErrorCode.PROVIDER_TIMEOUT and err.value.retry is Retry.ELSEWHERE


async def test_a_server_that_reads_a_big_request_slowly_but_steadily_is_answered() -> None:
    server = SlowReader(piece=1 << 20, every_s=0.05)
    url = await server.start()
    session = provider_session()
    adapter = OpenAICompatAdapter(ProviderConfig.model_validate(
        {"id": "p", "type": "vllm", "base_url": url, "capacity": 1, "models": [SERVED], "read_timeout_ms": 1000}),
        session)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "x" * 32_000_000}]}
    try:
        answer = await adapter.complete(RunKind.CHAT, body, "r")
    finally:
        await session.close()
        await server.stop()
    assert answer["choices"][0]["message"]["content"] == "read"


@pytest.mark.parametrize("family", ["openai", "ollama"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_chunk_size_that_is_not_hex_inside_a_body_ends_within_the_read_timeout(
        raw: Raw, family: str, stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp drops its read timeout when its parser fails inside a body it is reading: the read
    waited for nothing, and the run for its execution timeout (a review: no end after 10 s with a
    2 s read_timeout_ms). The worker's own watch of its reads ends it ("sent nothing for N ms").
    The bad chunk goes out once the reader waits for the body's second read."""
    kind = "text/event-stream" if family == "openai" else "application/x-ndjson"
    first = sse(delta("a")) if family == "openai" else nd(said("a"))
    reads = 0
    waiting = asyncio.Event()
    read = ReadWatch.read

    async def counted(watch: ReadWatch, reading: Any) -> bytes:
        nonlocal reads
        reads += 1
        if reads == 2:
            waiting.set()
        return await read(watch, reading)

    monkeypatch.setattr(ReadWatch, "read", counted)

    async def answer(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\n{CHUNKED}".encode() + frame(first))
        await writer.drain()
        await waiting.wait()
        writer.write(b"zz-not-hex\r\nxx\r\n")
        await writer.drain()

    raw.hold = True
    raw.answers["/v1/chat/completions" if family == "openai" else "/api/chat"] = answer
    config = (openai if family == "openai" else ollama)(raw.url, read_timeout_ms=300)
    session = provider_session()
    adapter = (OpenAICompatAdapter if family == "openai" else OllamaAdapter)(config, session)
    try:
        with pytest.raises(ProviderError) as err:
            async with asyncio.timeout(20):  # (well past two read timeouts)
                await ask_chat(adapter, stream, "r")
    finally:
        await session.close()
    assert err.value.message == f"provider {config.id}: sent nothing for 300 ms"
    assert err.value.code is ErrorCode.PROVIDER_TIMEOUT


async def test_a_read_begun_after_the_caller_held_the_body_a_while_is_not_cut_at_once() -> None:
    """The watch's looks, made by hand: a read that was not yet waiting at the last look (the caller
    held the body between reads, as the runner does while Redis is slow) is not a silence; the same
    read waiting at two looks in a row is (a review of the watch: the first version cut it at once)."""
    data: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def body() -> bytes:
        async with ReadWatch(3600) as watch:  # (its own looks come in an hour: these are made by hand)
            assert await watch.read(asyncio.sleep(0, b"first")) == b"first"
            watched.append(watch)
            return await watch.read(data)

    watched: list[ReadWatch] = []

    async def second_read() -> ReadWatch:
        for _ in range(100):  # (a few turns of the loop: the task enters the watch and ends its first read)
            if watched:
                return watched[0]
            await asyncio.sleep(0)
        raise AssertionError("the body's first read did not end")

    reading = asyncio.create_task(body())
    watch = await second_read()
    watch.reading = False
    watch._look()  # the caller holds the body: no read waits
    watch.reading = True
    watch._look()  # a read just begun
    await asyncio.sleep(0)
    assert not reading.done()
    data.set_result(b"second")
    assert await reading == b"second"

    data = asyncio.get_running_loop().create_future()
    watched.clear()
    reading = asyncio.create_task(body())
    watch = await second_read()
    watch._look()
    watch._look()  # the same read waiting at two looks
    with pytest.raises(aiohttp.SocketTimeoutError):
        await reading


@pytest.mark.parametrize(("provider_type", "error", "status"), [
    # older vLLM: 400 for every fault of its stream, its engine's too, and no param: not taken
    ("vllm", {"object": "error", "message": "engine died", "type": "BadRequestError", "param": None, "code": 400},
     None),
    # vLLM's VLLMValidationError, raised as its engine takes the request (after the 200): names its param
    ("vllm", {"message": "Requested sample logprobs of 25", "type": "BadRequestError", "param": "logprobs",
              "code": 400}, 400),
    # vLLM 0.34's GenerationError: its own status (older versions sent no 5xx in a stream), 503 while paused
    ("vllm", {"message": "The server had an error", "type": "InternalServerError", "param": "x", "code": 500}, 500),
    ("vllm", {"message": "Generation is paused. Please retry after it resumes.", "type": "InternalServerError",
              "param": None, "code": 503}, 503),
    # SGLang: a stream carries an error before any output only for an abort with a status
    ("sglang", {"object": "error", "message": "Input length", "type": "BAD_REQUEST", "param": None, "code": 400}, 400),
    ("sglang", {"object": "error", "message": "timed out", "type": "SERVICE_UNAVAILABLE", "code": 503}, 503),
    # Lemonade: its streaming proxy writes the backend's status as `status_code`, whatever the type
    ("lemonade", {"code": 400, "message": "exceeds the context", "status_code": 400,
                  "type": "exceed_context_size_error"}, 400),
    # llama-server: its error event's `code` is the status it answers the same error with whole
    # (`format_error_response`); llama-cpp-python's server sends none
    ("llamacpp", {"code": 400, "message": "request (81 tokens) exceeds the available context size (64 tokens)",
                  "type": "exceed_context_size_error", "n_prompt_tokens": 81, "n_ctx": 64}, 400),
    ("llamacpp", {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}, 500),
    ("openai_api", {"code": "context_length_exceeded", "message": "too long"}, None),
    ("sglang", "a string", None),
    ("sglang", {"code": True, "message": "a bool is no status"}, None),
])
def test_which_errors_in_a_stream_say_a_status(provider_type: str, error: Any, status: int | None) -> None:
    from workers.adapters.openai_compat import said_status, sent_error

    assert said_status(error, provider_type) == status
    err = sent_error("p", error, 500, provider_type)
    callers = status is not None and 400 <= status < 500
    # (another's status kept, as answered whole: a 503 is a busy provider, benched and not blamed)
    assert (err.retry, err.status) == ((Retry.NO, status) if callers else (Retry.ELSEWHERE, status))
    # (a 5xx shows nothing of its health, as answered whole: a paused vLLM answering every run so is
    # still probed, and found paused)
    assert err.strikes == (None if status is not None and status >= 500 else 0)


@pytest.mark.parametrize(("error", "retry", "status"), [
    # vLLM 0.34: a VLLMValidationError its engine raises after the 200 with no parameter (a schema xgrammar
    # does not take): tried on another provider first, the caller's 400 when none is left
    ({"message": "The provided JSON schema contains features not supported by xgrammar.",
      "type": "BadRequestError", "param": None, "code": 400}, Retry.UNABLE, 400),
    ({"message": "no param at all", "type": "BadRequestError", "code": 400}, Retry.UNABLE, 400),
    # older vLLM (before 0.10, its flat shape): 400 for every fault of its streams, its engine's too
    ({"object": "error", "message": "engine died", "type": "BadRequestError", "param": None, "code": 400},
     Retry.ELSEWHERE, None),
    # a 429 is not the caller's, param or not
    ({"message": "rate", "type": "x", "param": None, "code": 429}, Retry.ELSEWHERE, None),
])
def test_a_vllm_4xx_in_a_stream_without_a_param_goes_elsewhere_then_to_the_caller(
        error: dict[str, Any], retry: Retry, status: int | None) -> None:
    from workers.adapters.openai_compat import sent_error

    err = sent_error("p", error, 500, "vllm", "served-m")
    assert (err.retry, err.status, err.strikes) == (retry, status, 0)
    if retry is Retry.UNABLE:
        assert err.detail is not None and err.detail["message"] == error["message"]


@pytest.mark.parametrize(("provider_type", "error", "elsewhere"), [
    # a 404 or 403 in a stream that says this provider has not the model iop routed there: not the
    # caller's (the same error answered whole goes to another provider: `answered_error`)
    ("lemonade", {"message": "model 'served-m' not found", "status_code": 404, "type": "not_found_error"}, True),
    ("sglang", {"object": "error", "message": "The model `served-m` does not exist.", "type": "NotFoundError",
                "code": 404}, True),
    ("lemonade", {"message": "project may not use served-m", "status_code": 403}, True),
    ("lemonade", {"message": "no access", "status_code": 403, "code": "model_not_found"}, True),
    # (a hosted API's, or a vLLM's without a `param`: its `code` is no status of the caller's, but still says
    # which model the provider lacks; it was a sign of life, strikes 0, which put off the probe that finds
    # the model gone from its list, so every run of the model went there first)
    ("openai_api", {"code": 404, "message": "The model `served-m` does not exist or you do not have access to it."},
     True),
    ("vllm", {"object": "error", "message": "The model `served-m` does not exist.", "type": "NotFoundError",
              "code": 404}, True),
    # one that names another model (or none) is the caller's, as before
    ("lemonade", {"message": "adapter 'x' not found", "status_code": 404}, False),
    ("lemonade", {"message": "model 'served-m-lora' not found", "status_code": 404}, False),
])
def test_an_error_in_a_stream_saying_the_provider_lacks_the_model_goes_to_another_provider(
        provider_type: str, error: dict[str, Any], elsewhere: bool) -> None:
    from workers.adapters.openai_compat import sent_error

    err = sent_error("p", error, 500, provider_type, "served-m")
    assert (err.retry, err.status) == ((Retry.ELSEWHERE, None) if elsewhere else (Retry.NO, error.get("status_code",
                                                                                                     error.get("code"))))
    # (a provider without the model shows nothing of its health, as answered whole: a sign of life put
    # off the probe that finds the model gone from its list)
    assert err.strikes == (None if elsewhere else 0)
    parser = SSEParser("p", DEFAULT_LIMITS, "r", "served-m", provider_type)  # (as the stream reads it)
    assert parser.feed(b"data: " + json.dumps({"error": error}).encode() + b"\n\n") == []
    assert parser.failed is not None and parser.failed.retry is err.retry and parser.failed.status == err.status
    assert parser.failed.strikes == err.strikes


@pytest.mark.parametrize(("provider_type", "error", "status"), [
    # Lemonade's stream gives its backend's status (an OpenRouter behind it: a request larger than
    # the credits left pay for); vLLM's 4xx that names a `param` (a server that refuses extras)
    ("lemonade", {"message": "This request requires more credits, or fewer max_tokens. You requested up to "
                             "65536 tokens, but can only afford 3919", "status_code": 402}, 402),
    ("vllm", {"message": "Extra inputs are not permitted", "param": "top_k", "code": 400,
              "type": "BadRequestError"}, 400),
    ("sglang", {"message": "Unrecognized request argument supplied: top_k", "code": 400}, 400),
])
def test_a_callers_error_another_provider_may_serve_is_tried_there_sent_in_a_stream_as_answered_whole(
        provider_type: str, error: dict[str, Any], status: int) -> None:
    """The same rule in a stream as for the error answered whole (`callers_retry`): another provider
    first, no attempt used up, the caller's answer (with its status) when none is left."""
    from workers.adapters.failures import answered_error
    from workers.adapters.openai_compat import sent_error

    err = sent_error("p", error, 500, provider_type, "served-m")
    whole = answered_error("p", status, error["message"], error, "served-m")
    assert (err.retry, err.status, err.strikes) == (Retry.UNABLE, status, 0)
    assert (whole.retry, whole.status, whole.strikes) == (err.retry, err.status, err.strikes)


@pytest.mark.parametrize(("message", "unknown"), [
    ("Unrecognized request argument supplied: top_k", True),  # (OpenAI's, Azure's)
    ('{"detail":[{"type":"extra_forbidden","loc":["body","top_k"],"msg":"Extra inputs are not permitted"}]}',
     True),  # (Mistral's 422, pydantic's)
    ('Invalid JSON payload received. Unknown name "google": Cannot find field.', True),  # (Gemini's)
    ("Unsupported parameter: 'logit_bias' is not supported with this model.", True),  # (OpenAI's)
    ("'temperature' must be at most 2", False),
    ("This model's maximum context length is 8192 tokens", False),
    ("unknown model 'x'", False),
])
def test_which_refusals_say_a_field_is_unknown_to_the_server(message: str, unknown: bool) -> None:
    """A field one server does not know another of the model may take (vLLM takes `top_k`): such a
    400 or 422 is tried elsewhere first (`another_may`); a value the caller got wrong is not."""
    from workers.adapters.failures import UNKNOWN_FIELD

    assert bool(UNKNOWN_FIELD.search(message)) is unknown


@pytest.mark.parametrize(("message", "retry"), [
    ('{"detail":[{"type":"extra_forbidden","loc":["body","top_k"],"msg":"Extra inputs are not permitted", '
     '"input": 32000}]}', Retry.UNABLE),  # (the server's words come before its echo)
    ("1 validation error for ChatCompletionRequest messages.0.content Input should be a valid string "
     "[type=string_type, input_value='Why do I get Unrecognized request argument supplied?', input_type=str]",
     Retry.NO),  # (the caller's own words, echoed: nothing of the server)
    ("1 validation error: {'type': 'string_type', 'input': 'it says: Extra inputs are not permitted'}", Retry.NO),
    # FastAPI's own 422, as it writes it (compact JSON: no space after the colon); found in review with fastapi
    ('{"detail":[{"type":"list_type","loc":["body","messages"],"msg":"Input should be a valid list","input":"Why '
     'do I get Unrecognized request argument supplied?"}]}', Retry.NO),
    ('{"detail":[{"type":"extra_forbidden","loc":["body","top_k"],"msg":"Extra inputs are not permitted",'
     '"input":5}]}', Retry.UNABLE),
    # Gemini's, of a field named `input`: its own words, no echo
    ('Invalid JSON payload received. Unknown name "input": Cannot find field.', Retry.UNABLE),
])
def test_an_unknown_field_only_an_echo_of_the_request_names_is_the_callers_at_once(message: str,
                                                                                   retry: Retry) -> None:
    from workers.adapters.failures import callers_retry

    assert callers_retry(400, message) is retry


@pytest.mark.parametrize(("message", "lacks"), [
    ("model 'router-gone' not found", True),
    ("model name=router-gone is not running", True),
    ("model is not loaded", True),  # (--no-models-autoload: listed, not loaded; it was the caller's 400)
    ("model 'other' not found", False),
    ("the request exceeds the available context size", False),
])
def test_what_a_llama_server_router_says_it_lacks(message: str, lacks: bool) -> None:
    from workers.adapters.openai_compat import router_lacks

    assert router_lacks(message, "router-gone") is lacks


@pytest.mark.parametrize(("message", "flag"), [
    ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', True),  # vLLM
    ('tool_choice="required" requires --tool-call-parser to be set', True),  # vLLM
    ("max_thinking_tokens requires the server to be launched with --enable-strict-thinking", True),  # SGLang
    ("Request-supplied chat_template is not allowed. Start the server with --trust-request-chat-template to "
     "permit it.", True),  # SGLang
    # SGLang's prompt over its context: the caller's (a flag named, but not one it requires)
    ("Input length (8183 tokens) exceeds the maximum allowed length (8181 tokens). Use a shorter input or "
     "enable --allow-auto-truncate.", False),
    ("temperature must be non-negative, got -1.0.", False),
    ("a value that requires --- no flag", False),
    ("tools param requires --jinja flag", True),  # llama-server (server-common.cpp)
    # a request that fails vLLM's validation, echoed: the caller's words, not the server's (found in review)
    ("1 validation error for ChatCompletionRequest messages.0.content.list[...].0 Input tag 'input_text' found "
     "using 'type' does not match any of the expected tags [type=union_tag_invalid, input_value={'type': "
     "'input_text', 'text': 'npm publish requires --access public'}, input_type=dict]", False),
    ("[{'type': 'missing', 'loc': ('body', 'messages', 0, 'role'), 'msg': 'Field required', 'input': {'content': "
     "'this requires --force to overwrite'}}]", False),
    ("stop sequence too long (parameter=stop, value=['the deploy requires --force'])", False),
    # FastAPI's own 422 to a request its validator refuses, the whole body echoed as compact JSON (found in review)
    ('{"detail":[{"type":"value_error","loc":["body"],"msg":"Value error, n must be 1","input":{"model":"m","n":2,'
     '"messages":[{"role":"user","content":"npm publish requires --access public"}]},"ctx":{"error":{}}}]}', False),
])
def test_a_refusal_naming_a_flag_the_server_lacks_says_another_may_serve_it(message: str, flag: bool) -> None:
    from workers.adapters.failures import SERVER_FLAG, own_words

    assert bool(SERVER_FLAG.search(own_words(message))) is flag  # (in the server's own words, not its echo)
    assert callers_retry(400, message) is (Retry.UNABLE if flag else Retry.NO)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_an_ollama_completion_s_last_line_with_its_context_over_the_line_limit_is_taken(
        stream: bool, raw: Raw, session: aiohttp.ClientSession) -> None:
    """`/api/generate`'s last line carries `context`, the tokens of the prompt and the whole answer
    (server/routes.go:706-719, unless `raw`): about 6 bytes a token, past `runtime.max_line_bytes`
    (1 MiB) at some 170,000 tokens. The stream failed on its very last line, after the whole answer
    reached the caller. A completion's lines are held to `max_response_bytes` instead."""
    done = {"model": SERVED, "response": "", "done": True, "done_reason": "stop", "prompt_eval_count": 3,
            "eval_count": 2, "context": list(range(100_000, 100_400))}  # (~2.8 KB)
    raw.answers["/api/generate"] = chunked([nd({"model": SERVED, "response": "a b", "done": False}), nd(done)],
                                           content_type="application/x-ndjson")
    adapter = OllamaAdapter(ollama(raw.url), session, ReadLimits(line_bytes=1024))
    body = {"model": SERVED, "prompt": "x", "stream": stream}
    if stream:
        chunks = await collect(adapter.stream(RunKind.COMPLETION, body, "run_1"))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "a b"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        answer = await adapter.complete(RunKind.COMPLETION, body, "run_1")
        assert answer["choices"][0]["text"] == "a b" and answer["choices"][0]["finish_reason"] == "stop"
