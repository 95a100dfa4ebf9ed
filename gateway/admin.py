"""Operator routes (`/v1/admin/…`, operator keys only; `gateway.auth` answers 401/403):

- `POST /v1/admin/providers/{id}/drain`, `…/undrain`: the provider takes no new runs / takes them again.
- `POST /v1/admin/providers/{id}/capacity` with `{"capacity": N, "for": "30m"}` (`for` optional):
  the policy counts with N until cleared or expired; `DELETE …/capacity` clears it.
- `POST /v1/admin/nodes/{id}/cordon`, `…/uncordon`: every provider of the node, as drain/undrain.
- `GET /v1/admin/audit?limit=50&before=<id>`: the changes, newest first.

A change answers `{"object": "control.change", "change": <its audit entry>, "providers": [<the
catalog records of the providers it touched, after it>]}` (and `"node"` for a node). An unknown
provider or node is 404 `not_found`; a bad value 400 naming it (`param`), and so is a field a route
does not take (drain, undrain, cordon, uncordon and DELETE take none; an empty body or `{}` is
fine). A body is parsed as the run routes parse theirs: with more arrays and objects than
`runtime.max_json_containers`, nested deeper than
`runtime.max_json_depth`, or holding NaN, Infinity or a number beyond a double, it is a 400. The
audit entry names the key that made the change (`anonymous` when the gateway serves without keys).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import control
from common.catalog import change_report, read_catalog
from common.config import Config, RuntimeConfig
from common.control import Action, Change, ControlError, UnknownTarget
from common.redisconn import REDIS_FULL, now_ms
from common.shown import SHOWN_CHARS, shown
from common.wire import ErrorCode
from gateway.auth import principal
from gateway.connections import BODY
from gateway.errors import ApiError, invalid
from gateway.requests import json_object, query_value

#: Fields `POST …/capacity` takes.
CAPACITY_FIELDS = frozenset({"capacity", "for"})


#: `?limit=`: ASCII digits (`str.isdigit` takes a superscript 2, which `int` refuses), a few of them.
_LIMIT = re.compile(r"[0-9]{1,9}")


def _body(request: web.Request, runtime: RuntimeConfig, fields: frozenset[str] = frozenset(),
          takes: str = "no fields") -> dict[str, Any]:
    """The body as a JSON object ({} when there is none, else read as the run routes read theirs),
    with no field outside `fields`."""
    raw = request[BODY]
    if not raw.strip():
        return {}
    data = json_object(raw, runtime.max_json_depth, runtime.max_json_containers)
    unknown = sorted(set(data) - fields)
    if unknown:
        raise invalid(f"unknown field {shown(unknown[0])}: this route takes {takes}", unknown[0][:SHOWN_CHARS])
    return data


def _capacity_change(request: web.Request, provider_id: str, runtime: RuntimeConfig) -> Change:
    body = _body(request, runtime, CAPACITY_FIELDS, "capacity and for")
    if "capacity" not in body:
        raise invalid("capacity: required (a whole number; DELETE this route to clear an override)", "capacity")
    try:
        if isinstance(body["capacity"], str):  # (the command line's N is text; JSON has numbers)
            raise ControlError(f"capacity: {shown(body['capacity'])} is text, not a whole number "
                               "(send a JSON number, such as 2)", "capacity")
        capacity = control.check_capacity(body["capacity"])
        duration = body.get("for")
        if duration is not None and not isinstance(duration, str):
            raise ControlError(f"for: {shown(duration)} is not a duration such as 90s, 30m, 2h, 7d or 1h30m "
                               "(text)", "for")
        for_ms = control.parse_duration(duration) if duration is not None else None
    except ControlError as exc:
        raise invalid(str(exc), exc.param) from None
    return Change(Action.CAPACITY, provider_id, principal(request).name, capacity=capacity, for_ms=for_ms)


def setup(app: web.Application, config: Config, redis: Callable[[], Redis]) -> None:
    """Add the operator routes; `redis` returns the app's client once it is started."""
    runtime = config.runtime

    async def answer(change: Change) -> web.Response:
        try:
            entry = await control.apply(redis(), config, change)
        except UnknownTarget as exc:
            raise ApiError(ErrorCode.NOT_FOUND, str(exc)) from None
        except ControlError as exc:
            raise invalid(str(exc), exc.param) from None
        except RedisTimeoutError:
            raise ApiError(ErrorCode.UNAVAILABLE, f"Redis did not answer in time; {control.UNANSWERED} "
                           "(GET /v1/admin/audit)", headers={"Retry-After": "5"}) from None
        except REDIS_FULL:  # (a change that only removes, an undrain, frees: Redis takes it)
            raise ApiError(ErrorCode.UNAVAILABLE, "the run store (Redis) is full (maxmemory) and refuses writes: "
                           "nothing changed; retry once it has room", headers={"Retry-After": "5"}) from None
        catalog = await read_catalog(redis(), config, now_ms(), models=False)
        return web.json_response(change_report(catalog, entry), headers={"Cache-Control": "no-store"})

    def flag(action: Action, target: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            _body(request, runtime)  # a body is not needed, but a malformed one is still an error
            return await answer(Change(action, request.match_info[target], principal(request).name))
        return handler

    async def set_capacity(request: web.Request) -> web.Response:
        return await answer(_capacity_change(request, request.match_info["provider_id"], runtime))

    async def clear_capacity(request: web.Request) -> web.Response:
        _body(request, runtime)
        return await answer(Change(Action.CAPACITY_CLEAR, request.match_info["provider_id"],
                                   principal(request).name))

    async def audit(request: web.Request) -> web.Response:
        text = query_value(request, "limit", "50") or ""
        if not _LIMIT.fullmatch(text) or not 1 <= int(text) <= control.MAX_AUDIT_READ:
            raise invalid(f"limit: {shown(text)} is not a whole number between 1 and "
                          f"{control.MAX_AUDIT_READ}", "limit")
        try:
            entries = await control.read_audit(redis(), int(text), query_value(request, "before"))
        except ControlError as exc:
            raise invalid(str(exc), exc.param) from None
        return web.json_response({"object": "list", "data": [e.to_json() for e in entries]},
                                 headers={"Cache-Control": "no-store"})

    provider = "/v1/admin/providers/{provider_id:.+}"
    node = "/v1/admin/nodes/{node_id:.+}"
    app.router.add_post(f"{provider}/drain", flag(Action.DRAIN, "provider_id"))
    app.router.add_post(f"{provider}/undrain", flag(Action.UNDRAIN, "provider_id"))
    app.router.add_post(f"{provider}/capacity", set_capacity)
    app.router.add_delete(f"{provider}/capacity", clear_capacity)
    app.router.add_post(f"{node}/cordon", flag(Action.CORDON, "node_id"))
    app.router.add_post(f"{node}/uncordon", flag(Action.UNCORDON, "node_id"))
    app.router.add_get("/v1/admin/audit", audit)
