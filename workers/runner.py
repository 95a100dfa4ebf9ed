"""Executing one run on this node: start it, call the adapter, publish events, end it.

However a run ends (output, provider error, timeout, cancellation, worker shutdown, an answer
the worker cannot handle), the `finish` script releases its slot and wakes the schedulers. No
exception but the task's own cancellation leaves a run's task, so no provider's answer can take
the worker down. While it runs, its lease is renewed; if the lease is lost (the scheduler reaped
it), the run is abandoned at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys, token_cap
from common.chunks import (
    MAX_COUNTED_TOKENS,
    carries_output,
    fixed_usage,
    token_counts,
    usage_in,
    wants_usage,
    without_usage,
)
from common.codec import Unpackable, pack, unpack
from common.comeback import Comeback, pause_on
from common.config import Config
from common.policy import BLAME_RUNS, DOWN, candidate_class
from common.provider_types import PROBE_DISTURBS
from common.redisconn import REDIS_FULL, REDIS_UNUSABLE, Backoff, id_set, now_ms
from common.runlog import run_fields
from common.scripts import Scripts
from common.snapshots import read_snapshots
from common.wire import CONFLICT, ErrorCode, ErrorInfo, EventType, RunKind, RunState, busy, cancelled_by_caller
from common.wrongtype import read_or
from workers import metrics
from workers.adapters.base import Adapter, LastRead, ProviderError, Retry
from workers.adapters.failures import own_words
from workers.adapters.openai_compat import completion_tokens_named, max_tokens_only
from workers.health import Field
from workers.stream_pump import Pump, close_reads, shows_output

log = logging.getLogger("iop.worker")

#: Who runs an attempt, recorded in the run (`worker` field) for operators and fault tests.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


def new_worker_instance() -> str:
    """One worker's own id for the `take` script, which hands a job over again only to the
    instance it is in progress for: a worker restarted in place (a container's PID 1) has the same
    WORKER_ID but another instance, and so has each worker of a process that runs several."""
    return f"{WORKER_ID}:{uuid.uuid4().hex[:12]}"


#: The most cancels of runs not running here a worker keeps (`Runner.heard_cancel`).
MAX_CANCELS_HEARD = 4096

#: The most opening chunks (a bare `role` delta) a stream's first output waits for: more go out.
MAX_OPENING = 64

#: A delta event's largest size, packed, but for one of a single chunk: more output read at once (a
#: provider that sends faster than it is read) goes as several events. A caller's gateway holds a
#: reader's events up to about as much (`gateway.events.HELD_BYTES`), always at least one: an event
#: of 374 KB (an unpaced 100,000-token stream) had each slow reader hold ~2.5 MB there.
EVENT_BYTES = 1 << 16

#: The most times a request given the model's cap is asked again with less (`Runner._answer`): a chat
#: cap over SGLang's context, then the total over it, then (SGLang 0.5.2) a total equal to it
REFITS = 3

#: What a caller's cancellation looks like in the run's events.
CANCELLED = cancelled_by_caller()


def _stop(att: Attempt, task: asyncio.Task[Any]) -> None:
    att.stopping = True
    task.cancel()


class LeaseLost(Exception):
    """This attempt no longer owns the run."""


def _first(said: set[str], kind: str) -> int:
    """WARNING the first time `kind` is said (added to `said`), DEBUG after."""
    if kind in said:
        return logging.DEBUG
    said.add(kind)
    return logging.WARNING


class OutputTooLarge(Exception):
    """The run's output passed one of its limits (`runtime.max_output_bytes`, `max_events_per_run`)."""


class CancelledBeforeOutput(Exception):
    """The run's first output came after its cancel was recorded (this worker did not hear of it)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclass(slots=True)
class Attempt:
    run_id: str
    model_id: str
    provider_id: str
    attempt: str
    #: the run's own (its record's, as its queueing wrote it)
    max_attempts: int
    #: every provider an attempt of this run went to, this one included
    tried: frozenset[str] = frozenset()
    #: the name of the API key that started the run
    key: str = "-"
    #: the providers whose adapter would refuse the run (`gateway.refusals`): it never goes there
    refuse: frozenset[str] = frozenset()
    #: the run's attempts before this one that used up none of `max_attempts` (`Retry.UNABLE`)
    unable: int = 0
    #: the providers that refused the run as unable to do what it asks (the record's `unable_by`):
    #: it never goes back to them
    unable_by: frozenset[str] = frozenset()
    #: the providers an earlier attempt failed on so that the run goes only elsewhere (a 5xx, a 429, a
    #: redirect: the record's `elsewhere`): it never goes back to them, each is tried at most once
    elsewhere: frozenset[str] = frozenset()
    output: bool = False
    #: chunks of output the caller got (in `delta` events; its opening ones not counted), and the
    #: last `usage` the provider's stream carried, and the last read with output that went out:
    #: what a stream that ended before its own usage came counts (`_partial_usage`)
    out_chunks: int = 0
    usage_seen: dict[str, Any] | None = None
    usage_sent: dict[str, Any] | None = None
    #: bytes of output stored in the run's events so far
    output_bytes: int = 0
    #: events this attempt emitted so far (each emit is numbered: the `emit` script adds it once)
    emitted: int = 0
    #: why the run was cancelled (by its caller, or as its record's `cancel_code` says)
    cancelled: ErrorInfo | None = None
    #: the lease was lost (its renewal found it gone): the run is the scheduler's to requeue or fail
    lease_lost: bool = False
    #: the attempt's task was told to stop (cancelled once: a second cancel would interrupt how
    #: it handles the first, and the job's task would end cancelled)
    stopping: bool = False

    def last(self) -> bool:
        """Whether this is the run's last attempt by `max_attempts` (those `unable` not counted)."""
        return int(self.attempt) - self.unable >= self.max_attempts

    def log(self) -> dict[str, str]:
        """`extra` of a log line about this attempt: where it ran too, whatever its message says."""
        return run_fields(self.run_id, self.model_id, key=self.key, provider=self.provider_id)


def _count(record: dict[str, bytes], field: str, default: int) -> int:
    """A count of the run's record (`max_attempts`, `unable`), or `default` where it has none."""
    raw = record.get(field, b"")
    return int(raw) if raw.isdigit() else default


def _elsewhere(record: dict[str, bytes]) -> frozenset[str]:
    """The providers the run never goes back to after a 5xx, a 429 or a redirect (the record's
    `elsewhere`). A record that an older worker wrote, a rolling upgrade half done, holds the flag '1'
    instead, which said only that one of the providers tried answered so (a newer worker's `finish`
    adds its provider after it: '1,b'): every provider tried, then, as that worker kept a refusal as
    unable from sending the run back to any of them. (A provider named '1' is in `tried` too.)"""
    ids = id_set(record.get("elsewhere"))
    return ids | id_set(record.get("tried")) if "1" in ids else ids


#: What an attempt showed about its provider's health, for the `finish` script:
#: (kind: 'ok' | 'fail' | '', strikes, what failed).
Evidence = tuple[str, int, str]
NO_EVIDENCE: Evidence = ("", 0, "")
ALIVE: Evidence = ("ok", 0, "")


def evidence_of(exc: ProviderError) -> Evidence:
    if exc.strikes is None:
        return NO_EVIDENCE
    return ALIVE if exc.strikes == 0 else ("fail", exc.strikes, exc.message)


def _lost(att: Attempt) -> None:
    """Count an attempt whose end was not recorded: its lease went, and its run went on without it."""
    metrics.runs(att.model_id, att.provider_id, "lost").inc()


def suspect(info: ErrorInfo) -> bool:
    """Whether a failed attempt says something of its provider, should another provider serve the
    run (`common.scripts.BLAME`): a 5xx, a timeout, a broken or garbled answer, a redirect, a 409 (a
    state of the server's: Lemonade with every slot pinned answers every run of the model so, and
    keeps its slots free: unblamed, it was every run's first try); not a busy provider (429, 503),
    nor another 4xx (the caller's request, or one this provider's adapter cannot carry). (Nor a
    failure that takes the provider down at once, a refused connection: `_fail`; a server restarted
    after it was benched for 30 s more.)"""
    return info.code in (ErrorCode.PROVIDER_ERROR, ErrorCode.PROVIDER_TIMEOUT) and (
        info.status is None or info.status == CONFLICT
        or (not busy(info.status, info.message) and not 400 <= info.status < 500))


def _partial_usage(att: Attempt) -> tuple[int, int]:
    """(prompt, completion) tokens of a stream that ended after output but before its usage came
    (its caller left, it was cancelled, the provider broke off, it timed out): the provider's last
    usage if its stream carried one (vLLM's `continuous_usage_stats`), and at least one completion
    token for each output chunk the caller got (what most servers send a chunk). Without it such a
    run counted none: a caller that left just before the end had its tokens for nothing. Its
    completion tokens are those of the usage read with output that went out: a read that did not
    (an unpaced provider's last, hundreds of chunks and the whole answer's usage, read as a cancel
    came) counted every token of the answer, not the chunks its caller got."""
    prompt = token_counts(att.usage_seen)[0] if att.usage_seen else 0
    completion = token_counts(att.usage_sent)[1] if att.usage_sent else 0
    return prompt, max(completion, att.out_chunks)


def cannot_carry(provider_id: str, exc: Unpackable) -> ProviderError:
    """A provider's answer holding what msgpack cannot (an integer beyond 64 bits, a lone
    surrogate): it would fail the same way anywhere, so it is not tried again."""
    return ProviderError(f"provider {provider_id} sent an answer iop cannot carry: {exc}", retry=Retry.NO, strikes=0,
                         repeats=True)


def plain_text(text: str) -> str:
    """`text` as valid Unicode (a lone surrogate written as its escape, `\\ud800`): Redis takes
    it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def carried(info: ErrorInfo) -> ErrorInfo:
    """`info` without what msgpack cannot hold: the provider's error object is left out and its
    text made valid Unicode."""
    detail = info.detail
    try:
        pack(detail)
    except Unpackable:
        detail = None
    return replace(info, message=plain_text(info.message), detail=detail)


def _noop(provider_id: str) -> None:
    return None


def _refused(field: str) -> re.Pattern[str]:
    """How a server says it does not know a request's `field` (Azure OpenAI before 2024-06:
    "Unrecognized request argument supplied: stream_options"; pydantic's, as Mistral answers:
    `"type": "extra_forbidden", "loc": ["body", "max_completion_tokens"]`, "Extra inputs are not
    permitted")."""
    return re.compile(r"(unrecognized|unknown|unexpected|extra|not permitted|not allowed|unsupported)"
                      rf"[^.]{{0,60}}\b{field}\b", re.IGNORECASE)


_REFUSED_STREAM_OPTIONS = _refused("stream_options")
_REFUSED_MAX_COMPLETION_TOKENS = _refused("max_completion_tokens")


def refuses_stream_options(exc: ProviderError) -> bool:
    """The provider may have refused the request for its `stream_options`: a 400 or 422 whose
    `param` is it, or whose message says it does not know it. (A caller may put that text in an
    error too: the fallback is kept for the provider only once a request without them succeeded.)"""
    param = exc.detail.get("param") if exc.detail else None
    return exc.status in (400, 422) and (param == "stream_options"
                                         or bool(_REFUSED_STREAM_OPTIONS.search(own_words(exc.message))))


def refuses_max_completion_tokens(exc: ProviderError) -> bool:
    """The provider refused the request's `max_completion_tokens` as a field it does not know (Mistral:
    a 422 `extra_forbidden`, the older name `max_tokens` being the one it takes): a 400 or 422 whose
    message says so. (Not one that only names it as its `param`: a value too large is the caller's, and
    a reasoning model of OpenAI's refuses the other name.)"""
    return exc.status in (400, 422) and bool(_REFUSED_MAX_COMPLETION_TOKENS.search(own_words(exc.message)))


#: How OpenAI's reasoning models refuse `max_tokens` ("Unsupported parameter: 'max_tokens' is not
#: supported with this model. Use 'max_completion_tokens' instead.", `param` and `code` saying so too).
_REFUSED_MAX_TOKENS = re.compile(r"\bmax_tokens'? is not supported[^.]{0,40}\. use '?max_completion_tokens\b",
                                 re.IGNORECASE)


def refuses_max_tokens(exc: ProviderError) -> bool:
    """The provider refused the request's `max_tokens` as a name it does not take for the model: a 400
    whose `param` is it and `code` `unsupported_parameter`, or whose message says to use
    `max_completion_tokens` instead. (A limit it found too large, a 400 naming `max_tokens` too, is not
    this: that is the caller's answer.)"""
    detail = exc.detail or {}
    return exc.status == 400 and (
        (detail.get("param") == "max_tokens" and detail.get("code") == "unsupported_parameter")
        or bool(_REFUSED_MAX_TOKENS.search(exc.message)))


class Runner:
    def __init__(self, redis: Redis, config: Config, node_id: str, adapters: dict[str, Adapter],
                 on_strike: Callable[[str], None] = _noop, on_life: Callable[[str], None] = _noop,
                 comeback: Comeback | None = None) -> None:
        """`on_strike` / `on_life` hear of a provider's failure / sign of life once it is recorded
        (the heartbeats judge its health again). `comeback`: the worker's watch for Redis answering
        again, which cuts short the pauses of a run's writes through an outage."""
        self.redis = redis
        self.comeback = comeback
        self.config = config
        self.node_id = node_id
        self.adapters = adapters
        self.on_strike = on_strike
        self.on_life = on_life
        self.scripts = Scripts(redis)
        #: run id -> (attempt, the task executing it), for cancellation
        self.running: dict[str, tuple[Attempt, asyncio.Task[Any]]] = {}
        #: run id -> when (`time.monotonic()`) a cancel of it was heard while it did not run here (yet),
        #: oldest first (`heard_cancel`)
        self.cancels_heard: dict[str, float] = {}
        #: providers that refused the `stream_options` iop adds: their streams go without it
        self.no_stream_options: set[str] = set()
        #: (provider, served model) that refused `max_tokens`: their chat requests name the limit
        #: `max_completion_tokens` (`completion_tokens_named`)
        self.completion_tokens_only: set[tuple[str, str]] = set()
        #: (provider, served model) that refused `max_completion_tokens`: their chat requests name the
        #: limit `max_tokens` (`max_tokens_only`)
        self.max_tokens_only: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ entry
    def start_args(self) -> list[Any]:
        """The `start` / `take` scripts' arguments after the run's own (see common.scripts)."""
        rt = self.config.runtime
        return [rt.lease_ttl_ms, rt.run_ttl_s, WORKER_ID, pack(CANCELLED.to_wire()), keys.SCHEDULER_SIGNALS]

    async def execute(self, run_id: str) -> str:
        """Start one dispatched run and run it; returns how it ended (for logs and tests)."""
        reply = await self.scripts.call("start", [keys.run_record(run_id), keys.run_events(run_id)],
                                        [run_id, *self.start_args(), keys.leases("")])
        return await self.run(run_id, reply)

    async def run(self, run_id: str, started: list[bytes]) -> str:
        """Run a run the `start` or `take` script answered for (`started`: its status, then its
        record's fields and values)."""
        status: str = started[0].decode()
        if status != "ok":
            # (cancelled: its caller left between its dispatch and its start, as callers do)
            (log.info if status == "cancelled" else log.warning)("not started (%s)", status,
                                                                  extra=run_fields(run_id, None))
            return status
        record = {started[i].decode(): started[i + 1] for i in range(1, len(started) - 1, 2)}
        provider_id = record["provider"].decode()
        model_id = record["model"].decode()
        model = self.config.model(model_id)
        adapter = self.adapters.get(provider_id)
        if model is None or adapter is None:
            # The scheduler's config and this worker's differ (a rollout of a new one half done): the
            # run goes back to its queue, as a lost one would, while it has attempts left.
            why = (f"model {model_id!r} is not in the config of node {self.node_id}'s worker" if model is None else
                   f"provider {provider_id} is not on node {self.node_id} in its worker's config")
            log.error("%s (its config and the scheduler's differ)", why, extra=run_fields(run_id, model_id))
            att = Attempt(run_id, model_id, provider_id, record["attempts"].decode(),
                          _count(record, "max_attempts", 1), unable=_count(record, "unable", 0))
            return await self._fail(att, ErrorInfo(ErrorCode.UNAVAILABLE, why), Retry.ANY)  # (no suspect: `suspect`)
        policy = self.config.queue_for(model)
        # (the run's own `max_attempts`, as its queueing wrote it, not this worker's config: the start of
        # its last attempt by that limit took its body out of the record (`_START`), and the reaper
        # counts by it; in a rollout of a new limit a worker of 3 put back a run queued with 1, and its
        # next attempt had no body, a KeyError; '1' where the record has none, as `_START` reads it)
        att = Attempt(run_id, model_id, provider_id, record["attempts"].decode(), _count(record, "max_attempts", 1),
                      id_set(record.get("tried")), record.get("key", b"-").decode(),
                      refuse=id_set(record.get("refuse")), unable=_count(record, "unable", 0),
                      unable_by=id_set(record.get("unable_by")), elsewhere=_elsewhere(record))
        task = asyncio.current_task()
        assert task is not None
        self.running[run_id] = (att, task)
        # (a cancel heard before now, while its start's answer was on its way here: its lease is renewed
        # at once, which reads the run's cancel flag, not a renewal period later)
        renewer = asyncio.create_task(self._renew(att, task, at_once=self._heard_before(run_id)))
        began = time.monotonic()
        try:
            return await self._attempt(att, adapter, record, policy.execution_timeout_ms / 1000, model.max_tokens)
        except Exception as exc:  # ending the attempt failed itself: a last try, else the lease's reaper
            log.exception("the run's end failed", extra=att.log())
            info = ErrorInfo(ErrorCode.PROVIDER_ERROR,
                             f"provider {provider_id}: the worker failed ending the run ({type(exc).__name__})",
                             before_output=not att.output)
            try:
                return await self._finish(att, RunState.FAILED, EventType.FAILED, info.to_wire(), info)
            except Exception as again:
                log.error("the run's end could not be recorded (%s); its lease will expire", type(again).__name__,
                          extra=att.log())
                _lost(att)
                return "unrecorded"
        finally:
            renewer.cancel()
            metrics.run_seconds(model_id, provider_id).observe(time.monotonic() - began)
            self.running.pop(run_id, None)

    async def why_cancelled(self, run_id: str) -> ErrorInfo:
        """Why the run was cancelled, as its record says (the caller went away, a DELETE of the
        runs API: `cancelled`; its caller's gateway gone: `service_unavailable`); a record without
        a reason (written by an earlier version): by the caller."""
        try:  # (a record of another type, written by hand, says no reason)
            reason, code = await read_or(self.redis.hmget(keys.run_record(run_id), ["cancel_reason", "cancel_code"]),
                                         [None, None])
        except REDIS_UNUSABLE:
            reason = code = None
        if not reason:
            return CANCELLED
        return ErrorInfo.from_wire({"code": (code or b"cancelled").decode(errors="replace"),
                                    "message": reason.decode(errors="replace")})

    def heard_cancel(self, run_id: str) -> None:
        """The node's cancel of a run this worker does not run, heard: every worker of the node hears
        each, and the `take` of this one may have started the run already, its answer on its way back
        (or the run's task waiting for its previous attempt's task here to end). Kept for a lease's life
        (a run not begun by then is reaped), at most `MAX_CANCELS_HEARD`: a run that begins here meanwhile
        renews its lease at once (`run`), which reads its cancel flag. (Dropped, such a cancel left the
        provider generating for nobody, its slot held, until the first renewal, `lease_ttl_ms` / 3.)"""
        heard, now = self.cancels_heard, time.monotonic()
        heard.pop(run_id, None)
        heard[run_id] = now
        oldest = now - self.config.runtime.lease_ttl_ms / 1000
        while heard:  # (the oldest first: those a lease's life old, and those past the most kept)
            early = next(iter(heard))
            if heard[early] >= oldest and len(heard) <= MAX_CANCELS_HEARD:
                break
            del heard[early]

    def _heard_before(self, run_id: str) -> bool:
        """Whether a cancel of the run was heard before it began here, within a lease's life."""
        at = self.cancels_heard.pop(run_id, None)
        return at is not None and time.monotonic() - at <= self.config.runtime.lease_ttl_ms / 1000

    def cancel(self, run_id: str, why: ErrorInfo) -> bool:
        """Cancel a run this worker runs, once (a cancel message and the lease's renewal may both
        say so), and not while it records its end (a cancel raised into that would end the job's
        task cancelled, the run left to its lease; a run requeued then ends at its next start, its
        record's cancel flag says so); the run's next attempt, should it begin here, hears it too
        (`heard_cancel`). Returns whether it runs here."""
        entry = self.running.get(run_id)
        if entry is None:
            return False
        att, task = entry
        # (kept too: the attempt may be ending, or have lost its lease, and the run's next attempt be on
        # its way here; a run whose cancel was asked never goes on elsewhere, `drop_queued`)
        self.heard_cancel(run_id)
        if att.cancelled is None and not att.stopping:
            att.cancelled = why
            _stop(att, task)
        return True

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, att: Attempt, adapter: Adapter, record: dict[str, bytes], timeout_s: float,
                       cap: int | None) -> str:
        """`cap`: the model's `max_tokens`, for a request that asks for no limit."""
        kind = RunKind(record["kind"].decode())
        body = unpack(record["body"])
        body["model"] = record["target"].decode()
        capped = cap is not None and kind is not RunKind.EMBEDDING and token_cap.with_cap(body, cap, kind)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._answer(att, adapter, kind, body, record.get("stream") == b"1", capped)
        except ProviderError as exc:
            if exc.code is ErrorCode.PROVIDER_TIMEOUT:  # (silent: it may still generate, for nobody now)
                await self._gave_up(att, record)
            info = ErrorInfo(exc.code, exc.message, status=exc.status, detail=exc.detail,
                             before_output=not att.output, retry_after_s=exc.retry_after_s,
                             repeats=exc.repeats)
            # (a run that goes on without using up an attempt: its body again for a next one, where the
            # start of what was its last attempt deleted it from the record, `_START`)
            again_body = record["body"] if exc.retry is Retry.UNABLE and att.last() else b""
            return await self._fail(att, info, exc.retry, evidence_of(exc), body=again_body)
        except OutputTooLarge as exc:
            info = ErrorInfo(ErrorCode.OUTPUT_TOO_LARGE, str(exc), before_output=not att.output)
            return await self._fail(att, info, Retry.NO)
        except CancelledBeforeOutput as exc:
            att.cancelled = exc.info  # (now: a cancel message coming meanwhile must not cancel the job's task)
            log.info("cancelled before its output went out: %s", exc.info.message, extra=att.log())
            return await asyncio.shield(self._finish(att, RunState.CANCELLED, EventType.FAILED, exc.info.to_wire(),
                                                     exc.info))
        except TimeoutError:
            await self._gave_up(att, record)
            info = ErrorInfo(ErrorCode.EXECUTION_TIMEOUT,
                             f"the run did not finish within {int(timeout_s * 1000)} ms", before_output=not att.output)
            return await self._fail(att, info, Retry.NO)
        except LeaseLost:
            log.warning("lease lost, abandoning", extra=att.log())
            _lost(att)
            return "lease_lost"
        except asyncio.CancelledError:
            if att.lease_lost:  # the reaper requeues the run or fails it with worker_lost
                self._uncancel()
                log.warning("lease lost, abandoning", extra=att.log())
                _lost(att)
                return "lease_lost"
            if att.cancelled is None:  # the worker itself is shutting down
                info = ErrorInfo(ErrorCode.WORKER_LOST, "the worker shut down during the run",
                                 before_output=not att.output)
                await asyncio.shield(self._fail(att, info, Retry.ANY))
                raise
            self._uncancel()  # a cancelled run is an outcome, not the job's cancellation
            await asyncio.shield(self._gave_up(att, record))
            info = ErrorInfo(att.cancelled.code, att.cancelled.message, before_output=not att.output)
            return await asyncio.shield(self._finish(att, RunState.CANCELLED, EventType.FAILED, info.to_wire(), info))
        except Exception as exc:
            # Anything else (a bug, or an answer nothing above foresaw, such as JSON nested too
            # deep to parse) fails the run, not the worker: an exception leaving the job's task
            # would end the worker's loop, and the requeued run would take the next worker down.
            # Not tried again: the provider's answer would fail the same way anywhere.
            log.exception("the run failed on an unexpected error", extra=att.log())
            info = ErrorInfo(ErrorCode.PROVIDER_ERROR,
                             f"provider {att.provider_id}: the worker could not handle its answer "
                             f"({type(exc).__name__})", before_output=not att.output, repeats=True)
            return await self._fail(att, info, Retry.NO)

    async def _answer(self, att: Attempt, adapter: Adapter, kind: RunKind, body: dict[str, Any], stream: bool,
                      capped: bool = False) -> str:
        """Ask the provider and record its answer (`_answer_named`). A request given the model's cap
        (`capped`: it asked for none) that the provider refuses as passing its context (SGLang: prompt
        and limit together) is asked again with the cap cut to the room it said it has
        (`token_cap.fitted`, at most `REFITS` times): the caller asked no limit, and got a 400 for the cap."""
        for _ in range(REFITS if capped else 0):
            try:
                return await self._answer_named(att, adapter, kind, body, stream)
            except ProviderError as exc:
                smaller = token_cap.fitted(body, exc.message) if exc.status == 400 and not att.output else None
                if smaller is None:
                    raise
            log.info("provider %s has no room for the model's max_tokens cap with this prompt; asked again with "
                     "the room it has, %s", att.provider_id, smaller["max_tokens"], extra=att.log())
            body = smaller
        return await self._answer_named(att, adapter, kind, body, stream)

    async def _answer_named(self, att: Attempt, adapter: Adapter, kind: RunKind, body: dict[str, Any],
                            stream: bool) -> str:
        """Ask the provider and record its answer. A chat request whose `max_tokens` (the caller's, a
        Response's `max_output_tokens`, or the model's cap) the provider refuses for the served model
        (OpenAI's reasoning models take only `max_completion_tokens`) is asked again with the limit
        under that name at once, and so from then on for that model (`refuses_max_tokens`); and one
        whose `max_completion_tokens` (the official clients' name) it does not know (Mistral's 422) with
        the limit as `max_tokens` (`refuses_max_completion_tokens`)."""
        served = (att.provider_id, str(body.get("model")))
        if kind is RunKind.CHAT and served in self.completion_tokens_only:
            body = completion_tokens_named(body)
        elif kind is RunKind.CHAT and served in self.max_tokens_only:
            body = max_tokens_only(body)
        try:
            return await self._answer_once(att, adapter, kind, dict(body), stream)
        except ProviderError as exc:
            if kind is not RunKind.CHAT or att.output:
                raise
            if "max_tokens" in body and refuses_max_tokens(exc):
                renamed, seen, name = completion_tokens_named(body), self.completion_tokens_only, \
                    "max_completion_tokens"
            elif "max_completion_tokens" in body and refuses_max_completion_tokens(exc):
                renamed, seen, name = max_tokens_only(body), self.max_tokens_only, "max_tokens"
            else:
                raise
        if served not in seen:
            log.warning("provider %s refused the limit's name for %s; its chat requests for that model name the "
                        "limit %s", att.provider_id, served[1], name, extra=att.log())
            seen.add(served)
        return await self._answer_once(att, adapter, kind, renamed, stream)

    async def _answer_once(self, att: Attempt, adapter: Adapter, kind: RunKind, body: dict[str, Any],
                           stream: bool) -> str:
        if stream:
            return await self._stream(att, adapter, kind, body)
        response = await adapter.complete(kind, body, att.run_id)
        return await self._finish(att, RunState.COMPLETED, EventType.COMPLETED, {"response": response},
                                  evidence=ALIVE, usage=token_counts(fixed_usage(response)))

    @staticmethod
    def _uncancel() -> None:
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()

    async def _stream(self, att: Attempt, adapter: Adapter, kind: RunKind, body: dict[str, Any]) -> str:
        """Stream the run's output as `delta` events. The provider is asked for usage whether the
        caller asked or not (it is counted for the caller's key); a caller that did not ask gets
        the chunks without it. A provider that refuses the `stream_options` the caller did not
        send, or sent only to ask for usage (every Responses stream does: a hosted API refusing them
        answered those 400), is asked again without them, and from then on (an older Azure OpenAI)."""
        wanted = wants_usage(body)
        # (a caller's own {"include_usage": true} is what iop sends anyway: a Responses stream's, say)
        added = body.get("stream_options") in (None, {"include_usage": True})
        if added and att.provider_id in self.no_stream_options:
            body.pop("stream_options", None)
        else:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        try:
            usage, last = await self._stream_reads(att, adapter.stream(kind, body, att.run_id), wanted)
        except ProviderError as exc:
            if not (added and "stream_options" in body and refuses_stream_options(exc)) or att.output:
                raise
            del body["stream_options"]
            usage, last = await self._stream_reads(att, adapter.stream(kind, body, att.run_id), wanted)
            if att.provider_id not in self.no_stream_options:  # (it took the request without them)
                log.warning("provider %s refused the stream_options iop adds to ask for usage; its streams go "
                            "without them (their runs count a completion token an output chunk, and no prompt "
                            "tokens)", att.provider_id, extra=att.log())
                self.no_stream_options.add(att.provider_id)
        # (a stream that carried no usage, as llama-cpp-python's: its output chunks, as `_partial_usage`
        # counts them; it counted none, less than a caller who left before its end)
        counted = token_counts(usage) if usage is not None else (
            0, att.out_chunks + sum(map(carries_output, last)))
        return await self._finish(att, RunState.COMPLETED, EventType.COMPLETED, {}, evidence=ALIVE,
                                  usage=counted, last=last)

    async def _stream_reads(self, att: Attempt, reads: AsyncIterator[list[dict[str, Any]]],
                            wanted: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Returns the last usage object read, and the stream's last output, which goes out with the
        run's end (one Redis call, and one event fewer to wake the caller's gateway for)."""
        if self.config.runtime.stream_batch_ms:
            return await self._stream_batched(att, Pump(reads, wanted, MAX_OPENING),
                                              self.config.runtime.stream_batch_ms / 1000)
        return await self._stream_each(att, reads, wanted)

    async def _stream_each(self, att: Attempt, reads: AsyncIterator[list[dict[str, Any]]],
                           wanted: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Each read goes out as it comes, but those the adapter marks as its last (`LastRead`): they
        go with the run's end (unless `MAX_OPENING` chunks wait)."""
        usage = None
        # Opening chunks (a bare `role` delta) wait for the first real output: a stream cut short
        # before it has shown the caller nothing and may be tried again.
        # (no more than MAX_OPENING of them: so many are output, they must not pile up)
        held: list[dict[str, Any]] = []
        try:
            async for chunks in reads:
                usage = usage_in(chunks) or usage
                held += chunks if wanted else without_usage(chunks)
                if held and (att.output or shows_output(held, MAX_OPENING)) and (
                        not isinstance(chunks, LastRead) or len(held) >= MAX_OPENING):
                    out, held = held, []
                    await self._emit(att, EventType.DELTA, {"chunks": out})
                    att.output, att.usage_sent = True, usage
        except ProviderError:  # (found after the last read: what it held reaches the caller first)
            if held and (att.output or shows_output(held, MAX_OPENING)):
                await self._emit(att, EventType.DELTA, {"chunks": held})
                att.output, att.usage_sent = True, usage
            raise
        finally:
            att.usage_seen = usage
            await close_reads(reads)
        return usage, held

    async def _stream_batched(self, att: Attempt, pump: Pump,
                              batch_s: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """`runtime.stream_batch_ms`: the first output goes out at once; later output at most every
        `batch_s`, what came meanwhile in one event (an event costs every process on its way);
        the end of the stream at once (with the run's end), and what was held when the provider
        failed before its error."""
        loop = asyncio.get_running_loop()
        #: when held output goes out (loop time); None: the next output goes out as it comes
        due: float | None = None
        try:
            while True:
                await pump.ready(due)
                if pump.ended:
                    break
                read_usage, held = pump.usage, pump.take()
                if held:
                    await self._emit(att, EventType.DELTA, {"chunks": held})
                    att.output, att.usage_sent = True, read_usage
                    due = loop.time() + batch_s
                else:  # the window passed with nothing new: the next output goes out as it comes
                    due = None
        finally:
            att.usage_seen = pump.usage
            await pump.close()
        held = pump.take_all()
        # (taken from the pump, and from this frame as it is raised: its traceback holds the frames
        # that would hold it, a cycle that keeps the request and what was read until collected)
        error, pump.error = pump.error, None
        if error is not None:
            try:
                if held and att.output:  # what the provider sent before it failed reaches the caller first
                    await self._emit(att, EventType.DELTA, {"chunks": held})
                    att.usage_sent = pump.usage
                raise error
            finally:
                error = None
        return pump.usage, held

    async def _fail(self, att: Attempt, info: ErrorInfo, retry: Retry, evidence: Evidence = NO_EVIDENCE,
                    body: bytes = b"") -> str:
        """End a failed attempt: put the run back in its queue if another attempt may do better
        and nothing was sent yet, else fail it. A provider that answered with a server error is
        not tried again: the run goes back only if another provider of the model is available. One
        that cannot do what the request asks (`Retry.UNABLE`) used up no attempt: the run goes to
        another provider whatever its attempts, while one it was not tried on is available (so such
        refusals are at most one fewer than the model's providers), with `body` (the record's, if its start
        deleted it) for the next attempt; else, the attempt given back, while one it was tried on
        that did not refuse it so is available (it went there once and failed as a retry may: the
        run avoids it, as after a connection reset, but may go back). A provider that refused it as
        unable (the record's `unable_by`), or that answered it a 5xx, a 429 or a redirect (the
        record's `elsewhere`), is never asked again."""
        att.stopping = True  # (ending: a cancel now is not raised into it, see `cancel`)
        unable = retry is Retry.UNABLE
        again = not att.output and (unable or not att.last()) and (
            retry is Retry.ANY or (retry in (Retry.ELSEWHERE, Retry.UNABLE) and await self._other_available(att)))
        # (a provider that refused it so once more was chosen by a scheduler that does not read `unable_by`,
        # a rollout half done: the run goes back no more, or it could go round between the two for good)
        # (nor to one that answered a 5xx, a 429 or a redirect: those retry the run only on another
        # provider, each at most once, `requeue_elsewhere`)
        back = (unable and not again and not att.output and att.provider_id not in att.unable_by
                and await self._other_available(att, tried=True))
        again = again or back
        # (too busy: left alone for the model as long as it asked, else a second)
        too_busy = busy(info.status, info.message)
        cool_s = (info.retry_after_s or 1) if info.code is ErrorCode.PROVIDER_ERROR and too_busy else 0
        if again:
            # (the finish script takes the job off its node's queue first: the next dispatch
            # queues a job of the same id)
            outcome = await self._finish(att, None, EventType.REQUEUED, info.to_wire(), info, evidence=evidence,
                                         requeue="requeue" if retry is Retry.ANY else "requeue_unable_back" if back
                                         else "requeue_unable" if unable
                                         else "requeue_busy" if too_busy else "requeue_elsewhere",
                                         suspect=suspect(info) and evidence[1] < DOWN, cool_s=cool_s, body=body)
        else:
            outcome = await self._finish(att, RunState.FAILED, EventType.FAILED, info.to_wire(), info,
                                         evidence=evidence, cool_s=cool_s)
        if outcome == "unrecorded":  # (Redis did not answer for as long as the lease could live)
            log.warning("attempt %s failed (%s), and its end could not be recorded: Redis did not answer while its "
                        "lease could live; the scheduler takes the run back when the lease lapses", att.attempt,
                        info.message, extra=att.log())
        elif not outcome.endswith(":ok"):  # (its lease went: the run went on without it; nothing was recorded)
            log.info("attempt %s failed, but its run had gone on without it (%s): %s", att.attempt,
                     outcome.partition(":")[2] or outcome, info.message, extra=att.log())
        elif again and outcome.startswith("requeued"):  # (else it had output it did not know of: `_finish`)
            log.info("attempt %s failed, requeued: %s", att.attempt, info.message, extra=att.log())
        else:
            log.info("failed: %s", info.message, extra=att.log())
        return outcome

    async def _other_available(self, att: Attempt, tried: bool = False) -> bool:
        """Whether another provider of the run's model, one that no attempt went to (`tried`: one an
        earlier attempt went to), never one that refused it (as unable, or its adapter) or answered it a
        5xx, a 429 or a redirect (`elsewhere`), could take it
        now, but for its load: available with the model, not drained or cordoned, capacity above 0 (the
        scheduler's own test, `common.policy.candidate_class`). A run sent back for one that is
        drained would wait there until its queue timeout."""
        model = self.config.model(att.model_id)
        never = att.refuse | att.unable_by | att.elsewhere
        others = {p: served for p, served in (model.providers.items() if model else ())
                  if (p in att.tried) is tried and p not in never and p != att.provider_id}
        if not others:
            return False
        now = now_ms()
        snaps = await read_snapshots(self.redis, others, now, self.config.node_of)
        return any(candidate_class(s, now, self.config.runtime.heartbeat_ttl_ms) is not None for s in snaps)

    async def _gave_up(self, att: Attempt, record: dict[str, bytes]) -> None:
        """A non-stream request given up (its caller left, a cancel, `execution_timeout_ms`, a silence
        of `read_timeout_ms`) while a server whose probe disturbs a run (`PROBE_DISTURBS`:
        llama-cpp-python) generated it: that server goes on for nobody until it is done, and its
        `GET /v1/models` waits for it. Its heartbeat says until when it may (`read_timeout_ms` from
        now, the longest silence iop allows it), and no probe is sent till then (the `probe`
        script), as while it runs iop's runs: one would time out there and strike a busy server
        down. A stream stops at once there."""
        provider = self.config.provider(att.provider_id)  # (its adapter was made from it: `Runner.run`)
        if record.get("stream") == b"1" or provider.type not in PROBE_DISTURBS:
            return
        try:  # (one step: no hash made of this field alone, `common.scripts.MARK_BUSY`)
            await self.scripts.call("mark_busy", [keys.heartbeat(att.provider_id)],
                                    [Field.BUSY_UNTIL_MS, now_ms() + provider.read_timeout_ms])
        except (RedisError, *REDIS_UNUSABLE) as exc:  # (another type written by hand; Redis away: probes as before)
            log.info("could not mark provider %s busy with a run given up (%s)", att.provider_id, exc, extra=att.log())

    # ------------------------------------------------------------------ redis
    async def _emit(self, att: Attempt, etype: EventType, data: dict[str, Any]) -> None:
        """Add an event to the run, within its limits. Rides out a Redis restart
        (`_call_while_leased`). A delta larger than `EVENT_BYTES` packed goes as several, each of
        about that size (but a single chunk)."""
        rt = self.config.runtime
        # (a delta says its number: a gateway drops one it had, and ends a stream in which one is missing)
        # (and its attempt: a gateway tells the next attempt's first deltas from those written again)
        packed = self._output(att, {**data, "n": att.emitted + 1, "a": int(att.attempt)} if etype is EventType.DELTA
                              else data)
        chunks = data["chunks"] if etype is EventType.DELTA else ()
        if len(packed) > EVENT_BYTES and len(chunks) > 1:  # (in parts of about EVENT_BYTES, in order)
            parts = min(len(chunks), -(-len(packed) // EVENT_BYTES))
            del packed
            for i in range(parts):
                await self._emit(att, etype, {**data, "chunks": chunks[i * len(chunks) // parts:
                                                                     (i + 1) * len(chunks) // parts]})
            return
        # (chunks of output only: an opening, a choice's finish or a usage alone is none; each choice's
        # opening and finish counted a token, 7 for a stream of n=2 with 4 tokens; recorded with the
        # emit, for a worker lost after it: `EMIT`)
        out_chunks = att.out_chunks + sum(map(carries_output, chunks))
        args = [att.attempt, etype.value, packed, rt.max_events_per_run, att.run_id, att.emitted + 1,
                out_chunks if etype is EventType.DELTA else ""]
        ok = await self._call_while_leased(att, "emit", [keys.run_record(att.run_id), keys.run_events(att.run_id)],
                                           args, "emitting")
        if isinstance(ok, list):  # (its cancel was recorded before this, its first output: `EMIT`)
            code = ok[2].decode()
            raise CancelledBeforeOutput(ErrorInfo(ErrorCode(code) if code in ErrorCode._value2member_map_
                                                  else ErrorCode.CANCELLED, ok[1].decode()))
        if ok == 2:
            raise self._too_many_events()
        if not ok:
            raise LeaseLost(att.run_id)
        att.emitted += 1
        att.output_bytes += len(packed)
        att.out_chunks = out_chunks

    def _output(self, att: Attempt, data: dict[str, Any]) -> bytes:
        """An event's data, packed, if the run's output stays within `runtime.max_output_bytes`
        with it."""
        try:
            packed = pack(data)
        except Unpackable as exc:
            raise cannot_carry(att.provider_id, exc) from None
        limit = self.config.runtime.max_output_bytes
        if att.output_bytes + len(packed) > limit:
            raise OutputTooLarge(f"the run's output passed runtime.max_output_bytes ({limit} bytes)")
        return packed

    def _too_many_events(self) -> OutputTooLarge:
        limit = self.config.runtime.max_events_per_run
        return OutputTooLarge(f"the run's output passed runtime.max_events_per_run ({limit} events)")

    async def _finish(self, att: Attempt, state: RunState | None, etype: EventType, data: dict[str, Any],
                      info: ErrorInfo | None = None, *, evidence: Evidence = NO_EVIDENCE,
                      requeue: str = "requeue", usage: tuple[int, int] = (0, 0),
                      last: list[dict[str, Any]] | None = None, suspect: bool = False, cool_s: int = 0,
                      body: bytes = b"") -> str:
        """state None = requeue (`requeue` says how; `suspect`: the failure says something of the
        provider, `common.scripts.BLAME`; `cool_s`: the provider asked to be left alone that long, it
        is benched for the model so long). Records `evidence` of the provider's health,
        and `usage` (prompt, completion tokens the caller got) for its key. Rides out a Redis
        restart (`_call_while_leased`): a slot must come back. A provider's answer (`data`) that
        msgpack cannot hold fails the run instead, with why. `last`: a completed stream's last
        chunks, added as a `delta` event before the end (within the run's limits: else
        OutputTooLarge or the ProviderError of `cannot_carry` is raised, and nothing recorded).
        `body`: the run's, put back in its record by a requeue that uses up no attempt."""
        delta = self._output(att, {"chunks": last, "n": att.emitted + 1, "a": int(att.attempt)}) if last else b""
        if state is RunState.COMPLETED and etype is EventType.COMPLETED and "response" not in data:
            # (the stream's last number, `_emit`; 0 for one that had none: it was left out, and the README
            # says a streamed run's `completed` says how many there were)
            data = {**data, "deltas": att.emitted + (1 if last else 0)}
        if att.output and state is not None and state is not RunState.COMPLETED and usage == (0, 0):
            usage = _partial_usage(att)
        kind, strikes, reason = evidence
        try:
            packed = pack(data)
        except Unpackable as exc:
            if info is None:  # a completion's response: the caller gets why it has none
                info = ErrorInfo(ErrorCode.PROVIDER_ERROR, cannot_carry(att.provider_id, exc).message,
                                 before_output=not att.output, repeats=True)
                state, etype, usage = RunState.FAILED, EventType.FAILED, (0, 0)
                log.info("failed: %s", info.message, extra=att.log())
            else:  # an error holding the provider's own object or text
                info = carried(info)
            packed = pack(info.to_wire())
        # (its end as it reads once output went out: FINISH writes that when the record says some did where
        # this attempt did not hear so, the cancel or timeout that ends it having interrupted an emit Redis ran)
        after = pack({**unpack(packed), "before_output": False}) if (
            info is not None and info.before_output and state in (RunState.FAILED, RunState.CANCELLED, None)) else b""
        if "response" in data and len(packed) > self.config.runtime.max_output_bytes:
            # (a whole answer is output too: one of 14 MB with log probabilities was 70 MB as OpenAI's, kept
            # in Redis for run_ttl_s)
            raise OutputTooLarge(f"the run's output passed runtime.max_output_bytes "
                                 f"({self.config.runtime.max_output_bytes} bytes)")
        att.stopping = True  # (ending: a cancel now is not raised into it, see `cancel`)
        args = [att.run_id, state.value if state else requeue, etype.value, packed,
                self.config.runtime.run_ttl_s, keys.scheduler_channel(""), att.model_id,
                info.code.value if info else "", info.message if info else "", att.attempt, kind, strikes,
                plain_text(reason), *(min(n, MAX_COUNTED_TOKENS) for n in usage), self._fresh_ms(att.provider_id),
                delta, self.config.runtime.max_events_per_run, "1" if suspect else "",
                self._served(att.model_id, att.provider_id) if state is RunState.COMPLETED or cool_s else "",
                cool_s * 1000, body, after]
        run_keys = [keys.run_record(att.run_id), keys.leases(att.provider_id), keys.run_events(att.run_id),
                    keys.runs_stream(att.model_id), keys.heartbeat(att.provider_id), keys.node_queue(self.node_id),
                    keys.arq_in_progress(att.run_id),
                    *(keys.runs_stream(m) for m in self.config.models_of(att.provider_id))]
        try:
            result = await self._call_while_leased(att, "finish", run_keys, args, "recording its end")
        except LeaseLost:
            _lost(att)
            return "unrecorded"  # the lease expires and the scheduler reaps the run
        if result == b"too_many":  # (its last output would pass max_events_per_run: nothing was recorded)
            raise self._too_many_events()
        if result == b"failed_after_output":
            # (its output had gone out, an emit Redis ran whose reply this attempt never read: the run is
            # not put back in its queue but failed, before_output false, as the reaper ends one)
            log.info("the run failed, not requeued: its output had begun to go out", extra=att.log())
            state, result = RunState.FAILED, b"ok"
        if result in (b"cancel_asked", b"cancelled") and state is not RunState.CANCELLED:
            # (its cancel was recorded before this worker heard of it: the run ended so, not as this attempt
            # would have; `cancelled`: it had, when a lost reply made this call again, or the reaper)
            log.info("the run ended cancelled: its cancel was recorded before this worker heard of it",
                     extra=att.log())
            state = RunState.CANCELLED
        if result in (b"ok", b"cancel_asked", b"cancelled"):
            metrics.runs(att.model_id, att.provider_id, state.value if state else "requeued").inc()
        else:  # (`stale` and the like: the run went on without this attempt, its lease reaped)
            _lost(att)
        if kind == "fail":
            self.on_strike(att.provider_id)
        elif kind == "ok":
            self.on_life(att.provider_id)
        if state is RunState.COMPLETED and result == b"ok" and att.tried - {att.provider_id}:
            await self._blame(att)
        return f"{state.value if state else 'requeued'}:{result.decode()}"

    def _served(self, model_id: str, provider_id: str) -> str:
        """The model's served name at the provider ('' if the config has none)."""
        model = self.config.model(model_id)
        return model.providers.get(provider_id, "") if model else ""

    async def _blame(self, att: Attempt) -> None:
        """The run was served here after it failed elsewhere: the providers it failed on for
        reasons of theirs (the record's `suspects`) are blamed for its model, and benched for it
        after `BLAME_RUNS` runs in a row (`common.scripts.BLAME`; one call, only for a run that was
        tried again)."""
        bench_ms = self.config.runtime.bench_ms
        model = self.config.model(att.model_id)
        # (a bench is kept per served name, and every model served there under that name reads it: a
        # model that the provider alone serves so would be cut off by another's blame, which never
        # benches a model's only provider for it; that name there is blamed by none)
        alone = {pair for m in self.config.models if len(m.providers) == 1 for pair in m.providers.items()}
        others = {p: served for p, served in sorted(model.providers.items() if model else ())
                  if p in att.tried and p != att.provider_id and (p, served) not in alone}
        if not bench_ms or not others:
            return
        try:
            benched = await self.scripts.call(
                "blame", [keys.run_record(att.run_id), *(keys.heartbeat(p) for p in others)],
                [BLAME_RUNS, bench_ms, *(x for pair in others.items() for x in pair)])
        except REDIS_UNUSABLE as exc:  # (evidence lost, not the run: it is recorded already)
            log.warning("Redis unavailable while blaming %s (%s)", ", ".join(others), exc, extra=att.log())
            return
        for provider in benched:
            log.warning("provider %s is benched for model %s for %g s: %d runs of it in a row failed there and "
                        "another provider served them", provider.decode(), att.model_id, bench_ms / 1000,
                        BLAME_RUNS, extra=att.log())

    def _fresh_ms(self, provider_id: str) -> int:
        """How old a provider's last sign of life may be before a run's end writes a new one: a
        quarter of its probe interval (so a provider serving runs is never probed), at most 1 s."""
        try:
            interval = self.config.provider(provider_id).probe_interval_ms or self.config.runtime.probe_interval_ms
        except KeyError:  # (a provider this worker's config lacks: a run it was handed by mistake)
            interval = self.config.runtime.probe_interval_ms
        return min(1000, interval // 4)

    async def _call_while_leased(self, att: Attempt, script: str, run_keys: list[str], args: list[Any],
                                 doing: str) -> Any:
        """Run one of the attempt's scripts, riding out a Redis restart for as long as the lease
        could live; past that it is reaped anyway, and LeaseLost is raised. A full Redis is waited
        out for as long as it lasts: the lease's renewals go through meanwhile (the run's own
        timeouts and a cancel still end it)."""
        backoff = Backoff(cap=1.0)
        give_up = time.monotonic() + self.config.runtime.lease_ttl_ms / 1000
        # (its first failure of each kind is a WARNING, the tries after it DEBUG: every running run logged
        # each try, 14-17 lines a second from a worker of 12 streams while Redis was down or read-only)
        said: set[str] = set()
        while True:
            try:
                return await self.scripts.call(script, run_keys, args)
            except REDIS_FULL as exc:
                log.log(_first(said, "full"), "Redis is full while %s (%s); retrying", doing, exc, extra=att.log())
                await backoff.pause()
                give_up = time.monotonic() + self.config.runtime.lease_ttl_ms / 1000  # (renewed meanwhile)
            except REDIS_UNUSABLE as exc:
                if time.monotonic() > give_up:
                    raise LeaseLost(att.run_id) from exc
                log.log(_first(said, "away"), "Redis unavailable while %s (%s); retrying", doing, exc,
                        extra=att.log())
                # (cut short when Redis answers again: the run's output is not held back up to 1 s)
                await pause_on(self.comeback, backoff)

    async def _renew(self, att: Attempt, task: asyncio.Task[Any], at_once: bool = False) -> None:
        """Renew the attempt's lease every third of it (`at_once`: the first time now)."""
        rt = self.config.runtime
        period = rt.lease_ttl_ms / 3000
        said: set[str] = set()  # (a WARNING at its first failure, DEBUG after: as _call_while_leased)
        while True:
            if not at_once:
                await asyncio.sleep(period)
            at_once = False
            backoff = Backoff(cap=1.0)
            while True:
                try:
                    renewed = await self.scripts.call(
                        "renew", [keys.leases(att.provider_id), keys.run_record(att.run_id)],
                        [att.run_id, rt.lease_ttl_ms, att.attempt, att.out_chunks if att.output else ""])
                    break
                except REDIS_UNUSABLE as exc:
                    log.log(_first(said, "renew"), "lease renewal failed (%s)", exc, extra=att.log())
                    # Made again once Redis answers, not a period later: a lease with less than a
                    # period left when Redis came back expired meanwhile, and was reaped from a live run.
                    await pause_on(self.comeback, backoff)
            if renewed != 1:
                if renewed:  # it was cancelled (a cancel message was lost, or is being handled now)
                    self.cancel(att.run_id, await self.why_cancelled(att.run_id))
                elif not att.stopping:
                    att.lease_lost = True
                    _stop(att, task)
                return
