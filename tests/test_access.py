"""API keys at the gateway (real HTTP on port 0, a real Redis, no workers): who may call, which
models, whose runs, the operator routes, and limits that are exact in one atomic step."""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import json
import re
import unicodedata
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis
from yarl import URL

from common import keys
from common.auth import ApiKeyConfig, AuthConfig, KeyRing, UnresolvedKeys, hash_key
from common.config import MOST_COMPOSED, ConfigError, folded_name, parse_config
from common.scripts import _ENDED, _NOW, _UTC_DAY, _WRONG
from gateway.app import build_app
from gateway.runs import reset_text
from tests.conftest import async_wait_until
from tests.openapi import validate
from tests.test_gateway_hostile import read_response
from tests.test_scheduler import beat

MODELS = ("qwen3.6:35b", "llama3.3:70b")
CALLER, OTHER, OPERATOR = "sk-caller-7f3a9c1e5b", "sk-other-0d2b", "sk-operator-44e1"


def pool(auth: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [{"id": m, "providers": {"p": "p-served"}} for m in MODELS],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "queue": {"max_queue": 100},
    }
    if auth is not None:
        config["auth"] = auth
    return config


AUTH = {"keys": [
    {"name": "team-a", "sha256": hash_key(CALLER), "models": ["qwen3.6:35b"],
     "limits": {"max_in_flight": 2, "requests_per_minute": 3}},
    {"name": "team-b", "env": "IOP_TEST_OTHER_KEY"},
    {"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"},
]}


# ---------------------------------------------------------------------------- config, pure
@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda k: k.update(env="X"), "auth.keys[0]: give the key's sha256 or the env variable holding it"),
    (lambda k: k.pop("sha256"), "auth.keys[0]: give the key's sha256 or the env variable holding it"),
    (lambda k: k.update(sha256="abc"), "auth.keys[0].sha256: must be the key's SHA-256 in 64 hex digits"),
    (lambda k: k.update(models=["qwen3.6:35b", "nope"]),
     "auth.keys[0].models[1]: model 'nope' is not defined in models[]"),
    (lambda k: k.update(role="admin"), "auth.keys[0].role: Input should be 'caller' or 'operator', got 'admin'"),
    (lambda k: k.update(limits={"max_in_flight": 0}),
     "auth.keys[0].limits.max_in_flight: Input should be greater than or equal to 1"),
    (lambda k: k.update(limits={"rpm": 5}), "auth.keys[0].limits.rpm: unknown field"),
    (lambda k: k.update(name="has space"), "auth.keys[0].name: must be 1 to 64 letters, digits"),
    (lambda k: k.update(name="anonymous"), "auth.keys[0].name: 'anonymous' is what iop calls every caller when the "
     "config has no keys"),
    (lambda k: k.update(limits={"max_in_flight": 10**20}), "auth.keys[0].limits.max_in_flight: Input should be less"),
    (lambda k: k.update(limits={"requests_per_minute": 10**10}),
     "auth.keys[0].limits.requests_per_minute: Input should be less"),
])
def test_auth_faults_name_their_path(mutate: Any, expected: str) -> None:
    auth: dict[str, Any] = {"keys": [{"name": "team-a", "sha256": hash_key(CALLER)},
                                     {"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"}]}
    mutate(auth["keys"][0])
    with pytest.raises(ConfigError) as err:
        parse_config(pool(auth))
    assert any(e.startswith(expected) for e in err.value.errors), err.value.errors


def test_duplicate_names_and_keys_are_faults() -> None:
    auth = {"keys": [{"name": "a", "sha256": hash_key(CALLER)}, {"name": "a", "sha256": hash_key(CALLER)}]}
    with pytest.raises(ConfigError) as err:
        parse_config(pool(auth))
    assert err.value.errors == ["auth.keys[1].name: duplicate key name 'a' (first at auth.keys[0])",
                                "auth.keys[1].sha256: the same key as auth.keys[0]"]


def test_keys_resolve_from_hashes_and_the_environment() -> None:
    cfg = parse_config(pool(AUTH))
    assert cfg.auth is not None
    with pytest.raises(UnresolvedKeys) as err:
        KeyRing.from_config(cfg.auth, {})
    assert err.value.errors == ["auth.keys[1].env: the environment variable IOP_TEST_OTHER_KEY is not set"]
    with pytest.raises(UnresolvedKeys) as err:  # set but empty, as a copied .env.example leaves it
        KeyRing.from_config(cfg.auth, {"IOP_TEST_OTHER_KEY": ""})
    assert err.value.errors == ["auth.keys[1].env: the environment variable IOP_TEST_OTHER_KEY is empty "
                                "(`IOP_TEST_OTHER_KEY=` left unfilled in an env file?)"]
    ring = KeyRing.from_config(cfg.auth, {"IOP_TEST_OTHER_KEY": OTHER})
    caller, other, ops = ring.lookup(CALLER), ring.lookup(OTHER), ring.lookup(OPERATOR)
    assert caller is not None and caller.name == "team-a" and caller.models == frozenset({"qwen3.6:35b"})
    assert caller.max_in_flight == 2 and caller.requests_per_minute == 3 and not caller.operator
    assert other is not None and other.name == "team-b" and other.models is None
    assert ops is not None and ops.operator
    assert ring.lookup(CALLER + "x") is None and ring.lookup("") is None


@pytest.mark.parametrize(("value", "says"), [
    (OTHER + "\r", "starts or ends with whitespace (a line end of the file it came from?)"),
    (OTHER + "\n", "starts or ends with whitespace"),
    (" " + OTHER, "starts or ends with whitespace"),
    (OTHER[:8] + "\x00" + OTHER[8:], "a control character, which no HTTP header can carry"),
    (OTHER[:8] + "\x1b" + OTHER[8:], "a control character"),
])
def test_a_key_from_the_environment_that_no_request_could_present_stops_the_gateway(value: str, says: str) -> None:
    """The gateway strips the key a request sends, and a header carries no control character: such
    a key (a Windows line end from an env file, say) would match no request, every caller 401."""
    cfg = parse_config(pool(AUTH))
    assert cfg.auth is not None
    with pytest.raises(UnresolvedKeys) as err:
        KeyRing.from_config(cfg.auth, {"IOP_TEST_OTHER_KEY": value})
    assert len(err.value.errors) == 1, err.value.errors
    assert err.value.errors[0].startswith("auth.keys[1].env: the environment variable IOP_TEST_OTHER_KEY holds a key")
    assert says in err.value.errors[0] and value not in err.value.errors[0]  # (never the key itself)
    for inside in (" ", "\t"):  # (inside, a space or a tab may be sent)
        key = OTHER[:8] + inside + OTHER[8:]
        assert KeyRing.from_config(cfg.auth, {"IOP_TEST_OTHER_KEY": key}).lookup(key) is not None


def test_two_keys_that_resolve_to_the_same_key_stop_the_gateway() -> None:
    """The same key in two variables (or in a variable and as a hash) would be whichever key came
    last, maybe an operator: refused, naming both."""
    auth = {"keys": [{"name": "b", "env": "IOP_TEST_B"}, {"name": "c", "env": "IOP_TEST_C", "role": "operator"},
                     {"name": "d", "sha256": hash_key("shared")}]}
    cfg = parse_config(pool(auth))
    assert cfg.auth is not None
    with pytest.raises(UnresolvedKeys) as err:
        KeyRing.from_config(cfg.auth, {"IOP_TEST_B": "shared", "IOP_TEST_C": "shared"})
    assert err.value.errors == [
        "auth.keys[1].env: the same key as auth.keys[0] (each key must be different)",
        "auth.keys[2].sha256: the same key as auth.keys[0] (each key must be different)"]
    assert KeyRing.from_config(cfg.auth, {"IOP_TEST_B": "one", "IOP_TEST_C": "two"}).lookup("two") is not None


async def test_the_scripts_utc_day_is_pythons(redis: Redis) -> None:
    script = ("local now = 0\n" + _UTC_DAY
              + "local out = {} for i = 1, #ARGV do out[i] = utc_day(tonumber(ARGV[i])) end return out")
    moments = [0, 86_399_999, 86_400_000, 951_782_400_000, 1_709_164_800_000, 1_796_046_000_000, 4_107_542_399_999]
    moments += [int(dt.datetime(y, m, d, tzinfo=dt.UTC).timestamp() * 1000) + 1 for y in (1999, 2000, 2024, 2100)
                for m in (1, 2, 3, 12) for d in (1, 28)]
    days = await redis.eval(script, 0, *moments)
    assert [d.decode() for d in days] == [dt.datetime.fromtimestamp(ms / 1000, dt.UTC).date().isoformat()
                                          for ms in moments]


async def test_a_runs_end_adds_to_its_keys_day_and_total_exactly(redis: Redis) -> None:
    """`ended` adds a run to its key's day and all-time counts of its model: one run each, a
    failure only for a failed or timed-out run, the tokens when there are some (a count of zero is
    not written), exact integers also past what a Lua number prints plainly, and the day's TTL set
    when the day's first run of the model makes its count (not pushed back by the next)."""
    script = _NOW + _WRONG + _ENDED + "ended(KEYS[1], 'run_x', ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'm', '0') return 1"
    total = keys.usage_total("team-a")
    await redis.hset(total, mapping={"prompt_tokens:m": 10**15, "runs:other": 7})
    await redis.eval(script, 1, "iop:run:run_x", "completed", 3, 0, "team-a")
    [day] = await redis.keys(keys.usage_day("team-a", "*"))  # (Redis's day, not this process's)
    assert await redis.hgetall(day) == {b"runs:m": b"1", b"prompt_tokens:m": b"3"}
    assert keys.USAGE_RETENTION_S - 60 < await redis.ttl(day) <= keys.USAGE_RETENTION_S
    await redis.expire(day, 1000)
    await redis.eval(script, 1, "iop:run:run_x", "failed", 0, 4, "team-a")
    await redis.eval(script, 1, "iop:run:run_x", "timed_out", 2, 10**9, "team-a")
    await redis.eval(script, 1, "iop:run:run_x", "cancelled", 0, 0, "team-a")
    assert await redis.hgetall(day) == {b"runs:m": b"4", b"failures:m": b"2", b"prompt_tokens:m": b"5",
                                        b"completion_tokens:m": b"1000000004"}
    assert 990 <= await redis.ttl(day) <= 1000  # the day's first run set it; the others left it
    assert await redis.hgetall(total) == {b"runs:m": b"4", b"failures:m": b"2", b"prompt_tokens:m": b"1000000000000005",
                                          b"completion_tokens:m": b"1000000004", b"runs:other": b"7"}
    assert await redis.ttl(total) == -1  # all-time counts never expire


# ---------------------------------------------------------------------------- the HTTP surface
@pytest.fixture
async def gateway(redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    monkeypatch.setenv("IOP_TEST_OTHER_KEY", OTHER)
    cfg = parse_config(pool(AUTH))
    await beat(redis, cfg)
    server = TestServer(build_app(cfg, redis_url), port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(http: aiohttp.ClientSession, method: str, url: str, key: str | None = None,
               **kwargs: Any) -> tuple[int, Any, dict[str, str]]:
    async with http.request(method, url, headers=bearer(key) if key else {}, **kwargs) as resp:
        body = await resp.json(content_type=None) if resp.content_type == "application/json" else await resp.text()
        return resp.status, body, dict(resp.headers)


def chat(model: str = "qwen3.6:35b") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def submit(http: aiohttp.ClientSession, gateway: str, key: str, model: str = "qwen3.6:35b"
                 ) -> tuple[int, Any, dict[str, str]]:
    """A run request that is refused at once (its status, body, headers)."""
    return await call(http, "POST", gateway + "/v1/chat/completions", key, json=chat(model))


class Callers:
    """Run requests kept open while their runs wait (no workers): leaving would cancel them."""

    def __init__(self, http: aiohttp.ClientSession, gateway: str, redis: Redis) -> None:
        self.http, self.gateway, self.redis = http, gateway, redis
        self.tasks: list[asyncio.Task[tuple[int, Any, dict[str, str]]]] = []

    async def runs(self) -> list[str]:
        queued = [k for k in await self.redis.keys("iop:run:*") if await self.redis.hget(k, "state") == b"queued"]
        return sorted(k.decode().removeprefix("iop:run:") for k in queued)

    async def open(self, n: int, key: str) -> list[tuple[int, Any, dict[str, str]]]:
        """n requests at once; returns the answers of those refused once every one is refused or queued."""
        before = len(await self.runs())
        new = [asyncio.create_task(submit(self.http, self.gateway, key)) for _ in range(n)]
        self.tasks += new

        async def settled() -> bool:
            return sum(t.done() for t in new) + len(await self.runs()) - before == n

        await async_wait_until(settled, what=f"{n} requests refused or queued")
        return [t.result() for t in new if t.done()]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def callers(http: aiohttp.ClientSession, gateway: str, redis: Redis) -> AsyncIterator[Callers]:
    c = Callers(http, gateway, redis)
    yield c
    await c.close()


@pytest.mark.parametrize("path", ["/v1/models", "/v1/catalog", "/metrics", "/v1/usage", "/v1/runs/run_x"])
async def test_no_key_or_an_unknown_one_is_401_with_a_challenge(gateway: str, http: aiohttp.ClientSession,
                                                               path: str) -> None:
    for key in (None, "sk-wrong", CALLER[:-1]):
        status, body, headers = await call(http, "GET", gateway + path, key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (key, body)
        assert headers["WWW-Authenticate"].startswith("Bearer")
        validate("ErrorResponse", body)
        assert (key or "none") not in body["error"]["message"]  # a key is never echoed
    async with http.get(gateway + path, headers={"Authorization": f"Basic {CALLER}"}) as resp:
        assert resp.status == 401


@pytest.mark.parametrize("raw_key", [b"\xff", b"\x80abc", b"\xff\xfe" + CALLER.encode()])
async def test_a_key_that_is_not_utf8_is_401_not_an_internal_error(gateway: str, raw_key: bytes) -> None:
    # (hashing it raised UnicodeEncodeError: a 500 for anyone, with no key at all)
    url = URL(gateway)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + raw_key + b"\r\n\r\n")
        answer = await read_response(reader)
    finally:
        writer.close()
    assert answer.status == 401 and answer.error()["code"] == "invalid_api_key", answer


@pytest.mark.parametrize("second", [CALLER, "sk-wrong"])
async def test_two_authorization_headers_are_a_400_whichever_comes_first(gateway: str, second: str) -> None:
    url = URL(gateway)
    for first, then in ((CALLER, second), (second, CALLER)):
        reader, writer = await asyncio.open_connection(url.host, url.port)
        try:
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {first}\r\n"
                         f"Authorization: Bearer {then}\r\n\r\n".encode())
            answer = await read_response(reader)
        finally:
            writer.close()
        assert answer.status == 400 and answer.error()["code"] == "invalid_request_error", answer
        assert answer.error()["message"] == "send one Authorization header, not 2"
        validate("ErrorResponse", {"error": answer.error()})


@pytest.mark.parametrize(("key", "path", "status"), [
    (None, "/v1/chat/completions", 401), ("sk-not-a-key", "/v1/chat/completions", 401),
    (CALLER, "/v1/admin/providers/p/drain", 403), (CALLER, "/v1/chat/completions", 100)])
async def test_expect_100_continue_is_refused_before_the_body_when_the_key_is(
        gateway: str, key: str | None, path: str, status: int) -> None:
    """A client that asks before sending its body is told at once that its key will not do (it got
    100 Continue, sent the body, then the 401)."""
    url = URL(gateway)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        writer.write(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{auth}"
                     "Content-Length: 2\r\nExpect: 100-continue\r\n\r\n".encode())
        answer = await read_response(reader)
    finally:
        writer.close()
    assert answer.status == status, answer
    if status != 100:
        validate("ErrorResponse", {"error": answer.error()})


async def test_health_and_readiness_stay_open(gateway: str, http: aiohttp.ClientSession) -> None:
    for path in ("/healthz", "/readyz"):
        status, _, _ = await call(http, "GET", gateway + path)
        assert status == 200


async def test_a_caller_sees_only_its_models(gateway: str, http: aiohttp.ClientSession, redis: Redis) -> None:
    status, listing, _ = await call(http, "GET", gateway + "/v1/models", CALLER)
    assert status == 200 and [m["id"] for m in listing["data"]] == ["qwen3.6:35b"]
    _, listing, _ = await call(http, "GET", gateway + "/v1/models", OTHER)
    assert [m["id"] for m in listing["data"]] == list(MODELS)
    hidden = await call(http, "GET", gateway + "/v1/models/llama3.3:70b", CALLER)
    missing = await call(http, "GET", gateway + "/v1/models/nope", CALLER)
    assert hidden[0] == missing[0] == 404
    assert hidden[1]["error"]["code"] == missing[1]["error"]["code"] == "model_not_found"
    status, body, _ = await submit(http, gateway, CALLER, "llama3.3:70b")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["message"] == missing[1]["error"]["message"].replace("nope", "llama3.3:70b")
    assert await redis.xlen(keys.runs_stream("llama3.3:70b")) == 0 and not await redis.keys("iop:run:*")
    # a name that differs from one the caller may use only in case or spaces: a 404 that names it,
    # and none for a model the caller may not use (its existence is not told)
    _, near, _ = await call(http, "GET", gateway + "/v1/models/QWEN3.6:35B%20", CALLER)
    assert near["error"]["message"] == 'the model "QWEN3.6:35B " does not exist (did you mean "qwen3.6:35b"?)'
    status, body, _ = await submit(http, gateway, CALLER, "Llama3.3:70B")
    assert status == 404 and body["error"]["message"] == 'the model "Llama3.3:70B" does not exist'
    status, body, _ = await submit(http, gateway, OTHER, "Llama3.3:70B")
    assert body["error"]["message"] == 'the model "Llama3.3:70B" does not exist (did you mean "llama3.3:70b"?)'


@pytest.mark.parametrize("path", ["/v1/catalog", "/metrics", "/v1/admin/providers/p/drain"])
async def test_operator_routes_refuse_a_caller_key(gateway: str, http: aiohttp.ClientSession, path: str) -> None:
    status, body, _ = await call(http, "GET", gateway + path, CALLER)
    assert status == 403 and body["error"]["code"] == "permission_denied"
    validate("ErrorResponse", body)
    assert f'may not use "{path}"' in body["error"]["message"]


async def test_a_refused_path_is_shown_quoted_and_cut(gateway: str, http: aiohttp.ClientSession) -> None:
    status, body, _ = await call(http, "GET", gateway + "/v1/admin/" + "%00" + "x" * 3000, CALLER)
    assert status == 403 and '"/v1/admin/\\u0000xxx' in body["error"]["message"]
    assert len(body["error"]["message"]) < 400


async def test_operators_reach_the_catalog_and_metrics(gateway: str, http: aiohttp.ClientSession) -> None:
    status, catalog, _ = await call(http, "GET", gateway + "/v1/catalog", OPERATOR)
    assert status == 200 and catalog["providers"][0]["id"] == "p"
    status, text, _ = await call(http, "GET", gateway + "/metrics", OPERATOR)
    assert status == 200 and "iop_gateway_requests_total" in text


async def test_the_catalog_page_asks_for_the_key_itself(gateway: str, http: aiohttp.ClientSession) -> None:
    status, page, _ = await call(http, "GET", gateway + "/catalog")  # a browser: no header
    assert status == 200 and "<html" in page
    assert (await call(http, "GET", gateway + "/catalog", CALLER))[0] == 403
    assert (await call(http, "GET", gateway + "/catalog", "sk-wrong"))[0] == 401


async def test_a_caller_sees_only_its_own_runs(gateway: str, http: aiohttp.ClientSession, redis: Redis,
                                               callers: Callers) -> None:
    assert await callers.open(1, CALLER) == []
    (run_id,) = await callers.runs()
    assert await redis.hget(keys.run_record(run_id), "key") == b"team-a"
    status, view, _ = await call(http, "GET", f"{gateway}/v1/runs/{run_id}", CALLER)
    assert status == 200 and view["key"] == "team-a" and "worker" not in view
    status, view, _ = await call(http, "GET", f"{gateway}/v1/runs/{run_id}", OPERATOR)
    assert status == 200 and "worker" in view
    for method, path in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
        status, body, _ = await call(http, method, f"{gateway}/v1/runs/{run_id}{path}", OTHER)
        assert status == 404 and body["error"]["code"] == "not_found", (method, path)
    assert await redis.hget(keys.run_record(run_id), "state") == b"queued"  # the other key's DELETE did nothing
    status, view, _ = await call(http, "DELETE", f"{gateway}/v1/runs/{run_id}", CALLER)
    assert status == 200 and view["state"] == "cancelled"


async def test_max_in_flight_is_exact_and_comes_back_when_runs_end(gateway: str, http: aiohttp.ClientSession,
                                                                   redis: Redis, callers: Callers) -> None:
    # team-a: max_in_flight 2; 5 requests at once, none of them served (no workers)
    refused = await callers.open(5, CALLER)
    assert len(refused) == 3 and len(await callers.runs()) == 2
    assert await redis.zcard(keys.key_in_flight("team-a")) == 2
    status, body, headers = refused[0]
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert body["error"]["message"] == ("key 'team-a' is at its max_in_flight: 2 runs queued or running at once; "
                                        "retry when one has ended")
    assert headers["Retry-After"] == "1" and headers["x-iop-limit"] == "max_in_flight"
    # (OpenAI's x-ratelimit-*-requests are a limit a minute: they said 2 here, and 3 on the same key's
    # accepted runs, its requests_per_minute; a new user's review)
    assert not any(name.lower().startswith("x-ratelimit-") for name in headers)
    # (the three refused together come back spread over a second, not all at the second: `spread`)
    assert all(1000 <= int(h["retry-after-ms"]) < 2000 for _, _, h in refused)
    validate("ErrorResponse", body)
    # the two queued runs end (cancelled): the key may run again
    for run_id in await callers.runs():
        assert (await call(http, "DELETE", f"{gateway}/v1/runs/{run_id}", CALLER))[0] == 200
    assert await redis.zcard(keys.key_in_flight("team-a")) == 0
    assert await callers.open(1, CALLER) == []  # queued again


@pytest.mark.parametrize(("ms", "text"), [(20, "20ms"), (0, "0ms"), (1000, "1s"), (1500, "1.5s"),
                                          (59_999, "59.999s"), (60_000, "1m0s"), (360_000, "6m0s")])
def test_a_wait_is_written_as_openai_s_reset_headers_write_it(ms: int, text: str) -> None:
    assert reset_text(ms) == text


async def test_requests_per_minute_is_a_sliding_window(gateway: str, http: aiohttp.ClientSession,
                                                       redis: Redis, callers: Callers) -> None:
    accepted = []
    for _ in range(3):  # team-a: 3 a minute; each run is cancelled at once, so max_in_flight never bites
        assert await callers.open(1, CALLER) == []
        (run_id,) = await callers.runs()
        accepted.append(run_id)
        await call(http, "DELETE", f"{gateway}/v1/runs/{run_id}", CALLER)
    status, body, headers = await submit(http, gateway, CALLER)
    assert status == 429 and headers["x-iop-limit"] == "requests_per_minute"
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert re.fullmatch(r"(\d+ms|(\d+m)?\d+(\.\d+)?s)", headers["x-ratelimit-reset-requests"])  # (OpenAI's 6m0s, 20ms)
    # move the clock: the oldest request leaves the window, and one more is allowed
    window = keys.key_requests("team-a")
    await redis.zadd(window, {accepted[0]: 1})
    assert await callers.open(1, CALLER) == []
    assert await redis.zcard(window) == 3


async def test_usage_is_a_callers_own_and_every_keys_for_an_operator(gateway: str, http: aiohttp.ClientSession,
                                                                     redis: Redis) -> None:
    today = dt.datetime.now(dt.UTC).date().isoformat()
    await redis.hset(keys.usage_day("team-a", today), mapping={"runs:qwen3.6:35b": 2, "prompt_tokens:qwen3.6:35b": 7,
                                                               "completion_tokens:qwen3.6:35b": 5})
    await redis.hset(keys.usage_day("team-b", today), mapping={"runs:llama3.3:70b": 1, "failures:llama3.3:70b": 1})
    status, own, _ = await call(http, "GET", gateway + "/v1/usage", CALLER)
    assert status == 200 and own["data"] == [
        {"object": "usage", "key": "team-a", "model": "qwen3.6:35b", "date": today, "runs": 2, "prompt_tokens": 7,
         "completion_tokens": 5, "total_tokens": 12, "failures": 0}]
    assert (await call(http, "GET", gateway + "/v1/usage?key=team-b", CALLER))[0] == 404
    _, every, _ = await call(http, "GET", gateway + "/v1/usage", OPERATOR)
    assert [(r["key"], r["model"]) for r in every["data"]] == [("team-a", "qwen3.6:35b"), ("team-b", "llama3.3:70b")]
    _, one, _ = await call(http, "GET", gateway + "/v1/usage?key=team-b&model=llama3.3:70b", OPERATOR)
    assert [r["failures"] for r in one["data"]] == [1]
    # a parameter given twice is refused, not taken at its first value (it answered team-a's usage alone)
    status, bad, _ = await call(http, "GET", gateway + "/v1/usage?key=team-a&key=team-b", OPERATOR)
    assert status == 400 and bad["error"]["param"] == "key", bad
    assert bad["error"]["message"] == "key: given 2 times; give it once"
    status, bad, _ = await call(http, "GET", gateway + "/v1/usage?start_date=2026-13-01", OPERATOR)
    assert status == 400 and "YYYY-MM-DD" in bad["error"]["message"]
    status, bad, _ = await call(http, "GET", gateway + "/v1/usage?start_date=2020-01-01&end_date=2026-01-01", OPERATOR)
    assert status == 400 and "at most 366 days" in bad["error"]["message"]
    status, bad, _ = await call(http, "GET", gateway + "/v1/usage?start_date=%00" + "x" * 7000, OPERATOR)
    assert status == 400 and '"\\u0000xxx' in bad["error"]["message"] and len(bad["error"]["message"]) < 200
    for query, param in [("end_date=0001-01-01", None), ("start_date=2026-W48-1", "start_date"),
                         ("end_date=20261130", "end_date"), ("start_date=2025-01-01", "start_date"),
                         ("start_date=2026-11-30&end_date=2026-11-01", "start_date")]:
        # (the first day there is, and no 500: the default start was computed before it; ISO week
        # dates and days without dashes are no YYYY-MM-DD; the end at fault is the one given)
        status, answer, _ = await call(http, "GET", gateway + "/v1/usage?" + query, OPERATOR)
        if param is None:
            assert status == 200 and answer["start_date"] == "0001-01-01" == answer["end_date"], answer
        else:
            assert status == 400 and answer["error"]["param"] == param, (query, answer)


async def test_an_operator_sees_the_usage_of_a_key_no_longer_in_the_config(gateway: str, http: aiohttp.ClientSession,
                                                                            redis: Redis) -> None:
    today = dt.datetime.now(dt.UTC).date().isoformat()
    await redis.hset(keys.usage_day("gone", today), mapping={"runs:qwen3.6:35b": 4})
    await redis.hset(keys.usage_total("gone"), mapping={"runs:qwen3.6:35b": 4})
    status, body, _ = await call(http, "GET", gateway + "/v1/usage?key=gone", OPERATOR)
    assert status == 200 and [(r["key"], r["runs"]) for r in body["data"]] == [("gone", 4)]
    assert (await call(http, "GET", gateway + "/v1/usage?key=gone", CALLER))[0] == 404
    assert (await call(http, "GET", gateway + "/v1/usage?key=never", OPERATOR))[0] == 404
    # a model the config lacks with no usage is a 404 too, as a key is (an empty answer read as "no usage"
    # of a typo: a new operator); one removed from the config whose usage is kept is shown
    status, body, _ = await call(http, "GET", gateway + "/v1/usage?model=Qwen3.6:35b", OPERATOR)
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model", body
    await redis.hset(keys.usage_day("team-a", today), mapping={"runs:retired-model": 1})
    status, body, _ = await call(http, "GET", gateway + "/v1/usage?model=retired-model", OPERATOR)
    assert status == 200 and [(r["key"], r["model"]) for r in body["data"]] == [("team-a", "retired-model")], body
    # a model a caller's key may not use, as everywhere: the same 404 as one there is not
    assert (await call(http, "GET", gateway + "/v1/usage?model=llama3.3:70b", CALLER))[0] == 404
    assert (await call(http, "GET", gateway + "/v1/usage?model=qwen3.6:35b", CALLER))[0] == 200


async def test_the_usage_lists_and_counters_follow_a_reload_of_the_keys(redis: Redis, redis_url: str,
                                                                        http: aiohttp.ClientSession) -> None:
    """The keys a gateway lists in `/v1/usage` and `/metrics` are those it holds now, as a reload of
    its config file left them (`gateway.keys_reload`): they were those it started with, so a key
    added since had no counters until a restart, and one revoked was still listed."""
    first = parse_config(pool({"keys": [{"name": "team-a", "sha256": hash_key(CALLER)},
                                        {"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"}]}))
    assert first.auth is not None
    ring = KeyRing.from_config(first.auth, {})
    server = TestServer(build_app(first, redis_url, ring), port=0)
    await server.start_server()
    try:
        gateway = str(server.make_url("")).rstrip("/")
        today = dt.datetime.now(dt.UTC).date().isoformat()
        for name in ("team-a", "team-c"):
            await redis.hset(keys.usage_day(name, today), mapping={"runs:qwen3.6:35b": 1})
            await redis.hset(keys.usage_total(name), mapping={"runs:qwen3.6:35b": 1})
        reloaded = parse_config(pool({"keys": [{"name": "team-c", "sha256": hash_key(OTHER)},
                                               {"name": "ops", "sha256": hash_key(OPERATOR), "role": "operator"}]}))
        assert reloaded.auth is not None
        ring.replace(KeyRing.from_config(reloaded.auth, {}))
        _, every, _ = await call(http, "GET", gateway + "/v1/usage", OPERATOR)
        assert [r["key"] for r in every["data"]] == ["team-c"], every
        _, text, _ = await call(http, "GET", gateway + "/metrics", OPERATOR)
        runs = re.findall(r'^iop_usage_runs_total\{key="([^"]+)"', text, re.M)
        assert runs == ["team-c"], runs
        # (a revoked key's usage is still there, asked for by name)
        _, gone, _ = await call(http, "GET", gateway + "/v1/usage?key=team-a", OPERATOR)
        assert [r["key"] for r in gone["data"]] == ["team-a"], gone
    finally:
        await server.close()


def test_iop_usage_shows_a_key_no_longer_in_the_config_by_name(redis_url: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import redis as sync_redis

    from iop import usage_cmd

    client = sync_redis.Redis.from_url(redis_url)
    today = dt.datetime.now(dt.UTC).date().isoformat()
    client.hset(keys.usage_day("anonymous", today), mapping={"runs:qwen3.6:35b": 35})
    client.hset(keys.usage_total("anonymous"), mapping={"runs:qwen3.6:35b": 35})
    client.close()
    config = parse_config(pool(AUTH))  # (it has keys now: `anonymous` is what ran before them)
    assert usage_cmd.main(config, redis_url, "anonymous", None, None, None, as_json=True) == 0
    assert [(r["key"], r["runs"]) for r in json.loads(capsys.readouterr().out)["data"]] == [("anonymous", 35)]
    assert usage_cmd.main(config, redis_url, "never", None, None, None, as_json=True) == 2
    assert "no key named 'never' in the config" in capsys.readouterr().err
    assert usage_cmd.main(config, redis_url, None, "Qwen3.6:35b", None, None, as_json=True) == 2
    assert "no model named 'Qwen3.6:35b' in the config" in capsys.readouterr().err
    # (no runs in the range: a header alone read like a command that failed to print)
    assert usage_cmd.main(config, redis_url, "anonymous", None, "2020-01-01", "2020-01-02", as_json=False) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(no runs from 2020-01-01 to 2020-01-02 UTC)"


async def test_a_long_model_name_is_not_folded_for_a_hint(gateway: str, http: aiohttp.ClientSession,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint folds the name asked for (NFKC, case), which can make it 18 times longer (U+FDFA
    is 18 letters): a model of 8 MB of them held the gateway's one thread for 3-5 s, every other
    caller waiting, and took some 200 MB. A name far longer than every model's cannot fold to one."""
    folded: list[int] = []

    def spy(name: str) -> str:
        folded.append(len(name))
        return folded_name(name)

    monkeypatch.setattr("gateway.app.folded_name", spy)
    status, body, _ = await submit(http, gateway, OTHER, "\ufdfa" * 100_000 + " ")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "did you mean" not in body["error"]["message"]
    assert folded and max(folded) < 100, folded  # (the config's names alone)


def test_no_character_decomposes_to_more_than_the_bound() -> None:
    """The hint's bound: NFKC composes at most `MOST_COMPOSED` characters into one (the length of
    the longest canonical decomposition), so a name folds to one of n characters only if it holds
    at most that many times n."""
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert longest == MOST_COMPOSED
    assert folded_name("QWEN3.6:35B") == folded_name("qwen3.6:35b")


@pytest.mark.parametrize(("headers", "says"), [
    ({"Authorization": CALLER}, "'Bearer <key>'"),  # the key without its scheme
    ({"Authorization": f"Basic {CALLER}"}, "'Bearer <key>'"),
    ({"api-key": CALLER}, "not in the api-key header"),  # Azure's clients
    ({"x-api-key": CALLER}, "not in the x-api-key header"),  # Anthropic's
    ({}, "send Authorization: Bearer <key>"),
])
async def test_a_key_sent_another_way_than_bearer_is_told_how_to_send_it(
        gateway: str, http: aiohttp.ClientSession, headers: dict[str, str], says: str) -> None:
    """Found by a newcomer: a key sent as `Authorization: <key>` or in Azure's `api-key` header was
    answered "an API key is required", as if none had been sent."""
    async with http.get(gateway + "/v1/models", headers=headers) as resp:
        body = await resp.json()
    assert resp.status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert says in body["error"]["message"] and CALLER not in body["error"]["message"], body


def test_a_key_is_found_among_ten_thousand_without_comparing_it_with_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's digest was compared with every configured key's, a request: 0.5 ms with 10,000 keys, on
    the gateway's one event loop. Its digest is looked up instead; the key itself is never compared."""
    secrets_ = [f"key-{i}" for i in range(10_000)]
    auth = AuthConfig(keys=[ApiKeyConfig(name=f"k{i}", sha256=hash_key(s)) for i, s in enumerate(secrets_)])
    ring = KeyRing.from_config(auth, {})
    compared: list[object] = []
    real = hmac.compare_digest

    def counted(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    found = ring.lookup(secrets_[7_777])
    assert found is not None and found.name == "k7777"
    assert ring.lookup("key-10000") is None and ring.lookup("") is None
    assert len(compared) <= 3  # (at most one a lookup: not 10,000)
    other = KeyRing.from_config(AuthConfig(keys=[ApiKeyConfig(name="n", sha256=hash_key("new"))]), {})
    ring.replace(other)  # (a reload: the old keys let no one in, the new one does)
    assert ring.lookup(secrets_[7_777]) is None and ring.lookup("new") is not None


async def test_usage_written_by_hand_that_is_no_count_is_left_out_not_a_failure(redis: Redis) -> None:
    """A count that is not a whole number, or a usage key of another type (both written by hand) is
    left out of `/v1/usage`, `iop usage` and the usage counters: it made them fail (a 500)."""
    from common.usage import read_totals, read_usage
    await redis.hset(keys.usage_day("team-a", "2026-12-01"), mapping={"runs:m": "3", "prompt_tokens:m": "lots"})
    await redis.set(keys.usage_day("team-b", "2026-12-01"), "not a hash")
    await redis.hset(keys.usage_total("team-a"), mapping={"runs:m": "3", "completion_tokens:m": "1.5"})
    await redis.set(keys.usage_total("team-b"), "not a hash")
    rows = await read_usage(redis, ["team-a", "team-b"], ["2026-12-01"])
    assert [(r.key, r.model, r.runs, r.prompt_tokens) for r in rows] == [("team-a", "m", 3, 0)]
    totals = await read_totals(redis, ["team-a", "team-b"])
    assert [(r.key, r.model, r.runs, r.completion_tokens) for r in totals] == [("team-a", "m", 3, 0)]
