"""An OpenAI-compatible server that misbehaves the ways a broken or hostile provider can, chosen
by the served name a run asks for:

- `endless`: a stream of chunks without end;
- `huge`: a valid whole answer far larger than any limit, sent as it is produced;
- `big-whole`: a valid whole answer of 200 KB (under the tests' response limit, over their output limit);
- `garbage`: 200 with bytes that are not JSON (nor UTF-8);
- `garbage-error`: 500 with a long body of bytes that are not UTF-8, over many lines;
- `no-newline`: a stream whose one line never ends.

It runs on its own event loop in a thread, so the test's code may block."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from tests.fakes.serving import stop_runner

NAMES = ("endless", "huge", "big-whole", "garbage", "garbage-error", "no-newline")
DISCONNECTS = web.AppKey("disconnects", list)


def _chunk(i: int) -> bytes:
    body = {"id": "x", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {"content": f"word{i} " * 8}, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": n} for n in NAMES]})


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _chat(request: web.Request) -> web.StreamResponse:
    name = (await request.json())["model"]
    if name == "garbage":
        return web.Response(body=bytes(range(128, 256)) * 64, content_type="application/json")
    if name == "big-whole":
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "z" * 200_000}, "finish_reason": "stop"}]})
    if name == "garbage-error":
        return web.Response(status=500, body=(bytes(range(128, 256)) + b"\n") * 400)
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    i = 0
    try:
        if name == "huge":
            await resp.write(b'{"object": "chat.completion", "choices": [{"index": 0, "message": '
                             b'{"role": "assistant", "content": "')
            while True:  # the answer never stops growing; the reader must
                await resp.write(b"x" * 65536)
        elif name == "no-newline":
            await resp.write(b"data: ")
            while True:
                await resp.write(b"y" * 65536)
        else:
            while True:
                await resp.write(_chunk(i))
                i += 1
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[DISCONNECTS].append(name)
        raise


class Misbehaving:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.disconnects: list[str] = []

    async def _start(self) -> str:
        app = web.Application()
        app[DISCONNECTS] = self.disconnects
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/chat/completions", _chat)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __enter__(self) -> Misbehaving:
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

