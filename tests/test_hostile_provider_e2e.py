"""Hostile or broken hosted providers (`openai_api`) against real iop processes and a real Redis:
refusals of a field no provider of the model knows (`Retry.UNABLE`), an account out of credits, hostile
waits, and errors inside a stream after output began. Each caller gets an OpenAI-shaped answer in
bounded time, no run is executed twice after output, and nothing of the run is left in Redis but its
record and events (with their TTL)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import redis as sync_redis
from aiohttp import web

from tests.conftest import Stack
from tests.fakes.serving import ThreadedServer
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class Hostile(ThreadedServer):
    """An OpenAI-compatible API listing `served`, whose chat answers are `handler`'s (set by the test)."""

    def __init__(self, served: list[str], handler: Handler) -> None:
        super().__init__()
        self.served = served
        self.handler = handler
        self.calls: Counter[str] = Counter()
        #: what its model list names (a test takes a model away, as a hosted API retires one)
        self.listed = list(served)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": s, "object": "model"} for s in self.listed]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls[body["model"]] += 1
        return await self.handler(request, body)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app


def chunk(served: str, content: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
    delta = {"content": content} if content is not None else {}
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": served,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def events(request: web.Request, *parts: bytes, pause_s: float = 0.0) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
        if pause_s:
            await asyncio.sleep(pause_s)
    await resp.write_eof()
    return resp


async def ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    served = body["model"]
    if body.get("stream"):
        return await events(request, chunk(served, "hello"), chunk(served, None, "stop"), b"data: [DONE]\n\n")
    return web.json_response({"id": "x", "object": "chat.completion", "created": 1, "model": served,
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                           "finish_reason": "stop"}]})


def error(status: int, obj: Any, headers: dict[str, str] | None = None) -> Handler:
    async def handle(_: web.Request, __: dict[str, Any]) -> web.StreamResponse:
        return web.json_response(obj, status=status, headers=headers)
    return handle


UNRECOGNIZED = error(400, {"error": {"message": "Unrecognized request argument supplied: top_k",
                                     "type": "invalid_request_error", "param": None, "code": None}})
EXTRA_FORBIDDEN = error(422, {"object": "error", "message": {"detail": [
    {"type": "extra_forbidden", "loc": ["body", "nobody_sent_this"], "msg": "Extra inputs are not permitted",
     "input": 1}]}, "type": "invalid_request_error", "param": None, "code": None})


def start(stack: Stack, servers: dict[str, Hostile], queue: dict[str, int] | None = None,
          runtime: dict[str, Any] | None = None, **provider: Any) -> str:
    """Model `m` served by each provider (its first served name), one node, scheduler, worker, gateway."""
    providers = [{"id": pid, "type": "openai_api", "base_url": server.url + "/v1", "capacity": 2,
                  "models": server.served, "read_timeout_ms": 60_000, **provider} for pid, server in servers.items()]
    stack.write_config({"models": [{"id": "m", "providers": {pid: s.served[0] for pid, s in servers.items()}}],
                        "nodes": [{"id": "n1", "providers": providers}],
                        "runtime": {**FAST_RUNTIME, **(runtime or {})},
                        "queue": {"max_attempts": 3, **(queue or {})}})
    stack.scheduler()
    stack.worker("n1")
    url = stack.gateway()
    wait_available(stack.redis_url, list(servers))
    return url


async def ask(gateway: str, stream: bool = False, **extra: Any) -> tuple[int, dict[str, str], str, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    began = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(gateway + "/v1/chat/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.text(), time.monotonic() - began


def leftovers(stack: Stack) -> dict[str, Any]:
    """What Redis holds of runs that should have ended: leases, queued entries, node jobs, in-progress
    markers, bodies, records not ended, records or events without a TTL."""
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        left: dict[str, Any] = {}
        for key in r.scan_iter("iop:leases:*"):
            if r.zcard(key):
                left[key.decode()] = r.zrange(key, 0, -1)
        for key in r.scan_iter("iop:runs:*"):
            if r.xlen(key):
                left[key.decode()] = r.xrange(key)
        for key in r.scan_iter("iop:node:*"):
            if r.zcard(key):
                left[key.decode()] = r.zrange(key, 0, -1)
        for key in r.scan_iter("arq:in-progress:*"):
            left[key.decode()] = r.get(key)
        for key in r.scan_iter("iop:events:*"):
            if r.ttl(key) < 0:
                left[key.decode()] = "no TTL"
        for key in r.scan_iter("iop:run:*"):
            record = r.hgetall(key)
            if b"body" in record or record.get(b"state") not in (b"completed", b"failed", b"cancelled",
                                                                 b"timed_out") or r.ttl(key) < 0:
                left[key.decode()] = {k.decode(): v[:80] for k, v in record.items()}
        return left
    finally:
        r.close()


def records(stack: Stack) -> list[dict[str, str]]:
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        return [{k.decode(): v.decode(errors="replace")[:200] for k, v in r.hgetall(key).items() if k != b"body"}
                for key in r.scan_iter("iop:run:*")]
    finally:
        r.close()


RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


@pytest.mark.parametrize(("status", "headers", "details", "wait"), [
    # (a wait of more digits than a double holds exactly: the longest kept, as a Retry-After of as many
    # seconds is; it was none, 1 s, and the API that asked for 10^30 ms was asked again a second later)
    (429, {"retry-after-ms": "1" + "0" * 30}, None, 60),
    (429, {}, [{"@type": RETRY_INFO, "retryDelay": "9" * 20 + "s"}], 60),
    # (hostile or broken waits say nothing: 1 s, or a minute for an account out of credits)
    (429, {"retry-after-ms": "1e309", "Retry-After": "-5"}, [{"@type": RETRY_INFO, "retryDelay": "-5s"}], 1),
    (429, {"retry-after-ms": "NaN", "Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"}, None, 60),
    (402, {"Retry-After": "1.5"}, [{"@type": RETRY_INFO, "retryDelay": "1e309s"}], 60),
    (503, {"retry-after-ms": "999999999s"}, [{"@type": RETRY_INFO, "retryDelay": 5}], 1),
])
async def test_a_hostile_wait_is_a_caller_answer_and_a_bench_within_a_minute(
        stack: Stack, status: int, headers: dict[str, str], details: list[Any] | None, wait: int) -> None:
    """The caller of a model whose only provider answered so gets a 503 at once with `Retry-After` of
    that wait, and the model is benched there as long."""
    obj = {"error": {"code": status, "message": "slow down", "status": "RESOURCE_EXHAUSTED",
                     **({"details": details} if details is not None else {})}}
    with Hostile(["a-m"], error(status, obj, headers)) as a:
        try:
            gateway = start(stack, {"a": a})
            status_got, got, text, took = await ask(gateway)
            assert status_got == 503, text
            assert json.loads(text)["error"]["code"] == "provider_error", text
            assert got["Retry-After"] == str(wait), (got, text)
            assert wait - 3 < stack.bench_left_s("a", "a-m") <= wait, (wait, stack.bench_left_s("a", "a-m"))
            assert took < 5 and a.calls["a-m"] == 1
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def test_a_hosted_api_that_says_in_its_stream_it_lacks_the_model_is_not_shown_alive_by_it(stack: Stack) -> None:
    """A hosted API that retired the model (gone from its list) and says so in its stream before any output
    (`{"error": {"code": 404, "message": "The model `a-m` does not exist …"}}`, OpenRouter's shape), in a
    pool of `max_attempts: 1`: its caller gets a 502, and the error is no sign of life, as the same 404
    answered whole is not, so the probe that finds the model gone from the list comes within a probe
    interval, and the model's runs go to the other provider from then on. It was a sign of life (strikes 0:
    `said_status` reads no status from an `openai_api`'s `code`): each failed run refreshed it, the probe
    never came, and every run of the model went there first (the first by id) and failed, for as long as
    runs came (no blame either: no other provider served them)."""
    async def gone(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        message = f"The model `{body['model']}` does not exist or you do not have access to it."
        return await events(request, b"data: " + json.dumps({"error": {"code": 404, "message": message}}).encode()
                            + b"\n\n")

    with Hostile(["a-m"], gone) as a, Hostile(["b-m"], ok) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 1}, probe_interval_ms=1000)
            a.loop.call_soon_threadsafe(a.listed.clear)  # (retired: its next probe finds it gone)
            answers: Counter[int] = Counter()
            began = time.monotonic()
            while time.monotonic() - began < 5:
                status, _, text, _ = await ask(gateway, stream=True)
                answers[status] += 1
                assert status == 200 and "hello" in text or status == 502 and "does not exist" in text, text
            # (a's probe is due a probe interval after its last sign of life: a second or two of runs at most)
            assert answers[502] < answers[200] / 2, (answers, a.calls, b.calls)
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def aborted(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
    """The connection dropped before any answer (a provider that died)."""
    assert request.transport is not None
    request.transport.abort()
    return web.Response(status=500)  # (never sent)


def run_counts(stack: Stack) -> Counter[tuple[str, str, str]]:
    """(state, attempts, unable) of every run."""
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        counts: Counter[tuple[str, str, str]] = Counter()
        for key in r.scan_iter("iop:run:*"):
            state, attempts, unable = (v.decode() if v is not None else "0"
                                       for v in r.hmget(key, "state", "attempts", "unable"))
            counts[state, attempts, unable] += 1
        return counts
    finally:
        r.close()


@pytest.mark.parametrize(("other", "max_attempts", "answer"), [
    # (both refuse a field they do not know: each asked once, the last one's refusal is the caller's)
    ("extra_forbidden", 1, {400, 422}),
    # (the other dies: its fault is the caller's 502 when it was the run's last attempt by max_attempts, else
    # the run goes back, never to the one that refused it as unable (the record's `unable_by`), but to the one
    # that dies, while its attempts last; once its strikes take it down, a run refused as unable has no
    # provider left: the refusal, at once)
    ("dies", 1, {400, 502}),
    ("dies", 3, {400, 502}),
])
async def test_a_field_a_provider_does_not_know_bounces_a_run_nowhere_for_good(
        stack: Stack, other: str, max_attempts: int, answer: set[int]) -> None:
    """A refusal of a field the provider does not know (`Retry.UNABLE`) bounces a run between no two
    providers for good: 20 callers at once, half of them streaming, each answered OpenAI-shaped within
    seconds; every run ended, with at most one unable refusal (one fewer than the providers) and at
    most `max_attempts` more; nothing of them left in Redis but their records and events."""
    with Hostile(["a-m"], UNRECOGNIZED) as a, Hostile(["b-m"], EXTRA_FORBIDDEN if other != "dies" else aborted) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": max_attempts})
            answers = await asyncio.wait_for(asyncio.gather(*(ask(gateway, i % 2 == 0) for i in range(20))), 30)
            for status, _, text, took in answers:
                assert status in answer, text
                assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
                assert took < 10
            assert leftovers(stack) == {}
            counts = run_counts(stack)
            assert sum(counts.values()) == 20, counts
            for state, attempts, unable in counts:
                assert state == "failed" and int(unable) <= 1 and int(attempts) <= max_attempts + int(unable), counts
            assert a.calls["a-m"] + b.calls["b-m"] <= 20 * (max_attempts + 1) * 3, (a.calls, b.calls)  # (3 sends a try)
        finally:
            stack.stop_all()


async def test_a_refusal_while_the_other_provider_is_drained_is_the_callers_at_once(stack: Stack) -> None:
    """No untried provider to take it (the other drained): the caller's 400 at once, not after its
    queue timeout."""
    with Hostile(["a-m"], UNRECOGNIZED) as a, Hostile(["b-m"], ok) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"queue_timeout_ms": 10_000})
            r = sync_redis.Redis.from_url(stack.redis_url)
            r.set("iop:drain:b", "1")
            r.close()
            status, _, text, took = await ask(gateway, top_k=5)
            assert status == 400 and "top_k" in text and took < 5, (status, text, took)
            assert b.calls["b-m"] == 0 and leftovers(stack) == {}
        finally:
            stack.stop_all()


@pytest.mark.parametrize("said", [
    {"code": 404, "message": "The model `a-m` does not exist or you do not have access to it."},
    {"code": 402, "message": "Insufficient credits. Add more using https://openrouter.ai/credits"},
])
async def test_an_error_in_a_stream_after_output_ends_it_and_goes_nowhere_else(
        stack: Stack, said: dict[str, Any]) -> None:
    """Output went out: the caller gets it and the error (in the stream, then `[DONE]`), and the run is
    tried nowhere else (the caller would see text twice)."""
    async def half(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return await events(request, chunk(body["model"], "Half an"),
                            b"data: " + json.dumps({"error": said}).encode() + b"\n\n", pause_s=0.05)

    with Hostile(["a-m"], half) as a, Hostile(["b-m"], ok) as b:
        try:
            gateway = start(stack, {"a": a, "b": b})
            status, _, text, _ = await ask(gateway, stream=True)
            assert status == 200, text
            datas = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
            assert "Half an" in datas[0] and datas[-1] == "[DONE]", text
            assert json.loads(datas[-2])["error"]["message"] == f"provider a sent an error: {said['message']}"
            assert (a.calls["a-m"], b.calls["b-m"]) == (1, 0)
            assert leftovers(stack) == {}
            assert run_counts(stack) == Counter({("failed", "1", "0"): 1})
        finally:
            stack.stop_all()


@pytest.mark.parametrize("slug", ["a-m", "a-m-20260211"], ids=["names-it", "its-own-slug"])
async def test_a_hosted_apis_moderation_refusing_the_callers_input_is_the_callers_403(stack: Stack, slug: str) -> None:
    """OpenRouter's moderation flags a caller's input: a 403 naming the model (by OpenRouter's own slug,
    a dated one at times). The caller gets that 403 at once, the run tried nowhere else, and the provider
    keeps its health. It read as a refusal of iop's credentials (three flagged prompts took the provider
    down, each caller told 502 "check the provider's api_key_env"), or as the provider lacking the model
    (the run went to the other provider, which served what the moderation refused)."""
    async def moderated(_: web.Request, __: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": {"code": 403, "message": (
            f"{slug} requires moderation on OpenInference. Your input was flagged for \"violence/graphic\". No "
            "credits were charged."), "metadata": {"reasons": ["violence/graphic"], "flagged_input": "...",
                                                   "provider_name": "OpenInference", "model_slug": slug}}},
            status=403)

    with Hostile(["a-m"], moderated) as a, Hostile(["b-m"], ok) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 3})
            r = sync_redis.Redis.from_url(stack.redis_url)
            r.set("iop:drain:b", "1")  # (every run goes to a first)
            r.close()
            for stream in (False, True, False, True):
                status, _, text, took = await ask(gateway, stream=stream)
                assert status == 403 and "Your input was flagged" in text, text
                assert json.loads(text)["error"]["message"].startswith(slug), text
            r = sync_redis.Redis.from_url(stack.redis_url)
            try:
                r.delete("iop:drain:b")
                health = r.hmget("iop:provider:a", "health", "fails")
            finally:
                r.close()
            assert health == [b"available", b"0"], health
            status, _, text, _ = await ask(gateway)
            assert status == 403, text
            assert (a.calls["a-m"], b.calls["b-m"]) == (5, 0)
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def test_an_azure_deployment_not_found_goes_to_the_other_provider(stack: Stack) -> None:
    """Azure's 404 `DeploymentNotFound` (the deployment, iop's served name, is gone or misspelt; its message
    names none): the run goes to the other provider of the model, as after a 404 that names the served model.
    It was the caller's 404, never tried elsewhere, and a sign of life: Azure first by id, every caller got
    that 404 while the other provider was idle."""
    no_deployment = error(404, {"error": {
        "code": "DeploymentNotFound", "message": "The API deployment for this resource does not exist. If you "
        "created the deployment within the last 5 minutes, please wait a moment and try again."}})
    with Hostile(["a-m"], no_deployment) as a, Hostile(["b-m"], ok) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 2})
            for stream in (False, True, False, True):
                status, _, text, _ = await ask(gateway, stream=stream)
                assert status == 200 and "hello" in text, text
            assert b.calls["b-m"] == 4 and a.calls["a-m"] >= 1, (a.calls, b.calls)
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()
