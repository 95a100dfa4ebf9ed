"""Heartbeats: each worker probes its node's providers and publishes what it found.

Every worker process of a node publishes the same hashes (last writer wins), so a node
stays visible as long as any of its workers lives. Each provider is probed by its own
loop, so a provider that hangs cannot delay the others' heartbeats. A hash expires after
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
        "lifecycle": json.dumps(provider.effective_lifecycle),  # coarse flags (D05), shown, never acted on
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

    async def beat_once(self, provider: ProviderConfig) -> ProbeResult:
        interval_s = self.config.runtime.heartbeat_interval_ms / 1000
        try:
            # A probe never outlives one interval, so a hung provider turns unavailable
            # within two intervals.
            async with asyncio.timeout(interval_s):
                probe = await self.adapters[provider.id].probe()
        except TimeoutError:
            probe = ProbeResult(Health.UNAVAILABLE, f"health probe got no answer within {interval_s:g}s")
        key = keys.heartbeat(provider.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=heartbeat_fields(provider, self.node_id, probe, now_ms()))
        pipe.pexpire(key, self.config.runtime.heartbeat_ttl_ms)
        if self.last.get(provider.id) is not probe.health:
            log.info("provider %s is %s %s", provider.id, probe.health.value, probe.reason)
            pipe.publish(keys.SCHEDULER_SIGNALS, "*")
        await pipe.execute()
        self.last[provider.id] = probe.health
        return probe

    async def _loop(self, provider: ProviderConfig) -> None:
        interval = self.config.runtime.heartbeat_interval_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.beat_once(provider)
            except REDIS_DOWN as exc:
                self.last.pop(provider.id, None)  # Redis may have lost it: announce it again
                log.warning("heartbeat of %s: Redis unavailable (%s)", provider.id, exc)
            except Exception:  # a bug in a probe must not silence the heartbeat for good
                self.last.pop(provider.id, None)
                log.exception("heartbeat of %s failed", provider.id)
            await asyncio.sleep(max(0.0, interval - (loop.time() - began)))

    async def run(self) -> None:
        node = self.config.node(self.node_id)
        assert node is not None
        await asyncio.gather(*(self._loop(p) for p in node.providers))
