"""Which connections the gateway keeps when they are more than `runtime.max_connections`.

Up to `max_connections` connections are served. At the limit, a new connection takes the place
of the connection that has been idle longest (kept alive, or connected, without sending a byte
of a request): that one is closed, so idle connections never lock out clients with requests.
Only when every served connection is busy (a request in progress or its head arriving) does a
new one go to one of `TRIAGE_SLOTS` extra slots, where it is read only as far as its request
line so that `GET /healthz` is still answered; any other request there gets 503. A triage slot
whose connection has sent nothing yet, or was already answered, is likewise given to a newer
connection. Only when all of those are busy too is a new connection answered 503 at once.

`ConnectionGuard` keeps the counts and the two longest-idle-first lists; the connections
(`gateway.connections.GuardedHandler`) tell it when they turn idle or busy.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from common.config import RuntimeConfig
from common.wire import ErrorCode
from gateway.errors import ApiError

log = logging.getLogger("iop.gateway")

#: Connections beyond `max_connections` that are read far enough to answer /healthz.
TRIAGE_SLOTS = 64
#: What the limit did is logged at most this often.
LOG_EVERY_S = 10.0


#: The most bytes of one request head (its line and headers). aiohttp's own bounds (a line of 8,190
#: bytes, 128 headers) let an unauthenticated client hold ~1 MB of head, ~1.9 MB of the gateway's
#: memory, on each of its connections; a real client's head is under 8 KiB.
MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_connections: int

    @classmethod
    def from_runtime(cls, rt: RuntimeConfig) -> ConnectionLimits:
        return cls(rt.header_timeout_ms / 1000, rt.body_timeout_ms / 1000, rt.idle_timeout_ms / 1000,
                   rt.max_connections)


class Slot(enum.Enum):
    SERVED = "served"  # one of max_connections
    TRIAGE = "triage"  # one of TRIAGE_SLOTS beyond it
    NONE = "none"  # answered 503 at once, or given up to a newer connection


class Evictable(Protocol):
    def evict(self) -> None:
        """Close this connection at once: its slot has been given to a newer one."""


class ConnectionGuard:
    """The open connections of one listening site: counts, and the idle ones longest-idle first."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.served = 0
        self.triaged = 0
        self._idle: dict[Slot, OrderedDict[Evictable, None]] = {Slot.SERVED: OrderedDict(),
                                                                  Slot.TRIAGE: OrderedDict()}
        #: connections closed by a limit since the start, by reason (`iop_gateway_connections_closed_total`)
        self.closed = {"refused": 0, "evicted": 0, "head_timeout": 0}
        self._refused = 0
        self._evicted = 0
        self._logged_at = -LOG_EVERY_S
        self._flush: asyncio.TimerHandle | None = None
        #: what a connection refused at the limit, a head that came too late or one too large is told
        #: (written raw, each with an `X-Request-Id` of its own: `busy_answer()` ...)
        self._busy = ApiError(
            ErrorCode.UNAVAILABLE,
            f"the gateway has {limits.max_connections} connections open and busy, its limit "
            "(runtime.max_connections); retry shortly", headers={"Retry-After": "1"})
        self._late_head = ApiError(
            ErrorCode.REQUEST_TIMEOUT,
            f"the request head did not arrive within {limits.header_timeout_s:g} s (runtime.header_timeout_ms)")
        self._large_head = ApiError(
            ErrorCode.INVALID_REQUEST, f"the request head is over {MAX_HEAD_BYTES // 1024} KiB")

    def busy_answer(self) -> bytes:
        return self._busy.raw_response()

    def late_head_answer(self) -> bytes:
        return self._late_head.raw_response()

    def large_head_answer(self) -> bytes:
        return self._large_head.raw_response()

    def admit(self) -> Slot:
        """The slot of a new connection. At a limit, the longest-idle holder of a slot is evicted
        and its slot handed over."""
        if self.served < self.limits.max_connections:
            self.served += 1
            return Slot.SERVED
        if self._evict_oldest(Slot.SERVED):
            return Slot.SERVED
        if self.triaged < TRIAGE_SLOTS:
            self.triaged += 1
            return Slot.TRIAGE
        if self._evict_oldest(Slot.TRIAGE):
            return Slot.TRIAGE
        self.refused()
        return Slot.NONE

    def _evict_oldest(self, slot: Slot) -> bool:
        if not self._idle[slot]:
            return False
        victim, _ = self._idle[slot].popitem(last=False)
        victim.evict()
        self._evicted += 1
        self.closed["evicted"] += 1
        self._report()
        return True

    def idle(self, conn: Evictable, slot: Slot) -> None:
        """`conn` holds `slot` and may give it up: nothing of a request is arriving or running."""
        if slot is not Slot.NONE:
            self._idle[slot][conn] = None

    def busy(self, conn: Evictable) -> None:
        for idle in self._idle.values():
            idle.pop(conn, None)

    def release(self, conn: Evictable, slot: Slot) -> None:
        """`conn` closed."""
        self.busy(conn)
        if slot is Slot.SERVED:
            self.served -= 1
        elif slot is Slot.TRIAGE:
            self.triaged -= 1

    def refused(self) -> None:
        """Count a 503."""
        self._refused += 1
        self.closed["refused"] += 1
        self._report()

    def head_timed_out(self) -> None:
        self.closed["head_timeout"] += 1

    def _report(self) -> None:
        """Log what the limit did: at once the first time, then at most every `LOG_EVERY_S`."""
        wait = self._logged_at + LOG_EVERY_S - time.monotonic()
        if wait > 0:
            if self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(wait, self._report_now)
            return
        self._report_now()

    def _report_now(self) -> None:
        self._flush = None
        if not (self._refused or self._evicted):
            return
        log.warning("connection limit reached (runtime.max_connections = %d): since the last report %d "
                    "connections answered 503, %d idle connections closed to make room; %d served, %d in triage",
                    self.limits.max_connections, self._refused, self._evicted, self.served, self.triaged)
        self._refused = self._evicted = 0
        self._logged_at = time.monotonic()
