"""One event reader per gateway process: every caller waiting for a run is served by it.

A run's events live in its own stream (`iop:events:{run}`). Each script that adds one also
writes a copy to the inbox of every gateway that follows the run (`iop:inbox:{gateway}`, the
record's `watchers`), in the same atomic step, so a gateway's inbox holds the events of its runs
in the order they happened. Each gateway runs one **listener** blocked on its inbox, over one
Redis connection however many callers wait; it hands each event to the callers of its run. The
gateway that queued a completion watches as output-only (`{gateway}~`, `keys.OUTPUT_ONLY`): its
inbox gets `delta`, `completed` and `failed` only. Following through the runs API (`watch=True`)
makes it a watcher of every event.

Nothing is lost or delivered twice. Each caller (a `Follower`) gets only events newer than the
last one it got. A caller that starts following first reads what its run already has from the
run's own stream (`XRANGE` after its last event id), while the events the listener brings
meanwhile wait in its buffer. A completion's own caller skips that read: it follows before its
run is queued, so the run's every event comes through the inbox. If the inbox could have lost
entries (a Redis restart or reconnect, or the listener falling so far behind that the inbox was
trimmed past it), every followed run is read again from its own stream. A run whose record is
gone (Redis lost it) gets a `failed` event saying so; that is checked after a reconnect and, for
runs that heard nothing for a while, every `QUIET_CHECK_S`.

A caller that reads slower than its run writes (or not at all) holds at most `HELD_BYTES` of
events in the gateway: past that, the listener's events for it are dropped, and once it has taken
what it holds it reads on from the run's own stream (`Follower.behind`), a page at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.codec import decode_event, entry_key, unpack
from common.comeback import Comeback
from common.redisconn import REDIS_UNUSABLE, Backoff
from common.redisline import StreamEntries, new_line_of, stream_reply
from common.scripts import Scripts
from common.wire import ErrorCode, ErrorInfo, EventType
from common.wrongtype import delete_wrong_types, is_wrongtype, reply_or
from gateway.deadlines import Deadlines

log = logging.getLogger("iop.gateway")

#: How long the listener blocks on the inbox before it looks around.
LISTEN_BLOCK_MS = 1_000
#: Inbox entries read at once (each may be a batch of a run's output: a reply of this many is held,
#: and unpacked, at once).
LISTEN_COUNT = 256
#: Runs that heard nothing for this long are read again from their own stream, and their record
#: checked (did Redis lose it?).
QUIET_CHECK_S = 10.0
#: How often the listener trims from its inbox what it has handed out (each entry is a copy of an
#: event its run's stream keeps: the inbox holds about this long of a gateway's events, not the
#: `INBOX_MAXLEN` last ones, which may be whole answers).
TRIM_EVERY_S = 1.0
#: Events read from one run's stream per read (more come in the next read at once, unless the
#: caller is `behind`). One caller's read starts at `FIRST_COUNT` and doubles page by page: a
#: slow reader that can take only a few large events does not have many read and unpacked.
READ_COUNT = 64
FIRST_COUNT = 8
#: The share of the gateway's Redis connections (`runtime.redis_max_connections`) that reads of a
#: run's own stream for one caller may hold at once: a runs-API follower's first read, a slow
#: reader's read on, a replay's page. A crowd of followers of large runs takes turns in the rest,
#: not every connection a new request needs (an audit: 1,500 followers of a 1 MB run held all 64
#: and an unrelated completion waited 8 s).
READS_SHARE = 0.5
#: A caller's events held in the gateway for it, as stored (packed) bytes, with those it is still
#: writing: past this the rest wait in the run's own stream until it has taken these. (The first
#: held event is always taken, so a single larger one still gets through.) Unpacked, they take
#: about six times as much memory, and the SSE text written once more.
HELD_BYTES = 1 << 16
#: A caller's wait for an event before its keep-alive goes out, unless the hub is told otherwise
#: (`runtime.stream_keepalive_ms`'s default), and the shortest period of the sweeper of those waits
KEEP_ALIVE_S = 10.0
MIN_KEEP_ALIVE_SWEEP_S = 0.01
TERMINAL = (EventType.COMPLETED, EventType.FAILED)


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    type: str
    data: dict[str, Any]
    #: its data's size as stored (packed): what holding it costs, `HELD_BYTES`
    size: int = 0


def stored_event(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Event:
    """An event as read from a run's stream."""
    return Event(*decode_event(entry_id, fields), len(fields.get(b"data") or b""))


def new_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Follower:
    """One caller waiting for the events of one run, after `last_id`."""

    __slots__ = ("run_id", "last", "items", "waiter", "ended", "pending", "synced_at_start", "queueing", "heard_at",
                 "held", "writing", "behind", "hub", "had_output")

    def __init__(self, run_id: str, last_id: str, *, fresh: bool = False, hub: EventHub | None = None) -> None:
        """`fresh`: the run does not exist yet, so there is nothing to read first. `hub`: where it
        reads on from the run's stream once it fell behind (none: it never falls behind)."""
        self.run_id = run_id
        self.last = entry_key(last_id)
        #: events handed over and not yet taken, and the caller's wait for the next one (not an
        #: asyncio.Queue: its four deques cost ~3 KB a waiting caller)
        self.items: list[Event] = []
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        #: while its first read of the run's stream is out, what the listener brought meanwhile
        self.pending: list[Event] | None = None if fresh else []
        #: fresh: there is nothing to read from the run's stream first
        self.synced_at_start = fresh
        #: fresh, until its gateway has queued the run (`queued`): the run has no record yet, and
        #: none is missing (its queueing waits for a Redis that is coming back)
        self.queueing = fresh
        self.heard_at = time.monotonic()
        #: the size of `items` (`Event.size`), and of what the caller took and is still writing
        #: (`stream_response` sets it while its write waits for a slow reader)
        self.held = 0
        self.writing = 0
        #: `items` reached `HELD_BYTES`: what comes after them is read from the run's stream, not
        #: taken from the listener, once they are taken
        self.behind = False
        self.hub = hub
        #: it was handed output (a `delta`), or may have been before it resumed after `last_id`: a lost
        #: run is not "before output" to it
        self.had_output = self.last != (0, 0)

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        if not self.items and self.behind and self.hub is not None:
            began = time.monotonic()
            if not await self.hub._catch_up(self, timeout):
                return None  # (Redis is away: the caller's keep-alive goes out, and the read is tried again)
            if timeout is not None:  # (what the read took counts: keep-alives stay `timeout` apart)
                timeout = max(0.0, timeout - (time.monotonic() - began))
        if not self.items:
            if timeout is not None and timeout <= 0:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:  # (no timer to arm: the caller's deadline is the gateway's sweeper's)
                    await self.waiter
                elif self.hub is not None:  # (its hub's sweeper, not a timer: ~750 bytes a waiting caller)
                    # due a sweep early: the sweeper ends it by `timeout`, not up to a sweep after (a
                    # stream silent `stream_keepalive_ms` gets its keep-alive, as the config says)
                    sweeps = self.hub.keep_alives
                    with sweeps.within(max(0.0, timeout - sweeps.period_s)):
                        await self.waiter
                else:
                    async with asyncio.timeout(timeout):
                        await self.waiter
            except TimeoutError:
                return None
            finally:
                self.waiter = None
        event = self.items.pop(0)
        self.held -= event.size
        return event

    def take_ready(self) -> list[Event]:
        """The events handed over and not yet taken, all of them (none is waited for)."""
        items, self.items = self.items, []
        self.held = 0
        return items

    def offer(self, event: Event) -> None:
        """An event from the inbox: held while the first read is out, else handed over if new."""
        if self.pending is not None:
            self.pending.append(event)
        else:
            self.give(event)

    def give(self, event: Event) -> None:
        if self.ended:
            return
        if event.id != "lost":
            key = entry_key(event.id)
            if key <= self.last:
                return  # had it already
            if self.behind or ((self.items or self.writing) and self.held + self.writing + event.size > HELD_BYTES
                               and self.hub is not None):
                self.behind = True  # read from the run's stream once what is held is taken
                return
            self.last = key
        self.heard_at = time.monotonic()
        self.held += event.size
        self.items.append(event)
        if event.type == EventType.DELTA:
            self.had_output = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        if event.type in TERMINAL:
            self.ended = True

    def queued(self) -> None:
        """Its gateway queued the run: from now on a missing record means Redis lost it."""
        self.queueing = False

    def synced(self) -> None:
        """The first read is in: hand over what came meanwhile (each only if new)."""
        held, self.pending = self.pending or [], None
        for event in held:
            self.give(event)


class Following:
    """`EventHub.follow`'s block: the follower is known to the hub inside it, and only there. (A
    class, not a generator: a waiting caller holds less.)"""

    __slots__ = ("hub", "follower", "watch")

    def __init__(self, hub: EventHub, follower: Follower, watch: bool) -> None:
        self.hub = hub
        self.follower = follower
        self.watch = watch

    async def __aenter__(self) -> Follower:
        await self.hub._enter(self.follower, self.watch)
        return self.follower

    async def __aexit__(self, *exc: object) -> None:
        self.hub._leave(self.follower)


def _after(key: tuple[int, int]) -> str:
    return "-" if key == (0, 0) else f"({key[0]}-{key[1]}"


#: What the hub tells of the runs it found still queued in a quiet check: (run id, model id, its
#: entry id in the model's queue) of each.
Queued = list[tuple[str, str, str]]


class EventHub:
    def __init__(self, redis: Redis, gateway_id: str | None = None,
                 queued: Callable[[Queued], Awaitable[None]] | None = None,
                 keep_alive_s: float = KEEP_ALIVE_S) -> None:
        """`queued`: told of the followed runs found still waiting in their queue when they had
        heard nothing for `QUIET_CHECK_S` (`RunClient.stuck`). `keep_alive_s`: how long a caller
        waits for an event before its keep-alive goes out (`runtime.stream_keepalive_ms`): the
        waits of `Follower.next` end up to a tenth of it early, never late."""
        self.redis = redis
        #: the bounds of `Follower.next`'s waits: one sweeper, not a timer each waiting caller
        self.keep_alives = Deadlines(max(MIN_KEEP_ALIVE_SWEEP_S, keep_alive_s / 10))
        #: the watch for Redis answering again, which cuts the readers' pauses short
        self.comeback = Comeback(redis)
        self.queued = queued
        #: told of the followed runs found lost (their record gone: `RunClient.lost`)
        self.lost: Callable[[list[str]], Awaitable[None]] | None = None
        self.gateway_id = gateway_id or new_gateway_id()
        #: the inbox of a new gateway id is new too: the listener starts at its beginning
        self.new_inbox = gateway_id is None
        self.inbox = keys.gateway_inbox(self.gateway_id)
        self.scripts = Scripts(redis)
        #: turns for the reads of one caller's run (`READS_SHARE` of the pool)
        pool_size = getattr(redis.connection_pool, "max_connections", 2**31)
        self.reads = asyncio.Semaphore(max(1, int(pool_size * READS_SHARE)))
        #: the listener's own connection (`common.redisline`), when the client has lines
        self.listen_line = new_line_of(redis, "inbox")
        #: run id -> its followers (a list: a set costs a waiting caller ~200 bytes more)
        self.followers: dict[str, list[Follower]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.checked_at = 0.0
        #: set once the listener knows where in the inbox it starts
        self.listening = asyncio.Event()
        #: the last inbox entry the listener handed out, and trimmed the inbox up to (`_trim`)
        self.heard_to = self.trimmed_to = "0-0"
        self.trimmed_at = 0.0
        self.trim_refused = False

    # ------------------------------------------------------------------ callers
    def follow(self, run_id: str, last_id: str = "0", *, watch: bool = False, fresh: bool = False) -> Following:
        """Follow a run's events after `last_id` (`async with hub.follow(...) as follower`).
        `watch`: the run may have been started by another gateway, so this one joins its
        watchers first. `fresh`: the run is about to be queued by this gateway (which the
        `enqueue` script makes a watcher), so every event it will have comes through the inbox
        and there is nothing to read first."""
        return Following(self, Follower(run_id, last_id, fresh=fresh, hub=self), watch)

    async def _enter(self, follower: Follower, watch: bool) -> None:
        self._start()
        await self.listening.wait()  # the inbox's position is known: what comes after, it will hear
        self.followers.setdefault(follower.run_id, []).append(follower)
        try:
            if watch:
                await self.scripts.call("watch", [keys.run_record(follower.run_id)], [self.gateway_id])
            if not follower.synced_at_start:
                await self._catch_up(follower, None)
        except BaseException:
            self._leave(follower)
            raise

    def _leave(self, follower: Follower) -> None:
        group = self.followers.get(follower.run_id)
        if group is not None and follower in group:
            group.remove(follower)
            if not group:
                del self.followers[follower.run_id]

    async def _catch_up(self, follower: Follower, timeout: float | None) -> bool:
        """What the run has already (a follower's first read), or what came after what the follower
        held when it fell behind: read from its run's own stream (up to `HELD_BYTES`); then what the
        listener brought meanwhile. False when that took longer than `timeout` (Redis is away): the
        follower is still behind."""
        follower.behind = False
        if follower.pending is None:
            follower.pending = []
        backoff = Backoff(cap=1.0)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        await self._read_runs([follower.run_id], check_lost=False, only=follower)
                        break
                    except REDIS_UNUSABLE as exc:
                        log.warning("gateway events: Redis unavailable (%s); retrying", exc)
                        await self.comeback.pause(backoff)
        except TimeoutError:  # (what the listener brought meanwhile is read again with the rest)
            follower.pending = None
            follower.behind = True
            return False
        follower.synced()
        return True

    # ------------------------------------------------------------------ the listener
    def _start(self) -> None:
        if not self.tasks:
            start = "0-0" if self.new_inbox else None
            self.new_inbox = False
            if start is not None:
                self.listening.set()  # known without asking Redis (which may be away)
            self.tasks = [asyncio.create_task(self._listen(start), name="iop-inbox")]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        await self.keep_alives.close()
        await self.comeback.close()
        self.listening.clear()
        if self.listen_line is not None:
            await self.listen_line.close()

    async def _tail(self) -> str:
        """The inbox's last entry now (a follower's first read covers what came before it)."""
        backoff = Backoff(cap=1.0)
        while True:
            try:
                newest = await self.redis.xrevrange(self.inbox, "+", "-", count=1)
                return newest[0][0].decode() if newest else "0-0"
            except REDIS_UNUSABLE as exc:
                log.warning("gateway inbox: Redis unavailable (%s); retrying", exc)
                await self.comeback.pause(backoff)

    async def _listen(self, start: str | None) -> None:
        last = start or await self._tail()
        self.listening.set()
        backoff = Backoff(cap=1.0)
        resync = False
        connects = self.listen_line.connects if self.listen_line is not None else 0
        while True:
            try:
                if resync:
                    await self._read_runs(list(self.followers), check_lost=True)
                    resync = False
                entries = await self._read_inbox(last)
                if self.listen_line is not None and self.listen_line.connects != connects:
                    # Read on a connection made again (its retry hid the lost one: a failover, a
                    # restart): the new server may lack what was followed. Every run is read again.
                    connects = self.listen_line.connects
                    resync = resync or connects > 1
                if len(entries) == LISTEN_COUNT and await self._trimmed_past(last):
                    resync = True  # so far behind that entries went: read every run again
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    self._deliver(fields)
                self.heard_to = last
                if entries:
                    # The callers woken by these events answer before the listener blocks on the
                    # inbox again: the next read is not on their way.
                    await asyncio.sleep(0)
                await self._trim()
                await self._check_quiet()
                backoff.reset()
            except REDIS_UNUSABLE as exc:
                log.warning("gateway inbox: Redis unavailable (%s); retrying", exc)
                resync = True  # whatever came meanwhile is read from each run's stream
                await self.comeback.pause(backoff)  # (cut short when Redis answers again)
            except Exception as exc:  # a bug must not end the one reader every caller waits on
                # (an inbox of another type written by hand, `SET iop:inbox:{gateway} x`, holds no copy:
                # it goes, and the runs' own streams are read again; it failed every read for good)
                if not (is_wrongtype(exc) and await delete_wrong_types(self.redis, {self.inbox: "stream"}, log,
                                                                       "gateway inbox")):
                    log.exception("gateway inbox: the listener failed; it reads every followed run again")
                    await backoff.pause()
                resync = True

    async def _read_inbox(self, last: str) -> StreamEntries:
        """The inbox's entries after `last`, waiting up to LISTEN_BLOCK_MS for one."""
        if self.listen_line is None:
            reply = await self.redis.xread({self.inbox: last}, count=LISTEN_COUNT, block=LISTEN_BLOCK_MS)
        else:
            reply = stream_reply(await self.listen_line.execute(
                "XREAD", "COUNT", LISTEN_COUNT, "BLOCK", LISTEN_BLOCK_MS, "STREAMS", self.inbox, last,
                block_s=LISTEN_BLOCK_MS / 1000))
        return reply[0][1] if reply else []

    def _deliver(self, fields: dict[bytes, bytes]) -> None:
        run_id = fields.get(b"run", b"").decode()
        followers = self.followers.get(run_id)
        if not followers or all(f.behind for f in followers):  # (those read it from the run's stream)
            return
        raw = fields.get(b"data")
        data = unpack(raw) if raw else {}
        event = Event(fields.get(b"id", b"").decode(), fields.get(b"type", b"").decode(),
                      data if isinstance(data, dict) else {}, len(raw or b""))
        for follower in followers[:]:
            follower.offer(event)

    async def _trimmed_past(self, last: str) -> bool:
        info = await self.redis.xinfo_stream(self.inbox)
        first = info.get("first-entry")
        return first is not None and entry_key(first[0].decode()) > entry_key(last)

    async def _trim(self) -> None:
        """Take out of the inbox what the listener has handed out, every `TRIM_EVERY_S` (`MINID ~`:
        whole nodes of entries older than the last one read; nothing newer)."""
        now = time.monotonic()
        if self.heard_to == self.trimmed_to or now - self.trimmed_at < TRIM_EVERY_S:
            return
        self.trimmed_at, self.trimmed_to = now, self.heard_to
        try:
            if self.listen_line is None:
                await self.redis.xtrim(self.inbox, minid=self.heard_to, approximate=True)
            else:  # (the listener's own connection: free between its reads)
                await self.listen_line.execute("XTRIM", self.inbox, "MINID", "~", self.heard_to)
        except ResponseError as exc:  # (housekeeping: the listener goes on; the inbox's MAXLEN still bounds it)
            if not self.trim_refused:
                log.warning("gateway inbox: could not trim %s (%s); it is bounded by its length only", self.inbox, exc)
            self.trim_refused = True

    async def _check_quiet(self) -> None:
        now = time.monotonic()
        if now - self.checked_at < 1.0:
            return
        self.checked_at = now
        quiet = [r for r, fs in self.followers.items() if all(now - f.heard_at > QUIET_CHECK_S for f in fs)]
        if quiet:
            await self._read_runs(quiet, check_lost=True)
            for run_id in quiet:
                for f in self.followers.get(run_id, ()):
                    f.heard_at = now

    # ------------------------------------------------------------------ reading runs' streams
    async def _read_runs(self, run_ids: list[str], check_lost: bool, only: Follower | None = None) -> None:
        """Read the runs' new events from their own streams (one pipeline) and hand them out (to
        `only`, or to every follower of each run), a page after another until the end of each
        run's stream or until every follower it is read for is `behind`."""
        queued: Queued = []
        lost: list[str] = []
        wrong_events: dict[str, str] = {}
        count = FIRST_COUNT if only else READ_COUNT
        while run_ids := [r for r in run_ids if r in self.followers]:  # (those that still have followers)
            # (what is read is handed to the followers it was read for, from the first's position: one
            # that joins while the read is out reads for itself, from its own; handed this read, its
            # position jumped past what lay between, which its own read then skipped)
            read_for = {r: [only] if only else list(self.followers[r]) for r in run_ids}
            starts = {r: min(f.last for f in read_for[r]) for r in run_ids}
            pipe = self.redis.pipeline(transaction=False)
            for run_id in run_ids:
                pipe.xrange(keys.run_events(run_id), _after(starts[run_id]), "+", count=count)
                if check_lost:
                    pipe.hmget(keys.run_record(run_id), "state", "model", "entry")
            # (a read for every follower of these runs takes no turn: one connection, whatever their number)
            async with self.reads if only else contextlib.nullcontext():
                replies = iter(await pipe.execute(raise_on_error=False))
            more = []
            for run_id in run_ids:
                entries = reply_or(next(replies), None)
                if entries is None:
                    # (the run's events of another type, written by hand, hold no event: that run has
                    # none to read, and the key goes, its next event making it again; before, every
                    # read of the listener failed at it, no caller of the gateway hearing its run)
                    wrong_events[keys.run_events(run_id)] = "stream"
                    entries = []
                record = reply_or(next(replies), None) if check_lost else (b"", None, None)
                # (a record of another type, written by hand, holds no run: that run is lost, not every
                # check failed, and with it the listener's every read, for good)
                wrong = record is None
                state, model, entry = record or (None, None, None)
                exists = state is not None
                if state == b"queued" and model and entry:
                    queued.append((run_id, model.decode(), entry.decode()))
                still = self.followers.get(run_id, ())  # (of those, the ones that did not leave meanwhile)
                followers = [f for f in read_for[run_id] if f in still]
                for entry_id, fields in entries:
                    event = stored_event(entry_id, fields)
                    for f in followers:
                        f.give(event)
                if len(entries) == count and not all(f.behind for f in followers):
                    more.append(run_id)
                elif not entries and not exists and not any(f.queueing for f in followers):
                    # Redis lost the run (a restart without persistence, or a failover), or it expired
                    # before a slow reader took its end (the two look the same): say so. (A run still
                    # being queued has no record yet: its caller waits for the queueing's answer.)
                    info = ErrorInfo(ErrorCode.WORKER_LOST, (
                        f"the run was lost: its record in Redis ({keys.run_record(run_id)}) holds another type "
                        "than a run's (written by hand?)") if wrong else (
                        "the run was lost: Redis lost its record (a restart without persistence, or a failover), "
                        "or it expired (runtime.run_ttl_s) before its end was read"))
                    for f in followers:  # (before output as far as it knows)
                        data = {**info.to_wire(), "before_output": not f.had_output}
                        f.give(Event("lost", EventType.FAILED.value, data))
                    lost.append(run_id)
            run_ids, count = more, min(2 * count, READ_COUNT)
        if wrong_events:
            await delete_wrong_types(self.redis, wrong_events, log, "gateway events")
        if queued and self.queued is not None:
            await self.queued(queued)
        if lost and self.lost is not None:
            await self.lost(lost)
