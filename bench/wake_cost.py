#!/usr/bin/env python
"""What the end of a run costs Redis for each model its provider serves.

    python bench/wake_cost.py [--models 1,30,300,1000] [--calls 200]

The slot a run's end frees may serve any model of its provider, so `finish` (and `reap`, and a
queued run's drop) looks at the queue of each of them for its oldest waiting run (`_WAKE` in
`common/scripts.py`). This starts a private Redis and calls a script made of that same function
over `--models` runs streams with no run waiting (the common case: a provider listing hundreds of
models of which callers use a few), `--calls` times each, and prints one JSON document: Redis's
own time a call (`INFO commandstats`) and the caller's wall time a call, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import keys  # noqa: E402
from common.scripts import _WAKE  # noqa: E402
from iop.embedded_redis import RedisServer  # noqa: E402

LOOKS = _WAKE + """
for i = 1, #KEYS do wake_head(KEYS[i], ARGV[1]) end
return #KEYS
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1,30,300,1000", help="comma-separated counts of models (default 1,30,300,1000)")
    p.add_argument("--calls", type=int, default=200, help="calls of the script for each count (default 200)")
    args = p.parse_args()
    server = RedisServer().start()
    results = []
    try:
        r = redis.Redis.from_url(server.url)
        sha = r.script_load(LOOKS)
        for n in (int(x) for x in args.models.split(",")):
            streams = [keys.runs_stream(f"model-{i}") for i in range(n)]
            r.config_resetstat()
            wall = time.perf_counter()
            for _ in range(args.calls):
                r.evalsha(sha, n, *streams, keys.scheduler_channel(""))
            wall_us = (time.perf_counter() - wall) / args.calls * 1e6
            redis_us = r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
            results.append({"models": n, "redis_us_per_call": round(redis_us, 1),
                            "wall_us_per_call": round(wall_us, 1)})
        r.close()
    finally:
        server.stop()
        server.cleanup()
    json.dump({"calls": args.calls, "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
