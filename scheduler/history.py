"""The load sampler of a scheduler replica: offers a sample of the pool every
`runtime.history_interval_ms`; the `history` script keeps one writer at a time (`common.history`)."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.config import Config
from common.failover import first_line
from common.history import offer_sample
from common.redisconn import REDIS_UNUSABLE, now_ms
from common.wrongtype import delete_wrong_types, is_wrongtype

log = logging.getLogger("iop.scheduler")


async def sample_forever(redis: Redis, config: Config) -> None:
    """Until cancelled. A Redis outage or a bug only costs the samples it spans."""
    interval_s = config.runtime.history_interval_ms / 1000
    while True:
        try:
            await offer_sample(redis, config, now_ms())
        except REDIS_UNUSABLE as exc:
            log.debug("history: Redis unavailable (%s); no sample this time", exc)
        except RedisError as exc:
            # (the history of another type, written by hand, `SET iop:history x`: it holds no sample, and
            # every sample failed, and every read of the catalog's charts, for good: it goes; a key of a
            # provider's of another type fails its read each time until its worker's beat heals it)
            if not (is_wrongtype(exc) and await delete_wrong_types(redis, {keys.HISTORY_STREAM: "stream"}, log,
                                                                   "history")):
                log.warning("history: Redis refused a read (%s); no sample this time", first_line(exc))
        except Exception:
            log.exception("history: could not take a sample")
        await asyncio.sleep(interval_s)
