"""Sentinel URLs with passwords (the servers' and the sentinels' own) and over TLS: every kind of
client iop makes (the services' own, the gateway's bounded pool, arq's) finds the primary through
the sentinel and works there."""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from common import failover
from common.redisconn import REDIS_DOWN, connect
from gateway.redis_pool import gateway_redis
from tests.conftest import async_wait_until
from tests.sentinel import LoneSentinel
from tests.tls import make_certificates
from workers.arq_worker import arq_redis

# An `unclosed` ResourceWarning of a redis-py connection, raised when the garbage collector met it,
# failed one of these tests now and then in CI (a plain connection, as to a sentinel, collected at an
# arbitrary later moment; not seen when the module runs alone; its maker not found). It is not
# judged here: `test_closed_clients_leave_no_connection_to_the_sentinel` judges what it is about,
# that a closed client leaves no connection open to the sentinel.
pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")]


@pytest.fixture(params=[False, True], ids=["plain", "tls"])
def lone(request: pytest.FixtureRequest) -> Iterator[LoneSentinel]:
    tls_dir = None
    if request.param:
        tls_dir = Path(tempfile.mkdtemp(prefix="iop-sentinel-tls-"))
        make_certificates(tls_dir)  # skips (or fails with IOP_REQUIRE_TLS=1) without openssl
    server = LoneSentinel(password="pw:of/the@servers", sentinel_password="pw-of-the-sentinels", tls_dir=tls_dir)
    try:
        yield server.start()
    finally:
        server.cleanup()
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


def _url(lone: LoneSentinel, sentinel_password: bool = True) -> str:
    from urllib.parse import quote

    query = ["socket_timeout=10"]  # as the README suggests against a primary that goes silent
    if sentinel_password:
        query.append(f"sentinel_password={quote(lone.sentinel_password)}")
    scheme = "redis+sentinel"
    if lone.tls_dir is not None:
        scheme = "rediss+sentinel"
        query.append(f"ssl_ca_certs={lone.tls_dir / 'ca.crt'}")
    return f"{scheme}://:{quote(lone.password, safe='')}@127.0.0.1:{lone.sentinel_port}/mymaster/0?{'&'.join(query)}"


async def _until_answers(client: Any) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        try:
            await client.ping()
            return
        except REDIS_DOWN:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)  # the servers are starting


async def test_every_kind_of_client_reaches_the_primary_through_the_sentinel(lone: LoneSentinel) -> None:
    url = _url(lone)
    redis = connect(url)
    gateway, _ = gateway_redis(url, max_connections=4)
    arq = arq_redis(url)
    try:
        await _until_answers(redis)
        await redis.set("iop:test", "through the sentinel")
        assert await gateway.get("iop:test") == b"through the sentinel"
        assert await arq.get("iop:test") == b"through the sentinel"
        assert redis.connection_pool.connection_kwargs["socket_timeout"] == 10.0
        info = await redis.info("server")
        assert (info["redis_mode"], int(info["tcp_port"])) == ("standalone", lone.port)  # the primary, not the sentinel
    finally:
        await redis.aclose()
        await gateway.aclose()
        await arq.aclose(close_connection_pool=True)


async def test_without_the_sentinels_password_no_primary_is_found(lone: LoneSentinel) -> None:
    good = connect(_url(lone))
    try:
        await _until_answers(good)
    finally:
        await good.aclose()
    redis = connect(_url(lone, sentinel_password=False))
    try:
        with pytest.raises(REDIS_DOWN, match="No master found for 'mymaster'"):
            await redis.ping()
    finally:
        await redis.aclose()


async def test_closed_clients_leave_no_connection_to_the_sentinel(lone: LoneSentinel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A client follows the sentinel over a subscription of its own; closing the client closes it,
    whether the subscription is being made or made, though the close cancels the watch again and
    again (one connection was left open: found at a later test's garbage collection). The close
    cancels again at once here, as on a machine too loaded to end the watch within its wait."""
    monkeypatch.setattr(failover, "CLOSE_TRY_S", 0)
    tls = {"ssl": True, "ssl_ca_certs": str(lone.tls_dir / "ca.crt")} if lone.tls_dir is not None else {}
    sentinel = Redis(host="127.0.0.1", port=lone.sentinel_port, password=lone.sentinel_password, **tls)

    async def others() -> list[dict[str, Any]]:
        return [c for c in await sentinel.client_list() if c["cmd"] != "client|list"]

    try:
        for i in range(12):
            client = connect(_url(lone))
            try:
                await _until_answers(client)
                if i % 2:  # (else closed while its subscription may still be being made)
                    await async_wait_until(
                        lambda: _subscribed(others), what="the client's subscription to the sentinel")
            finally:
                await client.aclose()
        gc.collect()
        assert await others() == []
    finally:
        await sentinel.aclose()


async def _subscribed(others: Any) -> bool:
    return any(c["cmd"] == "subscribe" for c in await others())


@pytest.mark.parametrize("lone", [False], indirect=True, ids=["plain"])
async def test_a_sentinel_that_refuses_the_question_does_not_fail_the_lookup(lone: LoneSentinel) -> None:
    """Every sentinel is asked at once: one that answers first with an error (an ACL without
    +sentinel: NOPERM; an address now of a plain Redis) ended the lookup, though another named the
    primary (found by a review: 4 of 10 first connections failed). Here the good sentinel is
    reached through a relay that holds the question until the refusal went out."""
    refused = asyncio.Event()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := (await reader.read(4096)).upper():
            if b"MASTERS" in data:
                writer.write(b"-NOPERM this user has no permissions to run the 'sentinel|masters' command\r\n")
                await writer.drain()
                refused.set()
            else:
                writer.write(b"+OK\r\n" * (data.startswith(b"*") + data.count(b"\r\n*")))  # (each command)
        writer.close()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, wait: bool) -> None:
        try:
            while data := await reader.read(65536):
                if wait:
                    await refused.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", lone.sentinel_port)
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)

    good = _url(lone)
    first = connect(good)
    try:
        await _until_answers(first)
    finally:
        await first.aclose()
    servers = [await asyncio.start_server(refuse, "127.0.0.1", 0), await asyncio.start_server(relay, "127.0.0.1", 0)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    both = good.replace(f"127.0.0.1:{lone.sentinel_port}/", f"127.0.0.1:{ports[1]},127.0.0.1:{ports[0]}/")
    redis = connect(both)
    try:
        assert await redis.ping()
        assert refused.is_set()
    finally:
        await redis.aclose()
        for server in servers:
            server.close()
