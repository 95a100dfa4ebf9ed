"""The health rule (`workers.health.judge`) as a table: busy is not down; strikes take a provider
down; any sign of life brings it back."""

from __future__ import annotations

import json

import pytest

from common.policy import Health
from workers.adapters.base import DOWN, ProbeResult
from workers.health import Evidence, judge
from workers.heartbeat import MAX_OBSERVED, MAX_OBSERVED_BYTES, probe_evidence, recorded

REFUSED = "provider p: connection refused"


@pytest.mark.parametrize(("evidence", "in_flight", "expected"), [
    (Evidence(), 0, (Health.UNKNOWN, "not probed yet")),
    (Evidence(), 2, (Health.AVAILABLE, "")),  # leases only exist on a provider that was available
    (Evidence(ok_ms=10), 0, (Health.AVAILABLE, "")),
    # a long silence since the last sign of life is not a failure: busy or idle, still available
    (Evidence(ok_ms=10), 4, (Health.AVAILABLE, "")),
    (Evidence(ok_ms=10, fails=1, fail_ms=20, fail_reason="t"), 0, (Health.AVAILABLE, "")),
    (Evidence(ok_ms=10, fails=2, fail_ms=20, fail_reason="t"), 4, (Health.AVAILABLE, "")),
    (Evidence(ok_ms=10, fails=DOWN, fail_ms=20, fail_reason=REFUSED), 0, (Health.UNAVAILABLE, REFUSED)),
    (Evidence(ok_ms=10, fails=DOWN, fail_ms=20, fail_reason=REFUSED), 3, (Health.UNAVAILABLE, REFUSED)),
    (Evidence(fails=5, fail_ms=20, fail_reason="x"), 0, (Health.UNAVAILABLE, "x")),
    (Evidence(fails=DOWN, fail_ms=20, fail_reason="GET /v1/models answered 200 but not with a model list",
              fail_health=Health.UNKNOWN), 0,
     (Health.UNKNOWN, "GET /v1/models answered 200 but not with a model list")),
    (Evidence(fails=1, fail_ms=20, fail_reason="GET /health: no answer within 2000 ms"), 0,
     (Health.UNKNOWN, "GET /health: no answer within 2000 ms (1 of 3 strikes)")),
])
def test_judge(evidence: Evidence, in_flight: int, expected: tuple[Health, str]) -> None:
    assert judge(evidence, in_flight) == expected


def test_evidence_reads_the_heartbeat_hash_and_ignores_garbage() -> None:
    ev = Evidence.from_hash({"ok_ms": "5", "fails": "2", "fail_ms": "7", "fail_reason": "r",
                             "fail_health": "unknown", "health": "available"})
    assert ev == Evidence(ok_ms=5, fails=2, fail_ms=7, fail_reason="r", fail_health=Health.UNKNOWN)
    assert Evidence.from_hash({"ok_ms": "x", "fails": "", "fail_health": "bogus"}) == Evidence()


def test_a_probe_timeout_on_a_busy_provider_says_nothing() -> None:
    timeout = ProbeResult(Health.UNAVAILABLE, "GET /health: no answer within 2000 ms", strikes=1, timed_out=True)
    assert probe_evidence(timeout, busy=True) == ("", 0)
    assert probe_evidence(timeout, busy=False) == ("fail", 1)
    refused = ProbeResult(Health.UNAVAILABLE, "GET /health: connection refused")
    assert probe_evidence(refused, busy=True) == ("fail", DOWN)  # refused is refused, busy or not
    assert probe_evidence(ProbeResult(Health.AVAILABLE, "", ["m"]), busy=True) == ("ok", 0)


def test_a_model_list_of_100_000_keeps_the_configured_names_and_a_thousand_others() -> None:
    listed = [f"m{i}" for i in range(100_000)]
    kept = recorded(listed, ["m99999", "m5", "not-listed"])
    assert kept[:2] == ["m5", "m99999"] and len(kept) == MAX_OBSERVED and "m0" in kept
    assert recorded(["a", "b"], ["b"]) == ["b", "a"]
    # (other names longer than a config's served name may be are left out: 1,000 of 3.9 KB made
    # heartbeats of 3.9 MB; a hostile provider)
    assert recorded(["x" * 257, "x" * 256, "y" * 300], ["y" * 300]) == ["y" * 300, "x" * 256]
    # (each name once: a configured name listed 200,000 times was kept 200,000 times; a review)
    assert recorded(["m5", "a", "m5", "a"] * 50_000, ["m5"]) == ["m5", "a"]
    # (in bytes as the heartbeat stores them: 1,000 names of 256 emoji made 3 MB of JSON; a review)
    emoji = [f"{i:04d}" + "\U0001F600" * 252 for i in range(1_000)]
    kept = recorded(emoji, [])
    assert 0 < len(kept) < 1_000 and len(json.dumps(kept)) <= MAX_OBSERVED_BYTES + 2 * len(kept) + 2
