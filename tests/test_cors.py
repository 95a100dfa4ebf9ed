"""Pages of other sites calling the gateway (CORS), over real HTTP on port 0 with a real Redis: off
unless `runtime.cors_origins` lists the site; a listed site's preflight is answered without a key,
and every answer to it, errors and streams included, names the site."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from common import keys
from common.auth import hash_key
from common.config import ConfigError, parse_config
from gateway.app import build_app
from tests.openapi import validate
from tests.test_access import CALLER, bearer, pool
from tests.test_scheduler import beat

SITE = "https://app.example.com"
PREFLIGHT = {"Origin": SITE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"}
CHAT = {"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "hi"}]}


async def started(redis: Redis, redis_url: str, origins: list[str] | None) -> TestServer:
    config = pool({"keys": [{"name": "team-a", "sha256": hash_key(CALLER)}]})
    config["runtime"] = {"stream_keepalive_ms": 100, **({} if origins is None else {"cors_origins": origins})}
    cfg = parse_config(config)
    await beat(redis, cfg)
    server = TestServer(build_app(cfg, redis_url), port=0)
    await server.start_server()
    return server


@pytest.fixture
async def gateway(redis: Redis, redis_url: str) -> AsyncIterator[str]:
    server = await started(redis, redis_url, [SITE, "http://LocalHost:5173"])
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def test_a_listed_site_s_preflight_is_answered_without_a_key(gateway: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.options(gateway + "/v1/chat/completions", headers=PREFLIGHT) as resp:
            assert resp.status == 204
            assert resp.headers["Access-Control-Allow-Origin"] == SITE
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert resp.headers["Access-Control-Allow-Headers"] == PREFLIGHT["Access-Control-Request-Headers"]
            assert int(resp.headers["Access-Control-Max-Age"]) > 0
        # an unlisted site's preflight: refused as its POST would be, saying what to do (it was a 401 "an
        # API key is required", which a developer saw in the browser's network tab, though the page sent
        # its key: a preflight never carries it)
        other = {**PREFLIGHT, "Origin": "https://evil.example"}
        async with http.options(gateway + "/v1/chat/completions", headers=other) as resp:
            assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
            error = (await resp.json())["error"]
            assert error["code"] == "cross_site_request" and "runtime.cors_origins" in error["message"], error


async def test_every_answer_to_a_listed_site_names_it_errors_and_streams_too(gateway: str, redis: Redis) -> None:
    origin = {"Origin": SITE}
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway + "/v1/models", headers={**origin, **bearer(CALLER)}) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == SITE
            assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"]
        async with http.get(gateway + "/v1/models", headers=origin) as resp:  # no key: the page may read the 401
            assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == SITE
        # a stream (nothing serves the run: its keep-alive sends the headers)
        async with http.post(gateway + "/v1/chat/completions", json={**CHAT, "stream": True},
                             headers={**origin, **bearer(CALLER)}) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == SITE
            assert resp.headers["Vary"] == "Origin"
            assert (await resp.content.readline()).startswith(b": keep-alive")
        evil = {"Origin": "https://evil.example", **bearer(CALLER)}
        async with http.get(gateway + "/v1/models", headers=evil) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
            assert resp.headers["Vary"] == "Origin"  # (a cache must not give it to a listed site)
        local = {"Origin": "http://localhost:5173", **bearer(CALLER)}
        async with http.get(gateway + "/v1/models", headers=local) as resp:
            assert resp.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"  # (listed as LocalHost)


async def test_without_cors_origins_no_answer_names_a_site(redis: Redis, redis_url: str) -> None:
    server = await started(redis, redis_url, None)
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.options(url + "/v1/chat/completions", headers=PREFLIGHT) as resp:
                assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
            async with http.get(url + "/v1/models", headers={"Origin": SITE, **bearer(CALLER)}) as resp:
                assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    finally:
        await server.close()


async def test_any_site_with_a_star(redis: Redis, redis_url: str) -> None:
    server = await started(redis, redis_url, ["*"])
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http, http.options(url + "/v1/models", headers={
                **PREFLIGHT, "Origin": "http://anything.test:8000", "Access-Control-Request-Method": "GET"}) as resp:
            assert resp.status == 204 and resp.headers["Access-Control-Allow-Origin"] == "http://anything.test:8000"
    finally:
        await server.close()


async def test_a_page_of_another_site_cannot_start_a_run_on_a_gateway_without_keys(redis: Redis,
                                                                                   redis_url: str) -> None:
    """A browser sends a "simple" POST (`Content-Type: text/plain`, no preflight) from any page, with
    its `Origin`: a gateway without keys ran it, a hosted API's credits spent blind. Refused unless
    the page is the gateway's own site or a listed one; reads and clients that send no `Origin`
    (not browsers) are as before."""
    config = pool()
    config["runtime"] = {"stream_keepalive_ms": 100, "cors_origins": [SITE]}
    cfg = parse_config(config)
    await beat(redis, cfg)
    server = TestServer(build_app(cfg, redis_url), port=0)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    own = f"http://{server.host}:{server.port}"
    stream = json.dumps({**CHAT, "stream": True})
    plain = {"Content-Type": "text/plain"}
    try:
        async with aiohttp.ClientSession() as http:
            for origin in ("https://evil.example", "null", f"https://{server.host}:{server.port}.evil.example",
                           f"ftp://{server.host}:{server.port}"):
                async with http.post(url + "/v1/chat/completions", data=stream,
                                     headers={**plain, "Origin": origin}) as resp:
                    body = await resp.json()
                    assert resp.status == 403 and body["error"]["code"] == "cross_site_request", origin
                    assert "runtime.cors_origins" in body["error"]["message"]
                    validate("ErrorResponse", body)
            async with http.delete(url + "/v1/runs/run_x", headers={"Origin": "https://evil.example"}) as resp:
                assert resp.status == 403
            evil = {"Origin": "https://evil.example"}
            async with http.post(url + "/v1/admin/providers/p/drain", headers=evil) as resp:
                assert resp.status == 403
            assert await redis.xlen(keys.runs_stream("qwen3.6:35b")) == 0 and not await redis.keys("iop:run:*")
            assert not await redis.exists(keys.drained("p"))
            async with http.get(url + "/v1/models", headers={"Origin": "https://evil.example"}) as resp:
                assert resp.status == 200  # (a read: the page cannot see it)
            runs = set()
            for headers in ({}, {"Origin": own}, {"Origin": own.upper()}, {"Origin": SITE},
                            {"Origin": "https://iop.example.com", "X-Forwarded-Host": "iop.example.com"}):
                async with http.post(url + "/v1/chat/completions", data=stream, headers={**plain, **headers}) as resp:
                    assert resp.status == 200, headers
                    assert (await resp.content.readline()).startswith(b": keep-alive")
                    runs.add(resp.headers["X-IOP-Run-Id"])
            assert len(runs) == 5
    finally:
        await server.close()


@pytest.mark.parametrize("origin", ["app.example.com", "https://app.example.com/", "ftp://x", "https://a b", ""])
def test_a_site_that_is_not_an_origin_is_a_config_fault(origin: str) -> None:
    config: dict[str, Any] = {**pool(), "runtime": {"cors_origins": [SITE, origin]}}
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    said = "runtime.cors_origins[1]: must be a site as a browser's Origin names it"
    assert any(e.startswith(said) for e in err.value.errors), err.value.errors


def test_more_than_a_hundred_sites_is_a_config_fault() -> None:
    config: dict[str, Any] = {**pool(), "runtime": {"cors_origins": [f"https://s{i}.example" for i in range(101)]}}
    with pytest.raises(ConfigError) as err:
        parse_config(config)
    assert any(e.startswith("runtime.cors_origins: List should have at most 100 items") for e in err.value.errors), \
        err.value.errors


async def test_every_answer_says_nosniff(gateway: str) -> None:
    """A browser must take an answer as the type it says: JSON, an error's JSON carrying a
    provider's or a caller's text, the metrics' text, never sniffed into a page or a script."""
    async with aiohttp.ClientSession() as http:
        for method, path, headers in [("GET", "/v1/models", bearer(CALLER)), ("GET", "/v1/models", {}),
                                      ("GET", "/v1/runs/run_x%3Cscript%3E", bearer(CALLER)), ("GET", "/healthz", {}),
                                      ("POST", "/v1/chat/completions", bearer(CALLER)), ("GET", "/nowhere", {})]:
            async with http.request(method, gateway + path, headers=headers, data=b"<script>") as resp:
                assert resp.headers.get("X-Content-Type-Options") == "nosniff", (method, path, resp.status)
