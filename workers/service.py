"""`iop worker --node ID`: the arq worker of one node, with its heartbeats and cancel listener."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, cast

import aiohttp
from arq.constants import in_progress_key_prefix
from arq.worker import func

from common import keys
from common.codec import pack, unpack
from common.comeback import Comeback
from common.config import Config, ProviderConfig, RuntimeConfig
from common.redisconn import REDIS_REFUSED, REDIS_UNUSABLE, Backoff, connect
from common.shown import counted
from common.subscription import messages, subscribe
from common.wire import ErrorCode, ErrorInfo
from common.wrongtype import reply_or
from workers import metrics as worker_metrics
from workers.adapters.base import DEFAULT_LIMITS, Adapter, ReadLimits
from workers.adapters.cli import CliAdapter
from workers.adapters.credentials import sendable
from workers.adapters.ollama import OllamaAdapter
from workers.adapters.openai_compat import OpenAICompatAdapter
from workers.adapters.proxies import Proxy, ProxyError, proxy_for
from workers.adapters.sending import PoolConnector
from workers.arq_worker import WakeWorker, arq_redis, until_redis_answers
from workers.heartbeat import Heartbeats
from workers.runner import Runner

log = logging.getLogger("iop.worker")

RUNNER_CTX = "iop_runner"
#: The worker's heartbeats task (in its ctx), stopped first when it stops
HEARTBEATS_CTX = "iop_heartbeats"
#: The worker's watch for Redis answering again (its heartbeats', runs' and cancel listener's), in its
#: ctx: closed last, once its runs ended (the heartbeats stop before their grace)
COMEBACK_CTX = "iop_comeback"
#: How long the runs a stopping worker cancelled (its grace ran out) may take to record their end
#: (milliseconds, with Redis answering) before the worker stops without it (`serve`). Its other
#: writes to Redis as it stops go on beside the grace and within it: so a worker whose Redis does
#: not answer exits this long past its grace (and the few ms its close takes), well within the 5 s
#: past it that compose.yaml's stop timeout gives (15 s, grace 10 s).
END_RECORD_S = 2.0


def read_limits(runtime: RuntimeConfig) -> ReadLimits:
    return ReadLimits(runtime.max_response_bytes, runtime.max_line_bytes, runtime.max_error_chars)


def make_adapter(provider: ProviderConfig, session: aiohttp.ClientSession,
                 secret_env: frozenset[str] = frozenset(), limits: ReadLimits = DEFAULT_LIMITS,
                 proxy: Proxy | None = None) -> Adapter:
    if provider.type == "ollama":
        return OllamaAdapter(provider, session, limits, proxy)
    if provider.type == "cli":
        return CliAdapter(provider, secret_env - {provider.api_key_env or ""}, limits)
    return OpenAICompatAdapter(provider, session, limits, proxy)  # vllm, sglang, llamacpp, lemonade, openai_api


def secret_env_names(config: Config) -> frozenset[str]:
    """The environment variables that hold the pool's secrets, which no CLI tool is given: every
    provider's API key (`api_key_env`), and every caller's and operator's key (`auth.keys[].env`:
    a worker started with the gateway's environment, as `iop dev` and a shared env file start it,
    holds them, and a caller's tool could print the operator's key)."""
    names = {p.api_key_env for n in config.nodes for p in n.providers if p.api_key_env}
    if config.auth is not None:
        names |= {k.env for k in config.auth.keys if k.env}
    return frozenset(names)


def proxies(providers: Iterable[ProviderConfig], environ: Mapping[str, str]) -> dict[str, Proxy]:
    """The HTTP proxy of each provider whose requests go through one (`proxy_for`); a proxy that
    cannot be used stops the worker, naming the provider and the variable."""
    out: dict[str, Proxy] = {}
    for p in providers:
        if p.type == "cli" or not p.base_url:
            continue
        try:
            proxy = proxy_for(p.base_url, environ)
        except ProxyError as exc:
            raise SystemExit(f"error: provider {p.id}: {exc}") from None
        if proxy is not None:
            out[p.id] = proxy
    return out


def key_warnings(providers: Iterable[ProviderConfig], environ: Mapping[str, str]) -> list[str]:
    """A warning for each provider whose `api_key_env` names a variable `environ` lacks or holds
    empty (the worker sends its requests without a key: a hosted API will refuse them), or holds a
    key with whitespace at its start or end (a Windows line end of an env file: sent without it, as
    a header could not carry it), or holds inside it what no header can carry (sent without a key).
    """
    warnings = []
    for p in providers:
        value = environ.get(p.api_key_env) if p.api_key_env else None
        if p.api_key_env and not (value or "").strip():
            state = "not set" if value is None else "empty (or only whitespace)"
            warnings.append(f"provider {p.id}: its api_key_env {p.api_key_env} is {state} in this worker's "
                            "environment; its requests go without an API key")
        elif value is not None and not sendable(value.strip()):
            warnings.append(f"provider {p.id}: its api_key_env {p.api_key_env} holds a key with a character no "
                            "header can carry (a line break inside it?); its requests go without an API key")
        elif value is not None and value != value.strip():
            warnings.append(f"provider {p.id}: its api_key_env {p.api_key_env} holds a key with whitespace at its "
                            "start or end (a line end of the file it came from?); it is sent without it")
    return warnings


async def run_job(ctx: dict[str, Any], run_id: str) -> str:
    runner: Runner = ctx[RUNNER_CTX]
    return await runner.execute(run_id)


async def _listen_cancels(runner: Runner, node_id: str, comeback: Comeback) -> None:
    """`comeback`: the worker's watch for Redis answering again (its heartbeats'): a failed
    subscription (Redis went away, or moved) starts it, and the pause before subscribing again ends
    when Redis answers (`Comeback.pause`), as every other loop's does; the heartbeats beat then."""
    backoff = Backoff()
    while True:
        pubsub = runner.redis.pubsub()
        try:
            await subscribe(pubsub, keys.node_cancel(node_id))  # (applied: then the look below misses nothing)
            backoff.reset()
            for run_id in await _cancelled_unheard(runner):
                await _cancel(runner, run_id)
            async for msg in messages(pubsub):  # (a dead subscription raises: subscribed again)
                await _cancel(runner, msg["data"].decode(errors="replace"))  # (no run has a name that is not text)
        except REDIS_REFUSED as exc:
            log.warning("cancel listener: Redis unavailable (%s); subscribing again", exc)
            await comeback.pause(backoff)
        except Exception:  # (a bug must not leave the worker deaf to cancels for good)
            log.exception("cancel listener failed; subscribing again")
            await backoff.pause()
        finally:
            await pubsub.aclose()


async def _cancel(runner: Runner, run_id: str) -> None:
    att = runner.running.get(run_id)
    if att is None:  # (not here, or not yet: its start's answer may be on its way, `Runner.heard_cancel`)
        runner.heard_cancel(run_id)
        return
    if att[0].cancelled is not None:  # (being cancelled)
        return
    if runner.cancel(run_id, await runner.why_cancelled(run_id)):
        log.info("cancel requested", extra=att[0].log())


async def _cancelled_unheard(runner: Runner) -> list[str]:
    """The runs running here whose cancel was published while no subscription listened (the
    listener's connection was dead or being made again): their records say so (`cancel`)."""
    run_ids = [run_id for run_id, (att, _) in runner.running.items() if att.cancelled is None]
    if not run_ids:
        return []
    async with runner.redis.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hget(keys.run_record(run_id), "cancel")
        # (a record of another type, written by hand, says no cancel: not every look failed at it, the
        # listener deaf meanwhile)
        flags = [reply_or(flag, None) for flag in await pipe.execute(raise_on_error=False)]
    return [run_id for run_id, flag in zip(run_ids, flags, strict=True) if flag == b"1"]


def provider_session() -> aiohttp.ClientSession:
    """The HTTP client of a worker's adapters, shared by every run of the node. It keeps no
    cookies: a provider's `Set-Cookie` (a hosted API's load balancer, say) answers one caller's run
    and must not ride along on the next caller's. Its connector says which requests go out on a
    pooled connection (`workers.adapters.sending`)."""
    return aiohttp.ClientSession(connector=PoolConnector(limit=0, ttl_dns_cache=300),
                                 cookie_jar=aiohttp.DummyCookieJar())


def build_worker(config: Config, redis_url: str, node_id: str, max_jobs: int | None = None) -> WakeWorker:
    node = config.node(node_id)
    if node is None:
        raise SystemExit(f"error: node {node_id!r} is not in the config (nodes: {[n.id for n in config.nodes]})")
    if not node.providers:
        where = f"nodes[{config.nodes.index(node)}].providers"
        raise SystemExit(f"error: node {node_id!r} has no providers ({where} is empty): its worker would have nothing "
                         "to run")
    background: list[asyncio.Task[Any]] = []
    via = proxies(node.providers, os.environ)

    async def startup(ctx: dict[str, Any]) -> None:
        for warning in key_warnings(node.providers, os.environ):
            log.warning("%s", warning)
        for pid, proxy in via.items():
            log.info("provider %s: requests go through the proxy %s (%s)", pid, proxy.url, proxy.variable)
        redis = connect(redis_url, client_name="iop-worker")
        session = provider_session()
        secrets = secret_env_names(config)
        adapters = {p.id: make_adapter(p, session, secrets, read_limits(config.runtime), via.get(p.id))
                    for p in node.providers}
        # (the worker's, not the heartbeats': they stop first on SIGTERM, and the runs' writes in the
        # grace after still pause on it; closed once every run ended, `shutdown`)
        comeback = ctx[COMEBACK_CTX] = Comeback(redis)
        heartbeats = Heartbeats(redis, config, node_id, adapters, worker.instance, comeback=comeback)
        runner = Runner(redis, config, node_id, adapters, on_strike=heartbeats.nudge, on_life=heartbeats.showed_life,
                        comeback=comeback)
        ctx[RUNNER_CTX] = runner
        ctx["iop_session"] = session
        # (a Redis that stops answering here, after the first PING, is waited for as one down at the start)
        await until_redis_answers(runner.scripts.load)
        # (before its first take: a worker without its set is not checked)
        await until_redis_answers(heartbeats.announce)
        ctx[HEARTBEATS_CTX] = asyncio.create_task(heartbeats.run())
        background.append(ctx[HEARTBEATS_CTX])
        background.append(asyncio.create_task(_listen_cancels(runner, node_id, comeback)))

    async def shutdown(ctx: dict[str, Any]) -> None:
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        comeback: Comeback | None = ctx.get(COMEBACK_CTX)
        if comeback is not None:
            await comeback.close()
        runner: Runner | None = ctx.get(RUNNER_CTX)
        if runner is not None:
            await runner.redis.aclose()
        session = ctx.get("iop_session")
        if session is not None:
            await session.close()

    slots = max_jobs or sum(p.capacity for p in node.providers)
    worker = WakeWorker(
        functions=[func(run_job, name=keys.JOB_FUNCTION, max_tries=1)],  # (arq's own loop never runs it)
        queue_name=keys.node_queue(node_id),
        health_check_key=keys.node_health(node_id),
        wake_key=keys.node_wake(node_id),
        runner=lambda: cast(Runner, worker.ctx[RUNNER_CTX]),
        redis_pool=arq_redis(redis_url),  # the URL's parameters (TLS) too, unlike RedisSettings.from_dsn
        max_jobs=slots,
        job_timeout=7 * 24 * 3600,  # runs enforce their own execution timeout
        keep_result=0,
        poll_delay=1.0,
        on_startup=startup,
        on_shutdown=shutdown,
        retry_jobs=False,  # the run itself is requeued by its finish script
        job_serializer=pack,
        job_deserializer=unpack,
        handle_signals=False,  # `serve` owns SIGTERM/SIGINT and stops gracefully
        max_burst_jobs=-1,
    )
    return worker


async def leave_node(worker: WakeWorker, config: Config, node_id: str, until: float | None = None) -> None:
    """This worker stops (its pick-up loop and heartbeats have): if it was the node's last live one,
    the `worker_left` script takes its providers' heartbeats away and queues again the runs
    dispatched to the node that no worker took, now rather than after heartbeat_ttl_ms and their
    leases. `until`: the event loop's time by which Redis must have answered (`serve`: the end of
    the runs' grace), else the worker goes without it, as one killed would."""
    runner: Runner | None = worker.ctx.get(RUNNER_CTX)
    node = config.node(node_id)
    if runner is None or node is None:
        return
    lost = ErrorInfo(ErrorCode.WORKER_LOST, f"the last worker of node {node_id} stopped before taking the run")
    try:
        async with asyncio.timeout_at(until):  # (asyncio.timeout, not wait_for, which may drop a cancel on 3.11)
            last, requeued = await runner.scripts.call(
                "worker_left",
                [keys.node_workers(node_id), keys.node_queue(node_id), keys.node_wake(node_id),
                 *(keys.heartbeat(p.id) for p in node.providers)],
                [worker.instance, in_progress_key_prefix, pack(lost.to_wire()), keys.SCHEDULER_SIGNALS,
                 config.runtime.run_ttl_s])
    except (TimeoutError, *REDIS_UNUSABLE) as exc:
        log.warning("worker: Redis unavailable while stopping (%s): the node's providers lapse with their "
                    "heartbeats", str(exc) or "no answer within the stop's grace")
        return
    if last:
        log.info("the node's last worker stops: its providers take no runs until a worker starts (no "
                 "heartbeat); %s no worker took queued again", counted(requeued, "run"))


async def serve(config: Config, redis_url: str, node_id: str, grace_s: float = 10.0,
                metrics_port: int | None = None, metrics_host: str = "0.0.0.0") -> None:
    """Run until SIGTERM/SIGINT; then take no new jobs, let running ones finish for up to
    `grace_s`, and cancel the rest (each is requeued or failed, its slot released). Redis answering
    or not, it exits at most `END_RECORD_S` past the grace."""
    from common.lifecycle import ready, stop_event

    stop = stop_event()
    worker = build_worker(config, redis_url, node_id)
    # (first: a metrics port it cannot listen on ends the process before it takes any job)
    ops = None if metrics_port is None else await worker_metrics.serve_metrics(
        config, redis_url, node_id, metrics_host, metrics_port)
    # (the ready line once its start is over, Redis answering: it came before the first PING)
    worker.on_started = lambda: ready(
        f"iop worker for node {node_id} running ({worker.max_jobs} slot{'' if worker.max_jobs == 1 else 's'})")
    main = asyncio.create_task(worker.async_run())
    if ops is not None:
        ready(f"metrics on {ops.url}")
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([main, stopped], return_when=asyncio.FIRST_COMPLETED)
    loop = asyncio.get_running_loop()
    graced = loop.time() + grace_s  # (the end of the runs' grace, counted from the stop)
    # (the loop ends only when stopped: one that ended by itself, cancelled included, failed)
    crashed = main.done()
    if crashed:
        log.error("worker loop failed", exc_info=None if main.cancelled() else main.exception())
    # Take no new jobs: stop the pick-up loop; the jobs run in tasks of their own. And stop saying
    # the node's providers can take runs: while another worker of the node lives, its heartbeats
    # still do; when this was the last, its providers' heartbeats go at once (as if they had
    # lapsed: new runs go elsewhere or get 503, waiting runs wait) and the runs sent here that no
    # worker took go back to their queues (`leave_node`). That goes on beside the runs' grace, and
    # within it, with arq's health-check key deleted: a Redis that did not answer them held the
    # grace back by its reply timeout (5 s), and the close after it by as much again.
    main.cancel()
    beating = worker.ctx.get(HEARTBEATS_CTX)
    if beating is not None:
        beating.cancel()
    stopped.cancel()
    await asyncio.gather(main, stopped, *([beating] if beating is not None else []), return_exceptions=True)
    # (a worker stopped before its start was over, waiting for Redis, took nothing and is in no set:
    # it has nothing to write, and Redis, paused, would hold it to its grace)
    leaving = asyncio.gather(leave_node(worker, config, node_id, until=graced) if worker.started else asyncio.sleep(0),
                             worker.forget_health(until=graced))
    jobs = [t for t in worker.tasks.values() if not t.done()]
    if jobs:
        log.info("stopping: waiting up to %.1fs for %d runs", grace_s, len(jobs))
        _, pending = await asyncio.wait(jobs, timeout=max(0.0, graced - loop.time()))
        for t in pending:
            t.cancel()
        if pending:
            # A cancelled run records its end (in ms, Redis willing). One that cannot (Redis paused or
            # cut off: it would retry for as long as its lease lasts) is let go, as if this worker
            # had been killed: its lease lapses and the scheduler takes the run back.
            _, unrecorded = await asyncio.wait(pending, timeout=END_RECORD_S)
            if unrecorded:
                log.warning("stopping: %d runs could not record their end in %.0fs (Redis does not answer); "
                            "their leases will lapse and the scheduler take them back", len(unrecorded), END_RECORD_S)
            for t in unrecorded:
                t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await leaving  # (over by the grace's end at the latest)
    # Every job is done now. (arq's close gathers them again and would raise a cancelled one's
    # CancelledError, skipping the shutdown hook: the traceback, an unclosed HTTP session, status 1.)
    worker.tasks.clear()
    await worker.close()
    if ops is not None:
        await ops.close()
    if crashed:
        raise SystemExit(1)
    log.info("iop worker for node %s stopped", node_id)
