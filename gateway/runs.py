"""The gateway's side of a run: put it in its model's queue, follow its events, cancel it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.auth import ANYONE, Principal
from common.codec import entry_key, pack
from common.config import Config, ModelConfig
from common.policy import FREE_NOW
from common.redisconn import REDIS_REFUSED, now_ms
from common.redisline import may_have_run
from common.runlog import run_fields
from common.script_batch import ScriptBatch
from common.scripts import Scripts
from common.snapshots import why_none
from common.wire import ErrorCode, ErrorInfo, EventType, RunState, uuid4_hex
from common.wrongtype import delete_wrong_types, is_wrongtype
from gateway.deadlines import Deadlines
from gateway.errors import ApiError
from gateway.events import Event, EventHub, Following, Queued
from gateway.requests import ParsedRequest
from gateway.take_back import Kept, TakeBack

log = logging.getLogger("iop.gateway")

#: OpenAI's rate-limit headers of a limit on requests a minute, sent with every run of a key that has
#: `requests_per_minute`, and its refusal (not a `max_in_flight` one: it is not a limit a minute)
LIMIT_HEADER = "x-ratelimit-limit-requests"
REMAINING_HEADER = "x-ratelimit-remaining-requests"
RESET_HEADER = "x-ratelimit-reset-requests"
#: Which of its limits a key hit (`max_in_flight` or `requests_per_minute`), on a 429.
WHICH_LIMIT_HEADER = "x-iop-limit"
#: The rate-limit headers of a run whose key has no requests_per_minute (one, shared).
NO_LIMIT_HEADERS: Mapping[str, str] = MappingProxyType({})

def reset_text(ms: int) -> str:
    """A wait as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


#: Extra time a follower waits past a run's own queue and execution timeouts before it gives
#: up on the run itself (a scheduler or worker that died without a trace).
FOLLOW_GRACE_S = 30.0
#: A run still queued this long past its queue timeout (plus twice `runtime.scheduler_liveness_ms`,
#: the time a dead scheduler replica's runs take to reach another) has no scheduler: the gateway
#: ends it with `queue_timeout` itself (`RunClient.stuck`).
STUCK_GRACE_MS = 5_000
#: The gateway logs that it ended such runs at most this often per model.
STUCK_LOG_EVERY_S = 10.0
#: Why a run is cancelled whose caller left.
LEFT = "the caller went away"
#: Why a run is cancelled whose queueing timed out (its caller heard 503), if Redis queued it after all.
UNANSWERED = "Redis did not answer in time while the run was queued, and its caller was answered 503"


def new_run_id() -> str:
    return f"run_{uuid4_hex()}"


@dataclass(frozen=True, slots=True)
class ModelKeys:
    """The keys `enqueue` reads for a model: of its providers (heartbeat, leases, capacity override,
    drain and cordon flags: is one available, and how many slots are free), and the runs streams
    of the other models that share one with it (their waiting runs take those slots first), with
    which of its providers each has."""

    providers: list[str]
    sharing: list[str]
    #: for each of `sharing`, which of its providers that model has ('1' or '0' each, in the order of
    #: `providers`), comma-separated
    masks: str


class RunClient:
    def __init__(self, redis: Redis, config: Config, hub: EventHub | None = None) -> None:
        """`hub`: the gateway's one event reader (a private one when not given)."""
        self.redis = redis
        self.config = config
        self.scripts = Scripts(redis)
        #: the runs queued in one turn of the event loop go to Redis together (a burst of callers
        #: takes a few connections and round trips, not one each)
        self.enqueue = ScriptBatch(self.scripts, "enqueue")
        self.hub = hub or EventHub(redis, keep_alive_s=config.runtime.stream_keepalive_ms / 1000)
        self.hub.queued = self.stuck
        self.hub.lost = self.lost
        #: model id -> when the gateway last logged that it ended runs no scheduler took
        self._stuck_logged: dict[str, float] = {}
        #: the bounds of the callers waiting for their runs (one sweeper, not a timer each)
        self.deadlines = Deadlines()
        #: model id -> the keys `enqueue` reads for it (`_keys_of`)
        self._model_keys: dict[str, ModelKeys] = {}
        #: first tries to cancel the runs whose callers left while their queueing was out
        self._leaving: set[asyncio.Task[object]] = set()
        #: cancels Redis could not take when they were made, made once it answers
        self.take_back = TakeBack(redis, self._drop_kept, self.hub.comeback if self.hub.redis is redis else None)

    async def close(self) -> None:
        for task in self._leaving:
            task.cancel()
        await asyncio.gather(*self._leaving, return_exceptions=True)
        await self.take_back.close()
        await self.deadlines.close()
        await self.hub.close()

    def _keys_of(self, model: ModelConfig) -> ModelKeys:
        providers = [k for p in sorted(model.providers) for k in (
            keys.heartbeat(p), keys.leases(p), keys.capacity_override(p), keys.drained(p),
            keys.cordoned(self.config.node_of(p)))]
        # (the models with the fewest of its providers first: their waiting runs have the least choice)
        sharing = sorted((m for m in self.config.models if m.id != model.id and not model.providers.keys().isdisjoint(
            m.providers)), key=lambda m: len(model.providers.keys() & m.providers.keys()))
        masks = ",".join("".join("1" if p in m.providers else "0" for p in sorted(model.providers)) for m in sharing)
        self._model_keys[model.id] = ModelKeys(providers, [keys.runs_stream(m.id) for m in sharing], masks)
        return self._model_keys[model.id]

    async def submit(self, model: ModelConfig, req: ParsedRequest, who: Principal = ANYONE,
                     run_id: str | None = None, refuse: Sequence[str] = ()) -> tuple[str, Mapping[str, str]]:
        """Queue the run for `who` (under `run_id`, or a new id): (its id, the rate-limit headers
        of its key), or raise 429 rate_limit_exceeded / queue_full, or 503
        no_available_provider. Atomic. `refuse`: providers of the model whose adapter would
        refuse it (`gateway.refusals`): it never goes there, nor counts their slots."""
        run_id = run_id or new_run_id()
        policy = self.config.queue_for(model)
        model_keys = self._model_keys.get(model.id) or self._keys_of(model)
        def if_left(answer: list[bytes] | None) -> None:  # the caller left while its run was being queued
            if answer is None or answer[0] == b"ok":  # (None: Redis did not answer; it may queue it yet)
                self._in_background(self.leave(run_id, model.id))

        for again in (False, True):
            try:
                result = await self.enqueue.call(
                    [keys.runs_stream(model.id), keys.run_record(run_id), keys.key_in_flight(who.name),
                     keys.key_requests(who.name), *model_keys.providers, *model_keys.sharing],
                    [run_id, policy.max_queue, self.config.runtime.run_ttl_s, model.id, req.kind.value,
                     "1" if req.stream else "0", req.packed if req.packed is not None else pack(req.body), who.name,
                     who.max_in_flight or 0, who.requests_per_minute or 0, int(self.follow_deadline_s(model.id) * 1000),
                     policy.max_attempts, self.hub.gateway_id + keys.OUTPUT_ONLY,  # its caller wants output and end
                     ",".join(refuse), len(model_keys.providers), model_keys.masks],
                    if_left,
                )
            except (RedisTimeoutError, RedisConnectionError) as exc:
                # Redis did not answer, or the connection broke once the queueing was sent: its caller
                # hears 503 and sends the request again, but a Redis that was paused runs what it had
                # received when it resumes, and one that went down may have run it first (kept, with AOF).
                if may_have_run(exc):
                    self._cancel_later(run_id, model.id, UNANSWERED)
                raise
            except ResponseError as exc:
                # (the key's in-flight set or request window of another type, written by hand: every run of
                # the key was refused for good; the script wrote nothing before its read of them failed)
                if again or not is_wrongtype(exc) or not await delete_wrong_types(
                        self.redis, {keys.key_in_flight(who.name): "zset", keys.key_requests(who.name): "zset"},
                        log, f"key {who.name}"):
                    raise
                continue
            break
        status = result[0].decode()
        if status == "ok":
            left = int(result[2])
            return run_id, (NO_LIMIT_HEADERS if left < 0 else {LIMIT_HEADER: str(who.requests_per_minute),
                                                 REMAINING_HEADER: str(left)})
        if status in ("key_in_flight", "key_rate"):
            log.info("key %s is at its %s: refused", who.name,
                     "max_in_flight" if status == "key_in_flight" else "requests_per_minute", extra={"key": who.name})
        if status == "key_in_flight":
            # (the limit, not the count: a limit lowered by a reload of the keys, `gateway.keys_reload`,
            # finds more runs in flight than it allows, and the message said the key "has 1 run" with 4)
            raise ApiError(ErrorCode.RATE_LIMIT_EXCEEDED,
                           f"key {who.name!r} is at its max_in_flight: {who.max_in_flight} "
                           f"run{'s' if who.max_in_flight != 1 else ''} queued or running at once; "
                           "retry when one has ended", param=None,
                           headers={"Retry-After": "1", WHICH_LIMIT_HEADER: "max_in_flight"})
        if status == "key_rate":
            wait_ms = int(result[2])
            wait_s = max(1, math.ceil(wait_ms / 1000))
            raise ApiError(ErrorCode.RATE_LIMIT_EXCEEDED,
                           f"key {who.name!r} made {who.requests_per_minute} requests in the last minute, its "
                           f"requests_per_minute; retry in {wait_s} s",
                           headers={"Retry-After": str(wait_s), LIMIT_HEADER: str(who.requests_per_minute),
                                    REMAINING_HEADER: "0", RESET_HEADER: reset_text(wait_ms),
                                    WHICH_LIMIT_HEADER: "requests_per_minute"})
        if status == "full":
            raise ApiError(
                ErrorCode.QUEUE_FULL,
                f"the queue of model {model.id!r} is full ({policy.max_queue} runs waiting); retry later"
                if policy.max_queue else  # (no queue: "full (0 runs waiting)" read as a fault)
                f"model {model.id!r} has no free slot and no queue (max_queue 0); retry later",
                headers={"Retry-After": "1"},
            )
        why = await why_none(self.redis, model.providers, now_ms(), self.config.node_of,
                             self.config.runtime.heartbeat_ttl_ms, frozenset(refuse))
        # (read after the refusal: a provider that came back meanwhile, its first heartbeat after a
        # restart of Redis say, says it is free; the refusal stands, the caller may retry at once)
        raise ApiError(
            ErrorCode.NO_AVAILABLE_PROVIDER,
            f"no provider of model {model.id!r} was available when this request came{why}: one came back since; "
            "retry" if FREE_NOW in why else f"no provider of model {model.id!r} is available right now{why}",
            headers={"Retry-After": "1"},
        )

    def follow_deadline_s(self, model_id: str | None) -> float:
        """How long following a run of this model may take, at most: every attempt may wait out
        its queue and execution timeouts, and so may each of those that used none of the attempts up,
        its provider unable to do what it asks (one for each provider but one: its refusal may come as
        late as its execution timeout, as any answer may); plus a grace."""
        model = self.config.model(model_id or "")
        policy = self.config.queue_for(model) if model is not None else self.config.queue
        attempt_ms = policy.queue_timeout_ms + policy.execution_timeout_ms
        unable = max(len(model.providers) - 1, 0) if model is not None else 0
        return attempt_ms * (policy.max_attempts + unable) / 1000 + FOLLOW_GRACE_S

    def follow(self, run_id: str, last_id: str = "0", *, watch: bool = False,
               fresh: bool = False) -> Following:
        """Follow the run's events after `last_id` (through the gateway's one reader); `watch` for a
        run another gateway may have started; `fresh` for a run this gateway is about to
        `submit`. The follower's `next()` never ends the wait by itself: the caller bounds it
        with a deadline."""
        return self.hub.follow(run_id, last_id, watch=watch, fresh=fresh)

    async def events(self, run_id: str, last_id: str = "0", *, watch: bool = False) -> AsyncIterator[Event]:
        """Every event of the run after `last_id`, up to and including its terminal one."""
        async with self.follow(run_id, last_id, watch=watch) as follower:
            while True:
                event = await follower.next()
                assert event is not None
                yield event
                if event.type in (EventType.COMPLETED, EventType.FAILED):
                    return

    async def leave(self, run_id: str, model_id: str, reason: str = LEFT) -> str | None:
        """The run's caller went away (or the gateway, stopping, let it go: `reason`): the run must
        not go on without it (cancelled now, or, when Redis cannot do it now, in the background
        once it can). What `cancel` says (`ok`: dropped from its queue, `signalled`: told to stop
        where it runs, else the state it had ended in), None when it is left for later."""
        try:
            return await self.cancel(run_id, model_id, reason, ours=True)
        except REDIS_REFUSED as exc:
            log.warning("could not cancel yet (%s); trying again once Redis answers", exc,
                        extra=run_fields(run_id, model_id))
            self._cancel_later(run_id, model_id, reason)
            return None

    def _in_background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    def _cancel_later(self, run_id: str, model_id: str, reason: str) -> None:
        """Cancel the run once Redis answers, until it would have ended anyway (`follow_deadline_s`).
        A run not there yet is recorded cancelled: its queueing, if Redis still has it to run,
        then queues nothing."""
        self.take_back.add(run_id, model_id, reason, self.follow_deadline_s(model_id))

    async def _drop_kept(self, batch: list[tuple[str, Kept]]) -> list[Any]:
        return await self.scripts.call_many("drop_queued", [
            self._drop_call(run_id, kept.model_id, RunState.CANCELLED, ErrorInfo(ErrorCode.CANCELLED, kept.reason),
                            abort_running=True, ours=True) for run_id, kept in batch])

    async def cancel(self, run_id: str, model_id: str, reason: str, *, ours: bool = False) -> str:
        """Drop the run if it waits; tell its node to abort it if it runs. `ours`: this gateway
        queued it (or tried to), so a run not there yet is recorded cancelled, and its queueing,
        should it still be on its way, queues nothing (`drop_queued`)."""
        return await self._drop(run_id, model_id, RunState.CANCELLED, ErrorInfo(ErrorCode.CANCELLED, reason),
                                abort_running=True, ours=ours)

    async def _drop(self, run_id: str, model_id: str, state: RunState, info: ErrorInfo, abort_running: bool,
                    ours: bool = False) -> str:
        """End the run with `state` and `info` if it waits in its queue (`drop_queued`, atomic);
        `abort_running`: else tell its node to abort it if it runs; `ours`: see `cancel`."""
        result = await self.scripts.call("drop_queued", *self._drop_call(run_id, model_id, state, info, abort_running,
                                                                          ours))
        return result.decode() if isinstance(result, bytes) else str(result)

    def _drop_call(self, run_id: str, model_id: str, state: RunState, info: ErrorInfo, abort_running: bool,
                   ours: bool) -> tuple[list[str], list[Any]]:
        return ([keys.runs_stream(model_id), keys.run_record(run_id), keys.run_events(run_id)],
                [run_id, keys.SCHEDULER_GROUP, state.value, pack(info.to_wire()), self.config.runtime.run_ttl_s,
                 info.code.value, info.message, keys.node_cancel("") if abort_running else "",
                 keys.scheduler_channel(""), model_id if ours else ""])

    async def lost(self, run_ids: list[str]) -> None:
        """Followed runs whose record Redis lost (a restart without persistence): their callers
        hear 502 `worker_lost`, but a run still generating at its provider would go on until its
        worker's next lease renewal. Nothing says which node runs it any more: every node is told
        to cancel it (a worker that does not run it ignores the message)."""
        pipe = self.redis.pipeline(transaction=False)
        for run_id in run_ids:
            for node in self.config.nodes:
                pipe.publish(keys.node_cancel(node.id), run_id)
        try:
            await pipe.execute()
        except REDIS_REFUSED as exc:  # (the renewal still ends it)
            log.warning("could not tell the nodes to cancel %d lost runs (%s)", len(run_ids), exc)

    async def stuck(self, queued: Queued) -> None:
        """Followed runs found still waiting in their queue (`EventHub`'s quiet check). A
        scheduler ends a run that waited its `queue_timeout_ms`; one still queued well past that
        (`STUCK_GRACE_MS`), and that no live scheduler replica holds, has none: no scheduler runs,
        or none has its model in its config. The gateway ends it with `queue_timeout` itself,
        saying so, rather than keep its caller waiting out the whole follow deadline (minutes).
        (A run a live replica holds is that replica's to end, by its own config's timeout.)"""
        now = now_ms()
        grace_ms = STUCK_GRACE_MS + 2 * self.config.runtime.scheduler_liveness_ms
        late: dict[tuple[str, int], list[tuple[str, str]]] = {}  # (model id, queue timeout) -> (run id, entry)
        for run_id, model_id, entry in queued:
            model = self.config.model(model_id)
            timeout_ms = self.config.queue_for(model).queue_timeout_ms if model is not None else 0
            if model is not None and now - entry_key(entry)[0] > timeout_ms + grace_ms:
                late.setdefault((model.id, timeout_ms), []).append((run_id, entry))
        for (model_id, timeout_ms), waiting in late.items():
            run_ids = await self._unheld(model_id, waiting)
            if not run_ids:
                continue
            info = ErrorInfo(ErrorCode.QUEUE_TIMEOUT,
                             f"no scheduler took the run within its queue_timeout_ms ({timeout_ms} ms): is a "
                             f"scheduler running, with model {model_id!r} in its config?")
            outcomes = await asyncio.gather(*(self._drop(r, model_id, RunState.TIMED_OUT, info, abort_running=False)
                                              for r in run_ids), return_exceptions=True)
            ended = sum(outcome == "ok" for outcome in outcomes)
            if ended and time.monotonic() - self._stuck_logged.get(model_id, -STUCK_LOG_EVERY_S) >= STUCK_LOG_EVERY_S:
                self._stuck_logged[model_id] = time.monotonic()
                log.warning("%d runs of model %s were still queued %d ms past their queue_timeout_ms: no scheduler "
                            "took them (is one running, with this model in its config?); ended them with "
                            "queue_timeout", ended, model_id, grace_ms, extra={"model": model_id})

    async def _unheld(self, model_id: str, waiting: list[tuple[str, str]]) -> list[str]:
        """The runs (of (run id, its queue entry)) that no live scheduler replica holds: no replica
        read their entry, or the one that did is gone (its liveness key expired)."""
        stream = keys.runs_stream(model_id)
        pipe = self.redis.pipeline(transaction=False)
        for _, entry in waiting:
            pipe.xpending_range(stream, keys.SCHEDULER_GROUP, min=entry, max=entry, count=1)
        pending = await pipe.execute(raise_on_error=False)  # (no group yet: no scheduler ever read it)
        holders = [p[0]["consumer"] if isinstance(p, list) and p else None for p in pending]
        named = sorted({h for h in holders if h is not None})
        pipe = self.redis.pipeline(transaction=False)
        for holder in named:
            pipe.exists(keys.scheduler_alive(holder.decode()))
        alive = dict(zip(named, await pipe.execute(), strict=True)) if named else {}
        return [run_id for (run_id, _), holder in zip(waiting, holders, strict=True)
                if holder is None or not alive[holder]]
