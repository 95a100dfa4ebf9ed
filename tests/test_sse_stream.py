"""The gateway's SSE answer (`gateway.responses.SSEStream`) on a real aiohttp server."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.responses import KEEP_ALIVE, SSEStream


async def test_a_stream_s_headers_go_out_with_its_first_bytes_in_one_write() -> None:
    """One write, one TCP segment: the caller wakes once for the start of its stream, not for the
    headers and again for the first chunk (aiohttp's `StreamResponse` writes headers alone)."""
    writes: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        transport: Any = request.transport
        write, writelines = transport.write, transport.writelines

        class Recording:  # (the transport's methods are read-only: a stand-in that records them)
            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

            def write(self, data: bytes) -> None:
                writes.append(bytes(data))
                write(data)

            def writelines(self, lines: list[bytes]) -> None:
                writes.append(b"".join(lines))
                writelines(lines)

        request.protocol.transport = Recording()  # type: ignore[assignment]  # (what the writer writes to)
        out = SSEStream(request, "run_1", {})
        await out.keep_alive()
        await out.write(b"data: {}\n\n")
        return await out.end(b"data: [DONE]\n\n")

    app = web.Application()
    app.router.add_get("/", handler)
    server = TestServer(app, port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http, http.get(server.make_url("/")) as resp:
            body = await resp.read()
    finally:
        await server.close()
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "run_1"
    assert body == KEEP_ALIVE + b"data: {}\n\ndata: [DONE]\n\n"
    assert writes[0].startswith(b"HTTP/1.1 200 ") and KEEP_ALIVE in writes[0], writes[0]  # (chunk-framed)
    assert len(writes) == 3
