"""Balance under load: 1,000 runs through 3 scheduler replicas and 2 workers per node over
4 providers with capacities 1, 2, 3 and 4, with random run lengths."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from iop.embedded_redis import RedisServer
from tests.faults import FaultStack, chat

pytestmark = pytest.mark.e2e

CAPACITIES = {"p1": ("n1", 1), "p2": ("n1", 2), "p3": ("n2", 3), "p4": ("n2", 4)}
RUNS = 1000
CLIENTS = 30  # more than the 10 slots, so the queue never runs dry


@pytest.fixture
def fstack(tmp_path: Path) -> Iterator[FaultStack]:
    server = RedisServer().start()
    stack = FaultStack(tmp_path, server)
    try:
        yield stack
        stack.check_invariants()
    finally:
        stack.stop_all()
        server.cleanup()


@pytest.mark.timeout(300)
async def test_a_thousand_runs_keep_every_provider_within_capacity_and_in_proportion(fstack: FaultStack) -> None:
    for pid in CAPACITIES:
        fstack.add_simulator(pid)
    fstack.configure(CAPACITIES, queue={"max_queue": 100})
    for _ in range(3):
        fstack.scheduler()
    for node in ("n1", "n2"):
        for _ in range(2):
            fstack.worker(node)
    gateway = fstack.gateway()
    for pid in CAPACITIES:
        fstack.wait_health(pid, "available")

    rng = random.Random(7)
    lengths = [rng.randint(100, 300) for _ in range(RUNS)]
    todo = iter(lengths)
    statuses: list[int] = []

    async def client(http: aiohttp.ClientSession) -> None:
        for ttft in todo:
            async with http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=ttft)) as resp:
                await resp.read()
                statuses.append(resp.status)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    assert statuses == [200] * RUNS

    stats = {pid: await fstack.stats(pid) for pid in CAPACITIES}
    total_capacity = sum(cap for _, cap in CAPACITIES.values())
    total_busy = sum(s["busy_ms"] for s in stats.values())
    assert sum(s["total"] for s in stats.values()) == RUNS
    for pid, (_, cap) in CAPACITIES.items():
        # No simulator ever saw more concurrent requests than its capacity.
        assert stats[pid]["max_concurrent"] <= cap, (pid, stats[pid]["max_concurrent"])
        # Each provider's share of busy time is within 10% of its capacity share.
        share, expected = stats[pid]["busy_ms"] / total_busy, cap / total_capacity
        assert abs(share - expected) <= 0.1 * expected, (pid, round(share, 4), expected)
    # When everything is idle again, every in_flight and queued is 0 (the fixture checks it too).
    with fstack.client() as r:
        assert all(r.zcard(f"iop:leases:{pid}") == 0 for pid in CAPACITIES)
        assert r.xlen("iop:runs:qwen3.6:35b") == 0
