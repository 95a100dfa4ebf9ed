"""What the gateway measures, served at `GET /metrics` on its own port.

- `iop_gateway_requests_total{model,endpoint,status}`: every OpenAI run request by the
  HTTP status it got (499 = the caller left first). `model` is "-" when the request named
  no configured model (a 400 or 404), so unknown names cannot grow the label set.
- `iop_gateway_request_duration_seconds{model,endpoint}`: end-to-end latency of the runs
  that succeeded (2xx), from the request to the last byte.
- `iop_gateway_time_to_first_token_seconds{model}`: for streamed runs, from the request to
  the first chunk sent that carries output (text, reasoning or a tool call; the opening
  role-only chunk does not count).
- `iop_gateway_connections{slot}`: open client connections, `served` or in `triage` (beyond
  `runtime.max_connections`, see `gateway.admission`); read from the guard at scrape.
- `iop_gateway_connections_closed_total{reason}`: connections a limit closed: `refused` (503),
  `evicted` (idle, to make room), `head_timeout` (no whole request head in time).
- `iop_gateway_cancels_waiting`: cancels Redis could not take when they were made, kept until it
  answers (`gateway.take_back`); `iop_gateway_cancels_abandoned_total{reason}`: those given up,
  `deadline` (the run would have ended by then) or `full` (`MAX_KEPT` were kept already).
- `iop_usage_{runs,prompt_tokens,completion_tokens,failures}_total{key,model}`: every API key's
  usage for good, read from Redis at scrape (`common.usage`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis

from common.chunks import carries_output
from common.keys import USAGE_FIELDS
from common.metrics_http import exposition, labelled
from common.usage import Usage, read_totals
from gateway.admission import ConnectionGuard
from gateway.requests import ENDPOINTS
from gateway.take_back import TakeBack

REGISTRY = CollectorRegistry()

REQUESTS = Counter("iop_gateway_requests", "OpenAI run requests by model, endpoint and HTTP status",
                   ["model", "endpoint", "status"], registry=REGISTRY)
DURATION = Histogram("iop_gateway_request_duration_seconds", "end-to-end latency of successful runs",
                     ["model", "endpoint"], registry=REGISTRY,
                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
TTFT = Histogram("iop_gateway_time_to_first_token_seconds", "time to the first output of streamed runs",
                 ["model"], registry=REGISTRY,
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))

_requests, _duration, _ttft = labelled(REQUESTS), labelled(DURATION), labelled(TTFT)

#: The model id of a run request, set by the handler once it has found the model.
MODEL = web.RequestKey("iop_model", str)
_STARTED = web.RequestKey("iop_started", float)
_TOKEN_SEEN = web.RequestKey("iop_token_seen", bool)
#: the status of an error sent inside a stream that had already begun (its HTTP status was 200)
STREAM_ERROR = web.RequestKey("iop_stream_error", int)

def _endpoint(request: web.Request) -> str | None:
    """The run route's `endpoint` label, for a run request."""
    return ENDPOINTS.get(request.path) if request.method == "POST" else None


def begin(request: web.Request) -> str | None:
    """A request begins: the run endpoint it is for (None: not measured)."""
    endpoint = _endpoint(request)
    if endpoint is not None:
        request[_STARTED] = time.monotonic()
    return endpoint


def end(request: web.Request, endpoint: str, response: web.StreamResponse | None) -> None:
    """A measured request ended with `response` (None: the caller went away first, 499)."""
    status = 499 if response is None else request.get(STREAM_ERROR, response.status)
    model = request.get(MODEL, "-")
    _requests(model, endpoint, str(status)).inc()
    if 200 <= status < 300:
        _duration(model, endpoint).observe(time.monotonic() - request[_STARTED])


def streamed(request: web.Request, chunks: list[Any]) -> None:
    """Called with every batch of chunks a stream sends; the first that carries output is the TTFT."""
    if _TOKEN_SEEN in request or _STARTED not in request or not any(carries_output(c) for c in chunks):
        return
    request[_TOKEN_SEEN] = True
    _ttft(request.get(MODEL, "-")).observe(time.monotonic() - request[_STARTED])


class _Usage(Collector):
    """Every key's all-time usage per model, as counters read from Redis at each scrape (the same
    on every gateway: aggregate with max)."""

    def __init__(self) -> None:
        self.rows: list[Usage] = []

    def collect(self) -> Iterator[Metric]:
        families = {metric: CounterMetricFamily(f"iop_usage_{metric}", f"usage of API keys: {metric.replace('_', ' ')}",
                                                labels=["key", "model"]) for metric in USAGE_FIELDS}
        for row in self.rows:
            for metric, family in families.items():
                family.add_metric([row.key, row.model], getattr(row, metric))
        yield from families.values()


USAGE = _Usage()
REGISTRY.register(USAGE)


async def metrics(request: web.Request) -> web.Response:
    async def refresh() -> None:
        USAGE.rows = await read_totals(request.app[USAGE_SOURCE][0](), request.app[USAGE_SOURCE][1]())

    return await exposition(REGISTRY, refresh if USAGE_SOURCE in request.app else None)


class _Connections(Collector):
    """The open connections of the guard watched now, and the connections closed by every guard
    watched in this process: a gateway served again in the same process goes on from the last one's
    counts (a counter never goes back), and its metrics stay one family each."""

    def __init__(self) -> None:
        self.guard: ConnectionGuard | None = None
        self.carried: dict[str, int] = {}

    def watch(self, guard: ConnectionGuard) -> None:
        if self.guard is not None and self.guard is not guard:
            for reason, count in self.guard.closed.items():
                self.carried[reason] = self.carried.get(reason, 0) + count
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        if self.guard is None:
            return
        open_ = GaugeMetricFamily("iop_gateway_connections", "open client connections", labels=["slot"])
        open_.add_metric(["served"], self.guard.served)
        open_.add_metric(["triage"], self.guard.triaged)
        yield open_
        closed = CounterMetricFamily("iop_gateway_connections_closed", "connections a limit closed",
                                     labels=["reason"])
        for reason, count in self.guard.closed.items():
            closed.add_metric([reason], self.carried.get(reason, 0) + count)
        yield closed


CONNECTIONS = _Connections()


def watch_connections(guard: ConnectionGuard) -> None:
    """Expose the counts of the site's connection guard (the collector is registered once a process)."""
    first = CONNECTIONS.guard is None
    CONNECTIONS.watch(guard)
    if first:
        REGISTRY.register(CONNECTIONS)


class _TakeBack(Collector):
    """The gateway's kept cancels (`gateway.take_back`), read at scrape from the app set up last. The
    cancels given up count on from those of the one a scrape saw before (a gateway served again in
    the same process: a counter never goes back)."""

    def __init__(self) -> None:
        self.source: Callable[[], TakeBack | None] = lambda: None
        self.last: TakeBack | None = None
        self.carried = {"deadline": 0, "full": 0}

    def collect(self) -> Iterator[Metric]:
        take_back = self.source()
        if take_back is not None and take_back is not self.last:
            if self.last is not None:
                self.carried["deadline"] += self.last.given_up
                self.carried["full"] += self.last.refused
            self.last = take_back
        waiting = GaugeMetricFamily("iop_gateway_cancels_waiting", "cancels kept until Redis answers")
        abandoned = CounterMetricFamily("iop_gateway_cancels_abandoned", "kept cancels given up", labels=["reason"])
        if take_back is not None:
            waiting.add_metric([], len(take_back))
        if self.last is not None:
            abandoned.add_metric(["deadline"], self.carried["deadline"] + self.last.given_up)
            abandoned.add_metric(["full"], self.carried["full"] + self.last.refused)
        yield waiting
        yield abandoned


TAKE_BACK = _TakeBack()
REGISTRY.register(TAKE_BACK)


#: Where the usage counters come from: the app's Redis client, and the key names usage is kept under
#: (read at each scrape: the keys follow the config file, `gateway.keys_reload`).
USAGE_SOURCE = web.AppKey("usage_source", tuple)


def setup(app: web.Application, redis: Callable[[], Redis] | None = None,
          key_names: Callable[[], list[str]] | None = None,
          take_back: Callable[[], TakeBack | None] | None = None) -> None:
    """Serve /metrics (`gateway.middleware` measures the run requests); with `redis`, also the
    usage of the keys `key_names` gives; with `take_back`, the kept cancels."""
    app.router.add_get("/metrics", metrics)
    if take_back is not None:
        TAKE_BACK.source = take_back
    if redis is not None:
        app[USAGE_SOURCE] = (redis, key_names or list)
