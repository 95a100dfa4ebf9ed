"""Sending a run to a provider: a POST that a broken pooled connection does not fail.

A worker keeps its connections to a provider open between runs. A server may close one while it
sits in the pool, or just after it gave the connection back (an idle timeout racing the next
request; llama-cpp-python's server says keep-alive and closes the connection of a stream it ended
before any event), and a run sent on it fails before any byte of an answer: a reset, or the server
closing it. The server never took that run, and a run changes nothing on a server (RFC 9112,
9.3.1.1: a request that is idempotent in effect may be sent again), so it goes again at once, on
another connection, with no strike against a provider that did nothing wrong. A request that fails
so on a new connection is the provider's failure, as before. (aiohttp itself sends again only
idempotent methods; its tracing, which would say where a request went, cost ~18 µs a request
here, the connector says it for nothing.)
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

#: how many times one run is sent before its failure counts: each failed try closes the pooled
#: connection it took, so a pool with that many broken ones still ends on a new connection
MAX_SENDS = 3


#: whether the request being sent in this task went out on a connection taken from the pool
_pooled: ContextVar[bool] = ContextVar("iop_pooled", default=False)


class PoolConnector(aiohttp.TCPConnector):
    """aiohttp's connector, which tells `post` whether a request went out on a connection it had
    used before (one from the pool) or on a new one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()

    async def connect(self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout) -> Connection:
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            _pooled.set(protocol in self._used)
            self._used.add(protocol)
        return conn


def broke_before_answer(exc: BaseException) -> bool:
    """The request just sent went out on a pooled connection, closed or reset before any answer."""
    return _pooled.get() and isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


@asynccontextmanager
async def post(session: aiohttp.ClientSession, url: str, **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
    """`session.post(url, **kwargs)`, sent again (at most `MAX_SENDS` times in all) while it breaks
    before any answer on a connection taken from the pool (the session's connector must be a
    `PoolConnector`). The response is released at the end."""
    for tries_left in range(MAX_SENDS - 1, -1, -1):
        _pooled.set(False)
        try:
            resp = await session.post(url, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if tries_left and broke_before_answer(exc):
                continue
            raise
        break
    async with resp:
        yield resp


def connection_of(resp: aiohttp.ClientResponse) -> ResponseHandler | None:
    """The connection a response came on (kept before the body ends: at its end aiohttp gives the
    connection back to the pool)."""
    return resp.connection.protocol if resp.connection is not None else None


def drop(connection: ResponseHandler | None) -> None:
    """Close a connection, back in the pool or not, so that no other run is sent on it: a server
    that ended a stream short of its end may have left it broken. llama-cpp-python's, ending a
    stream before any event, says keep-alive and closes the connection just after, and a request
    that came in between gets a head and a body cut off (seen 1 to 3 times in 12 tries)."""
    if connection is not None and connection.is_connected():
        connection.close()
