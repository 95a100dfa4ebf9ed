"""Stopping a fake server of the test process without leaving a socket to the garbage collector
(a ResourceWarning, which pytest makes an error, in whatever test runs then)."""

from __future__ import annotations

import asyncio

from aiohttp import web


def _abort_connections(server: web.Server) -> None:
    """Every connection's socket closed now, kept-alive ones included. `abort`, not `close`: a
    transport whose write buffer is full (a client that stopped reading an endless answer) would
    wait for it to drain before closing its socket."""
    for conn in server.connections:
        transport = conn.transport
        conn.force_close()
        if transport is not None:
            transport.abort()


async def _turns() -> None:
    """A few turns of the event loop: callbacks scheduled now, and those they schedule, run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def stop_runner(runner: web.AppRunner) -> None:
    """No new connections, every one aborted (also one accepted while the listener closed, which
    the runner's own cleanup can forget), the runner cleaned up, and the sockets closed."""
    server = runner.server
    assert server is not None
    for site in runner.sites:
        await site.stop()
    await _turns()
    _abort_connections(server)
    await runner.cleanup()
    await _turns()
    _abort_connections(server)
    await _turns()
