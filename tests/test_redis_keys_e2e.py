"""What a pool's runs leave in a real Redis, real processes driven over HTTP: every key is one the
README's key table lists, of the type and TTL it gives (`keys.KEY_TABLE`, held to the README by
`test_readme`), while runs of every ending are under way and after; once they ended and
`runtime.run_ttl_s` passed, no key of a run is left, and the runs stream holds nothing pending."""

from __future__ import annotations

import asyncio
import re
import signal
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from common import keys
from tests.conftest import Stack, wait_until
from tests.conftest import async_wait_until as until
from tests.key_kinds import REDIS_TYPES, kind_of
from tests.test_e2e import FAST_RUNTIME, wait_available

pytestmark = pytest.mark.e2e

RUN_TTL_S = 4
MODEL = "m"
TIGHT = "tight"
CALLER = "caller-key-1"
OPERATOR = "operator-key-1"
#: the keys a run writes: none of them may outlive it by more than `run_ttl_s`
OF_A_RUN = {keys.run_record("{run}"), keys.run_events("{run}"), keys.arq_in_progress("{run}"),
            keys.leases("{provider}"), keys.node_queue("{node}"), keys.node_wake("{node}"),
            keys.worker_woken("{instance}"), keys.key_in_flight("{key}"), keys.node_passed("{node}")}


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", ".+", re.escape(pattern)) + "$")


ROWS = [(_regex(pattern), pattern, kind_of(kind)) for pattern, kind, *_ in keys.KEY_TABLE]


def pattern_of(key: str) -> str:
    found = [pattern for regex, pattern, _ in ROWS if regex.match(key)]
    assert len(found) == 1, f"{key!r} is in no row of the key table, or in several: {found}"
    return found[0]


def misfits(r: sync_redis.Redis) -> tuple[set[str], list[str]]:
    """The patterns of the keys in Redis now, and every key whose type or TTL is not its row's."""
    kinds = {pattern: kind for _, pattern, kind in ROWS}
    seen, wrong = set(), []
    for raw in r.scan_iter(count=1000):
        key = raw.decode()
        pattern = pattern_of(key)
        (kind, ttl), actual, pttl = kinds[pattern], r.type(raw).decode(), int(r.pttl(raw))
        if actual == "none":  # (it expired meanwhile)
            continue
        seen.add(pattern)
        if actual != REDIS_TYPES[kind] or (ttl == "always" and pttl < 0) or (ttl == "never" and pttl >= 0):
            wrong.append(f"{key}: {actual}, PTTL {pttl}; the table: {kind}, TTL {ttl}")
    return seen, wrong


def config(url: str) -> dict[str, Any]:
    """`m`: room for its runs; `tight`: one slot, one place in its queue, a short wait there."""
    providers = [{"id": p, "type": "vllm", "base_url": url, "capacity": capacity, "models": [f"{p}-served"]}
                 for p, capacity in (("p", 8), ("q", 1))]
    return {
        "models": [{"id": MODEL, "providers": {"p": "p-served"}},
                   {"id": TIGHT, "providers": {"q": "q-served"}, "queue": {"max_queue": 1, "queue_timeout_ms": 400}}],
        "nodes": [{"id": "n1", "providers": providers}],
        "queue": {"max_queue": 16, "queue_timeout_ms": 1000, "execution_timeout_ms": 1500, "max_attempts": 1},
        "runtime": {**FAST_RUNTIME, "run_ttl_s": RUN_TTL_S},
        "auth": {"keys": [{"name": "team", "env": "IOP_TEST_CALLER_KEY",
                           "limits": {"max_in_flight": 50, "requests_per_minute": 1000}},
                          {"name": "ops", "env": "IOP_TEST_OPERATOR_KEY", "role": "operator"}]},
    }


def test_every_key_runs_leave_is_in_the_key_table_and_none_of_a_run_outlives_its_ttl(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_CALLER_KEY", CALLER)
    monkeypatch.setenv("IOP_TEST_OPERATOR_KEY", OPERATOR)
    url = stack.simulator(["p-served", "q-served"])
    stack.write_config(config(url))
    stack.scheduler()
    worker = stack.worker("n1")
    gateway = stack.gateway()
    wait_available(stack.redis_url, ["p", "q"])
    r = sync_redis.Redis.from_url(stack.redis_url)
    caller, operator = {"Authorization": f"Bearer {CALLER}"}, {"Authorization": f"Bearer {OPERATOR}"}
    chat = "/v1/chat/completions"
    statuses: list[int] = []

    def body(stream: bool = False, model: str = MODEL, **sim: int) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, "sim": sim}

    async def call(session: aiohttp.ClientSession, path: str, payload: dict[str, Any]) -> None:
        async with session.post(gateway + path, json=payload, headers=caller) as resp:
            await resp.read()
            statuses.append(resp.status)

    async def first_output(session: aiohttp.ClientSession, *, cancel: bool) -> None:
        """A stream left after its first output: by its caller, or cancelled through the runs API."""
        async with session.post(gateway + chat, json=body(True, itl_ms=200, tokens=30), headers=caller) as resp:
            async for line in resp.content:
                if line.startswith(b"data:"):
                    break
            if cancel:
                async with session.delete(f"{gateway}/v1/runs/{resp.headers['X-IOP-Run-Id']}",
                                          headers=operator) as deleted:
                    statuses.append(deleted.status)

    async def tight_busy() -> bool:
        return bool(r.zcard(keys.leases("q")) == 1)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(
                call(session, chat, body()), call(session, chat, body(True)),
                call(session, "/v1/responses", {"model": MODEL, "input": "hi"}),
                call(session, "/v1/embeddings", {"model": MODEL, "input": ["a", "b"]}),
                call(session, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
                call(session, chat, body(fail_status=500)), call(session, chat, body(fail_status=400)),
                first_output(session, cancel=True), first_output(session, cancel=False),
                call(session, chat, body(ttft_ms=3000)))  # (its execution timeout)
            # `tight`'s slot taken by a run whose worker is then killed, a run waiting out its queue
            # timeout, one over the queue's bound
            slow = asyncio.create_task(call(session, chat, body(True, TIGHT, ttft_ms=60_000)))
            await until(tight_busy, what="the slot of tight taken")
            waiting = [asyncio.create_task(call(session, chat, body(model=TIGHT))) for _ in range(2)]
            seen, wrong = misfits(r)
            assert wrong == []
            assert {keys.run_record("{run}"), keys.run_events("{run}"), keys.arq_in_progress("{run}"),
                    keys.leases("{provider}"), keys.key_in_flight("{key}")} <= seen
            await asyncio.gather(*waiting)
            worker.stop(sig=signal.SIGKILL)
            stack.worker("n1")
            await slow

    asyncio.run(scenario())
    assert {200, 400, 429, 502, 504} <= set(statuses), statuses
    assert misfits(r)[1] == []

    def runs_gone() -> bool:
        return not misfits(r)[0] & OF_A_RUN

    wait_until(runs_gone, timeout=RUN_TTL_S + 15, what="every key of a run to be gone")
    seen, wrong = misfits(r)
    assert wrong == []
    assert seen & OF_A_RUN == set()
    assert r.xlen(keys.runs_stream(MODEL)) == 0
    assert r.xpending(keys.runs_stream(MODEL), keys.SCHEDULER_GROUP)["pending"] == 0
    r.close()
