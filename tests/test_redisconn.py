"""common.redisconn: the one Redis URL parser (plain and Sentinel), the pools every client is built
on, a server that is not the primary treated as an outage, and the retry pause while Redis is away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from arq.connections import ArqRedis
from redis.asyncio.sentinel import SentinelConnectionPool

from common import failover
from common.config import parse_config
from common.redisconn import (
    REDIS_DOWN,
    Backoff,
    DatabaseRefused,
    FollowingConnection,
    FollowingSentinelConnection,
    FollowingSentinelSSLConnection,
    FollowingSSLConnection,
    FollowingUnixConnection,
    NotPrimaryError,
    RedisUrlError,
    SentinelPool,
    connect,
    connection_pool,
    parse_redis_url,
    redact,
)
from common.redisline import Line, LinedPool, line_of
from common.scripts import Scripts
from gateway.app import build_app
from gateway.redis_pool import SentinelTrimmedPool, TrimmedPool, gateway_redis
from iop.embedded_redis import RedisServer
from tests.conftest import async_wait_until
from workers.arq_worker import arq_redis


async def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(first=0.001, cap=0.004)
    seen = []
    for _ in range(4):
        seen.append(backoff.delay)
        await backoff.pause()
    assert seen == [0.001, 0.002, 0.004, 0.004]
    backoff.reset()
    assert backoff.delay == 0.001


# ---------------------------------------------------------------------------- URLs
def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    target = parse_redis_url("redis+sentinel://:p%40ss@h1:26380,h2,[::1]:26381/mymaster/2")
    assert target.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert target.master == "mymaster"
    assert target.options["db"] == 2
    assert target.options["password"] == "p@ss"  # the Redis servers' password, percent-decoded
    assert target.options["connection_class"] is FollowingSentinelConnection
    assert "password" not in target.sentinel_options  # the sentinels get none unless told
    assert not target.tls


def test_a_sentinel_url_without_a_database_uses_0_and_ignores_a_trailing_slash() -> None:
    for url in ("redis+sentinel://h1/mymaster", "redis+sentinel://h1/mymaster/"):
        target = parse_redis_url(url)
        assert (target.master, target.options.get("db", 0)) == ("mymaster", 0)


def test_a_tls_sentinel_url_speaks_tls_to_the_sentinels_and_the_servers_and_has_its_own_sentinel_login() -> None:
    target = parse_redis_url("rediss+sentinel://app:pw@h1:26379,h2:26379/mymaster/0?ssl_ca_certs=/etc/ca.crt"
                             "&sentinel_username=watcher&sentinel_password=s%26cret")
    assert target.tls and target.options["connection_class"] is FollowingSentinelSSLConnection
    assert (target.options["username"], target.options["password"]) == ("app", "pw")
    assert target.options["ssl_ca_certs"] == "/etc/ca.crt"
    assert target.sentinel_options["ssl"] is True
    assert target.sentinel_options["ssl_ca_certs"] == "/etc/ca.crt"
    assert (target.sentinel_options["username"], target.sentinel_options["password"]) == ("watcher", "s&cret")
    assert "sentinel_password" not in target.options


@pytest.mark.parametrize(("url", "connection_class", "expected"), [
    ("redis://:pw@cache:6380/3", FollowingConnection, {"host": "cache", "port": 6380, "db": 3, "password": "pw"}),
    ("rediss://cache/0?ssl_ca_certs=/ca.crt", FollowingSSLConnection, {"host": "cache", "ssl_ca_certs": "/ca.crt"}),
    ("unix:///run/redis.sock?db=1", FollowingUnixConnection, {"path": "/run/redis.sock", "db": 1}),
])
def test_plain_urls_keep_redis_py_s_meaning(url: str, connection_class: type, expected: dict[str, Any]) -> None:
    target = parse_redis_url(url)
    assert not target.sentinels
    assert target.options["connection_class"] is connection_class
    assert {k: target.options[k] for k in expected} == expected


@pytest.mark.parametrize(("url", "says"), [
    ("", "has no scheme; use one of redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://"),
    ("http://:secret@h:6379/0", "has scheme 'http://'"),
    ("redis://:secret@h:99999/0", "Port out of range"),
    ("redis://:secret@h/0?sentinel_password=x", "option 'sentinel_password' is only for redis+sentinel://"),
    ("redis://:secret@h/0?ssl_ca_certs=/ca.crt", "unknown option 'ssl_ca_certs' (TLS options need rediss://"),
    ("redis://:secret@h/0?colour=blue", "unknown option 'colour'"),
    ("redis://:secret@h/0?protocol=3", "option protocol=3 is not supported; iop speaks RESP2"),
    ("unix:///run/redis.sock?db=1&protocol=3", "option protocol=3 is not supported"),
    ("redis+sentinel://:secret@h1/mymaster/0?protocol=3", "option protocol=3 is not supported"),
    ("redis://:secret@h:6379/abc", "the path '/abc' is not a database number"),  # was database 0
    ("redis://:secret@h:6379/1/2", "the path '/1/2' is not a database number"),  # was database 12
    ("rediss://:secret@h/-1?ssl_ca_certs=/ca.crt", "the path '/-1' is not a database number"),
    ("redis://:secret@h/%C2%B2", "the path '/²' is not a database number"),  # a digit to isdigit, not to int
    ("redis+sentinel://:secret@/mymaster/0", "names no sentinel"),
    ("redis+sentinel://:secret@h1:26379,h2:26379", "names no master; add /<master name>[/<db>]"),
    ("redis+sentinel://:secret@h1:26379,h2:26379/", "names no master"),
    ("redis+sentinel://:secret@h1:2637x/mymaster", "sentinel 1 ('h1:2637x') has port '2637x'"),
    ("redis+sentinel://:secret@h1,:26379/mymaster", "sentinel 2 (':26379') has no host"),
    ("redis+sentinel://:secret@h1,,h3/mymaster", "sentinel 2 ('') has no host"),
    ("redis+sentinel://:secret@::1:26379/mymaster", "write an IPv6 address in brackets"),
    ("redis+sentinel://:secret@h1/mymaster/zero", "database 'zero' is not a number"),
    ("redis+sentinel://:secret@h1/mymaster/%C2%B2", "database '²' is not a number"),
    ("redis+sentinel://:secret@h1/mymaster/0/extra", "the path must be /<master name>[/<db>]"),
    ("redis+sentinel://:secret@h1/mymaster/0?socket_timeout=soon", "option socket_timeout='soon' is not valid"),
    ("redis://:secret@h/0?socket_timeout=0", "option socket_timeout=0.0 is not a number of seconds above 0"),
    ("redis://:secret@h/0?socket_connect_timeout=-1", "option socket_connect_timeout=-1.0 is not a number of seconds"),
    ("redis://:secret@h/0?socket_timeout=nan", "option socket_timeout=nan is not a number of seconds above 0"),
    ("redis+sentinel://:secret@h1/mymaster/0?socket_timeout=0", "option socket_timeout=0.0 is not a number"),
    ("redis+sentinel://:secret@h1/mymaster/0?ssl_ca_certs=/ca.crt", "unknown option 'ssl_ca_certs' (TLS options"),
    ("redis+sentinel://:secret@h1/mymaster/0?colour=blue", "unknown option 'colour'"),
    # (redis-py took ?db= over the path, silently; found by a Sentinel/TLS audit)
    ("redis://:secret@h:6379/8?db=10", "names its database twice (the path's 8 and ?db=): keep one"),
    ("redis+sentinel://:secret@h1/mymaster/5?db=7", "Sentinel URL 'redis+sentinel://:***@h1/mymaster/5?db=7' names "
     "its database twice"),
    # a password with a '/', '?' or '#' not percent-encoded: the host seemed to end inside it, and the
    # error quoted it whole, and its pieces (found by a Sentinel audit: "sentinel 1 (':se') has no host")
    ("redis+sentinel://:se/cret@h1,h2/mymaster/0", "'redis+sentinel://:***@h1,h2/mymaster/0': its password seems "
     "to hold '/', '?' or '#'; percent-encode them (%2F, %3F, %23)"),
    ("redis://:se/cret@h:6379/0", "'redis://:***@h:6379/0': its password seems to hold"),
    ("redis://user:se?c#ret@h/0", "'redis://user:***@h/0': its password seems to hold"),
])
def test_a_malformed_url_gets_one_line_naming_what_is_wrong_and_never_the_password(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError) as err:
        parse_redis_url(url)
    message = str(err.value)
    assert says in message
    assert "\n" not in message and "secret" not in message and "cret" not in message


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:pw@h/0?password=x&db=1", "redis://user:***@h/0?password=***&db=1"),
    ("redis+sentinel://:pw@h1,h2/m/0?sentinel_password=spw", "redis+sentinel://:***@h1,h2/m/0?sentinel_password=***"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis+sentinel://:se/cr@t@h1,h2/m/0", "redis+sentinel://:***@h1,h2/m/0"),  # (one not percent-encoded)
    ("redis://u:p?w#d@h:6379/1", "redis://u:***@h:6379/1"),
    ("redis://:SE@C/RET@host/0", "redis://:***@host/0"),
    # an option's value may hold an '@' (a review found the end of these shown: ':***@SECRETTAIL')
    ("redis://127.0.0.1:1/0?password=hunter2@SECRETTAIL", "redis://127.0.0.1:1/0?password=***"),
    ("rediss+sentinel://h1:26379/mymaster?sentinel_password=p@ssw0rd", "rediss+sentinel://h1:26379/mymaster?"
     "sentinel_password=***"),
    ("redis://[::1]:6379/0?password=a@b", "redis://[::1]:6379/0?password=***"),
])
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown


# ---------------------------------------------------------------------------- pools
async def test_every_client_is_built_on_a_sentinel_pool_from_a_sentinel_url() -> None:
    url = "redis+sentinel://h1:26379,h2:26379/mymaster/0?sentinel_password=spw"
    plain = connection_pool("redis://127.0.0.1:6379/0")
    assert type(plain) is LinedPool and plain.connection_class is FollowingConnection
    pool = connection_pool(url)
    assert isinstance(pool, SentinelPool) and pool.service_name == "mymaster"
    assert all(isinstance(p.line, Line) for p in (plain, pool))
    assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [26379, 26379]
    assert pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
    redis, trimmed = gateway_redis(url, max_connections=7)
    assert isinstance(trimmed, SentinelTrimmedPool)
    assert isinstance(trimmed, TrimmedPool) and isinstance(trimmed, SentinelConnectionPool)
    assert line_of(redis) is trimmed.line
    assert trimmed.max_connections == 7 and redis.connection_pool is trimmed
    arq = arq_redis(url)
    assert isinstance(arq, ArqRedis) and isinstance(arq.connection_pool, SentinelPool)
    for closing in (plain.disconnect(), pool.disconnect(), redis.aclose(), arq.aclose(close_connection_pool=True)):
        await closing


# ---------------------------------------------------------------------------- a server that is not the primary
@pytest.fixture
def primary_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    primary, replica = RedisServer().start(), RedisServer().start()
    try:
        with _sync(replica) as r:
            r.replicaof("127.0.0.1", primary.port)
        yield primary, replica
    finally:
        replica.cleanup()
        primary.cleanup()


def _sync(server: RedisServer) -> Any:
    import redis as sync_redis

    return sync_redis.Redis.from_url(server.url, socket_timeout=5)


async def test_a_script_run_on_a_replica_is_an_outage_not_a_crash(
        primary_and_replica: tuple[RedisServer, RedisServer]) -> None:
    primary, replica = primary_and_replica
    with _sync(primary) as r, _sync(replica) as rr:  # a heartbeat, so that the script gets to write
        r.hset("iop:provider:p", "health", "available")
        await _until(lambda: rr.hget("iop:provider:p", "health") == b"available")
    redis = connect(replica.url)
    try:
        with pytest.raises(NotPrimaryError, match="not the primary.*READONLY") as err:
            # the replica has no scripts: NOSCRIPT loads them, then the write inside is refused
            await Scripts(redis).call(
                "enqueue", ["iop:runs:m", "iop:run:r", "iop:inflight:k", "iop:requests:k", "iop:provider:p"],
                ["r", 1, 60, "m", "chat", "0", b"", "k", 0, 0, 60_000, 1, "gw"])
        assert isinstance(err.value, REDIS_DOWN)
    finally:
        await redis.aclose()


async def test_a_blocked_command_on_a_primary_that_is_demoted_is_an_outage(
        primary_and_replica: tuple[RedisServer, RedisServer]) -> None:
    primary, replica = primary_and_replica
    redis = connect(primary.url)
    try:
        blocked = asyncio.create_task(redis.blpop(["iop:wake:n1"], timeout=0))
        with _sync(primary) as r:
            await _until(lambda: r.info("clients")["blocked_clients"] == 1)
            with _sync(replica) as other:
                other.replicaof("no", "one")
            r.replicaof("127.0.0.1", replica.port)  # Redis answers the blocked BLPOP with UNBLOCKED
        with pytest.raises(NotPrimaryError, match="not the primary"):
            await asyncio.wait_for(blocked, timeout=30)
    finally:
        await redis.aclose()


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def gateway_on_replica(primary_and_replica: tuple[RedisServer, RedisServer]) -> AsyncIterator[str]:
    config = parse_config({
        "models": [{"id": "m", "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
    })
    primary, replica = primary_and_replica
    with _sync(primary) as r, _sync(replica) as rr:  # a heartbeat, so that the enqueue script gets to write
        r.hset("iop:provider:p", "health", "available")
        await _until(lambda: rr.hget("iop:provider:p", "health") == b"available")
    server = TestServer(build_app(config, replica.url), port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_a_gateway_on_a_replica_answers_503_service_unavailable(gateway_on_replica: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(
            gateway_on_replica + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as resp:
        body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "service_unavailable", body


def test_a_redis_url_cannot_be_used_without_a_clear_error_from_the_cli() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "iop", "queues", "--config", "examples/demo.yaml", "--redis",
                           "redis+sentinel://:secret@h1:26379,h2:26379"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --redis: Sentinel URL 'redis+sentinel://:***@h1:26379,h2:26379': names no master; add "
        "/<master name>[/<db>] after the sentinels, as in redis+sentinel://host1:26379,host2:26379/mymaster/0"]



@pytest.mark.parametrize("db", ["99", "16"])
async def test_a_database_the_server_refuses_is_not_an_outage_and_no_exception_swallows_it(
        redis_url: str, db: str) -> None:
    """`SELECT 99` refused: a `DatabaseRefused`, which no service's retry loop (`except REDIS_DOWN`, or
    `except Exception`) takes for a Redis to wait for, naming the server and the database."""
    client = connect(redis_url.rpartition("/")[0] + f"/{db}")
    try:
        with pytest.raises(DatabaseRefused) as refused:
            try:
                await client.ping()
            except (Exception, *REDIS_DOWN) as exc:  # what the services retry forever
                pytest.fail(f"a refused database was retried as {exc!r}")
    finally:
        await client.aclose()
    address = redis_url.split("//", 1)[1].split("/", 1)[0]
    assert str(refused.value) == f"error: Redis at {address} refused database {db}: DB index is out of range"
    assert isinstance(refused.value, SystemExit) and refused.value.code == str(refused.value)


async def test_a_database_the_server_has_is_selected(redis_url: str) -> None:
    client = connect(redis_url.rpartition("/")[0] + "/3")
    other = connect(redis_url)
    try:
        await client.set("where", "db3")
        assert await other.get("where") is None
        assert (await client.client_info())["db"] == 3
    finally:
        await client.aclose()
        await other.aclose()


async def silent_sentinels(asked: list[int]) -> list[asyncio.Server]:
    """Three sentinels that take connections and never answer (paused: SIGSTOP), but redis-py's first
    words on a connection; `asked` gets the number of each asked where the primary is by a lookup."""
    def silent(n: int) -> Any:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := (await reader.read(4096)).upper():  # (until the client closes)
                writer.write(b"+OK\r\n" * data.count(b"SETINFO"))
                if b"MASTERS" in data:  # (`SENTINEL MASTERS`: the failover watch asks otherwise)
                    asked.append(n)
            writer.close()
        return serve

    return [await asyncio.start_server(silent(n), "127.0.0.1", 0) for n in range(3)]


async def test_sentinels_that_take_connections_and_never_answer_are_each_asked_once() -> None:
    """Sentinels paused (SIGSTOP: the kernel takes their connections, nobody answers) were asked one
    after another, each for its 2 s, and the lookup was made four times: each command waited about
    24 s (a gateway's request 105 s), and failed with redis-py's reprs of every client. Each is asked
    once (all at once), and the command fails saying so in one line."""
    asked: list[int] = []
    servers = await silent_sentinels(asked)
    hosts = ",".join(f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    redis = connect(f"redis+sentinel://{hosts}/mymaster/0")
    try:
        with pytest.raises(REDIS_DOWN) as err:
            await redis.ping()
    finally:
        await redis.aclose()
        for server in servers:
            server.close()
    assert str(err.value).startswith("No master found for 'mymaster': no sentinel named an available primary "
                                     "(3 of 3 could not be asked: Timeout reading from 127.0.0.1:")
    assert "<" not in str(err.value) and "\n" not in str(err.value)
    assert sorted(asked) == [0, 1, 2]  # once each (it was 4 times each)


async def test_losing_every_sentinel_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """(It was logged at DEBUG only: sentinels paused under load for 10 s left no line in any log.)"""
    monkeypatch.setattr(failover, "ANSWER_WITHIN_S", 0.05)
    servers = await silent_sentinels([])
    hosts = ",".join(f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    redis = connect(f"redis+sentinel://{hosts}/mymaster/0")
    try:
        with pytest.raises(REDIS_DOWN):
            await redis.ping()  # (its lookup starts the watch)

        async def said() -> bool:
            return any("no sentinel of mymaster can be followed" in r.getMessage() for r in caplog.records)

        await async_wait_until(said, what="the warning")
    finally:
        await redis.aclose()
        for server in servers:
            server.close()
    lost = [r.getMessage() for r in caplog.records if "can be followed" in r.getMessage()]
    assert len(lost) == 1 and lost[0].startswith("Redis Sentinel: no sentinel of mymaster can be followed (the last, "
                                                 "127.0.0.1:"), lost
