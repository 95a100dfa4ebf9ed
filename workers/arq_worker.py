"""An arq worker that picks jobs up when woken instead of polling.

arq polls its queue every `poll_delay` (0.5 s by default, measured here at 258 ms median
added latency per run). This worker blocks on the node's wake list instead: the dispatch
script LPUSHes the job id with every job it queues, so a job is claimed the moment it is
queued. The blocking `BLMOVE` (one id, to the worker's own list) goes out together with the Lua
script that takes the jobs and starts their runs (`take_woken`: that id and as many more as the
worker has free slots), and Redis runs the script as soon as the id comes: the wake-up and the
start are one round trip. The script replaces arq's WATCH/MULTI sequence, its job read and its
try counter; the run's `finish` script takes the job off the queue at the end, so arq writes no
result and deletes nothing per job.
arq's own poll iteration still runs when nothing woke the worker for `poll_delay` and
after the worker was full, as a safety net for tokens that were lost or trimmed.

A worker whose slots are all busy waits for one of its jobs to end instead of taking a
token, so an idle sibling process of the same node gets it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from arq.connections import ArqRedis, create_pool
from arq.constants import in_progress_key_prefix
from arq.worker import Worker
from redis.exceptions import ResponseError

from common import keys
from common.comeback import Comeback
from common.redisconn import REDIS_UNUSABLE, Backoff, connection_pool
from common.redisline import Line, new_line_of
from common.runlog import run_fields
from common.scripts import Scripts
from common.wrongtype import delete_wrong_types, is_wrongtype
from workers.runner import Runner, new_worker_instance

log = logging.getLogger("iop.worker")

#: How much later than its wait can last (`poll_delay`) a `take_woken` answer may come before the
#: worker checks the leases of the runs it started (see `_take_woken`).
LATE_ANSWER_S = 0.25

T = TypeVar("T")


async def until_redis_answers(step: Callable[[], Awaitable[T]]) -> T:
    """`step()` (a step of the worker's start that needs Redis: its first PING, loading the scripts,
    saying what it serves), tried again with backoff for as long as Redis is down or does not
    answer (paused, cut off: each try waits out the reply timeout), a WARNING for each failed try
    and no traceback; its result once Redis answers. A stop meanwhile cancels it."""
    backoff = Backoff()
    began = time.monotonic()
    while True:
        try:
            return await step()
        except REDIS_UNUSABLE as exc:
            log.warning("worker: waiting for Redis for %.1f s (%s); retrying in %.2fs",
                        time.monotonic() - began, str(exc) or type(exc).__name__, backoff.delay)
            await backoff.pause()


def arq_redis(url: str) -> ArqRedis:
    """arq's client over the same connection pool as every other service's: every parameter of
    the URL (TLS: `rediss://…?ssl_ca_certs=…`), Sentinel URLs included, and `client_options`.
    arq's own `RedisSettings.from_dsn` keeps only host, port, database, credentials and the
    scheme, and its Sentinel settings take neither a sentinel password nor TLS options."""
    return ArqRedis(connection_pool(url))


class WakeWorker(Worker):
    def __init__(self, *args: Any, wake_key: str, runner: Callable[[], Runner], **kwargs: Any) -> None:
        """`runner`: the node's runner, once the startup hook has made it."""
        super().__init__(*args, **kwargs)
        self.wake_key = wake_key
        self.runner = runner
        #: the in-progress marker of the jobs this worker takes (see `new_worker_instance`)
        self.instance = new_worker_instance()
        self._wake_line: Line | None = None
        #: `id:attempt` of each run the last `take_woken` answer this worker received started
        self._received: list[bytes] = []
        #: the attempt each task of `tasks` runs (job id -> `attempts`)
        self._attempts: dict[str, bytes | None] = {}
        #: (provider, model) of the runs this worker passed over, each said once (`_passed_over`)
        self._passed: set[tuple[str, str]] = set()
        #: the watch for Redis answering again after the main loop found it away
        self._comeback: Comeback | None = None
        #: whether `forget_health` was called (a stopping worker's, beside its runs' grace)
        self._health_forgotten = False
        #: whether its start (the startup hook included) is over: before that it took no job, wrote no
        #: health-check key, and has nothing to undo when it stops
        self.started = False
        #: called once its start is over (`serve`'s ready line)
        self.on_started: Callable[[], None] | None = None

    async def main(self) -> None:
        if self._pool is None:
            self._pool = await create_pool(
                self.redis_settings,
                job_deserializer=self.job_deserializer,
                job_serializer=self.job_serializer,
                default_queue_name=self.queue_name,
                expires_extra_ms=self.expires_extra_ms,
            )
        await self._first_connection()
        self._scripts = Scripts(self.pool)
        #: the wake list's own connection for its blocking pop (`common.redisline`), when the pool has lines
        self._wake_line = new_line_of(self.pool, "wake")
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)  # (its steps that need Redis wait for it: `until_redis_answers`)
        self.started = True
        # (said once it takes runs: before its startup hook, the line came before the hook's own waits
        # for Redis, and `serve`'s ready line before the first PING)
        log.info("worker for queue %s started, %d slots", self.queue_name, self.max_jobs)
        if self.on_started is not None:
            self.on_started()
        backoff = Backoff()
        self._comeback = Comeback(self.pool)
        poll = True
        while True:
            try:
                if poll:
                    await self._poll_iteration()
                poll = await self._wait_for_work()
                backoff.reset()
            except REDIS_UNUSABLE as exc:
                log.warning("worker: Redis unavailable (%s); retrying in %.2fs", exc, backoff.delay)
                await self._comeback.pause(backoff)  # (cut short when Redis answers again)
                poll = True
            except ResponseError as exc:
                if not is_wrongtype(exc) or not await self.heal():
                    raise
                poll = True

    async def heal(self) -> list[str]:
        """Delete the keys of the node's pick-up that hold another type than iop writes there (a
        `SET iop:node:n1 x`, `iop:wake:n1` or `iop:passed:n1` by hand: the worker's poll or its wake-up
        failed with WRONGTYPE and the worker exited, and every worker of the node after it, until
        someone deleted the key; such a key holds no job); returns them."""
        return await delete_wrong_types(self.pool, {
            self.queue_name: "zset", self.wake_key: "list", keys.node_passed(self.runner().node_id): "list",
            keys.worker_woken(self.instance): "list", keys.worker_answered(self.instance): "string"}, log, "worker")

    async def _first_connection(self) -> None:
        """Wait for Redis however long it takes to answer, as the scheduler does (arq's own
        start gives up after about six seconds)."""
        await until_redis_answers(self.pool.ping)

    async def _wait_for_work(self) -> bool:
        """Start what the wake list hands us. Returns whether a full poll is due."""
        self._forget_finished()
        if self.job_counter >= self.max_jobs:
            running = [t for t in self.tasks.values() if not t.done()]
            if running:
                await asyncio.wait(running, timeout=self.poll_delay_s, return_when=asyncio.FIRST_COMPLETED)
            else:
                # A job just ended but its done callback, which frees its slot, has not run yet: let
                # it. Nothing else on this path is sure to give the event loop a turn (arq's poll
                # sends nothing while the worker is full), so without this the worker would spin
                # here for good, full of nothing.
                await asyncio.sleep(0)
            return True
        taken, woken, refused = await self._take_woken(self.max_jobs - self.job_counter)
        await self._start(taken)
        if refused is not None:  # (its runs started: now the loop backs off)
            raise refused
        if not woken:
            return True  # nothing came for `poll_delay`: arq's poll is due (a safety net)
        # The runs just started call their providers before this worker blocks on the wake list
        # again: the next pop is not on their way.
        await asyncio.sleep(0)
        return False

    async def _take_woken(self, free: int) -> tuple[list[Any], bool, ResponseError | None]:
        """Block on the wake list until a job id comes (`BLMOVE` to this worker's own list), and
        take it with as many more as make `free` (the `take_woken` script), in one round trip:
        the script is sent with the blocking read and Redis runs it once the id is moved. Returns
        the script's answer, whether an id came before the wait's end (`poll_delay`), and the
        read's refusal, if Redis refused it (full) while it ran the script: the caller starts what
        the script took, then raises it."""
        script_keys = [self.queue_name, keys.worker_woken(self.instance), keys.worker_answered(self.instance),
                       self.wake_key, keys.node_passed(self.runner().node_id)]
        args = [*self._take_args(), free, *self._received]
        # (oldest first: `dispatch` LPUSHes)
        move = ("BLMOVE", self.wake_key, script_keys[1], "RIGHT", "LEFT", self.poll_delay_s)
        sent = time.monotonic()
        refused: ResponseError | None = None
        if self._wake_line is None:  # (a client not made by `common.redisconn`: fakeredis)
            woken = await self.pool.execute_command(*move)
            taken = await self._scripts.call("take_woken", script_keys, args)
        else:
            woken, taken = await self._scripts.send_after(self._wake_line, move, "take_woken", script_keys, args,
                                                          block_s=self.poll_delay_s)
            if isinstance(taken, ResponseError):
                raise taken
            if isinstance(woken, ResponseError):
                # A full Redis refuses the pop, while the script, sent with it, runs (its first
                # write frees): the runs it started are this worker's to run before it backs off.
                refused, woken = woken, None
        self._received = [b"%s:%s" % (started[0], started_attempt(started) or b"")
                          for started in taken if started[1] == b"ok"]
        if time.monotonic() - sent > self.poll_delay_s + LATE_ANSWER_S:
            # The script ran when an id came, and this process got its answer much later than the
            # wait can last: it was paused (SIGSTOP, a frozen VM) or starved. Its runs' leases may
            # have gone meanwhile, and the runs on with another worker: only those still leased run.
            taken = [started for started in taken if started[1] != b"ok" or await self._still_leased(started)]
        return taken, woken is not None, refused

    async def _still_leased(self, started: list[Any]) -> bool:
        """Whether a run `take_woken` started still holds its lease (renewed now, as a run does)."""
        record = dict(zip(started[2::2], started[3::2], strict=False))
        job_id = started[0].decode()
        provider = (record.get(b"provider") or b"").decode()
        held = await self._scripts.call(
            "renew", [keys.leases(provider), keys.run_record(job_id)],
            [job_id, self.runner().config.runtime.lease_ttl_ms, started_attempt(started) or b""])
        if held == 0:
            log.warning("its lease went while this worker was paused (its start's answer came late); not run here",
                        extra=run_fields(job_id, (record.get(b"model") or b"").decode() or None, provider=provider))
        return bool(held != 0)

    def _take_args(self) -> list[Any]:
        """The first arguments of the `take` scripts (their ARGV[1..13])."""
        runner = self.runner()
        return [in_progress_key_prefix, int(self.in_progress_timeout_s * 1000), keys.run_record(""),
                keys.run_events(""), keys.leases(""), *runner.start_args(), self.instance, keys.worker_serves(""),
                keys.node_workers(runner.node_id)]

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """arq's poll iteration hands its due jobs here; claim them the same one-trip way."""
        self._forget_finished()  # (a job id whose attempt here ended may be due again: a new attempt)
        free = self.max_jobs - self.job_counter
        ids = [i for i in (j.decode() for j in job_ids) if i not in self.tasks]  # (its own: see below)
        await self.claim_and_start(ids[:max(free, 0)])

    async def _poll_iteration(self) -> None:
        """arq's poll, which forgets the tasks of `tasks` that ended while it asked Redis: their
        attempts (`_attempts`) go with them (else each such run's stayed for the worker's life)."""
        try:
            await super()._poll_iteration()
        finally:
            for job_id in self._attempts.keys() - self.tasks.keys():
                del self._attempts[job_id]

    async def claim_and_start(self, job_ids: list[str]) -> None:
        """Take the jobs and start their runs in one round trip (the `take` script), then run each
        in a task of its own. arq's own per-job steps (reading the job, counting tries, writing a
        result) are not paid: the run record carries all of it, and the run's `finish` script
        takes the job off the queue. Never asks for a job it runs (`take` hands such a job over
        again, taking it for one whose answer was lost)."""
        self._forget_finished()  # (as in `start_jobs`)
        job_ids = [j for j in job_ids if j not in self.tasks]
        if job_ids:
            await self._start(await self._scripts.call("take", [self.queue_name], [*self._take_args(), *job_ids]))

    async def _start(self, taken: list[Any]) -> None:
        """Run each run a `take` script started in a task of its own (or log why it did not start).
        A job id is its run's id, the same for every attempt: an attempt this worker runs already
        (handed over again: its answer was lost) is not run twice, and a new attempt of a run whose
        last attempt's task is still ending here (its `finish` landed, its reply not yet) runs
        after that task. Ended tasks are not forgotten here: one that ended after the script ran,
        before its answer was read, ran the attempt the answer hands over again (forgotten first,
        that attempt went to the provider a second time)."""
        for started in taken:
            job_id = started[0].decode()
            if started[1] == b"passed":
                self._passed_over(job_id, started[2].decode(), started[3].decode())
                continue
            if started[1] != b"ok":
                await self.runner().run(job_id, started[1:])  # says why, in the log
                continue
            attempt = started_attempt(started)
            previous = self.tasks.get(job_id)
            if previous is not None and self._attempts.get(job_id) == attempt:
                continue  # (running here, or ended since the script ran)
            await self.sem.acquire()
            self.job_counter += 1
            run = partial(self.runner().run, job_id, started[1:])
            task = self.loop.create_task(run() if previous is None else _after(previous, run))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task
            self._attempts[job_id] = attempt

    def _passed_over(self, job_id: str, provider: str, model: str) -> None:
        """A run the `take` script left to the node's other workers: its provider or model is not in
        this worker's config. Said once for each provider and model, not for every run."""
        if (provider, model) in self._passed:
            return
        if len(self._passed) >= 64:
            self._passed.clear()
        self._passed.add((provider, model))
        runner = self.runner()
        served = runner.config.model(model)
        if runner.adapters.get(provider) is not None and served is not None and provider in served.providers:
            # (it serves them: its own `iop:serves` set is missing, Redis lost it, until its next beat)
            log.info("runs of model %r on provider %s are left to the node's other workers that say they serve them "
                     "until this worker's next heartbeat says it does too (Redis lost what it serves)", model, provider,
                     extra=run_fields(job_id, model, provider=provider))
            return
        log.warning("runs of model %r on provider %s are left to the node's other workers: this worker's config "
                    "lacks %s (a rollout half done: restart it with the config the schedulers run)", model, provider,
                    f"provider {provider}" if self.runner().adapters.get(provider) is None else f"model {model!r}",
                    extra=run_fields(job_id, model, provider=provider))

    async def forget_health(self, until: float | None = None) -> None:
        """arq's health-check key deleted, as arq's close does; Redis has until `until` (the event
        loop's time; None: the pool's reply timeout) to answer, else the key lapses by itself (iop
        reads it nowhere). A worker whose start is not over wrote no such key (the key is the node's:
        another worker's), and has nothing to delete."""
        if self._pool is None or not self.started:
            return
        self._health_forgotten = True
        try:
            async with asyncio.timeout_at(until):
                await self.pool.delete(self.health_check_key)
        except (TimeoutError, *REDIS_UNUSABLE) as exc:
            log.debug("worker: could not delete %s while stopping (%s)", self.health_check_key,
                      str(exc) or "no answer in time")

    async def close(self) -> None:
        """arq's close (its stats said, the health-check key deleted unless `forget_health` did, the
        shutdown hook, the pool closed), but a Redis that does not answer skips nothing."""
        if self._comeback is not None:
            await self._comeback.close()
        if not self._handle_signals:
            self.handle_sig(signal.SIGUSR1)  # (arq's: its stats said, any task left cancelled)
        if self._pool is None:
            return
        await asyncio.gather(*self.tasks.values())
        if not self._health_forgotten:
            await self.forget_health()
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        await self.pool.close(close_connection_pool=True)
        self._pool = None

    def _forget_finished(self) -> None:
        for job_id, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[job_id]
                self._attempts.pop(job_id, None)
                if task.cancelled():  # (a bug: a run's task ends as an outcome; this loop must go on)
                    log.error("a run's task ended cancelled", extra=run_fields(job_id, None))
                    continue
                task.result()  # surface a bug in run_job, as arq's own poll does


def started_attempt(started: list[Any]) -> bytes | None:
    """The attempt number (`attempts`) of a run a `take` script started: its answer is the job id,
    'ok', then the record's fields and values."""
    for i in range(2, len(started) - 1, 2):
        if started[i] == b"attempts":
            return bytes(started[i + 1])
    return None


async def _after(previous: asyncio.Task[Any], run: Callable[[], Awaitable[Any]]) -> Any:
    """`run()` once `previous` (the same run's last attempt here) has ended, however it ended."""
    await asyncio.wait([previous])
    return await run()
