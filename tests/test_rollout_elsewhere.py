"""A run in flight across a rolling upgrade: a record whose `elsewhere` is the flag '1' that an older
worker wrote (before `elsewhere` listed the providers) still keeps a refusal as unable from sending the
run back to a provider tried, as that worker did (the flag said one of them answered a 5xx, a 429 or a
redirect, not which): read as the list {'1'}, it named no provider, and the run went back to the one
that answered it the 500. Real Redis."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from common import keys
from common.wire import RunKind
from tests.test_cancel import StallingAdapter
from tests.test_scheduler import make_config, waiting_runs
from workers.adapters.base import ProviderError, Retry
from workers.runner import Runner


class UnableAdapter(StallingAdapter):
    """A provider that cannot do what the request asks (a hosted API's 400 for top_k)."""

    async def complete(self, kind: RunKind, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        self.calls += 1
        raise ProviderError("provider answered 400: Unrecognized request argument supplied: top_k",
                            status=400, retry=Retry.UNABLE, strikes=None)


@pytest.mark.parametrize("flag", ["1", "1,{y}"])
async def test_an_older_workers_elsewhere_flag_keeps_an_unable_refusal_from_going_back(redis: Redis, flag: str) -> None:
    """The run went to x, which answered a 500 under an older worker (record `elsewhere` = '1'), then
    to y, which reset the connection (with '1,{y}': answered a 500, and a new worker's `finish` added
    y after the flag), then to `here`, a new worker's, which refuses it as unable: it does not go back
    to x (nor to y: the flag does not say which of them answered the 500, as the older worker did)."""
    config = make_config({"a": 1, "b": 1, "c": 1})
    _, sched, (run_id,) = await waiting_runs(redis, config, 1)
    await sched.dispatch_all()
    record = keys.run_record(run_id)
    here = (await redis.hget(record, "provider") or b"").decode()
    x, y = sorted({"a", "b", "c"} - {here})
    tried = f"{x},{y},{here}"
    await redis.hset(record, mapping={"tried": tried, "attempts": tried.count(",") + 1,
                                      "elsewhere": flag.format(y=y)})
    runner = Runner(redis, config, f"n-{here}", {here: UnableAdapter()})
    await runner.execute(run_id)
    fields = await redis.hmget(record, "state", "tried")
    assert fields == [b"failed", tried.encode()], fields  # (not queued again: x answered it a 500)
    entries = await redis.xrange(keys.runs_stream(config.models[0].id))
    assert not [e for _, e in entries if e.get(b"run") == run_id.encode()], entries
