"""Helpers for the fault suite: a stack on its own killable Redis, and the invariants that
must hold after every fault (no lease leaked, queues empty, runs terminal, each run
executed at most once)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from iop.embedded_redis import RedisServer
from tests.conftest import Stack, async_wait_until, wait_until

FAST_RUNTIME = {"heartbeat_interval_ms": 200, "heartbeat_ttl_ms": 1000, "probe_interval_ms": 200, "lease_ttl_ms": 3000,
                "scheduler_liveness_ms": 1000}
MODEL = "qwen3.6:35b"
TERMINAL = {b"completed", b"failed", b"cancelled", b"timed_out"}


class FaultStack(Stack):
    """A Stack that knows its providers and simulators, and checks the invariants."""

    def __init__(self, tmp: Path, server: RedisServer) -> None:
        super().__init__(tmp, server.url)
        self.server = server
        self.sims: dict[str, str] = {}
        self.sim_procs: dict[str, Any] = {}
        self.providers: dict[str, tuple[str, int]] = {}

    def client(self) -> sync_redis.Redis:
        return sync_redis.Redis.from_url(self.redis_url, socket_timeout=5)

    def add_simulator(self, pid: str, *extra: str, port: int = 0) -> str:
        proc = self.start(f"sim-{pid}", "simulator", "--port", str(port), "--models", f"{pid}-served", *extra)
        url = proc.wait_for_line(r"listening on (http://\S+)").group(1)
        self.sims[pid] = url
        self.sim_procs[pid] = proc
        return url

    def configure(self, providers: dict[str, tuple[str, int]], queue: dict[str, int] | None = None,
                  provider_extra: dict[str, dict[str, Any]] | None = None,
                  auth: dict[str, Any] | None = None, runtime: dict[str, int] | None = None) -> None:
        """providers: id -> (node, capacity); each must have a simulator already. `runtime`: what
        differs from FAST_RUNTIME."""
        self.providers = providers
        nodes: dict[str, list[dict[str, Any]]] = {}
        for pid, (node, capacity) in providers.items():
            entry = {"id": pid, "type": "vllm", "base_url": self.sims[pid], "capacity": capacity,
                     "models": [f"{pid}-served"], **(provider_extra or {}).get(pid, {})}
            nodes.setdefault(node, []).append(entry)
        config: dict[str, Any] = {
            "models": [{"id": MODEL, "providers": {pid: f"{pid}-served" for pid in providers}}],
            "nodes": [{"id": n, "providers": ps} for n, ps in nodes.items()],
            "runtime": {**FAST_RUNTIME, **(runtime or {})},
            "queue": {"max_queue": 64, "queue_timeout_ms": 30_000, **(queue or {})},
        }
        if auth is not None:
            config["auth"] = auth
        self.write_config(config)

    def health(self, pid: str) -> str | None:
        with self.client() as r:
            value = r.hget(f"iop:provider:{pid}", "health")
            return value.decode() if value else None

    def wait_health(self, pid: str, health: str | None, timeout: float = 20.0) -> None:
        wait_until(lambda: self.health(pid) == health, timeout=timeout, what=f"{pid} to be {health}")

    def run_field(self, run_id: str, field: str) -> str | None:
        with self.client() as r:
            value = r.hget(f"iop:run:{run_id}", field)
            return value.decode() if value else None

    async def stats(self, pid: str) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.sims[pid] + "/stats") as resp:
            data: dict[str, Any] = await resp.json()
            return data

    def sim_stats(self, pid: str) -> dict[str, Any]:
        return asyncio.run(self.stats(pid))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, timeout: float = 20.0, at_most_once: bool = True) -> dict[str, int]:
        """Poll until the pool is idle and consistent, then check what each simulator ran: no run
        executed twice, unless `at_most_once` is off (a Redis failover may lose the record of a
        run's end); returns the runs executed more than once."""
        def idle() -> list[str]:
            problems = []
            with self.client() as r:
                for pid in self.providers:
                    if r.zcard(f"iop:leases:{pid}"):
                        problems.append(f"lease leaked on {pid}: {r.zrange(f'iop:leases:{pid}', 0, -1)}")
                if r.xlen(f"iop:runs:{MODEL}"):
                    problems.append(f"{r.xlen(f'iop:runs:{MODEL}')} runs still queued")
                for key in r.scan_iter("iop:node:*", _type="zset"):
                    if r.zcard(key):
                        problems.append(f"jobs left in {key!r}")
                for key in r.scan_iter("iop:run:*"):
                    state = r.hget(key, "state")
                    if state not in TERMINAL:
                        problems.append(f"{key!r} is {state!r}")
            return problems

        last: list[str] = []

        def settled() -> bool:
            nonlocal last
            last = idle()
            return not last

        try:
            wait_until(settled, timeout=timeout, what="the pool to settle")
        except AssertionError:
            raise AssertionError("invariants broken: " + "; ".join(last)) from None
        completed: Counter[str] = Counter()
        seen: list[tuple[str, dict[str, Any]]] = []
        for pid in self.sims:
            if self.sim_procs[pid].popen.poll() is not None:
                continue
            for req in self.sim_stats(pid)["requests"]:
                seen.append((pid, req))
                if req["completed"] and req["request_id"]:
                    completed[req["request_id"]] += 1
        twice = {run: n for run, n in completed.items() if n > 1}
        # (each execution of those, to line up with the processes' logs: where the second came from)
        told = [f"{pid}: {req}" for pid, req in seen if req["request_id"] in twice]
        assert not (at_most_once and twice), f"runs executed more than once: {twice}; " + "; ".join(told)
        return twice


def run_of(request_id: str) -> str:
    """The run id behind the `X-Request-Id` a provider saw (`common.wire.upstream_request_id`)."""
    return "run_" + uuid.UUID(request_id).hex


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A blocking POST (for use from threads/sync tests)."""
    async def go() -> tuple[int, dict[str, Any], dict[str, str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.post(url, json=body) as resp:
                text = await resp.text()
                return resp.status, json.loads(text) if text else {}, dict(resp.headers)
    return asyncio.run(go())


def chat(max_tokens: int = 2, stream: bool = False, **sim: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": max_tokens, "stream": stream}
    if sim:
        body["sim"] = sim
    return body


# ------------------------------------------------------------------ fixtures (a pytest plugin: see conftest)
@pytest.fixture
def own_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    server = RedisServer(appendonly=bool(getattr(request, "param", False))).start()
    yield server
    server.cleanup()


@pytest.fixture
def fstack(tmp_path: Path, own_redis: RedisServer) -> Iterator[FaultStack]:
    stack = FaultStack(tmp_path, own_redis)
    try:
        yield stack
        stack.check_invariants()
    finally:
        stack.stop_all()



async def stream_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | str]:
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[6:]
            yield payload if payload == "[DONE]" else json.loads(payload)


def start(fstack: FaultStack, providers: dict[str, tuple[str, int]], *, schedulers: int = 1,
          workers_per_node: int = 1, queue: dict[str, int] | None = None,
          sim_args: dict[str, tuple[str, ...]] | None = None,
          provider_extra: dict[str, dict[str, Any]] | None = None, auth: dict[str, Any] | None = None,
          runtime: dict[str, int] | None = None) -> str:
    for pid in providers:
        fstack.add_simulator(pid, *(sim_args or {}).get(pid, ()))
    fstack.configure(providers, queue=queue, provider_extra=provider_extra, auth=auth, runtime=runtime)
    for _ in range(schedulers):
        fstack.scheduler()
    for node in sorted({n for n, _ in providers.values()}):
        for _ in range(workers_per_node):
            fstack.worker(node)
    gateway = fstack.gateway()
    for pid in providers:
        fstack.wait_health(pid, "available")
    return gateway


async def until_current(fstack: FaultStack, pid: str, n: int) -> None:
    async def check() -> bool:
        return bool((await fstack.stats(pid))["current"] == n)
    await async_wait_until(check, what=f"{n} runs at {pid}")
