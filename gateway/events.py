"""One event reader per gateway process: every caller waiting for a run is served by it.

A run's events live in its own stream (`iop:events:{run}`). Each script that adds one also
writes the run's id to the inbox of every gateway that follows the run (`iop:inbox:{gateway}`,
the record's `watchers`). A gateway runs two tasks over a fixed two Redis connections, however
many callers wait:

- the **listener** blocks on the gateway's inbox and marks the runs it names as due;
- the **reader** reads the due runs' new events, all in one pipeline (`XRANGE` after the last
  event each caller got), and hands each event to the callers of that run, in order.

Nothing is lost or delivered twice: the run's own stream is the source of every event, and each
caller (a `Follower`) gets only the events after the last one it got. An inbox entry that goes
missing (Redis restarted, or the inbox was trimmed) only delays a caller: every `SWEEP_S` all
followed runs are read again, and after a Redis outage at once. A run whose record is gone
(Redis lost it) gets a `failed` event saying so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.codec import decode_event
from common.redisconn import REDIS_DOWN, Backoff
from common.scripts import Scripts
from common.wire import ErrorCode, ErrorInfo, EventType

log = logging.getLogger("iop.gateway")

#: How long the listener blocks on the inbox before it looks around.
LISTEN_BLOCK_MS = 1_000
#: Every this often, all followed runs are read whether their gateway heard of them or not.
SWEEP_S = 2.0
#: Events read from one run's stream per round (more come in the next round at once).
READ_COUNT = 512
TERMINAL = (EventType.COMPLETED, EventType.FAILED)


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    type: str
    data: dict[str, Any]


def new_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Follower:
    """One caller waiting for the events of one run, after `last_id`."""

    def __init__(self, run_id: str, last_id: str) -> None:
        self.run_id = run_id
        self.last_id = last_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ended = False

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        if timeout is None:
            return await self.queue.get()
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None

    def give(self, event: Event) -> None:
        if self.ended:
            return
        self.queue.put_nowait(event)
        if event.type in TERMINAL:
            self.ended = True


def _after(entry_id: str) -> str:
    return "-" if entry_id in ("0", "0-0", "") else f"({entry_id}"


class EventHub:
    def __init__(self, redis: Redis, gateway_id: str | None = None) -> None:
        self.redis = redis
        self.gateway_id = gateway_id or new_gateway_id()
        self.inbox = keys.gateway_inbox(self.gateway_id)
        self.scripts = Scripts(redis)
        self.followers: dict[str, set[Follower]] = {}
        self.due: set[str] = set()
        self.wake = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ callers
    @asynccontextmanager
    async def follow(self, run_id: str, last_id: str = "0", *, watch: bool = False) -> AsyncIterator[Follower]:
        """Follow a run's events after `last_id`. `watch`: the run may have been started by
        another gateway, so this one joins its watchers first."""
        self._start()
        if watch:
            await self.scripts.call("watch", [keys.run_record(run_id)], [self.gateway_id])
        follower = Follower(run_id, last_id)
        self.followers.setdefault(run_id, set()).add(follower)
        self._mark(run_id)  # what is there already
        try:
            yield follower
        finally:
            group = self.followers.get(run_id)
            if group is not None:
                group.discard(follower)
                if not group:
                    del self.followers[run_id]

    def _mark(self, run_id: str) -> None:
        self.due.add(run_id)
        self.wake.set()

    # ------------------------------------------------------------------ the two tasks
    def _start(self) -> None:
        if not self.tasks:
            self.tasks = [asyncio.create_task(self._listen(), name="iop-inbox"),
                          asyncio.create_task(self._read(), name="iop-events")]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    async def _listen(self) -> None:
        last = "$"
        backoff = Backoff(cap=1.0)
        while True:
            try:
                reply = await self.redis.xread({self.inbox: last}, count=4096, block=LISTEN_BLOCK_MS)
                backoff.reset()
            except REDIS_DOWN as exc:
                log.warning("gateway inbox: Redis unavailable (%s); retrying", exc)
                await backoff.pause()
                self.due.update(self.followers)  # whatever was missed meanwhile is read again
                self.wake.set()
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    run_id = fields.get(b"run", b"").decode()
                    if run_id in self.followers:
                        self.due.add(run_id)
            if self.due:
                self.wake.set()

    async def _read(self) -> None:
        backoff = Backoff(cap=1.0)
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            try:
                async with asyncio.timeout(max(0.0, next_sweep - time.monotonic())):
                    await self.wake.wait()
            except TimeoutError:
                pass
            self.wake.clear()
            sweep = time.monotonic() >= next_sweep
            if sweep:
                self.due.update(self.followers)
                next_sweep = time.monotonic() + SWEEP_S
            due, self.due = [r for r in self.due if r in self.followers], set()
            if not due:
                continue
            try:
                await self._read_runs(due, check_lost=sweep)
                backoff.reset()
            except REDIS_DOWN as exc:
                log.warning("gateway events: Redis unavailable (%s); retrying", exc)
                self.due.update(due)
                self.wake.set()
                await backoff.pause()

    async def _read_runs(self, run_ids: list[str], check_lost: bool) -> None:
        """Read the new events of `run_ids` (one pipeline) and hand them out."""
        starts = {r: min(f.last_id for f in self.followers[r]) for r in run_ids}
        pipe = self.redis.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.xrange(keys.run_events(run_id), _after(starts[run_id]), "+", count=READ_COUNT)
            if check_lost:
                pipe.exists(keys.run_record(run_id))
        replies = iter(await pipe.execute())
        for run_id in run_ids:
            entries = next(replies)
            exists = next(replies) if check_lost else 1
            followers = self.followers.get(run_id, set())
            for entry_id, fields in entries:
                event = Event(*decode_event(entry_id, fields))
                for f in followers:
                    if _newer(event.id, f.last_id):
                        f.last_id = event.id
                        f.give(event)
            if len(entries) == READ_COUNT:
                self._mark(run_id)  # more to read
            elif not entries and not exists:
                # Redis lost the run (a restart without persistence, or a failover): say so.
                info = ErrorInfo(ErrorCode.WORKER_LOST, "the run was lost: Redis lost its record "
                                                        "(a restart without persistence, or a failover)")
                for f in followers:
                    f.give(Event("lost", EventType.FAILED.value, info.to_wire()))


def _newer(entry_id: str, than: str) -> bool:
    return _key(entry_id) > _key(than)


def _key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0
