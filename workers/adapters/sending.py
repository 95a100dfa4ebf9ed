"""Sending a run to a provider: a POST that a broken pooled connection does not fail.

A worker keeps its connections to a provider open between runs. A server may close one while it
sits in the pool, or just after it gave the connection back (an idle timeout racing the next
request; llama-cpp-python's server says keep-alive and closes the connection of a stream it ended
before any event), and a run sent on it fails at once, before its answer's head: a reset, or the
server closing it. The server never worked on that run, so it goes again at once on another
connection, with no strike against a provider that did nothing wrong. Only then: a run that breaks
so on a new connection, after the server closed it with part of a head sent, or later than
`RESEND_WITHIN_S` after it went out (the server may have worked on it: a crash, a proxy's
timeout) is the provider's failure, as before, not sent again here. (A reset says nothing of what
came before it: one within `RESEND_WITHIN_S` is taken for the race.) aiohttp itself sends again
only idempotent methods; its tracing, which would say where a request went, cost ~18 µs a request
here: the connector says it for nothing.

A connection whose stream ended short of its end is not used for another run (`drop`): the
connector closes it when it would hand it out. So is one on which bytes came while it sat in the
pool (a server or proxy that sent an answer twice, or a late one): aiohttp reads them as the
answer to the next request sent on it, which would hand one run's answer to another run's caller
(or, the start of an answer only, fail that run as "not valid HTTP"). The connector makes its
connections' protocols `_Watched`, which note bytes that come while they are in the pool
(aiohttp's `_factory` and `_release`, which it has no public hook for). Bytes that come a moment
later, once the next request went out on the connection, cannot be told from its answer: so once
a server sent any, its connections are not kept between runs any more (a late copy of an answer
went to the next run's caller in 10 to 19 runs of 20 sent right after each other).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

log = logging.getLogger("iop.worker")

#: how many times one run is sent before its failure counts: each failed try closes the pooled
#: connection it took, so a pool with that many broken ones still ends on a new connection
MAX_SENDS = 3
#: how soon after it went out a run's break may be the race with an idle close: the server's
#: close or reset of a connection it no longer reads arrives within a round trip (a server that
#: took the run and broke later may have worked on it: not sent again here)
RESEND_WITHIN_S = 0.25

#: the connection the request being sent in this task went out on, and whether it came from the
#: pool (`PoolConnector.connect` sets them; `post` clears them before each send)
_sent_on: ContextVar[tuple[ResponseHandler | None, bool]] = ContextVar("iop_sent_on", default=(None, False))


class _Watched(ResponseHandler):
    """aiohttp's protocol of a connection, which notes bytes that came while it was in the pool."""

    idle = False
    stray = False

    def data_received(self, data: bytes) -> None:
        if data and self.idle:
            self.stray = True
        super().data_received(data)


def _watched(loop: asyncio.AbstractEventLoop) -> ResponseHandler:
    return _Watched(loop=loop)


class PoolConnector(aiohttp.TCPConnector):
    """aiohttp's connector, which says whether a request went out on a connection it had used
    before (one from the pool) or on a new one, and never hands out one that was `drop`ped, nor
    one on which bytes no request asked for came while it sat in the pool."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(_watched, self._loop)
        self._used: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()
        self._dropped: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()
        #: the servers that sent bytes no request asked for: their connections are not pooled
        self._unpooled: set[ConnectionKey] = set()

    async def connect(self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout) -> Connection:
        while True:
            conn = await super().connect(req, traces, timeout)
            protocol = conn.protocol
            if getattr(protocol, "stray", False) and req.connection_key not in self._unpooled:
                self._unpooled.add(req.connection_key)
                log.warning("the server at %s:%s sent bytes on a connection no request was waiting on (an answer "
                            "twice, or a late one); its connections are no longer kept between runs",
                            req.connection_key.host, req.connection_key.port)
            if protocol is None or not (protocol in self._dropped or protocol.should_close
                                        or getattr(protocol, "stray", False)):
                break
            conn.close()  # (closes it: the pool never hands it out again)
        _sent_on.set((protocol, protocol is not None and protocol in self._used))
        if protocol is not None:
            self._used.add(protocol)
            if isinstance(protocol, _Watched):
                protocol.idle = False
        return conn

    def _release(self, key: ConnectionKey, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        if isinstance(protocol, _Watched):
            protocol.idle = True  # (from now, in the pool: whatever comes on it is stray)
        super()._release(key, protocol, should_close=should_close or key in self._unpooled)

    def drop(self, protocol: ResponseHandler) -> None:
        """Never hand `protocol` out again; it is closed when next taken from the pool (a run that
        took it meanwhile goes on undisturbed)."""
        self._dropped.add(protocol)


def _resendable(exc: BaseException, pooled: bool, took_s: float) -> bool:
    """A run that went out on a pooled connection and broke at once, before any of an answer."""
    if not pooled or took_s > RESEND_WITHIN_S or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # (else it holds the part of an answer that came)
    return isinstance(exc, aiohttp.ClientOSError)


class NotRead(aiohttp.SocketTimeoutError):
    """The server read no more of a request's body for the read timeout (its text says so)."""


class _Sending:
    """A request body too big for the kernel to take at once, sent in pieces, each of which must
    go out within `wait_s` of the one before: aiohttp starts its read timeout (`sock_read`) only
    once the body is sent, so a server that reads none of it (hung, or hostile) held the run until
    its execution timeout (a 6 MB prompt: 600 s by default, instead of `read_timeout_ms`)."""

    def __init__(self, body: bytes, wait_s: float, sent: Callable[[], None] | None = None) -> None:
        self.body = body
        self.wait_s = wait_s
        #: called once the last piece went out
        self.sent = sent
        #: the deadline of the piece going out (None once the post has returned, or failed)
        self.deadline: asyncio.Timeout | None = None

    async def pieces(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        for start in range(0, len(self.body), WHOLE_BODY_BYTES):
            if self.deadline is not None:
                self.deadline.reschedule(loop.time() + self.wait_s)
            yield self.body[start:start + WHOLE_BODY_BYTES]
        if self.deadline is not None:  # (all out: the read timeout takes over)
            self.deadline.reschedule(None)
        if self.sent is not None:
            self.sent()

    async def post(self, session: aiohttp.ClientSession, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
        headers = {**(kwargs.pop("headers", None) or {}), "Content-Length": str(len(self.body))}
        try:
            async with asyncio.timeout(None) as self.deadline:
                return await session.post(url, data=self.pieces(), headers=headers, **kwargs)
        except TimeoutError:
            if self.deadline is not None and self.deadline.expired():
                raise NotRead(f"did not read the request for {self.wait_s * 1000:.0f} ms") from None
            raise
        finally:
            self.deadline = None


class NoHead(aiohttp.SocketTimeoutError):
    """The server began no answer within the wait for its head (`post`'s `head_wait_s`, longer than
    the read timeout: a server that loads the model first; its text says so)."""


#: a request body the kernel takes at once, in one write; a bigger one goes out in pieces of this
#: size, watched (`_Sending`)
WHOLE_BODY_BYTES = 64 * 1024


def _paced(kwargs: dict[str, Any], wait_s: float | None, sent: Callable[[], None] | None) -> _Sending | None:
    """How a body too big for the kernel to take at once goes out (`_Sending`, each piece within
    `wait_s`), or None."""
    data = kwargs.get("data")
    if not isinstance(data, bytes) or len(data) <= WHOLE_BODY_BYTES or not wait_s:
        return None
    return _Sending(data, wait_s, sent)


#: a `head_wait_s` without end: the answer's head is waited for until the caller of `post` stops
#: waiting (`workers.adapters.silence`)
NO_END = math.inf


@functools.lru_cache(maxsize=256)
def _head_waited(timeout: aiohttp.ClientTimeout | None, head_wait_s: float | None) -> aiohttp.ClientTimeout | None:
    """`timeout` with `head_wait_s` as its `sock_read` (aiohttp's wait for the head is that read
    timeout too; `NO_END`: none), when that is longer; else None (the timeout as it is). (Made once
    for each pair: a provider's timeout is one object.)"""
    if timeout is None or not timeout.sock_read or head_wait_s is None or head_wait_s <= timeout.sock_read:
        return None
    return aiohttp.ClientTimeout(total=timeout.total, connect=timeout.connect,
                                 sock_read=None if head_wait_s == NO_END else head_wait_s,
                                 sock_connect=timeout.sock_connect, ceil_threshold=timeout.ceil_threshold)


def _read_timeout_again(resp: aiohttp.ClientResponse, read_s: float) -> None:
    """The read timeout of the body of `resp`, whose head came within a longer wait, back to `read_s`."""
    protocol = resp.connection.protocol if resp.connection is not None else None
    if protocol is not None:
        protocol.read_timeout = read_s
        protocol.start_timeout()  # (the wait running now, set with the head's length, starts again with it)


@asynccontextmanager
async def post(session: aiohttp.ClientSession, url: str, head_wait_s: float | None = None,
               sent: Callable[[], None] | None = None, **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
    """`session.post(url, **kwargs)`, sent again (at most `MAX_SENDS` times in all) while it breaks
    at once, before any answer, on a connection taken from the pool (the session's connector must
    be a `PoolConnector`). The response is released at the end. A body that is `bytes` over
    `WHOLE_BODY_BYTES` must be read by the server at the pace of the timeout's `sock_read`, else
    `NotRead` (a `SocketTimeoutError`). `head_wait_s`: how long the answer's head may take when
    that is longer than the timeout's `sock_read` (Ollama, Lemonade and a llama-server router load
    the model before they answer anything), else `NoHead`; the body's reads then have `sock_read` again.
    `sent`: called when the request is out (a body sent in pieces: once its last piece went)."""
    timeout = kwargs.get("timeout")
    read_s = timeout.sock_read if isinstance(timeout, aiohttp.ClientTimeout) else None
    longer = _head_waited(timeout if isinstance(timeout, aiohttp.ClientTimeout) else None, head_wait_s)
    if longer is not None:
        kwargs = {**kwargs, "timeout": longer}
    for tries_left in range(MAX_SENDS - 1, -1, -1):
        _sent_on.set((None, False))
        began = time.monotonic()
        sending = _paced(kwargs, read_s, sent)
        if sending is None and sent is not None:
            sent()
        try:
            resp = await (session.post(url, **kwargs) if sending is None else
                          sending.post(session, url, **{k: v for k, v in kwargs.items() if k != "data"}))
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if tries_left and _resendable(exc, _sent_on.get()[1], time.monotonic() - began):
                continue
            raise
        except aiohttp.SocketTimeoutError as exc:
            if longer is None or isinstance(exc, NotRead):
                raise
            assert head_wait_s is not None
            raise NoHead(f"began no answer within {head_wait_s * 1000:.0f} ms (its read_timeout_ms and "
                         "load_timeout_ms: a model it loads first may take longer)") from None
        break
    if longer is not None and read_s:
        _read_timeout_again(resp, read_s)
    async with resp:
        yield resp


def sent_on() -> ResponseHandler | None:
    """The connection the request `post` just sent in this task went out on (`drop` it later: by
    the end of the body aiohttp has given it back to the pool)."""
    return _sent_on.get()[0]


def drop(session: aiohttp.ClientSession, connection: ResponseHandler | None) -> None:
    """No other run is sent on `connection`: a server that ended a stream short of its end may
    have left it broken. llama-cpp-python's, ending a stream before any event, says keep-alive
    and closes the connection just after, and a run sent on it meanwhile got a reset, or a head
    and a body cut off (1 to 3 times in 12 tries)."""
    connector = session.connector
    if connection is not None and isinstance(connector, PoolConnector):
        connector.drop(connection)
