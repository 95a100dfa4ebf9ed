"""The scheduler: takes runs from the model streams and dispatches each model's head run.

One replica owns the runs it read through the consumer group. For the head run of each
model it reads provider snapshots, asks the pure policy for a provider, and calls the
`dispatch` script, which checks that the run is still the head of its stream, applies the
same policy to the live state, reserves the slot on the provider it picks and queues the job
in one atomic step. A run that finds no slot waits; the scheduler is woken at once when a
slot frees (pub/sub) and fails runs that waited `queue_timeout_ms`.

Replicas announce themselves with a liveness key; a replica whose key expired has its
waiting runs claimed by the others. Expired leases (a worker died) are reaped here too.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.codec import entry_key, pack, unpack
from common.comeback import Comeback
from common.config import Config, ModelConfig
from common.policy import ProviderSnapshot, all_refused, candidate_class, retry_after_s, select_provider
from common.redisconn import REDIS_UNUSABLE, Backoff, id_set, now_ms
from common.redisline import new_line_of, stream_reply
from common.runlog import run_fields
from common.scripts import DISPATCH_BATCH, Scripts
from common.snapshots import each_why, read_snapshots, why_none
from common.subscription import messages, subscribe
from common.wire import (
    MAX_RETRY_AFTER_S,
    ErrorCode,
    ErrorInfo,
    EventType,
    RunState,
    callers_fault,
    cancelled_by_caller,
)
from common.wrongtype import delete_wrong_types, is_wrongtype, read_or
from scheduler import metrics

log = logging.getLogger("iop.scheduler")

#: Safety tick: even with no signal at all, each replica looks at its runs this often.
TICK_S = 1.0
#: How long after a failed SCAN for providers the config lacks (`Scheduler._look_for_strays`) it is tried again.
SCAN_AGAIN_MS = 30_000
#: Times a dispatch is retried at once when a concurrent replica changed the snapshot.
STALE_RETRIES = 16
#: The `dispatch_pending` calls kept ready, one for each set of models without waiting runs met.
PENDING_CALLS_KEPT = 64
#: How long the intake waits, after adopting runs, for the dispatcher's answer before it reads again.
ROUND_WAIT_S = 0.1
#: The most models `dispatch_pending` looks at in one call (each costs Redis an `XPENDING`), and
#: the most providers of theirs in all (the call carries 8 keys and 3 arguments of each).
PENDING_MODELS = 16
PENDING_CANDIDATES = 64
#: A run timed out this long past its deadline (plus twice `scheduler_liveness_ms`: a dead
#: replica's runs reach another within 4/3 of it) was read only then: no scheduler was up to dispatch it,
#: which its error says, rather than blame its providers' slots.
LATE_MS = 2_000


class Outcome(NamedTuple):
    """What the `dispatch` script said of one run."""

    result: str  # ok, stale, not_head, gone, probing
    provider: str | None = None  # when ok: the provider it went to ...
    holder: str = ""  # ... the replica holding the model's next waiting run ('' if none) ...
    mine: int = 0  # ... and how many runs from the head on are this replica's, in a row


@dataclass(order=True, slots=True)
class Waiting:
    """A run this replica owns, waiting in its model's stream."""

    sort_key: tuple[int, int]
    run_id: str = field(compare=False)
    entry_id: str = field(compare=False)
    deadline_ms: int = field(compare=False)
    #: providers earlier attempts failed on; a retry goes elsewhere when it can
    avoid: frozenset[str] = field(compare=False, default=frozenset())
    #: the last provider was too busy to take it (its 429 or 503)
    busy: bool = field(compare=False, default=False)
    #: providers it must not go to (a server error, or a request its adapter does not take: a cli
    #: tool's, Ollama's; one that refused it as unable, its entry's `unable_by`; one that answered it
    #: a 5xx, a 429 or a redirect, its entry's `elsewhere`), `refuse` included
    exclude: frozenset[str] = field(compare=False, default=frozenset())
    #: providers whose adapter would refuse it (`gateway.refusals`): it never went there
    refuse: frozenset[str] = field(compare=False, default=frozenset())


def _no_other_provider(model_id: str, w: Waiting) -> ErrorInfo:
    """A run its providers could not serve (a server error, too busy, no answer in time, or a
    request their adapters do not take), and no other provider can take it; when the last was too
    busy, as a busy provider's own answer (`status` 503: the caller's 503 says `Retry-After`)."""
    failed = ", ".join(sorted(w.exclude - w.refuse))
    return ErrorInfo(ErrorCode.PROVIDER_ERROR,
                     f"{failed} could not serve the run (a server error, too busy, no answer in time, or a request "
                     f"it does not take) and no other provider of model {model_id!r} is available",
                     status=503 if w.busy else None)


def _back_by(head: Waiting, snaps: list[ProviderSnapshot], now: int, ttl: int) -> int:
    """By when a busy bench of a provider the head may go to must end for the head to wait for it:
    its deadline; now (it does not wait) if a provider it was requeued off (its `exclude`, but not
    `refuse`) takes runs now: the runs behind it would go there, and it held them up until the bench
    or its deadline ended (a run requeued off one busy provider, waiting for another benched for its
    Retry-After). A provider its adapter would refuse it never counts: a fresh run that only a
    busy provider can take waits for its Retry-After, as README says (it failed at once, a 503)."""
    left = head.exclude - head.refuse
    if left and any(s.provider_id in left and candidate_class(s, now, ttl) is not None for s in snaps):
        return now
    return head.deadline_ms


def _unavailable(model_id: str, snaps: list[ProviderSnapshot], now: int, ttl: int,
                 refuse: frozenset[str] = frozenset()) -> ErrorInfo:
    """No provider of the model that would take the run (all but `refuse`) is available: a 503
    saying what each is, as for a run the gateway refuses at once (`each_why`), and when to try
    again (`retry_after_s`: when the first bench ends, if benches are all that keep them out)."""
    takers = [s for s in snaps if s.provider_id not in refuse]
    return ErrorInfo(ErrorCode.NO_AVAILABLE_PROVIDER,
                     f"no provider of model {model_id!r} is available" + each_why(snaps, now, ttl, refuse),
                     retry_after_s=retry_after_s(takers, now, ttl, MAX_RETRY_AFTER_S))


def new_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Scheduler:
    def __init__(self, redis: Redis, config: Config, consumer: str | None = None) -> None:
        self.redis = redis
        self.config = config
        self.scripts = Scripts(redis)
        #: the intake's own connection for its blocking read (`common.redisline`), when the client has lines
        self.intake_line = new_line_of(redis, "intake")
        self.consumer = consumer or new_consumer_name()
        self.waiting: dict[str, list[Waiting]] = {m.id: [] for m in config.models}
        self.kick = asyncio.Event()
        #: model id -> the entry of this replica's oldest run of it when another replica's was older
        self.behind: dict[str, str] = {}
        #: wakes heard: for each model, and for all ("*"). A wake that comes while a dispatch is out
        #: is not lost: the dispatch does not then mark the model `behind` (see `_heard`)
        self._wakes: dict[str, int] = {}
        self._wakes_all = 0
        #: models whose pending runs outnumbered this replica's at the last `adopt_forgotten`
        self._short: set[str] = set()
        #: model id -> the entry of this replica's oldest run of it, whose last dispatch found an
        #: older run at the head (`not_head`); and the same as `adopt_forgotten` last saw it
        self._blocked: dict[str, str] = {}
        self._blocked_seen: dict[str, str] = {}
        self._targets = {m.id: {p: m.providers[p] for p in sorted(m.providers)} for m in config.models}
        #: model id -> (its providers' snapshots, when they were read (ms)), kept across dispatch rounds
        self._snaps: dict[str, tuple[list[ProviderSnapshot], int]] = {}
        #: dispatch rounds begun and ended (`dispatch_round`), and the end of each
        self.rounds_started = 0
        self.rounds_done = 0
        self._round_end = asyncio.Event()
        #: the model ids, those of the runs read most recently last
        self._active: dict[str, None] = dict.fromkeys(m.id for m in config.models)
        #: the `dispatch_pending` calls made so far, by the models they cover
        self._pending_calls: dict[tuple[str, ...], tuple[list[str], list[Any]]] = {}
        #: providers the config lacks whose leases this replica reaps too (`_look_for_strays`): a
        #: provider taken out of the config keeps the slots its runs hold until they end or lapse
        self._strays: set[str] = set()
        #: the SCAN of lease keys at this replica's first look (its own task: it reads the whole
        #: keyspace, ~0.8 s a million keys, and must not hold up the liveness beats)
        self._scan: asyncio.Task[None] | None = None
        self._scanned = False
        self._scan_after_ms = 0
        #: when this replica's heartbeat last went through, and since when it has without a gap (a
        #: replica that could not reach Redis judges no gateway dead until they had time to beat)
        self._beat_ms = 0
        self._steady_since_ms = 0
        #: when orphans were last looked for
        self._orphans_ms = 0

    # ----------------------------------------------------------------- setup
    async def ensure_groups(self) -> None:
        for model in self.config.models:
            try:
                await self.redis.xgroup_create(keys.runs_stream(model.id), keys.SCHEDULER_GROUP, id="0",
                                               mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" in str(exc):
                    continue
                if not is_wrongtype(exc) or not await self.heal_streams():
                    raise
                await self.ensure_groups()
                return

    async def heal_streams(self) -> list[str]:
        """Delete the models' runs streams that hold another type than a stream (a `SET iop:runs:m x`
        by hand: every blocking read of the streams failed with WRONGTYPE, so no run of ANY model was
        dispatched, and the loop logged it twenty times a second, until someone deleted the key;
        such a key holds no run); returns them."""
        return await delete_wrong_types(self.redis, {keys.runs_stream(m.id): "stream" for m in self.config.models},
                                        log, "scheduler")

    async def heartbeat(self) -> None:
        """Say this replica lives: its key's TTL renewed (a write Redis takes even when full, so
        a full spell does not make the replicas take over each other's runs), or the key set anew."""
        alive, ttl_ms = keys.scheduler_alive(self.consumer), self.config.runtime.scheduler_liveness_ms
        if not await self.redis.pexpire(alive, ttl_ms):
            await self.redis.set(alive, now_ms(), px=ttl_ms)
        now = now_ms()
        # A gap of two beats: Redis was out of reach or stalled (or this replica was).
        # Gateways renew their keys every third of `gateway_liveness_ms` (at least this replica's
        # liveness, `check_runtime_timings`), so a stall long enough to let a live gateway's key
        # lapse is one this replica sees too.
        if now - self._beat_ms > 2 * ttl_ms // 3:
            self._steady_since_ms = now
        self._beat_ms = now

    # ----------------------------------------------------------------- intake
    def _adopt(self, model_id: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        run_id = fields.get(b"run", b"").decode()
        if not run_id:
            return
        model = self.config.model(model_id)
        assert model is not None
        timeout = self.config.queue_for(model).queue_timeout_ms
        tried = id_set(fields.get(b"tried"))
        refuse = id_set(fields.get(b"refuse"))  # (`gateway.refusals`)
        # (they refused it as unable, or answered it a 5xx, a 429 or a redirect: never again, `FINISH`)
        never = id_set(fields.get(b"unable_by")) | id_set(fields.get(b"elsewhere"))
        hard = fields.get(b"exclude") == b"1"
        key = entry_key(entry_id)
        item = Waiting(key, run_id, entry_id, key[0] + timeout, busy=fields.get(b"busy") == b"1",
                       avoid=frozenset() if hard else tried - refuse - never,
                       exclude=(tried if hard else frozenset()) | refuse | never, refuse=refuse)
        queue = self.waiting[model_id]
        if not any(w.entry_id == entry_id for w in queue):
            bisect.insort(queue, item)

    async def read_new(self, block_ms: int, count: int = 256) -> int:
        """Read runs no replica has seen yet (blocks up to block_ms) and adopt them. Returns how
        many of them wait for the dispatcher.

        Over a line, the `dispatch_pending` script goes in the same write as the read, for the
        models of which no run waits here: Redis runs it as soon as it has answered the read, so
        a run that finds a slot is dispatched without the round trip through this process, and
        only what it left (no slot, not the head, …) is adopted (`_settle`)."""
        streams = {keys.runs_stream(m.id): ">" for m in self.config.models}
        answer: Any = None
        try:
            if self.intake_line is None:
                reply = await self.redis.xreadgroup(keys.SCHEDULER_GROUP, self.consumer, streams,
                                                    count=count, block=block_ms)
            else:
                read = ("XREADGROUP", "GROUP", keys.SCHEDULER_GROUP, self.consumer, "COUNT", count, "BLOCK", block_ms,
                        "STREAMS", *streams, *streams.values())
                call = self._pending_call()
                if call is None:
                    first = await self.intake_line.execute(*read, block_s=block_ms / 1000)
                else:
                    metrics.PENDING_CALLS.inc()
                    first, answer = await self.scripts.send_after(self.intake_line, read, "dispatch_pending", *call,
                                                                  block_s=block_ms / 1000)
                    if isinstance(first, ResponseError):
                        raise first
                reply = stream_reply(first)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc) and not (is_wrongtype(exc) and await self.heal_streams()):
                raise
            await self.ensure_groups()
            return 0
        settled = self._settle(answer)
        adopted = 0
        prefix = len(keys.runs_stream(""))
        for stream, entries in reply or ():
            model_id = stream.decode()[prefix:]
            self._active.pop(model_id, None)
            self._active[model_id] = None
            for entry_id, fields in entries:
                if (model_id, entry_id) in settled:
                    continue
                if fields:  # a deleted entry comes back with no fields
                    self._adopt(model_id, entry_id.decode(), fields)
                    adopted += 1
                else:
                    await self.redis.xack(stream, keys.SCHEDULER_GROUP, entry_id)
        if adopted:
            self.kick.set()
        return adopted

    def _pending_call(self) -> tuple[list[str], list[Any]] | None:
        """The keys and arguments of `dispatch_pending` for the models of which no run waits here
        (whatever the read brings them is next in line), those with runs read most recently, at
        most `PENDING_MODELS` of them with `PENDING_CANDIDATES` providers in all (each provider's
        8 keys are in the call); None if runs of every model wait."""
        recent: list[str] = []
        candidates = 0
        for model_id in reversed(self._active):
            n = len(self._targets[model_id])
            if self.waiting[model_id] or candidates + n > PENDING_CANDIDATES:
                continue
            recent.append(model_id)
            candidates += n
            if len(recent) == PENDING_MODELS:
                break
        if not recent:
            return None
        idle = tuple(sorted(recent))
        call = self._pending_calls.get(idle)
        if call is None:
            rt = self.config.runtime
            call_keys: list[str] = []
            per_model: list[Any] = []
            for model_id in idle:
                targets = self._targets[model_id]
                call_keys.append(keys.runs_stream(model_id))
                model = self.config.model(model_id)
                assert model is not None
                per_model += (self.config.queue_for(model).queue_timeout_ms, len(targets))
                for pid, served in targets.items():
                    node = self.config.node_of(pid)
                    call_keys += _candidate_keys(pid, node)
                    per_model += (pid, node, served)
            call = (call_keys, [keys.SCHEDULER_GROUP, rt.lease_ttl_ms, rt.run_ttl_s, keys.scheduler_channel(""),
                                rt.heartbeat_ttl_ms, self.consumer, keys.run_record(""), keys.run_events(""),
                                DISPATCH_BATCH, *per_model])
            if len(self._pending_calls) >= PENDING_CALLS_KEPT:
                self._pending_calls.clear()
            self._pending_calls[idle] = call
        return call

    def _settle(self, answer: Any) -> set[tuple[str, bytes]]:
        """What `dispatch_pending` did: each run it dispatched (or found gone) leaves the waiting
        ones (a run it took from this replica's earlier ones too) and is counted as a dispatch.
        Returns their (model id, entry id). An error of the script is logged: the dispatcher
        dispatches those runs instead."""
        if answer is None:
            return set()
        if isinstance(answer, Exception):
            log.warning("dispatching the runs just read failed, the dispatcher takes them: %s", answer)
            return set()
        settled: set[tuple[str, bytes]] = set()
        prefix = len(keys.runs_stream(""))
        for stream, entry_id, run_id, result, holder, provider, _mine in answer:
            model_id, outcome = stream.decode()[prefix:], result.decode()
            if outcome == "error":  # (after the runs before it: those stay dispatched)
                log.warning("dispatching the runs just read failed, the dispatcher takes them: %s",
                            holder.decode(errors="replace"))
                break
            settled.add((model_id, entry_id))
            queue = self.waiting.get(model_id)
            if queue:
                queue[:] = [w for w in queue if w.entry_id != entry_id.decode()]
            metrics.dispatches(model_id, outcome).inc()
            metrics.PENDING_RUNS.inc()
            if outcome == "ok":
                chosen = provider.decode()
                kept = self._snaps.get(model_id)
                if kept is not None:
                    self._snaps[model_id] = (_one_more(kept[0], chosen), kept[1])
                _dispatched(model_id, run_id.decode(), chosen, entry_key(entry_id.decode())[0])
        return settled

    def on_signal(self, data: bytes) -> None:
        """A message on `iop:signals` ("*": a provider's health changed; a model id: a run of it was
        cancelled at its start) or on this replica's own channel (a model id: this replica holds
        its oldest waiting run, and a slot freed or the run ahead left). Only what could unblock
        this replica wakes it."""
        model_id = data.decode(errors="replace")
        if model_id == "*":
            self._wakes_all += 1
            self.behind.clear()
            self._snaps.clear()  # a health or an operator's setting changed: read them again
            self.kick.set()
        elif self.waiting.get(model_id):
            self._wakes[model_id] = self._wakes.get(model_id, 0) + 1
            self.behind.pop(model_id, None)
            self.kick.set()

    def _heard(self, model_id: str) -> int:
        """How many wakes that concern the model this replica has heard so far."""
        return self._wakes.get(model_id, 0) + self._wakes_all

    # ----------------------------------------------------------------- dispatch
    async def dispatch_round(self) -> None:
        """One round of the dispatcher: time out the overdue runs, dispatch what can go."""
        self.rounds_started += 1
        try:
            await self.expire_overdue()
            await self.dispatch_all()
        finally:
            self.rounds_done += 1
            self._round_end.set()

    async def dispatched_since(self, started: int, within_s: float) -> None:
        """Wait, at most `within_s`, for the end of a dispatch round begun after the first
        `started` rounds (one that saw what was adopted before)."""
        try:
            async with asyncio.timeout(within_s):
                while self.rounds_done <= started:
                    self._round_end.clear()
                    await self._round_end.wait()
        except TimeoutError:
            pass

    async def dispatch_all(self) -> None:
        """Dispatch every model's waiting runs, but for a model whose oldest waiting run is held
        by another replica (`not_head`): that one goes first, and it is woken, not this one,
        until this replica is signalled for the model (or the safety tick comes round).

        The models whose oldest waiting run has waited longest go first: a slot freed on a provider
        that several models share goes to the run that came first, whatever the models' order in
        the config (in that order, a model whose runs kept coming took every slot of a provider it
        shared, and another model's run waited there until its `queue_timeout_ms`)."""
        models = [m for m in self.config.models if self.waiting[m.id]]
        models.sort(key=lambda m: self.waiting[m.id][0].sort_key)
        for model in models:
            queue = self.waiting[model.id]
            if queue and self.behind.get(model.id) != queue[0].entry_id:
                await self.dispatch_model(model)

    async def dispatch_model(self, model: ModelConfig) -> None:
        """Dispatch the model's waiting runs, oldest first, while providers have free slots.

        The snapshots only decide whether a run may find a slot, and which providers it may go
        to: the `dispatch` script applies the policy to the live state and picks the provider
        itself. So they are kept between rounds (up to `heartbeat_interval_ms`, and until a
        health or an operator's setting changes) and kept up to date with what this replica did
        (after a dispatch the chosen provider holds one more run). Kept snapshots are trusted to
        try, never to wait: when they say no provider has room, they are read again first. Only
        `stale` (no candidate could take it after all) reads them again after a try."""
        queue = self.waiting[model.id]
        self._blocked.pop(model.id, None)  # (unless this try meets `not_head` again)
        ttl = self.config.runtime.heartbeat_ttl_ms
        stale = 0
        #: how many runs from the head on are this replica's, in a row (1 until a dispatch says)
        ahead = 1
        snaps, read_ms = self._snaps.pop(model.id, (None, 0))
        try:
            while queue:
                head = queue[0]
                now = now_ms()
                if snaps is not None and now - read_ms > self.config.runtime.heartbeat_interval_ms:
                    snaps = None
                fresh = snaps is None
                if snaps is None:
                    snaps, read_ms = await read_snapshots(
                        self.redis, self._targets[model.id], now, self.config.node_of), now
                if select_provider(snaps, now, ttl, head.avoid, head.exclude) is None:
                    if not fresh:
                        snaps = None  # kept counts may be too high (runs ended): look again before waiting
                        continue
                    if all_refused(snaps, now, ttl):
                        await self._refuse_all(model, snaps, now)
                        return
                    if all_refused(snaps, now, ttl, head.deadline_ms):  # (busy, back only after its deadline)
                        if _taken(queue, head):
                            await self._drop(model.id, head, RunState.FAILED, _unavailable(model.id, snaps, now, ttl))
                        continue
                    takers = [s for s in snaps if s.provider_id not in head.refuse] if head.refuse else snaps
                    if all_refused(takers, now, ttl, _back_by(head, snaps, now, ttl)):
                        # (those that would take it are down: as if all were)
                        if _taken(queue, head):
                            await self._drop(model.id, head, RunState.FAILED,
                                             _unavailable(model.id, snaps, now, ttl, head.refuse))
                        continue
                    others = [s for s in takers if s.provider_id not in head.exclude]
                    if head.exclude == head.refuse or (
                            others and not all_refused(others, now, ttl, _back_by(head, snaps, now, ttl))):
                        return  # it waits for a slot, and the runs behind it with it (FIFO)
                    refused = await self._refused_with(head)
                    if _taken(queue, head):
                        await self._drop(model.id, head, RunState.FAILED, refused or _no_other_provider(model.id, head))
                    continue
                # The head and the runs behind it that the snapshots say will find a slot too go in
                # one round trip; the script makes sure each goes only once the ones before it went.
                batch = _plan(queue, snaps, now, ttl, ahead)
                ahead = 1  # unless the last `ok` below says more runs in a row are this replica's
                heard = self._heard(model.id)
                outcomes = await self._dispatch(model, batch, snaps)
                # Woken while the dispatch was out (the replica ahead went, an operator freed a
                # slot): the model is not left `behind`, or the wake would wait for the safety tick.
                woken = self._heard(model.id) != heard
                for w, (result, chosen, next_holder, mine) in zip(batch, outcomes, strict=True):
                    if result == "not_head":
                        self._blocked[model.id] = w.entry_id
                    if result in ("ok", "gone"):
                        if w in queue:  # compare by identity of entry: another task may have moved on
                            queue.remove(w)
                        stale = 0
                        if result == "ok":
                            snaps = _one_more(snaps, chosen)
                            _dispatched(model.id, w.run_id, chosen, w.sort_key[0])
                            ahead = max(1, mine)
                            if queue and next_holder not in ("", self.consumer):
                                if not woken:  # another replica goes next; it was woken
                                    self.behind[model.id] = queue[0].entry_id
                                return
                        continue
                    if result == "stale" and stale < STALE_RETRIES:
                        stale += 1
                        snaps = None  # no candidate had a free slot after all: read again
                        break  # (the runs after it in the batch stayed where they were: not_head)
                    # not_head: an older run of another replica goes first; we are woken once it left.
                    # probing: a probe that would disturb a run is out; its end signals us.
                    if result == "not_head" and not woken:
                        self.behind[model.id] = w.entry_id
                    return
        finally:
            if snaps is not None:
                self._snaps[model.id] = (snaps, read_ms)

    async def _dispatch(self, model: ModelConfig, batch: list[Waiting],
                        snaps: list[ProviderSnapshot]) -> list[Outcome]:
        """Reserve a slot for each run of `batch`, oldest first, in one round trip, each on the
        provider the policy chooses on the live state (the `dispatch` script applies it to the
        same candidates). Returns each one's outcome, and when it is `ok` the provider and the
        replica holding the next run."""
        rt = self.config.runtime
        now = now_ms()
        calls = []
        for w in batch:
            candidates = sorted(
                ((s, c) for s in snaps
                 if (c := candidate_class(s, now, rt.heartbeat_ttl_ms, w.avoid, w.exclude)) is not None),
                key=lambda sc: sc[0].provider_id)
            nodes = {s.provider_id: self.config.node_of(s.provider_id) for s, _ in candidates}
            calls.append((
                [keys.runs_stream(model.id), keys.run_record(w.run_id), keys.run_events(w.run_id),
                 *(k for s, _ in candidates for k in _candidate_keys(s.provider_id, nodes[s.provider_id]))],
                [w.run_id, w.entry_id, keys.SCHEDULER_GROUP, rt.lease_ttl_ms, rt.run_ttl_s,
                 keys.scheduler_channel(""), rt.heartbeat_ttl_ms, self.consumer,
                 *(a for s, c in candidates for a in (
                     c, s.provider_id, nodes[s.provider_id], model.providers[s.provider_id]))],
            ))
        outcomes: list[Outcome] = []
        for result in await self.scripts.call_many("dispatch", calls):  # each counted, used or not
            if isinstance(result, Exception):
                raise result
            elif isinstance(result, list):  # ['ok', the next run's holder, the provider, runs ahead mine]
                outcomes.append(Outcome("ok", result[2].decode(), result[1].decode(), int(result[3])))
            else:
                outcomes.append(Outcome(result.decode() if isinstance(result, bytes) else str(result)))
            metrics.dispatches(model.id, outcomes[-1].result).inc()
        return outcomes

    async def _refuse_all(self, model: ModelConfig, snaps: list[ProviderSnapshot], now: int) -> None:
        """Every provider of the model is down: its waiting runs fail now (503, `_unavailable`), not
        at their timeout."""
        info = _unavailable(model.id, snaps, now, self.config.runtime.heartbeat_ttl_ms)
        queue = self.waiting[model.id]
        while queue:
            await self._drop(model.id, queue.pop(0), RunState.FAILED, info)

    # ----------------------------------------------------------------- timeouts
    def next_deadline_ms(self) -> int | None:
        deadlines = [w.deadline_ms for queue in self.waiting.values() for w in queue]
        return min(deadlines) if deadlines else None

    async def expire_overdue(self) -> None:
        now = now_ms()
        for model_id, queue in self.waiting.items():
            overdue = [w for w in queue if w.deadline_ms <= now]
            for w in overdue:
                if w not in queue:  # (dispatched meanwhile, by `dispatch_pending`: `_settle`)
                    continue
                queue.remove(w)
                await self._time_out(model_id, w)

    async def _refused_with(self, w: Waiting) -> ErrorInfo | None:
        """The caller's 4xx a run was requeued with (its last event): a server that said it cannot
        do what the request asks, tried on another provider first (`another_may`: Ollama's `"m"
        does not support tools`, llama-server's `n` over its slots), or an adapter that cannot carry
        it (`not_taken`). When no other provider serves the run (none left, or none free within its
        queue timeout), that 400 is the caller's answer, as README says: it was a 502, or a 504 after
        the whole queue timeout, which the official clients send twice more, each a 400 again."""
        if not w.exclude - w.refuse:  # (never tried anywhere)
            return None
        try:  # (its events of another type, written by hand, hold no 4xx: the run ends as usual, its end's
            # event replacing them, not every dispatch round failed at them)
            last = await read_or(self.redis.xrevrange(keys.run_events(w.run_id), count=1), [])
        except REDIS_UNUSABLE:
            return None
        if not last or last[0][1].get(b"type") != EventType.REQUEUED.value.encode():
            return None
        try:
            data = unpack(last[0][1].get(b"data", b""))
        except (ValueError, TypeError):  # (not an event of this version's: the usual answer)
            return None
        info = ErrorInfo.from_wire(data) if isinstance(data, dict) else None
        if info is None or type(info.status) is not int or not callers_fault(info.status, info.message):
            return None
        return info

    async def _time_out(self, model_id: str, w: Waiting) -> None:
        refused = await self._refused_with(w)
        if refused is not None:
            await self._drop(model_id, w, RunState.FAILED, refused)
            return
        model = self.config.model(model_id)
        assert model is not None
        timeout = self.config.queue_for(model).queue_timeout_ms
        late_ms = now_ms() - w.deadline_ms
        if late_ms > LATE_MS + 2 * self.config.runtime.scheduler_liveness_ms:  # (read long after: none was up)
            message = (f"the run waited {timeout + late_ms} ms in the queue of model {model_id!r}, past its "
                       f"queue_timeout_ms ({timeout} ms): no scheduler was running to dispatch it")
        else:
            why = await self._why(model_id, w.refuse, w.exclude - w.refuse)
            message = f"no provider of model {model_id!r} had a free slot within {timeout} ms{why}"
        await self._drop(model_id, w, RunState.TIMED_OUT, ErrorInfo(ErrorCode.QUEUE_TIMEOUT, message))

    async def _why(self, model_id: str, refuse: frozenset[str] = frozenset(),
                   excluded: frozenset[str] = frozenset()) -> str:
        """` (vllm-a: drained or cordoned, vllm-b: full (4 of 4))`: what each provider of the model
        says now (so an operator sees a drain or a cordon behind a timeout; `refuse`: those that would
        refuse the run say so; `excluded`: those it never goes back to, that they failed it, not
        that they have a free slot); '' if Redis cannot say."""
        return await why_none(self.redis, self._targets[model_id], now_ms(), self.config.node_of,
                              self.config.runtime.heartbeat_ttl_ms, refuse, excluded)

    def _drop_call(self, model_id: str, run_id: str, state: RunState, info: ErrorInfo,
                   abort_running: bool = False, entry_id: str = "") -> tuple[list[str], list[Any]]:
        """The `drop_queued` call that ends a run still waiting in its queue with `state` and `info`;
        `abort_running`: else tells its node to abort it if it runs (as a caller's leaving does);
        `entry_id`: its entry in the queue, which leaves it should its record be gone (or of another
        type, written by hand)."""
        return ([keys.runs_stream(model_id), keys.run_record(run_id), keys.run_events(run_id)],
                [run_id, keys.SCHEDULER_GROUP, state.value, pack(info.to_wire()), self.config.runtime.run_ttl_s,
                 info.code.value, info.message, keys.node_cancel("") if abort_running else "",
                 keys.scheduler_channel(""), "", entry_id])

    async def _drop(self, model_id: str, w: Waiting, state: RunState, info: ErrorInfo) -> None:
        """End a run that is still waiting in its queue."""
        result = await self.scripts.call("drop_queued", *self._drop_call(model_id, w.run_id, state, info,
                                                                          entry_id=w.entry_id))
        if result == b"ok":
            metrics.DROPPED.labels(model_id, state.value).inc()
            log.info("%s in the queue: %s: %s", state.value, info.code.value, info.message,
                     extra=run_fields(w.run_id, model_id))

    # ----------------------------------------------------------------- orphans
    async def cancel_orphans(self) -> int:
        """Cancel the runs whose caller's gateway died (`orphans`), as its leaving would have: the
        runs this replica holds waiting, and those running on every provider. Not until this replica
        has reached Redis for `OUTAGE_GRACE` times `gateway_liveness_ms` without a gap (after an
        outage the gateways need their liveness to beat again, once they reach Redis, and they may
        reach it well after this replica did), and at most every half of it."""
        now, liveness_ms = now_ms(), self.config.runtime.gateway_liveness_ms
        # (the beats are a task of their own: after an outage this sweep may reach Redis before the
        # liveness task's first beat has marked the gap, so a beat missing now is a gap too)
        missed = now - self._beat_ms > 2 * self.config.runtime.scheduler_liveness_ms // 3
        if (missed or now - self._steady_since_ms < OUTAGE_GRACE * liveness_ms
                or now - self._orphans_ms < liveness_ms // 2):
            return 0
        self._orphans_ms = now
        run_ids = [w.run_id for queue in self.waiting.values() for w in queue]
        async with self.redis.pipeline(transaction=False) as pipe:
            for provider_id in [*(p.id for node in self.config.nodes for p in node.providers), *sorted(self._strays)]:
                pipe.zrange(keys.leases(provider_id), 0, -1)  # (and those of providers the config lacks)
            leased = await pipe.execute()
        run_ids += [raw.decode() for ids in leased for raw in ids]
        found: list[tuple[str, str]] = []
        for i in range(0, len(run_ids), ORPHANS_BATCH):
            try:
                answer = await self.scripts.call("orphans", [keys.GATEWAYS], [
                    keys.run_record(""), keys.gateway_alive(""), *run_ids[i:i + ORPHANS_BATCH]])
            except ResponseError as exc:
                # (the gateways hash of another type, written by hand: every sweep failed, for good, and
                # no dead gateway's runs were cancelled; it names no gateway: the live ones name
                # themselves again at their next beat)
                if not is_wrongtype(exc) or not await delete_wrong_types(self.redis, {keys.GATEWAYS: "hash"}, log,
                                                                         "scheduler"):
                    raise
                return 0
            found += [(answer[j].decode(), answer[j + 1].decode()) for j in range(0, len(answer), 2)]
        info = ErrorInfo(ErrorCode.UNAVAILABLE, GATEWAY_GONE)
        outcomes: dict[str, int] = {}
        for i in range(0, len(found), ORPHANS_BATCH):  # (a batch a round trip: a dead gateway may leave thousands)
            batch = found[i:i + ORPHANS_BATCH]
            answers = await self.scripts.call_many("drop_queued", [
                self._drop_call(model_id, run_id, RunState.CANCELLED, info, abort_running=True)
                for run_id, model_id in batch])
            for (run_id, model_id), answer in zip(batch, answers, strict=True):
                outcome = answer.decode() if isinstance(answer, bytes) else type(answer).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome == "ok":
                    metrics.DROPPED.labels(model_id, RunState.CANCELLED.value).inc()
                if outcome in ("ok", "signalled"):  # (each run its own line: the sum below names none)
                    log.info("cancelled (%s): %s", "waiting" if outcome == "ok" else "dispatched or running",
                             GATEWAY_GONE, extra=run_fields(run_id, model_id))
        ended = outcomes.get("ok", 0) + outcomes.get("signalled", 0)
        if ended:  # (one line a sweep; the runs another replica cancelled first are not counted)
            log.warning("cancelled %d runs: %s (%d waiting, %d dispatched or running)", ended, GATEWAY_GONE,
                        outcomes.get("ok", 0), outcomes.get("signalled", 0))
        await self._forget_gateways()
        return ended

    async def _forget_gateways(self) -> None:
        """Stop naming the dead gateways that started `GATEWAY_FORGET_MS` ago (a live one stays)."""
        named = await self.redis.hgetall(keys.GATEWAYS)
        for gateway, started in named.items():
            if (now_ms() - int(started or 0) > keys.GATEWAY_FORGET_MS
                    and not await self.redis.exists(keys.gateway_alive(gateway.decode()))):
                await self.redis.hdel(keys.GATEWAYS, gateway)

    # ----------------------------------------------------------------- takeover
    async def take_over_dead(self) -> int:
        """Claim the pending runs of replicas whose liveness key expired. Returns how many. Every
        model's consumers are read in one round trip, and their liveness in another (one round trip
        a model and one a replica named there, every round: 800 commands a second with 300 models
        and 2 replicas, idle, and a round longer than `scheduler_liveness_ms` under load)."""
        pipe = self.redis.pipeline(transaction=False)
        for model in self.config.models:
            pipe.xinfo_consumers(keys.runs_stream(model.id), keys.SCHEDULER_GROUP)
        others: list[tuple[str, list[str]]] = []  # (model id, the other replicas its group names)
        for model, consumers in zip(self.config.models, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(consumers, ResponseError):  # (no stream or group yet: `read_new` makes it)
                continue
            if isinstance(consumers, Exception):
                raise consumers
            names = [info["name"].decode() if isinstance(info["name"], bytes) else str(info["name"])
                     for info in consumers]
            if any(name != self.consumer for name in names):
                others.append((model.id, [name for name in names if name != self.consumer]))
        named = sorted({name for _, names in others for name in names})
        pipe = self.redis.pipeline(transaction=False)
        for name in named:
            pipe.exists(keys.scheduler_alive(name))
        alive = {name for name, lives in zip(named, await pipe.execute() if named else [], strict=True) if lives}
        claimed = 0
        for model_id, names in others:
            stream = keys.runs_stream(model_id)
            for name in names:
                if name in alive:
                    continue
                claimed += await self._claim_from(model_id, stream, name)
        if claimed:
            self.kick.set()
        return claimed

    def _still_blocked(self, model_id: str) -> bool:
        """Whether this replica's oldest run of the model found an older run at the head at its
        last dispatch, and had when `adopt_forgotten` looked last."""
        entry, queue = self._blocked.get(model_id), self.waiting[model_id]
        return entry is not None and entry == self._blocked_seen.get(model_id) and bool(queue) and (
            queue[0].entry_id == entry)

    async def adopt_forgotten(self) -> int:
        """Adopt the runs Redis says this replica holds (pending for it) but it does not. They
        disagree after a Redis failover lost the newest writes: a dispatch the old primary
        acknowledged never reached the new one, so the run is back in its stream, pending for a
        live replica that thinks it dispatched it, and would hold up every run of its model
        behind it (FIFO). One XPENDING summary per model; the entries are read only when Redis
        holds more for this replica than it holds twice in a row (runs just read by `read_new`
        make it so for a moment), or when a run of its own has been kept from going by an older
        one (`not_head`) at two looks in a row: the counts may agree while Redis holds a forgotten
        run at the head and this replica a run whose queueing the failover lost (its model's
        queue stood still until that one timed out, 20 s in a test). Returns how many runs were
        adopted."""
        pipe = self.redis.pipeline(transaction=False)
        for model in self.config.models:
            pipe.xpending(keys.runs_stream(model.id), keys.SCHEDULER_GROUP)
        me = self.consumer.encode()
        short: set[str] = set()
        for model, summary in zip(self.config.models, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(summary, Exception):  # no group yet: `read_new` makes it
                continue
            mine = sum(int(c["pending"]) for c in summary.get("consumers") or () if c["name"] == me)
            if mine > len(self.waiting[model.id]):
                short.add(model.id)
            elif mine and self._still_blocked(model.id):
                self._short.add(model.id)  # (kept from going at two looks: read them now)
                short.add(model.id)
        self._blocked_seen = dict(self._blocked)
        again, self._short = short & self._short, short
        adopted = 0
        for model_id in sorted(again):
            try:
                reply = await self.redis.xreadgroup(keys.SCHEDULER_GROUP, self.consumer,
                                                    {keys.runs_stream(model_id): "0"}, count=100_000)
            except ResponseError:  # the group went meanwhile: nothing is pending then
                continue
            held = {w.entry_id for w in self.waiting[model_id]}
            for stream, entries in reply or ():
                for entry_id, fields in entries:
                    if not fields:  # deleted while pending: nothing to run
                        await self.redis.xack(stream, keys.SCHEDULER_GROUP, entry_id)
                    elif entry_id.decode() not in held:
                        self._adopt(model_id, entry_id.decode(), fields)
                        adopted += 1
        if adopted:
            log.warning("adopted %d waiting runs that Redis holds for this replica but it had lost track of",
                        adopted)
            self.kick.set()
        return adopted

    async def _claim_from(self, model_id: str, stream: str, dead: str) -> int:
        """Claim the runs pending for `dead` and delete it from the group (`take_over`: both in one
        step, a batch at a time, the delete with the last), adopting them. Returns how many."""
        taken = 0
        while True:
            batch = await self.scripts.call("take_over", [stream], [keys.SCHEDULER_GROUP, dead, self.consumer,
                                                                   TAKE_OVER_BATCH])
            for entry_id, flat in batch:
                if flat:  # (deleted while pending: nothing to run)
                    self._adopt(model_id, entry_id.decode(), dict(zip(flat[::2], flat[1::2], strict=True)))
            taken += len(batch)
            if len(batch) < TAKE_OVER_BATCH:
                break
        if taken:
            metrics.TAKEOVERS.labels(model_id).inc(taken)
            log.info("took over %d waiting runs of model %s from dead scheduler %s", taken, model_id, dead)
        return taken

    # ----------------------------------------------------------------- leases
    async def reap_expired_leases(self) -> int:
        """Give back the slots of workers that died, and requeue or fail their runs; also those of
        providers the config lacks (`_look_for_strays`)."""
        now = now_ms()
        reaped = 0
        max_attempts = {m.id: self.config.queue_for(m).max_attempts for m in self.config.models}
        providers = [(node.id, p.id) for node in self.config.nodes for p in node.providers]
        pipe = self.redis.pipeline(transaction=False)  # (one round trip for every provider's)
        for _, provider_id in providers:
            pipe.zrangebyscore(keys.leases(provider_id), "-inf", now)
        for (node_id, provider_id), expired in zip(providers, await pipe.execute(), strict=True):
            for raw in expired:
                reaped += await self._reap(keys.leases(provider_id), node_id, provider_id, raw.decode(), max_attempts)
        await self._look_for_strays()
        for provider_id in sorted(self._strays):
            lease_key = keys.leases(provider_id)
            for raw in await self.redis.zrangebyscore(lease_key, "-inf", now):
                reaped += await self._reap(lease_key, None, provider_id, raw.decode(), max_attempts)
            if not await self.redis.exists(lease_key):
                self._strays.discard(provider_id)
        return reaped

    async def _look_for_strays(self) -> None:
        """Providers the config lacks that may hold slots: taken out of the config while runs of
        theirs were going on (a worker of the old config may still run them, or die with them: no
        replica of the new config would give those slots back, and their callers would wait out
        their whole deadline). Those whose workers beat (`keys.BEATING`), and, at this replica's
        first look, every provider with a lease key (a SCAN: a worker killed before this replica
        started beats no more)."""
        found = [p.decode(errors="replace") for p in await self.redis.zrange(keys.BEATING, 0, -1)]
        self._strays.update(p for p in found if p not in self._configured())
        if not self._scanned and (self._scan is None or self._scan.done()) and now_ms() >= self._scan_after_ms:
            self._scan = asyncio.create_task(self._scan_leases(), name="scan-leases")  # (again after a failed one)

    def _configured(self) -> set[str]:
        return {p.id for node in self.config.nodes for p in node.providers}

    async def _scan_leases(self) -> None:
        prefix = keys.leases("")
        try:
            found = [key.decode(errors="replace")[len(prefix):]
                     async for key in self.redis.scan_iter(match=prefix + "*", count=1000)]
        except Exception as exc:  # (a task of its own: whatever it met is said here, and it is tried again later)
            self._scan_after_ms = now_ms() + SCAN_AGAIN_MS
            log.warning("could not look for the leases of providers the config lacks (%s: %s); trying again in "
                        "%d s", type(exc).__name__, exc, SCAN_AGAIN_MS // 1000)
            return
        self._strays.update(p for p in found if p not in self._configured())
        self._scanned = True

    async def forget_liveness(self) -> None:
        """This replica stops: its liveness key goes, so that another replica takes its waiting runs
        over now, not once the key lapses. Redis gets until then to answer, and at most
        `STOP_DELETE_S` (a stop waited out the reply timeout, 5 s, past the key's own lapse)."""
        left_s = (self._beat_ms + self.config.runtime.scheduler_liveness_ms - now_ms()) / 1000
        if left_s <= 0:  # (it lapsed by itself: Redis was away, or this replica never beat)
            return
        try:
            async with asyncio.timeout(min(STOP_DELETE_S, left_s)):
                await self.redis.delete(keys.scheduler_alive(self.consumer))
        except (TimeoutError, *REDIS_UNUSABLE):
            pass

    async def close(self) -> None:
        """Stop what this replica does on its own (the SCAN of `_look_for_strays`)."""
        if self._scan is not None:
            self._scan.cancel()
            await asyncio.gather(self._scan, return_exceptions=True)

    async def _reap(self, lease_key: str, node_id: str | None, provider_id: str, run_id: str,
                    max_attempts: dict[str, int]) -> int:
        """The node's queue is the one the run's record names (it was sent there), else `node_id`'s
        (None: a provider the config lacks)."""
        # (a record of another type, written by hand, holds no run: the script reads it as missing, not
        # every sweep failed at it for good)
        model_raw, node_raw, limit = await read_or(
            self.redis.hmget(keys.run_record(run_id), "model", "node", "max_attempts"), [None, None, None])
        model_id = model_raw.decode() if model_raw else ""
        if node_raw:  # (the node it was sent to: the config's may be another since, in a rollout)
            node_id = node_raw.decode()
        elif node_id is None:
            node_id = ""
        # (the run's own limit, as its queueing wrote it: a replica of an older config may not know
        # its model, nor have the same limit)
        attempts = int(limit) if limit and limit.isdigit() else max_attempts.get(model_id, 1)
        woken = [keys.runs_stream(m) for m in self.config.models_of(provider_id)] or [keys.runs_stream(model_id)]
        lost = ErrorInfo(ErrorCode.WORKER_LOST, "the worker running this run was lost")
        # (dispatched, never started: no worker of its node took it before its lease ran out, its
        # workers gone, stopped or too busy; an operator looks for them, not for a crash)
        unstarted = ErrorInfo(ErrorCode.WORKER_LOST, f"no worker of node {node_id} started this run before "
                                                     "its lease ran out")
        result = await self.scripts.call(
            "reap",
            [lease_key, keys.run_record(run_id), keys.run_events(run_id), keys.runs_stream(model_id),
             keys.node_queue(node_id), keys.arq_in_progress(run_id), *woken],
            [run_id, attempts, self.config.runtime.run_ttl_s, keys.scheduler_channel(""),
             model_id, pack(lost.to_wire()), pack({**lost.to_wire(), "before_output": False}),
             pack(cancelled_by_caller().to_wire()), pack(unstarted.to_wire()),
             unstarted.message],
        )
        outcome = result.decode() if isinstance(result, bytes) else str(result)
        if outcome != "alive":
            metrics.REAPS.labels(model_id, outcome).inc()
            log.warning("lease expired: %s", outcome,
                        extra=run_fields(run_id, model_id, provider=provider_id, node=node_id or "-"))
            return 1
        return 0


#: The most runs of a dead replica one `take_over` call claims (its ids go through Lua's `unpack`)
TAKE_OVER_BATCH = 1_000
#: How long a stopping replica waits for Redis to delete its liveness key (`forget_liveness`)
STOP_DELETE_S = 1.0
#: after its start or a gap in its contact with Redis, a replica judges no gateway dead until it has
#: reached Redis this many `gateway_liveness_ms` without a gap. Processes cut off from Redis together
#: come back at different times: after a Redis restart under podman one scheduler was back 15 s
#: before the gateway (liveness 10 s), whose callers' runs were all cancelled as a dead one's.
OUTAGE_GRACE = 3
#: how many runs one `orphans` call looks at (a call holds Redis for ~3 µs a run)
ORPHANS_BATCH = 256
#: why a run whose caller's gateway died is cancelled. The caller hears it only if that gateway was
#: not dead but paused or cut off from Redis (its key expired all the same): as a 503, which the
#: official clients send again.
GATEWAY_GONE = ("cancelled: the caller's gateway stopped renewing its liveness key for runtime.gateway_liveness_ms "
                "(paused, or cut off from Redis); send the request again")


def _plan(queue: list[Waiting], snaps: list[ProviderSnapshot], now: int, ttl: int, ahead: int) -> list[Waiting]:
    """The head of `queue` (the snapshots say it finds a slot) and the runs behind it that would
    find one too, each counted on the provider the policy picks for it: at most `ahead` (the
    runs known to be next in the stream) and `DISPATCH_BATCH`."""
    batch: list[Waiting] = []
    for w in queue[:min(ahead, DISPATCH_BATCH)]:
        chosen = select_provider(snaps, now, ttl, w.avoid, w.exclude)
        if chosen is None:
            break
        batch.append(w)
        snaps = _one_more(snaps, chosen.provider_id)
    return batch


def _taken(queue: list[Waiting], head: Waiting) -> bool:
    """Take `head`, the run a decision was made for, out of `queue`, wherever it is now: while the
    decision awaited Redis, another task may have put an older run in front of it (a dead replica's
    runs taken over, runs adopted) or taken it out (`dispatch_pending` dispatched it: False then).
    (`queue.pop(0)` after the await failed the run taken over, with the other run's error.)"""
    try:
        queue.remove(head)
    except ValueError:
        return False
    return True


def _dispatched(model_id: str, run_id: str, provider_id: str | None, queued_ms: int) -> None:
    """A run went to `provider_id`, whichever way (the dispatcher's or `dispatch_pending`): its
    time in the queue (from its entry's id, `queued_ms`) measured, and the log's line."""
    metrics.dispatch_latency(model_id).observe(max(0, now_ms() - queued_ms) / 1000)
    log.info("dispatched to %s", provider_id, extra=run_fields(run_id, model_id))


def _candidate_keys(provider_id: str, node_id: str) -> tuple[str, ...]:
    """The 8 keys the dispatch scripts read and write of one candidate provider."""
    return (keys.heartbeat(provider_id), keys.leases(provider_id), keys.capacity_override(provider_id),
            keys.drained(provider_id), keys.cordoned(node_id), keys.probing(provider_id),
            keys.node_queue(node_id), keys.node_wake(node_id))


def _one_more(snaps: list[ProviderSnapshot], provider_id: str | None) -> list[ProviderSnapshot]:
    """The snapshots after a run went to `provider_id`: it holds one more."""
    return [replace(s, in_flight=s.in_flight + 1) if s.provider_id == provider_id else s for s in snaps]


async def _forever(name: str, step: Any, comeback: Comeback) -> None:
    """Run `step()` in a loop; a Redis outage only pauses it, with backoff, cut short when Redis
    answers again (`comeback`). Any other error is logged and the loop goes on too: a replica whose
    liveness key stays fresh must never stop dispatching, or its runs would wait without anyone
    taking them over."""
    backoff = Backoff()
    while True:
        try:
            await step()
            backoff.reset()
        except REDIS_UNUSABLE as exc:
            log.warning("%s: Redis unavailable (%s); retrying in %.2fs", name, exc, backoff.delay)
            await comeback.pause(backoff)
        except Exception:
            log.exception("%s: unexpected error; retrying in %.2fs", name, backoff.delay)
            await backoff.pause()


async def run_scheduler(sched: Scheduler, stop: asyncio.Event, on_ready: Callable[[], None] | None = None) -> None:
    """All the loops of one replica, until `stop` is set; `on_ready` once its setup is over (Redis
    answered: its stream groups made, its liveness said)."""
    rt = sched.config.runtime
    maintenance_s = rt.scheduler_liveness_ms / 3000

    async def intake() -> None:
        if await sched.read_new(block_ms=1000):
            # The dispatcher, woken by the runs just read, sends their dispatch before this task
            # reads again: the next read is not on the new runs' way. It waits for the dispatch's
            # answer too (briefly): a model it leaves with no run waiting is then in the next
            # read's `dispatch_pending` again, not left out until a read finds nothing for 1 s.
            await sched.dispatched_since(sched.rounds_started, ROUND_WAIT_S)

    async def dispatcher() -> None:
        deadline = sched.next_deadline_ms()
        wait_s = TICK_S if deadline is None else max(0.0, min(TICK_S, (deadline - now_ms()) / 1000))
        try:
            async with asyncio.timeout(wait_s):  # (not wait_for: no task of its own, woken in one turn)
                await sched.kick.wait()
        except TimeoutError:
            pass
        if not sched.kick.is_set():
            sched.behind.clear()  # the safety tick: look at every model again
        sched.kick.clear()
        await sched.dispatch_round()

    async def liveness() -> None:
        # (a task of its own: a sweep below looks at every model and provider, and one that took
        # longer than `scheduler_liveness_ms` let the key lapse, so another replica took over the
        # runs of this live one)
        await sched.heartbeat()
        await asyncio.sleep(maintenance_s)

    async def maintenance() -> None:
        await sched.take_over_dead()
        await sched.adopt_forgotten()
        if await sched.reap_expired_leases():
            sched.kick.set()
        await sched.cancel_orphans()
        await asyncio.sleep(maintenance_s)

    async def signals() -> None:
        pubsub = sched.redis.pubsub()
        try:
            await subscribe(pubsub, keys.SCHEDULER_SIGNALS, keys.scheduler_channel(sched.consumer))
            sched.kick.set()  # anything may have changed while we were not listening
            async for msg in messages(pubsub):  # (a dead subscription raises: subscribed again)
                sched.on_signal(msg["data"])
        finally:
            await pubsub.aclose()

    async def setup() -> None:
        await sched.ensure_groups()
        await sched.heartbeat()

    # (Redis may be away for long at the start: a stop meanwhile ends the wait, not only a success)
    comeback = Comeback(sched.redis)
    waiting = asyncio.create_task(_retry_once(setup, comeback), name="setup")
    stopped = asyncio.create_task(stop.wait(), name="stop")
    await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for task in (waiting, stopped):
        task.cancel()  # (the one that is done stays as it ended)
    await asyncio.gather(waiting, stopped, return_exceptions=True)
    if waiting.cancelled() or waiting.exception() is not None:
        await comeback.close()
    if waiting.cancelled():
        return
    waiting.result()  # (an error of the setup's own is raised)
    if on_ready is not None:
        on_ready()
    tasks = [asyncio.create_task(_forever(n, f, comeback), name=n) for n, f in
             (("intake", intake), ("dispatch", dispatcher), ("liveness", liveness), ("maintenance", maintenance),
              ("signals", signals))]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await comeback.close()
        await sched.close()
        await sched.forget_liveness()


async def _retry_once(step: Any, comeback: Comeback) -> None:
    backoff = Backoff()
    while True:
        try:
            await step()
            return
        except REDIS_UNUSABLE as exc:
            log.warning("setup: waiting for Redis (%s); retrying in %.2fs", exc, backoff.delay)
            await comeback.pause(backoff)
