"""Heartbeats: each worker publishes the health of its node's providers, judged from evidence.

Every worker process of a node publishes the same hashes (last writer wins), so a node stays
visible as long as any of its workers lives. Health is judged by `workers.health.judge` from
the evidence in the hash (runs that succeeded or failed, probes) and the provider's live
leases, so every worker judges it the same way. A worker probes a provider only when it
claims the probe (`probe` script): nothing showed the provider alive for its probe interval,
no other worker probed it since, and, for a probe that would disturb a run, the provider runs
nothing. Probes run beside the heartbeat, so a slow one never delays it. A hash expires after
`heartbeat_ttl_ms`; a provider without one is `unknown` and never selected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from common import keys
from common.comeback import Comeback
from common.config import Config, ProviderConfig
from common.policy import Health
from common.provider_types import PROBE_DISTURBS
from common.redisconn import REDIS_DOWN, REDIS_UNUSABLE, as_text_map, now_ms
from common.scripts import Scripts
from common.shown import near_name
from common.wrongtype import delete_wrong_types, is_wrongtype
from workers.adapters.base import DOWN, Adapter, ProbeResult
from workers.health import Evidence, Field, judge

log = logging.getLogger("iop.worker")


def heartbeat_fields(provider: ProviderConfig, node_id: str, health: Health, reason: str,
                     ts_ms: int, worker: str = "") -> dict[str, str]:
    """`worker`: the instance that beats (host:pid and an id of its own: two containers' PID 1 on
    one host differ); '' for host:pid alone."""
    return {
        "id": provider.id,
        "node": node_id,
        "type": provider.type,
        "category": provider.effective_category,
        "health": health.value,
        "reason": reason,
        "capacity": str(provider.capacity),
        "models": json.dumps(provider.models),
        "lifecycle": json.dumps(provider.effective_lifecycle),  # coarse flags (D05), shown, never acted on
        "ts_ms": str(ts_ms),
        "worker": worker or f"{socket.gethostname()}:{os.getpid()}",
    }


#: Heartbeat fields taken from the config: every worker of a node announces them alike, when
#: they run one config.
_FROM_CONFIG = ("node", "type", "category", "capacity", "models", "lifecycle")


#: The most served names a probe's model list keeps in the heartbeat (`observed_models`): every
#: scheduler reads it with every snapshot, and a server may list 100,000 (about 1 MB).
MAX_OBSERVED = 1_000
#: The longest name kept of those the config does not give (a name a server gives a model is far
#: shorter), and the most those names take together as the heartbeat stores them (JSON, where an
#: emoji takes 12 bytes): a server listing 1,000 names of 3.9 KB each made heartbeats of 3.9 MB,
#: read by every scheduler's snapshot and every catalog
MAX_OBSERVED_CHARS = 256
MAX_OBSERVED_BYTES = 64 * 1024


def recorded(listed: list[str], configured: list[str]) -> list[str]:
    """The served names a probe saw, as the heartbeat keeps them, each once: those the config gives
    the provider first (what routing asks about), then others of at most `MAX_OBSERVED_CHARS`, up to
    `MAX_OBSERVED` names and `MAX_OBSERVED_BYTES` of them in all."""
    wanted = set(configured)
    seen: set[str] = set()
    mine: list[str] = []
    others: list[str] = []
    room = MAX_OBSERVED_BYTES
    for name in listed:
        if name in seen:
            continue
        seen.add(name)
        if name in wanted:
            mine.append(name)
        elif len(name) <= MAX_OBSERVED_CHARS and len(others) < MAX_OBSERVED and room > 0:
            room -= len(json.dumps(name))
            if room >= 0:
                others.append(name)
    return mine + others[:max(0, MAX_OBSERVED - len(mine))]


def probe_evidence(probe: ProbeResult, busy: bool) -> tuple[str, int]:
    """(evidence kind, strikes) of a probe's result: a timeout on a busy provider says nothing; a
    provider's answer that it is busy (429) is a sign of life (it answered, and took iop's key: a
    hosted API whose model list answered 429 from the start stayed `not probed yet` for good)."""
    if probe.health is Health.AVAILABLE or probe.busy:
        return "ok", 0
    if probe.timed_out and busy:
        return "", 0
    return "fail", probe.strikes


def _lacking(name: str, listed: list[str]) -> str:
    """A served name the provider's list lacks, as the warning names it: with the listed name it
    was likely meant as (`'Org/Alpha-7b' (it lists 'Org/Alpha-7B')`)."""
    near = near_name(name, listed)
    return repr(name) if near is None else f"{name!r} (it lists {near!r})"


def health_said(provider_id: str, health: Health, reason: str) -> str:
    """The log line of a provider's new health: `provider P is unavailable: why`, its id said once
    (a run's failure says `provider P: connection refused`, which came after it)."""
    why = reason.removeprefix(f"provider {provider_id}: ")
    return f"provider {provider_id} is {health.value}" + (f": {why}" if why else "")


def served_pairs(config: Config, node_id: str) -> list[str]:
    """`provider<TAB>model` for each model a provider of the node serves in `config`: what a worker
    of the node announces it serves (`keys.worker_serves`; ids are printable, never a tab)."""
    node = config.node(node_id)
    here = {p.id for p in node.providers} if node else set()
    return [f"{p}\t{m.id}" for m in config.models for p in m.providers if p in here]


class Heartbeats:
    def __init__(self, redis: Redis, config: Config, node_id: str, adapters: dict[str, Adapter],
                 instance: str = "", comeback: Comeback | None = None) -> None:
        """`instance`: the worker process's id (`new_worker_instance`), kept among the node's live
        workers (`keys.node_workers`) while it beats; '' for none. `comeback`: the worker's watch
        for Redis answering again, which its runs' writes and cancel listener pause on too, and which
        outlives the beats (they stop first, the runs' grace after; the worker closes it); without
        one, the heartbeats make their own and close it when they stop."""
        self.redis = redis
        self.instance = instance
        self.config = config
        self.node_id = node_id
        self.adapters = adapters
        self.scripts = Scripts(redis)
        node = config.node(node_id)
        assert node is not None
        self.providers = list(node.providers)
        #: what this worker serves (`keys.worker_serves`), rewritten with each beat
        self.serves = served_pairs(config, node_id)
        self.last: dict[str, Health] = {}
        self.wake = {p.id: asyncio.Event() for p in self.providers}
        self.probes: dict[str, asyncio.Task[None]] = {}
        #: (provider, exception type) of the probes that failed in the worker, each logged with its
        #: traceback once (a probe every few seconds would repeat it: 32 tracebacks a minute)
        self.probe_bugs: set[tuple[str, str]] = set()
        #: per provider, what each other worker of the node announced otherwise (`_warn_if_another_config`)
        self.disagreed: dict[str, dict[str, tuple[str, ...]]] = {}
        #: provider -> the served names its config gives it that its last model list lacked (said once a change)
        self.unlisted: dict[str, tuple[str, ...]] = {}
        #: the watch for Redis to answer again after it went away (`redis_lost`)
        self._own_comeback = comeback is None
        self.comeback = Comeback(redis) if comeback is None else comeback
        self.comeback.when_answered(self._beat_all)
        #: the beats stopped (`run` ended): an answer to the watch wakes none
        self._stopped = False
        #: when Redis last answered that watch (event loop time): a beat refused again within an
        #: interval of it does not start another (`_loop`)
        self._answered_at: float | None = None

    def _announce(self, pipe: Pipeline) -> None:
        """Add to `pipe` the writes of what this worker serves (`keys.worker_serves`), for its life."""
        if self.instance and self.serves:
            pipe.sadd(keys.worker_serves(self.instance), *self.serves)
            pipe.pexpire(keys.worker_serves(self.instance), self.config.runtime.heartbeat_ttl_ms)

    async def announce(self) -> None:
        """Say what this worker serves before it takes its first job (its beats say it again): a
        worker without its set takes every run it is handed."""
        pipe = self.redis.pipeline(transaction=False)
        self._announce(pipe)
        await pipe.execute()

    def nudge(self, provider_id: str) -> None:
        """New evidence about a provider: judge and publish its health now, not at the next beat."""
        event = self.wake.get(provider_id)
        if event is not None:
            event.set()

    def showed_life(self, provider_id: str) -> None:
        """A run succeeded there: that only changes its health if it was not available."""
        if self.last.get(provider_id) is not Health.AVAILABLE:
            self.nudge(provider_id)

    async def beat_once(self, provider: ProviderConfig) -> Health:
        """One heartbeat of `provider`. A key of it that holds another type than iop writes there (a
        string at `iop:provider:p` written by hand) is deleted, and said, and the beat made again:
        such a key failed every beat with WRONGTYPE, and every run of the provider's models with it,
        until someone deleted it (the hash lives only as long as beats renew it)."""
        try:
            return await self._beat(provider)
        except ResponseError as exc:
            if not is_wrongtype(exc) or not await self._heal(provider):
                raise
        return await self._beat(provider)

    async def _heal(self, provider: ProviderConfig) -> list[str]:
        """Delete the keys of `provider`'s beat that hold another type than iop writes there (none
        holds anything of iop's then); returns them."""
        wanted = {keys.heartbeat(provider.id): "hash", keys.leases(provider.id): "zset",
                  keys.node_workers(self.node_id): "zset", keys.BEATING: "zset"}
        if self.instance and self.serves:
            wanted[keys.worker_serves(self.instance)] = "set"
        return await delete_wrong_types(self.redis, wanted, log, f"provider {provider.id}")

    async def _beat(self, provider: ProviderConfig) -> Health:
        key = keys.heartbeat(provider.id)
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.zcount(keys.leases(provider.id), f"({now}", "+inf")
        self._announce(pipe)
        raw, in_flight, *_ = await pipe.execute()
        seen = as_text_map(raw)
        health, reason = judge(Evidence.from_hash(seen), int(in_flight))
        fields = heartbeat_fields(provider, self.node_id, health, reason, now, self.instance)
        self._warn_if_another_config(provider.id, seen, fields)
        changed = self.last.get(provider.id) is not health
        written = await self.scripts.call(
            "beat", [key, keys.node_workers(self.node_id), keys.BEATING],
            [seen.get(Field.OK_MS, ""), seen.get(Field.FAILS, ""), seen.get(Field.FAIL_MS, ""),
             self.config.runtime.heartbeat_ttl_ms, now, provider.id, self.instance,
             keys.SCHEDULER_SIGNALS if changed else "", *(x for pair in fields.items() for x in pair)])
        if not written:  # (a run's end or a probe changed the evidence since it was read: judged again)
            self.nudge(provider.id)
            return health
        if changed:  # (down is a WARNING: an operator's log filter at WARNING saw no provider go down)
            log.log(logging.WARNING if health is Health.UNAVAILABLE else logging.INFO, "%s",
                    health_said(provider.id, health, reason), extra={"provider": provider.id, "node": self.node_id})
        self.last[provider.id] = health
        await self._maybe_probe(provider, int(in_flight))
        return health

    def _warn_if_another_config(self, provider_id: str, seen: dict[str, str], mine: dict[str, str]) -> None:
        """Another worker of the node announced this provider otherwise (a rollout half done: its
        config differs): each beat's writer wins, so the capacity the scheduler dispatches against
        flips between them. Said once for each worker and disagreement, not every beat."""
        other = seen.get("worker", "")
        if not other or other == mine["worker"]:
            return
        differs = tuple(f"{f} {seen[f]} (this one's: {mine[f]})" for f in _FROM_CONFIG
                        if f in seen and seen[f] != mine[f])
        said = self.disagreed.setdefault(provider_id, {})
        if differs and said.get(other) != differs:
            log.warning("provider %s: worker %s of node %s announces %s: the provider's workers run different "
                        "configs, and each beat's writer wins (restart them with one config)", provider_id, other,
                        seen.get("node", "?"), "; ".join(differs))
        if len(said) >= 64:  # (workers come and go: those of long ago are forgotten)
            said.clear()
        said[other] = differs

    def _warn_if_unlisted(self, provider: ProviderConfig, listed: list[str]) -> None:
        """A served name the config gives the provider that its own model list lacks (a typo in the
        config, or a model the server does not have) takes none of that model's runs, though the
        provider is `available`: said at WARNING when the names lacking change, not every probe."""
        have = set(listed)
        lacking = tuple(name for name in provider.models if name not in have)
        if lacking == self.unlisted.get(provider.id, ()):
            return
        self.unlisted[provider.id] = lacking
        if lacking:
            which = "that model" if len(lacking) == 1 else "those models"
            log.warning("provider %s does not list %s, which its config gives it: no run of %s goes there "
                        "(check the served name in the config, or the server's models)", provider.id,
                        ", ".join(_lacking(name, listed) for name in lacking), which)
        else:
            log.info("provider %s lists every served name its config gives it", provider.id)

    # ------------------------------------------------------------------ probes
    def _probe_limit_s(self, provider: ProviderConfig) -> float:
        """The longest a whole probe may take (the OpenAI family makes up to two requests, vLLM three:
        its `/is_sleeping` too, whose timeout alone does not fail the probe; llama.cpp three when it
        asks a llama-server router's `/props`)."""
        requests = 3 if provider.type in ("vllm", "llamacpp") else 2
        return requests * provider.probe_timeout_ms / 1000 + 1.0

    async def _maybe_probe(self, provider: ProviderConfig, in_flight: int) -> None:
        running = self.probes.get(provider.id)
        if running is not None and not running.done():
            return
        interval = provider.probe_interval_ms or self.config.runtime.probe_interval_ms
        exclusive = provider.type in PROBE_DISTURBS
        claimed = await self.scripts.call(
            "probe", [keys.heartbeat(provider.id), keys.leases(provider.id), keys.probing(provider.id)],
            [interval, 1 if exclusive else 0, int(self._probe_limit_s(provider) * 1000),
             self.config.runtime.heartbeat_ttl_ms, DOWN, min(interval, self.config.runtime.heartbeat_interval_ms)])
        if claimed == 1:
            self.probes[provider.id] = asyncio.create_task(self._probe(provider, in_flight > 0))

    async def _probe(self, provider: ProviderConfig, busy: bool) -> None:
        limit_s = self._probe_limit_s(provider)
        try:
            async with asyncio.timeout(limit_s):
                probe = await self.adapters[provider.id].probe()
        except TimeoutError:
            probe = ProbeResult(Health.UNAVAILABLE, f"the probe got no answer within {int(limit_s * 1000)} ms",
                                strikes=1, timed_out=True)
        except Exception as exc:  # a bug, or an answer nothing foresaw: the probe's result is still recorded
            if (provider.id, type(exc).__name__) not in self.probe_bugs:
                self.probe_bugs.add((provider.id, type(exc).__name__))
                log.exception("probe of %s failed (logged once; its heartbeat's reason says so while it lasts)",
                              provider.id)
            probe = ProbeResult(Health.UNKNOWN, f"the probe failed in the worker ({type(exc).__name__})")
        try:
            if probe.timed_out and not busy:  # did runs start while it was out?
                busy = await self.redis.zcount(keys.leases(provider.id), f"({now_ms()}", "+inf") > 0
            kind, strikes = probe_evidence(probe, busy)
            observed = "-" if kind != "ok" else "" if probe.models is None else json.dumps(
                recorded(probe.models, provider.models))
            await self.scripts.call(
                "probed", [keys.heartbeat(provider.id), keys.probing(provider.id)],
                [kind, strikes, probe.reason, probe.health.value, observed, keys.SCHEDULER_SIGNALS])
        except REDIS_UNUSABLE as exc:
            log.warning("probe of %s: Redis unavailable (%s); its result is lost", provider.id, exc)
            return
        if kind == "ok" and probe.models is not None:
            self._warn_if_unlisted(provider, probe.models)
        if kind == "fail" or self.last.get(provider.id) is not Health.AVAILABLE:
            self.nudge(provider.id)

    # ------------------------------------------------------------------ loops
    async def _loop(self, provider: ProviderConfig) -> None:
        interval = self.config.runtime.heartbeat_interval_ms / 1000
        loop = asyncio.get_running_loop()
        wake = self.wake[provider.id]
        while True:
            began = loop.time()
            wake.clear()
            try:
                await self.beat_once(provider)
            except REDIS_UNUSABLE as exc:
                self.last.pop(provider.id, None)  # Redis may have lost it: announce it again
                log.warning("heartbeat of %s: Redis unavailable (%s)", provider.id, exc)
                if isinstance(exc, REDIS_DOWN) and not self._refused_since_answer(loop.time()):
                    self.redis_lost()  # (a full Redis answers: it is not awaited)
            except Exception:  # a bug in a probe must not silence the heartbeat for good
                self.last.pop(provider.id, None)
                log.exception("heartbeat of %s failed", provider.id)
            try:  # asyncio.timeout, not wait_for, which on Python 3.11 may drop a cancel
                async with asyncio.timeout(max(0.0, interval - (loop.time() - began))):
                    await wake.wait()
            except TimeoutError:
                pass

    def _refused_since_answer(self, now: float) -> bool:
        """Redis answered a PING less than an interval ago, and refused a beat since: it answers but
        does not take the beats (a read-only replica: a URL that names one, a primary demoted by
        hand), and watching for its answer again would wake every beat about three times a second
        (each refusal is redis-py's retries), each refused and logged. The beats keep their interval.
        (A reviewer: 10 'Redis answers again' and 30 refused beats in 5 s for 3 providers; now 2 and 12.)"""
        interval = self.config.runtime.heartbeat_interval_ms / 1000
        return self._answered_at is not None and now - self._answered_at < interval

    def redis_lost(self) -> None:
        """Redis went away (a beat failed; the cancel listener's failed subscription starts the same
        watch, `workers.service._listen_cancels`): every provider
        beats again as soon as it answers (`common.comeback`), not at its next beat. After an outage
        longer than `heartbeat_ttl_ms` (a restart, a Sentinel failover) every provider is `unknown`
        until then, and each caller meanwhile hears 503 no_available_provider: up to a whole
        interval of them (1,320 callers of 1,625 in the 2 s after a restart, with 2 s beats)."""
        self.comeback.watch()

    def _beat_all(self, was_away: bool) -> None:
        """Every provider beats now: Redis answers a PING after a watch began (a beat refused, a
        run's write, the cancel listener's subscription broken). An answer at once (it was not
        away, or came back before the first PING: a restart without data between two beats) wakes
        the beats once an interval at most: on a server that answers but refuses what the worker
        writes (a read-only replica), every running run's retried write watches again, and each
        answer woke every beat to be refused and logged."""
        if self._stopped:  # (the runs of a stopping worker watch on; no beat is left to wake)
            return
        now = asyncio.get_running_loop().time()
        recently = self._refused_since_answer(now)
        self._answered_at = now
        if was_away:
            log.info("Redis answers again: every provider of node %s beats now", self.node_id)
        elif recently:
            return
        for event in self.wake.values():
            event.set()

    async def run(self) -> None:
        try:
            await asyncio.gather(*(self._loop(p) for p in self.providers))
        finally:
            self._stopped = True
            if self._own_comeback:
                await self.comeback.close()
            for task in self.probes.values():
                task.cancel()
            await asyncio.gather(*self.probes.values(), return_exceptions=True)
