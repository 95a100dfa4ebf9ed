"""Every Redis key, stream, group and channel name iop uses, in one place.

The README's key table is written from `KEY_TABLE` below, and a test checks that the
two agree. Ids and states are plain strings so `redis-cli` shows them as they are;
only request bodies and event payloads are msgpack (a job is its run id alone: no arq payload).
"""

from __future__ import annotations

from typing import Final

PREFIX: Final = "iop"

#: Consumer group that every scheduler replica joins on every model stream.
SCHEDULER_GROUP: Final = "schedulers"
#: Pub/sub channel that wakes every scheduler replica: "*" when a provider's health changed, an
#: operator changed something, a probe ended or a node's last worker stopped; the model id when a
#: run of it was cancelled at its start.
SCHEDULER_SIGNALS: Final = f"{PREFIX}:signals"
#: arq job function name the workers register.
JOB_FUNCTION: Final = "run"


def runs_stream(model_id: str) -> str:
    """Stream of the runs waiting for `model_id`; XLEN is the exact `queued` count."""
    return f"{PREFIX}:runs:{model_id}"


def run_record(run_id: str) -> str:
    """Hash describing one run: state, model, provider, target, timestamps, error."""
    return f"{PREFIX}:run:{run_id}"


def run_events(run_id: str) -> str:
    """Stream of one run's events: dispatched, started, delta, requeued, completed, failed (a
    cancelled run ends with a `failed` event)."""
    return f"{PREFIX}:events:{run_id}"


def leases(provider_id: str) -> str:
    """Sorted set of the slots reserved on a provider: member run id, score lease expiry (ms)."""
    return f"{PREFIX}:leases:{provider_id}"


def heartbeat(provider_id: str) -> str:
    """Hash with a TTL published by the provider's node workers: health, capacity, models."""
    return f"{PREFIX}:provider:{provider_id}"


#: Fields of a provider's heartbeat hash for one served name, each followed by it: runs of it in a
#: row that failed there and another provider then served (`blame:Qwen/Qwen3.6-35B-A3B`), and until
#: when (ms) none of its runs goes there for that blame (`bench:…`; `common.scripts.BLAME`), or
#: because it answered too busy (429 or 503) and asked to be left alone so long (`busy:…` says the
#: same time then; `common.scripts.FINISH`).
BLAME_FIELD: Final = "blame:"
BENCH_FIELD: Final = "bench:"
BUSY_FIELD: Final = "busy:"


#: Sorted set of the providers whose node's workers beat: member the provider id, score until when
#: (ms, the workers' clock) its last heartbeat lives. The catalog names those its own config lacks
#: (a config older or newer than the pool's).
BEATING: Final = f"{PREFIX}:beating"


def probing(provider_id: str) -> str:
    """String with a TTL held while a health probe that would disturb a run is out; no run is
    dispatched to the provider meanwhile."""
    return f"{PREFIX}:probing:{provider_id}"


def drained(provider_id: str) -> str:
    """String held while an operator drains the provider: the time (ms) the drain began. No run is
    dispatched to it meanwhile (the `dispatch` script checks it); its running runs go on."""
    return f"{PREFIX}:drain:{provider_id}"


def cordoned(node_id: str) -> str:
    """String held while an operator cordons the node: the time (ms) the cordon began. No run is
    dispatched to any of its providers meanwhile."""
    return f"{PREFIX}:cordon:{node_id}"


def capacity_override(provider_id: str) -> str:
    """String (with a TTL when it was given one) holding the capacity an operator set for the provider;
    the policy and the `dispatch` script use it instead of the configured capacity."""
    return f"{PREFIX}:capacity:{provider_id}"


#: Stream of every operator change (drain, cordon, capacity override): who, what, previous value.
AUDIT_STREAM: Final = f"{PREFIX}:audit"
#: A key nothing writes: the gateway's `/readyz` reads it through a script (`ready`), so that a Redis
#: user without the right to run scripts, or to read iop's keys, is not ready.
READY_PROBE: Final = f"{PREFIX}:ready"
#: Entries the audit stream keeps at least (XADD MAXLEN ~: Redis trims in whole blocks, so a little more).
AUDIT_MAX_ENTRIES: Final = 10_000
#: Stream of load samples (per provider in_flight and capacity, per model queued and oldest wait),
#: written by one scheduler replica at a time every `runtime.history_interval_ms`.
HISTORY_STREAM: Final = f"{PREFIX}:history"


def node_queue(node_id: str) -> str:
    """arq queue (a sorted set of job ids) of one node; job id = run id."""
    return f"{PREFIX}:node:{node_id}"


def node_health(node_id: str) -> str:
    """String (with a TTL) arq writes for the node's workers: its health check (jobs done, failed,
    ongoing, queued). Not arq's default, `{queue}:health-check`: a node whose id ends in
    `:health-check` had its queue there (its worker died on WRONGTYPE)."""
    return f"{PREFIX}:health-check:{node_id}"


def node_wake(node_id: str) -> str:
    """List the dispatch script LPUSHes each queued job's id onto; idle workers BLMOVE it. At most
    1,024 ids, and gone `runtime.lease_ttl_ms` after the last (by then an older id's run was started,
    or its lease ran out)."""
    return f"{PREFIX}:wake:{node_id}"


def node_workers(node_id: str) -> str:
    """Sorted set of the node's live worker processes: member the instance id, score until when (ms)
    its last heartbeat vouches for it. The last one to stop hands the node's work back at once."""
    return f"{PREFIX}:workers:{node_id}"


def node_passed(node_id: str) -> str:
    """List of the ids of jobs a worker of the node took off its wake list and passed over: their
    run's provider or model is not in its config (a rollout half done), while another live worker
    of the node has them. That worker's `take_woken` takes them from here first."""
    return f"{PREFIX}:passed:{node_id}"


def worker_serves(instance: str) -> str:
    """Set of one worker process: the `provider<TAB>model` pairs its config serves, written as it
    starts and again with each of its heartbeats (TTL: heartbeat_ttl_ms). A missing set is not
    checked."""
    return f"{PREFIX}:serves:{instance}"


def worker_woken(instance: str) -> str:
    """List of one worker process (its instance id): the job id its blocking `BLMOVE` took off its
    node's wake list, for the `take_woken` script sent with it."""
    return f"{PREFIX}:woken:{instance}"


def worker_answered(instance: str) -> str:
    """String (with a TTL) of one worker process: the runs its last `take_woken` answer started
    (`id:attempt`, comma-separated), until its next call says it received them."""
    return f"{PREFIX}:answered:{instance}"


def node_cancel(node_id: str) -> str:
    """Pub/sub channel carrying the ids of runs to cancel on that node's workers."""
    return f"{PREFIX}:cancel:{node_id}"


def scheduler_channel(consumer: str) -> str:
    """Pub/sub channel of one scheduler replica: a model whose oldest waiting run it holds may go
    on (a slot freed, or the run ahead of it left). Payload: the model id."""
    return f"{PREFIX}:signals:{consumer}"


def gateway_inbox(gateway_id: str) -> str:
    """Stream of one gateway process: a copy of every event of the runs it follows (written with
    the event itself, for every run whose record names the gateway among its `watchers`)."""
    return f"{PREFIX}:inbox:{gateway_id}"


#: An inbox keeps this many entries at most (MAXLEN ~), and lives this long after its last one.
INBOX_MAXLEN: Final = 10_000
INBOX_TTL_MS: Final = 3_600_000
#: A run's watcher written as `{gateway id}~` gets only the events that carry output or end the run
#: (a completion caller's gateway); without it, every event (the runs API).
OUTPUT_ONLY: Final = "~"


#: Hash of the gateway processes that keep a liveness key: gateway id -> when it started (ms). A
#: gateway it names whose `gateway_alive` key is gone has died; one it does not name (an older
#: version's, or one that started while Redis was full) is presumed alive.
GATEWAYS: Final = f"{PREFIX}:gateways"
#: A dead gateway's field is removed this long after it started.
GATEWAY_FORGET_MS: Final = 86_400_000


def gateway_alive(gateway_id: str) -> str:
    """String with a TTL (`runtime.gateway_liveness_ms`) that a live gateway keeps refreshing."""
    return f"{PREFIX}:gateway:{gateway_id}"


def scheduler_alive(consumer: str) -> str:
    """String with a TTL that a live scheduler replica keeps refreshing."""
    return f"{PREFIX}:scheduler:{consumer}"


def key_in_flight(key_name: str) -> str:
    """Sorted set of an API key's runs that are queued or running: member run id, score the time
    (ms) by which the run has surely ended (a bound, should an end ever go unrecorded)."""
    return f"{PREFIX}:inflight:{key_name}"


def key_requests(key_name: str) -> str:
    """Sorted set of the runs an API key started in the last minute: member run id, score when (ms)."""
    return f"{PREFIX}:requests:{key_name}"


#: A key's usage of one day is `{USAGE_PREFIX}{key}:{YYYY-MM-DD}`.
USAGE_PREFIX: Final = f"{PREFIX}:usage:"
#: How long a day's usage is kept (the all-time totals are kept for good).
USAGE_RETENTION_S: Final = 400 * 86_400
#: The fields of a usage hash, each followed by `:` and the model id (`runs:qwen3.6:35b`).
USAGE_FIELDS: Final = ("runs", "prompt_tokens", "completion_tokens", "failures")


def usage_day(key_name: str, day: str) -> str:
    """Hash of an API key's usage on one UTC day (`YYYY-MM-DD`): `runs:{model}`, `prompt_tokens:{model}`,
    `completion_tokens:{model}`, `failures:{model}`."""
    return f"{USAGE_PREFIX}{key_name}:{day}"


def usage_total(key_name: str) -> str:
    """Hash of an API key's usage since it first ran anything (same fields as a day's)."""
    return f"{PREFIX}:usage-total:{key_name}"


def arq_in_progress(run_id: str) -> str:
    """arq's own marker of a job being executed by a worker; iop's `take` writes the worker's id in it."""
    return f"arq:in-progress:{run_id}"


#: (pattern, type, what it holds, the redis-cli command that reads it). The README's
#: Redis key table must list every pattern here, with the same type. A type says whether the key
#: has a TTL: `… + TTL` always (while it exists), `… (+ TTL)` only when it was given one, else never
#: (`tests/test_redis_keys_e2e.py` holds real keys to it).
KEY_TABLE: Final[tuple[tuple[str, str, str, str], ...]] = (
    (runs_stream("{model}"), "stream", "runs waiting for the model, oldest first; length = queued",
     "XLEN / XRANGE iop:runs:{model} - +"),
    (SCHEDULER_GROUP, "consumer group", "the schedulers' group on every runs stream",
     "XINFO GROUPS iop:runs:{model}; XPENDING iop:runs:{model} schedulers"),
    (run_record("{run}"), "hash + TTL", "state, model, node, provider, target, timestamps, error",
     "HGETALL iop:run:{run}"),
    (run_events("{run}"), "stream + TTL", "the run's events in order",
     "XRANGE iop:events:{run} - +"),
    (leases("{provider}"), "sorted set", "reserved slots: run id -> lease expiry (ms); in_flight = live members",
     "ZRANGE iop:leases:{provider} 0 -1 WITHSCORES"),
    (heartbeat("{provider}"), "hash + TTL",
     "health, reason, capacity, models, last heartbeat; health evidence (ok_ms, fails, fail_reason, probe_ms, "
     "blame:/bench:/busy:{served})",
     "HGETALL iop:provider:{provider}; PTTL iop:provider:{provider}"),
    (BEATING, "sorted set + TTL", "providers whose node's workers beat: provider id -> until (ms) its last heartbeat "
     "lives; the catalog names those its config lacks", "ZRANGE iop:beating 0 -1 WITHSCORES"),
    (probing("{provider}"), "string + TTL", "a probe that would disturb a run is out; dispatch waits",
     "EXISTS iop:probing:{provider}"),
    (drained("{provider}"), "string", "the provider is drained: takes no new runs; value = since (ms)",
     "GET iop:drain:{provider}"),
    (cordoned("{node}"), "string", "the node is cordoned: none of its providers takes new runs; value = since (ms)",
     "GET iop:cordon:{node}"),
    (capacity_override("{provider}"), "string (+ TTL)", "an operator's capacity for the provider, until cleared "
     "or expired", "GET iop:capacity:{provider}; PTTL iop:capacity:{provider}"),
    (AUDIT_STREAM, "stream", "operator changes: who, action, target, value, previous (capped)",
     "XREVRANGE iop:audit + - COUNT 10"),
    (READY_PROBE, "none: never written", "read by the gateway's /readyz through a script: may iop's Redis user run "
     "scripts and read iop's keys", "EXISTS iop:ready"),
    (HISTORY_STREAM, "stream", "load samples for the catalog's charts (capped by time and count)",
     "XREVRANGE iop:history + - COUNT 1"),
    (node_queue("{node}"), "sorted set (arq)",
     "jobs for the node's workers, queued or running (until the run ends there)",
     "ZRANGE iop:node:{node} 0 -1 WITHSCORES"),
    (node_health("{node}"), "string + TTL (arq)",
     "arq's health check of the node's workers (not read by iop)", "GET iop:health-check:{node}"),
    (node_wake("{node}"), "list + TTL", "ids of jobs just queued, popped by idle workers (at most 1,024; "
     "gone a lease after the last)", "LRANGE iop:wake:{node} 0 -1"),
    (node_workers("{node}"), "sorted set + TTL", "the node's live worker processes: instance -> until (ms)",
     "ZRANGE iop:workers:{node} 0 -1 WITHSCORES"),
    (node_passed("{node}"), "list + TTL", "ids of jobs a worker of the node passed over (their provider or "
     "model is not in its config: a rollout half done) for its other workers (at most 1,024)",
     "LRANGE iop:passed:{node} 0 -1"),
    (worker_serves("{instance}"), "set + TTL", "the provider<TAB>model pairs a worker process's config serves",
     "SMEMBERS iop:serves:{instance}"),
    (worker_woken("{instance}"), "list", "the job id a worker's BLMOVE just moved off its node's wake list",
     "LRANGE iop:woken:{instance} 0 -1"),
    (worker_answered("{instance}"), "string + TTL", "the runs (id:attempt) a worker's last take_woken answer "
     "started, until its next call says it received them", "GET iop:answered:{instance}"),
    (node_cancel("{node}"), "pub/sub channel", "run ids to cancel on the node", "SUBSCRIBE iop:cancel:{node}"),
    (SCHEDULER_SIGNALS, "pub/sub channel",
     "wakes every scheduler replica ('*': a provider's health changed, an operator's change, a probe ended, a "
     "node's last worker stopped; a model id: a run of it was cancelled at its start)",
     "SUBSCRIBE iop:signals"),
    (scheduler_channel("{consumer}"), "pub/sub channel", "wakes the one replica holding a model's oldest waiting run",
     "PSUBSCRIBE iop:signals:*"),
    (scheduler_alive("{consumer}"), "string + TTL", "a live scheduler replica", "KEYS iop:scheduler:*"),
    (gateway_inbox("{gateway}"), "stream + TTL", "copies of the events of the runs a gateway follows",
     "XREVRANGE iop:inbox:{gateway} + - COUNT 10"),
    (GATEWAYS, "hash", "the gateway processes that keep a liveness key: id -> when each started (ms)",
     "HGETALL iop:gateways"),
    (gateway_alive("{gateway}"), "string + TTL", "a live gateway (one named in iop:gateways without it died: its "
     "callers' runs are cancelled)", "KEYS iop:gateway:*"),
    (key_in_flight("{key}"), "sorted set + TTL", "an API key's runs queued or running: run id -> end bound (ms)",
     "ZCARD iop:inflight:{key}"),
    (key_requests("{key}"), "sorted set + TTL", "runs an API key started in the last 60 s: run id -> when (ms)",
     "ZCARD iop:requests:{key}"),
    (usage_day("{key}", "{day}"), "hash + TTL", "an API key's usage on a UTC day (YYYY-MM-DD): runs/prompt_tokens/"
     "completion_tokens/failures:{model}", "HGETALL iop:usage:{key}:2026-11-30"),
    (usage_total("{key}"), "hash", "an API key's usage for good (same fields)", "HGETALL iop:usage-total:{key}"),
    (arq_in_progress("{run}"), "string + TTL (arq)",
     "arq's marker of a job being run; value: the worker process that took it", "GET arq:in-progress:{run}"),
)
