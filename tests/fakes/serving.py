"""Stopping a fake server of the test process without leaving a socket to the garbage collector
(a ResourceWarning, which pytest makes an error, in whatever test runs then)."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

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


class ThreadedServer:
    """A fake server on its own event loop in a thread, on 127.0.0.1 and a free port (`url` once
    entered): a subclass says what it serves (`app`)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        raise NotImplementedError

    async def _start(self) -> str:
        self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __enter__(self) -> Self:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _stop(self) -> None:
        assert self.runner is not None
        await stop_runner(self.runner)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
