"""A gateway without keys answers over loopback only to the names that are its own (DNS rebinding),
over real HTTP on port 0 with a real Redis."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import TestServer, make_mocked_request
from redis.asyncio import Redis

from common import keys
from common.auth import hash_key
from common.config import ConfigError, parse_config
from gateway.app import build_app
from gateway.errors import ApiError
from gateway.hosts import ALLOWED, MAX_REMEMBERED, Names, refuse_foreign_host
from tests.openapi import validate
from tests.test_access import CALLER, bearer, pool
from tests.test_scheduler import beat

CHAT = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def start(redis: Redis, redis_url: str) -> AsyncIterator[Callable[[dict[str, Any]], Any]]:
    servers: list[TestServer] = []

    async def started(config: dict[str, Any]) -> str:
        config["runtime"] = {"stream_keepalive_ms": 100, **config.get("runtime", {})}
        cfg = parse_config(config)
        await beat(redis, cfg)
        server = TestServer(build_app(cfg, redis_url), host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield started
    for server in servers:
        await server.close()


async def status_of(http: aiohttp.ClientSession, url: str, host: str, **headers: str) -> tuple[int, Any]:
    async with http.get(url + "/v1/models", headers={"Host": host, **headers}) as resp:
        return resp.status, await resp.json()


async def test_a_keyless_gateway_answers_only_its_own_names(start: Any, redis: Redis) -> None:
    url = await start(pool())
    port = url.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as http:
        for host in (f"evil.example:{port}", "evil.example", "localhost.evil.example", "127.0.0.1.nip.io", "local",
                     "evil.example.local.evil.example"):
            status, body = await status_of(http, url, host)
            assert status == 403 and body["error"]["code"] == "host_not_allowed", host
            assert "runtime.allowed_hosts" in body["error"]["message"]
            validate("ErrorResponse", body)
        async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"}) as resp:
            assert resp.status == 403  # (no run started for the page)
        assert await redis.xlen(keys.runs_stream("qwen3.6:35b")) == 0 and not await redis.keys("iop:run:*")
        for host in (f"127.0.0.1:{port}", f"LOCALHOST:{port}", "app.localhost", "box.local", "gpu-1.internal",
                     f"localhost.:{port}", f"[::1]:{port}", "10.1.2.3", socket.gethostname(),
                     socket.gethostname().upper()):
            assert (await status_of(http, url, host))[0] == 200, host


async def test_the_names_listed_and_any_with_a_star(start: Any) -> None:
    url = await start({**pool(), "runtime": {"allowed_hosts": ["IOP.example.com"]}})
    star = await start({**pool(), "runtime": {"allowed_hosts": ["*"]}})
    async with aiohttp.ClientSession() as http:
        assert (await status_of(http, url, "iop.example.com:443"))[0] == 200
        assert (await status_of(http, url, "other.example.com"))[0] == 403
        assert (await status_of(http, star, "anything.example"))[0] == 200


async def test_a_gateway_with_keys_answers_any_name(start: Any) -> None:
    """(a page has no key to send: its requests are 401s whatever name they use)"""
    url = await start(pool({"keys": [{"name": "team-a", "sha256": hash_key(CALLER)}]}))
    async with aiohttp.ClientSession() as http:
        assert (await status_of(http, url, "evil.example", **bearer(CALLER)))[0] == 200
        assert (await status_of(http, url, "evil.example"))[0] == 401


@pytest.mark.parametrize(("local", "refused"), [(("127.0.0.1", 8000), True), (("::1", 8000, 0, 0), True),
                                                (("10.0.0.5", 8000), False), (("fe80::1%eth0", 8000, 0, 2), False),
                                                ("/run/iop.sock", False)])
def test_only_a_request_that_came_over_loopback_is_checked(local: Any, refused: bool) -> None:
    """(one from another machine reached a gateway told to serve anyone: `--allow-anonymous`)"""
    app: Any = {ALLOWED: Names(frozenset())}
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name: local if name == "sockname" else None
    request = make_mocked_request("GET", "/v1/models", headers={"Host": "evil.example"}, app=app,
                                  transport=transport)
    if refused:
        with pytest.raises(ApiError):
            refuse_foreign_host(request)
    else:
        refuse_foreign_host(request)


def test_the_good_names_remembered_are_few_and_only_good() -> None:
    names = Names(frozenset({"iop.example.com"}))
    assert all(names.answers(f"127.0.0.{i}:8080") for i in range(100))
    assert len(names.good) == MAX_REMEMBERED
    assert not names.answers("evil.example") and not names.answers("evil.example")
    assert names.answers("IOP.example.com:8443") and not names.answers("iop.example.com.evil.example")


@pytest.mark.parametrize("host", ["http://iop.example.com", "iop.example.com:443", "a b", "", "-x"])
def test_a_name_that_is_not_a_host_name_is_a_config_fault(host: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**pool(), "runtime": {"allowed_hosts": ["ok.example", host]}})
    said = "runtime.allowed_hosts[1]: must be a host name (iop.example.com: no scheme, no port) or *, got"
    assert any(e.startswith(said) for e in err.value.errors), err.value.errors
