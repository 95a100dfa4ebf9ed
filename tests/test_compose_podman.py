"""compose.yaml and the Dockerfile, unchanged, in a real container engine: podman with
podman-compose, as a user would run them.

One stack serves the tests of this module, in order: it is built and brought up, every
container's healthcheck passes with `iop` as a non-root PID 1, the official `openai` client
is answered on the published port (stream and not), the catalog shows every provider
available, a worker service scaled to three containers shares the runs, a worker container
killed mid-run still has its caller answered, every worker given SIGTERM finishes its runs,
Redis restarted on its AOF volume still serves the runs queued before (once iop's processes
reach it again: podman's DNS may take tens of seconds), every container stops
cleanly on SIGTERM, and `down -v` leaves nothing behind.

.ci/podman-setup prepares the machine (engine, stand-in base images); without it this module
skips, unless IOP_REQUIRE_PODMAN=1 (CI sets it): then it fails. Timings and the image size
land in test-artifacts/compose-podman.json, each container's log in
test-artifacts/compose-podman-logs/.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from common import keys
from common.auth import new_key
from common.config import load_config
from scheduler.core import GATEWAY_GONE, OUTAGE_GRACE
from tests.conftest import ROOT, wait_until
from tests.podman_project import PODMAN, PODMAN_COMPOSE, PodmanProject, pip_build_args

# The first test also builds the image and brings the stack up (a few minutes when nothing is cached).
pytestmark = [pytest.mark.e2e, pytest.mark.podman, pytest.mark.timeout(900)]

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OPERATOR_KEY, CALLER_KEY = new_key(), new_key()
POOL = load_config(ROOT / "examples" / "compose-pool.yaml")
MODELS = [m.id for m in POOL.models]
IOP_SERVICES = {name for name, svc in SERVICES.items() if svc["command"][0] == "iop"}
#: Every image compose.yaml and the Dockerfile start from.
BASE_IMAGES = sorted({svc["image"] for svc in SERVICES.values() if "build" not in svc}
                     | set(re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), flags=re.M)))
ARTIFACTS = ROOT / "test-artifacts"
TOKENS = "tok0 tok1 tok2"  # the simulators' answer to max_tokens=3


def _unavailable() -> str | None:
    if PODMAN is None:
        return "podman is not installed (.ci/podman-setup installs and configures it, as root)"
    if PODMAN_COMPOSE is None:
        return "podman-compose is not installed (pip install -e '.[test]')"
    for image in BASE_IMAGES:
        if subprocess.run([PODMAN, "image", "exists", image], capture_output=True).returncode != 0:
            return f"the base image {image} is missing (.ci/podman-setup makes a stand-in)"
    return None


if (_reason := _unavailable()) is not None:
    # .ci/run runs .ci/podman-setup and sets IOP_REQUIRE_PODMAN=1, so CI never skips this silently.
    if os.environ.get("IOP_REQUIRE_PODMAN") == "1":
        pytest.fail(f"IOP_REQUIRE_PODMAN=1 but {_reason}", pytrace=False)
    pytest.skip(_reason, allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def seconds(value: str) -> float:
    """A compose duration such as `15s` or `1m30s`."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", value))


class Stack:
    """The running project, and what the tests measured about it."""

    def __init__(self, project: PodmanProject, port: int) -> None:
        self.project = project
        self.url = f"http://127.0.0.1:{port}"
        self.figures: dict[str, Any] = {}

    def names(self, service: str | None = None) -> list[str]:
        return [c.name for c in self.project.containers(service)]

    def redis_cli(self, *args: str) -> str:
        return self.project.exec(self.names("redis")[0], "redis-cli", "--raw", *args).strip()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=CALLER_KEY, max_retries=0)

    def record(self, **figures: Any) -> None:
        self.figures.update(figures)
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "compose-podman.json").write_text(json.dumps(self.figures, indent=2) + "\n")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    port = free_port()
    # the keys compose.yaml asks for, as a user's .env would give them
    env = dict(os.environ, IOP_GATEWAY_PORT=str(port), IOP_OPERATOR_KEY=OPERATOR_KEY, IOP_CALLER_KEY=CALLER_KEY)
    project = PodmanProject(f"ioptest{os.getpid()}", env)
    s = Stack(project, port)
    try:
        began = time.monotonic()
        # One build: every iop service runs the image iop:local, but podman-compose would
        # build it once per service that names it (eight builds at once).
        project.compose("--podman-build-args", pip_build_args(), "build", "gateway", timeout=900)
        built = time.monotonic()
        project.compose("up", "-d")
        project.wait_healthy(s.names(), timeout=180)
        healthy = time.monotonic()
        size = int(project.podman("image", "inspect", "--format", "{{.Size}}", "iop:local").strip())
        s.record(build_s=round(built - began, 1), up_to_all_healthy_s=round(healthy - built, 1),
                 image_bytes=size, containers=len(s.names()))
        yield s
    finally:
        try:
            project.compose("down", "-v", "--remove-orphans", timeout=300)
        finally:
            project.remove_everything()


@pytest.fixture(autouse=True)
def keep_logs(stack: Stack) -> Iterator[None]:
    """After each test, every container's log so far (the last test removes the containers)."""
    yield
    if stack.names():
        stack.project.save_logs(ARTIFACTS / "compose-podman-logs")


async def ask(client: openai.AsyncOpenAI, model: str, stream: bool, **extra: Any) -> tuple[str, str]:
    """(the run id, the text) of one chat completion."""
    messages: Any = [{"role": "user", "content": "hello"}]
    if stream:
        async with client.chat.completions.with_streaming_response.create(
                model=model, messages=messages, max_tokens=3, stream=True, extra_body=extra) as resp:
            chunks = [c async for c in await resp.parse()]
            assert all(c.model == model for c in chunks)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return resp.headers["X-IOP-Run-Id"], " ".join(text.split())
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=3, extra_body=extra)
    reply = raw.parse()
    assert reply.model == model
    return raw.headers["X-IOP-Run-Id"], " ".join((reply.choices[0].message.content or "").split())


async def get_json(url: str) -> Any:
    """An operator's read (the catalog, any run)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {OPERATOR_KEY}"}) as session, \
            session.get(url) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        return await resp.json()


async def in_flight_and_queued(stack: Stack) -> tuple[int, int]:
    catalog = await get_json(stack.url + "/v1/catalog")
    queued = sum(int(stack.redis_cli("XLEN", keys.runs_stream(m))) for m in MODELS)
    return sum(p["in_flight"] for p in catalog["providers"]), queued


async def until(predicate: Any, timeout: float, what: str) -> Any:
    """Poll an async predicate with a deadline (the stack runs on a busy machine)."""
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
    return value


#: the process the container's init (PID 1) started: the service's own
FIRST_CHILD = ("import os\n"
               "for p in sorted(os.listdir('/proc'), key=lambda p: int(p) if p.isdigit() else 0):\n"
               "    if p.isdigit() and open(f'/proc/{p}/stat').read().rpartition(')')[2].split()[1] == '1':\n"
               "        print(p)\n"
               "        break\n")


def test_every_service_is_up_healthy_and_runs_iop_as_non_root_under_an_init(stack: Stack) -> None:
    """An init as PID 1 (`init: true`) reaps what iop leaves (a cli tool's children piled up as
    zombies of a worker running as PID 1) and hands iop, its one child, the container's signals."""
    for service, svc in SERVICES.items():
        names = stack.names(service)
        assert len(names) == svc.get("deploy", {}).get("replicas", 1), service
        for name in names:
            assert stack.project.healthy(name), name
            if service not in IOP_SERVICES:
                continue
            pid = stack.project.exec(name, "python", "-c", FIRST_CHILD).strip()
            argv = stack.project.exec(name, "cat", f"/proc/{pid}/cmdline").split("\0")[:-1]
            assert argv[1].endswith("/iop") and argv[2:] == svc["command"][1:], (name, argv)
            status = stack.project.exec(name, "cat", f"/proc/{pid}/status")
            uid = re.search(r"^Uid:\s+(\d+)", status, flags=re.M)
            assert uid is not None and uid.group(1) != "0", name
    assert stack.project.inspect(stack.names("gateway")[0], "{{.Config.User}}") == "iop"


def test_the_openai_client_is_answered_on_the_published_port(stack: Stack) -> None:
    async def scenario() -> None:
        client = stack.client()
        results = await asyncio.gather(*(ask(client, MODELS[i % 2], stream=bool(i // 2 % 2)) for i in range(16)))
        await client.close()
        assert [text for _, text in results] == [TOKENS] * 16

    asyncio.run(scenario())


def test_the_catalog_shows_every_provider_available(stack: Stack) -> None:
    async def available() -> bool:
        catalog = await get_json(stack.url + "/v1/catalog")
        health = {p["id"]: p["health"] for p in catalog["providers"]}
        assert set(health) == {p.id for n in POOL.nodes for p in n.providers}
        return set(health.values()) == {"available"}

    asyncio.run(until(available, 30, "every provider available"))


def test_a_worker_service_scaled_to_three_shares_the_runs(stack: Stack) -> None:
    # --no-deps: the new containers do not `--requires` Redis, else `down` (which knows them
    # only as orphans) fails to remove the Redis container and its volume before them.
    stack.project.compose("up", "-d", "--no-deps", "--scale", "worker-gpu-1=3", "worker-gpu-1")
    names = stack.names("worker-gpu-1")
    assert len(names) == 3
    stack.project.wait_healthy(names, timeout=120)
    hosts = {stack.project.inspect(n, "{{.Config.Hostname}}"): n for n in names}

    async def scenario() -> set[str]:
        client = stack.client()
        served: set[str] = set()
        for _ in range(8):  # batches of concurrent runs, until each of the three ran some
            ids = [run_id for run_id, _ in await asyncio.gather(
                *(ask(client, MODELS[i % 2], stream=False) for i in range(12)))]
            for run_id in ids:
                run = await get_json(f"{stack.url}/v1/runs/{run_id}")
                if run["node"] == "gpu-1":
                    served.add(hosts[run["worker"].split(":")[0]])
            if served == set(names):
                break
        await client.close()
        return served

    assert asyncio.run(scenario()) == set(names)


def test_a_worker_container_killed_mid_run_still_answers_the_caller(stack: Stack) -> None:
    """SIGKILL from outside, as a crash or the OOM killer would: the run's lease expires,
    the run (no output sent yet) is tried again elsewhere, and the container comes back
    (`restart: unless-stopped`)."""
    hosts = {stack.project.inspect(n, "{{.Config.Hostname}}"): n
             for n in stack.names("worker-gpu-1") + stack.names("worker-gpu-2")}

    async def scenario() -> str:
        client = stack.client()
        # (the run is found running within its time to first token: each look at its slot is a `podman
        # exec`, which took seconds on a loaded machine, and a 4 s one had ended before it was found)
        call = asyncio.create_task(ask(client, MODELS[0], stream=False, sim={"ttft_ms": 10_000}))
        try:
            async def running() -> list[str]:
                return [r for p in POOL.nodes for prov in p.providers
                        for r in stack.redis_cli("ZRANGE", keys.leases(prov.id), "0", "-1").split()]

            run_id = (await until(running, 30, "the run to hold a slot"))[0]
            started = await until(lambda: _started(stack, run_id), 30, "the run to start on a worker")
            victim = hosts[started["worker"].split(":")[0]]
            os.kill(int(stack.project.inspect(victim, "{{.State.Pid}}")), signal.SIGKILL)
            answered_id, text = await call
        finally:  # (a failure above leaves no socket to the next test's garbage collection)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await client.close()
        assert (answered_id, text) == (run_id, TOKENS)
        run = await get_json(f"{stack.url}/v1/runs/{run_id}")
        assert run["state"] == "completed" and run["attempts"] == 2, run
        return victim

    victim = asyncio.run(scenario())
    wait_until(lambda: int(stack.project.inspect(victim, "{{.RestartCount}}")) >= 1, 60, f"{victim} restarted")
    stack.project.wait_healthy([victim], timeout=120)


async def _started(stack: Stack, run_id: str) -> dict[str, Any] | None:
    run: dict[str, Any] = await get_json(f"{stack.url}/v1/runs/{run_id}")
    return run if run["state"] == "running" and run["worker"] else None


def test_workers_given_sigterm_finish_their_runs_within_the_grace(stack: Stack) -> None:
    workers = stack.names("worker-gpu-1") + stack.names("worker-gpu-2")
    grace = {seconds(SERVICES[s]["stop_grace_period"]) for s in ("worker-gpu-1", "worker-gpu-2")}
    assert len(grace) == 1

    async def scenario() -> None:
        client = stack.client()
        begun = [asyncio.Event() for _ in range(4)]

        async def one(i: int) -> str:
            async with client.chat.completions.with_streaming_response.create(
                    model=MODELS[i % 2], messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                    stream=True, extra_body={"sim": {"itl_ms": 300}}) as resp:
                text = ""
                async for chunk in await resp.parse():
                    text += "".join(c.delta.content or "" for c in chunk.choices)
                    begun[i].set()
                return " ".join(text.split())

        calls = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(b.wait() for b in begun)), 30)
        # Every run has sent output (so it cannot be tried again): the workers must finish them.
        stop = await asyncio.create_subprocess_exec(
            str(PODMAN), "stop", "-t", str(int(grace.pop())), *workers,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        texts = await asyncio.gather(*calls)
        await stop.wait()
        await client.close()
        assert texts == [" ".join(f"tok{i}" for i in range(12))] * 4

    asyncio.run(scenario())
    for name in workers:
        assert stack.project.inspect(name, "{{.State.ExitCode}}") == "0", name  # 137: killed after the grace
    assert any("stopping: waiting up to" in stack.project.logs(n) for n in workers)
    stack.project.podman("start", *workers)
    stack.project.wait_healthy(workers, timeout=120)


def test_redis_restarted_on_its_aof_volume_still_serves_the_queued_runs(stack: Stack) -> None:
    """`compose restart redis` with runs running and runs queued: every caller gets an answer,
    and the queued runs are served once iop's processes reach Redis again.

    podman gives the restarted container a new address, and its DNS (aardvark-dns 1.4, Debian's)
    may leave the name unanswered for tens of seconds after a restart (one lookup took 20 s here,
    the next 10 s), so the processes may reach Redis only that late; Docker's DNS does not do
    this. So the test measures when they are back (both scheduler replicas alive again, every
    provider's heartbeat written after the restart). Back well within the queue timeout, every
    run must be served; back later, a run may also fail with 504 `queue_timeout`, as iop says it
    does for a run that waited its queue timeout (a scheduler says it, or the gateway when none
    reached Redis in time). A gateway back later still, when a scheduler had been back for
    `OUTAGE_GRACE` times its `gateway_liveness_ms` (a CI run, when that grace was one liveness:
    one replica back at 30 s, the gateway at 45 s, every caller's run cancelled), is one iop cannot
    tell from a dead one: its callers may then also get the 503 iop documents for that
    (`GATEWAY_GONE`), and nothing else."""
    redis = stack.names("redis")[0]
    total = 10
    loaded = "DB loaded from append only file"
    loads_before = stack.project.logs(redis).count(loaded)
    queue_timeout_s = POOL.queue.queue_timeout_ms / 1000
    replicas = SERVICES["scheduler"]["deploy"]["replicas"]
    liveness_s = POOL.runtime.gateway_liveness_ms / 1000

    def iop_back(since_ms: int) -> bool:
        """Both scheduler replicas alive, every provider's heartbeat written since `since_ms`."""
        beats = [keys.heartbeat(p.id) for n in POOL.nodes for p in n.providers]
        alive, oldest = stack.redis_cli("EVAL", BACK_SCRIPT, str(len(beats)), *beats,
                                        keys.scheduler_alive("*")).split()
        return int(alive) == replicas and int(oldest) >= since_ms

    async def scenario() -> tuple[int, list[Any]]:
        client = stack.client()
        # The running runs last long enough to end after the restart: a run that ends while
        # Redis is away keeps trying to record its end for as long as its lease (15 s) lives.
        sent = time.monotonic()
        answered_s: list[float] = []

        async def timed(i: int) -> Any:
            try:
                return await ask(client, MODELS[i % 2], stream=False, sim={"ttft_ms": 12_000})
            finally:
                answered_s.append(round(time.monotonic() - sent, 1))

        calls = [asyncio.create_task(timed(i)) for i in range(total)]
        lapsed_s: list[float] = []  # when the gateway's key was missing, a scheduler long back

        async def watch_the_gateway() -> None:
            """Sample whether the gateway's liveness key is there while a scheduler is back, as a
            scheduler judges it: its callers' runs are cancelled only when it is missing after the
            scheduler has reached Redis for `OUTAGE_GRACE` times `gateway_liveness_ms` without a
            gap (a second less here, for the sampling)."""
            back_since: float | None = None
            while True:
                try:
                    alive, gateways = map(int, (await asyncio.to_thread(
                        stack.redis_cli, "EVAL", WATCH_SCRIPT, "0", keys.scheduler_alive("*"),
                        keys.gateway_alive("*"))).split())
                except (AssertionError, ValueError):  # (Redis restarting)
                    alive, gateways = 0, 1
                now = time.monotonic() - sent
                back_since = (back_since if back_since is not None else now) if alive else None
                if not gateways and back_since is not None and now - back_since >= OUTAGE_GRACE * liveness_s - 1:
                    lapsed_s.append(round(now, 1))
                await asyncio.sleep(0.2)

        async def settled() -> int:  # every slot busy, the rest queued
            running, queued = await in_flight_and_queued(stack)
            return queued if queued and running + queued == total else 0

        queued = await until(settled, 30, "runs holding every slot and runs queued behind them")
        began = time.monotonic()
        watching = asyncio.create_task(watch_the_gateway())
        stack.project.compose("restart", "redis")
        restarted_ms = int(time.time() * 1000)
        stack.record(redis_restart_began_s=round(began - sent, 1), redis_restart_s=round(time.monotonic() - began, 1))
        await until(lambda: asyncio.to_thread(iop_back, restarted_ms), 120, "iop's processes to reach Redis again")
        stack.record(iop_back_s=round(time.monotonic() - sent, 1))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        watching.cancel()
        await client.close()
        stack.record(redis_restart_answered_s=sorted(answered_s), gateway_lapsed_s=lapsed_s[:1] + lapsed_s[-1:])
        return int(queued), answers

    queued, answers = asyncio.run(scenario())
    texts = [a if isinstance(a, BaseException) else a[1] for a in answers]
    failed = [a for a in answers if isinstance(a, openai.APIStatusError)]
    # a queue timeout said by a scheduler ("had a free slot within") or, when no scheduler reached
    # Redis in time (a run here: back at 52 s), by the gateway ("no scheduler took the run")
    timed_out = [a for a in failed if a.status_code == 504 and a.code == "queue_timeout"]
    gateway_gone = [a for a in failed if a.status_code == 503 and GATEWAY_GONE in a.message]
    stack.record(redis_restart_timed_out=len(timed_out), redis_restart_gateway_gone=len(gateway_gone),
                 redis_restart_failed=sorted(f"{a.status_code} {a.code}" for a in failed))
    served = texts.count(TOKENS)
    if stack.figures["iop_back_s"] > queue_timeout_s - 10:  # back too late for some queued runs
        served += len(timed_out)
    if stack.figures["gateway_lapsed_s"]:  # the gateway back later than the grace after a scheduler
        served += len(gateway_gone)
    assert served == total, (json.dumps(stack.figures), texts)  # (the figures as text: pytest cuts a dict short)
    assert queued >= 1
    assert stack.project.logs(redis).count(loaded) == loads_before + 1  # the restart read the AOF
    assert int(stack.project.inspect(redis, "{{.RestartCount}}")) == 0  # restarted by us, not by a crash
    stack.record(queued_across_redis_restart=queued)


#: (the number of live scheduler replicas, the oldest of the heartbeats' `ts_ms`) in one call.
#: KEYS: the providers' heartbeats   ARGV: the pattern of the replicas' liveness keys
BACK_SCRIPT = """
local oldest
for _, key in ipairs(KEYS) do
  local ts = tonumber(redis.call('HGET', key, 'ts_ms') or '-1')
  if oldest == nil or ts < oldest then oldest = ts end
end
return {#redis.call('KEYS', ARGV[1]), oldest}
"""


#: (the number of live scheduler replicas, the number of live gateways) in one call.
#: ARGV: the patterns of the replicas' and the gateways' liveness keys
WATCH_SCRIPT = "return {#redis.call('KEYS', ARGV[1]), #redis.call('KEYS', ARGV[2])}"


def test_every_container_stops_cleanly_and_down_leaves_nothing_behind(stack: Stack) -> None:
    names = stack.names()
    stack.project.podman("stop", "-t", "15", *names, timeout=120)
    codes = {c.name: c.exit_code for c in stack.project.containers()}
    assert codes == dict.fromkeys(names, 0)  # 137 would be SIGKILL after the timeout
    # The replicas made by --scale are known to podman-compose only through --remove-orphans.
    stack.project.compose("down", "-v", "--remove-orphans", timeout=300)
    assert stack.project.leftovers() == {"containers": [], "pods": [], "volumes": [], "networks": []}
