"""`iop provider drain|undrain|capacity`, `iop node cordon|uncordon` and `iop audit`: operator control
straight on Redis (`common.control`), like `iop catalog` reads it. The audit trail names the OS
user (`cli:<user>`). Exit status: 0 done, 1 Redis unreachable, 2 an unknown provider or node, or a
bad value.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

from common import control
from common.catalog import change_report, read_catalog
from common.config import Config
from common.control import Action, AuditEntry, Change, ControlError, UnknownTarget
from common.redisconn import REDIS_DOWN, REDIS_FULL, WHICH_REDIS, connect, now_ms, redact
from iop.catalog_cmd import table


def _clock(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def change_for(args: Any, who: str) -> Change:
    """The change an `iop provider …` / `iop node …` command line asks for. Raises ControlError."""
    if args.command == "node":
        return Change(Action(args.node_command), args.node_id, who)
    if args.provider_command != "capacity":
        return Change(Action(args.provider_command), args.provider_id, who)
    if args.value == "clear":
        if args.for_ is not None:
            raise ControlError("--for: only with a capacity, not with clear", "for")
        return Change(Action.CAPACITY_CLEAR, args.provider_id, who)
    capacity = control.check_capacity(args.value, "N")
    for_ms = control.parse_duration(args.for_, "--for") if args.for_ is not None else None
    return Change(Action.CAPACITY, args.provider_id, who, capacity=capacity, for_ms=for_ms)


def describe(report: dict[str, Any]) -> str:
    """One line per provider the change touched: what it is now, and what it was."""
    change = report["change"]
    was = change["previous"]
    if change["previous_until_ms"] is not None:
        was += f" until {_clock(change['previous_until_ms'])}"
    lines = []
    for p in report["providers"]:
        ctl = p["control"]
        now = [ctl["state"] + _why_blocked(ctl)]
        if ctl["capacity_override"] is not None:
            until = ctl["capacity_override_until_ms"]
            override, effective = ctl["capacity_override"], p["effective_capacity"]
            # (an override above what the workers announce counts as that: say what is in effect)
            now.append((f"capacity {effective} (override {override}, above the {effective} its workers announce; "
                        if effective is not None and effective < override else f"capacity {override} (")
                       + f"configured {p['configured_capacity']})"
                       + (f" until {_clock(until)}" if until is not None else " until cleared"))
        else:
            now.append(f"capacity {p['effective_capacity'] if p['effective_capacity'] is not None else '?'}")
        now.append(f"{p['in_flight']} in flight")
        lines.append(f"provider {p['id']} (node {p['node_id']}): {', '.join(now)}")
    until = f" until {_clock(change['until_ms'])}" if change["until_ms"] is not None else ""
    head = f"{change['action']} {change['target_kind']} {change['target']}: {change['value']}{until} (was {was})"
    return "\n".join([head, *lines])


def _why_blocked(ctl: dict[str, Any]) -> str:
    """What blocks a provider besides its own drain: its node's cordon (an undrain of a provider
    whose node is cordoned leaves it drained: this says why)."""
    if ctl["cordoned_since_ms"] is None:
        return ""
    return " (its node is cordoned too)" if ctl["drained_since_ms"] is not None else " (its node is cordoned)"


async def _apply(config: Config, redis_url: str, change: Change) -> dict[str, Any]:
    redis = connect(redis_url)
    try:
        entry = await control.apply(redis, config, change)
        return change_report(await read_catalog(redis, config, now_ms(), models=False), entry)
    finally:
        await redis.aclose()


def act(config: Config, redis_url: str, args: Any, who: str, as_json: bool) -> int:
    try:
        change = change_for(args, who)
        report = asyncio.run(_apply(config, redis_url, change))
    except (ControlError, UnknownTarget) as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    except RedisTimeoutError as exc:
        print(f"error: {exc}; {control.UNANSWERED} (iop audit)", file=sys.stderr)
        return 1
    except REDIS_DOWN as exc:
        print(f"error: cannot reach Redis at {redact(redis_url)}: {exc} {WHICH_REDIS}", file=sys.stderr)
        return 1
    except REDIS_FULL:
        print(f"error: Redis at {redact(redis_url)} is full (maxmemory) and refuses writes: nothing changed",
              file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if as_json else describe(report))
    if report["providers"] and all(p["last_heartbeat"] is None for p in report["providers"]):
        print(f"warning: no provider it touched has a heartbeat in Redis at {redact(redis_url)}: no worker of its "
              "node runs against it now (stopped, or --redis is not the pool's); the change is recorded there",
              file=sys.stderr)
    return 0


def render_audit(entries: list[AuditEntry]) -> str:
    def value(v: str, until: int | None) -> str:
        return v if until is None else f"{v} until {_clock(until)}"

    return table(["TIME", "WHO", "ACTION", "TARGET", "VALUE", "PREVIOUS"],
                 [[_clock(e.at_ms), e.who, e.action, f"{e.target_kind} {e.target}", value(e.value, e.until_ms),
                   value(e.previous, e.previous_until_ms)] for e in entries])


async def _audit(redis_url: str, limit: int) -> list[AuditEntry]:
    redis = connect(redis_url)
    try:
        return await control.read_audit(redis, limit)
    finally:
        await redis.aclose()


def audit(redis_url: str, limit: int, as_json: bool) -> int:
    if not 1 <= limit <= control.MAX_AUDIT_READ:
        print(f"error: --limit: {limit} is not between 1 and {control.MAX_AUDIT_READ}", file=sys.stderr)
        return 2
    try:
        entries = asyncio.run(_audit(redis_url, limit))
    except REDIS_DOWN as exc:
        print(f"error: cannot reach Redis at {redact(redis_url)}: {exc} {WHICH_REDIS}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"object": "list", "data": [e.to_json() for e in entries]}, indent=2))
    else:
        print(render_audit(entries) if entries else "no operator changes recorded")
    return 0
