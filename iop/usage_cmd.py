"""`iop usage`: runs and tokens per API key, model and UTC day, straight from Redis."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys

from common.config import Config
from common.redisconn import REDIS_DOWN, WHICH_REDIS, connect, redact
from common.usage import Usage, day_range, has_usage, key_names, model_asked, no_such_model, read_usage
from iop.catalog_cmd import table

COLUMNS = ("DATE", "KEY", "MODEL", "RUNS", "PROMPT", "COMPLETION", "TOTAL", "FAILURES")


def usage_table(rows: list[Usage]) -> str:
    return table(COLUMNS, [(r.date or "", r.key, r.model, str(r.runs), str(r.prompt_tokens), str(r.completion_tokens),
                            str(r.prompt_tokens + r.completion_tokens), str(r.failures)) for r in rows])


def main(config: Config, redis_url: str, key: str | None, model: str | None, since: str | None,
         until: str | None, as_json: bool) -> int:
    try:
        days = day_range(since, until, dt.datetime.now(dt.UTC).date())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = key_names(config)

    async def read() -> list[Usage] | None:
        redis = connect(redis_url)
        try:
            if key is not None and key not in names and not await has_usage(redis, key):
                return None
            return await read_usage(redis, [key] if key else names, days, model_asked(config, model))
        finally:
            await redis.aclose()

    try:
        rows = asyncio.run(read())
    except REDIS_DOWN as exc:
        print(f"error: cannot read Redis at {redact(redis_url)}: {exc} {WHICH_REDIS}", file=sys.stderr)
        return 1
    if rows is None:
        print(f"error: no key named {key!r} in the config (keys: {', '.join(names)}), and no usage kept under "
              "that name", file=sys.stderr)
        return 2
    if no_such_model(config, model, rows):
        print(f"error: no model named {model!r} in the config (models: {', '.join(m.id for m in config.models)}), "
              f"and no usage of one so named from {days[0]} to {days[-1]}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"object": "list", "start_date": days[0], "end_date": days[-1],
                          "data": [r.to_json() for r in rows]}, indent=2))
    else:
        print(usage_table(rows))
        if not rows:  # (a header alone read like a command that failed to print)
            print(f"(no runs from {days[0]} to {days[-1]} UTC)")
    return 0
