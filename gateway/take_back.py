"""Cancels Redis could not take when the gateway made them, made once it answers again.

A run must not go on for nobody: the run of a caller who left, or whose queueing timed out (the
caller heard 503, and a paused Redis runs what it had received when it resumes). When Redis
cannot take such a cancel, the gateway keeps it here and one task sends what is kept, in
batches, once a PING is answered: during an outage each request adds a few hundred bytes, not a
task with its own retries (whose calls a paused Redis would all run on resuming). A cancel is
kept until its run would have ended anyway (its follow deadline), and at most `MAX_KEPT` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from redis.asyncio import Redis

from common.comeback import Comeback, pause_on
from common.redisconn import REDIS_REFUSED, Backoff
from common.runlog import run_fields

log = logging.getLogger("iop.gateway")

#: The most cancels kept at once; past it, a run whose cancel Redis could not take goes on (logged).
MAX_KEPT = 100_000
#: The most cancels sent in one round trip.
BATCH = 256


class Kept(NamedTuple):
    model_id: str
    reason: str
    #: when the run would have ended anyway (`time.monotonic()`): the cancel is given up then
    give_up: float


#: What sends a batch of cancels: (run id, kept) each, to one answer each (an exception for one
#: that failed); raises when Redis could take none.
Send = Callable[[list[tuple[str, Kept]]], Awaitable[list[Any]]]


class TakeBack:
    def __init__(self, redis: Redis, send: Send, comeback: Comeback | None = None) -> None:
        """`comeback`: the gateway's watch for Redis answering again, which cuts the pauses between
        tries short (the runs go on meanwhile, for nobody)."""
        self.redis = redis
        self.send = send
        self.comeback = comeback
        self.kept: dict[str, Kept] = {}
        self.task: asyncio.Task[None] | None = None
        self._full_logged = False
        #: closed (the gateway stops): nothing is kept any more, and no task starts
        self.closed = False
        #: cancels abandoned, for good: past their run's follow deadline, or refused (`MAX_KEPT` kept)
        self.given_up = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self.kept)

    def add(self, run_id: str, model_id: str, reason: str, within_s: float) -> None:
        """Cancel the run as soon as Redis answers, for at most `within_s` seconds."""
        if self.closed:
            log.warning("could not cancel: the gateway stops", extra=run_fields(run_id, model_id))
            return
        if run_id not in self.kept and len(self.kept) >= MAX_KEPT:
            self.refused += 1
            if not self._full_logged:
                self._full_logged = True
                log.warning("%d cancels wait for Redis already, the most the gateway keeps: runs whose caller left "
                            "while Redis could not take their cancel may go on", len(self.kept),
                            extra=run_fields(run_id, model_id))
            return
        self.kept.setdefault(run_id, Kept(model_id, reason, time.monotonic() + within_s))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._resend(), name="iop-take-back")

    async def close(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _resend(self) -> None:
        backoff = Backoff()
        error: BaseException | None = None
        while self.kept:
            await pause_on(self.comeback, backoff)  # (Redis just failed to take them)
            self._give_up(error)
            if not self.kept:
                return
            try:
                await self.redis.ping()  # (one small command a try while Redis is away, not the batch)
                batch = list(itertools.islice(self.kept.items(), BATCH))
                answers = await self.send(batch)
            except REDIS_REFUSED as exc:
                error = exc
                continue
            except Exception as exc:  # (not Redis's: said, and the cancels kept for the next try all the same)
                log.exception("sending kept cancels failed; trying again")
                error = exc
                continue
            sent = 0
            for (run_id, _), answer in zip(batch, answers, strict=True):
                if isinstance(answer, Exception):
                    error = answer
                else:
                    self.kept.pop(run_id, None)
                    sent += 1
            if len(self.kept) < MAX_KEPT:
                self._full_logged = False
            if sent:  # (else each was refused: not again at once)
                backoff.reset()

    def _give_up(self, error: BaseException | None) -> None:
        """Forget the cancels of runs that would have ended by now anyway."""
        now = time.monotonic()
        for run_id in [run_id for run_id, kept in self.kept.items() if kept.give_up < now]:
            kept = self.kept.pop(run_id)
            self.given_up += 1
            log.warning("could not cancel: %s", error or "Redis did not answer in time",
                        extra=run_fields(run_id, kept.model_id))
