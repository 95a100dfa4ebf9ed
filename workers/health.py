"""A provider's health from evidence: busy is not down.

Runs are the first evidence. A run the provider answered (completed, or refused with a 4xx)
says it is alive; a run that could not reach it (refused, reset, timed out) strikes against
it; a 5xx says neither (the server is up, but one request went wrong), nor does a 404 that
names the served model (it lost the model: with no sign of life its model list is probed again). Active probes fill
the gaps: a provider is probed only when nothing showed it alive for its probe interval, a
probe that could disturb a running generation is never sent while it runs one, and a probe
that times out while the provider is busy counts for nothing. A provider that strikes took down
is probed at once, and again every heartbeat while it stays down (the `probe` script): a
request that breaks every server's answer strikes them without their being down.

The evidence lives in the provider's heartbeat hash, so every worker of the node (and every
attempt, through the `finish` script) adds to the same record and every worker judges it the
same way. `judge` is the rule, a pure function:

- `DOWN` (3) strikes or more since the last sign of life: `unavailable` (`unknown` when a
  probe got an answer it did not understand), the last failure being the reason;
- else any sign of life, or runs in flight: `available`;
- else `unknown` ("not probed yet", or the failure so far).

A refused connection, a host that does not resolve and a health endpoint that answers an
error are `DOWN` strikes at once; a timeout or a reset is one strike, so three in a row, with
no sign of life between, are needed. Any sign of life resets the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.policy import DOWN_REASON, Health
from workers.adapters.base import DOWN


class Field:
    """Evidence fields of the heartbeat hash (`common.keys.heartbeat`)."""

    OK_MS = "ok_ms"  # the last sign of life: a run it answered, or a probe that passed
    FAILS = "fails"  # strikes since then
    FAIL_MS = "fail_ms"  # the last strike
    FAIL_REASON = "fail_reason"  # what the last strike was
    FAIL_HEALTH = "fail_health"  # the health the strikes mean: unavailable, or unknown
    PROBE_MS = "probe_ms"  # when a worker last claimed a probe
    #: until when the server may still generate a run iop gave up (`PROBE_DISTURBS` types: no probe till then)
    BUSY_UNTIL_MS = "busy_until_ms"


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Evidence:
    ok_ms: int | None = None
    fails: int = 0
    fail_ms: int | None = None
    fail_reason: str = ""
    fail_health: Health = Health.UNAVAILABLE

    @classmethod
    def from_hash(cls, fields: Mapping[str, str]) -> Evidence:
        try:
            fail_health = Health(fields.get(Field.FAIL_HEALTH) or Health.UNAVAILABLE)
        except ValueError:
            fail_health = Health.UNAVAILABLE
        return cls(ok_ms=_int(fields.get(Field.OK_MS)), fails=_int(fields.get(Field.FAILS)) or 0,
                   fail_ms=_int(fields.get(Field.FAIL_MS)), fail_reason=fields.get(Field.FAIL_REASON, ""),
                   fail_health=fail_health)


def judge(evidence: Evidence, in_flight: int) -> tuple[Health, str]:
    """(health, why it is not available) from the evidence and the provider's live leases."""
    if evidence.fails >= DOWN:
        return evidence.fail_health, evidence.fail_reason or DOWN_REASON
    if evidence.ok_ms is not None or in_flight > 0:
        return Health.AVAILABLE, ""
    if evidence.fails:
        return Health.UNKNOWN, f"{evidence.fail_reason} ({evidence.fails} of {DOWN} strikes)"
    return Health.UNKNOWN, "not probed yet"
