#!/usr/bin/env python
"""Every Redis command the scripts run for a non-stream run, script by script (MONITOR).

    python bench/script_calls.py [--requests 50] [--warmup 20] [--list] [--timed 0]

Starts `bench.py`'s stack (a private Redis, two simulators, a gateway, a scheduler, a worker a
node), sends `--warmup` non-stream requests one at a time, then `--requests` more under Redis
MONITOR, one at a time (concurrency 1), and prints one JSON document: for each script a run calls,
its calls a run and the commands run inside it a run (`redis.call` and `redis.pcall`), by command.
Scripts no run calls (heartbeats, probes, the history) are counted apart, not per run. `--list`
also prints each script's inner commands of the last traced run, in order, to stderr. `--timed N`:
then N more, one at a time, without MONITOR, and Redis's time in the scripts a run (`INFO
commandstats`: EVALSHA's usec over that phase, a heartbeat's scripts included) and a script call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import MODEL, Stack, chat_target  # noqa: E402  (bench/bench.py: this directory is on the path)
from common.scripts import SHAS  # noqa: E402

#: the scripts that run for a run (the others, heartbeats and probes, are background work)
RUN_SCRIPTS = ("enqueue", "dispatch", "dispatch_pending", "start", "take", "take_woken", "renew", "emit",
               "finish", "drop_queued", "watch", "blame", "reap")


def trace(url: str, events: list[tuple[bool, str]], ready: threading.Event) -> None:
    """(run by a script, the command as MONITOR shows it) of every command, until the end marker."""
    client = redis.Redis.from_url(url)
    with client.monitor() as m:
        ready.set()
        for cmd in m.listen():
            events.append((cmd.get("client_type") == "lua", cmd["command"]))
            if "iop-script-calls-end" in cmd["command"]:
                return


async def send(gateway: str, n: int) -> list[str]:
    target = chat_target(gateway, MODEL, 16, stream=False)
    ids = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            async with session.post(target.url, data=target.body, headers=dict(target.headers)) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")
                ids.append(r.headers.get("X-IOP-Run-Id", ""))
    return ids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--list", action="store_true")
    p.add_argument("--timed", type=int, default=0)
    args = p.parse_args()
    names = {sha: name for name, sha in SHAS.items()}
    stack = Stack(log_level="WARNING")
    events: list[tuple[bool, str]] = []
    timed: dict[str, Any] = {}
    try:
        stack.start(tokens=16)
        assert stack.redis is not None
        asyncio.run(send(stack.gateway, args.warmup))
        ready = threading.Event()
        t = threading.Thread(target=trace, args=(stack.redis.url, events, ready), daemon=True)
        t.start()
        ready.wait(10)
        asyncio.run(send(stack.gateway, args.requests))
        redis.Redis.from_url(stack.redis.url).echo("iop-script-calls-end")
        t.join(10)
        if args.timed:
            client = redis.Redis.from_url(stack.redis.url)
            client.config_resetstat()
            asyncio.run(send(stack.gateway, args.timed))
            ev = client.info("commandstats").get("cmdstat_evalsha", {})
            client.close()
            timed = {"runs": args.timed, "script_us_per_run": round(ev.get("usec", 0) / args.timed, 1),
                     "script_calls_per_run": round(ev.get("calls", 0) / args.timed, 2),
                     "us_per_script_call": ev.get("usec_per_call")}
    finally:
        stack.stop()
    calls: Counter[str] = Counter()
    inner: dict[str, Counter[str]] = defaultdict(Counter)
    current: str | None = None
    listing: list[tuple[str, str]] = []  # (script, command) from the last run's enqueue on
    for by_lua, command in events:
        if not by_lua:
            current = None
            parts = command.split(" ")
            if parts[0].upper() == "EVALSHA" and len(parts) > 1:
                current = names.get(parts[1], parts[1][:8])
                calls[current] += 1
                if current == "enqueue":
                    listing = []
            continue
        if current is None:
            continue
        inner[current][command.split(" ", 1)[0].upper()] += 1
        if current in RUN_SCRIPTS:
            listing.append((current, command[:150]))
    n = args.requests
    per_run = {name: {"calls": round(calls[name] / n, 2), "inner": round(sum(inner[name].values()) / n, 2),
                      "by_command": {c: round(k / n, 2) for c, k in inner[name].most_common()}}
               for name in calls if name in RUN_SCRIPTS}
    background = {name: {"calls": calls[name], "inner": sum(inner[name].values())}
                  for name in calls if name not in RUN_SCRIPTS}
    out: dict[str, Any] = {"requests": n, "inner_per_run": round(sum(v["inner"] for v in per_run.values()), 2),
                           "per_run": per_run, "background_total": background,
                           **({"timed": timed} if timed else {})}
    print(json.dumps(out, indent=1))
    if args.list:
        shown = None
        for name, command in listing:
            if name != shown:
                print(f"--- {name}", file=sys.stderr)
                shown = name
            print("   ", command, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
