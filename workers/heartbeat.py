"""Heartbeats: each worker probes its node's providers and publishes what it found.

Every worker process of a node publishes the same hashes (last writer wins), so a node
stays visible as long as any of its workers lives. A hash expires after
`heartbeat_ttl_ms`; a provider without one is `unknown` and never selected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

from redis.asyncio import Redis

from common import keys
from common.config import Config, ProviderConfig
from common.policy import Health
from common.redisconn import REDIS_DOWN, now_ms
from workers.adapters.base import Adapter, ProbeResult

log = logging.getLogger("iop.worker")


def heartbeat_fields(provider: ProviderConfig, node_id: str, probe: ProbeResult, ts_ms: int) -> dict[str, str]:
    return {
        "id": provider.id,
        "node": node_id,
        "type": provider.type,
        "category": provider.effective_category,
        "health": probe.health.value,
        "reason": probe.reason,
        "capacity": str(provider.capacity),
        "models": json.dumps(provider.models),
        "observed_models": json.dumps(probe.models) if probe.models is not None else "",
        "ts_ms": str(ts_ms),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
    }


class Heartbeats:
    def __init__(self, redis: Redis, config: Config, node_id: str, adapters: dict[str, Adapter]) -> None:
        self.redis = redis
        self.config = config
        self.node_id = node_id
        self.adapters = adapters
        self.last: dict[str, Health] = {}

    async def beat_once(self) -> None:
        node = self.config.node(self.node_id)
        assert node is not None
        probes = await asyncio.gather(*(self.adapters[p.id].probe() for p in node.providers))
        ts = now_ms()
        ttl = self.config.runtime.heartbeat_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        changed = False
        for provider, probe in zip(node.providers, probes, strict=True):
            key = keys.heartbeat(provider.id)
            pipe.hset(key, mapping=heartbeat_fields(provider, self.node_id, probe, ts))
            pipe.pexpire(key, ttl)
            if self.last.get(provider.id) is not probe.health:
                log.info("provider %s is %s %s", provider.id, probe.health.value, probe.reason)
                changed = True
            self.last[provider.id] = probe.health
        if changed:
            pipe.publish(keys.SCHEDULER_SIGNALS, "*")
        await pipe.execute()

    async def run(self) -> None:
        interval = self.config.runtime.heartbeat_interval_ms / 1000
        while True:
            try:
                await self.beat_once()
            except REDIS_DOWN as exc:
                self.last.clear()  # Redis may have lost them: publish the change again
                log.warning("heartbeat: Redis unavailable (%s)", exc)
            await asyncio.sleep(interval)
