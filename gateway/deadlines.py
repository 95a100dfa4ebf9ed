"""Deadlines of the requests in flight, kept by one sweeper instead of a timer each.

A caller waiting for its run is bounded by the run's longest possible life (`RunClient.
follow_deadline_s`: minutes). `asyncio.timeout` would give each waiting caller a timer of its own
(about 750 bytes under uvloop, made and cancelled per request); here a deadline is an entry in a
dict, and one task looks at all of them every `period_s`. A task past its deadline is cancelled,
and `within` turns that cancellation into `TimeoutError`, as `asyncio.timeout` does. A deadline
fires up to `period_s` late: fine for bounds of minutes, not for short timeouts.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

#: How often the sweeper looks (seconds): how late a deadline may fire.
PERIOD_S = 1.0


class Deadlines:
    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        #: task -> when it must be done (`time.monotonic()`)
        self._due: dict[asyncio.Task[object], float] = {}
        #: tasks the sweeper cancelled, until `within` has seen it
        self._expired: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def within(self, seconds: float) -> _Within:
        """Bound the current task's time in the block: TimeoutError once `seconds` have passed
        (give or take `period_s`), whatever the task was awaiting (a run's events, a write to a
        caller that stopped reading)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="iop-deadlines")
        return _Within(self, seconds)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            for task, due in list(self._due.items()):
                if due <= now and task not in self._expired:
                    self._expired.add(task)
                    task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None


class _Within:
    """`Deadlines.within`'s block (a class, not a generator: a waiting caller holds less)."""

    __slots__ = ("deadlines", "seconds", "task")

    def __init__(self, deadlines: Deadlines, seconds: float) -> None:
        self.deadlines = deadlines
        self.seconds = seconds
        self.task: asyncio.Task[object] | None = None

    def __enter__(self) -> None:
        self.task = task = asyncio.current_task()
        assert task is not None
        self.deadlines._due[task] = time.monotonic() + self.seconds

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        task, d = self.task, self.deadlines
        assert task is not None
        d._due.pop(task, None)
        expired = task in d._expired
        d._expired.discard(task)
        if kind is asyncio.CancelledError and expired and task.uncancel() == 0:
            raise TimeoutError from None  # our cancellation, and no one else's is pending
