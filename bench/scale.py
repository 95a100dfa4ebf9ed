#!/usr/bin/env python
"""Scale-out figures: many waiting callers on one gateway, and scheduler replicas without a herd.

    python bench/scale.py [--callers 5000] [--herd-requests 3000] [--out FILE]

1. **Waiting callers.** One gateway, one scheduler, one worker and simulators with a 3 s time to
   first token and room for 500 runs at once; `--callers` streamed completions at once. Reports:
   how many completed, the Redis connections the gateway held at most (`CLIENT LIST`, its
   connections are named `iop-gateway` and `iop-gateway:…`), the gateway's RSS idle and at the
   peak and per waiting caller (the peak's growth over `--callers`; `callers_open_at_peak`: how
   many had no answer yet when the RSS first came within 1% of its peak), and the time from a
   `delta` event being written (its stream id is Redis's clock) to a caller of the runs API
   receiving it (`GET /v1/runs/{id}/events` of a sample of the runs, on
   the same gateway and the same one reader).
2. **Herd.** Concurrency 64 of zero-latency runs (8 tokens, 1 ms apart) on 2 providers: with 1
   and with 3 scheduler replicas when the providers have 128 slots (no run waits), and with 3
   replicas when they have 32 (half the callers wait in the queue, so every freed slot must wake
   a replica). Reports dispatch scripts per dispatched run (every replica's calls of `dispatch`,
   `iop_scheduler_dispatch_total` of all outcomes less the runs `dispatch_pending` handled, plus its
   calls of `dispatch_pending`, over the `ok`s).

Prints one JSON document. The client shares the machine with everything it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from iop.embedded_redis import RedisServer
from iop.proc import IopProcess

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}


class Stack:
    def __init__(self, tmp: Path, ttft_ms: int, providers: int, capacity: int, schedulers: int,
                 max_connections: int = 10_000) -> None:
        self.redis = RedisServer(appendonly=False).start()
        self.procs: list[IopProcess] = []
        sims = {}
        for i in range(providers):
            proc = self.spawn(f"sim-{i}", "simulator", "--port", "0", "--models", f"served-{i}",
                              "--ttft-ms", str(ttft_ms), "--itl-ms", "1", "--tokens", "8")
            sims[f"p{i}"] = (f"served-{i}", proc.wait_for_line(r"listening on (http://\S+)").group(1))
        config = {
            "models": [{"id": MODEL, "providers": {pid: served for pid, (served, _) in sims.items()}}],
            "nodes": [{"id": "n1", "providers": [
                {"id": pid, "type": "vllm", "base_url": url, "capacity": capacity, "models": [served]}
                for pid, (served, url) in sims.items()]}],
            "queue": {"max_queue": 100_000, "queue_timeout_ms": 600_000},
            # room for every caller at once (the default limit would turn the rest away with 503s)
            "runtime": {"max_connections": max_connections},
        }
        (tmp / "iop.yaml").write_text(yaml.safe_dump(config))
        self.env = {**os.environ, "IOP_CONFIG": str(tmp / "iop.yaml"), "REDIS_URL": self.redis.url,
                    "PYTHONUNBUFFERED": "1", "IOP_LOG_LEVEL": "WARNING"}
        self.scheduler_metrics = []
        for i in range(schedulers):
            proc = self.spawn(f"scheduler-{i}", "scheduler", "--metrics-port", "0", "--metrics-host", "127.0.0.1")
            self.scheduler_metrics.append(proc.wait_for_line(r"metrics on (http://\S+)").group(1))
        self.spawn("worker", "worker", "--node", "n1").wait_for_line(r"iop worker for node n1 running")
        gw = self.spawn("gateway", "gateway", "--host", "127.0.0.1", "--port", "0")
        self.gateway = gw.wait_for_line(r"listening on (http://\S+)").group(1)
        self.gateway_pid = gw.popen.pid
        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + 30
        while not all(client.hget(f"iop:provider:{p}", "health") == b"available" for p in sims):
            if time.monotonic() > deadline:  # polling Redis with a deadline
                raise SystemExit("providers never became available")
            time.sleep(0.05)
        client.close()

    def spawn(self, name: str, *args: str) -> IopProcess:
        proc = IopProcess(name, list(args), getattr(self, "env", dict(os.environ)), cwd=ROOT, keep_lines=200)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.redis.cleanup()


def rss_kb(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def gateway_connections(url: str) -> int:
    """The gateway's connections: its pool's (`iop-gateway`) and its lines' (`iop-gateway:inbox`,
    `iop-gateway:scripts`, `common.redisline`)."""
    with redis.Redis.from_url(url) as r:
        return sum(1 for c in r.client_list() if c.get("name", "").startswith("iop-gateway"))


async def waiting_callers(stack: Stack, callers: int, observers: int, ramp_s: float = 0.0) -> dict[str, Any]:
    """`ramp_s`: the callers arrive evenly over that many seconds (0: all at once)."""
    idle_rss = rss_kb(stack.gateway_pid)
    connector = aiohttp.TCPConnector(limit=0)
    lags_ms: list[float] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:

        outcomes: Counter[str] = Counter()
        samples: dict[str, str] = {}  # the start of one answer of each kind that was not a whole stream

        async def stream(i: int) -> str | None:
            if ramp_s:
                await asyncio.sleep(ramp_s * i / callers)
            try:
                async with session.post(stack.gateway + "/v1/chat/completions", json=BODY) as resp:
                    run_id = resp.headers.get("X-IOP-Run-Id")
                    body = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcomes[type(exc).__name__] += 1
                return None
            whole = body.rstrip().endswith(b"data: [DONE]")
            error = re.search(rb'"code": ?"(\w+)"', body) if resp.status != 200 or b'"error"' in body else None
            outcome = f"{resp.status} {error.group(1).decode() if error else 'ok' if whole else 'cut short'}"
            outcomes[outcome] += 1
            if outcome not in samples and outcome != "200 ok":
                samples[outcome] = body[:300].decode(errors="replace")
            return run_id if resp.status == 200 and whole and not error else None

        async def observe(run_id: str) -> None:
            """Follow a run through the runs API: how late each delta reaches a caller."""
            async with session.get(f"{stack.gateway}/v1/runs/{run_id}/events") as resp:
                event_ms = None
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("id: "):
                        event_ms = int(line[4:].split("-")[0])
                    elif line == "event: delta" and event_ms is not None:
                        lags_ms.append(time.time() * 1000 - event_ms)

        began = time.monotonic()
        calls = [asyncio.create_task(stream(i)) for i in range(callers)]
        peak_conns = 0
        samples_rss: list[tuple[int, int]] = []  # (RSS, callers with no answer yet)
        watched: list[asyncio.Task[None]] = []
        while not all(c.done() for c in calls):
            samples_rss.append((rss_kb(stack.gateway_pid), sum(1 for c in calls if not c.done())))
            peak_conns = max(peak_conns, await asyncio.to_thread(gateway_connections, stack.redis.url))
            if len(watched) < observers:  # observers join runs still waiting in the queue
                with redis.Redis.from_url(stack.redis.url) as r:
                    waiting = [e[1][b"run"].decode() for e in r.xrange(f"iop:runs:{MODEL}", count=observers)]
                watched += [asyncio.create_task(observe(rid)) for rid in waiting[: observers - len(watched)]]
            await asyncio.wait(calls, timeout=0.25)
        results = [c.result() for c in calls]
        await asyncio.gather(*watched, return_exceptions=True)
        elapsed = time.monotonic() - began
    peak_rss = max([idle_rss, *(rss for rss, _ in samples_rss)])
    # (the callers still waiting when the RSS first came within 1% of its peak: the figure divides by all)
    open_at_peak = next((n for rss, n in samples_rss if rss >= idle_rss + 0.99 * (peak_rss - idle_rss)), 0)
    ok = sum(1 for r in results if r)
    lags = sorted(lags_ms)
    return {
        "callers": callers, "completed": ok, "outcomes": dict(outcomes), "samples": samples,
        "elapsed_s": round(elapsed, 1),
        "gateway_redis_connections_peak": peak_conns,
        "gateway_rss_idle_mb": round(idle_rss / 1024, 1), "gateway_rss_peak_mb": round(peak_rss / 1024, 1),
        "gateway_rss_per_waiting_caller_kb": round((peak_rss - idle_rss) / callers, 1),
        "callers_open_at_peak": open_at_peak,
        "delta_to_caller_ms": {"samples": len(lags), "p50": round(statistics.median(lags), 2) if lags else None,
                               "p99": round(lags[int(0.99 * (len(lags) - 1))], 2) if lags else None},
    }


async def scheduler_counts(urls: Sequence[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url) as resp:
                text = await resp.text()
            for outcome, value in re.findall(r'^iop_scheduler_dispatch_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
                                             text, re.M):
                totals[outcome] = totals.get(outcome, 0.0) + float(value)
            for name, value in re.findall(r'^iop_scheduler_dispatch_pending_(calls|runs)_total (\S+)$', text, re.M):
                totals[f"pending_{name}"] = totals.get(f"pending_{name}", 0.0) + float(value)
    return totals


async def herd(stack: Stack, requests: int, concurrency: int) -> dict[str, Any]:
    body = {**BODY, "stream": False}
    before = await scheduler_counts(stack.scheduler_metrics)
    issued = 0
    statuses: Counter[int] = Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal issued
            while issued < requests:
                issued += 1
                async with session.post(stack.gateway + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    statuses[resp.status] += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    after = await scheduler_counts(stack.scheduler_metrics)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    pending_calls, pending_runs = delta.pop("pending_calls", 0.0), delta.pop("pending_runs", 0.0)
    ok = delta.get("ok", 0.0)
    # every `dispatch` call counts one outcome; a `dispatch_pending` call counts one for each run
    # it dispatched or found gone: the scripts sent are those calls, not its runs
    scripts = sum(delta.values()) - pending_runs + pending_calls
    return {"replicas": len(stack.scheduler_metrics), "concurrency": concurrency, "http_statuses": dict(statuses),
            "dispatched": int(ok),
            "scripts_by_outcome": {k: int(v) for k, v in delta.items()},
            "dispatch_pending": {"calls": int(pending_calls), "runs": int(pending_runs)},
            "dispatch_scripts_per_run": round(scripts / ok, 3) if ok else None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--callers", type=int, default=5000, help="streamed callers at once (0: skip)")
    p.add_argument("--observers", type=int, default=100, help="runs followed through the runs API")
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="the callers arrive evenly over this many seconds (default 0: all at once)")
    p.add_argument("--herd-requests", type=int, default=3000, help="runs per replica count (0: skip)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}}
    if args.callers:
        with tempfile.TemporaryDirectory() as tmp:
            stack = Stack(Path(tmp), ttft_ms=3000, providers=5, capacity=100, schedulers=1,
                          max_connections=args.callers + 2 * args.observers + 64)
            try:
                out["waiting_callers"] = asyncio.run(waiting_callers(stack, args.callers, args.observers, args.ramp_s))
            finally:
                stack.stop()
        print(f"bench: waiting callers: {out['waiting_callers']}", file=sys.stderr)
    if args.herd_requests:
        out["herd"] = []
        # 2 providers of 64 slots: every run finds a slot at once; of 16: half the callers wait in
        # the queue, and every freed slot must wake a replica
        for replicas, capacity in ((1, 64), (3, 64), (3, 16)):
            with tempfile.TemporaryDirectory() as tmp:
                stack = Stack(Path(tmp), ttft_ms=0, providers=2, capacity=capacity, schedulers=replicas)
                try:
                    result = asyncio.run(herd(stack, args.herd_requests, 64))
                    out["herd"].append({"slots": 2 * capacity, **result})
                finally:
                    stack.stop()
            print(f"bench: herd: {out['herd'][-1]}", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
