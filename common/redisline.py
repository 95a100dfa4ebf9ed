"""Commands of a whole process over one shared Redis connection, many in flight at once.

redis-py's own path costs every command a connection taken from the pool and checked with a
zero-timeout read, the retry wrapper around it and the release after: 60-100 us of CPU a
script call on these 2-core machines (`bench/redis_calls.py`), more than Redis spends running
most scripts. A `Line` keeps
one connection of its own: a command is packed, queued and written with the others of the same
event-loop turn in one write, and one reader hands each reply to its caller in the order they
were sent (Redis answers a connection's commands in order): 40-50 us a call from one task,
13-19 us when many call at once, with fewer system calls.

The pool's shared line (`pool.line`) is for commands that answer at once (the scripts): a
blocking read (`XREAD BLOCK`, `BLMPOP`) would hold up every command behind it. Each loop that
blocks (the gateway's inbox listener, the scheduler's intake, a worker's wake list) has a line of
its own instead (`pool.new_line()`), used by that loop alone, so it too skips the pool's path.
Replies are as Redis sends them (RESP2), without redis-py's parsing: `stream_reply` turns an
`XREAD` / `XREADGROUP` reply into redis-py's shape.

Failures are what redis-py's path gives: an error reply is raised to its own caller only; a
lost connection (Redis away, a failover: `NotPrimaryError`) fails every command in flight on it,
each is tried again up to the pool's `retry` (as redis-py's client does), and the next command
connects again (through the sentinels for a Sentinel pool). The connection is made by the pool's
own connection class, so credentials, TLS, the database and Sentinel's primary are the pool's.
A caller that leaves (is cancelled) while its command is out does not take it back: the reply is
read and dropped, and the connection stays in step; on a blocking read's line the connection is
closed instead, so that the server drops the read (a BLMPOP left there would pop a job for nobody).

A Redis that stops answering with its connection up (paused, its host cut off, swapping) fails
each command that waited the pool's `socket_timeout` (`REPLY_TIMEOUT_S` unless the URL sets it),
past its own blocking time, for its reply with a redis-py `TimeoutError`, and the commands behind
it on the connection with it; the connection is closed, and the next command connects again. A
timed-out command is not sent again (it may have run, or run later: an `INCR` must not count
twice); its caller treats it as an outage. (redis-py's own `socket_timeout` would bound each read
too, but costs every read a timer, and would cut a blocking read short: the lines keep one timer
for all their commands instead, and their connections' own is off once connected.)
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: an argument longer than this goes out as a part of its own (not copied into the command's bytes)
BIG_ARGUMENT = 6000
#: How long a command waits for Redis's reply past its own blocking time (`XREAD BLOCK`, `BLMOVE`)
#: before it fails with a `TimeoutError`, unless the URL sets `?socket_timeout=` (every Redis
#: connection iop makes: `common.redisconn`).
REPLY_TIMEOUT_S = 5.0
#: A deadline's timer that runs this much later than it was due says the process was held (stopped,
#: its loop blocked), not that Redis was silent: its commands get the reply timeout again.
STALLED_S = 1.0


def _encoded_other(arg: Any) -> bytes | memoryview:
    if isinstance(arg, bool):  # (an int; redis-py refuses it too)
        raise DataError("Invalid input of type: 'bool'. Convert to a bytes, string, int or float first.")
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return arg if not isinstance(arg, bytearray) else bytes(arg)
    if isinstance(arg, str):
        return str(arg).encode()
    if isinstance(arg, (int, float)):
        return repr(arg).encode()
    raise DataError(f"Invalid input of type: '{type(arg).__name__}'. Convert to a bytes, string, int or float first.")


def pack_command(args: Sequence[Any]) -> list[bytes | memoryview]:
    """One command in Redis's protocol, as redis-py's `pack_command` makes it (each argument one
    argument: a command name is not split at spaces), in a fraction of its time: the parts of a
    command are joined once, and an argument longer than `BIG_ARGUMENT` is not copied."""
    out: list[bytes | memoryview] = []
    parts: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)
        data: bytes | memoryview
        if kind is bytes:
            data = arg
        elif kind is str:
            data = arg.encode()
        elif kind is int:
            data = b"%d" % arg
        else:
            data = _encoded_other(arg)
        if len(data) > BIG_ARGUMENT:
            parts.append(b"$%d\r\n" % len(data))
            out.append(b"".join(parts))
            out.append(data)
            parts = [b"\r\n"]
        else:
            parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    out.append(b"".join(parts))
    return out


class _Link:
    """One connection and the commands in flight on it. Once broken it stays broken: the line
    makes a new one."""

    __slots__ = ("conn", "reply_timeout_s", "waiting", "deadlines", "budgets", "timer", "timer_at", "out", "wake",
                 "reader", "broken")

    def __init__(self, conn: AbstractConnection, reply_timeout_s: float) -> None:
        self.conn = conn
        #: how long a reply may take past its command's own wait (`Line.execute`'s `block_s`)
        self.reply_timeout_s = reply_timeout_s
        #: the futures of the commands sent and not yet answered, oldest first
        self.waiting: deque[asyncio.Future[Any]] = deque()
        #: when each of them (in the same order) must have its reply, by the loop's clock
        self.deadlines: deque[float] = deque()
        #: how long each of them may take once Redis gets to it: the reply timeout and its block time
        self.budgets: deque[float] = deque()
        #: the one timer that checks the oldest deadline (`expire`), while commands wait, and when
        #: it fires (it may have been armed for a command answered since, whose deadline was later)
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        #: packed commands of this turn, written together at its end
        self.out: list[bytes | memoryview] = []
        #: set when the reader sleeps (nothing in flight) and a command is sent
        self.wake: asyncio.Future[None] | None = None
        self.reader: asyncio.Task[None] | None = None
        self.broken: BaseException | None = None

    def send(self, packed: list[bytes | memoryview], block_s: float) -> asyncio.Future[Any]:
        """Queue one packed command (`pack_command`) for this turn's write; its reply's future,
        failed with a TimeoutError if no reply comes within `block_s` (how long the command itself
        may wait in Redis) and the reply timeout."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.waiting.append(future)
        budget = self.reply_timeout_s + block_s
        deadline = loop.time() + budget
        self.deadlines.append(deadline)
        self.budgets.append(budget)
        if self.timer is None or (deadline < self.timer_at and len(self.deadlines) == 1):
            self._arm(deadline)
        if not self.out:
            loop.call_soon(self.flush)
        self.out += packed
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        return future

    def flush(self) -> None:
        if self.broken is not None or not self.out:
            return
        out, self.out = self.out, []
        writer = self.conn._writer  # (redis-py's stream writer: the same write its send_packed_command makes)
        if writer is None:
            self.fail(RedisConnectionError("the connection to Redis was closed"))
            return
        try:
            writer.writelines(out)
        except (OSError, RuntimeError) as exc:
            self.fail(RedisConnectionError(f"error while writing to Redis: {exc}"))

    async def read(self) -> None:
        """Hand each reply to its command's caller, in order, while the link lives."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.waiting:
                    self.wake = loop.create_future()
                    await self.wake
                    self.wake = None
                    continue
                try:
                    reply: Any = await self.conn.read_response()
                except ResponseError as exc:  # an error reply: its caller's alone (the stream is in step)
                    reply = exc.with_traceback(None)  # (this frame's: nothing to show its caller)
                future = self.waiting.popleft()
                self.deadlines.popleft()
                self.budgets.popleft()
                if self.deadlines:
                    # the next command could not be answered before this one: its time counts from now
                    # at the earliest (a command behind a blocking read, or behind a slow script)
                    self.deadlines[0] = max(self.deadlines[0], loop.time() + self.budgets[0])
                    if self.deadlines[0] < self.timer_at:  # (the timer was the one just answered's: later)
                        self._arm(self.deadlines[0])
                if future.done():  # its caller left
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except asyncio.CancelledError:
            self.fail(RedisConnectionError("the connection to Redis was closed"))
            raise
        except BaseException as exc:  # a lost connection, a timeout, not the primary any more, ...
            self.fail(exc if isinstance(exc, Exception) else RedisConnectionError(str(exc)))
            if not isinstance(exc, Exception):
                raise

    def _arm(self, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = asyncio.get_running_loop().call_at(at, self.expire), at

    def expire(self) -> None:
        """The timer: if the oldest command has waited past its deadline, Redis stopped answering
        (the replies come in order): the link breaks with a TimeoutError, its connection closed."""
        self.timer = None
        if not self.waiting or self.broken is not None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.deadlines[0] > now:
            self._arm(self.deadlines[0])
            return
        if now - self.timer_at > STALLED_S:
            # The timer itself came late: this process was held (SIGSTOP, a frozen VM, a blocked
            # loop), not Redis. A reply that came meanwhile is read in this same turn, after this
            # timer: the oldest command gets the reply timeout again, from now.
            self.deadlines[0] = now + self.reply_timeout_s
            self._arm(self.deadlines[0])
            return
        self.fail(RedisTimeoutError(f"Redis at {self.conn._host_error()} did not answer within "
                                    f"{self.reply_timeout_s:g} s (socket_timeout)"))
        self.close()

    def close(self) -> None:
        """Stop reading and close the connection at once (no await)."""
        if self.reader is not None:
            self.reader.cancel()
        writer = self.conn._writer  # (redis-py's stream writer)
        if writer is not None:
            writer.transport.abort()

    def fail(self, exc: BaseException) -> None:
        """The link is broken: every command in flight hears it."""
        if self.broken is None:
            self.broken = exc
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.deadlines.clear()
        self.budgets.clear()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
                future.exception()  # (retrieved: a caller that left must not leave a warning)
        self.out = []


class Line:
    """Commands over one connection of `pool`'s, made when first needed (see the module)."""

    def __init__(self, pool: ConnectionPool, role: str = "scripts", blocking: bool = False) -> None:
        """`role` is added to the pool's client name (`iop-gateway:scripts`), so that `CLIENT
        LIST` tells the line's connection apart. `blocking`: a line for one loop's blocking reads,
        whose connection is closed when a read's caller leaves before its reply (each read names
        how long it blocks: `block_s`)."""
        self.pool = pool
        self.role = role
        self.blocking = blocking
        self.retry = pool.connection_kwargs.get("retry")
        #: the pool's reply timeout (a URL's `?socket_timeout=`), which the line applies itself
        self.reply_timeout_s: float = pool.connection_kwargs.get("socket_timeout") or REPLY_TIMEOUT_S
        self._link: _Link | None = None
        self._connecting: asyncio.Lock | None = None
        #: the connections made so far: a reader that must know of a reconnect its command's retry hid
        #: (a failover, a restart) compares it before and after (`gateway.events`)
        self.connects = 0

    async def execute(self, *args: Any, block_s: float = 0.0) -> Any:
        """One command's reply; its error reply raised as redis-py raises it. `block_s`: how long
        the command itself may wait in Redis (a blocking read's timeout), before the reply timeout
        (`reply_timeout_s`) counts. A lost connection's ConnectionError says whether the command
        may have reached Redis (`may_have_run`)."""
        return await self._tried(lambda sent: self._once(args, block_s, sent))

    async def execute_many(self, commands: Sequence[Sequence[Any]], block_s: float = 0.0) -> list[Any]:
        """Several commands sent together, in order: each one's reply, or its error reply as the
        exception (as a pipeline answers with `raise_on_error=False`). A lost connection fails
        (and retries) them all. `block_s`: as for `execute`, for the longest of them."""
        return list(await self._tried(lambda sent: self._many(commands, block_s, sent)))

    async def _tried(self, attempt: Callable[[list[bool]], Awaitable[Any]]) -> Any:
        """`attempt`, tried again as the pool's retry says; its lost connection or timeout says
        whether any try sent the command (`iop_sent`, which `may_have_run` reads)."""
        sent = [False]
        try:
            if self.retry is None:
                return await attempt(sent)
            return await self.retry.call_with_retry(lambda: attempt(sent), self._failed)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            exc.iop_sent = sent[0]
            raise

    async def _once(self, args: Sequence[Any], block_s: float, sent: list[bool]) -> Any:
        packed = pack_command(args)
        link = await self._ready()
        future = link.send(packed, block_s)
        sent[0] = True
        try:
            return await future
        except asyncio.CancelledError:
            if self.blocking and future.cancelled():  # (cancelled with its caller: no reply yet)
                # A blocking read left running would take what comes next (a BLMPOP pops a job
                # for nobody): the connection is closed, and the server drops the read with it.
                self._abandon(link)
            raise

    async def _many(self, commands: Sequence[Sequence[Any]], block_s: float, sent: list[bool]) -> list[Any]:
        packed = [pack_command(args) for args in commands]  # (all or none: a DataError sends nothing)
        link = await self._ready()
        futures = [link.send(p, block_s) for p in packed]
        sent[0] = True
        replies: list[Any] = []
        try:
            for future in futures:
                try:
                    replies.append(await future)
                except ResponseError as exc:  # (without its traceback, which holds this frame: no cycle)
                    replies.append(exc.with_traceback(None))
        except asyncio.CancelledError:
            if self.blocking and futures[0].cancelled():  # (as in `_once`: the blocking read is first)
                self._abandon(link)
            raise
        return replies

    async def _failed(self, error: Exception) -> None:
        """redis-py's retry heard `error`: the link is dropped (its commands failed with it)."""
        await self._drop()

    async def _ready(self) -> _Link:
        link = self._link
        if link is not None and link.broken is None:
            return link
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            link = self._link
            if link is not None and link.broken is None:
                return link
            await self._drop()
            conn = self.pool.make_connection()
            if getattr(conn, "client_name", None):
                conn.client_name = f"{conn.client_name}:{self.role}"
            try:
                await conn.connect()  # (its handshake bounded by the pool's `socket_timeout`)
            except BaseException:
                await conn.disconnect()
                raise
            conn.socket_timeout = None  # (the link bounds its replies itself: `_Link.expire`)
            link = _Link(conn, self.reply_timeout_s)
            link.reader = asyncio.get_running_loop().create_task(link.read(), name="iop-redis-line")
            self._link = link
            self.connects += 1
            return link

    async def _drop(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        link.fail(RedisConnectionError("the connection to Redis was closed"))
        if link.reader is not None and link.reader is not asyncio.current_task():
            link.reader.cancel()
            await asyncio.gather(link.reader, return_exceptions=True)
        await link.conn.disconnect(nowait=True)

    def _abandon(self, link: _Link) -> None:
        """Close `link`'s connection at once (no await: its caller is being cancelled)."""
        if self._link is link:
            self._link = None
        link.fail(RedisConnectionError("the connection to Redis was closed"))
        link.close()

    async def close(self) -> None:
        """Close the connection (a later command opens a new one, as redis-py's pool does)."""
        await self._drop()


class Lined:
    """A pool class with a `Line` for the commands that answer at once, and lines of their own for
    the loops that block (mixed into redis-py's pools in `common.redisconn`). Closing the pool
    closes the lines' connections too; redis-py's own move to a new Sentinel primary, when a new
    connection finds it (`inuse_connections=False`), leaves them (they fail on the old primary and
    connect again), and `SentinelPool.switch_primary` closes them (`close_lines`)."""

    line: Line

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.line = Line(self)
        self._lines = [self.line]

    def new_line(self, role: str) -> Line:
        """A line for one loop's blocking reads, closed with the pool."""
        line = Line(self, role, blocking=True)
        self._lines.append(line)
        return line

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)  # type: ignore[misc]
        if inuse_connections:
            await self.close_lines()

    async def close_lines(self) -> None:
        """Close every line's connection (each opens a new one when next used)."""
        for line in self._lines:
            await line.close()


class LinedPool(Lined, ConnectionPool):  # type: ignore[misc]  # redis-py is not type-checked here
    """redis-py's pool of connections to one server, with a `Line`."""


def _lined(redis: Any) -> Lined | None:
    """The client's pool, if it has lines: a pool made by `common.redisconn` (over RESP2: a URL's
    `protocol=3` is refused there)."""
    pool = getattr(redis, "connection_pool", None)
    return pool if isinstance(pool, Lined) else None


def line_of(redis: Any) -> Line | None:
    """The shared line of a client made by `common.redisconn.connect`, else None (fakeredis, a
    client made another way: redis-py's own path)."""
    pool = _lined(redis)
    return None if pool is None else pool.line


def new_line_of(redis: Any, role: str) -> Line | None:
    """A line of its own for one loop's blocking reads (`role` names it in `CLIENT LIST`), for a
    client made by `common.redisconn.connect`; else None."""
    pool = _lined(redis)
    return None if pool is None else pool.new_line(role)


StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


def may_have_run(exc: BaseException) -> bool:
    """Whether a command that failed with `exc` may have run in Redis, or may still run there: it
    was sent (on any of its tries), and then its reply timed out (a paused Redis runs what it had
    received when it resumes) or its connection broke. One whose connection could not be made, or
    made in time, sent nothing. (An error from elsewhere than a `Line` says nothing: it may have.)"""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and bool(getattr(exc, "iop_sent", True))


def stream_reply(reply: Any) -> list[tuple[bytes, StreamEntries]]:
    """A raw `XREAD` / `XREADGROUP` reply as redis-py gives it: [(stream, [(id, fields)])]; an
    entry deleted while pending has no fields ({})."""
    return [(stream, [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {})
                      for entry_id, flat in entries])
            for stream, entries in reply or ()]
