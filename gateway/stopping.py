"""The gateway's stop (SIGTERM): its run requests in flight get `--grace` seconds to end.

The gateway stops listening (a load balancer's next connection goes to another gateway), closes
its idle connections, and waits for the run requests it is answering. Those still going when the
grace runs out are ended with an error the caller can act on: 503 `service_unavailable` with
`Retry-After` (the `openai` client sends it again, to another gateway), or, in a stream whose
headers went out, that error in the stream and `[DONE]`; their runs are cancelled, their slots
given back, as when a caller leaves. Without this, the runner's own shutdown waited up to twice
its timeout and then cut each answer short without a word.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from common.wire import ErrorCode
from gateway.connections import GuardedHandler
from gateway.errors import ApiError

log = logging.getLogger("iop.gateway")

#: How long run requests that outlasted the grace get to send their error and give their runs back:
#: with `--grace` (10 s) within the container's stop timeout (`compose.yaml`: 15 s) when Redis does
#: not answer (each error is sent within `gateway.responses.END_WITHIN_S`; a cancel that Redis
#: did not answer by then is left to the schedulers, `Stopping.drain`)
END_S = 3.0


class Stopping:
    """The run requests in flight, and whether the stop's grace ran out on them."""

    __slots__ = ("tasks", "cut_after_s", "followers", "followers_cut", "began", "cancelled", "leaving", "unsent")

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[object]] = set()
        #: the grace that ran out (seconds), once it did: the requests cancelled then end with `error`
        self.cut_after_s: float | None = None
        #: the runs API's followers of a run's events (`GET /v1/runs/{id}/events`): not run requests,
        #: they get no grace, and end once the run requests did, saying so (`cut_followers`)
        self.followers: set[asyncio.Task[object]] = set()
        #: the followers `cut_followers` cancelled: each ends its stream with an `error` event
        self.followers_cut: set[asyncio.Task[object]] = set()
        #: the stop began: every answer says `Connection: close` (`close_after`)
        self.began = False
        #: the runs of the run requests that outlasted the grace: cancelled with them (a runs-API
        #: follower of one is not told that it goes on)
        self.cancelled: set[str] = set()
        #: the cancels of those runs, sent once their callers were answered (`leave_after`)
        self.leaving: set[asyncio.Task[object]] = set()
        #: how many of those cancels Redis had not taken when the stop's end came (`drain`)
        self.unsent = 0

    async def close_after(self, _: web.Request, response: web.StreamResponse) -> None:
        """`on_response_prepare`: once the stop began, an answer says `Connection: close`. Its
        connection closes after it (`pre_shutdown`), and a client that took the answer for a
        kept-alive connection's sent its next request on it at once and got no answer."""
        if self.began:
            response.headers["Connection"] = "close"

    def refuse_new(self) -> None:
        """A request that began once the stop did: it came on a connection kept open (`close_idle`),
        its client's next request after an answer that began before the stop (a stream, which cannot
        say `Connection: close`). It is answered 503 with `Retry-After` (and `Connection: close`), not
        dropped with its connection: its client got a connection error, not an OpenAI-shaped one."""
        if self.began:
            raise ApiError(ErrorCode.UNAVAILABLE, "the gateway is stopping and takes no new requests: "
                           "send the request again", headers={"Retry-After": "1"})

    def follow(self) -> asyncio.Task[object] | None:
        """Count the current task (a runs-API follower) until `unfollow`."""
        return _current_into(self.followers)

    def unfollow(self, task: asyncio.Task[object] | None) -> None:
        if task is not None:
            self.followers.discard(task)
            self.followers_cut.discard(task)

    def was_cut(self, task: asyncio.Task[object] | None) -> bool:
        """Whether `cut_followers` cancelled `task` (not its caller leaving, nor its deadline)."""
        return task is not None and task in self.followers_cut

    def cut_followers(self) -> int:
        """End the followers of runs' events: each is cancelled, and ends its stream with an `error`
        event naming Last-Event-ID (they were cut mid-stream by the server's shutdown without a word,
        or ended as if nothing were wrong). Returns how many."""
        for task in self.followers:
            if not task.done():
                self.followers_cut.add(task)
                task.cancel()
        return len(self.followers_cut)

    def add(self) -> asyncio.Task[object] | None:
        """Count the current task (a run request) as in flight until `discard`."""
        return _current_into(self.tasks)

    def discard(self, task: asyncio.Task[object] | None) -> None:
        if task is not None:
            self.tasks.discard(task)

    def leave_after(self, leaving: Coroutine[Any, Any, object]) -> None:
        """Cancel the run of a request that outlasted the grace once its caller is answered, not
        before: a Redis that does not answer held each whole answer's 503 for its `socket_timeout`
        (5 s), past the grace the container's stop timeout allows (`compose.yaml`: 15 s), so
        Docker's SIGKILL cut those callers' connections instead. `drain` waits for these."""
        task = asyncio.get_running_loop().create_task(leaving)
        self.leaving.add(task)
        task.add_done_callback(self.leaving.discard)

    def error(self, headers: dict[str, str]) -> ApiError:
        """What a run request that outlasted the grace answers (with `headers`: its run's)."""
        return ApiError(ErrorCode.UNAVAILABLE,
                        f"the gateway is stopping and the run did not end within {self.cut_after_s:g} s of it; "
                        "the run was cancelled: send the request again", headers={**headers, "Retry-After": "1"})

    async def drain(self, grace_s: float, cut: asyncio.Event | None = None) -> int:
        """Wait up to `grace_s` for the run requests in flight, or until `cut` is set (a second
        SIGTERM or SIGINT), then end the rest (see the module's text). Returns how many outlasted
        the grace."""
        if not self.tasks:
            return 0
        log.info("stopping: waiting up to %gs for %d run requests (a second SIGTERM or SIGINT ends them now)",
                 grace_s, len(self.tasks))
        requests, started = set(self.tasks), asyncio.get_running_loop().time()
        waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(asyncio.wait(requests))}
        if cut is not None:
            waiters.add(asyncio.ensure_future(cut.wait()))
        await asyncio.wait(waiters, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:  # (the requests themselves go on: `asyncio.wait` does not cancel them)
            waiter.cancel()
        pending = {task for task in requests if not task.done()}
        if not pending:
            return 0
        waited = round(asyncio.get_running_loop().time() - started, 1)
        log.warning("stopping: %d run requests outlasted the grace (%gs%s): ending them with 503 "
                    "service_unavailable, their runs cancelled", len(pending), grace_s,
                    f", cut short after {waited:g}s by a second signal" if waited < grace_s else "")
        self.cut_after_s = min(waited, grace_s)
        for task in pending:
            task.cancel()
        end = asyncio.get_running_loop().time() + END_S
        await asyncio.wait(pending, timeout=END_S)
        if self.leaving:  # (handed over by the requests that ended: `leave_after`)
            await asyncio.wait(set(self.leaving), timeout=max(end - asyncio.get_running_loop().time(), 0))
        if self.leaving:  # (Redis did not answer them: the gateway's stop says so, `gateway.app`)
            self.unsent = len(self.leaving)
            for task in list(self.leaving):
                task.cancel()
            await asyncio.gather(*self.leaving, return_exceptions=True)
        return len(pending)


def close_idle(server: web.Server) -> None:
    """The stop began: idle keep-alive connections close now. A busy one stays open after its answer
    when that answer could not say `Connection: close` (a stream that began before): its client may
    send its next request on it at once, and that request is answered (`Stopping.refuse_new`). aiohttp's
    `pre_shutdown` closed each after its answer, so such a request met a closed connection."""
    for conn in server.connections:
        if isinstance(conn, GuardedHandler):
            conn.close_if_idle()
        else:
            conn.close()


def _current_into(tasks: set[asyncio.Task[object]]) -> asyncio.Task[object] | None:
    """Add the current task to `tasks`; returns it (None outside a task)."""
    task = asyncio.current_task()
    if task is not None:
        tasks.add(task)
    return task


async def stop_serving(runner: web.AppRunner, stopping: Stopping, grace_s: float,
                       cut: asyncio.Event | None = None) -> None:
    """Stop listening, close idle connections, and drain the run requests (`Stopping.drain`;
    `cut` ends the grace early), then end the runs API's followers (`Stopping.cut_followers`);
    `runner.cleanup()` ends what is left."""
    stopping.began = True
    for site in list(runner.sites):
        await site.stop()
    if runner.server is not None:
        close_idle(runner.server)
    await stopping.drain(grace_s, cut)
    stopping.cut_followers()  # (`runner.cleanup()` gives them a moment to say so)
