"""What a scheduler replica measures, served by `iop scheduler --metrics-port`.

Counters and the histogram move where the scheduler decides (one-line hooks in
`scheduler.core`); the queue gauges are read from Redis when scraped, so every replica
reports the same, exact values (aggregate them with `max by (model)`).

- `iop_scheduler_dispatch_total{model,outcome}`: calls of the `dispatch` script by result:
  `ok`, `stale` (a concurrent replica changed the load; retried), `not_head` (an older run
  goes first), `gone` (the run had left its queue).
  Those `dispatch_pending` dispatched (`ok`) or found gone (`gone`) count too, one each.
- `iop_scheduler_dispatch_pending_calls_total`, `iop_scheduler_dispatch_pending_runs_total`: calls
  of `dispatch_pending` (one with each read of the streams that has a model to look at), and the
  runs they dispatched or found gone. Dispatch scripts sent = `dispatch_total` − `pending_runs` +
  `pending_calls`.
- `iop_scheduler_dispatch_latency_seconds{model}`: from a run's entry in its queue to its dispatch.
- `iop_scheduler_dropped_total{model,state}`: runs ended while waiting: `timed_out` (waited
  `queue_timeout_ms`) or `failed` (every provider of the model was down).
- `iop_scheduler_takeover_runs_total{model}`: waiting runs claimed from dead replicas.
- `iop_scheduler_reaped_leases_total{model,outcome}`: expired leases of lost workers, by what
  became of the run (`requeued`, `failed`, or its state if it had already ended).
- `iop_queue_depth{model}`, `iop_queue_oldest_age_seconds{model}`: waiting runs and how long
  the oldest has waited (0 when none).
- `iop_scheduler_waiting_runs{model}`: waiting runs this replica holds.
- `iop_provider_effective_capacity{provider,node}`: the capacity the policy counts with (an
  operator's override, else the announced one; absent while neither is known).
- `iop_provider_control{provider,node,state}`: 1 for where operators left the provider: `active`,
  `draining` (drained or its node cordoned, runs still in flight) or `drained`; 0 for the others.
- `iop_node_cordoned{node}`: 1 while an operator cordons the node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio import Redis

from common import keys
from common.catalog import read_catalog
from common.config import Config
from common.metrics_http import MetricsServer, labelled, start_metrics_server
from common.redisconn import now_ms

REGISTRY = CollectorRegistry()

DISPATCHES = Counter("iop_scheduler_dispatch", "dispatch attempts by outcome", ["model", "outcome"],
                     registry=REGISTRY)
PENDING_CALLS = Counter("iop_scheduler_dispatch_pending_calls", "dispatch_pending calls, sent with the intake's reads",
                        registry=REGISTRY)
PENDING_RUNS = Counter("iop_scheduler_dispatch_pending_runs", "runs dispatch_pending dispatched or found gone",
                       registry=REGISTRY)
DISPATCH_LATENCY = Histogram("iop_scheduler_dispatch_latency_seconds", "time from enqueue to dispatch", ["model"],
                             registry=REGISTRY,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
#: `DISPATCHES.labels` and `DISPATCH_LATENCY.labels`, remembered (every dispatch counts in them)
dispatches, dispatch_latency = labelled(DISPATCHES), labelled(DISPATCH_LATENCY)
DROPPED = Counter("iop_scheduler_dropped", "runs ended while waiting, by their end state", ["model", "state"],
                  registry=REGISTRY)
TAKEOVERS = Counter("iop_scheduler_takeover_runs", "waiting runs claimed from dead scheduler replicas", ["model"],
                    registry=REGISTRY)
REAPS = Counter("iop_scheduler_reaped_leases", "expired leases reaped, by what became of the run",
                ["model", "outcome"], registry=REGISTRY)
QUEUE_DEPTH = Gauge("iop_queue_depth", "runs waiting for the model", ["model"], registry=REGISTRY)
QUEUE_OLDEST = Gauge("iop_queue_oldest_age_seconds", "how long the oldest waiting run has waited", ["model"],
                     registry=REGISTRY)
WAITING = Gauge("iop_scheduler_waiting_runs", "waiting runs this replica holds", ["model"], registry=REGISTRY)
EFFECTIVE_CAPACITY = Gauge("iop_provider_effective_capacity", "the capacity the policy counts with",
                           ["provider", "node"], registry=REGISTRY)
CONTROL = Gauge("iop_provider_control", "1 for the provider's control state: active, draining or drained",
                ["provider", "node", "state"], registry=REGISTRY)
CORDONED = Gauge("iop_node_cordoned", "1 while an operator cordons the node", ["node"], registry=REGISTRY)
CONTROL_STATES = ("active", "draining", "drained")


def _entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


async def refresh(redis: Redis, config: Config, waiting: Mapping[str, Sized]) -> None:
    """Read every model's queue length and oldest entry in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for model in config.models:
        pipe.xlen(keys.runs_stream(model.id))
        pipe.xrange(keys.runs_stream(model.id), "-", "+", count=1)
    replies = await pipe.execute()
    now = now_ms()
    for i, model in enumerate(config.models):
        depth, head = replies[2 * i], replies[2 * i + 1]
        QUEUE_DEPTH.labels(model.id).set(depth)
        QUEUE_OLDEST.labels(model.id).set(max(0, now - _entry_ms(head[0][0])) / 1000 if head else 0)
        WAITING.labels(model.id).set(len(waiting.get(model.id, ())))
    catalog = await read_catalog(redis, config, now, models=False)  # (its providers and nodes)
    for p in catalog.providers:
        if p.effective_capacity is not None:
            EFFECTIVE_CAPACITY.labels(p.id, p.node_id).set(p.effective_capacity)
        else:
            with suppress(KeyError):
                EFFECTIVE_CAPACITY.remove(p.id, p.node_id)
        for state in CONTROL_STATES:
            CONTROL.labels(p.id, p.node_id, state).set(1 if p.control.state == state else 0)
    for node in catalog.nodes:
        CORDONED.labels(node.id).set(0 if node.cordoned_since_ms is None else 1)


async def serve_metrics(redis: Redis, config: Config, waiting: Mapping[str, Sized], host: str,
                        port: int) -> MetricsServer:
    """/metrics, /healthz and /readyz of this replica (0 = any free port)."""

    async def ready() -> bool:
        return bool(await redis.ping())

    return await start_metrics_server(REGISTRY, host, port, refresh=lambda: refresh(redis, config, waiting),
                                      ready=ready)
