"""Redis connections for the services: one URL parser, reconnects with backoff, Sentinel failover.

Every Redis client iop makes (gateway, scheduler, worker and arq's pool, heartbeats, the cancel
listener, the `iop` inspection commands) is built here from the one `--redis` / `REDIS_URL`:

    redis://[[user]:password@]host[:port][/db][?option=value…]      one server
    rediss://…?ssl_ca_certs=/path/ca.crt                             one server over TLS
    unix:///path/redis.sock[?db=N]                                    one server on a Unix socket
    redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/master[/db][?option=value…]
    rediss+sentinel://…                                              the same, TLS to sentinels and servers

With Sentinel, the credentials are the Redis servers' (the primary's and its replicas');
`sentinel_username` / `sentinel_password` options authenticate to the sentinels themselves
(default: none). A sentinel's port defaults to 26379.

A connection that hears from a server that is no longer the primary (READONLY, or UNBLOCKED
for a command that was blocked when it was demoted) is closed and reported as a lost
connection: every caller already treats that as an outage (retry with `Backoff`), and a
Sentinel connection asks the sentinels for the primary again when it reconnects.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.connection import (
    URL_QUERY_ARGUMENT_PARSERS,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.failover import FailoverWatch, first_line
from common.redisline import REPLY_TIMEOUT_S, Lined, LinedPool

#: what an operator command that could not reach Redis adds: where the Redis it tried came from
WHICH_REDIS = "(the pool's Redis is --redis URL, else $REDIS_URL, else redis://127.0.0.1:6379/0)"

#: What a lost or restarting Redis raises; services back off and go on. A server that stopped
#: being the primary answers READONLY; connections made here turn that into a ConnectionError,
#: and ReadOnlyError is listed too for any reply that reaches a caller another way.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, ConnectionError, OSError)
#: What a full Redis raises: at `maxmemory` (noeviction, as iop runs it) it refuses each script and
#: command that could grow it, for as long as it is full (a script that frees first, as a run's end
#: does, still goes through).
REDIS_FULL = (OutOfMemoryError,)
#: Redis cannot do it now, down or full: a process's loops wait and try again, as for REDIS_DOWN.
REDIS_UNUSABLE = (*REDIS_DOWN, *REDIS_FULL)
#: Redis did not do it, for any reason of its own: REDIS_UNUSABLE, or any other error reply (a
#: MISCONF Redis, whose snapshot failed, refuses even PING). For what is tried again until done
#: (a kept cancel, a subscription), whatever refused it.
REDIS_REFUSED = (*REDIS_UNUSABLE, RedisError)

SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
#: Options of a Sentinel URL that are for the sentinels, not the Redis servers.
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
#: How long a sentinel may take to answer where the primary is.
SENTINEL_TIMEOUT_S = 2.0


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used. The message is one line, names what is wrong, and never
    shows a password."""


#: TCP keepalive of every Redis connection (Linux's names; where the system lacks one, its own
#: default): a probe after `idle` seconds with nothing received, then every `interval` seconds;
#: `count` probes unanswered and the connection is dead. So a connection whose peer is gone without
#: a word (a host powered off, a NAT or a load balancer that dropped the mapping of an idle
#: connection) fails within 30 s, and the probes keep such a mapping from being dropped at all.
#: (The system's default, 2 hours 11 minutes, let an idle pool connection or a subscription sit
#: dead, to time out only when next used.)
KEEPALIVE = {"TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


def keepalive_options() -> dict[int, int]:
    """`KEEPALIVE` as redis-py's `socket_keepalive_options` (the options this system has)."""
    return {getattr(socket, name): value for name, value in KEEPALIVE.items() if hasattr(socket, name)}


class _Retry(Retry):  # type: ignore[misc]  # redis-py is not type-checked here
    """redis-py's retry of a command (or a connect) whose connection dropped, with backoff; but a
    primary the sentinels could not name is not asked for again: every sentinel was asked at once,
    each within `SENTINEL_TIMEOUT_S` (asked one after another, four times, sentinels that took
    connections and answered nothing made each command wait about 24 s)."""

    async def call_with_retry(self, do: Callable[[], Awaitable[Any]], fail: Callable[[Any], Any]) -> Any:
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                failures += 1
                await fail(error)
                if isinstance(error, MasterNotFoundError) or 0 <= self._retries < failures:
                    raise
                pause = self._backoff.compute(failures)
                if pause > 0:
                    await asyncio.sleep(pause)


def client_options() -> dict[str, Any]:
    """What every service's Redis connections add to their URL: retry a command whose connection
    dropped a few times with exponential backoff, a connect timeout, a reply timeout, TCP
    keepalive (`KEEPALIVE`). Everything else, TLS included (`rediss://…?ssl_ca_certs=…`), comes from the URL,
    the same for every service.

    A command without a reply within `REPLY_TIMEOUT_S` (a Redis paused, or cut off with the
    connection up) raises redis-py's TimeoutError, which every caller treats as Redis down; it is
    not sent again (it may have run, or may still run: an INCR must not count twice)."""
    return {
        "decode_responses": False,
        # (redis-py's Retry also retries timeouts unless told which errors it may retry)
        "retry": _Retry(ExponentialBackoff(cap=1.0, base=0.02), retries=3, supported_errors=(RedisConnectionError,)),
        "retry_on_error": [RedisConnectionError],
        "socket_connect_timeout": 2.0,
        "socket_timeout": REPLY_TIMEOUT_S,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": 0,
        # no `CLIENT SETINFO` on each new connection: a round trip, and an error Redis 7.0 answers
        # (redis-py drops it, leaving a reference cycle for the collector); `client_name` says
        # which iop process a connection is in `CLIENT LIST`
        "lib_name": None,
        "lib_version": None,
    }


# ---------------------------------------------------------------------------- URLs
@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What a Redis URL names: one server (no `sentinels`), or the primary that the sentinels
    know as `master`. `options` are the connection options of the Redis servers (address,
    database, credentials, TLS, whatever else the URL set); `sentinel_options` those of the
    connections to the sentinels."""

    url: str
    options: dict[str, Any]
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""
    sentinel_options: dict[str, Any] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return issubclass(self.options["connection_class"], SSLConnection)


def _authority_end(rest: str) -> int:
    """Where the host part of a URL's `rest` (after `scheme://`) ends: its first `/`, `?` or `#`."""
    return min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))


def _unencoded_userinfo(rest: str) -> bool:
    """Whether a URL's user part seems to hold a `/`, `?`, `#` or `@` that is not percent-encoded
    (`:p/ss@host`, `:p@ss@host`): between its first `:` and its last `@` there is one of them,
    and no `?name=` (an option's value may hold an `@`: `?password=p@ss`)."""
    colon, at = rest.find(":"), rest.rfind("@")
    if colon < 0 or at < colon:
        return False
    span = rest[colon:at]
    query = span.find("?")
    if query >= 0 and "=" in span[query:]:
        return False
    return any(c in span for c in "/?#@")


def redact(url: str) -> str:
    """The URL without its passwords (the user part's, and a `password` or `sentinel_password`
    option), fit for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = rest.rfind("@")
    end = at + 1 + _authority_end(rest[at + 1:]) if _unencoded_userinfo(rest) else _authority_end(rest)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{hosts}"
    path, qsep, query = tail.partition("?")
    if qsep:
        query = "&".join(f"{name}=***" if name in ("password", "sentinel_password") else f"{name}{eq}{value}"
                         for name, eq, value in (item.partition("=") for item in query.split("&")))
    return f"{scheme}://{netloc}{path}{qsep}{query}"


def _accepted_options(connection_class: type) -> set[str]:
    """The keyword arguments a connection class takes (its own and those of its bases)."""
    names: set[str] = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        names |= {p.name for p in inspect.signature(init).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names | {"max_connections"}


def parse_redis_url(url: str) -> RedisTarget:
    """Parse `--redis` / `REDIS_URL`, or raise `RedisUrlError` saying what is wrong."""
    try:
        return _parse_redis_url(url)
    except RedisUrlError:
        if _unencoded_userinfo(url.partition("://")[2]):  # (what it says would show part of the password)
            raise RedisUrlError(f"Redis URL {redact(url)!r}: its password seems to hold '/', '?' or '#'; "
                                "percent-encode them (%2F, %3F, %23), and '@' and '%' (%40, %25)") from None
        raise


def _parse_redis_url(url: str) -> RedisTarget:
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SENTINEL_SCHEMES:
        return _parse_sentinel(url, scheme)
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in (*SCHEMES, *SENTINEL_SCHEMES))
        shown = f"scheme {scheme + '://'!r}" if scheme else "no scheme"
        raise RedisUrlError(f"Redis URL {redact(url)!r} has {shown}; use one of {known}")
    try:
        options: dict[str, Any] = dict(parse_url(url))
    except ValueError as exc:
        raise RedisUrlError(f"Redis URL {redact(url)!r}: {exc}") from None
    if scheme != "unix":  # unix:// has the socket's path there, and its database as ?db=N
        _check_database_path(url)
    options["connection_class"] = _FOLLOWING[options.get("connection_class", Connection)]
    _check_options(url, options, _accepted_options(options["connection_class"]))
    return RedisTarget(url, options)


def _check_database_path(url: str) -> None:
    """The path of a redis:// or rediss:// URL is the database: nothing, `/`, or `/<digits>`.
    (redis-py takes a path that is not a number as database 0, and `/1/2` as 12.)"""
    try:
        parts = urlsplit(url)
        path = unquote(parts.path)
        query = parse_qs(parts.query, keep_blank_values=True)
    except ValueError as exc:
        raise RedisUrlError(f"Redis URL {redact(url)!r}: {exc}") from None
    database = path[1:]
    if database and not (database.isascii() and database.isdigit()):
        raise RedisUrlError(f"Redis URL {redact(url)!r}: the path {path!r} is not a database number "
                            "(write /0, /1, … after the host, or nothing for database 0)")
    if database and "db" in query:  # (redis-py takes ?db= over the path, silently)
        raise RedisUrlError(_two_databases(url, database, "Redis"))


def _two_databases(url: str, database: str, kind: str) -> str:
    return f"{kind} URL {redact(url)!r} names its database twice (the path's {database} and ?db=): keep one"


def _check_options(url: str, options: dict[str, Any], accepted: set[str], kind: str = "Redis") -> None:
    if options.get("protocol") not in (None, 2, "2"):
        # (redis-py then answers with RESP3's maps and pushes, which iop's readers do not take: the
        # scheduler failed on every read and callers waited for answers that never came)
        raise RedisUrlError(f"{kind} URL {redact(url)!r}: option protocol={options['protocol']} is not "
                            "supported; iop speaks RESP2 (protocol=2, the default)")
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = options.get(name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            # (0 made every read time out at once; redis-py takes it as it comes)
            raise RedisUrlError(f"{kind} URL {redact(url)!r}: option {name}={value} is not a number of "
                                "seconds above 0")
    for name in options:
        if name in SENTINEL_OPTIONS:
            raise RedisUrlError(f"{kind} URL {redact(url)!r}: option {name!r} is only for "
                                f"redis+sentinel:// and rediss+sentinel:// URLs")
        if name not in accepted and name != "connection_class":
            hint = " (TLS options need rediss:// or rediss+sentinel://)" if name.startswith("ssl_") else ""
            raise RedisUrlError(f"{kind} URL {redact(url)!r}: unknown option {name!r}{hint}")


def _parse_sentinel(url: str, scheme: str) -> RedisTarget:
    def bad(what: str) -> RedisUrlError:
        return RedisUrlError(f"Sentinel URL {redact(url)!r}: {what}")

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    userinfo, at, hosts = parts.netloc.rpartition("@")
    options: dict[str, Any] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon and password:
            options["password"] = unquote(password)
    if not hosts:
        raise bad(f"names no sentinel; write {scheme}://host1:26379,host2:26379/<master name>[/<db>]")
    sentinels = tuple(_sentinel_address(item, i, bad) for i, item in enumerate(hosts.split(","), 1))
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "" and len(path) > 1:
        path.pop()  # a trailing slash
    if not path or not path[0]:
        raise bad("names no master; add /<master name>[/<db>] after the sentinels, as in "
                  f"{scheme}://host1:26379,host2:26379/mymaster/0")
    if len(path) > 2:
        raise bad(f"the path must be /<master name>[/<db>], not {parts.path!r}")
    master = path[0]
    if len(path) == 2:
        if not (path[1].isascii() and path[1].isdigit()):
            raise bad(f"database {path[1]!r} is not a number")
        options["db"] = int(path[1])
    connection_class = SentinelManagedSSLConnection if scheme == "rediss+sentinel" else SentinelManagedConnection
    options["connection_class"] = _FOLLOWING[connection_class]
    sentinel_options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S,
                                        "socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_keepalive": True,
                                        "socket_keepalive_options": keepalive_options()}
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise bad(f"cannot read its options ({exc})") from None
    if "db" in query and "db" in options:
        raise RedisUrlError(_two_databases(url, path[1], "Sentinel"))
    for name, values in query.items():
        value = values[-1]
        if name in SENTINEL_OPTIONS:
            sentinel_options[name.removeprefix("sentinel_")] = value
            continue
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if parser else value
        except (TypeError, ValueError):
            raise bad(f"option {name}={value!r} is not valid") from None
    accepted = _accepted_options(connection_class) - {"host", "port", "connection_pool"}
    _check_options(url, options, accepted, "Sentinel")
    if scheme == "rediss+sentinel":  # the sentinels speak TLS too, checked the same way
        sentinel_options["ssl"] = True
        sentinel_options.update({k: v for k, v in options.items() if k.startswith("ssl_")})
    return RedisTarget(url, options, sentinels, master, sentinel_options)


def _sentinel_address(item: str, n: int, bad: Any) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, closed, rest = item[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise bad(f"sentinel {n} ({item!r}) is not host:port")
        port = rest[1:]
    else:
        host, _, port = item.partition(":")
        if ":" in port:
            raise bad(f"sentinel {n} ({item!r}) is not host:port (write an IPv6 address in brackets)")
    if not host:
        raise bad(f"sentinel {n} ({item!r}) has no host")
    if not port:
        return unquote(host), SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"sentinel {n} ({item!r}) has port {port!r}, which is not a port number")
    return unquote(host), int(port)


# ---------------------------------------------------------------------------- connections
def _not_primary(exc: ResponseError) -> bool:
    """A reply that says the server is no longer (or not) the primary."""
    return isinstance(exc, ReadOnlyError) or str(exc).startswith("UNBLOCKED")


class NotPrimaryError(RedisConnectionError):  # type: ignore[misc]  # redis-py is not type-checked here
    """The server answered as a replica: a failover is under way, or the URL names a replica."""


class DatabaseRefused(SystemExit):
    """The server refused the database the URL names (`SELECT 99`: "DB index is out of range").

    Not an outage to wait out, and no answer to any command will ever differ: the process stops.
    It is a SystemExit on purpose, so that no retry loop of a service (which go on after any
    `Exception`, logging it) turns it into a traceback a second, forever: the process ends with
    this one line (its `code`) and status 1, wherever the connection was made. `str()` is the
    line too; `address`, `db` and `reason` are its parts."""

    def __init__(self, address: str, db: int, reason: str) -> None:
        super().__init__(f"error: Redis at {address} refused database {db}: {reason}")
        self.address = address
        self.db = db
        self.reason = reason

    def __str__(self) -> str:
        return str(self.code)


class _FollowsFailover:
    """READONLY or UNBLOCKED from the server: close the connection and raise a ConnectionError.
    redis-py's retry then reconnects (a Sentinel connection asks the sentinels for the primary
    again) and, if that fails too, the caller treats it as a Redis outage.

    It also selects the database itself, after redis-py's own handshake, so that a refused
    SELECT is told apart from every other reply (`DatabaseRefused`)."""

    db: int
    socket_timeout: float | None

    async def on_connect(self) -> None:
        db = self.db
        self.db = 0  # redis-py's handshake without its SELECT, whose error reads like any other
        try:
            await super().on_connect()  # type: ignore[misc]
        finally:
            self.db = db
        if not db:
            return
        await self.send_command("SELECT", db)  # type: ignore[attr-defined]
        try:
            reply = await self.read_response()
        except ResponseError as exc:  # (READONLY and UNBLOCKED are a NotPrimaryError by now)
            await self.disconnect()  # type: ignore[attr-defined]
            raise DatabaseRefused(self._host_error(), db, str(exc)) from None  # type: ignore[attr-defined]
        if reply not in (b"OK", "OK"):
            raise RedisConnectionError(f"SELECT {db} answered {reply!r}")

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        """redis-py's send, bounded by `socket_timeout` with `asyncio.timeout` instead of its
        `asyncio.wait_for`, which on Python 3.11 can swallow the cancellation of the task that
        sends (cpython gh-86296): a gateway's heartbeat cancelled at shutdown went on, and the
        shutdown waited for it for good."""
        timeout = self.socket_timeout
        if not timeout:
            return await super().send_packed_command(command, check_health)  # type: ignore[misc,no-any-return]
        self.socket_timeout = None  # (redis-py's wait_for is skipped for it; a connect made here is within the bound)
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisTimeoutError(f"Redis at {self._host_error()} did not take a command "  # type: ignore[attr-defined]
                                    f"within {timeout:g} s") from None
        finally:
            self.socket_timeout = timeout

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except RedisTimeoutError:  # (`socket_timeout`'s: a timeout the caller gave returns None)
            if self.socket_timeout is None:
                raise
            raise RedisTimeoutError(f"Redis at {self._host_error()} did not answer within "  # type: ignore[attr-defined]
                                    f"{self.socket_timeout:g} s (socket_timeout)") from None
        except ResponseError as exc:
            if not _not_primary(exc):
                raise
            await self.disconnect()  # type: ignore[attr-defined]
            said = f"READONLY {exc}" if isinstance(exc, ReadOnlyError) else str(exc)  # redis-py drops the code
            raise NotPrimaryError(f"the server is not the primary ({said})") from exc


class FollowingConnection(_FollowsFailover, Connection):  # type: ignore[misc]
    pass


class FollowingSSLConnection(_FollowsFailover, SSLConnection):  # type: ignore[misc]
    pass


class FollowingUnixConnection(_FollowsFailover, UnixDomainSocketConnection):  # type: ignore[misc]
    pass


class FollowingSentinelConnection(_FollowsFailover, SentinelManagedConnection):  # type: ignore[misc]
    pass


class FollowingSentinelSSLConnection(_FollowsFailover, SentinelManagedSSLConnection):  # type: ignore[misc]
    pass


_FOLLOWING: dict[type, type] = {
    Connection: FollowingConnection,
    SSLConnection: FollowingSSLConnection,
    UnixDomainSocketConnection: FollowingUnixConnection,
    SentinelManagedConnection: FollowingSentinelConnection,
    SentinelManagedSSLConnection: FollowingSentinelSSLConnection,
}


class SentinelPool(Lined, SentinelConnectionPool):  # type: ignore[misc]
    """redis-py's pool of connections to the primary the sentinels name, with a `Line`
    (`common.redisline`), which also closes its connections to the sentinels when it is closed.

    From its first connection on, it follows the sentinels' announcements of a new primary
    (`common.failover`): when one comes, every connection to the old primary is closed at once,
    the lines' and those in use included, and each reconnects to the new one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = FailoverWatch(self.service_name, self.sentinel_manager.sentinels,
                                   lambda: self.master_address, self.switch_primary)

    async def get_master_address(self) -> Any:
        """Where the primary is: where the watch went, once it has an answer (a sentinel asked
        first may not have heard of the last failover yet; the watch only moves to a newer
        configuration), else what the first sentinel to name an available one says (`_discover`)."""
        self.watch.start()
        address: Any = self.watch.address
        if address is None:
            found = await self._discover()
            was = getattr(self, "master_address", None)
            if was is not None and found != was:
                await self.disconnect(inuse_connections=False)  # (idle ones reconnect there: redis-py's way)
            address = self.watch.primary(found)
        self.master_address = address
        return address

    async def _discover(self) -> tuple[str, int]:
        """Ask every sentinel at once where the primary is; the first to name one that is up (redis-py's
        `check_master_state`) is taken. Asked one after another, as redis-py does, a sentinel that took
        the connection and answered nothing held every new connection for its `SENTINEL_TIMEOUT_S`."""
        manager = self.sentinel_manager

        async def ask(sentinel: Any) -> tuple[str, int] | None:
            state = (await sentinel.sentinel_masters()).get(self.service_name)
            if state and manager.check_master_state(state, self.service_name):
                return str(state["ip"]), int(state["port"])
            return None

        asked = [asyncio.ensure_future(ask(s)) for s in manager.sentinels]
        failures: list[str] = []
        try:
            for answer in asyncio.as_completed(asked):
                try:
                    found = await answer
                except (RedisConnectionError, RedisTimeoutError, ResponseError, OSError) as exc:
                    # (a sentinel that refused the question: an ACL without +sentinel, a plain Redis)
                    failures.append(first_line(exc))
                    continue
                if found is not None:
                    return found
        finally:
            for task in asked:
                task.cancel()
            await asyncio.gather(*asked, return_exceptions=True)
        why = f" ({len(failures)} of {len(asked)} could not be asked: {failures[0]})" if failures else ""
        raise MasterNotFoundError(f"No master found for {self.service_name!r}: no sentinel named an available "
                                  f"primary{why}")

    async def switch_primary(self, address: tuple[str, int]) -> None:
        """The primary is at `address` now, as the watch's sentinel says: close every connection,
        in use or not, the lines' too (each reconnects when next used, to `address`:
        `watch.primary`)."""
        self.master_address = address
        connections = [*self._available_connections, *self._in_use_connections]
        try:
            await asyncio.gather(*(c.disconnect() for c in connections), return_exceptions=True)
        finally:
            await self.close_lines()

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the whole pool is closing, not just a switch to a new primary
            await self.watch.close()
            await asyncio.gather(*(s.aclose() for s in self.sentinel_manager.sentinels), return_exceptions=True)


def connection_pool(url: str, *, max_connections: int | None = None, pool_class: type = LinedPool,
                    sentinel_pool_class: type = SentinelPool, client_name: str | None = None) -> Any:
    """A pool of connections to the server the URL names, or to the primary its sentinels name,
    with `client_options`. `pool_class` / `sentinel_pool_class` (a `SentinelPool`) make it; both
    have a `Line` (`common.redisline`) that `Scripts` sends its calls over.
    `client_name` names its connections in Redis's `CLIENT LIST` (`iop-gateway`, …)."""
    target = parse_redis_url(url)
    # (what the connection class does not take is left out: a Unix socket has no TCP keepalive)
    accepted = _accepted_options(target.options["connection_class"])
    options = {**{k: v for k, v in client_options().items() if k in accepted}, **target.options}
    if max_connections is not None:
        options["max_connections"] = max_connections
    if client_name is not None:
        options.setdefault("client_name", client_name)
    if not target.sentinels:
        return pool_class(**options)
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_options)
    return sentinel_pool_class(target.master, manager, **options)


def connect(url: str, *, max_connections: int | None = None, client_name: str | None = None) -> Redis:
    """A client over `connection_pool(url)`; closing it closes the pool."""
    return Redis.from_pool(connection_pool(url, max_connections=max_connections, client_name=client_name))


class Backoff:
    """The pause between retries while Redis is away: doubles from `first` up to `cap`,
    and starts over after a success (`reset`)."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def reset(self) -> None:
        self.delay = self.first

    def take(self) -> float:
        """The pause to make now; the next is twice as long, up to `cap`."""
        delay = self.delay
        self.delay = min(self.delay * 2, self.cap)
        return delay

    async def pause(self) -> None:
        await asyncio.sleep(self.take())


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def text(value: bytes | str | None) -> str | None:
    """Decode a Redis reply that holds a plain string."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def id_set(value: bytes | None) -> frozenset[str]:
    """A comma-separated list of ids in a record or stream field (`tried`, `refuse`), as a set."""
    return frozenset(value.decode().split(",")) - {""} if value else frozenset()


def as_text_map(raw: dict[bytes, bytes]) -> dict[str, str]:
    """HGETALL reply of a plain-string hash, decoded."""
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
