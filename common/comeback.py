"""Redis coming back after an outage, watched once per client.

A loop whose Redis call failed waits out a backoff (doubling up to 1-2 s) before it tries again,
so after an outage each loop of each process resumed up to its cap late: after 10 s without
Redis, a run queued 0.06 s after it was back completed 1.6 s later, its scheduler's and worker's
loops still pausing. `Comeback.pause` cuts a loop's pause short when Redis answers a PING it had
refused: one watch per client, PINGing 10-50 ms apart while Redis is away, whatever the number of
loops. (While Redis is down, a process spends 1-3% of a core on them, against 0.4-0.5% before. A
refused connection is not tried again by the client's own retries: 197-198 PINGs refused in 10 s,
1.1% of a core, with and without them.) A PING answered at once (Redis was there, and
the loop failed for another reason: a READONLY replica, a slow command's timeout) cuts no pause
short, so no loop spins.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis

from common.redisconn import REDIS_REFUSED, Backoff

#: The pauses between PINGs while Redis is away: doubling from the first up to the cap.
FIRST_S = 0.01
CAP_S = 0.05


class Comeback:
    def __init__(self, redis: Redis, first_s: float = FIRST_S, cap_s: float = CAP_S) -> None:
        self.redis = redis
        self.first_s = first_s
        self.cap_s = cap_s
        #: the PINGs refused by the current (or last) watch
        self.refused = 0
        self._task: asyncio.Task[None] | None = None
        self._back = asyncio.Event()
        self._answered: list[Callable[[bool], None]] = []
        self._closed = False

    def when_answered(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(was_away)` each time a watch ends with Redis answering a PING; `was_away`:
        it had refused one first."""
        self._answered.append(callback)

    def watch(self) -> asyncio.Event:
        """Redis may be away: watch for it (unless a watch is on already). The event returned is
        set when it answers a PING after refusing one."""
        if self._closed:  # (an event that may be set would end every pause at once: a loop would spin)
            return asyncio.Event()
        if self._task is None or self._task.done():
            self._back = asyncio.Event()
            self.refused = 0
            self._task = asyncio.get_running_loop().create_task(self._run(self._back), name="iop-comeback")
        return self._back

    async def pause(self, backoff: Backoff) -> None:
        """`backoff`'s next pause, cut short when Redis comes back (`watch`)."""
        back = self.watch()
        try:  # asyncio.timeout, not wait_for, which on Python 3.11 may drop a cancel
            async with asyncio.timeout(backoff.take()):
                await back.wait()
        except TimeoutError:
            pass

    async def _run(self, back: asyncio.Event) -> None:
        pause = Backoff(first=self.first_s, cap=self.cap_s)
        while True:
            await pause.pause()
            try:
                await self.redis.ping()
            except REDIS_REFUSED:  # (a MISCONF Redis refuses even a PING)
                self.refused += 1
                continue
            if self.refused:
                back.set()
            for callback in self._answered:
                callback(self.refused > 0)
            return

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def pause_on(comeback: Comeback | None, backoff: Backoff) -> None:
    """`backoff`'s next pause, cut short by `comeback` when there is one (`Comeback.pause`)."""
    await (backoff.pause() if comeback is None else comeback.pause(backoff))
