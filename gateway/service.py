"""`iop gateway`: serve the app until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.auth import KeyRing, UnresolvedKeys
from common.config import Config
from common.lifecycle import ready, stop_event
from common.listening import cannot_listen, listen_address
from common.redisconn import REDIS_DOWN
from gateway import metrics
from gateway.admission import TRIAGE_SLOTS, ConnectionGuard, ConnectionLimits
from gateway.app import RUNS, STOPPING, build_app
from gateway.auth import is_loopback
from gateway.connections import GuardedSite
from gateway.keys_reload import follow_keys
from gateway.stopping import stop_serving

log = logging.getLogger("iop.gateway")

#: File descriptors kept for everything but client and Redis connections (the listening socket,
#: standard streams, DNS, the event loop's own).
RESERVED_FDS = 64
#: How long run requests in flight get to end when the gateway stops (`iop gateway --grace`)
DEFAULT_GRACE_S = 10.0
#: How long what is left after them (runs-API followers, which resume with Last-Event-ID) gets
CLEANUP_TIMEOUT_S = 1.0
#: How long the gateway's start waits for Redis to say whether it takes the URL's database.
STARTUP_CHECK_S = 2.0


def raise_file_limit() -> int:
    """Each waiting caller holds a socket and a Redis connection: allow as many as the system does.
    Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fit_to_file_limit(max_connections: int, redis_connections: int, file_limit: int) -> tuple[int, int]:
    """(client connections, Redis connections) that fit in `file_limit` descriptors along with the
    triage slots and `RESERVED_FDS`: the configured ones, or both lowered in proportion."""
    room = max(file_limit - RESERVED_FDS - TRIAGE_SLOTS, 3)
    if max_connections + redis_connections <= room:
        return max_connections, redis_connections
    clients = max(1, room * max_connections // (max_connections + redis_connections))
    return clients, max(2, room - clients)


def _fitted(config: Config, file_limit: int) -> Config:
    rt = config.runtime
    clients, pooled = fit_to_file_limit(rt.max_connections, rt.redis_max_connections, file_limit)
    if (clients, pooled) == (rt.max_connections, rt.redis_max_connections):
        return config
    log.warning("runtime.max_connections (%d) and runtime.redis_max_connections (%d) need more file descriptors "
                "than the %d this process may open (ulimit -n): using %d and %d", rt.max_connections,
                rt.redis_max_connections, file_limit, clients, pooled)
    runtime = rt.model_copy(update={"max_connections": clients, "redis_max_connections": pooled})
    return config.model_copy(update={"runtime": runtime})


def keyring_for(config: Config, host: str, allow_anonymous: bool, environ: Mapping[str, str]) -> KeyRing | None:
    """The resolved API keys, or None to serve anyone: allowed on loopback, or when asked for.
    Exits with one clear line (or one per unset key variable) otherwise."""
    if config.auth is None:
        if not (is_loopback(host) or allow_anonymous):
            where = host or "every address"
            raise SystemExit(f"iop gateway: refusing to serve anyone who can reach {where} without API keys: add "
                             "auth.keys to the config, serve on loopback only (--host 127.0.0.1), or pass "
                             "--allow-anonymous")
        return None
    try:
        return KeyRing.from_config(config.auth, environ)
    except UnresolvedKeys as exc:
        raise SystemExit("\n".join(f"error: {e}" for e in exc.errors)) from None


async def _refused_database(redis: Redis) -> None:
    """A Redis that answers and refuses the URL's database stops the gateway before it listens
    (`DatabaseRefused`, its one line), as it stops the other services. A Redis that does not answer
    yet is waited for as ever: the gateway answers 503 until it does."""
    try:
        async with asyncio.timeout(STARTUP_CHECK_S):
            await redis.ping()
    except (TimeoutError, RedisError, *REDIS_DOWN):  # (an ACL user without PING: /readyz says so)
        pass


async def serve(config: Config, redis_url: str, host: str, port: int, keyring: KeyRing | None = None,
                grace_s: float = DEFAULT_GRACE_S, config_path: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT; then stop listening and give the run requests in flight
    `grace_s` seconds to end, or until a second SIGTERM/SIGINT (`gateway.stopping`). The keys follow
    the file at `config_path` (`gateway.keys_reload`)."""
    started, config = config, _fitted(config, raise_file_limit())
    stop = stop_event()
    app = build_app(config, redis_url, keyring)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=CLEANUP_TIMEOUT_S)
    await runner.setup()
    try:
        await _refused_database(app[RUNS].redis)
    except SystemExit:
        await runner.cleanup()
        raise
    guard = ConnectionGuard(ConnectionLimits.from_runtime(config.runtime))
    metrics.watch_connections(guard)
    site = GuardedSite(runner, host, port, guard, backlog=1024, access_log=None)
    try:
        await site.start()
    except OSError as exc:  # a name that does not resolve (socket.gaierror), a port in use, no permission
        await runner.cleanup()
        raise cannot_listen("", host, port, exc) from None
    bound = runner.addresses[0][1] if runner.addresses else port
    ready(f"iop gateway listening on http://{listen_address(host, bound)}")
    following = None if keyring is None or config_path is None else asyncio.create_task(
        follow_keys(config_path, started, keyring), name="keys")
    try:
        await stop.wait()
    finally:
        if following is not None:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        stop.clear()  # (a second SIGTERM or SIGINT sets it again: the grace is cut short)
        await stop_serving(runner, app[STOPPING], grace_s, cut=stop)
        await runner.cleanup()
    log.info("iop gateway stopped")
