#!/usr/bin/env python
"""What `runtime.stream_batch_ms` saves on streams whose tokens come paced, as a real model's do.

    python bench/stream_batch.py [--batch-ms 0,20,50] [--itl-ms 10] [--tokens 64] [--requests 300]

For each value of `stream_batch_ms`, starts the same stack as `bench.py` (a private Redis, two
simulators, a gateway, a scheduler, a worker per node) and sends `--requests` streamed chats
through the gateway at `--concurrency`, each answered with `--tokens` tokens `--itl-ms` apart.
Prints one JSON line per value: events a run's stream holds, CPU a run of every iop process and
Redis (and by process), time to first byte and to the last byte (p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (this directory's bench.py)


async def measure(stack: bench.Stack, args: argparse.Namespace) -> dict[str, object]:
    body = {"model": bench.MODEL, "messages": bench.MESSAGES, "max_tokens": args.tokens, "stream": True,
            "sim": {"tokens": args.tokens, "itl_ms": args.itl_ms}}
    target = bench.Target(stack.gateway + "/v1/chat/completions", json.dumps(body).encode(), bench.MODEL,
                          (("Content-Type", "application/json"),))
    async with aiohttp.ClientSession() as session:
        await bench.closed_loop(session, "warm-up", [target], args.concurrency, requests=args.concurrency,
                                stream=True)
        before = bench.cpu_snapshot(stack)
        phase = await bench.closed_loop(session, "paced", [target], args.concurrency, requests=args.requests,
                                        stream=True, keep_ids=True)
        after = bench.cpu_snapshot(stack)
    assert stack.redis is not None
    cpu = {name: round(1000 * (after[name] - before[name]) / args.requests, 3)  # type: ignore[operator]
           for name in before if bench.process_kind(name) is not None}
    return {"ok": phase.statuses.get(200, 0), "bad_body": phase.bad_body,
            "events_per_run": bench.events_per_run(stack.redis.url, phase.run_ids),
            "cpu_ms_per_run": round(sum(cpu.values()), 3), "cpu_ms_per_run_by_process": cpu,
            "ttfb_p50_ms": round(statistics.median(phase.ttfb_ns) / 1e6, 2),
            "total_p50_ms": round(statistics.median(phase.latencies_ns) / 1e6, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-ms", default="0,20,50", help="values of runtime.stream_batch_ms, comma-separated")
    p.add_argument("--itl-ms", type=float, default=10.0, help="time between two tokens of the simulators")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    ok = True
    for batch_ms in (int(v) for v in args.batch_ms.split(",")):
        stack = bench.Stack("INFO", runtime={"stream_batch_ms": batch_ms})
        started = time.monotonic()
        try:
            stack.start(args.tokens)
            result = asyncio.run(measure(stack, args))
        finally:
            stack.stop()
        ok = ok and result["ok"] == args.requests and not result["bad_body"]
        print(json.dumps({"stream_batch_ms": batch_ms, "itl_ms": args.itl_ms, "tokens": args.tokens,
                          "concurrency": args.concurrency, **result,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
