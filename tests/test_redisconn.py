"""common.redisconn: the retry pause while Redis is away."""

from __future__ import annotations

from common.redisconn import Backoff


async def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(first=0.001, cap=0.004)
    seen = []
    for _ in range(4):
        seen.append(backoff.delay)
        await backoff.pause()
    assert seen == [0.001, 0.002, 0.004, 0.004]
    backoff.reset()
    assert backoff.delay == 0.001
