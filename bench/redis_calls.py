#!/usr/bin/env python
"""What one script call costs the calling process: redis-py's own path against `common.redisline`.

    python bench/redis_calls.py [--calls 20000] [--concurrency 1,8]

Starts a private Redis and calls the `watch` script (a small script every run's follower may
call) `--calls` times from as many tasks as `--concurrency` says, under uvloop as the services
run: once through redis-py's client (`Redis.evalsha`: a connection from the pool, checked, the
retry wrapper, the release) and once through the line the services use (`Scripts` over
`common.redisconn.connect`). Prints one JSON document: the caller's CPU and the wall time a call,
in microseconds, for each path and concurrency. Redis's own time is not in the CPU figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import keys  # noqa: E402
from common.redisconn import connect  # noqa: E402
from common.scripts import SHAS, Scripts  # noqa: E402
from iop.embedded_redis import RedisServer  # noqa: E402


async def timed(call: object, calls: int, concurrency: int) -> dict[str, float]:
    async def task(n: int) -> None:
        for _ in range(n):
            await call()  # type: ignore[operator]

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(task(calls // concurrency) for _ in range(concurrency)))
    done = calls // concurrency * concurrency
    return {"cpu_us_per_call": round(1e6 * (time.process_time() - cpu) / done, 1),
            "wall_us_per_call": round(1e6 * (time.perf_counter() - wall) / done, 1)}


async def measure(url: str, calls: int, concurrencies: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    redis = connect(url)
    scripts = Scripts(redis)
    await scripts.load()
    record = keys.run_record("bench")
    await redis.hset(record, "state", "queued")
    sha = SHAS["watch"]
    paths = {
        "redis-py": lambda: redis.evalsha(sha, 1, record, "gateway-1"),
        "line": lambda: scripts.call("watch", [record], ["gateway-1"]),
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for name, call in paths.items():
            await timed(call, 1000, 1)  # warm-up: connections made, code paths hot
            out[name] = {f"c{c}": await timed(call, calls, c) for c in concurrencies}
    finally:
        await redis.aclose()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--concurrency", default="1,8")
    args = p.parse_args()
    server = RedisServer().start()
    try:
        result = uvloop.run(measure(server.url, args.calls, [int(c) for c in args.concurrency.split(",")]))
    finally:
        server.cleanup()
    print(json.dumps({"calls": args.calls, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
