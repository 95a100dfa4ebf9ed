"""Redis Sentinel, with real processes: a primary, a replica and three sentinels from the one Redis
binary, the whole iop stack pointed at them with a `redis+sentinel://` URL, callers streaming in,
then SIGKILL of the primary.

What must hold: every caller gets an answer (a completion, or an OpenAI-shaped error; never a
hang), new runs succeed within 15 s of the promotion, and once the callers are answered the pool
settles: no lease left, nothing queued, every run terminal. Replication is asynchronous, so a run
may be executed twice (its end was written to the old primary only); that is counted and shown,
not forbidden.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from common.scripts import SHAS
from tests.conftest import ROOT, Stack, async_wait_until
from tests.faults import FAST_RUNTIME, MODEL, FaultStack, chat, run_of
from tests.sentinel import MASTER, SentinelCluster

pytestmark = pytest.mark.e2e

#: The issue's bound: new runs succeed within this long after the promotion.
NEW_RUNS_WITHIN_S = 15.0
#: Queue and execution timeouts of the test pool: a caller's answer is due within
#: (queue + execution) x max_attempts + the gateway's 30 s grace = 90 s, whatever happens.
QUEUE = {"queue_timeout_ms": 10_000, "execution_timeout_ms": 10_000, "max_attempts": 3}
ANSWER_WITHIN_S = 95.0
CALLERS = 8


@pytest.fixture
def cluster() -> Iterator[SentinelCluster]:
    c = SentinelCluster()
    try:
        yield c.start()
    finally:
        c.cleanup()


class SentinelStack(FaultStack):
    """The fault suite's stack, on a Sentinel URL; its own checks read the current primary."""

    def __init__(self, tmp: Path, cluster: SentinelCluster) -> None:
        Stack.__init__(self, tmp, cluster.url)
        self.cluster = cluster
        self.sims = {}
        self.sim_procs = {}
        self.providers = {}

    def client(self) -> Any:
        return self.cluster.primary()


@pytest.fixture
def sstack(tmp_path: Path, cluster: SentinelCluster) -> Iterator[SentinelStack]:
    stack = SentinelStack(tmp_path, cluster)
    try:
        yield stack
    finally:
        stack.stop_all()


@dataclass(slots=True)
class Call:
    started: float
    stream: bool
    ended: float = 0.0
    outcome: str = ""  # "completed", "<status> <code>" for an OpenAI-shaped error, else what went wrong
    run_id: str = ""

    @property
    def answered(self) -> bool:
        return self.outcome == "completed" or self.outcome.split(" ")[0].isdigit()


def _error_code(body: Any) -> str | None:
    """The code of an OpenAI-shaped error body, or None if it is not one."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str) \
            and isinstance(err.get("code"), str):
        return str(err["code"])
    return None


async def _one_call(http: aiohttp.ClientSession, gateway: str, stream: bool) -> Call:
    call = Call(time.monotonic(), stream)
    try:
        async with http.post(gateway + "/v1/chat/completions", json=chat(max_tokens=8, stream=stream)) as resp:
            call.run_id = resp.headers.get("X-IOP-Run-Id", "")
            if resp.status != 200 or not stream:
                body = json.loads(await resp.text())
                code = _error_code(body)
                if resp.status == 200 and body.get("choices") and body["choices"][0]["message"]["content"]:
                    call.outcome = "completed"
                elif resp.status != 200 and code:
                    call.outcome = f"{resp.status} {code}"
                else:
                    call.outcome = f"unexpected {resp.status}: {body}"
            else:
                chunks: list[Any] = []
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        chunks.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                errors = [_error_code(c) for c in chunks if isinstance(c, dict) and "error" in c]
                if errors and errors[0]:
                    call.outcome = f"200 {errors[0]}"
                elif chunks and chunks[-1] == "[DONE]" and not errors:
                    call.outcome = "completed"
                else:
                    call.outcome = f"a stream without [DONE] or an error: {chunks[-3:]}"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        call.outcome = f"no answer: {exc!r}"
    call.ended = time.monotonic()
    return call


async def _iop(*args: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    """An `iop` inspection command, run beside the callers (in a thread: it blocks)."""
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "iop", *args, "--redis", redis_url],
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)


def _callers(gateway: str, calls: list[Call], stop: asyncio.Event) -> list[asyncio.Task[None]]:
    """`CALLERS` callers, each sending one request after the other (stream or not, by turns) until
    `stop`, every call's outcome into `calls`."""
    async def caller(n: int) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ANSWER_WITHIN_S)) as http:
            i = 0
            while not stop.is_set():
                calls.append(await _one_call(http, gateway, stream=(n + i) % 2 == 0))
                i += 1

    return [asyncio.create_task(caller(n)) for n in range(CALLERS)]


def _start_pool(sstack: SentinelStack, lease_ttl_ms: int) -> str:
    """Two simulators on two nodes, the scheduler, a worker per node and the gateway, on the
    Sentinel URL; the gateway's address once both providers are available."""
    for pid in ("a", "b"):
        sstack.add_simulator(pid, "--ttft-ms", "150", "--itl-ms", "25")
    sstack.configure({"a": ("n1", 4), "b": ("n2", 4)}, queue=QUEUE)
    sstack.write_config({**yaml.safe_load(sstack.config_path.read_text()),
                         "runtime": {**FAST_RUNTIME, "lease_ttl_ms": lease_ttl_ms}})
    sstack.scheduler()
    sstack.worker("n1")
    sstack.worker("n2")
    gateway = sstack.gateway()
    for pid in ("a", "b"):
        sstack.wait_health(pid, "available")
    return gateway


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lease_ttl_ms", [5000, 1500], ids=["leases-outlast-the-failover", "leases-expire-in-it"])
async def test_the_stack_follows_a_failover_of_the_primary(sstack: SentinelStack, cluster: SentinelCluster,
                                                           lease_ttl_ms: int) -> None:
    gateway = _start_pool(sstack, lease_ttl_ms)

    calls: list[Call] = []
    stop = asyncio.Event()
    callers = _callers(gateway, calls, stop)
    try:
        await async_wait_until(lambda: _count(calls, 20), timeout=60, what="20 runs served before the failover")
        before = await _iop("queues", "--json", "--config", str(sstack.config_path), redis_url=cluster.url)
        assert before.returncode == 0, before.stderr
        assert json.loads(before.stdout)["queues"][0]["model"] == MODEL

        # Redis does not copy its script cache to a replica: the promoted one must be taught them.
        shas = list(SHAS.values())
        assert not any(cluster.ask("replica", lambda r: r.script_exists(*shas)))

        killed = time.monotonic()
        cluster.kill("primary")
        await async_wait_until(lambda: asyncio.to_thread(cluster.promoted), timeout=60,
                               what="the sentinels to promote the replica")
        promoted = time.monotonic()

        def served_after(t: float) -> list[Call]:
            return [c for c in calls if c.started >= t and c.outcome == "completed"]

        # The load goes on until 20 runs begun after the promotion were served (or the bound passed).
        async def enough() -> bool:
            return len(served_after(promoted)) >= 20 or time.monotonic() > promoted + NEW_RUNS_WITHIN_S
        await async_wait_until(enough, timeout=NEW_RUNS_WITHIN_S + 5, what="runs after the promotion")
    finally:
        stop.set()
        await asyncio.gather(*callers)  # each call ends by itself: answered, or its client timeout
    done = time.monotonic()

    unanswered = [c.outcome for c in calls if not c.answered]
    assert not unanswered, f"callers without an answer: {unanswered}"
    first = min((c.ended for c in served_after(promoted)), default=None)
    outcomes = Counter(c.outcome for c in calls)
    errors = Counter(c.outcome for c in calls if c.outcome != "completed")
    during = Counter(c.outcome for c in calls if c.outcome != "completed" and c.ended >= killed)

    settled_at = time.monotonic()
    twice = await asyncio.to_thread(sstack.check_invariants, 30.0, False)
    settled = time.monotonic()

    with cluster.primary() as r:
        failed = [{"outcome": c.outcome, "stream": c.stream, "run": c.run_id,
                   "ended_s_after_promotion": round(c.ended - promoted, 2),
                   **{k.decode(): v.decode() for k, v in r.hgetall(f"iop:run:{c.run_id}").items()
                      if k in (b"state", b"attempts", b"error_message")}}
                  for c in calls if c.outcome != "completed"]
        ran_twice = {run: {k.decode(): v.decode() for k, v in r.hgetall(f"iop:run:{run}").items()
                           if k in (b"state", b"attempts", b"stream", b"error_message")}
                     for run in (run_of(rid) for rid in twice)}
    print(json.dumps({
        "lease_ttl_ms": lease_ttl_ms, "calls": len(calls), "outcomes": dict(outcomes), "failed": failed,
        "errors_after_the_kill": dict(during), "errors_before_the_kill": dict(errors - during),
        "promotion_after_kill_s": round(promoted - killed, 2),
        "first_new_run_served_after_promotion_s": None if first is None else round(first - promoted, 2),
        "runs_executed_twice": ran_twice,
        "every_caller_answered_s_after_promotion": round(done - promoted, 2),
        "pool_settled_in_s": round(settled - settled_at, 2),
    }, indent=2))
    assert first is not None and first - promoted <= NEW_RUNS_WITHIN_S, \
        f"no new run served within {NEW_RUNS_WITHIN_S} s of the promotion: {outcomes}"

    # The scheduler's wake-ups and each worker's cancel listener subscribed again, on the new primary.
    def subscribers() -> dict[str, int]:
        with cluster.primary() as r:
            return {k.decode(): int(n) for k, n in r.pubsub_numsub("iop:signals", "iop:cancel:n1", "iop:cancel:n2")}
    await async_wait_until(lambda: asyncio.to_thread(lambda: set(subscribers().values()) == {1}), timeout=30,
                           what="the pub/sub listeners to subscribe on the new primary")

    with cluster.primary() as r:  # loaded there when the first call of each met NOSCRIPT
        assert all(r.script_exists(*shas))

    # The inspection commands follow the promotion too.
    after = await _iop("queues", "--json", "--config", str(sstack.config_path), redis_url=cluster.url)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["queues"][0]["waiting"] == 0
    last = max(served_after(promoted), key=lambda c: c.started)
    shown = await _iop("runs", "show", last.run_id, "--json", redis_url=cluster.url)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "completed"


async def _count(calls: list[Call], n: int) -> bool:
    return sum(c.outcome == "completed" for c in calls) >= n


@pytest.mark.timeout(300)
async def test_a_failover_asked_for_moves_every_process_off_the_old_primary_which_stays_up(
        sstack: SentinelStack, cluster: SentinelCluster) -> None:
    """`SENTINEL FAILOVER` leaves the old primary running, and a primary until Sentinel turns it
    into a replica. Here it never does (its REPLICAOF is refused), so the window in which iop could
    write to the old primary, and lose it, has no end unless iop follows the sentinels' announcement
    of the new primary itself: every process must leave the old primary, and every run begun after
    that must be on the new one."""
    gateway = _start_pool(sstack, 5000)
    cluster.ask("primary", lambda r: r.execute_command("ACL", "SETUSER", "default", "-replicaof", "-slaveof"))
    assert cluster.clients_on("primary"), "iop's processes are connected to the primary"

    calls: list[Call] = []
    stop = asyncio.Event()
    callers = _callers(gateway, calls, stop)
    try:
        await async_wait_until(lambda: _count(calls, 20), timeout=60, what="20 runs served before the failover")
        cluster.ask("sentinel-1", lambda s: s.execute_command("SENTINEL", "FAILOVER", MASTER))
        await async_wait_until(lambda: asyncio.to_thread(cluster.promoted), timeout=60,
                               what="the sentinels to promote the replica")
        await async_wait_until(lambda: asyncio.to_thread(lambda: not cluster.clients_on("primary")), timeout=30,
                               what="every iop connection to leave the old primary")
        left = time.monotonic()
        # Sentinel could not demote it: still a primary, and so it would have taken every write.
        assert cluster.ask("primary", lambda r: r.info("replication")["role"]) == "master"
        assert cluster.clients_on("replica"), "iop's processes are connected to the new primary"

        async def enough() -> bool:
            return sum(c.started >= left and c.outcome == "completed" for c in calls) >= 20
        await async_wait_until(enough, timeout=60, what="20 runs served after the switch")
    finally:
        stop.set()
        await asyncio.gather(*callers)

    unanswered = [c.outcome for c in calls if not c.answered]
    assert not unanswered, f"callers without an answer: {unanswered}"
    after = [c for c in calls if c.started >= left and c.outcome == "completed"]
    with cluster.client("replica") as new, cluster.client("primary") as old:
        assert [new.hget(f"iop:run:{c.run_id}", "state") for c in after] == [b"completed"] * len(after)
        assert [old.exists(f"iop:run:{c.run_id}") for c in after] == [0] * len(after)
    assert not cluster.clients_on("primary"), "no iop process went back to the old primary"
    await asyncio.to_thread(sstack.check_invariants, 30.0, False)
