"""Turning a run's events into the caller's answer: one JSON body, or an SSE stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from common.wire import ErrorInfo, EventType
from gateway import metrics
from gateway.errors import ApiError
from gateway.runs import Event

RUN_ID_HEADER = "X-IOP-Run-Id"
SSE_DONE = b"data: [DONE]\n\n"


def with_model(obj: Any, model_id: str) -> Any:
    """The caller always sees the model id it sent, never a provider's served name."""
    if isinstance(obj, dict) and "model" in obj:
        obj["model"] = model_id
    return obj


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def whole_response(events: AsyncIterator[Event], model_id: str, headers: dict[str, str]) -> web.Response:
    """`headers`: the run id's and the key's rate-limit headers."""
    async for event in events:
        if event.type == EventType.COMPLETED:
            body = with_model(event.data.get("response", {}), model_id)
            return web.json_response(body, headers=headers)
        if event.type == EventType.FAILED:
            raise ApiError.from_info(ErrorInfo.from_wire(event.data))
    raise RuntimeError("event stream ended without a terminal event")


async def stream_response(
    request: web.Request, events: AsyncIterator[Event], model_id: str, headers: dict[str, str]
) -> web.StreamResponse:
    """Headers go out with the first output, so a failure before it keeps its HTTP status.
    `headers`: the run id's and the key's rate-limit headers."""
    resp: web.StreamResponse | None = None

    async def begin() -> web.StreamResponse:
        r = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **headers,
        })
        await r.prepare(request)
        return r

    async for event in events:
        if event.type == EventType.DELTA:
            resp = resp or await begin()
            chunks = event.data.get("chunks", [])
            await resp.write(b"".join(sse(with_model(c, model_id)) for c in chunks))
            metrics.streamed(request, chunks)
        elif event.type == EventType.COMPLETED:
            resp = resp or await begin()
            await resp.write(SSE_DONE)
            await resp.write_eof()
            return resp
        elif event.type == EventType.FAILED:
            error = ApiError.from_info(ErrorInfo.from_wire(event.data))
            if resp is None:
                raise error
            request[metrics.STREAM_ERROR] = error.status
            await resp.write(sse(error.body()))
            await resp.write_eof()
            return resp
    raise RuntimeError("event stream ended without a terminal event")
