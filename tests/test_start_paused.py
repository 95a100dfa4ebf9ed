"""A process whose Redis stops answering in the middle of its start (paused with its connections up:
SIGSTOP, a frozen VM, a host cut off), real processes on a real Redis: it waits for Redis as it does
for one that is down at the start (a WARNING, no traceback), serves once Redis answers again, and
stops cleanly on SIGTERM meanwhile.

Redis is paused the moment it runs the first command of the step under test, seen on its MONITOR:
for a worker, the `CLIENT SETNAME iop-worker` of the connection its startup hook makes (the scripts'
load and what it serves come after it, more than 20 round trips); for a gateway, that of its client (its start's look at
the database, before it listens). A worker paused there exited with status 1, "worker loop failed"
and a TimeoutError traceback from `runner.scripts.load()`, about 10 s after it started; the
scheduler and the gateway already waited. A scheduler's setup (stream groups, liveness) is only a
few round trips, answered before MONITOR's word came on a loaded machine: its connections go through
a relay instead, which holds each from its `CLIENT SETNAME iop-scheduler` on.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import aiohttp
import pytest
import redis as sync_redis

from iop.embedded_redis import RedisServer
from tests.blackhole import Blackhole
from tests.conftest import Proc, paused
from tests.faults import FaultStack, chat
from tests.test_stop_paused import past_the_grace_s

pytestmark = pytest.mark.e2e


@contextmanager
def paused_at(fstack: FaultStack, command: str) -> Iterator[threading.Event]:
    """Redis paused (SIGSTOP) as soon as its MONITOR shows `command` (the start of it), until the block
    ends; the event is set once it is paused."""
    assert fstack.server.proc is not None
    stopped = threading.Event()
    monitor_client = sync_redis.Redis.from_url(fstack.redis_url)
    monitor = monitor_client.monitor().__enter__()

    def watch() -> None:
        try:
            for event in monitor.listen():
                if event["command"].startswith(command):
                    assert fstack.server.proc is not None
                    fstack.server.proc.send_signal(signal.SIGSTOP)
                    stopped.set()
                    return
        except (sync_redis.RedisError, OSError, ValueError):  # (the block ended first: the monitor closed)
            return

    watcher = threading.Thread(target=watch, name="monitor", daemon=True)
    watcher.start()
    try:
        yield stopped
    finally:
        if stopped.is_set():
            fstack.server.proc.send_signal(signal.SIGCONT)
        monitor.connection.disconnect()
        monitor_client.close()
        watcher.join(timeout=5)
        if stopped.is_set():  # (a SIGSTOP after the SIGCONT above: the watcher saw it late)
            fstack.server.proc.send_signal(signal.SIGCONT)


def no_traceback(proc: Proc) -> None:
    said = proc.output(400)
    assert "Traceback" not in said and "loop failed" not in said, said


async def served(gateway: str) -> None:
    async with aiohttp.ClientSession() as http, http.post(gateway + "/v1/chat/completions", json=chat()) as resp:
        assert resp.status == 200, await resp.text()


def setup_pool(fstack: FaultStack) -> None:
    fstack.add_simulator("only")
    fstack.configure({"only": ("n1", 1)})


async def test_a_worker_whose_redis_stops_answering_during_its_start_waits_then_serves(fstack: FaultStack) -> None:
    setup_pool(fstack)
    fstack.scheduler()
    gateway = fstack.gateway()
    with paused_at(fstack, "CLIENT SETNAME iop-worker") as stopped:
        worker = fstack.start("worker-n1", "worker", "--node", "n1")
        await asyncio.to_thread(stopped.wait, 30)
        assert stopped.is_set(), worker.output()
        await asyncio.to_thread(worker.wait_for_line, r"WARNING .*worker: waiting for Redis for \S+ s .*did not "
                                "answer", 30)
        assert worker.popen.poll() is None, worker.output()
        assert "worker for queue" not in worker.output(400), worker.output(400)
    fstack.wait_health("only", "available")
    await served(gateway)
    no_traceback(worker)
    assert worker.popen.poll() is None, worker.output()
    said = worker.output(400)  # (it said it started, and runs, once Redis answered its start)
    waited = said.rindex("waiting for Redis for")
    assert waited < said.index("worker for queue iop:node:n1 started"), said
    assert waited < said.index("iop worker for node n1 running"), said


@pytest.mark.parametrize("where", ["first-ping", "startup-hook"])
def test_a_worker_stopped_while_it_waits_for_a_paused_redis_exits_cleanly(fstack: FaultStack, where: str) -> None:
    """Nothing runs and the worker took nothing: it exits without waiting for its grace or for Redis
    (within the margin compose gives past the grace, whatever it is). `first-ping`: Redis paused before
    the worker started (its stop waited 5.1 s for Redis to delete arq's health-check key);
    `startup-hook`: paused in its startup hook (it exited 1, with a traceback, before any SIGTERM)."""
    setup_pool(fstack)
    with ExitStack() as pause:
        if where == "first-ping":
            pause.enter_context(paused(fstack.server))
        else:
            stopped = pause.enter_context(paused_at(fstack, "CLIENT SETNAME iop-worker"))
        worker = fstack.start("worker-n1", "worker", "--node", "n1")
        if where != "first-ping":
            assert stopped.wait(30), worker.output()
        worker.wait_for_line(r"WARNING .*worker: waiting for Redis for", 30)
        said = worker.output(400)  # (its start is not over: it says neither that it runs nor that it started)
        assert "iop worker for node n1 running" not in said and "worker for queue" not in said, said
        code = worker.stop(timeout=past_the_grace_s())
        said = worker.output(400)
        assert code == 0, said
        assert "iop worker for node n1 stopped" in said, said
        assert "while stopping" not in said, said  # (no write to Redis tried on the way out)
    no_traceback(worker)
    fstack.worker("n1")  # (the node's worker, for the invariants' check)


@pytest.fixture
def relay(own_redis: RedisServer) -> Iterator[Blackhole]:
    """A relay to the test's Redis (asked for before `fstack`, it outlives the stack's processes)."""
    through = Blackhole("127.0.0.1", own_redis.port)
    yield through
    through.close()


async def test_a_scheduler_whose_redis_stops_answering_during_its_setup_waits_then_serves(
        relay: Blackhole, fstack: FaultStack) -> None:
    """Its connections go through a relay that holds what each sends from its `CLIENT SETNAME
    iop-scheduler` on: a Redis paused on MONITOR's word came too late on a loaded machine (the
    setup's few round trips were answered first, and it said it was running)."""
    setup_pool(fstack)
    relay.hold(b"iop-scheduler")
    try:
        scheduler = fstack.start("scheduler", "scheduler", "--redis", relay.url())
        await asyncio.to_thread(scheduler.wait_for_line, r"WARNING .*setup: waiting for Redis", 30)
        assert scheduler.popen.poll() is None, scheduler.output()
        assert not re.search(r"iop scheduler \S+ running", scheduler.output(400)), scheduler.output(400)
    finally:
        relay.release()
    await asyncio.to_thread(scheduler.wait_for_line, r"iop scheduler \S+ running", 30)  # (once Redis answers)
    fstack.worker("n1")
    gateway = fstack.gateway()
    fstack.wait_health("only", "available")
    await served(gateway)
    no_traceback(scheduler)
    code = scheduler.stop()
    assert code == 0 and re.search(r"iop scheduler \S+ stopped", scheduler.output()), scheduler.output()


async def test_a_gateway_whose_redis_stops_answering_during_its_start_listens_then_serves(
        fstack: FaultStack) -> None:
    """Its start's one look at Redis (does it take the URL's database?) waits at most 2 s; it listens
    whatever the answer, and serves once Redis answers."""
    setup_pool(fstack)
    fstack.scheduler()
    fstack.worker("n1")
    with paused_at(fstack, "CLIENT SETNAME iop-gateway") as stopped:
        gateway_proc = fstack.start("gateway", "gateway", "--host", "127.0.0.1", "--port", "0")
        await asyncio.to_thread(stopped.wait, 30)
        assert stopped.is_set(), gateway_proc.output()
        found = await asyncio.to_thread(gateway_proc.wait_for_line, r"listening on (http://\S+)", 30)
        gateway = found.group(1)
        assert gateway_proc.popen.poll() is None, gateway_proc.output()
    fstack.wait_health("only", "available")
    await served(gateway)
    no_traceback(gateway_proc)
