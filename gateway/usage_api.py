"""`GET /v1/usage`: runs and tokens per API key, model and UTC day.

A caller key sees its own usage; an operator key every key's. Filters: `key`, `model` (an alias
names its model), `start_date` and `end_date` (`YYYY-MM-DD`, inclusive; default the last 30 days, at most 366).
A key the request may not see, or that does not exist, is a 404 like any other. An operator may
ask for a key no longer in the config by name (`key=`): its usage stays in Redis.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from aiohttp import web
from redis.asyncio import Redis

from common.config import Config
from common.shown import quoted
from common.usage import DayError, day_range, has_usage, key_names, model_asked, no_such_model, read_usage
from common.wire import ErrorCode
from gateway.auth import KEYRING, principal
from gateway.errors import ApiError, invalid
from gateway.requests import query_value


def setup(app: web.Application, config: Config, redis: Callable[[], Redis]) -> None:
    async def usage(request: web.Request) -> web.Response:
        who = principal(request)
        known = key_names(config, request.app.get(KEYRING))  # (the keys as a reload left them)
        asked = query_value(request, "key")
        visible = known if who.operator else [who.name]
        if asked is not None and asked not in visible and not (who.operator and await has_usage(redis(), asked)):
            raise ApiError(ErrorCode.NOT_FOUND, f"no usage of a key named {quoted(asked)}", param="key")
        try:
            days = day_range(query_value(request, "start_date"), query_value(request, "end_date"),
                             dt.datetime.now(dt.UTC).date())
        except DayError as exc:
            raise invalid(str(exc), f"{exc.end}_date") from None
        model = model_asked(config, query_value(request, "model"))
        rows = await read_usage(redis(), [asked] if asked else visible, days, model)
        named = query_value(request, "model")
        if named is not None and not rows and (no_such_model(config, named, rows) or not who.may_use(model or "")):
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"no model named {quoted(named)}, and no usage of one so named "
                           f"from {days[0]} to {days[-1]}", param="model")
        return web.json_response({"object": "list", "start_date": days[0], "end_date": days[-1],
                                  "data": [r.to_json() for r in rows]})

    app.router.add_get("/v1/usage", usage)
