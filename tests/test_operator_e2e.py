"""Operator control end to end, with real processes on a Redis of the test's own (`FaultStack`; the
fixture checks after each test that no lease leaked, nothing is left queued and no run ran twice).

- A drain under load, through 3 scheduler replicas: not one run is dispatched to the provider
  after `iop provider drain` returned, the runs it had finish, nothing fails, and it takes runs
  again once undrained.
- A capacity override from 4 to 1 with 4 runs in flight: none is interrupted, no new run starts
  there until in_flight is 0, and the simulator never sees more than 1 at once after that.
- Every iop service (and Redis, with AOF) restarted with a drain and an override in place: both hold.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from common.codec import unpack
from iop.embedded_redis import RedisServer
from tests.conftest import async_wait_until
from tests.faults import MODEL, FaultStack, chat, run_of, start

pytestmark = pytest.mark.e2e


def iop(fstack: FaultStack, *args: str) -> str:
    """Run an `iop` command against the stack's config and Redis; returns its output (exit 0 required)."""
    done = subprocess.run([sys.executable, "-m", "iop", *args], env=fstack.env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def catalog(gateway: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(gateway + "/v1/catalog") as resp:
        assert resp.status == 200
        data: dict[str, Any] = await resp.json()
        return data


def provider(cat: dict[str, Any], pid: str) -> dict[str, Any]:
    found: dict[str, Any] = next(p for p in cat["providers"] if p["id"] == pid)
    return found


def dispatches_to(fstack: FaultStack, pid: str) -> list[tuple[int, str]]:
    """(Redis time in ms, run id) of every `dispatched` event naming `pid`, from every run's events."""
    out = []
    with fstack.client() as r:
        for key in r.scan_iter("iop:events:*"):
            run_id = key.decode().split(":", 2)[2]
            for entry_id, fields in r.xrange(key):
                if fields[b"type"] == b"dispatched" and unpack(fields[b"data"])["provider"] == pid:
                    out.append((int(entry_id.split(b"-")[0]), run_id))
    return out


class Load:
    """Callers sending runs back to back until told to stop; every status is kept."""

    def __init__(self, gateway: str, clients: int, ttft_ms: tuple[int, int]) -> None:
        self.gateway = gateway
        self.statuses: list[int] = []
        self.stopping = asyncio.Event()
        self.rng = random.Random(12)
        self.ttft_ms = ttft_ms
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self.tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        while not self.stopping.is_set():
            body = chat(ttft_ms=self.rng.randint(*self.ttft_ms))
            async with self.session.post(self.gateway + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                self.statuses.append(resp.status)

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)
        await self.session.close()


@pytest.mark.timeout(240)
async def test_a_drain_under_load_dispatches_nothing_there_after_the_command_returned(fstack: FaultStack) -> None:
    gateway = start(fstack, {"p1": ("n1", 3), "p2": ("n2", 3)}, schedulers=3, queue={"max_queue": 64})
    # 12 callers for 6 slots keep both full; runs of 1.5-3 s outlast the `iop` command's own start and exit
    load = Load(gateway, clients=12, ttft_ms=(1500, 3000))
    try:
        async def p1_busy() -> bool:
            stats = await fstack.stats("p1")
            return bool(stats["total"] >= 6 and stats["current"] > 0)
        await async_wait_until(p1_busy, timeout=30, what="p1 to serve under load")

        out = await asyncio.to_thread(iop, fstack, "provider", "drain", "p1")
        # Everything dispatched to p1 before the drain's write is either still holding its lease now
        # or has already been served by p1 (its lease goes only after its provider answered).
        with fstack.client() as r:
            holding = {m.decode() for m in r.zrange("iop:leases:p1", 0, -1)}
            (audit_id, audit) = r.xrevrange("iop:audit", "+", "-", count=1)[0]
        served_before = {run_of(q["request_id"]) for q in (await fstack.stats("p1"))["requests"]}
        assert out.startswith("drain provider p1: drained (was active)")
        assert audit[b"action"] == b"drain" and audit[b"who"].startswith(b"cli:")
        drained_at = int(audit_id.split(b"-")[0])
        assert holding, "the drain should catch runs in flight on p1 (the test's load keeps it full)"

        cat = await catalog(gateway)
        p1 = provider(cat, "p1")
        assert p1["control"]["state"] == ("draining" if p1["in_flight"] else "drained")

        async def drained() -> bool:
            return bool(provider(await catalog(gateway), "p1")["control"]["state"] == "drained")
        await async_wait_until(drained, timeout=30, what="p1 to show drained once its runs ended")
        async def all_completed() -> bool:  # the runs it had finished normally
            return all(fstack.run_field(run_id, "state") == "completed" for run_id in holding)
        await async_wait_until(all_completed, timeout=30, what="p1's runs to complete")
        p2_then = (await fstack.stats("p2"))["total"]

        async def p2_took_more() -> bool:
            return bool((await fstack.stats("p2"))["total"] >= p2_then + 10)
        await async_wait_until(p2_took_more, timeout=60, what="the load to go on, on p2 alone")
        assert (await fstack.stats("p1"))["current"] == 0

        # Not a run dispatched to p1 after the command returned: p1 has seen no other runs...
        seen_by_p1 = {run_of(q["request_id"]) for q in (await fstack.stats("p1"))["requests"]}
        assert seen_by_p1 <= holding | served_before, seen_by_p1 - holding - served_before
        # ... and no dispatch event names it after the drain was written (same ms: the same instant).
        late = [(ms, run) for ms, run in dispatches_to(fstack, "p1") if ms > drained_at]
        assert late == []

        out = await asyncio.to_thread(iop, fstack, "provider", "undrain", "p1")
        assert out.startswith("undrain provider p1: active (was drained)")
        p1_then = (await fstack.stats("p1"))["total"]

        async def p1_takes_runs() -> bool:
            return bool((await fstack.stats("p1"))["total"] >= p1_then + 3)
        await async_wait_until(p1_takes_runs, timeout=30, what="p1 to take runs again")
    finally:
        await load.stop()
    assert load.statuses and set(load.statuses) == {200}, "nothing fails because of a drain"


@pytest.mark.timeout(180)
async def test_a_capacity_lowered_below_in_flight_interrupts_nothing_and_holds_new_runs_back(
        fstack: FaultStack) -> None:
    gateway = start(fstack, {"p": ("n1", 4)}, queue={"max_queue": 64})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def run(ttft_ms: int) -> tuple[int, dict[str, Any], str]:
            async with http.post(gateway + "/v1/chat/completions", json=chat(max_tokens=4, ttft_ms=ttft_ms)) as resp:
                return resp.status, await resp.json(), resp.headers.get("X-IOP-Run-Id", "")

        # 4 runs fill p (capacity 4); they end one after another, 0.5 s apart.
        first = [asyncio.create_task(run(1500 + 500 * i)) for i in range(4)]

        async def four_in_flight() -> bool:
            return bool((await fstack.stats("p"))["current"] == 4)
        await async_wait_until(four_in_flight, what="4 runs in flight on p")
        # 4 more wait behind them
        later = [asyncio.create_task(run(200)) for _ in range(4)]

        async def four_waiting() -> bool:
            with fstack.client() as r:
                return bool(r.xlen(f"iop:runs:{MODEL}") == 4)
        await async_wait_until(four_waiting, what="4 runs waiting")

        async with http.post(gateway + "/v1/admin/providers/p/capacity", json={"capacity": 1}) as resp:
            assert resp.status == 200
            answer = await resp.json()
        (p,) = answer["providers"]
        assert (p["configured_capacity"], p["effective_capacity"], p["in_flight"]) == (4, 1, 4)
        assert answer["change"]["who"] == "anonymous"

        firsts = await asyncio.gather(*first)
        for status, body, _ in firsts:  # none was interrupted
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] and body["choices"][0]["finish_reason"] == "length"
        lasts = await asyncio.gather(*later)
        assert [status for status, _, _ in lasts] == [200] * 4

        # No later run started before the last of the first four ended (in_flight back to 0), and they
        # went one at a time (each dispatched once the one before it ended).
        ends = [int(fstack.run_field(run_id, "finished_ms") or 0) for _, _, run_id in firsts]
        spans = sorted((int(fstack.run_field(run_id, "dispatched_ms") or 0),
                        int(fstack.run_field(run_id, "finished_ms") or 0)) for _, _, run_id in lasts)
        assert spans[0][0] >= max(ends), (spans, ends)
        for (_, end), (start_next, _) in zip(spans, spans[1:], strict=False):
            assert start_next >= end, spans

        # Drained down to the override: the simulator never sees more than 1 at once.
        async with http.post(fstack.sims["p"] + "/stats/reset") as resp:
            assert resp.status == 200
        more = await asyncio.gather(*(run(100) for _ in range(6)))
        assert [status for status, _, _ in more] == [200] * 6
        stats = await fstack.stats("p")
        assert stats["total"] == 6 and stats["max_concurrent"] == 1

        async with http.delete(gateway + "/v1/admin/providers/p/capacity") as resp:
            assert resp.status == 200
        async with http.post(fstack.sims["p"] + "/stats/reset") as resp:
            assert resp.status == 200
        again = await asyncio.gather(*(run(400) for _ in range(4)))
        assert [status for status, _, _ in again] == [200] * 4
        assert (await fstack.stats("p"))["max_concurrent"] > 1  # cleared: the configured 4 again


@pytest.mark.timeout(180)
@pytest.mark.parametrize("own_redis", [True], indirect=True)
async def test_a_drain_and_an_override_outlive_a_restart_of_every_service(fstack: FaultStack,
                                                                           own_redis: RedisServer) -> None:
    gateway = start(fstack, {"p1": ("n1", 2), "p2": ("n2", 4)})
    iop(fstack, "provider", "drain", "p1")
    iop(fstack, "provider", "capacity", "p2", "1")
    iop(fstack, "node", "cordon", "n1")

    for proc in list(fstack.procs):  # every iop service; the simulators stand for the providers
        if not proc.name.startswith("sim-"):
            proc.stop()
    own_redis.stop()
    own_redis.start()
    fstack.procs = [p for p in fstack.procs if p.name.startswith("sim-")]
    fstack.scheduler()
    fstack.scheduler()
    fstack.worker("n1")
    fstack.worker("n2")
    gateway = fstack.gateway()
    for pid in ("p1", "p2"):
        fstack.wait_health(pid, "available")

    cat = await catalog(gateway)
    p1, p2 = provider(cat, "p1"), provider(cat, "p2")
    assert p1["control"]["state"] == "drained" and p1["control"]["drained_since_ms"] is not None
    assert p1["control"]["cordoned_since_ms"] is not None
    assert (p2["control"]["state"], p2["effective_capacity"], p2["configured_capacity"]) == ("active", 1, 4)
    assert [e["action"] for e in (await _audit(gateway))] == ["cordon", "capacity", "drain"]

    for pid in ("p1", "p2"):
        async with aiohttp.ClientSession() as s, s.post(fstack.sims[pid] + "/stats/reset") as resp:
            assert resp.status == 200
    assert await _chats(gateway, 5, ttft_ms=150) == [200] * 5
    assert (await fstack.stats("p1"))["total"] == 0
    p2_stats = await fstack.stats("p2")
    assert p2_stats["total"] == 5 and p2_stats["max_concurrent"] == 1

    iop(fstack, "provider", "undrain", "p1")
    iop(fstack, "node", "uncordon", "n1")
    assert await _chats(gateway, 4, ttft_ms=300) == [200] * 4
    assert (await fstack.stats("p1"))["total"] >= 1  # taken back: p1 (0/2) beats p2 (1/1 while busy)


async def _chats(gateway: str, n: int, ttft_ms: int) -> list[int]:
    """`n` chat completions at once through the gateway; their HTTP statuses."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def one() -> int:
            async with http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=ttft_ms)) as resp:
                await resp.read()
                return resp.status
        return list(await asyncio.gather(*(one() for _ in range(n))))


async def _audit(gateway: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(gateway + "/v1/admin/audit") as resp:
        assert resp.status == 200
        data: list[dict[str, Any]] = (await resp.json())["data"]
        return data
