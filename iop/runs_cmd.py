"""`iop runs show ID`: one run's record and events, read from Redis (what `GET /v1/runs/{id}` shows).

Exit status 0 when the run was found, 1 when it is unknown or expired, 2 when Redis is
unreachable.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from redis.exceptions import ResponseError

from common import keys
from common.codec import decode_event
from common.redisconn import REDIS_DOWN, connect, redact
from common.runview import TIMESTAMPS, run_view
from common.shown import printable
from common.wrongtype import is_wrongtype


async def read_run(redis_url: str, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(the run view, its events as {id, type, data}) or None when the run is not in Redis."""
    redis = connect(redis_url)
    try:
        raw = await redis.hgetall(keys.run_record(run_id))
        if not raw:
            return None
        entries = await redis.xrange(keys.run_events(run_id), "-", "+")
    finally:
        await redis.aclose()
    events = [dict(zip(("id", "type", "data"), decode_event(eid, fields), strict=True)) for eid, fields in entries]
    return run_view(run_id, raw), events


def _when(ms: int, since: int | None) -> str:
    stamp = datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return stamp if since is None else f"{stamp}  (+{ms - since} ms)"


def _summary(event: dict[str, Any]) -> str:
    data = event["data"]
    if event["type"] == "delta":
        return f"{len(data.get('chunks', []))} chunk(s)"
    if event["type"] == "completed":
        return "response" if data.get("response") else ""
    if event["type"] in ("failed", "requeued"):
        return f"{data.get('code', '')}: {data.get('message', '')}"
    return " ".join(f"{k}={v}" for k, v in data.items())


def render(view: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """The record as `name  value` lines, then one line per event; control characters escaped."""
    rows: list[tuple[str, str]] = [
        ("run", view["id"]), ("state", str(view["state"])), ("model", str(view["model"])),
        ("kind", f"{view['kind']}{' (stream)' if view['stream'] else ''}"),
    ]
    for name in ("node", "provider", "target", "worker"):
        if view[name]:
            rows.append((name, view[name]))
    never = [*(f"{p} (unable)" for p in view["unable_by"]),
             *(f"{p} (failed it)" for p in view["elsewhere"])]
    said = "; ".join(part for part in (
        f"tried {', '.join(view['tried'])}" if view["tried"] else "",
        f"max_attempts {view['max_attempts']}" if view["max_attempts"] is not None else "",
        f"{view['unable']} refused as unable, not counted" if view["unable"] else "",
        f"never again: {', '.join(never)}" if never else "",
    ) if part)
    rows.append(("attempts", f"{view['attempts']}{f' ({said})' if said else ''}"))
    created = view["created_ms"]
    for field in TIMESTAMPS:
        if view[field.value] is not None:
            since = None if field.value == "created_ms" else created
            rows.append((field.value.removesuffix("_ms"), _when(view[field.value], since)))
    if view["error"]:
        rows.append(("error", f"{view['error']['code']}: {view['error']['message']}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {printable(value)}" for name, value in rows]  # (a provider's error text)
    lines.append(f"events ({len(events)}):")
    id_width = max((len(e["id"]) for e in events), default=0)
    for event in events:
        lines.append(f"  {event['id'].ljust(id_width)}  {event['type']:<10}  {printable(_summary(event))}".rstrip())
    return "\n".join(lines)


def _json_keys(obj: Any) -> Any:
    """`obj` with every key JSON cannot hold (bytes: not iop's writing) as its `repr`, at any depth:
    `json.dumps`'s `default` sees values only."""
    if isinstance(obj, dict):
        return {k if k is None or isinstance(k, str | int | float) else repr(k): _json_keys(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_keys(v) for v in obj]
    return obj


def show(redis_url: str, run_id: str, as_json: bool = False) -> int:
    try:
        found = asyncio.run(read_run(redis_url, run_id))
    except REDIS_DOWN as exc:
        print(f"error: Redis at {redact(redis_url)} is unreachable: {exc}", file=sys.stderr)
        return 1  # (as every command that reads Redis: 2 is for what was given)
    except ResponseError as exc:  # (a key of the run's written by hand: the operator is told which, not a traceback)
        if not is_wrongtype(exc):
            raise
        print(f"error: {keys.run_record(run_id)} or {keys.run_events(run_id)} holds another type than iop writes "
              f"there (written by hand?), no run: {exc}", file=sys.stderr)
        return 1
    if found is None:
        print(f"error: run {run_id!r} is not in Redis (unknown, or expired after runtime.run_ttl_s)",
              file=sys.stderr)
        return 1
    view, events = found
    # (`repr` for what JSON cannot hold: bytes in an event that is not iop's writing, a value or a key)
    print(json.dumps(_json_keys({**view, "events": events}), indent=2, default=repr) if as_json
          else render(view, events))
    return 0
