"""Load history for the catalog's charts: per provider in_flight and effective capacity, per model
queued runs and the oldest one's wait, sampled over the last `runtime.history_retention_s`.

Every scheduler replica offers a sample every `runtime.history_interval_ms` (`offer_sample`); the
`history` script writes it only when no other replica wrote one in the last 80% of an interval, so
the samples come one writer at a time, about one per interval, and every gateway reads the same
stream (`keys.HISTORY_STREAM`). The stream is trimmed by time (the retention) and by count in the
same script. A sample is one JSON field, readable with `redis-cli`:
`{"p": {"vllm-a": [in_flight, effective_capacity]}, "m": {"qwen3.6:35b": [queued, oldest_waiting_ms]}}`.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.catalog import Catalog, read_catalog
from common.config import Config
from common.scripts import Scripts

#: A sample is skipped when another was written less than this share of an interval ago.
MIN_GAP = 0.8
#: Entries the stream may hold beyond retention / interval (MAXLEN ~ trims in blocks of 100).
SLACK_ENTRIES = 100


def sample_of(catalog: Catalog) -> dict[str, Any]:
    """The compact sample of a catalog. Pure."""
    return {
        "p": {p.id: [p.in_flight, p.effective_capacity] for p in catalog.providers},
        "m": {m.id: [m.queued, m.oldest_waiting_ms] for m in catalog.models},
    }


def max_entries(config: Config) -> int:
    rt = config.runtime
    return rt.history_retention_s * 1000 // rt.history_interval_ms + SLACK_ENTRIES


async def _recent(redis: Redis, min_gap_ms: int) -> bool:
    """Whether a sample was written less than `min_gap_ms` ago (by Redis's clock, as the script
    judges it): one round trip, not the whole catalog a sample is made of."""
    pipe = redis.pipeline(transaction=False)
    pipe.time()
    pipe.xrevrange(keys.HISTORY_STREAM, count=1)
    (seconds, micros), last = await pipe.execute()
    return bool(last) and seconds * 1000 + micros // 1000 - int(last[0][0].split(b"-", 1)[0]) < min_gap_ms


async def offer_sample(redis: Redis, config: Config, now_ms: int) -> str | None:
    """Sample the pool and append it, unless another replica just did. Returns the entry id written.
    (A replica that finds a recent sample reads nothing more: with 300 models and 100 providers,
    every replica but the writer built the whole catalog every interval for nothing.)"""
    rt = config.runtime
    if await _recent(redis, int(rt.history_interval_ms * MIN_GAP)):
        return None
    catalog = await read_catalog(redis, config, now_ms)
    written = await Scripts(redis).call(
        "history", [keys.HISTORY_STREAM],
        [json.dumps(sample_of(catalog), separators=(",", ":")), int(rt.history_interval_ms * MIN_GAP),
         rt.history_retention_s * 1000, max_entries(config)])
    text = written.decode() if isinstance(written, bytes) else str(written)
    return text or None


def columns(config: Config, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> dict[str, Any]:
    """Samples (stream entries, oldest first) as one series per configured provider and model, with
    null where a sample lacks one (the config changed since). Pure."""
    times: list[int] = []
    samples: list[dict[str, Any]] = []
    for entry_id, fields in entries:
        try:
            sample = json.loads(fields.get(b"sample", b"{}"))
        except ValueError:
            continue
        if not isinstance(sample, dict):
            continue
        times.append(int(entry_id.split(b"-", 1)[0]))
        samples.append(sample)

    def series(part: str, ident: str, index: int) -> list[int | None]:
        out: list[int | None] = []
        for s in samples:
            values = s.get(part, {}).get(ident)
            out.append(values[index] if isinstance(values, list) and len(values) > index else None)
        return out

    providers = [p.id for n in config.nodes for p in n.providers]
    return {
        "t": times,
        "providers": {pid: {"in_flight": series("p", pid, 0), "capacity": series("p", pid, 1)} for pid in providers},
        "models": {m.id: {"queued": series("m", m.id, 0), "oldest_waiting_ms": series("m", m.id, 1)}
                   for m in config.models},
    }


async def read_history(redis: Redis, config: Config, now_ms: int, since_ms: int | None = None) -> dict[str, Any]:
    """The samples of the last retention period (only those after `since_ms` when given), as columns:
    the newest `max_entries`, oldest first, where it holds more (a shorter interval just configured)."""
    rt = config.runtime
    start = now_ms - rt.history_retention_s * 1000
    if since_ms is not None:
        start = max(start, since_ms + 1)
    entries = await redis.xrevrange(keys.HISTORY_STREAM, "+", str(max(0, start)), count=max_entries(config))
    entries.reverse()
    return {"object": "catalog.history", "interval_ms": rt.history_interval_ms,
            "retention_s": rt.history_retention_s, "generated_at_ms": now_ms, **columns(config, entries)}
