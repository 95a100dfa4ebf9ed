"""The gateway over real HTTP (port 0) and a real Redis: bad input gets a clear,
OpenAI-shaped 4xx, nothing is queued for it, and no input yields a 500."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from common.auth import hash_key
from common.config import Config, parse_config
from common.wire import upstream_request_id
from gateway.app import build_app
from gateway.errors import new_request_id
from gateway.runs import RunClient, new_run_id
from iop.embedded_redis import RedisServer
from tests.conftest import async_wait_until, redis_full
from tests.openapi import validate
from tests.test_scheduler import beat

MODEL = "qwen3.6:35b"


def config(max_body_bytes: int = 4096) -> Config:
    return parse_config({
        "models": [{"id": MODEL, "display_name": "Qwen 3.6 35B", "providers": {"p": "p-served"}}],
        "nodes": [{"id": "n1", "providers": [{"id": "p", "type": "vllm", "base_url": "http://127.0.0.1:9",
                                              "capacity": 1, "models": ["p-served"]}]}],
        "runtime": {"max_body_bytes": max_body_bytes},
    })


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[str]:
    server = TestServer(build_app(config(), redis_url), port=0)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def nothing_queued(redis: Redis) -> bool:
    return bool(await redis.xlen(f"iop:runs:{MODEL}") == 0 and await redis.keys("iop:run:*") == [])


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    body: dict[str, Any] = await resp.json()
    validate("ErrorResponse", body)
    error: dict[str, Any] = body["error"]
    return error


async def test_models_are_listed_with_their_display_names(gateway: str, http: aiohttp.ClientSession) -> None:
    async with http.get(gateway + "/v1/models") as resp:
        listing = await resp.json()
    validate("ListModelsResponse", listing)
    assert [(m["id"], m["display_name"]) for m in listing["data"]] == [(MODEL, "Qwen 3.6 35B")]
    async with http.get(f"{gateway}/v1/models/{MODEL}") as resp:
        model = await resp.json()
    validate("Model", model)
    assert model["id"] == MODEL
    async with http.get(gateway + "/v1/models/nope") as resp:
        assert resp.status == 404 and (await error_of(resp))["code"] == "model_not_found"


async def test_every_answer_has_a_request_id(gateway: str, http: aiohttp.ClientSession) -> None:
    """As OpenAI's: an error before any run, the model list, a preflight-free 404 (a run's own
    answer has its run's id: the e2e tests)."""
    seen = set()
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", b"{not json"),
                               ("GET", "/v1/nothing-here", None), ("GET", "/healthz", None)):
        async with http.request(method, gateway + path, data=body) as resp:
            request_id = resp.headers.get("X-Request-Id", "")
            assert re.fullmatch(r"req_[0-9a-f]{32}", request_id), (path, dict(resp.headers))
            seen.add(request_id)
    assert len(seen) == 4


def test_run_and_request_ids_are_random_version_4_uuids() -> None:
    """(made without a `UUID` object; a provider gets the run's as its `X-Request-Id`, and
    llama-cpp-python's answers 400 to one that is not a UUID)"""
    made = [new_run_id() for _ in range(1000)] + [new_request_id() for _ in range(1000)]
    assert len(set(made)) == 2000
    for made_id in made:
        assert re.fullmatch(r"(run|req)_[0-9a-f]{32}", made_id)
        parsed = uuid.UUID(made_id[4:])
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert upstream_request_id(made[0]) == str(uuid.UUID(made[0][4:]))


@pytest.mark.parametrize(("path", "raw", "status", "code", "param"), [
    ("/v1/chat/completions", b"{not json", 400, "invalid_request_error", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request_error", None),
    ("/v1/chat/completions", b'{"model": "qwen3.6:35b"}', 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", b'{"model": "qwen3.6:35b", "messages": "hi"}', 400, "invalid_request_error",
     "messages"),
    ("/v1/chat/completions", b'{"model": 7, "messages": []}', 400, "invalid_request_error", "model"),
    ("/v1/chat/completions", b'{"model": "qwen3.6:35b", "messages": [{"role": "user"}], "stream": "yes"}',
     400, "invalid_request_error", "stream"),
    ("/v1/completions", b'{"model": "qwen3.6:35b"}', 400, "invalid_request_error", "prompt"),
    ("/v1/embeddings", b'{"model": "qwen3.6:35b", "input": {}}', 400, "invalid_request_error", "input"),
    ("/v1/chat/completions", b'{"model": "no-such", "messages": [{"role": "user"}]}', 404, "model_not_found",
     "model"),
    ("/v1/chat/completions", b'{"model": "qwen3.6:35b", "messages": [{"role": "user"}]}', 503,
     "no_available_provider", None),  # no heartbeat: refused at once, not queued
    ("/v1/chat/completions", b'{"model": "qwen3.6:35b", "messages": [{"role": "user", "content": "'
     + b"x" * 5000 + b'"}]}', 413, "request_too_large", None),
])
async def test_bad_requests_get_a_clear_error_and_queue_nothing(
        gateway: str, http: aiohttp.ClientSession, redis: Redis,
        path: str, raw: bytes, status: int, code: str, param: str | None) -> None:
    async with http.post(gateway + path, data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        error = await error_of(resp)
    assert error["code"] == code and error["param"] == param
    assert await nothing_queued(redis)


async def test_unknown_routes_and_methods_are_openai_shaped(gateway: str, http: aiohttp.ClientSession) -> None:
    async with http.get(gateway + "/v1/nothing-here") as resp:
        assert resp.status == 404 and (await error_of(resp))["code"] == "not_found"
    # (an endpoint of OpenAI's API that iop does not serve: the caller learns which it does)
    async with http.post(gateway + "/v1/audio/speech", json={"model": "m", "input": "hi"}) as resp:
        error = await error_of(resp)
        assert resp.status == 404 and error["code"] == "not_found"
        assert error["message"].startswith("Invalid URL (POST /v1/audio/speech): iop serves POST /v1/chat/completions")
        assert "POST /v1/responses" in error["message"]
        assert "GET /v1/models/{model}" in error["message"] and "GET /v1/usage" in error["message"]
        # (an operator who mistyped an admin path was told of the callers' routes only: a new operator)
        assert "for an operator's key also GET /v1/catalog" in error["message"] and "/v1/admin/" in error["message"]
    async with http.get(gateway + "/v1/models/a%0Ab") as resp:  # (a name with a line break: no such model)
        error = await error_of(resp)
        assert resp.status == 404 and error["code"] == "model_not_found", error
        assert error["message"] == 'the model "a\\nb" does not exist'
    async with http.get(gateway + "/v1/" + "x" * 5000) as resp:  # (a long path is not repeated whole)
        error = await error_of(resp)
        assert resp.status == 404 and len(error["message"]) < 800 and error["message"].count("x") < 250
    async with http.get(gateway + "/v1/embeddings") as resp:
        error = await error_of(resp)
        assert resp.status == 405 and error["code"] == "method_not_allowed"
        assert resp.headers["Allow"] == "POST"
        assert error["message"] == "GET /v1/embeddings is not allowed: it takes POST"
    async with http.delete(gateway + "/v1/models/" + "m" * 5000) as resp:  # (a long path is not repeated whole)
        error = await error_of(resp)
        assert resp.status == 405 and len(error["message"]) < 500 and error["message"].endswith("it takes GET, HEAD")
    async with http.get(gateway + "/v1/models") as resp:  # (compact JSON, as every other answer)
        assert b", " not in await resp.read()


@pytest.mark.parametrize(("method", "path", "words"), [
    # a Response asked for (`client.responses.retrieve`, `cancel`...): iop keeps none, says so and where its run is
    ("GET", "/v1/responses/resp_0123456789abcdef0123456789abcdef", "is not kept; the run that made it is kept"),
    ("POST", "/v1/responses/resp_0123456789abcdef0123456789abcdef/cancel", "is not kept; the run"),
    # endpoints of OpenAI's under that path that iop does not have (found by a hostile review: they
    # were told "compact is not kept")
    ("POST", "/v1/responses/compact", "Invalid URL (POST /v1/responses/compact): iop serves"),
    ("POST", "/v1/responses/input_tokens", "Invalid URL (POST /v1/responses/input_tokens)"),
    # stored chat completions (`client.chat.completions.list`, `retrieve`, `update`, `delete`, `messages.list`):
    # the list was a 405 ("it takes POST", which OpenAI's does not say), the others "Invalid URL"
    ("GET", "/v1/chat/completions", "iop keeps no chat completions"),
    ("GET", "/v1/chat/completions/chatcmpl-abc", 'iop keeps no chat completions (it stores none, whatever a '
                                                 'request\'s store says): "chatcmpl-abc" is not kept'),
    ("POST", "/v1/chat/completions/chatcmpl-abc", '"chatcmpl-abc" is not kept'),
    ("DELETE", "/v1/chat/completions/chatcmpl-abc", '"chatcmpl-abc" is not kept'),
    ("GET", "/v1/chat/completions/chatcmpl-abc/messages", '"chatcmpl-abc" is not kept')])
async def test_a_stored_response_is_not_kept_and_other_paths_under_responses_are_unknown(
        gateway: str, http: aiohttp.ClientSession, method: str, path: str, words: str) -> None:
    async with http.request(method, gateway + path, json={"model": "qwen3.6:35b", "input": "hi"}) as resp:
        error = await error_of(resp)
    assert resp.status == 404 and error["code"] == "not_found" and words in error["message"], error


def _garbage(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "none", "list", "dict"] if depth < 3 else ["str", "int", "none"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [_garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        keys = ["model", "messages", "prompt", "input", "stream", "stream_options", "role", "x"]
        return {rng.choice(keys): _garbage(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    scalars: dict[str, Any] = {"str": rng.choice(["", MODEL, "user", "\u00e9\ud7ff"]), "int": rng.randint(-2, 2),
                               "float": rng.random(), "bool": rng.random() < 0.5, "none": None}
    return scalars[kind]


async def test_no_input_yields_a_500(gateway: str, http: aiohttp.ClientSession) -> None:
    rng = random.Random(11)
    for i in range(300):
        body = _garbage(rng)
        if i % 3 == 0 and isinstance(body, dict):
            body["model"] = MODEL
        raw = json.dumps(body).encode() if i % 7 else bytes(rng.randrange(256) for _ in range(20))
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
        async with http.post(gateway + path, data=raw) as resp:
            assert 400 <= resp.status < 500 or resp.status == 503, (path, raw, resp.status, await resp.text())
            await error_of(resp)


async def test_health_and_readiness(http: aiohttp.ClientSession) -> None:
    server = RedisServer().start()
    app_server = TestServer(build_app(config(), server.url), port=0)
    await app_server.start_server()
    url = str(app_server.make_url("")).rstrip("/")
    try:
        async with http.get(url + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 200
        server.stop(kill=True)
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 503 and (await error_of(resp))["code"] == "service_unavailable"
        async with http.get(url + "/healthz") as resp:
            assert resp.status == 200  # alive, just not ready
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 503 and (await error_of(resp))["code"] == "service_unavailable"
            assert resp.headers.get("Retry-After")
    finally:
        await app_server.close()
        server.cleanup()


@pytest.mark.parametrize("limited", [False, True])
async def test_a_full_redis_is_a_503_and_keeps_what_it_holds(http: aiohttp.ClientSession, limited: bool) -> None:
    """Whether the caller's key has limits or not (`enqueue` trimmed the key's window first: a write
    that let the rest of the script through a full Redis, and queued the run)."""
    cfg = config()
    headers = {}
    if limited:
        cfg = parse_config({**cfg.model_dump(exclude_none=True), "auth": {"keys": [
            {"name": "team-a", "sha256": hash_key("sk-full-redis-test"),
             "limits": {"max_in_flight": 5, "requests_per_minute": 100}}]}})
        headers = {"Authorization": "Bearer sk-full-redis-test"}
    server = RedisServer().start()
    redis = Redis.from_url(server.url)
    app_server = TestServer(build_app(cfg, server.url), port=0)
    await app_server.start_server()
    gateway = str(app_server.make_url("")).rstrip("/")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    try:
        await beat(redis, cfg)

        async def wait() -> None:
            async with http.post(gateway + "/v1/chat/completions", json=body, headers=headers) as resp:
                await resp.read()

        waiting = asyncio.create_task(wait())

        async def one_queued() -> bool:
            return bool(await redis.xlen(f"iop:runs:{MODEL}") == 1)

        await async_wait_until(one_queued, what="a run waiting")
        async with redis_full(redis):
            async with http.post(gateway + "/v1/chat/completions", json=body, headers=headers) as resp:
                error = await error_of(resp)
                assert resp.status == 503 and error["code"] == "service_unavailable" and "full" in error["message"]
                assert resp.headers["Retry-After"] == "5"
            assert await redis.xlen(f"iop:runs:{MODEL}") == 1 and len(await redis.keys("iop:run:*")) == 1  # kept
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    finally:
        await app_server.close()
        await redis.aclose()
        server.cleanup()


async def test_a_waiting_caller_holds_no_copy_of_its_request_body(redis_url: str, redis: Redis) -> None:
    """A prompt of megabytes is in Redis while its run waits, not in the gateway's memory too
    (thousands may wait at once)."""
    import gc
    import tracemalloc

    cfg = config(max_body_bytes=8 * 1024 * 1024)
    await beat(redis, cfg)  # available, but no scheduler: the run waits in its queue
    server = TestServer(build_app(cfg, redis_url), port=0)
    await server.start_server()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_000_000}],
                       "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    runs = RunClient(redis, cfg)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(head)
        writer.write(body)  # (the caller's own copy was made before `before`)
        await writer.drain()
        await async_wait_until(lambda: redis.xlen(f"iop:runs:{MODEL}"), what="the run to be queued")

        async def holds() -> int:
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - before

        async def settled() -> bool:  # the handler drops its copies once its run is queued
            return await holds() < 250_000

        try:
            await async_wait_until(settled, timeout=5, what="the gateway to drop the body")
        except AssertionError:
            pass
        held = await holds()
    finally:
        tracemalloc.stop()
        for record in await redis.keys("iop:run:*"):  # the caller hears its run end
            await runs.cancel(record.decode().removeprefix("iop:run:"), MODEL, "the test is over")
        await runs.close()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # its answer (the cancel)
        writer.close()
        await server.close()
    assert held < 250_000, f"the gateway holds {held} bytes more while the caller waits"


async def queued_gateway(redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> TestServer:
    """A gateway (keep-alive every 100 ms) whose runs wait in their queue (the provider is available,
    but no scheduler runs) and whose callers give up on them after 1 s."""
    cfg = parse_config({**config().model_dump(mode="json", exclude_none=True),
                        "runtime": {"stream_keepalive_ms": 100}})
    await beat(redis, cfg)
    monkeypatch.setattr(RunClient, "follow_deadline_s", lambda self, model_id: 1.0)
    server = TestServer(build_app(cfg, redis_url), port=0)
    await server.start_server()
    return server


async def test_a_stream_the_gateway_gives_up_on_after_its_headers_ends_with_the_error_in_it(
        redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's deadline passes after the stream's headers went out (keep-alive comments while
    its run waited): the stream ends with the error and [DONE], one HTTP answer, not a second one
    written after the first."""
    server = await queued_gateway(redis_url, redis, monkeypatch)
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)  # to the end of the connection
        writer.close()
    finally:
        await server.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    text = answer.decode()
    assert ": keep-alive" in text and '"code":"execution_timeout"' in text
    assert text.index('"code":"execution_timeout"') < text.index("data: [DONE]")


async def test_a_queued_responses_stream_opens_with_its_first_keep_alive_and_ends_failed(
        redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Responses stream whose run waits in its queue: when its headers go out (its first
    keep-alive), `response.created` and `response.in_progress` go with them (a caller learns the
    Response's id), then keep-alive comments; the gateway's giving up ends it with `error` and
    `response.failed`, every event in OpenAI's schema, no `[DONE]`."""
    server = await queued_gateway(redis_url, redis, monkeypatch)
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"http://{server.host}:{server.port}/v1/responses",
                json={"model": MODEL, "input": "x", "stream": True}) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
    finally:
        await server.close()
    blocks = [b for b in text.split("\n\n") if b]
    assert blocks[0].startswith("event: response.created\n") and blocks[1].startswith("event: response.in_progress\n")
    assert blocks[2] == ": keep-alive" and "data: [DONE]" not in text
    events = [json.loads(b.split("data: ", 1)[1]) for b in blocks if b.startswith("event: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2]["code"] == "execution_timeout" and events[0]["response"]["id"] == events[3]["response"]["id"]
    for event in events:
        validate("ResponseStreamEvent", event)


async def test_a_stream_the_gateway_gives_up_on_whose_caller_does_not_read_is_closed(
        redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The same, for a caller that stopped reading (its socket full of output): the error cannot
    go out, so within `END_WITHIN_S` of the deadline the connection is closed; the caller is not
    held, and no second answer ever follows the stream."""
    import socket
    import time

    from common import keys
    from common.codec import event_fields
    from gateway import metrics as gateway_metrics
    from gateway import responses as gateway_responses

    def ended() -> float:  # requests of the model that ended, however (it is counted as the caller's leaving: 499)
        return sum(sample.value for metric in gateway_metrics.REGISTRY.collect() for sample in metric.samples
                   if sample.name == "iop_gateway_requests_total" and sample.labels.get("model") == MODEL)

    before = ended()
    caplog.set_level(logging.INFO, "iop.gateway")
    await beat(redis, config())
    monkeypatch.setattr(RunClient, "follow_deadline_s", lambda self, model_id: 1.0)
    server = TestServer(build_app(config(), redis_url), port=0)
    await server.start_server()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

        async def queued() -> list[Any]:
            return list(await redis.xrange(f"iop:runs:{MODEL}"))

        run_id = (await async_wait_until(queued, what="the run to be queued"))[0][1][b"run"].decode()
        inbox = keys.gateway_inbox((await redis.hget(keys.run_record(run_id), "watchers") or b"").decode()
                                   .removesuffix(keys.OUTPUT_ONLY))
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x" * 65536}}]}
        for _ in range(200):  # ~13 MB of output the caller will not read (as a worker would write it)
            fields = event_fields("delta", {"chunks": [chunk]})
            entry = await redis.xadd(keys.run_events(run_id), fields)
            await redis.xadd(inbox, {"run": run_id, "id": entry, **fields})
        began = time.monotonic()

        async def read_all() -> bytes:
            got = b""
            try:
                while data := await reader.read(65536):
                    got += data
            except ConnectionError:  # (closed at once: a reset)
                pass
            return got

        async def given_up() -> bool:  # the gateway is done with the request, the caller read nothing
            return ended() > before

        await async_wait_until(given_up, timeout=1.0 + gateway_responses.END_WITHIN_S + 10,
                               what="the gateway to give up on the caller")
        answer = await asyncio.wait_for(read_all(), 30)
        writer.close()
    finally:
        await server.close()
    assert time.monotonic() - began < 30
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1
    assert len(answer) < 13_000_000  # cut short: the connection was closed under the caller
    # (the gateway says why a caller may see its answer cut: here the deadline gave up a write first)
    assert "closed the connection of a caller of POST /v1/chat/completions without the end of its answer: an " \
           "earlier write to it was given up" in caplog.text


async def test_an_error_answer_leaves_no_reference_cycle_holding_the_request_s_body(
        redis_url: str, http: aiohttp.ClientSession) -> None:
    """Services collect garbage less often (`common.lifecycle.tune_gc`): a request answered with an
    error must leave nothing that only the collector frees, or each would hold its body (here
    512 KiB) until then. Raising the error again to sort it made such a cycle on every one."""
    server = TestServer(build_app(config(max_body_bytes=4 << 20), redis_url), port=0)
    await server.start_server()
    url = str(server.make_url("/v1/chat/completions"))
    big = "x" * (1 << 19)  # (a bigger body makes aiohttp warn)
    bodies = {
        400: [b'{"model": "x", "messages": [' + big.encode(),  # not JSON
              json.dumps({"model": MODEL, "messages": big}).encode()],  # messages not a list
        404: [json.dumps({"model": "nope", "messages": [{"role": "user", "content": big}]}).encode()],
        503: [json.dumps({"model": MODEL, "messages": [{"role": "user", "content": big}]}).encode()],  # no provider up
    }
    gc.collect()
    gc.disable()
    try:
        for status, sent in bodies.items():
            for body in sent:
                async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == status, await resp.text()
        await server.close()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        holding = [type(o).__name__ for o in gc.garbage
                   if any(isinstance(r, (bytes, str)) and len(r) >= len(big) for r in gc.get_referents(o))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert holding == []


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_the_gateway_cannot_shape_ends_openai_shaped_and_ends_the_run(
        redis_url: str, redis: Redis, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
        stream: bool) -> None:
    """A bug, or a provider's output nothing foresaw, met while the gateway shapes an answer (a hostile
    review found one: a `tool_calls` of `5` in a Responses stream): the caller gets a 502 naming no
    internals, in the stream once its headers went out (`error`, then `response.failed`), never a
    500 or a connection cut mid-stream; and the run goes no further."""
    from common import keys
    from common.codec import event_fields
    from gateway.responses_output import ResponseShape

    shaped = {"events": 0}
    real_events = ResponseShape.events

    def events(self: ResponseShape, chunks: list[Any]) -> bytes:
        shaped["events"] += 1
        if shaped["events"] > 1:
            raise TypeError("'int' object is not iterable")
        return real_events(self, chunks)

    def whole(self: ResponseShape, completion: Any) -> dict[str, Any]:
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(ResponseShape, "events", events)
    monkeypatch.setattr(ResponseShape, "whole", whole)
    await beat(redis, config())
    server = TestServer(build_app(config(), redis_url), port=0)
    await server.start_server()
    try:
        async def run_of() -> str | None:
            queued = await redis.xrange(f"iop:runs:{MODEL}")
            return queued[0][1][b"run"].decode() if queued else None

        async def provide() -> None:  # (as a worker would write the run's output)
            run_id = await async_wait_until(run_of, what="the run to be queued")
            watcher = (await redis.hget(keys.run_record(run_id), "watchers") or b"").decode()
            inbox = keys.gateway_inbox(watcher.removesuffix(keys.OUTPUT_ONLY))
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
            answers = ([("delta", {"chunks": [chunk]}), ("delta", {"chunks": [chunk]})] if stream else
                       [("completed", {"response": {"choices": [{"index": 0, "message": {"content": "hi"}}]}})])
            for etype, data in answers:
                fields = event_fields(etype, data)
                entry = await redis.xadd(keys.run_events(run_id), fields)
                await redis.xadd(inbox, {"run": run_id, "id": entry, **fields})

        provider = asyncio.create_task(provide())
        async with http.post(server.make_url("/v1/responses"), json={"model": MODEL, "input": "x",
                                                                    "stream": stream}) as resp:
            body = await resp.read()
            status, run_id = resp.status, resp.headers.get("X-IOP-Run-Id")
        await provider
        if stream:
            assert status == 200
            told = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in body.split(b"\n\n") if block]
            assert [e["type"] for e in told][-2:] == ["error", "response.failed"]
            assert told[-2]["code"] == "provider_error"
            assert "could not shape the run's answer (TypeError)" in told[-2]["message"]
            assert "output_text.delta" in {e["type"].removeprefix("response.") for e in told}
            for event in told:
                validate("ResponseStreamEvent", event)
        else:
            assert status == 502
            error = json.loads(body)["error"]
            assert error["code"] == "provider_error" and "(TypeError)" in error["message"]
        assert run_id is not None

        async def cancelled() -> bool:  # (the run was still queued: it ends there, cancelled)
            return bool(await redis.hget(keys.run_record(run_id), "state") == b"cancelled")

        await async_wait_until(cancelled, what="the run to end")
    finally:
        await server.close()


@pytest.mark.parametrize(("method", "path"), [("POST", "/chat/completions"), ("GET", "/models"),
                                              ("POST", "/responses"), ("GET", "/models/qwen3.6:35b")])
async def test_a_client_whose_base_url_lacks_v1_is_told_so(gateway: str, http: aiohttp.ClientSession,
                                                           method: str, path: str) -> None:
    """Found by a newcomer: `OpenAI(base_url="http://host:8080")`, without its `/v1`, was answered
    with the list of routes, which did not say what was wrong."""
    async with http.request(method, gateway + path, json={"model": "qwen3.6:35b"}) as resp:
        error = await error_of(resp)
    assert resp.status == 404 and error["code"] == "not_found", error
    assert error["message"].startswith(f"Invalid URL ({method} {path}): the API is under /v1 ({method} /v1{path}): "
                                       "a client's base_url ends in /v1"), error
