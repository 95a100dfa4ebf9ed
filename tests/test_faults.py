"""The failure model, proven by really killing processes (issue: nothing lost, nothing stuck).

Every test runs a real stack on its own Redis server; after each, the `fstack` fixture
checks the invariants: no lease leaked, queues empty, every run terminal, each run
executed at most once.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest

from gateway.runs import LEFT, UNANSWERED
from iop.embedded_redis import RedisServer
from tests.blackhole import Blackhole
from tests.conftest import async_wait_until, paused
from tests.faults import MODEL, FaultStack, chat, run_of, start, stream_events, until_current

pytestmark = pytest.mark.e2e


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(http: aiohttp.ClientSession, gateway: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def queued() -> str:
    return f"iop:runs:{MODEL}"


# ---------------------------------------------------------------------------- 1. scheduler replicas
async def test_a_killed_scheduler_s_waiting_runs_are_taken_over(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)}, schedulers=2)
    holder = asyncio.create_task(call(http, gateway, chat(ttft_ms=1500)))
    await until_current(fstack, "only", 1)
    waiting = [asyncio.create_task(call(http, gateway, chat())) for _ in range(4)]
    r = fstack.client()
    await async_wait_until(lambda: _pending_total(r, 4), what="4 runs held by the schedulers")
    owners = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(queued(), "schedulers") if c["pending"]}
    victim = next(iter(owners))
    proc = next(p for p in fstack.procs if p.name == "scheduler" and any(victim in line for line in p.lines))
    proc.send(signal.SIGKILL)
    results = await asyncio.gather(holder, *waiting)
    assert [status for status, _ in results] == [200] * 5
    consumers = [c["name"].decode() for c in r.xinfo_consumers(queued(), "schedulers")]
    assert victim not in consumers  # the survivor claimed its runs and removed it
    r.close()


async def _pending_total(r: Any, n: int) -> bool:
    try:
        return bool(r.xpending(queued(), "schedulers")["pending"] == n)
    except Exception:
        return False


# ---------------------------------------------------------------------------- 2. leases
async def test_a_worker_killed_mid_stream_gives_worker_lost_and_the_slot_back(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)})
    body = chat(max_tokens=200, stream=True, itl_ms=100, tokens=200)
    async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        run_id = resp.headers["X-IOP-Run-Id"]
        events = stream_events(resp)
        first = await anext(events)
        assert isinstance(first, dict) and "choices" in first
        worker_pid = int((fstack.run_field(run_id, "worker") or ":0").rsplit(":", 1)[1])
        worker = next(p for p in fstack.procs if p.popen.pid == worker_pid)
        worker.send(signal.SIGKILL)
        rest = [e async for e in events]
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert errors and errors[-1]["error"]["code"] == "worker_lost"
    assert fstack.run_field(run_id, "state") == "failed"


async def test_a_worker_killed_before_output_has_its_run_retried(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)}, workers_per_node=2)
    task = asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=1000)))
    await until_current(fstack, "only", 1)
    run_id = run_of(next(r["request_id"] for r in (await fstack.stats("only"))["requests"]))
    worker_pid = int((fstack.run_field(run_id, "worker") or ":0").rsplit(":", 1)[1])
    next(p for p in fstack.procs if p.popen.pid == worker_pid).send(signal.SIGKILL)
    resp = await task
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-IOP-Run-Id"] == run_id
    assert fstack.run_field(run_id, "attempts") == "2"
    tries = [r for r in (await fstack.stats("only"))["requests"] if run_of(r["request_id"]) == run_id]
    assert [r["completed"] for r in tries] == [False, True]
    resp.release()


# ---------------------------------------------------------------------------- 3. retries
async def test_a_provider_error_before_output_is_retried_on_another_provider(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"a-bad": ("n1", 2), "b-good": ("n1", 2)},
                    sim_args={"a-bad": ("--fail-rate", "1", "--fail-status", "503")})
    status, body = await call(http, gateway, chat())
    assert status == 200 and body["model"] == MODEL
    async with http.post(gateway + "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status == 200
        chunks = [e async for e in stream_events(resp)]
    assert chunks[-1] == "[DONE]"
    bad, good = (await fstack.stats("a-bad"))["requests"], (await fstack.stats("b-good"))["requests"]
    # (its 503 says it is too busy: it is left alone for the model for a second, so the second run,
    # sent at once, went straight to b-good)
    assert len(bad) == 1 and not any(r["completed"] for r in bad)
    assert len(good) == 2 and all(r["completed"] for r in good)
    assert {r["request_id"] for r in bad} < {r["request_id"] for r in good}


async def test_retries_stop_at_max_attempts(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    # the provider drops every connection before answering: worth trying again, even there
    gateway = start(fstack, {"bad": ("n1", 1)}, queue={"max_attempts": 2},
                    sim_args={"bad": ("--fail-after-tokens", "0")})
    async with http.post(gateway + "/v1/chat/completions", json=chat()) as resp:
        status, body, run_id = resp.status, await resp.json(), resp.headers["X-IOP-Run-Id"]
    assert status == 502 and body["error"]["code"] == "provider_error"
    assert body["error"]["message"] == "provider bad: the server closed the connection"
    assert fstack.run_field(run_id, "attempts") == "2"
    # Each attempt sent it once on a new connection; one that first took a connection of the
    # pool (its probes' one) sent it once more (`workers.adapters.sending`): 2 to 4 in all.
    sent = [r for r in (await fstack.stats("bad"))["requests"] if r.get("path", "").endswith("/chat/completions")]
    assert 2 <= len(sent) <= 4, sent


@pytest.mark.parametrize("providers", [("a",), ("a", "b")])
async def test_a_server_error_is_tried_again_only_on_another_provider_once_each(
        fstack: FaultStack, http: aiohttp.ClientSession, providers: tuple[str, ...]) -> None:
    # a deterministic 500 (a parameter the server rejects that way) would only come back the same
    gateway = start(fstack, {p: ("n1", 1) for p in providers}, queue={"max_attempts": 5},
                    sim_args={p: ("--fail-rate", "1", "--fail-status", "500") for p in providers})
    status, body = await call(http, gateway, chat())
    assert status == 502 and body["error"]["code"] == "provider_error"
    assert re.fullmatch(r"provider [ab] answered 500: .+", body["error"]["message"]), body
    assert [len((await fstack.stats(p))["requests"]) for p in providers] == [1] * len(providers)


async def test_a_run_that_already_sent_output_is_never_retried(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"a": ("n1", 1), "b": ("n1", 1)})
    body = chat(max_tokens=10, stream=True, fail_after_tokens=2)
    async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = [e async for e in stream_events(resp)]
    content = [e for e in events if isinstance(e, dict) and e.get("choices")]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert content and errors and errors[0]["error"]["code"] == "provider_error"
    total = len((await fstack.stats("a"))["requests"]) + len((await fstack.stats("b"))["requests"])
    assert total == 1
    async with http.get(gateway + "/metrics") as resp:
        exposition = await resp.text()
    # the stream had begun with 200, but the run failed: the metric says so
    assert re.search(r'^iop_gateway_requests_total\{[^}]*status="502"[^}]*\} 1\.0$', exposition, re.M)


# ---------------------------------------------------------------------------- 4. cancellation
async def test_a_caller_leaving_a_queued_run_takes_it_out_of_the_queue(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)})
    holder = asyncio.create_task(call(http, gateway, chat(ttft_ms=600_000)))
    await until_current(fstack, "only", 1)
    r = fstack.client()
    waiting = asyncio.create_task(call(http, gateway, chat()))
    await async_wait_until(lambda: _is(r.xlen(queued()) == 1), what="the run to wait")
    run_id = r.xrange(queued())[0][1][b"run"].decode()
    waiting.cancel()
    await async_wait_until(lambda: _is(r.xlen(queued()) == 0), what="the queue to drop the run")
    assert fstack.run_field(run_id, "state") == "cancelled"
    holder.cancel()
    await async_wait_until(lambda: _is(r.zcard("iop:leases:only") == 0), what="the holder's slot")
    r.close()


async def _is(value: bool) -> bool:
    return value


@pytest.mark.parametrize("stream", [True, False])
async def test_a_caller_leaving_a_running_run_closes_the_provider_request(
        fstack: FaultStack, http: aiohttp.ClientSession, stream: bool) -> None:
    gateway = start(fstack, {"only": ("n1", 1)})
    body = chat(max_tokens=500, stream=stream, itl_ms=50, tokens=500)
    if stream:
        resp = await http.post(gateway + "/v1/chat/completions", json=body)
        run_id = resp.headers["X-IOP-Run-Id"]
        await anext(stream_events(resp))
        resp.close()  # the caller goes away mid-stream
    else:
        task = asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=body))
        await until_current(fstack, "only", 1)
        run_id = run_of(next(r["request_id"] for r in (await fstack.stats("only"))["requests"]))
        task.cancel()  # the caller goes away while waiting for the whole answer
    r = fstack.client()
    await async_wait_until(lambda: _disconnects(fstack, 1), what="the provider to see the disconnect")
    await async_wait_until(lambda: _is(r.zcard("iop:leases:only") == 0), what="the slot to come back")
    assert fstack.run_field(run_id, "state") == "cancelled"
    r.close()


async def _disconnects(fstack: FaultStack, n: int) -> bool:
    return bool((await fstack.stats("only"))["disconnects"] == n)


# ---------------------------------------------------------------------------- 5. timeouts
async def stalled_call(gateway: str) -> openai.InternalServerError:
    """What the official client (its default retries on) raises for a request its provider never answers."""
    async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused") as client:
        with pytest.raises(openai.InternalServerError) as err:
            body = chat(ttft_ms=600_000)
            await client.chat.completions.create(model=body["model"], messages=body["messages"],
                                                 extra_body={"sim": body["sim"]})
    return err.value


async def test_a_stalled_provider_hits_the_execution_timeout(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)}, queue={"execution_timeout_ms": 500})
    # The official client, with its default retries (it tries every 5xx twice more): the answer
    # says another try would only repeat the run (`x-should-retry: false`), so the provider
    # serves the runaway request once, not three times.
    err = await stalled_call(gateway)
    assert err.status_code == 504 and err.code == "execution_timeout"
    assert err.response.headers["x-should-retry"] == "false"
    await async_wait_until(lambda: _disconnects(fstack, 1), what="the provider request to be closed")
    assert (await fstack.stats("only"))["total"] == 1


@pytest.mark.parametrize("health", ["answers", "waits"])
async def test_a_long_whole_answer_on_a_provider_that_stays_well_is_waited_for(
        fstack: FaultStack, http: aiohttp.ClientSession, health: str) -> None:
    """A whole answer that takes longer than `read_timeout_ms` (vLLM sends nothing of it, its head
    included, until it is done) is waited for while the provider's health check passes: it was a 504
    and a strike, and was tried on another provider for as long again. A check the busy provider
    does not answer in time (`waits`: the simulator's `--busy-probe-ms`) says nothing either (issue
    8: a probe timeout on a provider with runs in flight never fails callers)."""
    # (a check that takes its time on a loaded machine still passes)
    extra = {"read_timeout_ms": 300, "probe_timeout_ms": 15_000 if health == "answers" else 300}
    gateway = start(fstack, {"only": ("n1", 1)}, provider_extra={"only": extra},
                    sim_args={"only": ("--busy-probe-ms", "600000")} if health == "waits" else None)
    async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as client:
        body = chat(ttft_ms=1500)  # (five times the read timeout)
        answer = await client.chat.completions.create(model=body["model"], messages=body["messages"],
                                                      extra_body={"sim": body["sim"]})
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert (await fstack.stats("only"))["total"] == 1
    assert fstack.health("only") == "available"


async def test_a_whole_answer_waited_on_past_its_read_timeout_ends_at_the_execution_timeout(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """The wait on a silent whole answer whose provider's probe says nothing (unanswered in time,
    the simulator's `--busy-probe-ms`) is bounded by `execution_timeout_ms`."""
    gateway = start(fstack, {"only": ("n1", 1)}, queue={"execution_timeout_ms": 1500},
                    sim_args={"only": ("--busy-probe-ms", "600000")},
                    provider_extra={"only": {"read_timeout_ms": 300, "probe_timeout_ms": 300}})
    err = await stalled_call(gateway)
    assert err.status_code == 504 and err.code == "execution_timeout"
    assert (await fstack.stats("only"))["total"] == 1
    assert fstack.health("only") == "available"


async def test_a_silent_provider_hits_its_read_timeout(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """A stream that sends nothing for `read_timeout_ms` (a whole answer waits while its provider
    does not say it is down: above)."""
    gateway = start(fstack, {"only": ("n1", 1)}, queue={"max_attempts": 3},
                    provider_extra={"only": {"read_timeout_ms": 300}})
    # (a 504 that says not to try again, as a run past its execution timeout: found by a hostile-
    # provider audit, the official client's two retries tripled the caller's wait on it)
    async with openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused") as client:
        with pytest.raises(openai.InternalServerError) as raised:
            body = chat(ttft_ms=600_000)
            await client.chat.completions.create(model=body["model"], messages=body["messages"], stream=True,
                                                 extra_body={"sim": body["sim"]})
    err = raised.value
    assert err.status_code == 504 and err.code == "provider_timeout"
    assert isinstance(err.body, dict) and err.body["message"] == "provider only: sent nothing for 300 ms"
    assert err.response.headers["x-should-retry"] == "false"
    # It took the request and is most likely still at it: not tried on it again, and one strike is
    # not three (it stays available).
    assert (await fstack.stats("only"))["total"] == 1
    r = fstack.client()
    assert r.hget("iop:provider:only", "health") == b"available"
    r.close()


# ---------------------------------------------------------------------------- 6. Redis restarts
async def test_services_reconnect_after_a_redis_restart(fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 2)})
    assert (await call(http, gateway, chat()))[0] == 200
    fstack.server.stop(kill=True)

    async def readyz(expected: int) -> bool:
        async with http.get(gateway + "/readyz") as resp:
            return resp.status == expected

    await async_wait_until(lambda: readyz(503), what="/readyz to say not ready")
    status, body = await call(http, gateway, chat())
    assert status == 503 and body["error"]["code"] == "service_unavailable"
    fstack.server.start()
    await async_wait_until(lambda: readyz(200), what="/readyz to say ready again")

    async def served() -> bool:
        return (await call(http, gateway, chat()))[0] == 200

    await async_wait_until(served, what="a run to be served again")


async def test_providers_beat_as_soon_as_a_restarted_redis_answers_not_at_their_next_beat(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """A Redis restarted without its data between two beats loses every heartbeat; each provider
    stayed `unknown`, and every caller heard 503 no_available_provider, until its worker's next
    beat: up to `heartbeat_interval_ms` (a minute here, 2 s by default; 1,320 callers of 1,625 in
    the 2 s after a restart). The worker's cancel listener finds its subscription gone, and the
    worker beats every provider as soon as Redis answers."""
    gateway = start(fstack, {"only": ("n1", 2)},
                    runtime={"heartbeat_interval_ms": 60_000, "heartbeat_ttl_ms": 75_000})
    assert (await call(http, gateway, chat()))[0] == 200
    fstack.server.stop(kill=True)
    fstack.server.start()  # (no persistence: it comes back empty)

    async def served() -> bool:
        status, body = await call(http, gateway, chat())
        assert status in (200, 503), body
        return status == 200

    await async_wait_until(served, what="a run to be served again, long before the next beat")


async def test_a_redis_that_stops_answering_gets_callers_a_503_not_a_hang_and_serves_again_when_back(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """A Redis paused with its connections up (SIGSTOP here: a frozen VM, a host cut off) answers
    nothing and closes nothing: a caller, `/readyz` and an `iop` command waited for good. Now each
    gets its answer after the URL's `socket_timeout`; the processes carry on once it is back.

    Nothing runs for nobody: a paused Redis runs what it had received when it resumes, the queueing
    of the run whose caller heard 503 too; and a caller that left while Redis was paused could not
    have its run cancelled then. The gateway cancels both once Redis answers."""
    fstack.redis_url = fstack.server.url + "?socket_timeout=2"
    # (heartbeats that outlive the pause: else the queueing finds none once Redis resumes, and queues nothing)
    gateway = start(fstack, {"only": ("n1", 2)}, runtime={"heartbeat_ttl_ms": 60_000})
    assert (await call(http, gateway, chat()))[0] == 200
    leaving = asyncio.create_task(call(http, gateway, chat(ttft_ms=30_000)))
    await until_current(fstack, "only", 1)
    with paused(fstack.server):
        leaving.cancel()  # (its gateway cannot cancel the run now)
        await asyncio.gather(leaving, return_exceptions=True)
        status, body = await asyncio.wait_for(call(http, gateway, chat(ttft_ms=30_000)), 30)  # (the test's bound)
        assert status == 503 and body["error"]["code"] == "service_unavailable", body
        async with http.get(gateway + "/readyz") as resp:
            assert resp.status == 503
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "iop", "audit"], env=fstack.env(),
                                       capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 1, done
        assert len(done.stderr.splitlines()) == 1 and "did not answer within 2 s" in done.stderr, done.stderr
        assert await _gauge(http, gateway, "iop_gateway_cancels_waiting") == 2  # (the two take-backs, kept)

    async def served() -> bool:
        return (await call(http, gateway, chat()))[0] == 200

    await async_wait_until(served, what="a run to be served again")
    r = fstack.client()
    await async_wait_until(lambda: _gauge(http, gateway, "iop_gateway_cancels_waiting", 0), what="kept cancels sent")

    def ended() -> Counter[tuple[bytes | None, bytes | None]]:
        return Counter(tuple(r.hmget(k, "state", "error_message")) for k in r.scan_iter("iop:run:*"))

    await async_wait_until(lambda: _is(ended()[(b"cancelled", UNANSWERED.encode())] == 1
                                       and ended()[(b"cancelled", LEFT.encode())] == 1),
                           what="both runs cancelled", timeout=20)
    r.close()


async def _gauge(http: aiohttp.ClientSession, gateway: str, name: str, equals: float | None = None) -> float | bool:
    """A sample of the gateway's /metrics without labels (with `equals`: whether it is that)."""
    async with http.get(gateway + "/metrics") as resp:
        found = re.search(rf"^{name} (\S+)$", await resp.text(), re.M)
    assert found is not None, name
    value = float(found.group(1))
    return value if equals is None else value == equals


@pytest.fixture
def hole(own_redis: RedisServer) -> Iterator[Blackhole]:
    """A relay to the test's Redis (ask for it before `fstack`: it closes after the stack stopped)."""
    relay = Blackhole("127.0.0.1", own_redis.port)
    yield relay
    relay.close()


async def test_connections_a_network_path_drops_in_silence_are_noticed_subscriptions_too(
        hole: Blackhole, fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """The scheduler's and the worker's connections go through a path that starts dropping
    everything without a word (a NAT or a load balancer that forgot them, both ends still up).
    Their commands time out and are made again; their subscriptions, which only ever read, waited
    for good (Redis, which still sees them, publishing to nobody): a freed slot woke no scheduler
    (the next run waited for its 1 s tick) and a caller's cancel reached the worker only at its
    lease's renewal, its GPU generating for nobody meanwhile. Now a subscription quiet for a while
    PINGs, is found dead, and is made again."""
    direct = fstack.redis_url
    fstack.redis_url = hole.url() + "/0?socket_timeout=1"
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)}, runtime={"lease_ttl_ms": 120_000})  # (renewals 40 s apart)
    scheduler = fstack.scheduler()
    worker = fstack.worker("n1")
    fstack.redis_url = direct
    gateway = fstack.gateway()
    fstack.wait_health("only", "available")
    assert (await call(http, gateway, chat()))[0] == 200
    assert hole.cut() >= 4  # (each process's subscription, lines and pool)
    await asyncio.to_thread(worker.wait_for_line, r"cancel listener: Redis unavailable \(Redis did not answer a "
                            r"PING on a subscription within 1 s\); subscribing again")
    await asyncio.to_thread(scheduler.wait_for_line, r"signals: Redis unavailable \(Redis did not answer a PING")
    assert (await call(http, gateway, chat()))[0] == 200
    leaving = asyncio.create_task(call(http, gateway, chat(ttft_ms=60_000)))
    await until_current(fstack, "only", 1)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await asyncio.to_thread(worker.wait_for_line, r"cancel requested run=")
    await until_current(fstack, "only", 0)


async def test_a_worker_stopped_while_redis_stops_answering_stops_and_leaves_its_run_to_its_lease(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """SIGTERM with a run going and Redis paused: past the grace the run is cancelled, and its end
    cannot be recorded. The worker kept trying for as long as the run's lease could live (33 s seen,
    past compose's 15 s stop period, then a SIGKILL); now it stops a few seconds after its grace,
    while Redis is still paused, and the run is the lease's, as if the worker had been killed."""
    fstack.redis_url = fstack.server.url + "?socket_timeout=1"
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)}, runtime={"lease_ttl_ms": 10_000})
    fstack.scheduler()
    worker = fstack.worker("n1", "--grace", "0.5")
    gateway = fstack.gateway()
    fstack.wait_health("only", "available")
    running = asyncio.create_task(call(http, gateway, chat(ttft_ms=60_000)))
    await until_current(fstack, "only", 1)
    with paused(fstack.server):
        assert await asyncio.to_thread(worker.stop, 60) == 0, worker.output()
        assert "runs could not record their end" in worker.output(), worker.output()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    fstack.worker("n1")  # (the node's worker again, as an operator would start it)


async def test_a_run_redis_lost_is_stopped_at_its_provider_not_left_to_its_lease(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """A restart without persistence loses a running run's record: its caller hears 502
    `worker_lost`, and the run generated on for nobody until its worker's next lease renewal (a
    third of `lease_ttl_ms`; found by a chaos test). The gateway now tells every node to cancel it."""
    gateway = start(fstack, {"only": ("n1", 1)}, runtime={"lease_ttl_ms": 600_000})  # (renewals 200 s apart)
    running = asyncio.create_task(call(http, gateway, chat(ttft_ms=120_000)))
    await until_current(fstack, "only", 1)
    fstack.server.stop(kill=True)  # (no persistence here: it comes back empty)
    fstack.server.start()
    status, body = await asyncio.wait_for(running, 60)  # (the test's bound)
    assert status == 502 and body["error"]["code"] == "worker_lost", body
    await until_current(fstack, "only", 0)  # (the provider's request closed, long before a renewal)


@pytest.mark.parametrize("own_redis", [True], indirect=True)
async def test_runs_queued_before_a_redis_restart_are_served_after_it_with_aof(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 1)})
    holder = asyncio.create_task(call(http, gateway, chat(ttft_ms=1500)))
    await until_current(fstack, "only", 1)
    waiting = [asyncio.create_task(call(http, gateway, chat())) for _ in range(2)]
    r = fstack.client()
    await async_wait_until(lambda: _is(r.xlen(queued()) == 2), what="two runs waiting")
    r.close()
    fstack.server.stop(kill=True)
    fstack.server.start()
    results = await asyncio.gather(holder, *waiting)
    assert [s for s, _ in results] == [200, 200, 200]


@pytest.mark.parametrize("own_redis", [True], indirect=True)
async def test_callers_arriving_while_redis_restarts_with_aof_are_never_told_their_run_was_lost(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """Requests that came while Redis was down wait for it to queue their runs; once it was back
    the gateway's listener read every followed run again, and those whose queueing had not gone
    through yet had no record: their callers heard 502 "the run was lost" while their runs went on
    to complete (a helper: 15 of 40 callers). Each caller now gets its answer (or a 503 when its
    queueing gave up), never a loss of a run that was not lost."""
    gateway = start(fstack, {"only": ("n1", 8)})
    assert (await call(http, gateway, chat()))[0] == 200  # (the stack is up)
    gateway_proc = next(p for p in fstack.procs if p.name.startswith("gateway"))
    seen = gateway_proc.output(last=10_000).count("Redis unavailable")
    fstack.server.stop(kill=True)

    async def gateway_found_redis_away() -> bool:
        return gateway_proc.output(last=10_000).count("Redis unavailable") > seen

    await async_wait_until(gateway_found_redis_away, what="the gateway to find Redis away")
    # (callers come while Redis starts: each one's queueing is tried again until Redis answers)
    callers = [asyncio.create_task(call(http, gateway, chat())) for _ in range(40)]
    await asyncio.to_thread(fstack.server.start)
    results = await asyncio.gather(*callers)
    assert all(status in (200, 503) for status, _ in results), [(s, b) for s, b in results if s not in (200, 503)]
    assert any(status == 200 for status, _ in results), results


@pytest.mark.parametrize("own_redis", [True], indirect=True)
async def test_streams_mid_output_through_a_redis_restart_with_aof_all_complete(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"only": ("n1", 2)})
    body = chat(max_tokens=40, stream=True, itl_ms=100, tokens=40)
    responses = [await http.post(gateway + "/v1/chat/completions", json=body) for _ in range(2)]
    streams = [stream_events(resp) for resp in responses]
    firsts = [await anext(s) for s in streams]  # both have begun
    worker = next(p for p in fstack.procs if p.name == "worker-n1")
    seen = worker.output(last=10_000).count("Redis unavailable")
    fstack.server.stop(kill=True)
    # the outage lasts until the worker has seen it three times (its heartbeats beat every 200 ms)
    await async_wait_until(lambda: asyncio.sleep(0, worker.output(last=10_000).count("Redis unavailable") >= seen + 3),
                           what="the worker to notice the outage")
    fstack.server.start()
    rests = [[e async for e in s] for s in streams]
    for resp in responses:
        resp.close()
    for first, rest in zip(firsts, rests, strict=True):
        events = [first, *rest]
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if isinstance(e, dict) and e.get("choices"))
        assert text == "".join(f"tok{i} " for i in range(40))


@pytest.mark.parametrize("own_redis", [True], indirect=True)
async def test_a_full_redis_stops_no_process_and_its_runs_go_on_once_it_has_room(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    """Redis at `maxmemory` (noeviction) refuses every write that could grow it: new runs get 503,
    an operator's change a clear error, and every process waits, as for a Redis that is down (the
    workers exited: their wake-up read starts runs, a write). A running stream's output waits,
    its lease renewed meanwhile, for longer than the lease lasts unrenewed; once Redis has room
    again the stream goes on where it was, whole, and new runs are served by the same processes."""
    gateway = start(fstack, {"only": ("n1", 2)})
    procs = list(fstack.procs)
    resp = await http.post(gateway + "/v1/chat/completions",
                           json=chat(max_tokens=30, stream=True, itl_ms=100, tokens=30))
    stream = stream_events(resp)
    first = await anext(stream)
    worker = next(p for p in procs if p.name == "worker-n1")
    r = fstack.client()
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        # full until the worker was refused three times (its emits, heartbeats and wake-up reads)
        await async_wait_until(lambda: asyncio.sleep(0, worker.output(last=10_000).count("maxmemory") >= 3),
                               what="the worker to be refused by a full Redis")
        status, body = await call(http, gateway, chat())
        assert status == 503 and body["error"]["code"] == "service_unavailable" and "full" in body["error"]["message"]
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "iop", "provider", "drain", "only"],
                                       env=fstack.env(), capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 1 and "is full (maxmemory)" in done.stderr and "Traceback" not in done.stderr
        # full for longer than the run's lease lasts unrenewed (`lease_ttl_ms`: 3 s): its renewals
        # go through, and the run keeps its lease
        (run_id, lease_ends), = r.zrange("iop:leases:only", 0, -1, withscores=True)

        def renewed_past_its_first_end() -> bool:
            score = r.zscore("iop:leases:only", run_id)
            return score is not None and score > lease_ends and time.time() * 1000 > lease_ends

        await async_wait_until(lambda: asyncio.sleep(0, renewed_past_its_first_end()), timeout=20,
                               what="the lease to be renewed past its first end while Redis is full")
        assert [p.name for p in procs if p.popen.poll() is not None] == []
    finally:
        r.config_set("maxmemory", 0)
        r.close()
    events = [first, *[e async for e in stream]]
    resp.close()
    # the stream went on where it was: whole, no error
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices")) == "".join(f"tok{i} " for i in range(30))
    assert [p.name for p in procs if p.popen.poll() is not None] == []

    async def served() -> bool:
        return (await call(http, gateway, chat()))[0] == 200

    await async_wait_until(served, what="a run to be served again")


# ---------------------------------------------------------------------------- 7. provider health
async def test_a_provider_that_stops_is_avoided_and_used_again_when_back(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"a": ("n1", 1), "b": ("n1", 1)})
    port = fstack.sims["a"].rsplit(":", 1)[1]
    fstack.sim_procs["a"].stop()
    fstack.wait_health("a", "unavailable")
    for _ in range(3):
        assert (await call(http, gateway, chat()))[0] == 200
    assert len((await fstack.stats("b"))["requests"]) == 3
    fstack.add_simulator("a", port=int(port))
    fstack.wait_health("a", "available")
    assert (await call(http, gateway, chat()))[0] == 200
    assert len((await fstack.stats("a"))["requests"]) == 1  # idle and first by id: chosen again


async def test_a_server_that_dies_mid_run_is_down_when_its_connection_is_refused_and_the_run_waits_for_another(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    # a's server dies while a run waits for its answer (long after it was sent: not taken for a
    # pooled connection's race, `sending.RESEND_WITHIN_S`), and b is full. The broken connection is
    # one strike: the run is tried again, on a (b has no slot), where the connection is refused.
    # That takes a down at once, in the script that puts the run back, not at a's next beat (a few
    # ms later, racing the dispatch): the run's third try waits for b's slot, rather than going to
    # a a third time in milliseconds (a 502 the caller need not have had; found by an operator
    # audit, 3 tries in 9 ms).
    gateway = start(fstack, {"a": ("n1", 1), "b": ("n1", 1)}, queue={"max_attempts": 3})
    on_a = asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=3000)))
    await until_current(fstack, "a", 1)  # (both idle: the first by id)
    on_b = asyncio.create_task(call(http, gateway, chat(ttft_ms=2000)))
    await until_current(fstack, "b", 1)
    run_a = run_of(next(r["request_id"] for r in (await fstack.stats("a"))["requests"]))

    async def sent_long_ago() -> bool:
        with fstack.client() as r:
            seconds, micros = r.time()
        started = fstack.run_field(run_a, "started_ms")
        return started is not None and seconds * 1000 + micros // 1000 - int(started) > 500

    await async_wait_until(sent_long_ago, what="a's run to be half a second under way")
    fstack.sim_procs["a"].send(signal.SIGKILL)
    resp = await on_a
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-IOP-Run-Id"] == run_a
    resp.release()
    # (a's beat may find it refused first, a few ms after the break, before the dispatch: then the
    # run's second try is b's already; it never goes to a a third time)
    assert (fstack.run_field(run_a, "tried") or "").split(",") in (["a", "a", "b"], ["a", "b"])
    assert fstack.health("a") == "unavailable"
    assert (await on_b)[0] == 200


async def test_stale_heartbeats_are_unknown_and_no_provider_means_503_at_once(
        fstack: FaultStack, http: aiohttp.ClientSession) -> None:
    gateway = start(fstack, {"a": ("n1", 1), "b": ("n2", 1)})
    worker_a = next(p for p in fstack.procs if p.name == "worker-n1")
    worker_a.stop()
    fstack.wait_health("a", None)  # its heartbeat expired: unknown
    assert (await call(http, gateway, chat()))[0] == 200
    assert (await fstack.stats("a"))["total"] == 0
    next(p for p in fstack.procs if p.name == "worker-n2").stop()
    fstack.wait_health("b", None)
    status, body = await call(http, gateway, chat())
    assert status == 503 and body["error"]["code"] == "no_available_provider"


async def test_processes_stop_cleanly_while_redis_is_down(fstack: FaultStack) -> None:
    start(fstack, {"only": ("n1", 1)})
    fstack.server.stop(kill=True)
    for name, last in (("worker-n1", "iop worker for node n1 stopped"), ("scheduler", r"iop scheduler \S+ stopped"),
                       ("gateway", "iop gateway stopped")):
        proc = next(p for p in fstack.procs if p.name == name)
        assert proc.stop() == 0, proc.output()
        assert proc.wait_for_line(last, timeout=1), proc.output()  # (said even with Redis away)
    fstack.server.start()  # for the invariant check

