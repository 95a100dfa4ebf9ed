"""Turning a run's events into the caller's answer: one JSON body, or an SSE stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, NoReturn

import orjson
from aiohttp import web

from common.jsonio import dumps, json_response
from common.wire import ErrorCode, ErrorInfo, EventType
from gateway import metrics
from gateway.errors import REQUEST_ID_HEADER, ApiError
from gateway.events import Follower
from gateway.responses_output import ResponseShape, TooManyItems

RUN_ID_HEADER = "X-IOP-Run-Id"
SSE_DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def with_model(obj: Any, model_id: str) -> Any:
    """The caller always sees the model id it sent, never a provider's served name: every
    response and chunk (a dict) says `model`, whether the provider's had one or not."""
    if isinstance(obj, dict):
        obj["model"] = model_id
    return obj


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


#: How long a caller whose stream the gateway gave up on has to take its error (and `[DONE]`).
END_WITHIN_S = 1.0

log = logging.getLogger("iop.gateway")


async def ended_within(request: web.Request, ending: Awaitable[object], within_s: float = END_WITHIN_S) -> None:
    """Await `ending`, the last write of an answer whose caller may have stopped reading, for at
    most `within_s`. A caller that does not take it has its connection closed: the bound passed,
    the connection broke, or the write's wait for the caller to read was given up before it began
    (a deadline that cut an earlier write cancelled aiohttp's wait, which every later write then
    awaits: a CancelledError at once, though nothing cancels the task). The task's own
    cancellation (the caller left, the gateway stops) is raised again."""
    try:
        async with asyncio.timeout(within_s):
            await ending
    except (TimeoutError, ConnectionError, asyncio.CancelledError) as exc:
        task = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
            raise
        if request.transport is not None:
            request.transport.abort()
            why = "its connection broke" if isinstance(exc, ConnectionError) else (
                f"it did not take it within {within_s:g} s" if isinstance(exc, TimeoutError) else
                "an earlier write to it was given up")
            log.info("closed the connection of a caller of %s %s without the end of its answer: %s",
                     request.method, request.path, why)


def sse_chunks(chunks: list[Any], model_id: str) -> bytes:
    """A delta's chunks as SSE lines, each saying `model_id`: one text."""
    for chunk in chunks:
        with_model(chunk, model_id)
    if not chunks:
        return b""
    try:  # (orjson's texts joined by what goes between them: ~0.14 us a chunk less than each one's own line)
        return b"data: " + b"\n\ndata: ".join(map(orjson.dumps, chunks)) + b"\n\n"
    except TypeError:  # (what orjson cannot write: each chunk as `dumps` writes it)
        return b"".join([b"data: " + dumps(c) + b"\n\n" for c in chunks])


def answer_headers(run_id: str, limit_headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a run's answer: its id and its key's rate-limit headers. (Made when the
    answer starts, not held by a caller while its run waits.)"""
    return {**run_headers(run_id), **limit_headers}


def run_headers(run_id: str) -> dict[str, str]:
    """The run's id, as iop and as OpenAI name it, on every answer to a run, an error's too."""
    return {RUN_ID_HEADER: run_id, REQUEST_ID_HEADER: run_id}


async def whole_response(follower: Follower, model_id: str, run_id: str,
                         limit_headers: Mapping[str, str], shape: ResponseShape | None = None) -> web.Response:
    """The run's answer as one JSON body once it completed (`shape`: a Responses API request's,
    as a Response); a failure raises its error."""
    while True:
        event = await follower.next()
        if event is None:
            continue
        if event.type == EventType.COMPLETED:
            answer = event.data.get("response", {})
            body = with_model(answer, model_id) if shape is None else shape.whole(answer)
            return json_response(body, headers=answer_headers(run_id, limit_headers))
        if event.type == EventType.FAILED:
            raise ApiError.from_info(ErrorInfo.from_wire(event.data))


class _Stream(web.StreamResponse):
    """An answer whose headers go out with its first bytes, in one write (aiohttp's own
    `web.Response` does so; its `StreamResponse` writes the headers alone at `prepare`): one TCP
    segment fewer for the caller to wake for, at the start of each stream."""

    _send_headers_immediately = False


#: What a stream writes at once at most, but for a single event's SSE lines: the events a caller
#: had waiting go out in writes of about this size, each awaited, so that a caller that reads
#: slowly has no more in the gateway's buffers (its held events' text was written at once: 2.8 MB
#: a caller that read nothing, with a provider that sent faster than it was read).
WRITE_BYTES = 1 << 16


class SSEStream:
    """An SSE answer whose headers go out only when needed: with the first output, or with the
    first keep-alive comment. Until then a failure keeps its own HTTP status. Chat chunks, or
    with `shape` a Responses API request's events."""

    __slots__ = ("request", "run_id", "limit_headers", "resp", "shape")

    def __init__(self, request: web.Request, run_id: str, limit_headers: Mapping[str, str],
                 shape: ResponseShape | None = None) -> None:
        self.request = request
        self.run_id = run_id
        self.limit_headers = limit_headers
        self.resp: web.StreamResponse | None = None
        self.shape = shape

    def chunks(self, chunks: list[Any], model_id: str) -> bytes:
        """A delta's chunks as this answer's SSE lines."""
        return sse_chunks(chunks, model_id) if self.shape is None else self.shape.events(chunks)

    def done(self) -> bytes:
        """The last SSE lines of an answer whose run completed."""
        return SSE_DONE if self.shape is None else self.shape.completed()

    async def _started(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = _Stream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no", **answer_headers(self.run_id, self.limit_headers)})
            await self.resp.prepare(self.request)
        return self.resp

    async def write(self, data: bytes) -> web.StreamResponse:
        resp = await self._started()
        await resp.write(data)
        return resp

    async def keep_alive(self) -> None:
        """An SSE comment: proxies and clients with read timeouts see the stream is alive. (A
        Response's stream opens with its first events instead, once its headers go out.)"""
        await self.write(KEEP_ALIVE if self.shape is None else self.shape.opening() or KEEP_ALIVE)

    async def fail(self, error: ApiError, within_s: float) -> web.StreamResponse | None:
        """End an answer whose headers went out with `error` in the stream, then `[DONE]`; a caller
        that does not read them within `within_s` (it stopped reading) has its connection closed.
        None when the headers have not gone out: the error keeps its own HTTP status."""
        if self.resp is None:
            return None
        await ended_within(self.request, self.end_with(error), within_s)
        return self.resp

    async def end_with(self, error: ApiError, before: bytes = b"") -> web.StreamResponse:
        """End the answer with `before`, then `error` OpenAI-shaped in the stream, then `[DONE]`
        (counted under the error's status)."""
        self.request[metrics.STREAM_ERROR] = error.status
        told = sse(error.body()) + SSE_DONE if self.shape is None else self.shape.failed(error)
        return await self.end(before + told)

    async def end(self, data: bytes) -> web.StreamResponse:
        """The last bytes and the end of the answer, in one write (with the headers, if they have
        not gone out yet)."""
        resp = await self._started()
        await resp.write_eof(data)
        return resp


class Cut(Exception):
    """The answer ended with `error` in it (written): the run goes no further (`run_request`
    cancels it, as for a caller that left)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def _lost_output() -> ApiError:
    return ApiError(ErrorCode.UNAVAILABLE, "Redis lost part of this run's output (a failover promoted a replica "
                    "that had not received it: replication is asynchronous); the answer is not whole: send the "
                    "request again")


async def _cut(request: web.Request, out: SSEStream, error: ApiError, before: bytes) -> NoReturn:
    """End the answer with `before`, then `error`, and raise `Cut`."""
    await ended_within(request, out.end_with(error, before), END_WITHIN_S)
    raise Cut(error)


async def stream_response(request: web.Request, follower: Follower, model_id: str, out: SSEStream,
                          keep_alive_s: float) -> web.StreamResponse:
    """The run as OpenAI chunks. While nothing comes for `keep_alive_s` (the run waits in its
    queue, say), a keep-alive comment goes out every `keep_alive_s`. An error before anything
    went out keeps its HTTP status; after, it comes in the stream, OpenAI-shaped, then [DONE].
    The answer's headers: the run's id and its key's rate-limit headers. The events that arrived
    together go out in one write (the last output, `[DONE]` and the end of the answer, say).
    `out`: the caller's answer (made by the caller of this, which ends it if this is cut short).

    Each delta says its number (`n`, from 1), and a completed stream how many it had (`deltas`): a
    delta Redis holds twice is given once, and a stream Redis lost one of ends with the error
    `Cut` carries, not with a hole nothing tells of. (A Sentinel failover: the worker wrote a delta
    again on the promoted replica after the old primary had it read, or a delta only the old
    primary ever had.) Deltas without numbers (an older worker's) are given as they come."""
    had = 0  # (the number of the last delta given)
    attempt = None  # (the attempt its deltas were of, as they say: `a`)
    while True:
        first = await follower.next(keep_alive_s)
        if first is None:
            await out.keep_alive()
            continue
        parts: list[bytes] = []
        size = 0
        events = (first, *follower.take_ready())
        follower.writing = sum(e.size for e in events)  # (held until written: a slow reader's write waits)
        for event in events:
            if event.type == EventType.DELTA:
                n = event.data.get("n")
                if "a" in event.data and event.data["a"] != attempt:  # (another attempt's: its requeue unheard)
                    if had:  # (as a requeue after deltas the caller got: see below)
                        await _cut(request, out, _lost_output(), b"".join(parts))
                    attempt = event.data["a"]
                if type(n) is int:
                    if n <= had:  # (written again after a failover: given already)
                        continue
                    if n != had + 1:
                        await _cut(request, out, _lost_output(), b"".join(parts))
                    had = n
                chunks = event.data.get("chunks", [])
                try:
                    parts.append(out.chunks(chunks, model_id))
                except TooManyItems as exc:  # (the caller cancels the run: it goes no further)
                    await _cut(request, out, exc.error, b"".join(parts) + exc.before)
                metrics.streamed(request, chunks)
                size += len(parts[-1])
                if size >= WRITE_BYTES:  # (what waited goes on in parts, each awaited: `WRITE_BYTES`)
                    await out.write(b"".join(parts))
                    parts, size = [], 0
            elif event.type == EventType.COMPLETED:
                deltas = event.data.get("deltas")
                if type(deltas) is int and deltas > had:  # (its last deltas lost)
                    await _cut(request, out, _lost_output(), b"".join(parts))
                return await out.end(b"".join(parts) + out.done())
            elif event.type == EventType.REQUEUED:
                # A run with output is never requeued (the record says it had some): a requeue after
                # deltas the caller got means Redis lost them (a failover promoted a replica without
                # them); the next attempt's answer from its start would follow them.
                if had:
                    await _cut(request, out, _lost_output(), b"".join(parts))
                had = 0  # (another attempt numbers its own)
            elif event.type == EventType.FAILED:
                info = ErrorInfo.from_wire(event.data)
                if out.resp is None and not parts:  # (raised unbound: a local of this frame, which its
                    raise ApiError.from_info(info)  # traceback holds, would make a cycle)
                return await out.end_with(ApiError.from_info(info), b"".join(parts))
        if parts:
            await out.write(b"".join(parts))
        follower.writing = 0
        del first, events, parts  # (not held while the next events are awaited)
