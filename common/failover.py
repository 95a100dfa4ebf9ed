"""Following a Sentinel failover as soon as the sentinels announce it.

redis-py's Sentinel pool asks the sentinels where the primary is only when it makes a connection.
After a crash that is enough: the connections to the dead primary broke, and each one that
reconnects finds the new primary. A failover that leaves the old primary running (one asked for
with `SENTINEL FAILOVER`, or one after a partition) breaks nothing: the old primary stays a
primary until Sentinel turns it into a replica (about 10 s later on these machines), and every
write made there meanwhile is gone when it resyncs from the new one.

So each Sentinel pool keeps a `FailoverWatch`: one subscription to the sentinels' `+switch-master`
announcements (on one sentinel at a time, the next one if it goes away), and a question to that
sentinel every `CHECK_EVERY_S`, in case an announcement was missed while no sentinel was followed.
When the followed sentinel names another primary, the pool is told (`switch`): it closes every
connection to the old one, in use or not, and each reconnects to the new primary (a connection
made from then on goes where the watch went, `primary`, whatever the sentinel it asked says). A
sentinel whose configuration is older than one already seen (its config epoch is lower: it has
not heard of the failover yet) is never followed back to the old primary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import ConnectionPool, Redis

from common.subscription import subscribe

log = logging.getLogger("iop.redis")

#: The sentinels' announcement of a new primary: "<master> <old ip> <old port> <new ip> <new port>".
SWITCH_CHANNEL = "+switch-master"
#: How often the followed sentinel is asked where the primary is when it announced nothing.
CHECK_EVERY_S = 5.0
#: How long a sentinel may take to answer that question.
ANSWER_WITHIN_S = 2.0
#: The pause before following the sentinels again when none could be followed, doubling up to the cap.
RETRY_FIRST_S = 0.1
RETRY_CAP_S = 2.0
#: Cancelling the watch: how many times, and how long to wait each time for it to end.
CLOSE_TRIES = 40
CLOSE_TRY_S = 0.05

Address = tuple[str, int]


class FailoverWatch:
    """Follows the sentinels' announcements for `master` and calls `switch(address)` when the
    primary moved away from where the pool's connections went (`address`: at first the pool's
    own, `current()`; then wherever a switch sent them)."""

    def __init__(self, master: str, sentinels: list[Any], current: Callable[[], Address | None],
                 switch: Callable[[Address], Awaitable[None]]) -> None:
        """`sentinels` is the list of the Sentinel manager's clients (redis-py's `Sentinel.sentinels`,
        shared with it: read, never reordered here); `switch(address)` moves the pool's connections."""
        self.master = master
        self.sentinels = sentinels
        self.current = current
        self.switch = switch
        #: the highest config epoch a followed sentinel answered with
        self.epoch: int | None = None
        #: where the pool's connections were sent (None until the first answer)
        self.address: Address | None = None
        self._task: asyncio.Task[None] | None = None
        #: the sentinel `_follow` is on was subscribed to and answered
        self._followed = False
        #: none could be followed at the last round (said once, at WARNING, until one can again)
        self._lost = False
        #: the closing of subscriptions `_follow` left (shielded from the cancellations `close` repeats)
        self._closing: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        """Start following (once; again after `close`)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="iop-sentinel-watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        # (Python 3.11's `asyncio.wait_for`, which redis-py writes with, can lose a cancellation
        # that meets its own end: cancel again until the task has ended.)
        for _ in range(CLOSE_TRIES):
            if task is None or task.done():
                break
            task.cancel()
            await asyncio.wait([task], timeout=CLOSE_TRY_S)
        else:
            log.warning("the watch of the sentinels for %s did not stop", self.master)
        # (a subscription's connection is closed whatever cancellations came meanwhile: one left
        # open was found at a test's garbage collection, `unclosed Connection` to a sentinel)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def primary(self, found: Address) -> Address:
        """Where a new connection of the pool goes, when the sentinels it asked said `found`: the
        watch's address if it has one (a sentinel asked first may not have heard of the last
        failover yet; the watch only ever moves to a newer configuration), else `found`."""
        return found if self.address is None else self.address

    async def _run(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            followed = False
            why = ""
            for sentinel in list(self.sentinels):
                try:
                    await self._follow(sentinel)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # that sentinel went away or answered nonsense: the next one
                    why = f"{_where(sentinel)}: {first_line(exc)}"
                    log.debug("cannot follow the sentinel %s for %s", why, self.master)
                followed = followed or self._followed
            if not followed and not self._lost:
                self._lost = True
                log.warning("Redis Sentinel: no sentinel of %s can be followed (the last, %s); a failover goes "
                            "unseen until one answers", self.master, why or "none")
            delay = RETRY_FIRST_S if followed else min(delay * 2, RETRY_CAP_S)
            await asyncio.sleep(delay)

    async def _follow(self, sentinel: Any) -> None:
        """Follow one sentinel until it fails. The subscription has a connection of its own,
        without the read timeout of the sentinel's client (its questions keep theirs)."""
        self._followed = False
        pool = sentinel.connection_pool
        listener = Redis(connection_pool=ConnectionPool(
            connection_class=pool.connection_class, max_connections=1,
            **{**pool.connection_kwargs, "socket_timeout": None}))
        pubsub = listener.pubsub()
        try:
            await subscribe(pubsub, SWITCH_CHANNEL, reply_s=ANSWER_WITHIN_S)
            await self._check(sentinel)  # (what was announced before the subscription)
            self._followed = True
            if self._lost:
                self._lost = False
                log.warning("Redis Sentinel: following the sentinel %s for %s again", _where(sentinel), self.master)
            while True:
                try:
                    # (redis-py's own wait, `get_message(timeout=…)`, can swallow a cancellation)
                    async with asyncio.timeout(CHECK_EVERY_S):
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                except TimeoutError:
                    message = None
                if message is None or _names(message, self.master):
                    await self._check(sentinel)
        finally:  # (shielded: `close` cancels again and again, and a cancel met here left it open)
            closing = asyncio.ensure_future(_close_listener(pubsub, listener))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            await asyncio.shield(closing)

    async def _check(self, sentinel: Any) -> None:
        """Ask `sentinel` where the primary is; switch if it moved and the sentinel is not behind."""
        async with asyncio.timeout(ANSWER_WITHIN_S):
            state = await sentinel.sentinel_master(self.master)
        epoch, address = int(state["config-epoch"]), (str(state["ip"]), int(state["port"]))
        if self.epoch is not None and epoch < self.epoch:
            return  # a sentinel that has not heard of the last failover yet
        self.epoch = epoch
        if self.address is None:
            self.address = self.current()
        was = self.address
        if was is None or _same(was, address) or not state.get("is_master", True) \
                or state.get("is_odown") or state.get("is_sdown"):
            return
        log.warning("Redis Sentinel: the primary of %s moved from %s:%s to %s:%s (config epoch %d); "
                    "reconnecting there", self.master, was[0], was[1], address[0], address[1], epoch)
        # (decided by where the connections went, not by the pool's `master_address`, which a new
        # connection that asked the sentinels moves without closing the connections in use)
        self.address = address
        await self.switch(address)


async def _close_listener(pubsub: Any, listener: Redis) -> None:
    """Close a subscription and its client's own pool (the client was given it: it does not close it)."""
    try:
        await pubsub.aclose()
        await listener.aclose()
    finally:
        await listener.connection_pool.disconnect()


def _names(message: dict[str, Any], master: str) -> bool:
    """A `+switch-master` message about `master`."""
    data = message.get("data")
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    return isinstance(data, str) and data.split(" ", 1)[0] == master


def _same(a: Address, b: Address) -> bool:
    return str(a[0]) == str(b[0]) and int(a[1]) == int(b[1])


def first_line(exc: BaseException) -> str:
    """What went wrong with a sentinel, in one line: its error's first line, else its kind."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _where(sentinel: Any) -> str:
    kwargs = getattr(getattr(sentinel, "connection_pool", None), "connection_kwargs", {})
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
