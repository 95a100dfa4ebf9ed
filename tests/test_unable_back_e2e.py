"""A run refused as unable (`Retry.UNABLE`: a hosted API's 400 "Unrecognized request argument supplied:
top_k", which vLLM serves) goes back to a provider it was tried on that did not refuse it so, while its
attempts allow, and never to the one that refused it. With a (vLLM-like: knows top_k, but reset its
connection once) and b (the hosted API: refuses top_k), the run went a, b, and the caller got b's 400 at
once, with attempts left and a healthy again. Real iop processes and Redis; the providers are small
aiohttp fakes (`tests.test_hostile_provider_e2e.Hostile`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis as sync_redis
from aiohttp import web

from tests.conftest import Stack
from tests.test_hostile_provider_e2e import UNRECOGNIZED, Hostile, aborted, ask, error, leftovers, ok, start

pytestmark = pytest.mark.e2e


def resets(until: Hostile | None) -> Any:
    """Drops the connection before any answer until `until` was asked (None: always), then answers."""
    async def handle(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if until is None or not until.calls:
            return await aborted(request, body)
        return await ok(request, body)
    return handle


async def no_top_k(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """A hosted OpenAI API: a request with `top_k` is its 400; any other, an answer."""
    if "top_k" in body:
        return await UNRECOGNIZED(request, body)
    return await ok(request, body)


def the_record(stack: Stack) -> dict[str, str]:
    r = sync_redis.Redis.from_url(stack.redis_url)
    try:
        [key] = list(r.scan_iter("iop:run:*"))
        return {k.decode(): v.decode(errors="replace") for k, v in r.hgetall(key).items() if k != b"body"}
    finally:
        r.close()


@pytest.mark.parametrize(("stream", "max_attempts"), [(False, 3), (True, 3), (False, 2)])
async def test_an_unable_refusal_goes_back_to_a_provider_tried_before(
        stack: Stack, stream: bool, max_attempts: int) -> None:
    """a resets the connection (an attempt used; each send of it, `MAX_SENDS`, until b was asked), b
    refuses top_k as unable (none used): the run goes back to a, which serves it; b is asked once. With
    `max_attempts: 2` too: the refusal gave its attempt back."""
    with Hostile(["b-m"], no_top_k) as b, Hostile(["a-m"], resets(b)) as a:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": max_attempts})
            status, _, text, took = await ask(gateway, stream=stream, top_k=5)
            assert status == 200 and "hello" in text, (status, text)
            assert b.calls["b-m"] == 1 and 2 <= a.calls["a-m"] <= 3 + 1, (a.calls, b.calls)  # (3 sends a try)
            record = the_record(stack)
            assert (record["state"], record["attempts"], record["unable"], record["unable_by"], record["tried"]) == (
                "completed", "3", "1", "b", "a,b,a"), record
            assert took < 10
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def test_a_provider_that_refused_as_unable_is_never_asked_again(stack: Stack) -> None:
    """a resets every connection: the run goes a, b (unable), a, a, and ends with a's failure once its
    attempts are used up (at most `max_attempts` + the one refusal); b is asked once, not again after a's
    later resets (a retry after a reset may go to any provider tried, but not to one that refused it)."""
    with Hostile(["a-m"], resets(None)) as a, Hostile(["b-m"], no_top_k) as b:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 3})
            status, _, text, took = await ask(gateway, top_k=5)
            assert status in (400, 502), (status, text)
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
            assert b.calls["b-m"] == 1 and 2 <= a.calls["a-m"] <= 3 * 3, (a.calls, b.calls)  # (3 sends a try)
            record = the_record(stack)
            assert record["state"] == "failed" and record["unable"] == "1" and record["unable_by"] == "b", record
            assert int(record["attempts"]) <= 3 + 1, record
            assert took < 10
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


def fails_once(until: Hostile) -> Any:
    """Answers 500 until `until` was asked, then answers."""
    async def handle(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not until.calls:
            return await error(500, {"error": {"message": "boom", "type": "server_error"}})(request, body)
        return await ok(request, body)
    return handle


async def test_an_unable_refusal_never_goes_back_to_a_provider_that_answered_a_server_error(stack: Stack) -> None:
    """a answers 500 (tried again only on another provider, each at most once), b refuses top_k as
    unable: the run does not go back to a (which would now answer), the caller gets b's 400."""
    with Hostile(["b-m"], no_top_k) as b, Hostile(["a-m"], fails_once(b)) as a:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 3})
            status, _, text, took = await ask(gateway, top_k=5)
            assert status == 400 and "top_k" in text, (status, text)
            assert a.calls["a-m"] == 1 and b.calls["b-m"] == 1, (a.calls, b.calls)
            record = the_record(stack)
            assert (record["state"], record["tried"], record["elsewhere"]) == ("failed", "a,b", "a"), record
            assert took < 10
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def test_a_provider_that_answered_a_server_error_is_not_asked_again_after_another_reset(stack: Stack) -> None:
    """a answers 500, then b resets every connection: the run is tried again on b (a reset may go back),
    never on a (issue 8: a 5xx is tried again only on another provider, each at most once). It went
    back to a, which the plain requeue after b's reset no longer kept out (a 500, the same request
    twice at a server that answers it so every time)."""
    with Hostile(["b-m"], resets(None)) as b, Hostile(["a-m"], fails_once(b)) as a:
        try:
            gateway = start(stack, {"a": a, "b": b}, queue={"max_attempts": 3})
            status, _, text, took = await ask(gateway)
            assert status == 502, (status, text)
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text
            assert a.calls["a-m"] == 1 and b.calls["b-m"] >= 2, (a.calls, b.calls)
            record = the_record(stack)
            assert (record["state"], record["tried"], record["elsewhere"]) == ("failed", "a,b,b", "a"), record
            assert took < 10
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()


async def test_an_unable_refusal_goes_back_to_a_provider_that_reset_not_to_one_that_answered_a_server_error(
        stack: Stack) -> None:
    """a answers 500 every time, b resets until c was asked, c refuses top_k as unable: the run goes
    back to b, which serves it, and never to a. It went to no provider tried once any attempt had
    answered a 5xx, and the caller got c's 400 while b could serve it."""
    with Hostile(["c-m"], no_top_k) as c, Hostile(["b-m"], resets(c)) as b, \
            Hostile(["a-m"], error(500, {"error": {"message": "boom", "type": "server_error"}})) as a:
        try:
            gateway = start(stack, {"a": a, "b": b, "c": c}, queue={"max_attempts": 3})
            status, _, text, took = await ask(gateway, top_k=5)
            assert status == 200 and "hello" in text, (status, text)
            assert (a.calls["a-m"], c.calls["c-m"]) == (1, 1) and b.calls["b-m"] >= 2, (a.calls, b.calls, c.calls)
            record = the_record(stack)
            assert (record["state"], record["tried"], record["elsewhere"], record["unable_by"]) == (
                "completed", "a,b,c,b", "a", "c"), record
            assert took < 10
            assert leftovers(stack) == {}
        finally:
            stack.stop_all()
