"""What a worker measures, served by `iop worker --metrics-port`.

The run counter and histogram move in `workers.runner` (one-line hooks); the provider
gauges are read from Redis when scraped, for the providers of this worker's node (every
worker of a node reports the same values: aggregate with `max by (provider)`).

- `iop_worker_runs_total{model,provider,outcome}`: attempts this worker ended: `completed`,
  `failed`, `cancelled`, `requeued` (failed before any output and tried again), or `lost` (its end
  was not recorded: its lease went, and the reaper ended or requeued its run).
- `iop_worker_run_duration_seconds{model,provider}`: how long an attempt ran on the provider.
- `iop_provider_in_flight{provider,node}`, `iop_provider_capacity{provider,node}`: live leases
  and slots (capacity is absent while the provider has no heartbeat).
- `iop_provider_health{provider,node,state}`: 1 for the provider's current health
  (`available`, `unavailable`, `unknown` = no fresh heartbeat), 0 for the others.
"""

from __future__ import annotations

from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio import Redis

from common import keys
from common.config import Config
from common.metrics_http import MetricsServer, labelled, start_metrics_server
from common.policy import Health
from common.redisconn import connect, now_ms

REGISTRY = CollectorRegistry()

RUNS = Counter("iop_worker_runs", "attempts ended by this worker, by outcome", ["model", "provider", "outcome"],
               registry=REGISTRY)
RUN_SECONDS = Histogram("iop_worker_run_duration_seconds", "how long an attempt ran on its provider",
                        ["model", "provider"], registry=REGISTRY,
                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
#: `RUNS.labels` and `RUN_SECONDS.labels`, remembered (every attempt counts in them)
runs, run_seconds = labelled(RUNS), labelled(RUN_SECONDS)
IN_FLIGHT = Gauge("iop_provider_in_flight", "runs holding a live lease on the provider", ["provider", "node"],
                  registry=REGISTRY)
CAPACITY = Gauge("iop_provider_capacity", "concurrent slots the provider announces", ["provider", "node"],
                 registry=REGISTRY)
HEALTH = Gauge("iop_provider_health", "1 for the provider's current health state", ["provider", "node", "state"],
               registry=REGISTRY)


async def refresh(redis: Redis, config: Config, node_id: str) -> None:
    """Each provider of the node: heartbeat health and capacity, and live leases, in one round trip."""
    node = config.node(node_id)
    if node is None:
        return
    now = now_ms()
    pipe = redis.pipeline(transaction=False)
    for p in node.providers:
        pipe.hmget(keys.heartbeat(p.id), "health", "capacity")
        pipe.zcount(keys.leases(p.id), f"({now}", "+inf")
    replies = await pipe.execute()
    for i, p in enumerate(node.providers):
        (health_raw, capacity_raw), in_flight = replies[2 * i], replies[2 * i + 1]
        health = health_raw.decode() if health_raw else Health.UNKNOWN.value
        IN_FLIGHT.labels(p.id, node_id).set(in_flight)
        if capacity_raw is not None:
            CAPACITY.labels(p.id, node_id).set(int(capacity_raw))
        else:
            with suppress(KeyError):  # no heartbeat: capacity unknown
                CAPACITY.remove(p.id, node_id)
        for state in Health:
            HEALTH.labels(p.id, node_id, state.value).set(1 if state.value == health else 0)



async def serve_metrics(config: Config, redis_url: str, node_id: str, host: str, port: int) -> MetricsServer:
    """/metrics, /healthz and /readyz of this worker (0 = any free port), on a Redis connection of its own."""
    redis = connect(redis_url)

    async def ready() -> bool:
        return bool(await redis.ping())

    server = await start_metrics_server(REGISTRY, host, port, refresh=lambda: refresh(redis, config, node_id),
                                        ready=ready)
    server.on_close = redis.aclose
    return server
