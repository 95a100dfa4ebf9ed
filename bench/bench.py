#!/usr/bin/env python
"""Benchmark of iop's routing overhead: the same requests straight to a zero-latency simulator
and through the gateway (gateway -> Redis -> scheduler -> worker -> simulator and back).

    python bench/bench.py [--requests N] [--concurrency 1,32] [--out FILE]

Starts everything it needs as real processes (a private Redis, two simulators, a gateway, a
scheduler and one worker per node), measures, stops everything, and prints one JSON document
to stdout. The client runs on the same machine, so every number includes its CPU competition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from common.auth import hash_key, new_key
from iop.embedded_redis import RedisServer
from iop.proc import IopProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
RUN_ID_HEADER = "X-IOP-Run-Id"
#: A chunk carrying text in an SSE answer: a non-empty `content` (the first token)
FIRST_TEXT = re.compile(rb'"content":\s*"(?:[^"\\]|\\.)')
#: (provider id, node id, served name) of the two providers, one per node.
PROVIDERS = (("prov-a", "node-a", "sim-a"), ("prov-b", "node-b", "sim-b"))
MESSAGES = [{"role": "user", "content": "Say hello."}]
REQUEST_TIMEOUT_S = 30.0
MONITOR_END = "iop-bench-monitor-end"
#: rounds of the access-cost phase (without a key, then with one), so drift hits both sides alike
ACCESS_ROUNDS = 3


# --------------------------------------------------------------------------- processes


class Proc(IopProcess):
    """A real `python -m iop ...` process of the benchmark; its last lines are kept."""

    ready_timeout_s = 30.0

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        super().__init__(name, args, env, cwd=ROOT, keep_lines=200)

    def warnings(self) -> list[str]:
        return [ln for ln in list(self.lines) if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]


@dataclass
class Stack:
    log_level: str
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="iop-bench-")))
    redis: RedisServer | None = None
    procs: list[Proc] = field(default_factory=list)
    sims: dict[str, str] = field(default_factory=dict)  # served name -> base url
    gateway: str = ""
    #: a second gateway on the same pool, with an API key that has both limits (what access costs)
    auth_gateway: str = ""
    auth_key: str = field(default_factory=new_key)
    config: dict[str, Any] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    #: the config's `runtime` section (none: the defaults)
    runtime: dict[str, Any] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.tmp / "iop.yaml"

    def env(self) -> dict[str, str]:
        assert self.redis is not None
        env = dict(os.environ)
        env.update({"IOP_CONFIG": str(self.config_path), "REDIS_URL": self.redis.url,
                    "PYTHONUNBUFFERED": "1", "IOP_LOG_LEVEL": self.log_level})
        return env

    def spawn(self, name: str, *args: str) -> Proc:
        proc = Proc(name, list(args), self.env())
        self.procs.append(proc)
        return proc

    def start(self, tokens: int) -> None:
        # Redis is started in this process group, so a Ctrl-C at the terminal would stop it under the
        # services still using it; with SIGINT blocked it inherits a mask that ignores it, and
        # `stop` ends it with SIGTERM after everything else.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.redis = RedisServer(appendonly=False).start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for _, _, served in PROVIDERS:
            sim = self.spawn(f"simulator-{served}", "simulator", "--port", "0", "--models", served,
                             "--ttft-ms", "0", "--itl-ms", "0", "--tokens", str(tokens))
            self.sims[served] = sim.wait_for_line(r"listening on (http://\S+)").group(1)
        self.config = {
            "models": [{"id": MODEL, "providers": {pid: served for pid, _, served in PROVIDERS}}],
            "nodes": [
                {"id": node, "providers": [{"id": pid, "type": "vllm", "base_url": self.sims[served],
                                            "capacity": 64, "models": [served]}]}
                for pid, node, served in PROVIDERS
            ],
            **({"runtime": self.runtime} if self.runtime else {}),
        }
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        auth = {"keys": [{"name": "bench", "sha256": hash_key(self.auth_key),
                          "limits": {"max_in_flight": 100_000, "requests_per_minute": 10_000_000}}]}
        (self.tmp / "iop-auth.yaml").write_text(yaml.safe_dump({**self.config, "auth": auth}, sort_keys=False))
        gw = self.spawn("gateway", "gateway", "--host", "127.0.0.1", "--port", "0")
        gw_auth = self.spawn("gateway-auth", "gateway", "--host", "127.0.0.1", "--port", "0",
                             "--config", str(self.tmp / "iop-auth.yaml"))
        self.spawn("scheduler", "scheduler").wait_for_line(r"iop scheduler \S+ running")
        for _, node, _ in PROVIDERS:
            self.spawn(f"worker-{node}", "worker", "--node", node).wait_for_line(
                rf"iop worker for node {re.escape(node)} running")
        self.gateway = gw.wait_for_line(r"iop gateway listening on (http://\S+)").group(1)
        self.auth_gateway = gw_auth.wait_for_line(r"iop gateway listening on (http://\S+)").group(1)
        self.wait_for_heartbeats()

    def wait_for_heartbeats(self, timeout: float = 30.0) -> None:
        """Both providers' heartbeats exist and say `available` (the gateway refuses runs otherwise)."""
        assert self.redis is not None
        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                health = [client.hget(f"iop:provider:{pid}", "health") for pid, _, _ in PROVIDERS]
                if all(h == b"available" for h in health):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"provider heartbeats not available after {timeout}s: {health}")
                time.sleep(0.02)  # polling Redis with a deadline
        finally:
            client.close()

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the gateway and services before the simulators
            try:
                self.exit_codes[proc.name] = proc.stop()
            except Exception as exc:  # keep stopping the others
                print(f"bench: could not stop {proc.name}: {exc}", file=sys.stderr)
        if self.redis is not None:
            self.redis.cleanup()
        for path in self.tmp.iterdir():
            path.unlink()
        self.tmp.rmdir()


# --------------------------------------------------------------------------- CPU accounting


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CpuSnapshot = dict[str, float | None]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (Linux /proc), in seconds."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_snapshot(stack: Stack) -> CpuSnapshot:
    pids = {p.name: p.popen.pid for p in stack.procs}
    if stack.redis is not None and stack.redis.proc is not None:
        pids["redis"] = stack.redis.proc.pid
    pids["bench-client"] = os.getpid()
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_used(before: CpuSnapshot, after: CpuSnapshot, wall_s: float) -> dict[str, Any]:
    """CPU seconds each process used between two snapshots, as a share of one core."""
    used = {name: round(b - a, 2) for name, a in before.items()
            if a is not None and (b := after.get(name)) is not None}
    return {"cpu_s": used, "cores_busy": round(sum(used.values()) / wall_s, 2) if wall_s else None}


# --------------------------------------------------------------------------- statistics


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    if len(values) == 1:
        v = values[0]
        return {"p50": v, "p90": v, "p99": v, "mean": v, "max": v}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3),
            "mean": round(statistics.fmean(values), 3), "max": round(max(values), 3)}


def ms(values_ns: Sequence[int]) -> list[float]:
    return [v / 1e6 for v in values_ns]


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Target:
    url: str
    body: bytes
    model: str  # the `model` the answer must carry
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)


def chat_target(base_url: str, model: str, max_tokens: int, stream: bool, key: str | None = None,
                sim_tokens: int | None = None) -> Target:
    """A chat request; `sim_tokens` makes the simulator answer that many tokens (its `sim` field)."""
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}
    if sim_tokens is not None:
        body["sim"] = {"tokens": sim_tokens}
    headers = (("Content-Type", "application/json"),) + ((("Authorization", f"Bearer {key}"),) if key else ())
    return Target(base_url + "/v1/chat/completions", json.dumps(body).encode(), model, headers)


@dataclass
class Phase:
    name: str
    concurrency: int
    latencies_ns: list[int] = field(default_factory=list)
    ttfb_ns: list[int] = field(default_factory=list)
    #: to the first read that completes a chunk carrying text (a non-empty `content`): the first
    #: token, as `real_model.py` measures it (a server's first bytes may be a bare `role` chunk)
    ttft_ns: list[int] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    bad_body: int = 0
    run_ids: list[str] = field(default_factory=list)
    wall: dict[str, tuple[float, float]] = field(default_factory=dict)  # run id -> (sent, received), epoch s
    elapsed_s: float = 0.0
    cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def failures(self) -> int:
        non_200 = sum(n for s, n in self.statuses.items() if s != 200)
        return non_200 + sum(self.exceptions.values()) + self.bad_body

    def summary(self) -> dict[str, Any]:
        done = sum(self.statuses.values())
        out: dict[str, Any] = {
            "concurrency": self.concurrency,
            "requests": done + sum(self.exceptions.values()),
            "ok": self.statuses.get(200, 0) - self.bad_body,
            "non_200": {str(s): n for s, n in sorted(self.statuses.items()) if s != 200},
            "exceptions": dict(self.exceptions),
            "bad_body": self.bad_body,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(done / self.elapsed_s, 1) if self.elapsed_s else None,
            "latency_ms": quantiles(ms(self.latencies_ns)),
        }
        if self.ttfb_ns:
            out["ttfb_ms"] = quantiles(ms(self.ttfb_ns))
        if self.ttft_ns:
            out["ttft_ms"] = quantiles(ms(self.ttft_ns))
        if self.cpu:
            out["cpu"] = self.cpu
        return out


async def one_request(session: aiohttp.ClientSession, target: Target, stream: bool, phase: Phase,
                      keep_ids: bool) -> None:
    sent_wall = time.time()
    t0 = time.perf_counter_ns()
    ttfb = ttft = 0
    async with session.post(target.url, data=target.body, headers=dict(target.headers)) as resp:
        if stream and resp.status == 200:
            chunks = []
            async for chunk in resp.content.iter_any():
                if not ttfb:
                    ttfb = time.perf_counter_ns() - t0
                chunks.append(chunk)
                if not ttft and FIRST_TEXT.search(b"".join(chunks)):
                    ttft = time.perf_counter_ns() - t0
            body = b"".join(chunks)
        else:
            body = await resp.read()
        elapsed = time.perf_counter_ns() - t0
        received_wall = time.time()
        run_id = resp.headers.get(RUN_ID_HEADER)
    phase.statuses[resp.status] += 1
    if resp.status != 200:
        return
    phase.latencies_ns.append(elapsed)
    if stream:
        phase.ttfb_ns.append(ttfb)
        phase.ttft_ns.append(ttft or elapsed)
        if not body.rstrip().endswith(b"data: [DONE]") or f'"model":"{target.model}"'.encode() not in body:
            phase.bad_body += 1
    else:
        try:
            answer = json.loads(body)
            good = answer.get("model") == target.model and bool(answer.get("choices"))
        except ValueError:
            good = False
        phase.bad_body += not good
    if keep_ids and run_id:
        phase.run_ids.append(run_id)
        phase.wall[run_id] = (sent_wall, received_wall)


async def closed_loop(session: aiohttp.ClientSession, name: str, targets: Sequence[Target], concurrency: int,
                      *, requests: int | None = None, duration_s: float | None = None, stream: bool = False,
                      keep_ids: bool = False) -> Phase:
    """`concurrency` clients each sending the next request as soon as their last one ended,
    for `requests` requests in all or for `duration_s` seconds. Targets are used round-robin."""
    phase = Phase(name, concurrency)
    issued = 0
    start = time.perf_counter()
    deadline = start + duration_s if duration_s is not None else None

    async def client() -> None:
        nonlocal issued
        while True:
            if requests is not None and issued >= requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            target = targets[issued % len(targets)]
            issued += 1
            try:
                await one_request(session, target, stream, phase, keep_ids)
            except (aiohttp.ClientError, TimeoutError) as exc:
                phase.exceptions[type(exc).__name__] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    phase.elapsed_s = time.perf_counter() - start
    return phase


# --------------------------------------------------------------------------- run records


def record_timings(client: redis.Redis, run_ids: Sequence[str]) -> dict[str, Any]:
    """Stage times of runs from their records (Redis TIME, whole ms) and event stream ids."""
    fields = ["created_ms", "dispatched_ms", "started_ms", "finished_ms", "provider", "state"]
    pipe = client.pipeline(transaction=False)
    for rid in run_ids:
        pipe.hmget(f"iop:run:{rid}", fields)
        pipe.xrange(f"iop:events:{rid}", "-", "+")
    replies = pipe.execute()
    stages: dict[str, list[float]] = {"schedule_ms": [], "dispatch_ms": [], "worker_pickup_ms": [],
                                      "execute_ms": [], "enqueue_to_finish_ms": []}
    events: dict[str, list[float]] = {"dispatched_to_started_ms": [], "started_to_completed_ms": []}
    providers: Counter[str] = Counter()
    states: Counter[str] = Counter()
    missing = 0
    for i in range(len(run_ids)):
        rec, evs = replies[2 * i], replies[2 * i + 1]
        if rec[0] is None or rec[1] is None or rec[2] is None:
            missing += 1
            continue
        created, dispatched, started = int(rec[0]), int(rec[1]), int(rec[2])
        finished = int(rec[3]) if rec[3] is not None else None
        providers[rec[4].decode() if rec[4] else "?"] += 1
        states[rec[5].decode() if rec[5] else "?"] += 1
        stages["schedule_ms"].append(dispatched - created)
        stages["dispatch_ms"].append(started - created)
        stages["worker_pickup_ms"].append(started - dispatched)
        if finished is not None:
            stages["execute_ms"].append(finished - started)
            stages["enqueue_to_finish_ms"].append(finished - created)
        at = {fv[b"type"].decode(): int(eid.split(b"-")[0]) for eid, fv in evs if b"type" in fv}
        if "dispatched" in at and "started" in at:
            events["dispatched_to_started_ms"].append(at["started"] - at["dispatched"])
        if "started" in at and "completed" in at:
            events["started_to_completed_ms"].append(at["completed"] - at["started"])
    out: dict[str, Any] = {"runs": len(run_ids), "records_missing": missing, "providers": dict(providers),
                           "states": dict(states)}
    for name, values in stages.items():
        out[name] = quantiles(values)
    for name in ("schedule_ms", "dispatch_ms"):
        out[name]["histogram"] = {str(k): n for k, n in sorted(Counter(stages[name]).items())[:20]}
    out["event_stream_ids"] = {name: quantiles(values) for name, values in events.items()}
    return out


def events_per_run(url: str, run_ids: Sequence[str]) -> dict[str, float | None]:
    """How many events each run's stream holds (its `started`, `delta`s and end): what the
    worker wrote and the gateway read for it."""
    client = redis.Redis.from_url(url)
    try:
        pipe = client.pipeline(transaction=False)
        for rid in run_ids:
            pipe.xlen(f"iop:events:{rid}")
        return quantiles([float(n) for n in pipe.execute()])
    finally:
        client.close()


def reset_command_stats(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.config_resetstat()
    finally:
        client.close()


def command_stats(url: str, runs: int) -> dict[str, Any]:
    """Redis commands per run (INFO commandstats since the last CONFIG RESETSTAT), busiest first.
    Redis counts a script's commands twice: on their own line, and inside EVALSHA's usec."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    per_run = {name.removeprefix("cmdstat_"): (v["calls"] / runs, v["usec"] / runs)
               for name, v in stats.items() if isinstance(v, dict) and runs}
    ranked = sorted(per_run.items(), key=lambda kv: -kv[1][0])
    return {"runs": runs, "calls_per_run_incl_script_commands": round(sum(c for c, _ in per_run.values()), 1),
            "by_command": {name: {"calls": round(c, 2), "usec": round(u, 1)} for name, (c, u) in ranked[:12]},
            "usec_per_call": {name: round(u / c, 2) for name, (c, u) in per_run.items() if c}}


def unlogged_exec_us(slowlog: dict[str, Any], stats: dict[str, Any]) -> float | None:
    """Redis time per run without SLOWLOG's own cost: at a 0 us threshold Redis logs every
    command run inside a script too (copying its arguments), and that time is counted in the
    script's. SLOWLOG says which commands run at top level and how often a run; INFO
    commandstats of a plain phase at the same concurrency says what each costs a call (a
    script's usec includes its commands). Each top-level command a run: calls x usec a call."""
    per_call = stats.get("usec_per_call") or {}
    total = 0.0
    for label, entry in (slowlog.get("by_command") or {}).items():
        name = label.split(" ")[0].lower()
        # a command with subcommands is counted per subcommand there (`xinfo|consumers`)
        costs = [v for k, v in per_call.items() if k == name or k.startswith(name + "|")]
        if not costs:
            return None
        cost = max(costs)
        total += entry["per_run"] * cost
    return round(total + float(slowlog.get("other_commands_us_per_run") or 0), 1)


class SlowlogTrace:
    """Every command's execution time inside Redis (SLOWLOG with a 0 us threshold), blocking
    time and network I/O not included. A script's time includes the commands it runs; those are
    logged too (client `?:0`) and counted apart. The previous settings are restored on exit."""

    SETTINGS = ("slowlog-log-slower-than", "slowlog-max-len")

    def __init__(self, url: str, max_len: int) -> None:
        self.client = redis.Redis.from_url(url)
        self.max_len = max_len
        self.saved: dict[str, str] = {}
        self.entries: list[dict[str, Any]] = []
        self.script_names = {sha: name for name, sha in _script_shas().items()}

    def __enter__(self) -> SlowlogTrace:
        for name in self.SETTINGS:
            self.saved.update({k: str(v) for k, v in self.client.config_get(name).items()})
        self.client.config_set("slowlog-max-len", self.max_len)
        self.client.config_set("slowlog-log-slower-than", 0)
        self.client.slowlog_reset()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.client.config_set("slowlog-log-slower-than", -1)  # stop logging before reading
            self.entries = self.client.slowlog_get(self.max_len)
            for name, value in self.saved.items():
                self.client.config_set(name, value)
            self.client.slowlog_reset()
        finally:
            self.client.close()

    def _label(self, command: bytes | str) -> str:
        text = command.decode(errors="replace") if isinstance(command, bytes) else command
        parts = text.split(" ", 2)
        name = parts[0].upper()
        if name in ("EVALSHA", "EVALSHA_RO") and len(parts) > 1:
            return f"EVALSHA {self.script_names.get(parts[1], parts[1][:8])}"
        return name

    def summary(self, runs: int) -> dict[str, Any]:
        groups: dict[str, list[float]] = {}
        inner = 0
        for entry in self.entries:
            address = entry.get("client_address") or b""
            if (address.decode() if isinstance(address, bytes) else str(address)).startswith("?"):
                inner += 1  # run by a script: its time is already in the script's
                continue
            label = self._label(entry["command"])
            if label in ("SLOWLOG", "CONFIG"):
                continue
            groups.setdefault(label, []).append(float(entry["duration"]))
        if not runs:
            return {"runs": 0}
        ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
        total = sum(sum(v) for v in groups.values())
        top_level = sum(len(v) for v in groups.values())
        return {
            "runs": runs, "log_full": len(self.entries) >= self.max_len,
            "top_level_commands_per_run": round(top_level / runs, 1),
            "commands_inside_scripts_per_run": round(inner / runs, 1),
            "redis_exec_us_per_run": round(total / runs, 1),
            "by_command": {
                label: {"per_run": round(len(v) / runs, 2), "us_p50": quantiles(v)["p50"],
                        "us_per_run": round(sum(v) / runs, 1)}
                for label, v in ranked[:12]
            },
            "other_commands_us_per_run": round(sum(sum(v) for _, v in ranked[12:]) / runs, 1),
        }


def _script_shas() -> dict[str, str]:
    """name -> sha1 of the project's Lua scripts, to name EVALSHA calls (empty if unavailable)."""
    try:
        from common.scripts import SHAS
    except ImportError:
        return {}
    return dict(SHAS)


# --------------------------------------------------------------------------- MONITOR


class Monitor:
    """Redis MONITOR in a thread: microsecond server timestamps of the commands the scripts run
    for each run (enqueue XADD, state HSETs, its first `delta` event) and of the worker's pickup
    (HGETALL). `bench/real_model.py --trace` uses it too."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.marks: dict[str, dict[str, float]] = {}
        self.lines = 0
        self.ready = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def __enter__(self) -> Monitor:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("MONITOR did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.echo(MONITOR_END)
        self.thread.join(timeout=10)
        self.client.close()

    def _mark(self, run_id: str, what: str, t: float) -> None:
        self.marks.setdefault(run_id, {}).setdefault(what, t)

    def _run(self) -> None:
        try:
            with self.client.monitor() as mon:
                self.ready.set()
                while True:
                    cmd = mon.next_command()
                    self.lines += 1
                    text: str = cmd["command"]
                    if MONITOR_END in text:
                        return
                    t: float = cmd["time"]
                    if text.startswith("XADD iop:runs:"):
                        self._mark(text.rsplit(" ", 1)[1], "enqueued", t)
                    elif text.startswith("HSET iop:run:") and cmd["client_type"] == "lua":
                        parts = text.split(" ", 4)
                        if len(parts) >= 4 and parts[2] == "state":
                            self._mark(parts[1][len("iop:run:"):], parts[3], t)
                    elif text.startswith("HGETALL iop:run:"):
                        self._mark(text.split(" ", 1)[1][len("iop:run:"):], "picked_up", t)
                    elif text.startswith("XADD iop:events:") and " delta " in text:
                        self._mark(text.split(" ", 2)[1][len("iop:events:"):], "first_delta", t)
        except Exception as exc:  # reported in the JSON
            self.error = f"{type(exc).__name__}: {exc}"
            self.ready.set()

    def stages(self, phase: Phase) -> dict[str, Any]:
        names = [("client_to_enqueue_us", "sent", "enqueued"), ("schedule_us", "enqueued", "dispatched"),
                 ("worker_pickup_us", "dispatched", "picked_up"),
                 ("pickup_to_start_us", "picked_up", "running"), ("dispatch_us", "enqueued", "running"),
                 ("execute_us", "running", "completed"), ("finish_to_client_us", "completed", "received"),
                 ("client_total_us", "sent", "received")]
        values: dict[str, list[float]] = {n: [] for n, _, _ in names}
        complete = 0
        for rid in phase.run_ids:
            marks = dict(self.marks.get(rid, {}))
            marks["sent"], marks["received"] = phase.wall[rid]
            if not all(k in marks for k in ("enqueued", "dispatched", "picked_up", "running", "completed")):
                continue
            complete += 1
            for name, a, b in names:
                values[name].append((marks[b] - marks[a]) * 1e6)
        return {"runs": len(phase.run_ids), "runs_fully_traced": complete, "monitor_lines": self.lines,
                "error": self.error, **{n: quantiles(v) for n, v in values.items()}}


# --------------------------------------------------------------------------- the run


def code_info(root: Path = ROOT) -> dict[str, Any]:
    """Which code the run measured: the checkout its processes import (they run in `root`, which
    comes first on their path, before PYTHONPATH), its commit and whether it has changes not
    committed. (Run another checkout's code with that checkout's own `bench/bench.py`.)"""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"root": str(root), "commit": git("rev-parse", "HEAD"), "dirty": None if changes is None else bool(changes)}


def machine_info(server: RedisServer) -> dict[str, Any]:
    client = redis.Redis.from_url(server.url)
    try:
        info = client.info("server")
    finally:
        client.close()
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        uvloop_version: str | None = __import__("uvloop").__version__
    except ImportError:
        uvloop_version = None
    return {
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(), "cpu_model": cpu,
        "platform": platform.platform(), "python": sys.version.split()[0],
        "redis_version": info.get("redis_version"), "redis_server_name": info.get("server_name", "redis"),
        "redis_binary": server.binary, "aiohttp": aiohttp.__version__, "uvloop": uvloop_version,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "loadavg_note": "load averages count every process on the machine, not only this run's",
    }


async def cancel_slot_back(session: aiohttp.ClientSession, gateway: str, redis_url: str,
                           runs: int) -> dict[str, Any]:
    """Callers that leave mid-stream: time from closing the connection to the slot coming back.

    The slot is back when the worker's `finish` script has removed the lease: the time is taken
    when Redis's keyspace notification of that removal arrives (and the lease set is checked to
    be empty). The benchmark's private Redis is told to send those notifications."""
    from redis import asyncio as aioredis

    from common import keys

    client = aioredis.Redis.from_url(redis_url)
    await client.config_set("notify-keyspace-events", "Kz")
    pubsub = client.pubsub()
    await pubsub.subscribe(*(f"__keyspace@0__:{keys.leases(pid)}" for pid, _, _ in PROVIDERS))
    for _ in PROVIDERS:
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmations
    lease_keys = [keys.leases(pid) for pid, _, _ in PROVIDERS]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
            "max_tokens": 100_000, "sim": {"tokens": 100_000, "itl_ms": 20}}
    waits_ns: list[int] = []
    failures = 0
    try:
        for _ in range(runs):
            resp = await session.post(gateway + "/v1/chat/completions", json=body)
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"content":"tok' in line:
                    break
            while await pubsub.get_message(timeout=0.0):  # drop signals from before the close
                pass
            resp.close()  # the caller leaves
            left = time.perf_counter_ns()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg and msg["data"] == b"zrem" and not sum([await client.zcard(k) for k in lease_keys]):
                    waits_ns.append(time.perf_counter_ns() - left)
                    break
            else:
                failures += 1
    finally:
        await pubsub.aclose()
        await client.aclose()
    return {"runs": runs, "failures": failures, "slot_back_ms": quantiles(ms(waits_ns))}


async def measure(args: argparse.Namespace, stack: Stack, out: dict[str, Any]) -> None:
    assert stack.redis is not None
    redis_url = stack.redis.url
    served = [s for _, _, s in PROVIDERS]
    direct = [chat_target(stack.sims[s], s, args.max_tokens, False) for s in served]
    gateway = [chat_target(stack.gateway, MODEL, args.max_tokens, False)]
    gateway_stream = [chat_target(stack.gateway, MODEL, args.max_tokens, True)]
    results: dict[str, Any] = out["results"]
    measured: list[Phase] = []

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def phase(name: str, targets: Sequence[Target], c: int, **kw: Any) -> Phase:
            before = cpu_snapshot(stack)
            ph = await closed_loop(session, name, targets, c, **kw)
            ph.cpu = cpu_used(before, cpu_snapshot(stack), ph.elapsed_s)
            measured.append(ph)
            summary = ph.summary()
            print(f"bench: {name}: {summary['requests_per_s']} req/s, p50 {summary['latency_ms']['p50']} ms, "
                  f"failures {ph.failures}", file=sys.stderr)
            return ph

        warmup_failures = 0
        for c in sorted({1, *args.concurrency, args.saturation_concurrency}):
            for targets, stream in ((direct, False), (gateway, False), (gateway_stream, True)):
                w = await closed_loop(session, "warmup", targets, c, requests=max(args.warmup, 2 * c),
                                      stream=stream)
                warmup_failures += w.failures
        results["warmup_failures"] = warmup_failures

        for c in args.concurrency:
            n = args.requests if args.requests is not None else (2000 if c == 1 else 4000)
            d = (await phase(f"direct c={c}", direct, c, requests=n)).summary()
            reset_command_stats(redis_url)
            g_phase = await phase(f"gateway c={c}", gateway, c, requests=n, keep_ids=c == 1)
            g = g_phase.summary()
            g["redis_commands"] = command_stats(redis_url, len(g_phase.latencies_ns))
            added = {q: diff(g["latency_ms"][q], d["latency_ms"][q]) for q in ("p50", "p90", "p99")}
            ratio = (round(g["requests_per_s"] / d["requests_per_s"], 3)
                     if g["requests_per_s"] and d["requests_per_s"] else None)
            results[f"c{c}"] = {"added_latency_ms": added, "gateway_to_direct_rps_ratio": ratio,
                                "direct": d, "gateway": g}
            if c == 1:
                client = redis.Redis.from_url(redis_url)
                try:
                    results["dispatch_from_run_records"] = record_timings(client, g_phase.run_ids)
                finally:
                    client.close()

        if args.access_requests:
            results["access_c1"] = await access_cost(phase, stack, args)
        results["redis_bytes_per_run"] = await redis_bytes_per_run(session, stack)

        if args.stream_requests:
            s = (await phase("gateway stream c=1", gateway_stream, 1, requests=args.stream_requests,
                             stream=True)).summary()
            results["gateway_stream_c1"] = {"ttft_ms": s.pop("ttft_ms"), "ttfb_ms": s.pop("ttfb_ms"), **s}
            direct_stream = [chat_target(stack.sims[sv], sv, args.max_tokens, True) for sv in served]
            s = (await phase("direct stream c=1", direct_stream, 1, requests=args.stream_requests,
                             stream=True)).summary()
            results["direct_stream_c1"] = {"ttft_ms": s.pop("ttft_ms"), "ttfb_ms": s.pop("ttfb_ms"), **s}

        if args.stream64_requests:
            n64, c64 = args.stream64_requests, args.stream64_concurrency
            long_g = [chat_target(stack.gateway, MODEL, 64, True, sim_tokens=64)]
            long_d = [chat_target(stack.sims[sv], sv, 64, True, sim_tokens=64) for sv in served]
            reset_command_stats(redis_url)
            with Profiler(stack, args.profile and str(Path(args.profile) / "stream64"), None, args.profile_format):
                long_g_phase = await phase(f"gateway stream 64 tokens c={c64}", long_g, c64, requests=n64, stream=True,
                                           keep_ids=True)
            results[f"stream64_c{c64}"] = {
                "gateway": long_g_phase.summary(),
                "redis_commands": command_stats(redis_url, len(long_g_phase.latencies_ns)),
                "events_per_run": events_per_run(redis_url, long_g_phase.run_ids),
                "direct": (await phase(f"direct stream 64 tokens c={c64}", long_d, c64, requests=n64,
                                       stream=True)).summary(),
            }

        if args.cancel_runs:
            results["cancel_mid_stream"] = await cancel_slot_back(session, stack.gateway, redis_url,
                                                                  args.cancel_runs)
            print(f"bench: cancel: {results['cancel_mid_stream']}", file=sys.stderr)

        sc = args.saturation_concurrency
        secs = args.saturation_s
        with Profiler(stack, args.profile, secs, args.profile_format):
            sat_g = (await phase(f"saturation gateway c={sc}", gateway, sc, duration_s=secs)).summary()
        sat_d = (await phase(f"saturation direct c={sc}", direct, sc, duration_s=secs)).summary()
        results[f"saturation_c{sc}"] = {
            "gateway_requests_per_s": sat_g["requests_per_s"],
            "direct_requests_per_s": sat_d["requests_per_s"],
            "gateway": sat_g, "direct": sat_d,
        }

        for c in args.slowlog_concurrency if args.slowlog_requests else []:
            with SlowlogTrace(redis_url, max_len=max(10_000, 200 * args.slowlog_requests)) as trace:
                sl_phase = await phase(f"gateway c={c} under SLOWLOG", gateway, c,
                                       requests=args.slowlog_requests)
            ex = results[f"redis_exec_c{c}"] = {"commands": trace.summary(len(sl_phase.latencies_ns)),
                                                "client": sl_phase.summary()}
            plain = results.get(f"c{c}", {}).get("gateway", {}).get("redis_commands")
            if plain:
                ex["unlogged_exec_us_per_run"] = unlogged_exec_us(ex["commands"], plain)

        if args.monitor_requests:
            with Monitor(redis_url) as mon:
                m_phase = await phase("gateway c=1 under MONITOR", gateway, 1, requests=args.monitor_requests,
                                      keep_ids=True)
            results["monitor_c1"] = {"stages": mon.stages(m_phase), "client": m_phase.summary()}

    out["errors_total"] = sum(p.failures for p in measured) + results.get("cancel_mid_stream", {}).get("failures", 0)
    out["ok"] = out["errors_total"] == 0 and warmup_failures == 0
    out["headline"] = headline(results, args)


async def redis_bytes_per_run(session: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    """Redis memory (`MEMORY USAGE`) an ended run holds for `run_ttl_s`: its record and its events,
    for a non-stream run and for a 1,000-token stream."""
    assert stack.redis is not None
    client = redis.Redis.from_url(stack.redis.url)
    out: dict[str, Any] = {}
    try:
        for name, stream in (("non_stream_16_tokens", False), ("stream_1000_tokens", True)):
            tokens = 1000 if stream else 16
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "stream": stream,
                    "sim": {"tokens": tokens}}
            async with session.post(stack.gateway + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                run_id = resp.headers[RUN_ID_HEADER]
            record = client.memory_usage(f"iop:run:{run_id}", samples=0) or 0
            events = client.memory_usage(f"iop:events:{run_id}", samples=0) or 0
            out[name] = {"record_bytes": record, "events_bytes": events, "total_bytes": record + events,
                         "events": client.xlen(f"iop:events:{run_id}")}
    finally:
        client.close()
    return out


async def access_cost(phase: Callable[..., Any], stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """What an API key with both limits adds to a run at concurrency 1: the same requests through
    the gateway without `auth` and through the one with it, alternated in rounds."""
    plain = [chat_target(stack.gateway, MODEL, args.max_tokens, False)]
    keyed = [chat_target(stack.auth_gateway, MODEL, args.max_tokens, False, stack.auth_key)]
    rows: dict[str, list[Phase]] = {"without": [], "with": []}
    for _ in range(ACCESS_ROUNDS):
        rows["without"].append(await phase("gateway c=1 without auth", plain, 1, requests=args.access_requests))
        rows["with"].append(await phase("gateway c=1 with a key and limits", keyed, 1, requests=args.access_requests))
    out: dict[str, Any] = {}
    for side, phases in rows.items():
        latencies = [ns for ph in phases for ns in ph.latencies_ns]
        runs = sum(len(ph.latencies_ns) for ph in phases)
        cpu: Counter[str] = Counter()
        for ph in phases:
            cpu.update(ph.cpu["cpu_s"])
        iop_cpu = sum(v for name, v in cpu.items() if name != "bench-client" and not name.startswith("simulator"))
        out[side] = {"p50_ms": quantiles(ms(latencies))["p50"],
                     "cpu_ms_per_run_iop_and_redis": round(iop_cpu * 1000 / runs, 3) if runs else None,
                     "cpu_ms_per_run_gateway": round(cpu.get("gateway-auth" if side == "with" else "gateway", 0)
                                                     * 1000 / runs, 3) if runs else None}
    out["added"] = {"p50_ms": diff(out["with"]["p50_ms"], out["without"]["p50_ms"]),
                    "cpu_ms_per_run": diff(out["with"]["cpu_ms_per_run_iop_and_redis"],
                                           out["without"]["cpu_ms_per_run_iop_and_redis"])}
    return out


def headline(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The numbers most readers want, copied from `results`."""
    h: dict[str, Any] = {}
    for c in args.concurrency:
        r = results[f"c{c}"]
        h[f"c{c}"] = {"direct_p50_ms": r["direct"]["latency_ms"]["p50"],
                      "gateway_p50_ms": r["gateway"]["latency_ms"]["p50"],
                      "added_p50_ms": r["added_latency_ms"]["p50"],
                      "added_p99_ms": r["added_latency_ms"]["p99"],
                      "direct_rps": r["direct"]["requests_per_s"],
                      "gateway_rps": r["gateway"]["requests_per_s"]}
    if "access_c1" in results:
        h["access_added_c1"] = results["access_c1"]["added"]
    if "redis_bytes_per_run" in results:
        h["redis_bytes_per_run"] = {k: v["total_bytes"] for k, v in results["redis_bytes_per_run"].items()}
    if "gateway_stream_c1" in results:
        st = results["gateway_stream_c1"]
        direct = results.get("direct_stream_c1", {})
        h["stream_c1"] = {"ttft_p50_ms": st["ttft_ms"]["p50"], "ttft_p99_ms": st["ttft_ms"]["p99"],
                          "ttfb_p50_ms": st["ttfb_ms"]["p50"], "ttfb_p99_ms": st["ttfb_ms"]["p99"],
                          "added_ttfb_p50_ms": diff(st["ttfb_ms"]["p50"], direct.get("ttfb_ms", {}).get("p50")),
                          "full_p50_ms": st["latency_ms"]["p50"]}
    h["targets"] = targets(results, args)
    sat = results.get(f"saturation_c{args.saturation_concurrency}")
    if sat:
        h[f"saturation_c{args.saturation_concurrency}_rps"] = {"gateway": sat["gateway_requests_per_s"],
                                                               "direct": sat["direct_requests_per_s"]}
    rec = results.get("dispatch_from_run_records")
    if rec:
        h["dispatch_ms_1ms_resolution"] = {"p50": rec["dispatch_ms"]["p50"], "p99": rec["dispatch_ms"]["p99"],
                                           "mean": rec["dispatch_ms"]["mean"]}
        h["schedule_ms_1ms_resolution"] = {"p50": rec["schedule_ms"]["p50"], "p99": rec["schedule_ms"]["p99"],
                                           "mean": rec["schedule_ms"]["mean"]}
    cancel = results.get("cancel_mid_stream")
    if cancel:
        h["cancel_slot_back_ms"] = {"p50": cancel["slot_back_ms"]["p50"], "p99": cancel["slot_back_ms"]["p99"],
                                    "failures": cancel["failures"]}
    mon = results.get("monitor_c1")
    if mon:
        h["dispatch_us_monitor"] = {"p50": mon["stages"]["dispatch_us"]["p50"],
                                    "p99": mon["stages"]["dispatch_us"]["p99"]}
    for c in args.slowlog_concurrency:
        ex = results.get(f"redis_exec_c{c}")
        if ex:
            h[f"redis_exec_us_per_run_c{c}"] = ex["commands"].get("redis_exec_us_per_run")
            if "unlogged_exec_us_per_run" in ex:
                h[f"redis_exec_us_per_run_c{c}_unlogged"] = ex["unlogged_exec_us_per_run"]
    return h


IOP_PROCESSES = ("gateway", "scheduler", "worker", "redis")


def process_kind(name: str) -> str | None:
    """gateway, scheduler, worker or redis for the processes on the measured path; None for the
    client, the simulators and the second gateway (the one with keys, idle but for its phases)."""
    kind = name.split("-")[0]
    return kind if kind in IOP_PROCESSES and name != "gateway-auth" else None


def cpu_ms_per_run(summary: dict[str, Any]) -> dict[str, Any] | None:
    """CPU ms per run of a phase: every iop process and Redis together (the client and the
    simulators left out), and split by kind of process (gateway, scheduler, worker, redis).
    `over_simulators`: the total over the simulators' CPU in the same phase, a fixed amount of
    work a run: it moves less with the machine's speed than the total does (on one machine the
    same code's total moved 25% between runs, this ratio ~1-3%), so compare it across runs."""
    runs = summary.get("ok") or 0
    cpu = summary.get("cpu", {}).get("cpu_s")
    if not runs or not cpu:
        return None
    split = {kind: round(sum(v for name, v in cpu.items() if process_kind(name) == kind) * 1000 / runs, 3)
             for kind in IOP_PROCESSES}
    total = sum(split.values())
    sims = sum(v for name, v in cpu.items() if name.startswith("simulator") and v) * 1000 / runs
    return {"total": round(total, 3), **split, "over_simulators": round(total / sims, 2) if sims else None}


def targets(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the performance issue's table, each with its target."""
    sc = args.saturation_concurrency
    sat = results.get(f"saturation_c{sc}", {}).get("gateway", {})
    c1 = results.get("c1", {})
    g_ttft = results.get("gateway_stream_c1", {}).get("ttft_ms", {}).get("p50")
    d_ttft = results.get("direct_stream_c1", {}).get("ttft_ms", {}).get("p50")
    s64 = results.get(f"stream64_c{args.stream64_concurrency}", {}).get("gateway", {})
    slow = results.get("redis_exec_c1", {}).get("commands", {})
    rows = {
        "cpu_ms_per_non_stream_run": (cpu_ms_per_run(sat), 1.2, f"saturation c={sc}, all iop processes + Redis"),
        "cpu_ms_per_stream_run_64_tokens": (cpu_ms_per_run(s64), 2.0,
                                            f"64-token streams at c={args.stream64_concurrency}"),
        "added_latency_p50_ms_c1": (c1.get("added_latency_ms", {}).get("p50"), 1.5, "non-stream, gateway - direct"),
        "added_ttft_p50_ms_c1": (diff(g_ttft, d_ttft), 1.5, "stream, first chunk with text, gateway - direct"),
        "saturation_runs_per_s": (sat.get("requests_per_s"), 1500, f"non-stream, c={sc}, whole stack"),
        "redis_commands_per_non_stream_run": (slow.get("top_level_commands_per_run"), 8,
                                              "top-level commands at c=1 (SLOWLOG); pipelined ones "
                                              "count one each, so round trips are at most this"),
        "redis_exec_us_per_non_stream_run_c1": (slow.get("redis_exec_us_per_run"), 150,
                                                "SLOWLOG at c=1, which itself adds to every script's time"),
        "redis_exec_us_per_non_stream_run_c1_unlogged": (results.get("redis_exec_c1", {}).get(
            "unlogged_exec_us_per_run"), 150, "the same commands at INFO commandstats' cost a call, no logging"),
    }
    out: dict[str, Any] = {}
    for name, (value, target, how) in rows.items():
        figure = value["total"] if isinstance(value, dict) else value
        met = None if figure is None else (figure >= target if name == "saturation_runs_per_s" else figure <= target)
        out[name] = {"value": value, "target": target, "met": met, "how": how}
    return out


def compare(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Each target figure of this run next to the same figure of an earlier run's JSON."""
    def figure(doc: dict[str, Any], name: str, part: str = "total") -> float | None:
        value = doc.get("headline", {}).get("targets", {}).get(name, {}).get("value")
        return value.get(part) if isinstance(value, dict) else value

    def row(a: float | None, b: float | None) -> dict[str, Any]:
        return {"before": a, "now": b, "change": diff(b, a),
                "change_pct": round(100 * (b - a) / a, 1) if a and b is not None else None}

    out: dict[str, Any] = {}
    for name in now.get("headline", {}).get("targets", {}):
        out[name] = row(figure(before, name), figure(now, name))
        if name.startswith("cpu_ms_per_"):  # (see cpu_ms_per_run)
            out[f"{name}_over_simulators"] = row(figure(before, name, "over_simulators"),
                                                 figure(now, name, "over_simulators"))
    return out


#: py-spy from the same environment as this script when it is there, else from PATH
PY_SPY = str(next((p for p in (Path(sys.executable).parent / "py-spy",) if p.exists()), "py-spy"))


PROFILE_SUFFIX = {"flamegraph": "svg", "raw": "txt", "speedscope": "json"}


class Profiler:
    """`py-spy record` of every iop process over one phase: a flame graph (SVG) per process in
    `directory`, next to the JSON. Does nothing when `directory` is None."""

    def __init__(self, stack: Stack, directory: str | None, seconds: float | None, fmt: str = "flamegraph") -> None:
        """`seconds` None: until the phase ends (py-spy is stopped with SIGINT and writes then)."""
        self.stack, self.directory, self.seconds, self.fmt = stack, directory, seconds, fmt
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Profiler:
        if self.directory is None:
            return self
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        for proc in self.stack.procs:
            if process_kind(proc.name):
                svg = Path(self.directory) / f"{proc.name}.{PROFILE_SUFFIX[self.fmt]}"
                duration = [] if self.seconds is None else ["--duration", str(max(1, round(self.seconds)))]
                self.procs.append(subprocess.Popen(
                    [PY_SPY, "record", "--pid", str(proc.popen.pid), *duration,
                     "--rate", "250", "--nonblocking", "--format", self.fmt, "--output", str(svg)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if self.seconds is None:
                p.send_signal(signal.SIGINT)
            try:
                _, err = p.communicate(timeout=(self.seconds or 0) + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                print(f"bench: py-spy failed: {err.decode(errors='replace').strip()[-300:]}", file=sys.stderr)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=None,
                   help="requests per measured phase (default 2000 at concurrency 1, 4000 otherwise)")
    p.add_argument("--concurrency", default="1,32", help="comma-separated concurrencies (default 1,32)")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--warmup", type=int, default=50, help="warm-up requests per target and concurrency")
    p.add_argument("--stream-requests", type=int, default=1000,
                   help="streamed requests through the gateway at concurrency 1 (0: skip)")
    p.add_argument("--saturation-s", type=float, default=5.0, help="seconds of each saturation phase")
    p.add_argument("--access-requests", type=int, default=1000,
                   help=f"requests per side and round ({ACCESS_ROUNDS} rounds) of the access-cost phase (0: skip)")
    p.add_argument("--saturation-concurrency", type=int, default=64)
    p.add_argument("--stream64-requests", type=int, default=1000,
                   help="64-token streams, direct and through the gateway, for the CPU of a streamed run (0: skip)")
    p.add_argument("--stream64-concurrency", type=int, default=8)
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="an earlier run's JSON: print each target figure next to its value there")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="flame graphs (py-spy, SVG) of every iop process during the saturation phase, in DIR, "
                        "and during the 64-token streams, in DIR/stream64")
    p.add_argument("--profile-format", default="flamegraph", choices=sorted(PROFILE_SUFFIX),
                   help="py-spy's output format: flamegraph (SVG), raw (collapsed stacks, text) or speedscope")
    p.add_argument("--cancel-runs", type=int, default=100,
                   help="streams the client leaves mid-way, timing the slot's return (0 = skip)")
    p.add_argument("--monitor-requests", type=int, default=300,
                   help="requests of the extra c=1 phase traced with Redis MONITOR (0 = skip)")
    p.add_argument("--slowlog-requests", type=int, default=300,
                   help="requests of each extra gateway phase whose Redis commands SLOWLOG times (0 = skip)")
    p.add_argument("--slowlog-concurrency", default="1,32",
                   help="concurrencies of the SLOWLOG phases (default 1,32)")
    p.add_argument("--tokens", type=int, default=16, help="tokens each simulator answers")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-level", default="INFO", help="IOP_LOG_LEVEL of the iop processes (default INFO)")
    args = p.parse_args(argv)
    for name in ("concurrency", "slowlog_concurrency"):
        try:
            values = [int(c) for c in getattr(args, name).split(",") if c.strip()]
        except ValueError:
            p.error(f"--{name.replace('_', '-')} takes comma-separated integers")
        if not values or min(values) < 1:
            p.error(f"--{name.replace('_', '-')} values must be >= 1")
        setattr(args, name, values)
    return args


NOTES = [
    "latency is measured by the client (aiohttp, one ClientSession, keep-alive) on the same machine as "
    "every iop process, Redis and the simulators; they all share the CPUs, so throughput numbers are "
    "for this machine only",
    "direct = straight to the simulators (round-robin over both, each with its served name); "
    "gateway = model bench-model through gateway -> Redis -> scheduler -> worker -> simulator",
    "added_latency_ms = gateway quantile - direct quantile at the same concurrency",
    "dispatch_from_run_records: created_ms, dispatched_ms, started_ms and finished_ms are Redis TIME "
    "truncated to whole milliseconds, so each difference has 1 ms resolution (a true 0.3 ms shows as 0 "
    "or 1); the histograms show the raw distribution. dispatch_ms = started_ms - created_ms (enqueue -> "
    "worker start), schedule_ms = dispatched_ms - created_ms. event_stream_ids uses the <ms>-<seq> ids "
    "of iop:events:<run>: the same 1 ms resolution, a cross-check only",
    "redis_exec_c<N>: extra gateway phases with SLOWLOG logging every command (threshold 0 us): the time "
    "Redis spent executing each top-level command (network I/O and blocking waits excluded; a script's "
    "time includes the commands it runs, which are excluded from the totals). Logging costs: each command "
    "a script runs is logged too, inside the script's time. unlogged_exec_us_per_run: the same top-level "
    "commands a run, each at its usec a call from INFO commandstats of the plain c<N> phase (no logging)",
    "cpu: utime+stime from /proc of every process during the phase (bench-client = this script); "
    "cores_busy = sum / wall time, out of machine.nproc",
    "redis_commands (in the c<N> gateway results): INFO commandstats over that phase; commands run by "
    "scripts are counted on their own lines and again inside EVALSHA usec",
    "with capacity 64 each and equal load the policy's deterministic tie-break sends every c=1 run "
    "to prov-a (see dispatch_from_run_records.providers)",
    "headline.targets: the figures of the performance table with their targets. cpu_ms_per_*: CPU of "
    "gateway, scheduler, workers and Redis over the phase's runs (client and simulators left out), split by "
    "process kind; added_ttft = p50 time to the first token (the first read completing a chunk with a "
    "non-empty `content`, as real_model.py measures it) through the gateway - the same straight to the "
    "simulators, both streamed at c=1 (headline.stream_c1.added_ttfb_p50_ms: the same to the first body bytes, which "
    "straight from a server may be a bare `role` chunk, held by iop until the first text); "
    "redis_commands_per_non_stream_run: SLOWLOG's top-level "
    "commands (a pipelined command counts one, so round trips are at most this)",
    "stream64_c<N>: 64-token streams (the simulator's `sim.tokens`), direct and through the gateway; "
    "redis_commands: INFO commandstats over the gateway phase, a stream (evalsha: the scripts a stream calls)",
    "monitor_c1: an extra c=1 gateway phase traced with Redis MONITOR, whose timestamps have 1 us "
    "resolution (client sent/received use the same wall clock); MONITOR itself slows Redis, so those "
    "stages are upper bounds and that phase's client latency is not comparable with c1",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out: dict[str, Any] = {
        "benchmark": "iop gateway routing overhead vs direct simulator",
        "ok": False,
        "errors_total": None,
        "headline": {},
        "params": {
            "requests": args.requests, "requests_default": {"c=1": 2000, "other": 4000},
            "concurrency": args.concurrency, "warmup": args.warmup, "stream_requests": args.stream_requests,
            "saturation_s": args.saturation_s, "saturation_concurrency": args.saturation_concurrency,
            "monitor_requests": args.monitor_requests, "slowlog_requests": args.slowlog_requests,
            "slowlog_concurrency": args.slowlog_concurrency,
            "simulator": {"ttft_ms": 0, "itl_ms": 0, "tokens": args.tokens},
            "max_tokens": args.max_tokens, "messages": MESSAGES, "iop_log_level": args.log_level,
            "request_timeout_s": REQUEST_TIMEOUT_S,
        },
        "results": {},
        "notes": NOTES,
    }
    signal.signal(signal.SIGTERM, _interrupt)
    stack = Stack(args.log_level)
    code = 1
    try:
        stack.start(args.tokens)
        assert stack.redis is not None
        out["machine"] = machine_info(stack.redis)
        out["code"] = code_info()
        out["config"] = stack.config
        run_async(measure(args, stack, out))
        if args.compare:
            out["compare"] = compare(out, json.loads(Path(args.compare).read_text()))
        for name, row in out["headline"].get("targets", {}).items():
            before = out.get("compare", {}).get(name, {}).get("before")
            print(f"bench: {name}: {row['value']} (target {row['target']}, met: {row['met']})"
                  + (f", before: {before}" if args.compare else ""), file=sys.stderr)
        code = 0 if out["ok"] else 3
    except KeyboardInterrupt:
        out["interrupted"] = True
        code = 130
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        # a second Ctrl-C must not cut the cleanup short and leave processes behind
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        warnings = {p.name: p.warnings()[-10:] for p in stack.procs if p.warnings()}
        stack.stop()
        out["process_warnings"] = warnings
        out["process_exit_codes"] = stack.exit_codes
        out["failed_process_output"] = {p.name: p.output().splitlines()[-15:] for p in stack.procs
                                        if stack.exit_codes.get(p.name) not in (0, None)}
        out["duration_s"] = round(time.monotonic() - started, 1)
        if "machine" in out:
            out["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        text = json.dumps(out, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    return code


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the benchmark the way Ctrl-C does


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    """asyncio.run, with uvloop when it is installed (as the iop processes use)."""
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(coro)


if __name__ == "__main__":
    sys.exit(main())
