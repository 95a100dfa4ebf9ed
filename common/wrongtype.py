"""Keys of iop's that hold another type than iop writes there (an operator's `redis-cli SET` by
hand, another app's): Redis answers every command of iop's on them WRONGTYPE, for good. Those
that hold nothing but what iop writes (a queue, a list of job ids, a stream of copies) are
deleted, and said, so the loop that met the error goes on (`workers.heartbeat` heals the keys
of a beat so)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common.redisconn import REDIS_UNUSABLE

T = TypeVar("T")


def is_wrongtype(exc: BaseException) -> bool:
    """Whether Redis refused a command (or a script's) on a key of another type."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)


async def read_or(read: Awaitable[T], missing: T) -> T:
    """What `read` (a command of redis-py's) answers, or `missing` when its key holds another type
    (nothing of iop's is there: read as no key). Any other error is raised."""
    try:
        return await read
    except ResponseError as exc:
        if not is_wrongtype(exc):
            raise
        return missing


def reply_or(reply: Any, missing: Any) -> Any:
    """A pipeline's reply (`execute(raise_on_error=False)`) as `read_or` takes a command's: `missing`
    for a key of another type, any other error raised."""
    if isinstance(reply, Exception):
        if not is_wrongtype(reply):
            raise reply
        return missing
    return reply


# Delete each of KEYS whose type is still neither ARGV's (the one iop writes there) nor none, at
# once: between a process's TYPE and its DEL another (a worker of the same node, a gateway's other
# caller) may have deleted it already and iop written there since (a job queued, a run in flight).
_DELETE_IF_WRONG = """
local gone = {}
for i, key in ipairs(KEYS) do
  local got = redis.call('TYPE', key)['ok']
  if got ~= ARGV[i] and got ~= 'none' then
    redis.call('DEL', key)
    gone[#gone + 1] = key
  end
end
return gone
"""


async def delete_wrong_types(redis: Redis, wanted: Mapping[str, str], log: logging.Logger, who: str) -> list[str]:
    """Delete the keys of `wanted` (key -> the type iop writes there, as TYPE names it: "stream",
    "zset", "list", "string", "hash", "set") that hold another type; a WARNING names each. Returns
    those found so, deleted here or, meanwhile, by another process that met them too (then only
    deleted if they hold another type still: iop may have written there since).
    Redis away (or full) meanwhile: nothing deleted, said, no error (the loops that heal here must go
    on: the one that met the key's error meets it again)."""
    try:
        pipe = redis.pipeline(transaction=False)
        for key in wanted:
            pipe.type(key)
        seen = {}
        for (key, want), got in zip(wanted.items(), await pipe.execute(), strict=True):
            got = got.decode(errors="replace") if isinstance(got, bytes) else got
            if got not in (want, "none"):
                seen[key] = (got, want)
        if not seen:
            return []
        gone = await redis.eval(_DELETE_IF_WRONG, len(seen), *seen, *(want for _, want in seen.values()))
    except REDIS_UNUSABLE as exc:
        log.warning("%s: could not delete a key of iop's of another type (Redis unavailable: %s)", who, exc)
        return []
    for key in (raw.decode() if isinstance(raw, bytes) else raw for raw in gone):
        log.warning("%s: %s held a %s, not the %s iop writes there (written by hand?): deleted",
                    who, key, *seen[key])
    return list(seen)
