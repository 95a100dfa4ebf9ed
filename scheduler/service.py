"""`iop scheduler`: one scheduler replica until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging

from common.config import Config
from common.lifecycle import ready, stop_event
from common.redisconn import connect
from scheduler import metrics
from scheduler.core import Scheduler, run_scheduler
from scheduler.history import sample_forever

log = logging.getLogger("iop.scheduler")


async def serve(config: Config, redis_url: str, metrics_port: int | None = None,
                metrics_host: str = "0.0.0.0") -> None:
    stop = stop_event()
    redis = connect(redis_url, client_name="iop-scheduler")
    sched = Scheduler(redis, config)
    ops = None if metrics_port is None else await metrics.serve_metrics(
        redis, config, sched.waiting, metrics_host, metrics_port)
    if ops is not None:
        ready(f"metrics on {ops.url}")
    sampler = asyncio.create_task(sample_forever(redis, config), name="history")
    try:
        # (its ready line once its setup is over: it came before the setup's waits for Redis)
        await run_scheduler(sched, stop, on_ready=lambda: ready(f"iop scheduler {sched.consumer} running"))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        if ops is not None:
            await ops.close()
        await redis.aclose()
    log.info("iop scheduler %s stopped", sched.consumer)
