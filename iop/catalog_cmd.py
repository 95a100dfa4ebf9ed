"""`iop catalog` and `iop queues`: the catalog records as terminal tables (or JSON).

They read Redis exactly the way `GET /v1/catalog` does (`common.catalog`), so the terminal
and the page never disagree. Read-only.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.catalog import Catalog, ModelRecord, ProviderRecord, read_catalog
from common.config import Config
from common.redisconn import REDIS_DOWN, WHICH_REDIS, connect, now_ms, redact
from common.shown import printable


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded. A cell's control
    characters are escaped: what Redis holds (an audit entry's `who`) cannot forge a line."""
    shown = [[printable(str(c)) for c in row] for row in [headers, *rows]]
    widths = [max(len(r[i]) for r in shown) for i in range(len(headers))]
    lines = []
    for row in shown:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _age(ms: int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f}s"
    if ms < 120 * 60_000:
        return f"{ms / 60_000:.0f}m"
    # (an override --for 7d said "10079m left")
    return f"{ms / 3_600_000:.0f}h" if ms < 48 * 3_600_000 else f"{ms / 86_400_000:.0f}d"


def _load(p: ProviderRecord) -> str:
    cap = "?" if p.effective_capacity is None else str(p.effective_capacity)
    ratio = "-" if p.load_ratio is None else f"{p.load_ratio:.2f}"
    return f"{p.in_flight}/{cap} ({ratio})"


def _control(p: ProviderRecord, now_ms: int) -> str:
    """`active`, `draining` or `drained` (`(node)` when only its node is cordoned, `(and node)` when it is
    drained and its node cordoned), and an operator's capacity (with what counts when it is above the
    configured one: an override set before a config lowered the capacity)."""
    ctl = p.control
    text = ctl.state
    if ctl.state != "active" and ctl.cordoned_since_ms is not None:
        text += " (node)" if ctl.drained_since_ms is None else " (and node)"
    if ctl.capacity_override is not None:
        until = ctl.capacity_override_until_ms
        left = "" if until is None else f", {_age(max(0, until - now_ms))} left"
        above = f": {p.configured_capacity} counts" if ctl.capacity_override > p.configured_capacity else ""
        text += f" cap {ctl.capacity_override} (of {p.configured_capacity}{above}{left})"
    return text


def _flags(p: ProviderRecord) -> str:
    on = [f.split("_")[0] for f, enabled in p.lifecycle_capabilities.items() if enabled]
    return ",".join(on) or "-"


def _benched(catalog: Catalog) -> dict[str, list[str]]:
    """The models each provider is benched for now (a bench is a model's: the provider serves others)."""
    benched: dict[str, list[str]] = {}
    for m in catalog.models:
        for pl in m.providers:
            if pl.reason == "benched":
                benched.setdefault(pl.provider_id, []).append(m.id)
    return benched


def _reason(p: ProviderRecord, benched: list[str]) -> str:
    """Its health's reason, and the models it is benched for (it was `available` with no reason)."""
    said = [p.health_reason] if p.health_reason else []
    if benched:
        said.append(f"benched for {', '.join(benched)}")
    return "; ".join(said)


def provider_rows(catalog: Catalog) -> list[list[str]]:
    benched = _benched(catalog)
    return [
        [p.node_id, p.id, p.type, p.category, p.health, _load(p), _control(p, catalog.generated_at_ms),
         str(p.queued), ",".join(p.serves), _flags(p), _age(p.heartbeat_age_ms), _reason(p, benched.get(p.id, []))]
        for p in catalog.providers
    ]


def _placements(m: ModelRecord) -> str:
    return ", ".join(f"{pl.provider_id}:{'ok' if pl.selectable else pl.reason}" for pl in m.providers)


def render_catalog(catalog: Catalog) -> str:
    providers = table(
        ["NODE", "PROVIDER", "TYPE", "CATEGORY", "HEALTH", "LOAD", "CONTROL", "QUEUED", "MODELS", "LIFECYCLE",
         "HEARTBEAT", "REASON"],
        provider_rows(catalog))
    models = table(
        ["MODEL", "ALIASES", "QUEUED", "OLDEST", "PROVIDERS (selectable now, or why not)"],
        [[m.id, ",".join(m.aliases) or "-", f"{m.queued}/{m.max_queue}", _age(m.oldest_waiting_ms), _placements(m)]
         for m in catalog.models])
    unconfigured = ""
    if catalog.unconfigured_providers:
        unconfigured = (f"\n\nproviders with heartbeats that this config does not define: "
                        f"{', '.join(map(printable, catalog.unconfigured_providers))} (the pool runs another config)")
    return f"{providers}\n\n{models}{unconfigured}"


def queue_records(catalog: Catalog) -> list[dict[str, Any]]:
    return [{"model": m.id, "waiting": m.queued, "max_queue": m.max_queue,
             "oldest_waiting_ms": m.oldest_waiting_ms, "oldest_run_id": m.oldest_run_id}
            for m in catalog.models]


def render_queues(catalog: Catalog) -> str:
    return table(["MODEL", "WAITING", "MAX", "OLDEST WAITING", "OLDEST RUN"],
                 [[q["model"], str(q["waiting"]), str(q["max_queue"]), _age(q["oldest_waiting_ms"]),
                   q["oldest_run_id"] or "-"] for q in queue_records(catalog)])


async def _any_scheduler(redis: Redis) -> bool:
    """Whether a scheduler replica's liveness key is in Redis (a SCAN, stopped at the first)."""
    async for _ in redis.scan_iter(match=keys.scheduler_alive("*"), count=10_000):
        return True
    return False


async def _read_checked(config: Config, redis_url: str) -> tuple[Catalog, bool]:
    """The catalog, and whether runs wait while no scheduler replica is alive to dispatch them."""
    redis = connect(redis_url)
    try:
        catalog = await read_catalog(redis, config, now_ms())
        waiting = any(m.queued for m in catalog.models)
        return catalog, waiting and not await _any_scheduler(redis)
    finally:
        await redis.aclose()


def main(command: str, config: Config, redis_url: str, as_json: bool) -> int:
    """Print the catalog (`catalog`) or the queues (`queues`); exit status 1 if Redis is unreachable."""
    try:
        catalog, unscheduled = asyncio.run(_read_checked(config, redis_url))
    except REDIS_DOWN as exc:
        print(f"error: cannot read Redis at {redact(redis_url)}: {exc} {WHICH_REDIS}", file=sys.stderr)
        return 1
    if command == "queues":
        print(json.dumps({"queues": queue_records(catalog)}, indent=2) if as_json else render_queues(catalog))
    else:
        print(json.dumps(catalog.to_json(), indent=2) if as_json else render_catalog(catalog))
    if catalog.providers and all(p.last_heartbeat is None for p in catalog.providers):
        # (`iop catalog` without the `--redis` that `iop dev` printed reads 127.0.0.1:6379: an empty pool)
        print(f"warning: no provider of the config has a heartbeat in Redis at {redact(redis_url)}: no worker "
              "runs against it now (stopped, or --redis is not the pool's)", file=sys.stderr)
    if unscheduled:
        # (every provider `ok` beside a queue that only grew: the catalog cannot tell that nobody dispatches)
        print(f"warning: runs wait and no scheduler is running against Redis at {redact(redis_url)}: nothing "
              "dispatches them until one starts (`iop scheduler`); each ends with queue_timeout after its "
              "queue_timeout_ms", file=sys.stderr)
    return 0
