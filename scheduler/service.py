"""`iop scheduler`: one scheduler replica until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

from common.config import Config
from common.lifecycle import stop_event
from common.redisconn import connect
from scheduler.core import Scheduler, run_scheduler

log = logging.getLogger("iop.scheduler")


async def serve(config: Config, redis_url: str) -> None:
    stop = stop_event()
    redis = connect(redis_url)
    sched = Scheduler(redis, config)
    print(f"iop scheduler {sched.consumer} running", flush=True)
    try:
        await run_scheduler(sched, stop)
    finally:
        await redis.aclose()
