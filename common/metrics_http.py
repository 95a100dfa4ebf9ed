"""Serving Prometheus metrics: the text exposition of a registry, and a tiny HTTP server for
processes that have no HTTP port of their own (scheduler, worker).

Gauges that mirror Redis (queue depth, provider load) are read when scraped: `refresh` is
awaited before each exposition. The server also answers `/healthz` (the process lives) and
`/readyz` (`ready()` is true: Redis answers), for container healthchecks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from redis.exceptions import RedisError

from common.api_error import ApiError, from_http_error, shown_path
from common.failover import first_line
from common.listening import cannot_listen
from common.redisconn import REDIS_DOWN
from common.wire import ErrorCode

log = logging.getLogger("iop.metrics")

# No `*_created` series: they double the exposition and no dashboard here reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

Refresh = Callable[[], Awaitable[None]]
Ready = Callable[[], Awaitable[bool]]

#: How long a scrape waits for `refresh` (Redis) before it answers with what it has.
REFRESH_TIMEOUT_S = 2.0
#: label sets `labelled` remembers, per metric
LABELLED_MAX = 4096
#: What the port serves, said by its 404s
SERVED = "GET /metrics, GET /healthz and GET /readyz"


def labelled(metric: MetricWrapperBase) -> Callable[..., Any]:
    """`metric.labels`, remembering the child it gave for each label set (at most `LABELLED_MAX`):
    the hot paths count every run, and `labels` costs about 5 µs a call (checks, a lock), a
    remembered child a fraction of one. Only for metrics none of whose label sets is removed."""
    return functools.lru_cache(maxsize=LABELLED_MAX)(metric.labels)


async def exposition(registry: CollectorRegistry, refresh: Refresh | None = None) -> web.Response:
    """The registry as Prometheus text; a Redis outage leaves the Redis-fed gauges as they were."""
    if refresh is not None:
        try:
            async with asyncio.timeout(REFRESH_TIMEOUT_S):
                await refresh()
        except (TimeoutError, *REDIS_DOWN) as exc:
            log.warning("metrics: could not read Redis (%s); answering with the last values",
                        str(exc) or f"no answer within {REFRESH_TIMEOUT_S:g} s")
        except RedisError as exc:  # (a key of iop's of another type, WRONGTYPE: an operator's or another app's)
            log.warning("metrics: Redis refused a read (%s); answering with the last values", first_line(exc))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error this port answers is OpenAI-shaped, as the gateway's are."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        unknown = f"Invalid URL ({request.method} {shown_path(request)}): this port serves {SERVED}"
        return from_http_error(request, exc, unknown).response()
    except Exception:
        log.exception("metrics: unhandled error on %s %s", request.method, request.path)
        return ApiError(ErrorCode.INTERNAL, "internal error").response()


@dataclass
class MetricsServer:
    runner: web.AppRunner
    url: str
    #: what else the server owns (a Redis connection), closed after it
    on_close: Callable[[], Awaitable[None]] | None = None

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.on_close is not None:
            await self.on_close()


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int, *,
                               refresh: Refresh | None = None, ready: Ready | None = None) -> MetricsServer:
    """Serve /metrics, /healthz and /readyz on host:port (0 = any free port)."""

    async def metrics(request: web.Request) -> web.Response:
        return await exposition(registry, refresh)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(1.0):
                ok = ready is None or await ready()
        except (TimeoutError, *REDIS_DOWN):
            ok = False
        if not ok:
            raise ApiError(ErrorCode.UNAVAILABLE, "not ready: Redis is unreachable")
        return web.json_response({"status": "ready"})

    app = web.Application(middlewares=[_openai_errors])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # a port in use, a name that does not resolve, no permission
        await runner.cleanup()
        raise cannot_listen("for metrics ", host, port, exc) from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return MetricsServer(runner, f"http://{host}:{bound}/metrics")
