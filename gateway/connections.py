"""Connection hygiene of the gateway's listening socket: how slowly a client may send, how long a
connection may idle, and how many connections are open. Defaults live in `common.config`
(`RuntimeConfig`); the README explains each.

Every connection is served by a `GuardedHandler`, aiohttp's own request handler plus:

- `header_timeout_ms`: a request head must be complete this long after its first byte (after the
  connect, for a connection's first request; after the answer before it, for one sent behind
  another). Else, if anything had been sent, 408 `request_timeout`, and what the client still
  sends is dropped until it closes (at most `LINGER_S`); the connection closes either way.
- `MAX_HEAD_BYTES`: a head is counted as its bytes arrive (`gateway.heads` finds where each
  begins) and answered 400 once it passes the limit, without waiting for its end.
- `body_timeout_ms`: a body must be complete this long after its head (`body_reader`, run by `gateway.middleware`), else
  408 and the connection ends (`GuardedHandler._end_after_answer`: the rest of the body is dropped
  for at most aiohttp's lingering time, then it closes).
  The body is decoded (`Content-Encoding`) by `gateway.bodies`, not by aiohttp, and handed to
  the handlers as `request[BODY]`.
- `BODIES_BUDGET`: the bodies being read hold at most so many bytes beyond each one's first
  `FREE_BODY_BYTES`, all connections together; past it, 503 `service_unavailable` and the
  connection ends (`body_reader`).
- `idle_timeout_ms`: a kept-alive connection without a request is closed after this (aiohttp's
  keep-alive timeout).
- `max_connections`: which connections are kept at the limit is `gateway.admission`'s decision;
  a connection in a triage slot is read here only as far as its request line: `GET /healthz` is
  answered (and the connection closed), anything else gets 503 `service_unavailable`.

Parse errors aiohttp answers itself (a malformed request line or header, a header over 8 KiB)
get the same OpenAI-shaped body as every other error (`handle_error`), saying only what kind of
fault it was: aiohttp's own text quotes the raw request (an `Authorization` header among it), so
it reaches neither the caller nor the log. So does a request's `Expect` header (`expect_handler`):
`100-continue` is answered `100 Continue` unless the body it announces is over the limit (413 at
once), any other expectation 417.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

from aiohttp import HttpVersion11, http_exceptions, web

from common.shown import quoted
from common.wire import ErrorCode
from gateway.admission import MAX_HEAD_BYTES, ConnectionGuard, Slot
from gateway.auth import admit
from gateway.bodies import decode, too_large
from gateway.errors import ApiError, from_status, invalid
from gateway.heads import FREE_CHUNKS, MIN_CHUNK_BYTES, HeadScanner

log = logging.getLogger("iop.gateway")

#: The one request answered on connections in triage: how its request line begins (then " " or "?").
HEALTH_REQUEST = b"GET /healthz"
#: The request's body, read within the limits and decoded (empty when it had none).
BODY = web.RequestKey("iop_body", bytes)
#: How long a connection answered 408 for a late head drops what its client still sends before it
#: closes (a client that reads its answer closes at once).
LINGER_S = 2.0
#: The most bytes of request bodies the gateway holds while it reads them, all connections together
#: (or `runtime.max_body_bytes`, if that is more: one body of the limit always fits), beyond each
#: body's first `FREE_BODY_BYTES`. A body that passes it gets 503 and its connection closes:
#: connections each sending 8 MiB but its last byte held ~13 MB of memory each, ~50 GB at
#: `runtime.max_connections` (4096).
BODIES_BUDGET = 256 * 1024 * 1024
#: What of each body is not counted: so the small ones (almost every request) get through whatever
#: large ones hold, and a budget is taken only by bytes sent, never by a length announced (a few
#: connections announcing 8 MiB and sending nothing would have refused every body for 60 s).
#: `runtime.max_connections` (4096) of them hold 256 MiB at most.
FREE_BODY_BYTES = 64 * 1024


class BodiesBudget:
    """The bytes of request bodies being read, against their budget (one per gateway)."""

    __slots__ = ("most", "held")

    def __init__(self, most: int) -> None:
        self.most = most
        self.held = 0

    def take(self, size: int) -> None:
        """Count `size` more bytes, or raise the 503 that refuses them."""
        if self.held + size > self.most:
            raise ApiError(ErrorCode.UNAVAILABLE, f"the gateway is reading request bodies of {self.most} bytes in "
                           "all, its limit; retry shortly", headers={"Retry-After": "1"})
        self.held += size


class ChunksTooSmall(Exception):
    """Set on a request's body whose chunks average under `gateway.heads.MIN_CHUNK_BYTES`: its read
    raises it (`body_reader` answers 400)."""


class TrailersTooLarge(Exception):
    """Set on a request's chunked body whose trailers passed `MAX_HEAD_BYTES` (none of their bytes
    beyond reached aiohttp, so the body would never end): its read raises it (`body_reader` answers 400)."""


def _refuse_body_of(content: Any, refusal: type[Exception]) -> None:
    """Make the body's read raise `refusal`, and mark it ended: aiohttp then does not linger on it
    after the answer (its lingering read would raise it, an "Unhandled exception")."""
    content.set_exception(refusal())
    content.feed_eof()


def _unread_chunked(request: web.BaseRequest) -> bool:
    """The request has a chunked body that was not read to its end."""
    return not request.content.is_eof() and "chunked" in request.headers.get("Transfer-Encoding", "").lower()


class Phase(enum.Enum):
    SERVING = "serving"  # aiohttp reads and answers its requests
    TRIAGE = "triage"  # over the limit: reading the request line
    ANSWERED = "answered"  # over the limit: answered 503, waiting for the client to close


class GuardedHandler(web.RequestHandler):
    """aiohttp's request handler with a head deadline, a connection limit and OpenAI-shaped parse errors."""

    __slots__ = ("_guard", "_slot", "_phase", "_raw", "_line", "_head_timer", "_head_begun", "_in_request",
                 "_close_after_response", "_dropping", "_heads", "_answered", "_refusing", "_started",
                 "_body_refused_at", "_refusal")

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **options: Any) -> None:
        # Bodies are decoded by `body_reader` (gateway.bodies), not by aiohttp.
        super().__init__(manager, keepalive_timeout=guard.limits.idle_timeout_s, auto_decompress=False, **options)
        self._guard = guard
        self._slot = Slot.NONE
        self._phase = Phase.SERVING
        self._raw: asyncio.Transport | None = None  # the transport while aiohttp does not have it
        self._line = bytearray()
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_begun = False
        self._in_request = False
        self._close_after_response = False
        #: answered 408 to a late head: what the client still sends is dropped until it closes
        self._dropping = False
        #: where each head lies in what the client sends, and how many requests were answered
        self._heads = HeadScanner(MAX_HEAD_BYTES)
        self._answered = 0
        #: a head passed the limit behind requests not yet answered: its 400 follows their answers
        self._refusing = False
        #: requests whose handling began (`request_started`)
        self._started = 0
        #: which request (counted as `_started`) had its chunked body refused while it came, and why
        #: (`ChunksTooSmall`, `TrailersTooLarge`); 0 for none
        self._body_refused_at = 0
        self._refusal: type[Exception] = ChunksTooSmall

    # -- the connection's life -------------------------------------------------------------

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # uvloop's transports are not asyncio.Transport subclasses
        self._slot = self._guard.admit()
        if self._slot is Slot.NONE:
            transport.write(self._guard.busy_answer())
            transport.close()
            self._phase = Phase.ANSWERED
            return
        self._arm_head_timer()
        self._guard.idle(self, self._slot)  # nothing sent yet
        if self._slot is Slot.TRIAGE:
            self._raw, self._phase = transport, Phase.TRIAGE
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        if self._phase is Phase.SERVING:
            if not self._in_request and not self._head_begun:
                self._head_begun = True
                self._guard.busy(self)
                if self._head_timer is None:
                    self._arm_head_timer()
            heads = self._heads.heads
            within = self._heads.feed(data)
            if within < len(data):
                if self._heads.chunks_refused:
                    self._refuse_body(data[:within], ChunksTooSmall)
                elif self._heads.in_trailers:  # (its request is begun: a 400 behind it would wait for its end)
                    self._refuse_body(data[:within], TrailersTooLarge)
                else:
                    self._refuse_large_head(data[:within])
                return
            if self._heads.heads != heads and not self._heads.in_head:
                self._cancel_head_timer()  # the head came whole (its request starts on the next turn)
            self._parse(data)
        elif self._phase is Phase.TRIAGE:
            self._guard.busy(self)
            self._triage(data)
        # ANSWERED: the rest of what the client sends is dropped

    def _refuse_large_head(self, before: bytes) -> None:
        """A head passed `MAX_HEAD_BYTES` (none of its bytes beyond what was parsed already are):
        answered 400 and the connection ends, after the answers to the requests sent before it
        (`before`: the bytes of this read that came before the head)."""
        self._cancel_head_timer()
        if before:
            self._parse(before)
        self._dropping = True
        if self._answered < self._heads.heads:
            self._refusing = True  # (answered by `finish_response` after the last of them)
        else:
            self._answer_large_head()

    def _refuse_body(self, before: bytes, refusal: type[Exception]) -> None:
        """The last head's chunked body came in chunks too small (`gateway.heads.MIN_CHUNK_BYTES`), or
        its trailers passed `MAX_HEAD_BYTES`: nothing more of it is parsed, and what the client still
        sends is dropped. Its request is answered 400 when its body is read (at once if it is being
        read), then the connection ends (`finish_response`). (A request answered before its chunked
        body was read is not here: its answer ended the connection, and what came after was dropped
        unparsed.)"""
        if before:
            self._parse(before)
        self._dropping = True
        self._body_refused_at, self._refusal = self._heads.heads, refusal
        request = self._current_request
        if request is not None and self._started == self._body_refused_at:
            _refuse_body_of(request.content, refusal)

    def body_refused(self, request: web.BaseRequest) -> None:
        """Called as a request's body is about to be read: a body refused before its handling began
        (`_refuse_body`) is refused now."""
        if self._body_refused_at and self._body_refused_at == self._started:
            _refuse_body_of(request.content, self._refusal)

    def _parse(self, data: bytes) -> None:
        """Give aiohttp's parser the bytes one request at a time where several heads began in them
        (pipelined): it drops every request of a read in which it finds a fault, so a head it
        refuses (a line over 8 KiB, not HTTP) behind others would take them along, unanswered."""
        starts = self._heads.starts
        if len(starts) < 2:
            super().data_received(data)
            return
        cuts = [0, *(i for i in starts if 0 < i < len(data)), len(data)]
        for a, b in itertools.pairwise(cuts):
            super().data_received(data[a:b])

    def _answer_large_head(self) -> None:
        self._refusing = False
        if self.transport is not None:
            self.transport.write(self._guard.large_head_answer())
        self._drop_then_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        self._guard.release(self, self._slot)
        self._slot = Slot.NONE
        if self._phase is Phase.SERVING and self._raw is None:
            super().connection_lost(exc)
        self._raw = None

    def close_if_idle(self) -> None:
        """The gateway's stop began (`gateway.stopping.close_idle`): closed now when idle (kept alive, or
        connected, without a byte of a request); otherwise left to its answer and the next request."""
        if not self._in_request and not self._head_begun:
            self.close()

    def evict(self) -> None:
        """Give the slot up to a newer connection (`ConnectionGuard.admit`) and close at once."""
        self._slot = Slot.NONE
        self._cancel_head_timer()
        if self._raw is not None:
            self._raw.close()
        else:
            self.force_close()

    # -- the head deadline -----------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_request:
            return
        self._guard.head_timed_out()
        if self._phase is Phase.SERVING:
            if self.transport is not None and self._head_begun:
                self.transport.write(self._guard.late_head_answer())
                self._drop_then_close()
            else:
                self.force_close()
        elif self._raw is not None:
            if self._phase is Phase.TRIAGE and self._line:
                self._raw.write(self._guard.late_head_answer())
            self._raw.close()

    def _drop_then_close(self) -> None:
        """After the 408 to a late head: the client may still be sending it, and closing with its
        bytes unread sends a reset, which can reach the client before the 408 (it saw a broken
        connection). The gateway ends what it sends, drops what comes, and closes once the client
        has, or after `LINGER_S`; meanwhile the connection is idle (a newer one may evict it)."""
        self._dropping = True
        self._guard.idle(self, self._slot)
        if not self._end_sending():
            self.force_close()
            return
        self._head_timer = self._loop.call_later(LINGER_S, self.force_close)  # (cancelled as the connection ends)

    def _end_sending(self) -> bool:
        """Send the end of what the gateway sends (the client reads its answer, then the end);
        False when the transport cannot (closed, or no half-close), or failed (then it is closed)."""
        transport = self.transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            return False
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            self.force_close()
            return False
        return True

    def request_started(self) -> None:
        """A request is being handled (called by `gateway.middleware` first thing). No head
        deadline runs until its response is written: a pipelined next head waits behind it; one
        still incomplete then gets its deadline from then (`finish_response`)."""
        self._cancel_head_timer()
        self._in_request = True
        self._head_begun = False
        self._started += 1

    def close_after_response(self) -> None:
        self._close_after_response = True

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        """aiohttp's last step of every answered request: the response is written. An HTTP error
        aiohttp raised before the middleware could shape it (its own `Expect` handling, on a
        path no route matches) is OpenAI-shaped here."""
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            resp = (expectation_failed() if resp.status == 417 else from_status(resp.status, resp.reason)).response()
            resp.force_close()
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered += 1
            if (self._body_refused_at and self._answered >= self._body_refused_at) or _unread_chunked(request):
                # a body refused for its chunks or trailers (its end marked: aiohttp does not linger on it), or a
                # chunked body its answer left unread (a refused key): what still comes is dropped, not
                # parsed (aiohttp read it through its parser, chunk by chunk, for 10 s: a keyless client
                # cost the gateway ~4.5 ms a connection), and the connection ends
                self._dropping = True
                self._drop_then_close()
            elif self._close_after_response:
                self._end_after_answer()
            elif self._refusing:
                if self._answered >= self._heads.heads:
                    self._answer_large_head()
            else:
                self._in_request = False
                self._guard.idle(self, self._slot)
                # The next head's deadline: from its first byte, or from now for one begun already
                # (sent behind this request); none if none began (a request answered before its
                # body was read, as a refused key, had left the connection's deadline running).
                self._cancel_head_timer()
                self._head_begun = self._heads.in_head
                if self._head_begun:
                    self._guard.busy(self)
                    self._arm_head_timer()

    def _end_after_answer(self) -> None:
        """End a connection whose request was answered before its body was read (a 413, a 408, a
        refused `Expect`): the answer is followed by the end of what the gateway sends (the client
        reads it, then the end), and what the client still sends is read and dropped for at most
        aiohttp's lingering time (10 s), then the connection closes. Closing at once, with the body
        unread in the socket, sends a reset, which can reach the client before the answer: it would
        see a broken connection (and retry) instead of the 413. (`_in_request` stays set: no head
        deadline runs on the dropped bytes: a refused `Expect` is answered before `request_started`.)"""
        self._cancel_head_timer()
        self._in_request = True
        self.close()  # no next request on it; aiohttp lingers on the unread body, then closes
        self._end_sending()

    # -- over the limit ----------------------------------------------------------------------

    def _triage(self, data: bytes) -> None:
        """Answer 503 as soon as the first bytes show that this is not a health check; hand a
        health check over to aiohttp."""
        self._line += data
        start = bytes(self._line[:len(HEALTH_REQUEST) + 1])
        if not (HEALTH_REQUEST + b" ").startswith(start) and not (HEALTH_REQUEST + b"?").startswith(start):
            self._answer_busy()
        elif len(start) > len(HEALTH_REQUEST):
            # Health is answered even now; the connection closes after it, freeing its triage slot.
            transport, head = self._raw, bytes(self._line)
            assert transport is not None
            self._raw, self._line, self._phase = None, bytearray(), Phase.SERVING
            self._close_after_response = True
            self._head_begun = True
            super().connection_made(transport)
            self.data_received(head)

    def _answer_busy(self) -> None:
        self._guard.refused()
        self._phase, self._line = Phase.ANSWERED, bytearray()
        assert self._raw is not None
        self._raw.write(self._guard.busy_answer())
        if self._raw.can_write_eof():
            # The client reads the 503 and closes; the head deadline or a newer connection closes it otherwise.
            self._raw.write_eof()
            self._guard.idle(self, self._slot)
        else:
            self._raw.close()

    # -- parse errors ----------------------------------------------------------------------

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse, OpenAI-shaped; the connection closes.
        aiohttp's `message` quotes the raw request: only the kind of fault is told (and logged)."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response had begun; no error can be sent")
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            text = "internal error"
        else:
            problem = parse_problem(exc, message)
            if problem == TOO_MANY_HEADERS:  # (aiohttp's limit, this connection's: say it)
                problem = f"it has more than {self.max_headers} header lines"
            text = f"the request could not be parsed as HTTP/1.1: {problem}"
            log.info("unparsable request from %s: %s", request.remote, problem)
        resp = from_status(status, text).response()
        resp.force_close()
        return resp


TOO_MANY_HEADERS = "it has too many headers"
#: What a parser fault is about, by a word of aiohttp's (or llhttp's) description of it.
_FAULTS = (
    ("host", "the Host header is missing"),
    ("duplicate", "a header that may appear only once appears more than once"),
    ("too many headers", TOO_MANY_HEADERS),
    ("content-length", "the Content-Length header is malformed"),
    ("transfer-encoding", "the Transfer-Encoding header is malformed"),
    ("chunk", "the chunked body is malformed"),
    ("header", "a header line is malformed"),
    ("method", "the request line is malformed"),
    ("url", "the request line is malformed"),
    ("version", "the request line is malformed"),
    ("status line", "the request line is malformed"),
)


def parse_problem(exc: BaseException | None, message: str | None) -> str:
    """What was wrong with a request aiohttp could not parse, in a few fixed words. aiohttp's
    `message` and `exc` quote the raw request (header values, API keys among them): only the
    start of their description is looked at, and nothing of them is returned."""
    if isinstance(exc, http_exceptions.LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else None
        size = f"{limit} bytes" if limit is not None else "the limit"
        return f"a header or the request line is over {size}"
    if isinstance(exc, http_exceptions.BadHttpMethod) and (message or "").startswith("Received HTTPS"):
        return "it looks like HTTPS (TLS), but this port speaks plain HTTP"
    if isinstance(exc, http_exceptions.BadStatusLine | http_exceptions.InvalidURLError):
        return "the request line is malformed"
    if isinstance(exc, http_exceptions.InvalidHeader):
        return "a header line is malformed"
    if isinstance(exc, http_exceptions.ContentLengthError):
        return "the body is shorter than its Content-Length"
    about = (message or "").partition(":")[0].lower()
    if "content-length" in about and "transfer-encoding" in about:
        return "it has both a Content-Length and a Transfer-Encoding header"
    found = [(about.find(word), problem) for word, problem in _FAULTS if word in about]
    return min(found)[1] if found else "it is malformed"  # (the word said first: what it is about)


def expectation_failed() -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, "the Expect header is not supported: the only expectation "
                    "answered is 100-continue", param="Expect", status=417)


def expect_handler(max_body_bytes: int) -> Callable[[web.Request], Coroutine[Any, Any, web.StreamResponse | None]]:
    """aiohttp's answer to a request's `Expect` header, before any middleware runs (set on every
    route by `gateway.app`): `100-continue` is answered `100 Continue`, unless the body announced
    is over `max_body_bytes` (then 413 at once: the client need not send it) or its key is
    refused (401 or 403, as `gateway.auth.admit` says); any other expectation gets 417. Each
    refusal closes the connection (no body is read)."""

    def refuse(request: web.Request, error: ApiError) -> web.StreamResponse:
        if isinstance(request.protocol, GuardedHandler):
            request.protocol.close_after_response()
        resp = error.response()
        resp.force_close()
        return resp

    async def expect(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").strip().lower() != "100-continue":
            return refuse(request, expectation_failed())
        if request.content_length is not None and request.content_length > max_body_bytes:
            return refuse(request, too_large(max_body_bytes, declared=request.content_length))
        try:
            admit(request)  # (a client whose key is refused is told so before it sends its body)
        except ApiError as exc:
            return refuse(request, exc)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not begun
        return None

    return expect


def body_reader(body_timeout_s: float, max_body_bytes: int) -> Callable[[web.Request], Awaitable[None]]:
    """Reads each body within `body_timeout_s` into `request[BODY]`, decoded (aiohttp decodes it itself
    on connections that are not a `GuardedHandler`'s, as in tests that serve the app alone); the
    bodies being read at once within `BODIES_BUDGET`."""
    budget = BodiesBudget(max(BODIES_BUDGET, max_body_bytes))

    async def read(request: web.Request) -> bytes:
        """The body, what of it passes `FREE_BODY_BYTES` counted against `budget` as it comes
        (aiohttp's `read()` would hold it all uncounted)."""
        taken = 0
        body = bytearray()
        try:
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > max_body_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_body_bytes, actual_size=len(body))
                if len(body) - FREE_BODY_BYTES > taken:
                    budget.take(len(body) - FREE_BODY_BYTES - taken)
                    taken = len(body) - FREE_BODY_BYTES
            return bytes(body)
        finally:
            budget.held -= taken

    async def read_body(request: web.Request) -> None:
        guarded = request.protocol if isinstance(request.protocol, GuardedHandler) else None
        body = b""
        if request.body_exists:
            coding = transfer_coding(request.headers.get("Transfer-Encoding", ""))
            if coding is not None:
                if guarded is not None:
                    guarded.close_after_response()  # the body is not read
                raise invalid(f"Transfer-Encoding {quoted(coding)} is not supported: send the body chunked or "
                              "with a Content-Length, its compression in Content-Encoding", param="Transfer-Encoding")
            if request.content_length is not None and request.content_length > max_body_bytes:
                if guarded is not None:
                    guarded.close_after_response()  # the body is not read
                raise too_large(max_body_bytes, declared=request.content_length)
            if guarded is not None:
                guarded.body_refused(request)
            try:
                if request.content.is_eof():  # all of it came with the head: no wait, no timer
                    body = await read(request)
                else:
                    async with asyncio.timeout(body_timeout_s):
                        body = await read(request)  # at most max_body_bytes
            except ApiError:  # (over the budget: the rest of it is not read)
                if guarded is not None:
                    guarded.close_after_response()
                raise
            except web.HTTPRequestEntityTooLarge:  # (a body of no declared length, counted as it came)
                if guarded is not None:
                    guarded.close_after_response()  # the rest of it is not read
                raise too_large(max_body_bytes, sent=True) from None
            except ChunksTooSmall:
                raise invalid(f"the request body came in chunks too small: more than {FREE_CHUNKS} of them must "
                              f"average at least {MIN_CHUNK_BYTES} bytes; send it in larger chunks, or with a "
                              "Content-Length") from None
            except TrailersTooLarge:
                raise invalid(f"the request's trailers (the header lines after its chunked body) are over "
                              f"{MAX_HEAD_BYTES // 1024} KiB") from None
            except TimeoutError:
                if guarded is not None:
                    guarded.close_after_response()
                raise ApiError(ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within "
                               f"{body_timeout_s:g} s (runtime.body_timeout_ms)") from None
            if guarded is not None:
                # (header lines of one name make one list, as HTTP says: the first alone hid the rest)
                body = decode(body, ", ".join(request.headers.getall("Content-Encoding", ())), max_body_bytes)
        request[BODY] = body

    return read_body


def transfer_coding(header: str) -> str | None:
    """The first coding of a `Transfer-Encoding` header other than `chunked` and the obsolete
    `identity`, or None: aiohttp ignores the others (a gzipped body would be read as it came)."""
    codings = (c.strip().lower() for c in header.split(","))
    return next((c for c in codings if c not in ("", "chunked", "identity")), None)


def request_started(request: web.Request) -> None:
    """The request is being handled: its connection's head deadline stops (`GuardedHandler`)."""
    if isinstance(request.protocol, GuardedHandler):
        request.protocol.request_started()


def forget_body(request: web.Request) -> None:
    """The request's body was parsed and is no longer needed: drop every copy, so a caller waiting
    for its run holds none of it (a prompt can be megabytes). aiohttp keeps what `read()`
    returned in a private attribute of its own."""
    request.pop(BODY, None)
    if getattr(request, "_read_bytes", None) is not None:
        request._read_bytes = None


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are served by `GuardedHandler`s sharing one `ConnectionGuard`."""

    __slots__ = ("_host", "_port", "_guard", "_options")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, *,
                 backlog: int = 1024, **handler_options: Any) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard
        self._options = handler_options

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def handler() -> GuardedHandler:
            return GuardedHandler(server, self._guard, loop=loop, **self._options)

        self._server = await loop.create_server(handler, self._host, self._port, backlog=self._backlog)
