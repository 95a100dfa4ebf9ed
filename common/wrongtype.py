"""Keys of iop's that hold another type than iop writes there (an operator's `redis-cli SET` by
hand, another app's): Redis answers every command of iop's on them WRONGTYPE, for good. Those
that hold nothing but what iop writes (a queue, a list of job ids, a stream of copies) are
deleted, and said, so the loop that met the error goes on (`workers.heartbeat` heals the keys
of a beat so)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from redis.asyncio import Redis
from redis.exceptions import ResponseError


def is_wrongtype(exc: BaseException) -> bool:
    """Whether Redis refused a command (or a script's) on a key of another type."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)


async def delete_wrong_types(redis: Redis, wanted: Mapping[str, str], log: logging.Logger, who: str) -> list[str]:
    """Delete the keys of `wanted` (key -> the type iop writes there, as TYPE names it: "stream",
    "zset", "list", "string", "hash", "set") that hold another type; a WARNING names each. Returns them."""
    pipe = redis.pipeline(transaction=False)
    for key in wanted:
        pipe.type(key)
    wrong = []
    for (key, want), got in zip(wanted.items(), await pipe.execute(), strict=True):
        got = got.decode(errors="replace") if isinstance(got, bytes) else got
        if got not in (want, "none"):
            wrong.append(key)
            log.warning("%s: %s held a %s, not the %s iop writes there (written by hand?): deleted",
                        who, key, got, want)
    if wrong:
        await redis.delete(*wrong)
    return wrong
