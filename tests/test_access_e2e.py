"""API keys with real processes on a real Redis: two gateways share one key's limits exactly; a
key's in-flight count comes back to 0 however its runs end (completed, timed out in the queue,
the caller leaving while queued or while streaming, a worker killed with SIGKILL mid-run); and
its usage equals the sum of the `usage` objects its callers received, in `/v1/usage`, in
`iop usage` and in the gateway's counters."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from common import keys
from common.auth import hash_key, new_key
from tests.conftest import ROOT, async_wait_until, wait_until
from tests.faults import MODEL, FaultStack, chat, start, stream_events, until_current

pytestmark = pytest.mark.e2e

KEY, OPS = new_key(), new_key()


def auth(**limits: int) -> dict[str, Any]:
    return {"keys": [{"name": "team-a", "sha256": hash_key(KEY), "limits": limits},
                     {"name": "ops", "sha256": hash_key(OPS), "role": "operator"}]}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        yield session


async def post(http: aiohttp.ClientSession, gateway: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def in_flight(fstack: FaultStack) -> int:
    with fstack.client() as r:
        return int(r.zcard(keys.key_in_flight("team-a")))


async def test_two_gateways_share_one_keys_limits(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gw_a = start(fstack, {"only": ("n1", 4)}, auth=auth(max_in_flight=2))
    gw_b = fstack.gateway()
    slow = [asyncio.create_task(post(http, gw, chat(ttft_ms=1500))) for gw in (gw_a, gw_b)]
    await until_current(fstack, "only", 2)
    for gw in (gw_b, gw_a):  # the third run is refused by either gateway
        status, body = await post(http, gw, chat())
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
    assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
    assert in_flight(fstack) == 0
    assert (await post(http, gw_b, chat()))[0] == 200


async def test_in_flight_comes_back_to_zero_however_runs_end(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)}, auth=auth(max_in_flight=10), queue={"queue_timeout_ms": 1500})
    # completed
    assert (await post(http, gateway, chat()))[0] == 200
    assert in_flight(fstack) == 0

    # timed out in the queue, and a caller leaving while queued, behind a run that holds the slot
    holder = asyncio.create_task(post(http, gateway, chat(ttft_ms=4000)))
    await until_current(fstack, "only", 1)
    status, body = await post(http, gateway, chat())
    assert status == 504 and body["error"]["code"] == "queue_timeout"
    leaving = asyncio.create_task(post(http, gateway, chat()))
    await async_wait_until(lambda: asyncio.sleep(0, in_flight(fstack) == 2), what="a second run in flight")
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await async_wait_until(lambda: asyncio.sleep(0, in_flight(fstack) == 1), what="the queued run to leave")
    assert (await holder)[0] == 200
    assert in_flight(fstack) == 0

    # a caller leaving while streaming
    resp = await http.post(gateway + "/v1/chat/completions", json=chat(max_tokens=500, stream=True, itl_ms=50,
                                                                         tokens=500))
    await anext(stream_events(resp))
    resp.close()
    await async_wait_until(lambda: asyncio.sleep(0, in_flight(fstack) == 0), what="the stream's run to end")

    # a worker killed mid-run, after output: its lease is reaped and the run fails
    resp = await http.post(gateway + "/v1/chat/completions", json=chat(max_tokens=500, stream=True, itl_ms=50,
                                                                         tokens=500))
    run_id = resp.headers["X-IOP-Run-Id"]
    events = stream_events(resp)
    await anext(events)
    worker_pid = int((fstack.run_field(run_id, "worker") or ":0").rsplit(":", 1)[1])
    next(p for p in fstack.procs if p.popen.pid == worker_pid).send(signal.SIGKILL)
    rest = [e async for e in events]
    resp.close()
    assert any(isinstance(e, dict) and e.get("error", {}).get("code") == "worker_lost" for e in rest)
    assert in_flight(fstack) == 0
    fstack.worker("n1")  # the pool serves again (the fixture checks every invariant at the end)
    fstack.wait_health("only", "available")

    with fstack.client() as r:
        usage = {k.decode(): int(v) for k, v in r.hgetall(keys.usage_total("team-a")).items()}
    assert usage[f"runs:{MODEL}"] == 6 and usage[f"failures:{MODEL}"] == 2  # the timeout and the lost worker


async def test_usage_equals_what_callers_received(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 4)}, auth=auth())
    received = {"prompt_tokens": 0, "completion_tokens": 0}
    for n in range(1, 4):  # non-stream answers always carry usage
        status, body = await post(http, gateway, chat(max_tokens=n))
        assert status == 200
        for field in received:
            received[field] += body["usage"][field]
    for n in (2, 5):  # streams that ask for usage end with a usage chunk
        async with http.post(gateway + "/v1/chat/completions",
                             json={**chat(max_tokens=n, stream=True), "stream_options": {"include_usage": True}}) as r:
            chunks = [e async for e in stream_events(r)]
        usage = [c["usage"] for c in chunks if isinstance(c, dict) and c.get("usage")]
        assert len(usage) == 1
        for field in received:
            received[field] += usage[0][field]

    today = dt.datetime.now(dt.UTC).date().isoformat()
    expected = {"object": "usage", "key": "team-a", "model": MODEL, "date": today, "runs": 5,
                "prompt_tokens": received["prompt_tokens"], "completion_tokens": received["completion_tokens"],
                "total_tokens": sum(received.values()), "failures": 0}
    async with http.get(gateway + "/v1/usage") as resp:
        assert (await resp.json())["data"] == [expected]

    # a stream that did not ask for usage gets none, and its tokens are counted all the same
    async with http.post(gateway + "/v1/chat/completions", json=chat(max_tokens=4, stream=True)) as r:
        chunks = [e async for e in stream_events(r)]
    assert not any(isinstance(c, dict) and "usage" in c for c in chunks) and chunks[-1] == "[DONE]"
    async with http.get(gateway + "/v1/usage") as resp:
        listed = await resp.json()
        row = listed["data"][0]
    assert row["runs"] == 6 and row["completion_tokens"] == received["completion_tokens"] + 4

    # the same from the command line, and as the gateway's counters (an operator's scrape)
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "iop", "usage", "--json"],
                                   env=fstack.env(), cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    out = done.stdout
    assert json.loads(out) == listed  # (the same document as the API's)
    async with http.get(gateway + "/metrics", headers={"Authorization": f"Bearer {OPS}"}) as resp:
        text = await resp.text()
    counter = re.search(r'^iop_usage_completion_tokens_total\{key="team-a",model="qwen3.6:35b"\} (\S+)$', text, re.M)
    assert counter is not None and float(counter.group(1)) == row["completion_tokens"]
    async with http.get(gateway + "/metrics") as resp:  # a caller key may not scrape
        assert resp.status == 403


def content_chunks(events: list[dict[str, Any] | str]) -> int:
    return sum(1 for e in events
               if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content"))


async def test_every_run_counts_once_however_it_ends_through_two_gateways(fstack: FaultStack,
                                                                          http: aiohttp.ClientSession) -> None:
    """One key through two gateways: a stream cancelled with the runs API (on the other gateway)
    counts the chunks its caller got; runs refused before they were queued (the key's
    max_in_flight, a full queue) count nothing; a run whose worker was killed before any output,
    run again by another worker, counts once, with the usage its caller got; one whose worker was
    killed after output counts the chunks its caller got. `/v1/usage` and the usage counters of
    both gateways say the same."""
    gw_a = start(fstack, {"only": ("n1", 1)}, auth=auth(max_in_flight=3), queue={"max_queue": 2, "max_attempts": 2})
    gw_b = fstack.gateway()
    ops = {"Authorization": f"Bearer {OPS}"}

    # a stream cancelled through the other gateway after some output
    resp = await http.post(gw_a + "/v1/chat/completions", json=chat(max_tokens=500, stream=True, itl_ms=50,
                                                                      tokens=500))
    run_id = resp.headers["X-IOP-Run-Id"]
    events = stream_events(resp)
    got: list[dict[str, Any] | str] = []
    async for event in events:
        got.append(event)
        if content_chunks(got) == 3:
            break
    async with http.delete(f"{gw_b}/v1/runs/{run_id}") as cancelled:
        assert cancelled.status == 200
    got += [e async for e in events]
    resp.close()
    assert isinstance(got[-2], dict) and got[-2]["error"]["code"] == "cancelled", got[-2:]
    streamed = content_chunks(got)

    # a slot taken, a full queue: the key's fourth run and another key's run are refused, not counted
    holder = asyncio.create_task(post(http, gw_a, chat(ttft_ms=2000)))
    await until_current(fstack, "only", 1)
    waiting = [asyncio.create_task(post(http, gw, chat())) for gw in (gw_a, gw_b)]
    await async_wait_until(lambda: asyncio.sleep(0, in_flight(fstack) == 3), what="3 runs of the key in flight")
    status, body = await post(http, gw_b, chat())
    assert status == 429 and "max_in_flight" in body["error"]["message"], body
    async with http.post(gw_a + "/v1/chat/completions", json=chat(), headers=ops) as full:
        assert full.status == 429 and (await full.json())["error"]["code"] == "queue_full"
    answers = await asyncio.gather(holder, *waiting)
    assert [s for s, _ in answers] == [200, 200, 200], answers

    # a worker killed before its run had output: another worker runs it again, and it counts once
    asked = asyncio.create_task(post(http, gw_b, chat(max_tokens=4, ttft_ms=1500)))

    def running() -> str | None:
        with fstack.client() as r:
            return next((k.decode().removeprefix("iop:run:") for k in r.scan_iter("iop:run:*")
                         if r.hget(k, "state") == b"running"), None)

    run_id = await async_wait_until(lambda: asyncio.sleep(0, running()), what="a run running")
    worker_pid = int((fstack.run_field(run_id, "worker") or ":0").rsplit(":", 1)[1])
    next(p for p in fstack.procs if p.popen.pid == worker_pid).send(signal.SIGKILL)
    fstack.worker("n1")
    status, body = await asked
    assert status == 200 and fstack.run_field(run_id, "attempts") == "2", body
    answers.append((status, body))

    # a worker killed a moment after its stream's first output: the run fails, counting each chunk its
    # caller got (not those of the last lease renewal: none had come since)
    resp = await http.post(gw_a + "/v1/chat/completions", json=chat(max_tokens=500, stream=True, itl_ms=50,
                                                                      tokens=500))
    run_id = resp.headers["X-IOP-Run-Id"]
    events = stream_events(resp)
    got = [await anext(events)]
    worker_pid = int((fstack.run_field(run_id, "worker") or ":0").rsplit(":", 1)[1])
    next(p for p in fstack.procs if p.popen.pid == worker_pid).send(signal.SIGKILL)
    got += [e async for e in events]
    resp.close()
    assert isinstance(got[-2], dict) and got[-2]["error"]["code"] == "worker_lost", got[-2:]
    lost = content_chunks(got)
    assert lost > 0

    await async_wait_until(lambda: asyncio.sleep(0, in_flight(fstack) == 0), what="every run of the key to end")
    fstack.worker("n1")  # (the pool serves again: the fixture checks every invariant at the end)
    expected = {"runs": 6, "prompt_tokens": sum(b["usage"]["prompt_tokens"] for _, b in answers),
                "completion_tokens": streamed + lost + sum(b["usage"]["completion_tokens"] for _, b in answers),
                "failures": 1}
    with fstack.client() as r:
        usage = {k.decode(): int(v) for k, v in r.hgetall(keys.usage_total("team-a")).items()}
    assert {field: usage.get(f"{field}:{MODEL}", 0) for field in expected} == expected
    for gw in (gw_a, gw_b):
        async with http.get(gw + "/v1/usage") as listed:
            (row,) = (await listed.json())["data"]
        assert {field: row[field] for field in expected} == expected
        async with http.get(gw + "/metrics", headers=ops) as scraped:
            text = await scraped.text()
        for field, value in expected.items():
            counter = re.search(rf'^iop_usage_{field}_total\{{key="team-a",model="{re.escape(MODEL)}"\}} (\S+)$',
                                text, re.M)
            assert counter is not None and float(counter.group(1)) == value, field


def test_without_keys_the_gateway_only_listens_on_loopback(fstack: FaultStack) -> None:
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)})
    refused = subprocess.run([sys.executable, "-m", "iop", "gateway", "--host", "0.0.0.0", "--port", "0"],
                             env=fstack.env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        "iop gateway: refusing to serve anyone who can reach 0.0.0.0 without API keys: add auth.keys to the "
        "config, serve on loopback only (--host 127.0.0.1), or pass --allow-anonymous")
    proc = fstack.start("gateway-open", "gateway", "--host", "0.0.0.0", "--port", "0", "--allow-anonymous")
    proc.wait_for_line(r"listening on http://0\.0\.0\.0:\d+")
    wait_until(lambda: fstack.gateway().startswith("http://127.0.0.1:"), what="a loopback gateway")


def test_keys_new_prints_a_key_once_and_an_entry_holding_only_its_hash() -> None:
    """The key on stderr, the entry alone on stdout (`>> iop.yaml` stores no key)."""
    done = subprocess.run([sys.executable, "-m", "iop", "keys", "new", "--name", "team-z", "--role", "operator"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    (key,) = [ln for ln in done.stderr.splitlines() if not ln.startswith("#")]
    assert key.startswith("iop-") and len(key) > 40
    import yaml

    (entry,) = yaml.safe_load(done.stdout)
    assert entry == {"name": "team-z", "sha256": hash_key(key), "role": "operator"}
    assert key not in done.stdout and done.stderr.count(key) == 1
