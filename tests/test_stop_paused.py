"""A worker and a scheduler told to stop (SIGTERM) while their Redis does not answer (paused with its
connections up: SIGSTOP, a frozen VM, a host cut off), real processes on a real Redis: each exits
by itself before the time after which stopping it gains nothing over killing it.

- **A worker** gets, from compose.yaml, `stop_grace_period` before its SIGKILL: its `--grace`
  (the command's, 10 s) and 5 s more. Whatever its `--grace`, it must be gone within it plus that
  margin. Its `leave_node` (5 s, Redis's reply timeout), the runs' end records (5 s) and arq's
  close (5 s) took a worker with a run in flight 25 s, idle 10 s; compose's SIGKILL cut it.
- **A scheduler's** last write, deleting its liveness key, only hands its runs over sooner than the
  key's lapse (`runtime.scheduler_liveness_ms`): a stop that outlasts that is no better than a
  kill, and held up a rollout. It took 5 s (the reply timeout), against a liveness of 3 s.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest
import redis as sync_redis
import yaml

from common.config import RuntimeConfig
from iop.cli import build_parser
from tests.conftest import ROOT, Proc, paused, wait_until
from tests.faults import FaultStack, chat, until_current

pytestmark = pytest.mark.e2e

COMPOSE_WORKER: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["worker-gpu-1"]


def seconds(value: str) -> float:
    """A compose duration such as `15s` or `1m30s`."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", value))


def past_the_grace_s() -> float:
    """How long compose lets a worker run past its `--grace` once told to stop, before its SIGKILL."""
    grace: float = build_parser().parse_args(COMPOSE_WORKER["command"][1:]).grace
    return seconds(COMPOSE_WORKER["stop_grace_period"]) - grace


def stopped_by_itself(proc: Proc, within_s: float) -> tuple[int, float]:
    """SIGTERM; the exit code (a SIGKILL's -9 once `within_s` passed) and how long it took."""
    began = time.monotonic()
    code = proc.stop(timeout=within_s)
    return code, time.monotonic() - began


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "a-run-in-flight"])
async def test_a_worker_whose_redis_is_paused_exits_before_compose_would_kill_it(
        fstack: FaultStack, in_flight: bool) -> None:
    grace_s = 1.0
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)}, runtime={"lease_ttl_ms": 10_000})
    fstack.scheduler()
    worker = fstack.worker("n1", "--grace", f"{grace_s:g}")
    gateway = fstack.gateway()
    fstack.wait_health("only", "available")
    async with aiohttp.ClientSession() as http:
        running = None
        if in_flight:  # (a run that outlasts the grace: it is cancelled, and cannot record its end)
            running = asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=60_000)))
            await until_current(fstack, "only", 1)
        limit_s = grace_s + past_the_grace_s()
        with paused(fstack.server):
            code, took = await asyncio.to_thread(stopped_by_itself, worker, limit_s)
        assert code == 0, f"killed {limit_s:g} s after SIGTERM (--grace {grace_s:g}), as compose would:\n" + \
            worker.output()
        assert "iop worker for node n1 stopped" in worker.output(), worker.output()
        if running is not None:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    print(f"worker stopped in {took:.2f} s")
    fstack.worker("n1")  # (the node's worker again, as an operator would start it: the run's lease is its)


@pytest.mark.parametrize(("waiting", "away"), [(0, False), (20, False), (0, True)],
                         ids=["idle", "runs-waiting", "redis-away-a-while"])
async def test_a_scheduler_whose_redis_is_paused_exits_before_its_liveness_key_would_lapse(
        fstack: FaultStack, waiting: int, away: bool) -> None:
    """`away`: Redis stopped answering long enough before the SIGTERM that the scheduler's commands
    timed out and their connections are being made again (the delete waited behind another task's
    handshake, which held the pool: 6.5-9.5 s)."""
    liveness_ms = RuntimeConfig().scheduler_liveness_ms  # (the default, as compose runs it)
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)}, runtime={"scheduler_liveness_ms": liveness_ms})
    scheduler = fstack.scheduler()
    consumer = scheduler.wait_for_line(r"iop scheduler (\S+) running").group(1)
    fstack.worker("n1")
    gateway = fstack.gateway()
    fstack.wait_health("only", "available")

    def beaten() -> bool:
        with sync_redis.Redis.from_url(fstack.redis_url) as r:
            return bool(r.exists(f"iop:scheduler:{consumer}"))

    wait_until(beaten, what="the scheduler's liveness key")
    async with aiohttp.ClientSession() as http:
        # (one run on the provider, the others waiting behind it in the scheduler's queue)
        calls = [asyncio.create_task(http.post(gateway + "/v1/chat/completions", json=chat(ttft_ms=60_000)))
                 for _ in range(waiting)]
        if waiting:
            await until_current(fstack, "only", 1)
        with paused(fstack.server):
            if away:
                await asyncio.to_thread(scheduler.wait_for_line, "liveness: Redis unavailable", 30)
            code, took = await asyncio.to_thread(stopped_by_itself, scheduler, liveness_ms / 1000)
        assert code == 0, f"killed {liveness_ms} ms after SIGTERM (its liveness key lapsed by then):\n" + \
            scheduler.output()
        assert re.search(r"iop scheduler \S+ stopped", scheduler.output()), scheduler.output()
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    print(f"scheduler stopped in {took:.2f} s")
    fstack.scheduler()  # (the pool's scheduler again, to time out or cancel what waited)
