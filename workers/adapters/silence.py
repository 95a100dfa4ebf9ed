"""A whole answer's wait for its head, while its server says it is well.

vLLM, SGLang, llama.cpp, Lemonade and hosted APIs send nothing of a whole (non-stream) answer until
it is done, its head included. A silence of `read_timeout_ms` there says nothing of the server: a long
generation, or one queued behind others, is as silent as a hung server. So the head of a whole
answer is waited for as long as the server's health check passes, asked after the first silence of
`read_timeout_ms` (`load_timeout_ms` more on a type that loads the model first) and again after each
further one; a check the server answers with a failure, or refuses, ends the wait as the silence ended
it before (a 504 and a strike). One it does not answer in time says nothing (`well`).
`execution_timeout_ms` bounds the wait in any case. On llama.cpp the check is its `/health` alone
(llama-cpp-python's model list disturbs a run in progress, `PROBE_DISTURBS`); not for streams, whose
tokens show the server at work.

The watch is a timer, not a task: a whole answer that comes within the first silence costs one timer
set and cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from common.policy import Health
from workers.adapters.base import ProbeResult

log = logging.getLogger("iop.worker")


def well(result: ProbeResult) -> bool:
    """A check that does not say the server is down: it passed, the server answered that it is busy
    (429), or it did not answer in time. A busy server's check may wait (SGLang's `/health` waits for
    its next output, up to 20 s; llama-cpp-python's model list for the generation): no answer is no
    evidence, as for the heartbeat's own probe while runs are in flight, and never fails a caller."""
    return result.health is Health.AVAILABLE or result.busy or result.timed_out


def _taken(task: asyncio.Task[ProbeResult]) -> None:
    """A shared check's end, taken: an error that no watch awaited is logged, not left to asyncio's
    "never retrieved" at collection."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the shared check of silent whole answers failed unexpectedly", exc_info=task.exception())


class SharedCheck:
    """One check for every silent whole answer on a provider (in this worker process): one under way
    is joined, and one that ended less than `fresh_s` ago is taken as it was. So N silent answers ask
    the server about once each `fresh_s`, not N times (a hosted API's `GET /models` each time)."""

    __slots__ = ("check", "fresh_s", "_running", "_last", "_at")

    def __init__(self, check: Callable[[], Awaitable[ProbeResult]], fresh_s: float) -> None:
        self.check = check
        self.fresh_s = fresh_s
        self._running: asyncio.Task[ProbeResult] | None = None
        self._last: ProbeResult | None = None
        self._at = 0.0

    async def __call__(self) -> ProbeResult:
        now = asyncio.get_running_loop().time()
        if self._last is not None and now - self._at < self.fresh_s:
            return self._last
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._run())
            # (its end is taken even when every watch that joined it closed meanwhile)
            self._running.add_done_callback(_taken)
        # (a watch that closes leaves the check to the others that joined it)
        return await asyncio.shield(self._running)

    async def _run(self) -> ProbeResult:
        try:
            result = await self.check()
            self._last, self._at = result, asyncio.get_running_loop().time()
            return result
        finally:
            self._running = None


class SilenceWatch:
    """Watches the task that creates it while it waits for a whole answer's head: after `first_s`
    of silence, and every `every_s` after a check that passed, `check` is awaited; one that does
    not pass (`well`) cancels the task, and `failed` says what it found. `close` ends the watch
    (the head came, or the wait ended otherwise); a check under way then is cancelled. The watch
    begins once the request is out (`sent`)."""

    __slots__ = ("check", "first_s", "every_s", "failed", "_task", "_timer", "_checking", "_closed")

    def __init__(self, check: Callable[[], Awaitable[ProbeResult]], first_s: float, every_s: float) -> None:
        self.check = check
        self.first_s = first_s
        self.every_s = every_s
        #: the check that did not pass, once one did not (the task was cancelled for it)
        self.failed: ProbeResult | None = None
        self._task = asyncio.current_task()
        self._timer: asyncio.TimerHandle | None = None
        self._checking: asyncio.Task[None] | None = None
        self._closed = False

    def sent(self) -> None:
        """The request is all out: the silence counts from now (a request's body sent in pieces has
        its own watch, `sending._Sending`). Once: a request sent again keeps the first count."""
        if self._timer is None and self._checking is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(self.first_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._checking = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            result = await self.check()
        except Exception:  # (a bug in a check: the wait goes on, to execution_timeout_ms at most)
            log.exception("the health check of a silent whole answer failed unexpectedly")
            result = ProbeResult(Health.AVAILABLE)
        self._checking = None
        if self._closed:
            return
        if well(result):
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._start)
        elif self._task is not None:
            self.failed = result
            # (at the next turn: a head that came in this one has the task closing the watch first, and
            # a cancel asked once its head came could not be taken back, its answer lost)
            asyncio.get_running_loop().call_soon(self._cancel)

    def _cancel(self) -> None:
        if self._closed:
            self.failed = None  # (the head came first: the answer stands)
        elif self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._checking is not None:
            self._checking.cancel()
            self._checking = None

    def ended_it(self) -> bool:
        """Whether the task's cancellation being handled is this watch's alone (then taken back):
        a failed check's, with no other cancel asked meanwhile (a caller who left, a shutdown)."""
        if self.failed is None or self._task is None:
            return False
        return self._task.uncancel() == 0
