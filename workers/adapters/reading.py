"""Reading from a provider within limits: a whole answer up to a size, lines up to a length,
and JSON up to a depth.

A provider can send anything: an endless stream, a 100 MB answer, a line with no end, JSON
nested thousands deep, a redirect elsewhere. Every read here stops at its `ReadLimits` with an
`output_too_large` error instead of growing; JSON too deep for the parser is a provider error,
not a `RecursionError` that escapes the adapter."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from common import jsonio
from common.chunks import is_preamble
from common.policy import Health
from common.runlog import run_fields
from workers.adapters.base import DOWN, ProbeResult, ProviderError, ReadLimits, Retry
from workers.adapters.failures import body_text, one_line, redact

log = logging.getLogger("iop.worker")

#: the most of a redirect's target shown in an error
MAX_LOCATION_CHARS = 200
#: A provider's JSON nested deeper than this is its error (`too_deep`): every answer and chunk is
#: written again on its way to the caller, by an encoder that stops at 255 levels; a real answer
#: has fewer than ten.
MAX_DEPTH = 128


class ReadWatch:
    """A read timeout of iop's own over a body's reads, besides aiohttp's `sock_read`, which aiohttp
    drops when its parser fails inside a body (a chunk size that is not hex): the read then waited
    for nothing, and the run for its `execution_timeout_ms`. Counted, not timed, per read (a timer
    each would cost a stream's CPU): every `read_s` it looks whether a read was waiting at its
    last look and still is, none having ended between; if so the task is cancelled, and the block raises
    `aiohttp.SocketTimeoutError` ("sent nothing for N ms"). So a silence ends within two `read_s`,
    and only time spent in a read counts (not the caller's, between reads)."""

    def __init__(self, read_s: float | None) -> None:
        """`read_s` None: reads are counted, not watched (a probe, bounded by its own total timeout)."""
        self.read_s = read_s
        self.reading = False
        self.reads = 0
        self._seen = -1
        self._was_reading = False
        self._expired = False
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> ReadWatch:
        self._task = asyncio.current_task()
        if self.read_s is not None:
            self._handle = asyncio.get_running_loop().call_later(self.read_s, self._look)
        return self

    def _look(self) -> None:
        # (the same read waiting at both looks: reading then and now, and none ended between; a
        # read begun just before this look, after the caller held the body a while, has time)
        if self.reading and self._was_reading and self.reads == self._seen and self._task is not None:
            self._expired = True
            self._task.cancel()
            return
        self._seen, self._was_reading = self.reads, self.reading
        assert self.read_s is not None
        self._handle = asyncio.get_running_loop().call_later(self.read_s, self._look)

    async def read(self, reading: Awaitable[bytes]) -> bytes:
        self.reading = True
        try:
            return await reading
        finally:
            self.reading = False
            self.reads += 1

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._expired and kind is asyncio.CancelledError and self._task is not None and not self._task.uncancel():
            raise aiohttp.SocketTimeoutError(f"no read ended within {self.read_s:g} s") from None


async def read_at_most(resp: aiohttp.ClientResponse, limit: int, read_s: float | None = None) -> bytes | None:
    """The whole body of an answer, or None once it passes `limit` bytes (nothing more is read);
    `read_s`: each read within that (`ReadWatch`)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()  # (one buffer: a body dribbled in tiny reads takes what its bytes take, not a
    async with ReadWatch(read_s) as watch:  # list of as many bytes objects, 34 bytes each more)
        while True:
            watch.reading = True  # (`watch.read`, inline: a coroutine less a read)
            data = await resp.content.readany()
            watch.reading = False
            watch.reads += 1
            if not data:
                break
            if len(body) + len(data) > limit:
                return None
            body += data
    return bytes(body)


#: the most of an error answer read to describe it, and how long it may take to come
MAX_ERROR_BODY = 64 * 1024
ERROR_BODY_S = 5.0


async def error_body(resp: aiohttp.ClientResponse) -> str:
    """An error answer's body as text (`body_text`): read until it ends, `MAX_ERROR_BODY` bytes
    came, or `ERROR_BODY_S` passed, whichever is first (one read takes only what has arrived: a
    body written in two pieces was cut after the first)."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(ERROR_BODY_S):
            while size < MAX_ERROR_BODY:
                data = await resp.content.read(MAX_ERROR_BODY - size)
                if not data:
                    break
                parts.append(data)
                size += len(data)
    except (TimeoutError, aiohttp.ClientError):  # (what came is what there is to show)
        pass
    return body_text(b"".join(parts))


#: the most of what an error answer to a probe says that its reason shows
MAX_PROBE_SAID = 100


async def probe_said(resp: aiohttp.ClientResponse) -> str:
    """What an error answer to a probe says, in a few words for its reason (llama-server's `/health`
    answers 503 `Loading model` while it loads): its JSON error's message, or its text ('' if none)."""
    text = await error_body(resp)
    said = text
    if text.lstrip()[:1] == "{":
        try:
            obj = jsonio.loads(text.encode())
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict):
            said = error_text(obj.get("error") or obj, MAX_PROBE_SAID)
    return "" if said == "no message" else one_line(said, MAX_PROBE_SAID)


async def read_whole(resp: aiohttp.ClientResponse, provider_id: str, limits: ReadLimits,
                     read_s: float | None = None) -> bytes:
    """The whole body of an answer, or ProviderError once it passes `limits.response_bytes`;
    `read_s`: each read within that (`ReadWatch`)."""
    data = await read_at_most(resp, limits.response_bytes, read_s)
    if data is None:
        raise limits.too_large(provider_id, "an answer", limits.response_bytes)
    return data


def too_deep(provider_id: str) -> ProviderError:
    """JSON nested deeper than the parser's recursion limit: the provider answered (no strike).
    Not retried (`Retry.NO`), as README's "a provider's answer cannot be carried or handled"
    says of every answer the worker cannot handle, JSON nested too deep among them."""
    return ProviderError(f"provider {provider_id} sent JSON nested too deep", retry=Retry.NO, strikes=0,
                         repeats=True)


def parse_json(data: bytes, provider_id: str) -> Any:
    """A provider's JSON; ValueError when it is not JSON, ProviderError when it is nested deeper
    than `MAX_DEPTH`."""
    try:
        value = jsonio.loads(data)
    except RecursionError:
        raise too_deep(provider_id) from None
    # (counting brackets costs two C scans of the text; only text with that many walks the value. JSON
    # nested deeper than the limit opens and closes more than it: text of at most twice it bytes, a
    # short SSE chunk's, say, cannot, and skips the scans, ~0.3 us a 220-byte chunk)
    if len(data) > 2 * MAX_DEPTH and data.count(b"[") + data.count(b"{") > MAX_DEPTH \
            and deeper_than(value, MAX_DEPTH):
        raise too_deep(provider_id)
    return value


def deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest deeper than `limit` levels in `value` (itself level 1)."""
    if type(value) is not dict and type(value) is not list:
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (item.values() if type(item) is dict else item)
                     if type(child) is dict or type(child) is list)  # (only what may nest: a leaf costs nothing)
    return False


def error_text(error: Any, limit: int) -> str:
    """What a provider's `error` field says, on one line: an object's `message`, a string as it
    is, anything else as JSON (never a Python repr); without a traceback it carries."""
    if isinstance(error, dict):
        error = error.get("message") or "no message"
    if not isinstance(error, str):
        try:
            error = json.dumps(error, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            error = "an error it did not describe"
    return one_line(without_traceback(error), limit) or "no message"


#: Where a Python traceback begins in an error's text, wherever it is (after a `\r`, a no-break space,
#: or inside JSON text, its quotes escaped): its heading, or a frame (`File "…", line N, in f`; the
#: `in` tells a frame from a message that names a file's line).
_TRACEBACK = re.compile(r'Traceback \(most recent call last\)|File \\?"[^"\r\n]*?\\?", line \d+, in ')
#: The line a traceback ends with: the exception and its message (`ValueError: bad`).
_RAISED = re.compile(r'(?:^|[\r\n]|\\n)\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b[^\r\n\\]*)')


def without_traceback(text: str) -> str:
    """A provider's error text up to the traceback it may carry (llama-cpp-python's 500s end with
    one): its frames name the server's files and code, which its callers have no business seeing
    (the server's own log keeps them). What came before it is kept, and the exception it ends with
    (`ValueError: bad`); a text that has neither says a traceback was left out."""
    found = _TRACEBACK.search(text)
    if found is None:
        return text
    before = text[:found.start()].rstrip()
    raised = _RAISED.findall(text[found.start():])
    said = "\n".join(part for part in (before, raised[-1].strip() if raised else "") if part)
    return said or "an error with a traceback (left out: the server's log has it)"


def redirect_text(resp: aiohttp.ClientResponse) -> str:
    """`a redirect to /path` for a 3xx answer (`… on another server` when it points elsewhere): the
    path it points to, never an address (this text may reach callers), nor the credentials, query
    or fragment the Location may carry."""
    location = resp.headers.get("Location", "").strip()
    if not location:
        return "a redirect without a Location"
    try:
        parts = urlsplit(location)
        host = parts.netloc.rpartition("@")[2]
        elsewhere = bool(host) and host.lower() != (resp.url.raw_authority or "").rpartition("@")[2].lower()
    except ValueError:
        return "a redirect to a URL that is not valid"
    where = one_line(parts.path, MAX_LOCATION_CHARS) or "/"
    return f"a redirect to {where} on another server" if elsewhere else f"a redirect to {where}"


#: the 3xx statuses that redirect (a 300, 304 or 305 with no Location redirects nowhere)
REDIRECTS = (301, 302, 303, 307, 308)


def _not_followed(resp: aiohttp.ClientResponse) -> str:
    if resp.status not in REDIRECTS and not resp.headers.get("Location", "").strip():
        return f"answered {resp.status}, which is no answer to a run or a probe (fix base_url)"
    return f"answered {resp.status} ({redirect_text(resp)}; iop does not follow redirects: fix base_url)"


def redirect_error(provider_id: str, resp: aiohttp.ClientResponse) -> ProviderError:
    """A run answered with a 3xx. iop never follows a provider's redirect (a 307 would send the
    whole prompt to another host, a 302 would turn the run into a GET): the provider as
    configured cannot serve runs, which is for its operator to fix, so it is down at once
    (`DOWN` strikes) and the run may go to another provider."""
    return ProviderError(f"provider {provider_id} {_not_followed(resp)}", status=resp.status, retry=Retry.ELSEWHERE,
                         strikes=DOWN)


def redirect_probe(path: str, resp: aiohttp.ClientResponse, secrets: list[str]) -> ProbeResult:
    """A probe (`GET path`) answered with a 3xx: not followed either, and down at once, as a run's
    (`redirect_error`); `secrets` are redacted from where it points."""
    return ProbeResult(Health.UNAVAILABLE, redact(f"GET {path} {_not_followed(resp)}", secrets), strikes=DOWN)


def is_redirect(status: int) -> bool:
    return 300 <= status < 400


class LineSplitter:
    """Splits a byte stream into lines; keeps a partial line between reads, up to a length.

    A line ends with LF, CRLF or a CR alone, as in server-sent events: a CR that ends a read ends
    its line at once, and an LF that opens the next read is its CRLF's second half (the `openai`
    client splits so). `feed` returns the complete lines as an iterator that checks each line's
    length as it comes to it: a reader that stops at an end marker is not failed by a line after
    it."""

    def __init__(self, provider_id: str, limits: ReadLimits) -> None:
        self.provider_id = provider_id
        self.limits = limits
        #: the partial line: it grows in place while reads bring no line end (a line dribbled in
        #: small reads was copied whole at each: 0.3 s of CPU for a 1 MiB line in 512-byte reads)
        self._buf = bytearray()
        #: the last read ended with a CR: an LF that opens the next one is its CRLF's
        self._skip_lf = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._skip_lf and data:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        if b"\n" not in data and b"\r" not in data:
            self._buf += data
            return self._checked([], len(self._buf) > self.limits.line_bytes)
        buf = bytes(self._buf) + data if self._buf else data
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = buf.split(b"\n")
        self._buf = bytearray(rest)
        return self._checked(lines, len(rest) > self.limits.line_bytes)

    def _checked(self, lines: list[bytes], partial_too_long: bool) -> Iterator[bytes]:
        for line in lines:
            if len(line) > self.limits.line_bytes:
                raise self.limits.too_large(self.provider_id, "a line", self.limits.line_bytes)
            yield line
        if partial_too_long:
            raise self.limits.too_large(self.provider_id, "a line", self.limits.line_bytes)


async def watched_reads(resp: aiohttp.ClientResponse, read_s: float) -> AsyncIterator[bytes]:
    """A body's reads, each within `read_s` (`ReadWatch`)."""
    async with ReadWatch(read_s) as watch:
        while data := await watch.read(resp.content.readany()):
            yield data


async def with_line_end(reads: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A body's reads, then a line end: a last line the server did not end is read too (Ollama's
    final `done` line without its newline)."""
    async for data in reads:
        yield data
    yield b"\n"


class Breaks:
    """Where a stream parser's error goes when it comes after objects of the same read. Once the
    caller has been shown output (`shown`, which the adapter sets), the objects before the error
    are given and the error held (`broken`) for the adapter to raise once they went out: what a
    caller got stays the provider's output up to the bad line, with no gap (a garbled line
    dropped the chunks before it in its read). Before that the error is raised at once: nothing
    reached the caller, and the run may still be tried elsewhere."""

    def __init__(self) -> None:
        #: the error a read ended with, after the objects given with it (until `take`n)
        self.broken: Exception | None = None
        #: an error ended the stream: nothing more is read
        self.stopped = False
        #: the caller was shown output (not only an opening, `common.chunks.is_preamble`)
        self.shown = False

    def read(self, read: Callable[[list[Any]], None], whole: Callable[[list[Any]], bool] | None = None) -> list[Any]:
        """The objects `read` puts in its list; its error as above, or a garbled line's held too
        when they make the answer whole (`whole`): the adapter keeps a whole answer it follows."""
        out: list[Any] = []
        try:
            read(out)
        except (ValueError, ProviderError) as exc:
            kept = self.shown or (isinstance(exc, ValueError) and whole is not None and whole(out))
            if not (out and kept):
                raise
            # (without the frames it came through: they hold the parser, which holds it)
            self.broken, self.stopped = exc.with_traceback(None), True
        return out

    def passing(self, chunks: list[Any]) -> list[Any]:
        """`chunks`, on their way to the caller: `shown` once one of them is output."""
        if not self.shown and not all(is_preamble(c) for c in chunks):
            self.shown = True
        return chunks

    def take(self) -> Exception:
        """The held error, to raise: no longer held (held, it and the frame raising it would hold
        each other, which only the garbage collector frees)."""
        broken, self.broken = self.broken, None
        assert broken is not None
        return broken


class NonObjects:
    """Stream chunks that are not JSON objects (`[1, 2]`, `"text"`, `42`, `null`) carry nothing a
    caller could use and would break its client: they are dropped, with one WARNING per run."""

    def __init__(self, provider_id: str, request_id: str, model: str | None) -> None:
        self.provider_id = provider_id
        self.extra = run_fields(request_id, model, provider=provider_id)
        self.dropped = 0

    def drop(self, obj: Any) -> None:
        self.dropped += 1
        if self.dropped == 1:
            what = ("whose choices are not a list of objects, each delta or message an object"
                    if isinstance(obj, dict) else f"that is not a JSON object ({_json_type(obj)})")
            log.warning("provider %s sent a stream chunk %s; dropped it, and any more in this run",
                        self.provider_id, what, extra=self.extra)


def _json_type(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, (int, float)):
        return "a number"
    if isinstance(obj, str):
        return "a string"
    if isinstance(obj, list):
        return "an array"
    return "not an object"
