"""An OpenAI-compatible server that misbehaves the ways a broken or hostile provider can, chosen
by the served name a run asks for:

- `endless`: a stream of chunks without end;
- `huge`: a valid whole answer far larger than any limit, sent as it is produced;
- `big-whole`: a valid whole answer of 200 KB (under the tests' response limit, over their output limit);
- `garbage`: 200 with bytes that are not JSON (nor UTF-8);
- `garbage-error`: 500 with a long body of bytes that are not UTF-8, over many lines;
- `no-newline`: a stream whose one line never ends;
- `alternating`: a stream without end whose every chunk has reasoning and text (a Response of it
  opens two output items a chunk).

It runs on its own event loop in a thread, so the test's code may block."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from tests.fakes.serving import ThreadedServer

NAMES = ("endless", "huge", "big-whole", "garbage", "garbage-error", "no-newline", "alternating")
ALTERNATING = b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"a","content":"b"}}]}\n\n'
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
        elif name == "alternating":
            while True:
                await resp.write(ALTERNATING)
        else:
            while True:
                await resp.write(_chunk(i))
                i += 1
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[DISCONNECTS].append(name)
        raise


class Misbehaving(ThreadedServer):
    def __init__(self) -> None:
        super().__init__()
        self.disconnects: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app[DISCONNECTS] = self.disconnects
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/chat/completions", _chat)
        return app

