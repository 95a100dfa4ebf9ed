#!/usr/bin/env python
"""What OpenAI's Responses API costs over a chat completion: the same runs through
`POST /v1/responses` and `POST /v1/chat/completions`.

    python bench/responses.py [--tokens 64] [--requests 400] [--concurrency 8] [--rounds 2]

Starts the same stack as `bench.py` (a private Redis, two zero-latency simulators, a gateway, a
scheduler, a worker per node), then sends `--requests` runs of each kind at `--concurrency`,
streamed and not, alternating the two routes `--rounds` times. Prints one JSON line per route and
mode: CPU a run of every iop process and Redis (and of the gateway alone, where the translation
runs) and latency p50. A run whose answer is not whole (a stream without its last event) counts
as bad.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (this directory's bench.py)

#: each route: its path, its request body's own fields, and what a whole stream ends with and a
#: whole body holds
ROUTES: dict[str, tuple[str, dict[str, Any], bytes, bytes]] = {
    "chat": ("/v1/chat/completions", {"messages": bench.MESSAGES}, b"data: [DONE]", b'"finish_reason":"stop"'),
    "responses": ("/v1/responses", {"input": "Say hello."}, b'"type":"response.completed"',
                  b'"status":"completed"'),
}


async def phase(session: aiohttp.ClientSession, url: str, body: bytes, whole: bytes, stream: bool,
                requests: int, concurrency: int) -> tuple[int, list[float]]:
    """`requests` runs, `concurrency` at a time: (bad answers, latencies in ms)."""
    latencies: list[float] = []
    bad = 0
    left = requests

    async def one() -> None:
        nonlocal bad, left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                data = await resp.read()
            latencies.append((time.perf_counter() - t0) * 1000)
            ok = resp.status == 200 and whole in (data.rstrip()[-400:] if stream else data)
            bad += not ok

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return bad, latencies


async def measure(stack: bench.Stack, args: argparse.Namespace) -> list[dict[str, Any]]:
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    async with aiohttp.ClientSession() as session:
        for round_ in range(args.rounds):
            for name, (path, fields, stream_end, body_mark) in ROUTES.items():
                for stream in (False, True):
                    body = json.dumps({"model": bench.MODEL, "stream": stream, "sim": {"tokens": args.tokens},
                                       **fields}).encode()
                    url, whole = stack.gateway + path, stream_end if stream else body_mark
                    await phase(session, url, body, whole, stream, args.concurrency, args.concurrency)  # warm-up
                    before = bench.cpu_snapshot(stack)
                    bad, latencies = await phase(session, url, body, whole, stream, args.requests, args.concurrency)
                    after = bench.cpu_snapshot(stack)
                    cpu = {k: 1000 * (after[k] - before[k]) / args.requests  # type: ignore[operator]
                           for k in before if bench.process_kind(k) is not None}
                    gateway = sum(v for k, v in cpu.items() if bench.process_kind(k) == "gateway")
                    results.setdefault((name, stream), []).append({
                        "bad": bad, "cpu_ms_per_run": round(sum(cpu.values()), 3),
                        "gateway_cpu_ms_per_run": round(gateway, 3),
                        "p50_ms": round(statistics.median(latencies), 2), "round": round_})
    return [{"route": name, "stream": stream, "tokens": args.tokens, "concurrency": args.concurrency,
             "requests": args.requests, "runs": runs} for (name, stream), runs in results.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    stack = bench.Stack("WARNING")
    try:
        stack.start(args.tokens)
        rows = asyncio.run(measure(stack, args))
    finally:
        stack.stop()
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0 if all(r["bad"] == 0 for row in rows for r in row["runs"]) else 3


if __name__ == "__main__":
    sys.exit(main())
