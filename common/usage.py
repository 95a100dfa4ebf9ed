"""Usage per API key, model and UTC day, read back from the hashes `common.scripts` fills when
a run ends (`keys.usage_day`, `keys.usage_total`): runs, prompt and completion tokens (those of
the `usage` the caller got), failures. Shared by `GET /v1/usage`, `iop usage` and the gateway's
usage counters."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.auth import ANONYMOUS, KeyRing
from common.config import Config
from common.shown import quoted
from common.wrongtype import reply_or

#: The most days one question may cover.
MAX_DAYS = 366
#: Days asked for when no range is given: the last 30, today included.
DEFAULT_DAYS = 30


@dataclass(slots=True)
class Usage:
    key: str
    model: str
    date: str | None  # None: all time
    runs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failures: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"object": "usage", "key": self.key, "model": self.model}
        if self.date is not None:
            out["date"] = self.date
        out.update(runs=self.runs, prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                   total_tokens=self.prompt_tokens + self.completion_tokens, failures=self.failures)
        return out


def key_names(config: Config, ring: KeyRing | None = None) -> list[str]:
    """The names usage is kept under: every configured key, or `anonymous` without keys. With `ring`
    (a gateway's keys, which follow its config file: `gateway.keys_reload`), the keys it holds now."""
    if ring is not None:
        return [principal.name for _, principal in ring.entries]
    return [k.name for k in config.auth.keys] if config.auth is not None else [ANONYMOUS]


def model_asked(config: Config, name: str | None) -> str | None:
    """The model a filter names: the model's id when `name` is one of its aliases (runs, and so
    usage, are the model's); else `name` as given (a model no longer configured keeps its usage)."""
    named = config.model_named(name) if name else None
    return named.id if named is not None else name


def no_such_model(config: Config, name: str | None, rows: list[Usage]) -> bool:
    """Whether a filter names a model the config lacks and of which no usage was found: a typo, which
    is said (an empty answer read as "no usage"), not a model since removed whose usage is kept."""
    return name is not None and config.model_named(name) is None and not rows


async def has_usage(redis: Redis, key_name: str) -> bool:
    """Whether usage is kept under this name (a key removed from the config keeps its usage)."""
    return bool(await redis.exists(keys.usage_total(key_name)))


#: a day as the API and the CLI take it: ASCII digits, dashes, nothing else (`fromisoformat` also
#: takes `YYYYMMDD` and ISO week dates such as `2026-W48-1`)
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


class DayError(ValueError):
    """What is wrong with a range of days; `end` says which end is at fault: `start` or `end`."""

    def __init__(self, message: str, end: str) -> None:
        super().__init__(message)
        self.end = end


def parse_day(text: str, what: str, end: str) -> dt.date:
    """A `YYYY-MM-DD` day, or DayError naming `what`."""
    try:
        day = dt.date.fromisoformat(text) if _DAY.fullmatch(text) else None
    except ValueError:
        day = None
    if day is None:
        raise DayError(f"{what} must be a day written YYYY-MM-DD, got {quoted(text, 40)}", end)
    return day


def day_range(since: str | None, until: str | None, today: dt.date) -> list[str]:
    """The days from `since` to `until` (inclusive; defaults: the last `DEFAULT_DAYS` days, from
    the first day there is when `until` is earlier), or DayError saying what is wrong with them."""
    last = parse_day(until, "the end date", "end") if until else today
    if since:
        first = parse_day(since, "the start date", "start")
    else:
        first = dt.date.fromordinal(max(1, last.toordinal() - (DEFAULT_DAYS - 1)))
    if first > last:
        raise DayError(f"the start date {first} is after the end date {last}", "start")
    span = (last - first).days + 1
    if span > MAX_DAYS:  # (the end the caller gave: the start alone, or the end)
        raise DayError(f"at most {MAX_DAYS} days at once ({first} to {last} is {span})",
                       "start" if since and not until else "end")
    return [(first + dt.timedelta(days=i)).isoformat() for i in range(span)]


def _rows(key: str, date: str | None, raw: dict[bytes, bytes], model: str | None) -> list[Usage]:
    rows: dict[str, Usage] = {}
    for name, value in raw.items():
        metric, _, model_id = name.decode(errors="replace").partition(":")
        if metric not in keys.USAGE_FIELDS or not model_id or (model is not None and model_id != model):
            continue
        if not value.isdigit():  # (written by hand: no count, left out, not the whole answer failed)
            continue
        row = rows.setdefault(model_id, Usage(key, model_id, date))
        setattr(row, metric, int(value))
    return [rows[m] for m in sorted(rows)]


async def read_usage(redis: Redis, key_names: Iterable[str], days: Sequence[str],
                     model: str | None = None) -> list[Usage]:
    """One row per key, day and model that has usage, in that order (one pipeline)."""
    names = list(key_names)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        for day in days:
            pipe.hgetall(keys.usage_day(name, day))
    replies = iter([reply_or(r, {}) for r in await pipe.execute(raise_on_error=False)])  # (another type: none)
    return [row for name in names for day in days for row in _rows(name, day, next(replies), model)]


async def read_totals(redis: Redis, key_names: Iterable[str]) -> list[Usage]:
    """All-time usage, one row per key and model."""
    names = list(key_names)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.usage_total(name))
    replies = [reply_or(r, {}) for r in await pipe.execute(raise_on_error=False)]  # (another type: none)
    return [row for name, raw in zip(names, replies, strict=True) for row in _rows(name, None, raw, None)]
