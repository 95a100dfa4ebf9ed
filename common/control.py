"""Operator control: drain a provider, cordon a node, override a provider's capacity.

The state lives in Redis only (`keys.drained`, `keys.cordoned`, `keys.capacity_override`), so it
survives a restart of every iop service and every replica reads the same. Two places honour it:
the selection policy, whose snapshots carry it (`common.policy`), and the `dispatch` script,
which checks it in the very step that reserves a slot, so once a change is written no scheduler
replica dispatches against it, whatever it read before.

Each change and its audit entry are written by one script (`control`): who made it (an API key's
name, or `cli:<user>` for the `iop` command), what, and the value it replaced. Parsing and bounds
are pure; `apply`, `read_control` and `read_audit` talk to Redis.
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from common import keys
from common.config import Config
from common.policy import capacity_override
from common.redisconn import REDIS_DOWN, as_text_map, text
from common.scripts import Scripts
from common.shown import near_name, shown


class Action(StrEnum):
    DRAIN = "drain"  # a provider takes no new runs; its running runs go on
    UNDRAIN = "undrain"
    CORDON = "cordon"  # every provider of a node takes no new runs
    UNCORDON = "uncordon"
    CAPACITY = "capacity"  # the policy counts with this capacity instead of the announced one
    CAPACITY_CLEAR = "capacity_clear"


NODE_ACTIONS = frozenset({Action.CORDON, Action.UNCORDON})
#: the actions that only take a setting away: allowed on an id the config lacks when its setting is
#: there (a provider or node taken out of the config while drained keeps its key, and would come back
#: drained if the id came back)
CLEARING = frozenset({Action.UNDRAIN, Action.UNCORDON, Action.CAPACITY_CLEAR})

#: The shortest and longest time a capacity override may be given (`--for`, `"for"`).
MIN_FOR_MS = 1_000
MAX_FOR_MS = 7 * 86_400_000
#: What a change is told when Redis did not answer it in time (paused, cut off): it may have been
#: made, or be made when Redis resumes (it runs what it had received), so it is not to be sent
#: again blindly (a drain then an undrain, both timed out, would both apply, in order).
UNANSWERED = ("the change may still be made when Redis answers (a paused Redis runs what it had received): "
              "look at the audit trail before sending it again")
#: Audit entries one read returns at most (`iop audit --limit`, `GET /v1/admin/audit?limit=`).
MAX_AUDIT_READ = 1_000

#: A duration, matched whole (`fullmatch`): ASCII digits only (`\d` takes any Unicode digit), no spaces.
_DURATION = re.compile(r"(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")
_UNIT_MS = (86_400_000, 3_600_000, 60_000, 1_000)
#: A whole number as text: ASCII digits only (`str.isdigit` takes a superscript 2, which `int` refuses).
_WHOLE = re.compile(r"[0-9]+")
#: A Redis stream entry id as an audit page's `before`: `<ms>` or `<ms>-<seq>`, each below 2**64.
_ENTRY_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
#: Digits a number may have, leading zeros aside, before it is certainly out of range (`int` refuses
#: text of more than 4,300 digits with a ValueError).
_MAX_DIGITS = 20


class ControlError(ValueError):
    """A value an operator gave that cannot be used; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class AboveConfigured(ControlError):
    """A capacity override above the provider's capacity in the config that checked it (`configured`);
    `announced`: what the provider's workers announce, when that is at least the override (the config
    that checked it is older than the pool's)."""

    def __init__(self, change: Change, configured: int, announced: int | None = None) -> None:
        old = "" if announced is None else f"; its workers announce {announced}: is this config older than the pool's?"
        super().__init__(f"capacity: {change.capacity} is above {change.target}'s configured capacity "
                         f"{configured} (an override can only lower it; raise it in the config{old})", "capacity")
        self.configured = configured


class UnknownTarget(LookupError):
    """A provider or node the config does not define."""


def parse_duration(value: str, param: str = "for") -> int:
    """`90s`, `30m`, `2h`, `7d` or a combination in that order (`1h30m`) -> milliseconds, within
    [MIN_FOR_MS, MAX_FOR_MS]. ASCII digits only, nothing around it (no spaces)."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if not value or match is None or not any(match.groups()):
        raise ControlError(f"{param}: {shown(value)} is not a duration such as 90s, 30m, 2h, 7d or 1h30m", param)
    parts = [(part or "").lstrip("0") for part in match.groups()]  # leading zeros do not count
    if any(len(part) > _MAX_DIGITS for part in parts):
        raise ControlError(f"{param}: {shown(value)} is longer than 7d, the longest an override may last", param)
    ms = sum(int(part) * unit for part, unit in zip(parts, _UNIT_MS, strict=True) if part)
    if ms < MIN_FOR_MS:
        raise ControlError(f"{param}: {shown(value)} is shorter than 1s", param)
    if ms > MAX_FOR_MS:
        raise ControlError(f"{param}: {shown(value)} is longer than 7d, the longest an override may last", param)
    return ms


def format_duration(ms: int) -> str:
    """The inverse of `parse_duration`, to whole seconds: 5_400_000 -> `1h30m`."""
    left = max(0, ms) // 1000 * 1000
    parts = []
    for unit, name in zip(_UNIT_MS, "dhms", strict=True):
        if left >= unit:
            parts.append(f"{left // unit}{name}")
            left %= unit
    return "".join(parts) or "0s"


def check_capacity(value: Any, param: str = "capacity") -> int:
    """A capacity override: a whole number >= 1 (a drain is how to take none), or its ASCII digits
    as text (the command line's N; with a `-` before them, a number below 1, refused as such). Its
    upper bound, the provider's configured capacity, is `check_change`'s."""
    if isinstance(value, str) and _WHOLE.fullmatch(value.removeprefix("-")):  # (`-1`: said below 1, not unread)
        if len(value.removeprefix("-").lstrip("0")) > _MAX_DIGITS:
            raise ControlError(f"{param}: {shown(value)} is too large for a capacity", param)
        value = int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:  # (`2.0`, `1e2`: JSON's decimals)
        raise ControlError(f"{param}: {shown(value)} is a decimal number; give it as a whole number "
                           f"({int(value)})", param)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(f"{param}: {shown(value)} is not a whole number", param)
    if value < 1:
        raise ControlError(f"{param}: {value} is less than 1 (to take no runs, drain it)", param)
    return value


def entry_id(text: str) -> tuple[int, int | None] | None:
    """(ms, seq) of a stream entry id `<ms>` or `<ms>-<seq>` (ASCII digits, each below 2**64), as
    Redis takes it for the end of a range; None if it is not one."""
    match = _ENTRY_ID.fullmatch(text)
    if match is None:
        return None
    ms, seq = int(match[1]), int(match[2]) if match[2] is not None else None
    if ms >= 2**64 or (seq is not None and seq >= 2**64):
        return None
    return ms, seq


def cli_user() -> str:
    """Who the `iop` command acts as in the audit trail: `cli:` and the OS user."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no USER/LOGNAME and no passwd entry (a bare container)
        user = f"uid{os.getuid()}"
    return f"cli:{user}"


@dataclass(frozen=True, slots=True)
class Change:
    """One operator action on a provider (or, for cordon/uncordon, a node)."""

    action: Action
    target: str
    #: the API key's name, or `cli:<user>`
    who: str
    #: `capacity` only: the capacity to use
    capacity: int | None = None
    #: `capacity` only: how long the override lasts (ms); None = until cleared
    for_ms: int | None = None

    @property
    def target_kind(self) -> str:
        return "node" if self.action in NODE_ACTIONS else "provider"

    def key(self) -> str:
        if self.action in (Action.DRAIN, Action.UNDRAIN):
            return keys.drained(self.target)
        if self.action in NODE_ACTIONS:
            return keys.cordoned(self.target)
        return keys.capacity_override(self.target)


def check_change(config: Config, change: Change) -> None:
    """Raise UnknownTarget for a provider or node the config does not define, ControlError for a bad value."""
    if change.target_kind == "node":
        if config.node(change.target) is None:
            try:
                but = f" ({shown(change.target)} is a provider, of node {config.node_of(change.target)})"
            except KeyError:
                but = _meant(change.target, [n.id for n in config.nodes])
            raise UnknownTarget(f"no node {shown(change.target)} in the config{but}")
    else:
        try:
            configured = config.provider(change.target).capacity
        except KeyError:
            but = (f" ({shown(change.target)} is a node)" if config.node(change.target) is not None
                   else _meant(change.target, [p.id for n in config.nodes for p in n.providers]))
            raise UnknownTarget(f"no provider {shown(change.target)} in the config{but}") from None
    if change.action is Action.CAPACITY:
        if change.capacity is None:
            raise ControlError("capacity: required", "capacity")
        check_capacity(change.capacity)
        # Lower only: a node's workers run as many runs at once as its configured capacities add up
        # to, so slots above them would be leases that wait for a worker.
        if change.capacity > configured:
            raise AboveConfigured(change, configured)
        if change.for_ms is not None and not MIN_FOR_MS <= change.for_ms <= MAX_FOR_MS:
            raise ControlError(f"for: {change.for_ms} ms is not between 1s and 7d", "for")


def _meant(target: str, ids: list[str]) -> str:
    """` (did you mean 'x'?)` for the id of `ids` that `target` was likely typed for; empty if none."""
    near = near_name(target, ids)
    return f" (did you mean {shown(near)}?)" if near is not None else ""


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One recorded change."""

    id: str
    #: when it was made (ms since the epoch, Redis's clock)
    at_ms: int
    who: str
    action: str
    #: provider | node
    target_kind: str
    target: str
    #: what it is now: `drained`, `cordoned`, `active`, a capacity, or `none` (override cleared)
    value: str
    #: when the new capacity override expires (ms); None = until cleared
    until_ms: int | None
    #: what it was before (the same words)
    previous: str
    previous_until_ms: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: dict[bytes, bytes]) -> AuditEntry:
        f = as_text_map(fields)
        ident = text(entry_id) or ""
        at_ms = _opt_int(f.get("at_ms")) or int(ident.split("-", 1)[0])
        return cls(id=ident, at_ms=at_ms, who=f.get("who", ""), action=f.get("action", ""),
                   target_kind=f.get("target_kind", ""), target=f.get("target", ""), value=f.get("value", ""),
                   until_ms=_opt_int(f.get("until_ms")), previous=f.get("previous", ""),
                   previous_until_ms=_opt_int(f.get("previous_until_ms")))


def _opt_int(value: str | bytes | None) -> int | None:
    if value is None or value in ("", b""):
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def apply(redis: Redis, config: Config, change: Change) -> AuditEntry:
    """Make the change and record it, in one atomic step; the schedulers are woken. Raises
    UnknownTarget or ControlError (nothing is written then)."""
    try:
        check_change(config, change)
    except UnknownTarget:
        if change.action not in CLEARING or not await redis.exists(change.key()):
            raise
    except AboveConfigured as exc:
        raise await _above_an_old_config(redis, change, exc) from None
    entry_id, _previous, _until = await Scripts(redis).call(
        "control", [change.key(), keys.AUDIT_STREAM],
        [change.action.value, change.target_kind, change.target, change.who,
         change.capacity if change.capacity is not None else "", change.for_ms or 0, keys.AUDIT_MAX_ENTRIES,
         keys.SCHEDULER_SIGNALS])
    (entry,) = await redis.xrange(keys.AUDIT_STREAM, entry_id, entry_id)
    return AuditEntry.from_entry(*entry)


async def _above_an_old_config(redis: Redis, change: Change, exc: AboveConfigured) -> ControlError:
    """`exc`, or, for a capacity above the reader's config that the provider's workers announce
    (a rollout raised it; this config is older), `exc` saying so: "raise it in the config" alone sends
    the operator to a config that may say it already."""
    try:
        announced = _opt_int(await redis.hget(keys.heartbeat(change.target), "capacity"))
    except REDIS_DOWN:  # (a bad value is said as one, Redis or not)
        return exc
    if change.capacity is None or announced is None or change.capacity > announced:
        return exc
    return AboveConfigured(change, exc.configured, announced)


async def read_audit(redis: Redis, limit: int = 50, before: str | None = None) -> list[AuditEntry]:
    """The newest `limit` changes (at most MAX_AUDIT_READ), newest first; `before` an entry id to page
    back (ControlError, param `before`, if it is not one; `0-0`, before every entry: none)."""
    limit = max(1, min(limit, MAX_AUDIT_READ))
    parsed = None
    if before is not None:
        parsed = entry_id(before)
        if parsed is None:
            raise ControlError(f"before: {shown(before)} is not an audit entry id (<ms>-<seq>, such as "
                               "1796052617385-0)", "before")
        if parsed in ((0, 0), (0, None)):  # Redis refuses an exclusive end below the first id there can be
            return []
    # (`<ms>` alone is `<ms>-0`: an exclusive `(<ms>` would still take the entries of that ms, as
    # Redis ends it at `<ms>-<max seq>`)
    top = "+" if parsed is None else f"({parsed[0]}-{parsed[1] or 0}"
    raw = await redis.xrevrange(keys.AUDIT_STREAM, top, "-", count=limit)
    return [AuditEntry.from_entry(ident, fields) for ident, fields in raw]


# --- reading the state ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderControl:
    """What operators set for one provider (and its node), at one instant."""

    #: since when it is drained (ms); None = not drained
    drained_since_ms: int | None = None
    #: since when its node is cordoned (ms); None = not cordoned
    cordoned_since_ms: int | None = None
    #: the capacity an operator set; None = the announced one
    capacity_override: int | None = None
    #: when that override expires (ms); None = until cleared
    capacity_override_until_ms: int | None = None

    @property
    def blocked(self) -> bool:
        """It takes no new runs (drained, or its node cordoned)."""
        return self.drained_since_ms is not None or self.cordoned_since_ms is not None

    def state(self, in_flight: int) -> str:
        """`active`; `draining` while blocked with runs still in flight; then `drained`."""
        if not self.blocked:
            return "active"
        return "draining" if in_flight > 0 else "drained"


#: Nothing set.
NONE = ProviderControl()

#: Replies `queue_reads` adds to a pipeline per provider and per node.
PER_PROVIDER = 2
PER_NODE = 1


def queue_reads(pipe: Pipeline, config: Config) -> None:
    """Add the reads of every provider's and node's control state to `pipe` (see `from_replies`).
    MGET, as the dispatch scripts read them: a key of another type (a hash written by hand) is none,
    where GET's WRONGTYPE failed the whole read."""
    for node in config.nodes:
        for p in node.providers:
            pipe.mget(keys.drained(p.id), keys.capacity_override(p.id))
            pipe.execute_command("PEXPIRETIME", keys.capacity_override(p.id))
    for node in config.nodes:
        pipe.mget(keys.cordoned(node.id))


def from_replies(config: Config, replies: list[Any]) -> tuple[dict[str, ProviderControl], dict[str, int | None]]:
    """(provider id -> its control state, node id -> since when it is cordoned), from the replies of
    `queue_reads`, in order. Pure."""
    providers = [(node.id, p.id) for node in config.nodes for p in node.providers]
    n = len(providers) * PER_PROVIDER
    cordons = {node.id: _since(replies[n + i][0]) for i, node in enumerate(config.nodes)}
    out = {}
    for i, (node_id, pid) in enumerate(providers):
        (drained, override), expires_at = replies[PER_PROVIDER * i:PER_PROVIDER * (i + 1)]
        value = capacity_override(override)
        # (Redis's own expiry time, the `until_ms` the audit recorded: no clock of this process in it)
        out[pid] = ProviderControl(
            drained_since_ms=_since(drained), cordoned_since_ms=cordons[node_id], capacity_override=value,
            capacity_override_until_ms=int(expires_at) if value is not None and int(expires_at) > 0 else None)
    return out, cordons


def _since(value: bytes | str | None) -> int | None:
    """A drain's or a cordon's key: since when (ms), 0 when its value says no time (one written by
    hand, `SET iop:drain:p yes`), None when there is none. The schedulers and the dispatch script
    ask only whether the key exists."""
    if value is None:
        return None
    since = _opt_int(value)
    return since if since is not None and since >= 0 else 0


async def read_control(redis: Redis, config: Config) -> tuple[dict[str, ProviderControl], dict[str, int | None]]:
    pipe = redis.pipeline(transaction=False)
    queue_reads(pipe, config)
    return from_replies(config, await pipe.execute())
