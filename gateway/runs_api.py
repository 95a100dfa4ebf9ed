"""The runs API: look a run up, replay and follow its events (SSE, resumable), cancel it.

- `GET /v1/runs/{id}`: the run record (`common.runview`), 404 once unknown or expired.
- `GET /v1/runs/{id}/events`: every event of the run as SSE (`id:` = the stream entry id,
  `event:` = its type, `data:` = its JSON), then the new ones as they come, until the
  terminal event. A `Last-Event-ID` header resumes after that entry. If the gateway stops
  following before that (the run's longest possible life, `RunClient.follow_deadline_s`, passed),
  an `error` event says so last. `HEAD` answers the headers only.
- `DELETE /v1/runs/{id}`: cancels the run (dropped if queued, aborted if running) and
  answers its state: 200 once it has ended, 202 if it had not ended within `CANCEL_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from aiohttp import hdrs, web

from common import keys
from common.codec import entry_key
from common.jsonio import dumps, json_response
from common.redisconn import REDIS_DOWN
from common.runview import is_terminal, run_view
from common.shown import quoted
from common.wire import ErrorCode, EventType, RunField
from common.wrongtype import read_or
from gateway.auth import principal
from gateway.errors import REQUEST_ID_HEADER, ApiError, caller_left, invalid, new_request_id
from gateway.events import HELD_BYTES, READ_COUNT, Event, stored_event
from gateway.responses import KEEP_ALIVE, RUN_ID_HEADER, ended_within, with_model
from gateway.runs import RunClient
from gateway.stopping import Stopping

log = logging.getLogger("iop.gateway")

#: How long DELETE waits for a running run to end before it answers 202.
CANCEL_WAIT_S = 10.0
#: The events of a replay's first page (`RunsApi._replay`): pages grow from it while they are small.
FIRST_PAGE = 8

_STREAM_ID = re.compile(r"[0-9]+(-[0-9]+)?")
#: Both parts of a Redis stream id are unsigned 64-bit integers.
_ID_PART_MAX = 2**64 - 1
_ID_PART_DIGITS = len(str(_ID_PART_MAX))




def _nothing_after(stream_id: str) -> bool:
    """An id at the last millisecond a stream id can have: no event can come after it (Redis
    refuses the largest id as an exclusive start, and a run's events are stamped with the clock)."""
    return int(stream_id.partition("-")[0]) == _ID_PART_MAX


def _past_its_events(run_id: str, last_id: str, latest: str | None) -> bytes:
    """The error event that ends a stream resumed past the run's events (`latest`: its last event's
    id, '' if it has none yet, None if no event can come after `last_id` at all): it says so, and
    where to resume, rather than end empty, as a run's end would."""
    where = (f"its last event is {latest}: resume with that Last-Event-ID" if latest else
             "it has none yet: resume with Last-Event-ID 0" if latest == "" else
             "no event can come after it: resume with the id of the last event received, or 0")
    return _error_event(ApiError(
        ErrorCode.NOT_FOUND, f"Last-Event-ID {last_id} is past the events of run {run_id} (it never wrote that event, "
        f"or Redis lost it in a failover); {where}, or GET /v1/runs/{run_id} for its state"))


def _stream_id(text: str) -> str | None:
    """`text` as a Redis stream id (leading zeros dropped), or None when it is not one."""
    if _STREAM_ID.fullmatch(text) is None:
        return None
    digits = [p.lstrip("0") or "0" for p in text.split("-")]
    if any(len(d) > _ID_PART_DIGITS for d in digits):  # (before int(): Python refuses > 4,300 digits)
        return None
    parts = [int(d) for d in digits]
    if any(p > _ID_PART_MAX for p in parts):
        return None
    return "-".join(map(str, parts))


def _sse(event: Event, model_id: str) -> bytes:
    """One SSE message; output keeps the caller's model id, as the OpenAI responses do."""
    data: Any = event.data
    if event.type == EventType.DELTA:
        data = {**data, "chunks": [with_model(c, model_id) for c in data.get("chunks", [])]}
    elif event.type == EventType.COMPLETED and isinstance(data.get("response"), dict):
        data = {**data, "response": with_model(data["response"], model_id)}
    head = f"id: {event.id}\n" if _STREAM_ID.fullmatch(event.id) else ""
    try:
        body = dumps(data)
    except (TypeError, ValueError):  # (bytes in it: not iop's writing; the replay hung on it)
        body = b"{}"
    return f"{head}event: {event.type}\ndata: ".encode() + body + b"\n\n"


def _error_event(error: ApiError) -> bytes:
    """An error, OpenAI-shaped, as the SSE message that ends an events stream short of the run's end."""
    return b"event: error\ndata: " + dumps(error.body()) + b"\n\n"


def _owner(raw: dict[bytes, bytes]) -> str | None:
    owner = raw.get(RunField.KEY.value.encode())
    return owner.decode() if owner is not None else None



def not_yet_passed(last_id: str, now_ms: int) -> bool:
    """For a run with no event yet (still queued): whether `last_id` is one Redis has not passed
    at `now_ms`. Ids it has passed come before all the run will write (`0-0` is past nothing);
    any of this millisecond may not (its first event may be `<now_ms>-0`), nor one from later:
    those cannot be followed."""
    return entry_key(last_id) >= (now_ms, 0)

class RunsApi:
    def __init__(self, runs: Callable[[], RunClient], stopping: Stopping | None = None) -> None:
        self.runs = runs
        self.stopping = Stopping() if stopping is None else stopping

    async def _view(self, request: web.Request, run_id: str) -> dict[str, Any]:
        """The run, if it exists and the request's key may see it (its own, or any for an
        operator); else the same 404 either way."""
        # (a record of another type, written by hand, holds no run: 404, not a 503 "Redis refused" and
        # Retry-After for as long as the key lives)
        raw = await read_or(self.runs().redis.hgetall(keys.run_record(run_id)), {})
        who = principal(request)
        if not raw or not who.may_see_run(_owner(raw)):
            raise ApiError(ErrorCode.NOT_FOUND, f"the run {quoted(run_id)} does not exist or has expired", param="id")
        return run_view(run_id, raw, operator=who.operator)

    async def get(self, request: web.Request) -> web.Response:
        view = await self._view(request, request.match_info["run_id"])
        return json_response(view, headers={RUN_ID_HEADER: view["id"]})

    async def events(self, request: web.Request) -> web.StreamResponse:
        run_id = request.match_info["run_id"]
        given = request.headers.getall("Last-Event-ID", [])
        if len(given) > 1:  # (which one the client meant is not ours to guess)
            raise invalid(f"Last-Event-ID was given {len(given)} times; give it once", param="Last-Event-ID")
        header = (given[0] if given else "").strip() or "0"
        last_id = _stream_id(header)
        if last_id is None:
            raise invalid(f"Last-Event-ID {quoted(header)} is not an event id: an event id is one or two unsigned "
                          f"64-bit integers joined by '-' (at most {_ID_PART_MAX})", param="Last-Event-ID")
        view = await self._view(request, run_id)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", RUN_ID_HEADER: run_id,
                                           REQUEST_ID_HEADER: new_request_id()})
        await resp.prepare(request)
        if request.method == hdrs.METH_HEAD:  # (aiohttp would send what is written, unframed)
            await resp.write_eof()
            return resp
        runs = self.runs()
        deadline_s = runs.follow_deadline_s(view["model"])
        told = b""
        following = self.stopping.follow()
        try:
            with runs.deadlines.within(deadline_s):
                if _nothing_after(last_id) or (beyond := await self._beyond(run_id, last_id)) is not None:
                    told = _past_its_events(run_id, last_id, None if _nothing_after(last_id) else beyond)
                elif is_terminal(view):
                    told = await self._replay(resp, run_id, last_id, view["model"])
                else:
                    await self._follow(resp, run_id, last_id, view["model"])
        except TimeoutError:  # (not the run's end: the client must not take the stream's end for it)
            told = _error_event(ApiError(
                ErrorCode.EXECUTION_TIMEOUT, f"the gateway ended this stream after {deadline_s:g} s (the longest "
                f"a run of this model can last) before it reached the run's end; GET /v1/runs/{run_id} tells "
                f"the run's state, and Last-Event-ID resumes its events"))
        except REDIS_DOWN as exc:  # the headers went out: the error comes in the stream, OpenAI-shaped
            if caller_left(request):  # (a write to the caller failed: it went away, Redis did not)
                return resp
            log.warning("redis unavailable while following run %s: %s", run_id, exc)
            told = _error_event(ApiError(ErrorCode.UNAVAILABLE, "the run store (Redis) became unavailable while "
                                         "this stream followed the run; Last-Event-ID resumes its events"))
        except asyncio.CancelledError:
            if not self.stopping.was_cut(following):  # (its caller left, or the task is being torn down)
                raise
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
            told = _error_event(ApiError(ErrorCode.UNAVAILABLE, self._stopped(run_id)))
        finally:
            self.stopping.unfollow(following)
        await ended_within(request, resp.write_eof(told))  # (a caller that stopped reading is not waited for)
        return resp

    def _stopped(self, run_id: str) -> str:
        """What a follower cut by the gateway's stop is told of its run."""
        if run_id in self.stopping.cancelled:  # (its caller's request here outlasted the grace)
            return (f"the gateway is stopping, and run {run_id} was cancelled with its caller's request, which "
                    f"outlasted the stop's grace; GET /v1/runs/{run_id} at another gateway tells how it ended")
        return (f"the gateway is stopping; run {run_id} goes on: resume its events at another gateway with "
                "Last-Event-ID (the id of the last event received)")

    async def _beyond(self, run_id: str, last_id: str) -> str | None:
        """The run's last event id ('' for none yet) when `last_id` is past it: the client says it
        had one the run never wrote (a run's events stay until they all expire; a Redis failover may
        lose the last ones), so nothing it has not had can come, and the run's end, which it would
        take for one it had, would go unseen. None when it is not."""
        if last_id == "0":
            return None
        redis = self.runs().redis
        latest = await redis.xrevrange(keys.run_events(run_id), "+", "-", count=1)
        if latest:
            latest_id = latest[0][0].decode()
            return latest_id if entry_key(latest_id) < entry_key(last_id) else None
        seconds, micros = await redis.time()
        return "" if not_yet_passed(last_id, int(seconds) * 1000 + int(micros) // 1000) else None

    async def _follow(self, resp: web.StreamResponse, run_id: str, last_id: str, model_id: str) -> None:
        """Every event after `last_id` until the terminal one, with a keep-alive comment whenever
        nothing came for `runtime.stream_keepalive_ms`."""
        runs = self.runs()
        keep_alive_s = runs.config.runtime.stream_keepalive_ms / 1000
        async with runs.follow(run_id, last_id, watch=True) as follower:
            while True:
                event = await follower.next(keep_alive_s)
                if event is None:
                    await resp.write(KEEP_ALIVE)
                    continue
                await resp.write(_sse(event, model_id))
                if event.type in (EventType.COMPLETED, EventType.FAILED):
                    return

    async def _replay(self, resp: web.StreamResponse, run_id: str, last_id: str, model_id: str) -> bytes:
        """An ended run's events after `last_id`: all there already (its terminal event may be the
        one the client has, so following would never end). Read a page at a time, each sent before
        the next is read: a client that reads slowly (or not at all) holds one page. A page is 8
        events, then twice as many while a page holds at most `HELD_BYTES` (as stored), up to
        `READ_COUNT`, and half as many past it (a run of large events: 64 of 64 KiB each, 4 MB a
        reader that reads nothing). Returns b"", or the error event to end with when the events
        expired (`run_ttl_s`) before the replay reached the run's end: a stream that just stopped
        would pass for the end."""
        start = "-" if last_id == "0" else f"({last_id}"
        last_type: str | None = None
        runs = self.runs()
        count = FIRST_PAGE
        while True:
            async with runs.hub.reads:  # (a crowd of replays takes turns: `gateway.events.READS_SHARE`)
                entries = await runs.redis.xrange(keys.run_events(run_id), start, "+", count=count)
            size = 0
            for entry_id, fields in entries:
                event = stored_event(entry_id, fields)
                await resp.write(_sse(event, model_id))
                last_type, size = event.type, size + event.size
            if len(entries) < count:
                break
            start = f"({entries[-1][0].decode()}"
            count = max(1, count // 2) if size > HELD_BYTES else min(READ_COUNT, count * 2)
            del entries
        if last_type in (EventType.COMPLETED, EventType.FAILED):
            return b""
        if last_type is None and last_id != "0" and await runs.redis.exists(keys.run_events(run_id)):
            return b""  # (resumed at the run's last event: nothing more to send)
        return _error_event(ApiError(
            ErrorCode.NOT_FOUND, f"the events of run {run_id} expired (runtime.run_ttl_s) before this stream "
            f"reached the run's end; GET /v1/runs/{run_id} tells how it ended while its record lasts"))

    async def delete(self, request: web.Request) -> web.Response:
        run_id = request.match_info["run_id"]
        view = await self._view(request, run_id)
        runs = self.runs()
        latest = await runs.redis.xrevrange(keys.run_events(run_id), "+", "-", count=1)
        after = latest[0][0].decode() if latest else "0"
        if await runs.cancel(run_id, view["model"], "cancelled through the runs API") == "signalled":
            await self._until_ended(run_id, after)
        view = await self._view(request, run_id)
        return json_response(view, status=200 if is_terminal(view) else 202, headers={RUN_ID_HEADER: run_id})

    async def _until_ended(self, run_id: str, after: str) -> None:
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                async for _ in self.runs().events(run_id, after, watch=True):
                    pass
        except TimeoutError:
            return


def setup(app: web.Application, runs: Callable[[], RunClient], stopping: Stopping | None = None) -> None:
    """Add the runs routes; `runs` gives the app's RunClient once the app has started; `stopping`
    ends the followers of runs' events when the gateway stops."""
    api = RunsApi(runs, stopping)
    app.router.add_get("/v1/runs/{run_id}", api.get)
    app.router.add_get("/v1/runs/{run_id}/events", api.events)
    app.router.add_delete("/v1/runs/{run_id}", api.delete)
