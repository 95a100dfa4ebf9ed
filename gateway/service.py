"""`iop gateway`: serve the app until SIGTERM/SIGINT."""

from __future__ import annotations

import resource

from aiohttp import web

from common.config import Config
from common.lifecycle import stop_event
from gateway.app import build_app


def raise_file_limit() -> None:
    """Each waiting caller holds a socket and a Redis connection: allow as many as the system does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open
            pass


async def serve(config: Config, redis_url: str, host: str, port: int) -> None:
    raise_file_limit()
    stop = stop_event()
    runner = web.AppRunner(build_app(config, redis_url), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"iop gateway listening on http://{host}:{bound}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
