"""Calls of one script from many tasks, sent together.

Every call made in the same turn of the event loop goes to Redis in one pipeline (up to
`max_batch` a pipeline, `Scripts.call_many`), so a burst of callers takes a few Redis
connections and round trips, not one each. At most `max_sending` pipelines are on their way at
once; the calls made meanwhile wait, unpacked, and go together once one has its answers. So a
burst of thousands is packed for Redis only as fast as Redis takes it, and the calls waiting
hold no packed copy. Each caller gets its own answer, or the error of its own call, or, when the
round trip itself failed (Redis away), that error: no caller is left waiting. When Redis did not
answer a round trip in time (or a connection in time), the calls waiting behind it hear so at
once, as calls that were not sent, rather than each wait out a timeout of its own in turn; so do
those behind a round trip whose sentinels named no primary after `slow_s` (the sentinels cut off,
none answering within `SENTINEL_TIMEOUT_S`: a gateway cut off from Redis's hosts). A lost or
refused connection fails a round trip within its retries, however long they took: the calls
behind it go next, with retries of their own (Redis may be back by then: a restart, a Sentinel
failover); but those that have waited `max_wait_s` (`REPLY_TIMEOUT_S`, as long as a call waits for
a reply) fail with it, as never sent. So while Redis refuses connections no caller waits longer
than that and one more round trip's retries (~6.5 s through a Sentinel pool, where a pipeline of
256 failing a ~1.45 s after another had let the wait grow with every caller arriving: 1,500
callers in a second waited up to 9.1 s, 3,000 in 3 s up to 16.1 s), and a failover of a few
seconds still answers those that came during it (in one of 4 s, as many as with no such rule).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.redisconn import SENTINEL_TIMEOUT_S
from common.redisline import REPLY_TIMEOUT_S, may_have_run
from common.scripts import Scripts

#: a call's keys, its arguments, its answer to come, and when it came (`ScriptBatch.clock`)
Call = tuple[Sequence[str], Sequence[Any], "asyncio.Future[Any]", float]

#: A round trip whose sentinels named no primary after this long waited on sentinels that do not
#: answer (they fail after `SENTINEL_TIMEOUT_S`), not on ones that refused at once. (The time alone
#: tells nothing: through a Sentinel pool the retries of a refused connection take 1.42-1.49 s,
#: the retries of a connect within those of the command, on either side of 1.5 s with the load.)
SLOW_FAILURE_S = 0.75 * SENTINEL_TIMEOUT_S


def _after_leaving(if_left: Callable[[Any], None], future: asyncio.Future[Any]) -> None:
    """The answer of a call whose caller left, to `if_left`: None when it may have run but no answer
    came (`may_have_run`)."""
    if future.cancelled():
        return
    error = future.exception()
    if error is None:
        if_left(future.result())
    elif may_have_run(error):  # (Redis did not answer, or the connection broke once the call was sent)
        if_left(None)


class ScriptBatch:
    def __init__(self, scripts: Scripts, name: str, max_batch: int = 256, max_sending: int = 1,
                 slow_s: float = SLOW_FAILURE_S, max_wait_s: float = REPLY_TIMEOUT_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.scripts = scripts
        self.name = name
        self.max_batch = max_batch
        self.max_sending = max_sending
        self.slow_s = slow_s
        self.max_wait_s = max_wait_s
        self.clock = clock or time.monotonic
        self._pending: list[Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, keys: Sequence[str], args: Sequence[Any],
                   if_left: Callable[[Any], None] | None = None) -> Any:
        """The call's answer. A caller that leaves (is cancelled) while it waits does not take
        the call back: it is made, or was, and its answer goes to `if_left` (when it is not an
        error), which may undo what the call did; None when Redis did not answer in time (the
        call may have been made, or may be when Redis resumes)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((keys, args, future, self.clock()))
        if len(self._pending) == 1 and len(self._sending) < self.max_sending:
            loop.call_soon(self._flush)  # after the other calls of this turn joined (else: `_sent`)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if if_left is not None:
                future.add_done_callback(partial(_after_leaving, if_left))
            raise
        except BaseException:
            del future  # (it holds the error, whose traceback holds this frame: no cycle)
            raise

    def _flush(self) -> None:
        while self._pending and len(self._sending) < self.max_sending:
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        self._flush()  # the calls made meanwhile

    async def _send(self, batch: list[Call]) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        try:
            answers = await self.scripts.call_many(self.name, [(keys, args) for keys, args, _, _ in batch])
        except BaseException as exc:  # the round trip failed: every caller of the batch hears it
            _fail(batch, exc)
            if isinstance(exc, (RedisTimeoutError, asyncio.CancelledError)) or (
                    isinstance(exc, MasterNotFoundError) and loop.time() - sent_at >= self.slow_s):
                # (and the calls waiting behind it, which would each wait as long in turn; a lost or
                # refused connection is not, however long its retries took: the calls behind it get
                # retries of their own, which may see Redis back: a failover, a restart)
                waiting, self._pending = self._pending, []
                _fail(waiting, exc if isinstance(exc, asyncio.CancelledError) else _unsent(exc))
                waiting = []
            elif isinstance(exc, RedisConnectionError):
                # (those that have waited `max_wait_s` already fail with it; the others go next. The
                # first come first: those that waited so long are the first of `_pending`)
                since = self.clock() - self.max_wait_s
                old = next((i for i, call in enumerate(self._pending) if call[3] > since), len(self._pending))
                waiting, self._pending = self._pending[:old], self._pending[old:]
                _fail(waiting, _unsent(exc))
                waiting = []
            batch = []  # (its futures hold the error, whose traceback holds this frame: no cycle)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future, _), answer in zip(batch, answers, strict=True):
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)


def _fail(calls: list[Call], exc: BaseException) -> None:
    for _, _, future, _ in calls:
        if not future.done():
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)


def _unsent(exc: BaseException) -> BaseException:
    """`exc` (Redis away) as the error of a call that was never sent: it did not run (`may_have_run`)."""
    error = type(exc)(*exc.args)
    error.iop_sent = False  # type: ignore[attr-defined]
    return error
