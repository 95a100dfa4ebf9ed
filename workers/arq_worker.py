"""An arq worker that picks jobs up when woken instead of polling.

arq polls its queue every `poll_delay` (0.5 s by default, measured here at 258 ms median
added latency per run). This worker runs arq's own poll iteration, then blocks on the
node's wake list (the scheduler LPUSHes a token with every job it queues), so a job is
picked up as soon as it is queued; `poll_delay` is only a safety net. A worker whose
slots are all busy waits for one of its jobs to end instead of taking the token, so an
idle sibling process of the same node gets it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.connections import create_pool
from arq.worker import Worker

from common.redisconn import REDIS_DOWN

log = logging.getLogger("iop.worker")


class WakeWorker(Worker):
    def __init__(self, *args: Any, wake_key: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wake_key = wake_key

    async def main(self) -> None:
        if self._pool is None:
            self._pool = await create_pool(
                self.redis_settings,
                job_deserializer=self.job_deserializer,
                job_serializer=self.job_serializer,
                default_queue_name=self.queue_name,
                expires_extra_ms=self.expires_extra_ms,
            )
        log.info("worker for queue %s started, %d slots", self.queue_name, self.max_jobs)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        delay = 0.05
        while True:
            try:
                await self._poll_iteration()
                await self._wait_for_work()
                delay = 0.05
            except REDIS_DOWN as exc:
                log.warning("worker: Redis unavailable (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _wait_for_work(self) -> None:
        if self.job_counter >= self.max_jobs:
            running = [t for t in self.tasks.values() if not t.done()]
            if running:
                await asyncio.wait(running, timeout=self.poll_delay_s, return_when=asyncio.FIRST_COMPLETED)
            return
        await self.pool.blpop([self.wake_key], timeout=self.poll_delay_s)
