"""Lua scripts: every state change that must be atomic, registered once per connection.

Each script takes all its keys in KEYS (names from `common.keys`), reads the server clock
with TIME, and writes plain strings except event payloads (cmsgpack). Callers use
`Scripts.call`, which runs EVALSHA and reloads the script if Redis lost it (a restart).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from hashlib import sha1
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from common import keys
from common.policy import DOWN, DOWN_REASON
from common.redisline import Line, line_of

# Scripts at Redis's `maxmemory` (noeviction, as iop runs it). A script without a shebang is
# refused there at its first write that could grow memory, unless it wrote anything before (a
# ZREM counts): it may then run whole. So a script that may grow memory writes nothing before it
# decides (`enqueue`: a full Redis refuses its XADD, and a repeated call, which only reads, is
# answered); and what ends, cancels or keeps a run runs whatever the memory (`FREES`: `finish`,
# `reap`, `drop_queued`, `renew`), since refusing it would keep a run going for nobody, lose a
# running run's lease, or never free its slot and request body. Those add little but an ended
# run's last events (a non-stream run's answer, up to `runtime.max_response_bytes`, or a stream's
# last read of its provider, in its events and each follower's inbox), and `finish`'s
# `requeue_unable` the request body (up to `runtime.max_body_bytes`) that the start of what was the
# run's last attempt took out: Redis may pass `maxmemory` by that much a run ending meanwhile.
FREES = "#!lua flags=allow-oom\n"

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# A key of another type than iop writes there (written by hand) holds nothing of iop's; the scripts
# whose read or write of it would fail midway (their state written and the rest not) make it a
# `redis.pcall` and ask `wrongtype(reply)`: false for any reply but an error, true for WRONGTYPE,
# and any other error raised again as `redis.call` would have (its prefix kept: OOM stays OOM).
# `drop_wrong(key)` deletes such a key, said in Redis's log. Every script that uses them has this
# prelude once, before its fragments (`tests/test_scripts_static.py` checks).
_WRONG = """
local function wrongtype(reply)
  if type(reply) ~= 'table' or not reply.err then return false end
  if not string.find(reply.err, 'WRONGTYPE', 1, true) then error(reply) end
  return true
end
local function drop_wrong(key)
  redis.log(redis.LOG_WARNING, 'iop: ' .. key .. ' held another type than iop writes there (written by hand?): deleted')
  redis.call('DEL', key)
end
"""

# Why a run cancelled once dispatched ends, from its record's `cancel_reason` and `cancel_code`
# (`drop_queued` keeps them there; no code: `cancelled`): the message, the error code, and the data
# of its `failed` event (`default_data`, the packed ErrorInfo of "cancelled by the caller", before
# output, when the record has no reason: written by an earlier version; `output`: some of its output
# went out, and the data says so whatever the reason).
# `cancel_data` packs that data with the keys of the worker's own (`ErrorInfo.to_wire`), `status`
# and `detail` null (a Lua table holds no nil: packed as one, a runs-API follower read a cancel
# written here without the keys a worker's has).
_CANCEL_REASON = """
local function cancel_data(code, message, output)
  return string.char(0x85) .. cmsgpack.pack('code', code, 'message', message, 'status') .. string.char(0xc0)
    .. cmsgpack.pack('detail') .. string.char(0xc0) .. cmsgpack.pack('before_output', not output)
end
local function cancel_reason(reason, code, default_data, output)
  if not reason then
    if not output then return 'cancelled by the caller', 'cancelled', default_data end
    reason = 'cancelled by the caller'
  end
  code = code or 'cancelled'
  return reason, code, cancel_data(code, reason, output)
end

-- End a dispatched run cancelled, for the reason its record keeps (`cancel_reason`): its `failed`
-- event (its events then live `ttl`), its state and error, and its end for its key
-- (`watchers`, `key`, `model`, `limited`: as the record has them, read already; nil: read here).
local function end_cancelled(record, events, run_id, why_reason, why_code, default_data, output, ttl,
                             watchers, key, model, limited, prompt, completion)
  local reason, code, data = cancel_reason(why_reason, why_code, default_data, output)
  add_event(record, events, run_id, 'failed', data, watchers)
  redis.call('EXPIRE', events, ttl)
  redis.call('HSET', record, 'state', 'cancelled', 'finished_ms', now, 'error_code', code, 'error_message', reason)
  ended(record, run_id, 'cancelled', prompt or 0, completion or 0, key, model, limited)
end
"""

# Put a dispatched run back at the tail of its model's queue; earlier providers go along as
# `tried`, so the retry avoids them (or, `elsewhere`, never goes to them: `exclude` = 1; `busy` = 1
# when the last was too busy to take it, so a run no other can take then fails as a busy one), and
# so do the providers that would refuse it (`refuse`, as `enqueue` wrote it), those that refused
# it as unable to do what it asks (`unable_by`, as FINISH wrote it) and those that answered it a
# 5xx, a 429 or a redirect (the record's `elsewhere`, as FINISH wrote it): it never goes to any of
# them, however a later attempt ends (a connection reset, a lost worker: each at most once).
# Shared by FINISH (a failed attempt), REAP (a lost one) and WORKER_LEFT (one never started).
# `ttl` (s; nil: the caller sets it): the record lives that long from its queueing again, as from
# its first (no dispatch sets it: the queueing's outlasts the attempt).
_REQUEUE = """
local function requeue(record, stream, run_id, elsewhere, busy, ttl)
  local was = redis.call('HMGET', record, 'tried', 'refuse', 'unable_by', 'elsewhere')
  local fields = {'run', run_id, 'tried', was[1] or ''}
  if was[2] then table.insert(fields, 'refuse') table.insert(fields, was[2]) end
  if was[3] then table.insert(fields, 'unable_by') table.insert(fields, was[3]) end
  if was[4] then table.insert(fields, 'elsewhere') table.insert(fields, was[4]) end
  if elsewhere then table.insert(fields, 'exclude') table.insert(fields, '1') end
  if busy then table.insert(fields, 'busy') table.insert(fields, '1') end
  local entry = redis.call('XADD', stream, '*', unpack(fields))
  redis.call('HSET', record, 'state', 'queued', 'entry', entry)
  redis.call('HDEL', record, 'provider', 'node', 'target', 'dispatched_ms', 'started_ms', 'worker')
  if ttl then redis.call('EXPIRE', record, ttl) end
end
"""

# The UTC day (YYYY-MM-DD) of a time in ms (days-from-civil, inverted; Redis Lua has no os.date).
_UTC_DAY = """
local function utc_day(ms)
  local z = math.floor(ms / 86400000) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d-%02d-%02d', y, m, d)
end
"""

# The end of a run: its request body leaves Redis (nothing needs it any more), and for the API
# key that started it (the record's `key`) it leaves the key's in-flight set and its usage is
# added to the key's day and all-time totals. Every script that ends a run calls it, exactly
# once per run (they only end a run that is not ended yet). `key`, `model` and `limited`: the
# record's, when the caller read them already (false: the record has none); nil, and they are read
# here. The record's `limited` is '0' when `enqueue` did not put the run in its key's in-flight set
# (the key has no max_in_flight): nothing to take out then. (A record without it, written by an
# earlier version, is taken out as before.) The day's totals get their TTL when the day's hash is
# made (its first count of a model: a day's hash is only ever written here).
_ENDED = _UTC_DAY + f"""
local function ended(record, run_id, state, prompt, completion, key, model, limited)
  redis.call('HDEL', record, 'body')
  if key == nil then
    local f = redis.call('HMGET', record, 'key', 'model', 'limited')
    key, model, limited = f[1], f[2], f[3]
  end
  if not key then return end
  -- (a key's in-flight set or usage hash of another type, written by hand: deleted, not left to
  -- fail every end of the key's runs midway; `pcall`, no cost to the reads that find the right type)
  if limited ~= '0' then
    local flight = '{keys.key_in_flight("")}' .. key
    if wrongtype(redis.pcall('ZREM', flight, run_id)) then drop_wrong(flight) end
  end
  model = model or '-'
  local day = '{keys.USAGE_PREFIX}' .. key .. ':' .. utc_day(now)
  local failed = (state == 'failed' or state == 'timed_out') and 1 or 0
  local adds = {{['runs:' .. model] = 1, ['failures:' .. model] = failed,
    ['prompt_tokens:' .. model] = tonumber(prompt), ['completion_tokens:' .. model] = tonumber(completion)}}
  local fields = {{'runs:' .. model, 'failures:' .. model, 'prompt_tokens:' .. model, 'completion_tokens:' .. model}}
  for _, h in ipairs({{day, '{keys.usage_total("")}' .. key}}) do
    -- one read and one write a hash (the counts it changes), not an HINCRBY a count; '%d', as a
    -- Lua number past 10^14 prints in exponent form (exact up to 2^53: 10^9 tokens a run at most)
    local was, set = redis.pcall('HMGET', h, unpack(fields)), {{}}
    if wrongtype(was) then
      drop_wrong(h)
      was = {{}}
    end
    for i, field in ipairs(fields) do
      if adds[field] > 0 then
        set[#set + 1] = field
        set[#set + 1] = string.format('%d', (tonumber(was[i]) or 0) + adds[field])
      end
    end
    redis.call('HSET', h, unpack(set))
    if not was[1] and h == day then redis.call('EXPIRE', day, {keys.USAGE_RETENTION_S}) end
  end
end
"""

#: The most runs of one model a replica sends to the `dispatch` script in one round trip.
DISPATCH_BATCH = 16

# Wake the one scheduler replica that holds the oldest run waiting in a model's stream (it alone
# may dispatch next: FIFO), on that replica's own channel (prefix + consumer name), with the
# model id. Nobody holds a run not read yet: the replica that reads it wakes by itself. Returns
# that replica ('' if none). `me` and `n` (the `dispatch` script's): the replica that just
# dispatched is not woken (it goes on with its next run anyway); it is told how many runs from the
# head on, in a row and at most `n`, are its own: those it may send in one pipeline without one
# finding another replica's older run ahead of it.
_WAKE = f"""
local function wake_head(stream, channel_prefix, me, n)
  n = n or 1
  local entries = redis.call('XRANGE', stream, '-', '+', 'COUNT', n)
  if #entries == 0 then return '', 0 end
  local pending = redis.pcall('XPENDING', stream, '{keys.SCHEDULER_GROUP}', entries[1][1], entries[#entries][1], n)
  if type(pending) ~= 'table' or pending.err ~= nil or #pending == 0 or pending[1][1] ~= entries[1][1] then
    return '', 0
  end
  local holder = pending[1][2]
  if holder ~= me then
    redis.call('PUBLISH', channel_prefix .. holder, string.sub(stream, {len(keys.runs_stream("")) + 1}))
    return holder, 0
  end
  local mine = 0
  for i = 1, #entries do
    if pending[i] == nil or pending[i][1] ~= entries[i][1] or pending[i][2] ~= me then break end
    mine = mine + 1
  end
  return holder, mine
end
"""

# Add an event to a run, and hand a copy to every gateway that follows the run (the record's
# `watchers`: gateway ids, comma-separated) through its inbox, which that gateway's one reader
# waits on. The copy says which run and which event (`run`, `id`) it is. A watcher written with
# the `{keys.OUTPUT_ONLY}` suffix (the gateway of a completion caller, who wants the output and the
# end, nothing else) gets only `delta`, `completed` and `failed` copies. `watchers`: the record's,
# when the caller read them already (false: none); nil, and they are read here.
_EVENTS = f"""
local function add_event(record, events, run_id, etype, data, watchers)
  local id = redis.pcall('XADD', events, '*', 'type', etype, 'data', data)
  if wrongtype(id) then
    -- (the run's events of another type, written by hand: the script failed here midway, after its
    -- state was written, and every script after it of the run, the worker's take of its node's jobs
    -- with it; such a key holds no event: it is deleted and the event added)
    drop_wrong(events)
    id = redis.call('XADD', events, '*', 'type', etype, 'data', data)
  end
  if watchers == nil then watchers = redis.call('HGET', record, 'watchers') end
  if watchers then
    local output = etype == 'delta' or etype == 'completed' or etype == 'failed'
    for watcher in string.gmatch(watchers, '[^,]+') do
      local gateway, n = string.gsub(watcher, '{keys.OUTPUT_ONLY}$', '')
      if output or n == 0 then
        local inbox = '{keys.gateway_inbox("")}' .. gateway
        -- (pcall: an inbox of another type, written by hand, fails only its copy, not the script
        -- midway, which left a finished run `running` for good; its gateway deletes it and reads
        -- its runs' own streams)
        local copied = redis.pcall('XADD', inbox, 'MAXLEN', '~', {keys.INBOX_MAXLEN}, '*', 'run', run_id, 'id', id,
          'type', etype, 'data', data)
        if type(copied) ~= 'table' then redis.call('PEXPIRE', inbox, {keys.INBOX_TTL_MS}) end
      end
    end
  end
  return id
end
"""

# What a run or a probe showed about a provider's health (`workers.health`), added to its
# heartbeat hash if it has one: 'ok' (a sign of life) resets the strikes, 'fail' adds some.
# `fresh_ms` (runs' ends give it): an 'ok' is not written when the hash holds one younger than
# that and no strikes, so a busy provider costs one read a run, not a write. (Its probe may then
# come up to `fresh_ms` early: the worker keeps it well under the probe interval.)
# Strikes that reach `DOWN` set its `health` (and `reason`) here, as `judge` will at the next
# beat: a run this end puts back in the queue is not dispatched to a dead server again in the
# milliseconds before that beat (a refused connection would use up its attempts there). A sign
# of life sets it available, as `judge` would.
# `also` (a field name, or nil): read with the freshness of an 'ok', when that is read. Returns
# whether it was read, and its value then (nothing writes it here).
_EVIDENCE = f"""
local function evidence(hb, kind, strikes, reason, health, fresh_ms, also)
  if kind == '' then return false end
  local known, read, value = false, false, nil  -- (known: whether the hash is known to exist)
  if kind == 'ok' and fresh_ms then
    local seen = also and redis.call('HMGET', hb, 'ok_ms', 'fails', also) or redis.call('HMGET', hb, 'ok_ms', 'fails')
    read, value = also ~= nil, also and seen[3]
    local ok_ms = tonumber(seen[1])
    if ok_ms and now - ok_ms < tonumber(fresh_ms) and (seen[2] == '0' or not seen[2]) then return read, value end
    known = ok_ms ~= nil
  end
  if not known and redis.call('EXISTS', hb) == 0 then return read, value end
  if kind == 'ok' then
    redis.call('HSET', hb, 'ok_ms', now, 'fails', 0, 'health', 'available', 'reason', '')
  elseif redis.call('HINCRBY', hb, 'fails', strikes) >= {DOWN} then
    redis.call('HSET', hb, 'fail_ms', now, 'fail_reason', reason, 'fail_health', health, 'health', health,
      'reason', reason ~= '' and reason or '{DOWN_REASON}')
  else
    redis.call('HSET', hb, 'fail_ms', now, 'fail_reason', reason, 'fail_health', health)
  end
  return read, value
end
"""

# Queue a run, unless its API key is at a limit, no provider of the model is available, or the
# model's queue is full; once only for a run id. The key's limits are exact across gateways: its
# in-flight runs are a set of run ids (left by `account` when a run ends; the score bounds a
# member's life, should an end ever go unrecorded), its requests of the last minute a sliding
# window of run ids.
# A model's queue is full when it holds `max_queue` runs more than the model has free slots: runs
# not dispatched yet that a free slot will take at once are not waiting (a burst of callers fills
# the free slots, then the queue; `max_queue: 0` runs what finds a free slot and queues nothing).
# The runs waiting for other models that share a provider with it take the free slots of the
# providers they share first (in a burst to two models, each counted a shared provider's slots as
# its own, and 3 runs waited in a queue of `max_queue: 0`). Bounded the other way: a burst to two
# such models may be refused early by up to the other models' free slots of providers this one
# lacks (their waiting runs may be bound for those), or that refuse them.
# KEYS: runs stream, run record, key in-flight set, key requests window, then for each of the model's
#       providers 5 keys: its heartbeat, its leases, its capacity override, its drain flag, its node's
#       cordon flag..., then the runs streams of the other models that share a provider with it...
# ARGV: run id, max_queue, ttl_s, model, kind, stream flag, body, key name, max_in_flight (0: none),
#       requests_per_minute (0: none), how long a run can last at most (ms), max_attempts, the id of
#       the gateway that follows it (its first watcher), the providers whose adapter would refuse
#       the run (`gateway.refusals`; comma-separated, '' none: it never goes there, and their slots
#       and health count for nothing here), how many keys of KEYS are its providers' (none
#       given: all after the first 4), and for each other model's runs stream after them, which of
#       this model's providers it has ('1' or '0' for each, in their order; comma-separated)
# Returns {'ok', entry, requests left in the window (-1: no window)}, {'key_in_flight', n},
# {'key_rate', n, ms until a request leaves the window}, {'unavailable', queued} or {'full', queued}.
# A provider's capacity: the operator's override, never above the announced one (an override set
# before the config lowered the capacity), as `ProviderSnapshot.effective_capacity`.
_CAPPED = """
local function capped(announced, override)
  -- (an override is an integer in digits, as `policy.capacity_override` reads it: one written by
  -- hand otherwise, '1.5' or ' 2', is none)
  local a, o = tonumber(announced), override and string.match(override, '^%-?%d+$') and tonumber(override)
  if not o then o = nil end
  if a and o and o < a then return o end
  return a or o
end
"""

ENQUEUE = _NOW + _CAPPED + f"""
local heartbeat_prefix_len = #'{keys.heartbeat("")}'
""" + """
-- the same call made again (a dropped connection lost its reply, and the client sent it again):
-- the run is queued already, and must not be queued twice (nor refused by its own limits)
if redis.call('EXISTS', KEYS[2]) == 1 then return {'ok', redis.call('HGET', KEYS[2], 'entry') or '', -1} end
-- (nothing is written before the run is taken: a full Redis refuses the first write, the XADD,
-- and the script then did nothing; its expired members are trimmed when a run is taken)
local max_in_flight, rpm = tonumber(ARGV[9]), tonumber(ARGV[10])
if max_in_flight > 0 then
  local n = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
  if n >= max_in_flight then return {'key_in_flight', n} end
end
local left = -1
if rpm > 0 then
  local n = redis.call('ZCOUNT', KEYS[4], '(' .. (now - 60000), '+inf')
  if n >= rpm then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. (now - 60000), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    return {'key_rate', n, tonumber(oldest[2]) + 60000 - now}
  end
  left = rpm - n - 1
end
local refuse = ARGV[14] or ''
local refused = {}
for p in string.gmatch(refuse, '[^,]+') do refused[p] = true end
local function takes(i)  -- whether the provider of KEYS[i] (its heartbeat) would take the run
  return refuse == '' or not refused[string.sub(KEYS[i], heartbeat_prefix_len + 1)]
end
local last_provider_key = ARGV[15] and 4 + tonumber(ARGV[15]) or #KEYS
local available = false
for i = 5, last_provider_key, 5 do
  if takes(i) and redis.call('HGET', KEYS[i], 'health') == 'available' then available = true break end
end
if not available then return {'unavailable', redis.call('XLEN', KEYS[1])} end
local queued = redis.call('XLEN', KEYS[1])
if queued >= tonumber(ARGV[2]) then
  local free_at = {}  -- the free slots of each provider, by its place among the model's
  for i = 5, last_provider_key, 5 do
    local hb = takes(i) and redis.call('HMGET', KEYS[i], 'health', 'capacity') or {}
    local n = 0
    if hb[1] == 'available' then
      local ops = redis.call('MGET', KEYS[i + 2], KEYS[i + 3], KEYS[i + 4])
      local cap = capped(hb[2], ops[1])
      if cap and not ops[2] and not ops[3] then
        n = math.max(0, cap - redis.call('ZCOUNT', KEYS[i + 1], '(' .. now, '+inf'))
      end
    end
    free_at[#free_at + 1] = n
  end
  -- each other model's waiting runs take the free slots of the providers it shares with this one
  local j = last_provider_key
  for mask in string.gmatch(ARGV[16] or '', '[^,]+') do
    j = j + 1
    local room = 0
    for p = 1, #mask do
      if string.byte(mask, p) == 49 then room = room + free_at[p] end  -- ('1')
    end
    local waiting = room > 0 and redis.call('XLEN', KEYS[j]) or 0
    for p = 1, #mask do
      if waiting == 0 then break end
      if string.byte(mask, p) == 49 then
        local took = math.min(waiting, free_at[p])
        free_at[p], waiting = free_at[p] - took, waiting - took
      end
    end
  end
  local free = 0
  for _, n in ipairs(free_at) do free = free + n end
  if queued >= tonumber(ARGV[2]) + free then return {'full', queued} end
end
local entry
if refuse ~= '' then
  entry = redis.call('XADD', KEYS[1], '*', 'run', ARGV[1], 'refuse', ARGV[14])
  redis.call('HSET', KEYS[2], 'refuse', ARGV[14])
else
  entry = redis.call('XADD', KEYS[1], '*', 'run', ARGV[1])
end
redis.call('HSET', KEYS[2], 'model', ARGV[4], 'kind', ARGV[5], 'stream', ARGV[6], 'body', ARGV[7],
  'state', 'queued', 'created_ms', now, 'entry', entry, 'attempts', 0, 'key', ARGV[8],
  'limited', max_in_flight > 0 and '1' or '0',
  'max_attempts', ARGV[12], 'watchers', ARGV[13])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if max_in_flight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[11]), ARGV[1])
  -- the set lives as long as its longest-lived member (GT), not the newest one's: a quick model's
  -- run must not end the life of a long one's; NX for a set just made (GT counts it as endless)
  if redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[11]), 'GT') == 0 then
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[11]), 'NX')
  end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 60000)
  redis.call('ZADD', KEYS[4], now, ARGV[1])
  redis.call('PEXPIRE', KEYS[4], 60000)
end
return {'ok', entry, left}
"""

# KEYS: runs stream, run record, events, then for every candidate of the run (`policy.candidate_class`
#       not None on the scheduler's snapshot), 8 keys: its heartbeat, its leases, its capacity override,
#       its drain flag, its node's cordon flag, its probing lock, its node's queue, its node's wake list...
# ARGV: run id, entry id, group, lease_ttl_ms, ttl_s, replica channel prefix, heartbeat_ttl_ms, the
#       dispatching replica's consumer name, then for every candidate (same order) 4 values: its class,
#       its provider id, its node, the served name the model has there...
# The scheduler's snapshot (`policy.select_provider`) only says that a run may find a slot now and
# which providers it may go to; here, in the step that reserves the slot, the policy is applied to the
# live state: among candidates whose heartbeat is fresh and says `available` with a capacity, that are
# not drained or cordoned, with a free slot under their capacity (an operator's override when one is
# set, never above the announced one: `capped`), the lowest class, then the lowest in_flight/capacity, then the larger
# capacity, then the lower id (the candidates come in the order of their ids, so the first of equals
# wins; no string comparison here, as Lua's follows the server's locale). So runs that ended or
# started elsewhere since the snapshot, a drain or a heartbeat that went stale never cost a second
# round trip: only 'stale' (no candidate can take it now; the scheduler reads again) or 'probing' (the
# provider picked has a probe out that would disturb a run; the prober signals its end) send the
# scheduler back.
# The job on the node's queue is the run id alone (the run record carries the rest): the worker's
# `take` script reads the record, not an arq job payload.
# Once dispatched (or dropped, its record no longer queued), the replica holding the next waiting
# run of the model is woken (`_WAKE`; not the dispatching one), and the answer to a dispatch says
# which it is: {'ok', consumer ('' if none holds it yet), provider id, how many runs from the head
# on are the dispatching replica's own}. A replica may send that many in one pipeline, oldest first:
# each still checks that its run is the head, so one that cannot go holds back the ones behind it
# ('not_head').
# `dispatch_one`: the whole of a dispatch, for one run; `cands` are its candidates, in the order
# of their ids: {k = the index in KEYS of its first key (heartbeat, leases, capacity override,
# drained, cordoned, probing, node queue, node wake list), class = 0 | 1, provider, node, target,
# listed = true when the candidate must also list `target` among the models its server answered
# with (its heartbeat's `observed_models`; `common.snapshots._lists` for the scheduler's own
# candidates, which come checked)}; `head`: the stream's first two entries (`XRANGE - + COUNT
# 2`) when the caller read them already, nil to read them here: a head with none behind it wakes
# nobody once dispatched (the stream is empty then), without another read of the stream.
_DISPATCH_ONE = _EVENTS + _WAKE + _CAPPED + f"""
local function lists(observed, served)
  if not observed or observed == '' then return true end
  local ok, names = pcall(cjson.decode, observed)
  if not ok or type(names) ~= 'table' or (next(names) ~= nil and #names == 0) then return true end
  for _, name in ipairs(names) do
    if name == served then return true end
  end
  return false
end

local function dispatch_one(stream, record, events, run_id, entry, group, lease_ms, ttl_s, prefix, hb_ttl, me, cands,
                            head)
  head = head or redis.call('XRANGE', stream, '-', '+', 'COUNT', 2)
  if #head == 0 then return 'gone' end
  if head[1][1] ~= entry then
    if #redis.call('XRANGE', stream, entry, entry) == 0 then return 'gone' end
    return 'not_head'
  end
  -- (a record of another type, written by hand, holds no run: it goes as a run whose record is gone,
  -- not every dispatch of the model failed at its head for good)
  local rec = redis.pcall('HMGET', record, 'state', 'tried', 'attempts', 'watchers')
  if wrongtype(rec) then rec = {{}} end
  if rec[1] ~= 'queued' then
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
    -- (the run behind it is the head now: its replica is woken, as after a dispatch)
    if #head > 1 then wake_head(stream, prefix, me, 1) end
    return 'gone'
  end
  local live, oldest_beat = '(' .. now, now - tonumber(hb_ttl)
  local alive, beats, op_keys = {{}}, {{}}, {{}}
  for _, c in ipairs(cands) do
    local k = c.k
    local hb = redis.call('HMGET', KEYS[k], 'health', 'ts_ms', 'capacity', 'observed_models',
      '{keys.BENCH_FIELD}' .. c.target, 'node')
    -- (a heartbeat from another node than the candidate's: the provider moved there in a config
    -- this replica does not run yet; its node's queue is not where it is served)
    if hb[1] == 'available' and tonumber(hb[2]) and tonumber(hb[2]) >= oldest_beat
        and (not c.listed or lists(hb[4], c.target)) and not (tonumber(hb[5]) and tonumber(hb[5]) > now)
        and (not hb[6] or hb[6] == c.node) then
      alive[#alive + 1], beats[#beats + 1] = c, hb
      for x = 2, 5 do op_keys[#op_keys + 1] = KEYS[k + x] end
    end
  end
  if #alive == 0 then return 'stale' end
  -- the operator's capacity override, drain and cordon, and the probing lock of every candidate
  -- alive, in one read: all strings, four a candidate
  local ops = redis.call('MGET', unpack(op_keys))
  local best, best_n, best_cap, best_class, best_probing
  for i, c in ipairs(alive) do
    local o = 4 * (i - 1)
    local cap = capped(beats[i][3], ops[o + 1])
    local class = c.class
    -- (its slots are not counted when it cannot win whatever they are: a higher class than the best
    -- so far, or the same class as a best with none in flight and no larger capacity)
    if not ops[o + 2] and not ops[o + 3] and cap and cap > 0 and (best == nil or class < best_class
        or (class == best_class and (best_n > 0 or cap > best_cap))) then
      local n = redis.call('ZCOUNT', KEYS[c.k + 1], live, '+inf')
      if n < cap and (best == nil or class < best_class or (class == best_class and (
          n * best_cap < best_n * cap or (n * best_cap == best_n * cap and cap > best_cap))))
      then
        best, best_n, best_cap, best_class, best_probing = c, n, cap, class, ops[o + 4]
      end
    end
  end
  if best == nil then return 'stale' end
  if best_probing then return 'probing' end
  local k = best.k
  local provider, node, target = best.provider, best.node, best.target
  local ttl = tonumber(ttl_s)
  redis.call('ZADD', KEYS[k + 1], now + tonumber(lease_ms), run_id)
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
  local tried = rec[2]
  redis.call('HSET', record, 'state', 'dispatched', 'provider', provider, 'node', node, 'target', target,
    'dispatched_ms', now, 'tried', tried and (tried .. ',' .. provider) or provider,
    'attempts', (tonumber(rec[3]) or 0) + 1)
  -- (its `entry` stays: it is read only while the run is queued, and a requeue writes the new one;
  -- no EXPIRE of the record: its queueing set it to ttl_s, which outlasts the wait and the attempt,
  -- config: run_ttl_s > queue_timeout_ms + execution_timeout_ms; a requeue sets it anew)
  redis.call('ZADD', KEYS[k + 6], now, run_id)
  if redis.call('LPUSH', KEYS[k + 7], run_id) > 1024 then redis.call('LTRIM', KEYS[k + 7], 0, 1023) end
  -- (the list lives a lease after its last id: an older id's run was started or reaped by then, so a
  -- node that no worker pops any more, its workers killed or the node taken out of the config,
  -- keeps none for good)
  redis.call('PEXPIRE', KEYS[k + 7], lease_ms)
  add_event(record, events, run_id, 'dispatched', cmsgpack.pack({{provider = provider, node = node, target = target}}),
    rec[4])
  redis.call('EXPIRE', events, ttl)
  -- (a head read alone in the stream leaves it empty: nobody holds a run there to be woken)
  local holder, mine = '', 0
  if #head > 1 then holder, mine = wake_head(stream, prefix, me, {DISPATCH_BATCH}) end
  return {{'ok', holder, provider, mine}}
end
"""

DISPATCH = _NOW + _WRONG + _DISPATCH_ONE + """
local cands = {}
for j = 0, (#KEYS - 3) / 8 - 1 do
  local a = 9 + 4 * j
  cands[j + 1] = {k = 4 + 8 * j, class = tonumber(ARGV[a]), provider = ARGV[a + 1], node = ARGV[a + 2],
    target = ARGV[a + 3]}
end
return dispatch_one(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
  ARGV[8], cands)
"""

# The scheduler sends this in the same write as its blocking read of the model streams
# (`XREADGROUP`), so Redis runs it as soon as the read is answered: the runs the read handed this
# replica are dispatched then, without the round trip through the scheduler (which is told after,
# and dispatches what is left itself). For each model block, it takes the replica's own pending
# entries of the stream (those the read just handed it, and any it took over), oldest first, and
# dispatches each as `dispatch` does, with the candidates the scheduler would give it: the model's
# providers that list its served name (`listed`), classes from the entry's `tried` and `exclude`,
# none of its `refuse`, `unable_by` or `elsewhere` (as `Waiting` makes them). It stops at a run
# that cannot go (not the head, no slot, a probe out), and at one that has waited its model's
# `queue_timeout_ms` (the scheduler times it out): the scheduler's way takes over from there. An
# error stops it too, and is returned after what was done before it (the runs dispatched stay
# dispatched: a script's writes are not undone).
# KEYS: for each model: its runs stream, then `dispatch`'s 8 keys of each of its providers (in
#       the order of their ids)
# ARGV: group, lease ttl ms, run ttl s, replica channel prefix, heartbeat ttl ms, this replica,
#       run record key prefix, events key prefix, the most entries a model, then for each model:
#       its queue_timeout_ms, its providers' count, and for each provider: id, node, served name
# Returns {stream, entry, run id, result, holder, provider, mine} for each run dispatched ('ok')
# or found gone ('gone'), then {stream, entry, run id, 'error', message, '', 0} after an error.
DISPATCH_PENDING = _NOW + _WRONG + _DISPATCH_ONE + """
local out = {}
local function model_block(i, a)
  local stream, timeout, p = KEYS[i], tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local pending = redis.call('XPENDING', stream, ARGV[1], '-', '+', ARGV[9], ARGV[6])
  for _, pe in ipairs(pending) do
    local entry = pe[1]
    if tonumber(string.match(entry, '^(%d+)')) + timeout <= now then return end
    -- (an entry that is not the head, or not in the stream any more, stops the block either way)
    local head = redis.call('XRANGE', stream, '-', '+', 'COUNT', 2)  -- (and whether one follows it)
    if #head == 0 or head[1][1] ~= entry then return end
    local f, fields = head[1][2], {}
    for x = 1, #f, 2 do fields[f[x]] = f[x + 1] end
    local run_id = fields['run']
    if not run_id then return end
    local tried, refuse = {}, {}
    for t in string.gmatch(fields['tried'] or '', '[^,]+') do tried[t] = true end
    for t in string.gmatch(fields['refuse'] or '', '[^,]+') do refuse[t] = true end
    for t in string.gmatch(fields['unable_by'] or '', '[^,]+') do refuse[t] = true end
    for t in string.gmatch(fields['elsewhere'] or '', '[^,]+') do refuse[t] = true end
    local cands = {}
    for j = 0, p - 1 do
      local pa = a + 2 + 3 * j
      local provider = ARGV[pa]
      if not (tried[provider] and fields['exclude'] == '1' or refuse[provider]) then
        cands[#cands + 1] = {k = i + 1 + 8 * j, class = tried[provider] and 1 or 0, provider = provider,
          node = ARGV[pa + 1], target = ARGV[pa + 2], listed = true}
      end
    end
    local ok, r = pcall(dispatch_one, stream, ARGV[7] .. run_id, ARGV[8] .. run_id, run_id, entry, ARGV[1],
      ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], cands, head)
    if not ok then
      out[#out + 1] = {stream, entry, run_id, 'error', tostring(r), '', 0}
      return 'error'
    elseif r == 'gone' then
      out[#out + 1] = {stream, entry, run_id, 'gone', '', '', 0}
    elseif type(r) == 'table' then
      out[#out + 1] = {stream, entry, run_id, 'ok', r[2], r[3], r[4]}
    else
      return
    end
  end
end
local i, a = 1, 10
while i <= #KEYS do
  local ok, r = pcall(model_block, i, a)
  if not ok then out[#out + 1] = {KEYS[i], '', '', 'error', tostring(r), '', 0} end
  if not ok or r == 'error' then return out end
  local p = tonumber(ARGV[a + 1])
  i, a = i + 1 + 8 * p, a + 2 + 3 * p
end
return out
"""

# A worker starts a dispatched run: checks its lease (and a cancel request), marks it running
# and returns its record. Returns {'ok', field, value, ...} or {status}. On the run's last
# possible attempt the request body leaves Redis once read.
# `serves` (false: not checked) is {the serves-set key prefix, the worker's instance, the node's
# live workers key}: a run whose provider and model are not in the worker's set (`keys.worker_serves`:
# its config lacks them, a rollout half done) is passed over, {'passed', provider, model}, with
# nothing written, while another live worker of the node serves them (or has no set to say: an older
# version); with none, it starts here, and the worker's own check fails it. A worker whose own set is
# missing (it announces it before its first take, so Redis lost it, or it lapsed, until its next beat
# writes it again) passes over only what another live worker's set names, and takes the rest.
_START = """
local function serves_pair(prefix, instance, pair)
  local set = prefix .. instance
  return redis.call('SISMEMBER', set, pair) == 1 or redis.call('EXISTS', set) == 0
end
local function passes(serves, provider, model)
  if not serves or not provider or not model then return false end
  local pair = provider .. '\\t' .. model
  local own = serves[1] .. serves[2]
  if redis.call('SISMEMBER', own, pair) == 1 then return false end
  local said = redis.call('EXISTS', own) == 1
  for _, other in ipairs(redis.call('ZRANGEBYSCORE', serves[3], '(' .. now, '+inf')) do
    if other ~= serves[2] then
      if said then
        if serves_pair(serves[1], other, pair) then return true end
      elseif redis.call('SISMEMBER', serves[1] .. other, pair) == 1 then
        return true
      end
    end
  end
  return false
end
-- A run's record as HGETALL gives it; one of another type (written by hand) holds nothing of iop's:
-- read as missing (that run alone is dropped, not the take of every job of the node failed, the
-- worker exited, and each worker of the node after it, its poll meeting the job again)
local function record_fields(record)
  local flat = redis.pcall('HGETALL', record)
  if wrongtype(flat) then return {} end
  return flat
end
local function start_run(record, events, run_id, lease_ttl_ms, ttl, worker, cancelled, signals, lease_prefix, serves)
  local flat = record_fields(record)
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  local state = r['state']
  if state ~= 'dispatched' then return {state or 'missing'} end
  local lease = lease_prefix .. r['provider']
  local score = redis.call('ZSCORE', lease, run_id)
  if not score or tonumber(score) <= now then return {'lease_lost'} end
  if passes(serves, r['provider'], r['model']) then return {'passed', r['provider'], r['model']} end
  if r['cancel'] == '1' then
    -- it was cancelled between dispatch and start: end it here and give the slot back
    redis.call('ZREM', lease, run_id)
    end_cancelled(record, events, run_id, r['cancel_reason'], r['cancel_code'], cancelled, false, ttl,
                  r['watchers'] or false, r['key'] or false, r['model'] or false, r['limited'] or false)
    redis.call('EXPIRE', record, ttl)
    redis.call('PUBLISH', signals, r['model'] or '')
    return {'cancelled'}
  end
  -- (a lease the dispatch gave in this same millisecond ends when this one would: not written again)
  local until_ms = now + tonumber(lease_ttl_ms)
  if tonumber(score) ~= until_ms then redis.call('ZADD', lease, 'XX', until_ms, run_id) end
  redis.call('HSET', record, 'state', 'running', 'started_ms', now, 'worker', worker)
  -- no EXPIRE of the record or the events here, nor in EMIT: the queueing set the record's to ttl_s
  -- and DISPATCH the events', which outlast the attempt (config: run_ttl_s > queue_timeout_ms +
  -- execution_timeout_ms), and the script that ends the attempt sets them again
  local attempt = tonumber(r['attempts'] or '1')
  add_event(record, events, run_id, 'started', cmsgpack.pack({attempt = attempt}), r['watchers'] or false)
  -- the record as it was read, now running (`started_ms` and `worker` are not in it)
  for i = 1, #flat, 2 do
    if flat[i] == 'state' then flat[i + 1] = 'running' end
  end
  table.insert(flat, 1, 'ok')
  -- the last attempt has the body now: no other attempt will need it (`unable`: attempts that used up
  -- none, their provider unable to do what the request asks, FINISH)
  if attempt - (tonumber(r['unable'] or '0') or 0) >= tonumber(r['max_attempts'] or '1') then
    redis.call('HDEL', record, 'body')
  end
  return flat
end
"""

# Start one dispatched run (`_START`), for a caller that has its run id (tests, arq's fallback).
# KEYS: run record, events
# ARGV: run id, lease_ttl_ms, ttl_s, worker (host:pid), cancelled event data, signals channel,
#       lease key prefix (the lease key is that prefix + the run's provider)
START = _NOW + _WRONG + _ENDED + _EVENTS + _CANCEL_REASON + _START + """
return start_run(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], false)
"""

# A worker takes jobs off its node's queue and starts their runs, in one round trip: each job
# (job id = run id) that is due and not in progress gets its in-progress marker (the worker
# process's instance id, unique to this start of it) and its run is started (`_START`). A job whose
# run cannot start (it ended, its lease went, it was cancelled) leaves the queue at once. A job in
# progress for this same instance, which never asks for a job it runs, is one whose `take` answer
# it did not get (a dropped connection, the call made again): its run is handed over again, as
# started, while it is still that start (its lease lives, nothing was sent, its body is there), so
# it does not wait for its lease to expire. (A worker restarted in place, same host and pid, is
# another instance: its predecessor's runs go through their leases and count an attempt.)
# `take_jobs(...)` returns {{job id, status, field, value, ...}, ...}.
_TAKE = _ENDED + _EVENTS + _CANCEL_REASON + _START + """
local function started_again(record, run_id, worker, lease_prefix)
  local flat = record_fields(record)
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  if r['state'] ~= 'running' or r['worker'] ~= worker or r['output'] == '1' or not r['body'] then return nil end
  local score = redis.call('ZSCORE', lease_prefix .. r['provider'], run_id)
  if not score or tonumber(score) <= now then return nil end
  table.insert(flat, 1, 'ok')
  return flat
end
-- the `serves` of `start_run` from ARGV[11..13] (false if ARGV[12], the set key prefix, is '')
local serves = ARGV[12] ~= '' and {ARGV[12], ARGV[11], ARGV[13]}
local function take_jobs(queue, ids)
  local out = {}
  for _, id in ipairs(ids) do
    local score = redis.call('ZSCORE', queue, id)
    if score and tonumber(score) <= now then
      -- the marker, set here unless the job has one (then that one, unchanged)
      local marker = redis.pcall('SET', ARGV[1] .. id, ARGV[11], 'NX', 'GET', 'PX', ARGV[2])
      if wrongtype(marker) then
        -- (a marker of another type, written by hand: the take of the node's jobs failed, the worker
        -- exited, and so did each worker after it; it marks nothing: it goes)
        drop_wrong(ARGV[1] .. id)
        marker = redis.call('SET', ARGV[1] .. id, ARGV[11], 'NX', 'GET', 'PX', ARGV[2])
      end
      local started
      if not marker then
        started = start_run(ARGV[3] .. id, ARGV[4] .. id, id, ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[5],
                            serves)
        if started[1] ~= 'ok' then
          redis.call('DEL', ARGV[1] .. id)
          -- (one passed over stays in the queue, for a worker that serves it)
          if started[1] ~= 'passed' then redis.call('ZREM', queue, id) end
        end
      elseif marker == ARGV[11] then
        started = started_again(ARGV[3] .. id, id, ARGV[8], ARGV[5])
      end
      if started then
        table.insert(started, 1, id)
        out[#out + 1] = started
      end
    end
  end
  return out
end
"""

# `take_jobs` for the job ids given (arq's poll lists them).
# KEYS: node queue
# ARGV: in-progress key prefix, in-progress ttl (ms), run record prefix, events prefix, lease
#       prefix, lease_ttl_ms, ttl_s, worker, cancelled event data, signals channel, instance id,
#       serves-set key prefix ('': no check), the node's live workers key, job ids...
TAKE = _NOW + _WRONG + _TAKE + """
local ids = {}
for i = 14, #ARGV do ids[#ids + 1] = ARGV[i] end
return take_jobs(KEYS[1], ids)
"""

# `take_jobs` for the jobs of the node's wake list, sent in the same write as the worker's blocking
# `BLMOVE` of one id from the wake list to the worker's own list (`keys.worker_woken`): Redis runs it
# as soon as the id is moved, with no round trip between the wake-up and the start. It takes the ids
# of its own list and as many more from the wake list as make `free` (oldest first: `dispatch`
# LPUSHes). The runs its answer started are kept (`keys.worker_answered`, `id:attempt`) until the
# worker's next call names them as received (`acked`): one that was not (the answer was lost with a
# dropped connection) goes through `take_jobs` again, which hands its run over again as started
# (not on the run's last attempt: its start took the body). A job id is its run's id, the same for
# every attempt: hence the attempt, and a new attempt comes through the own list, never acked away.
# Runs `take_jobs` passed over (their provider or model is not in this worker's config) go to the
# node's passed list (`keys.node_passed`, at most 1,024), from which a worker that serves them (any
# worker, once no other live worker of the node does: it starts such a run and fails it) takes them
# first (they are the oldest), before its wake list; they stay in the node's queue meanwhile (arq's poll
# of an idle worker that serves them takes them too). A run new to the passed list also goes back
# on the wake list, once: a worker that serves it, blocked there, wakes now, not when its wait ends
# (poll_delay, a second: most such runs waited that long). One already listed is not pushed again, so
# workers that lack it do not hand it round.
# KEYS: node queue, the worker's own list, its last answer's ids, the node's wake list, its passed list
# ARGV: as TAKE's first 13, then the most jobs to take (`free`), then `id:attempt` of each run the
#       worker's last answer started (acked)...
TAKE_WOKEN = _NOW + _WRONG + _TAKE + """
-- (`have`: the ids taken already, from the worker's own list: one is not taken twice)
local function passed_here(list, room, have)
  local out = {}
  if room <= 0 then return out end
  local listed = redis.call('LRANGE', list, -100, -1)
  for i = #listed, 1, -1 do
    local id = listed[i]
    -- (a record of another type, written by hand, holds no run: it leaves the list, not failed every
    -- take of the node's workers, each exiting on it)
    local r = redis.pcall('HMGET', ARGV[3] .. id, 'provider', 'model')
    if wrongtype(r) then r = {} end
    if not r[1] or not r[2] or not passes(serves, r[1], r[2]) then
      redis.call('LREM', list, -1, id)
      if r[1] and r[2] and not have[id] then
        out[#out + 1] = id
        have[id] = true
      end
      if #out >= room then break end
    end
  end
  return out
end
local free = tonumber(ARGV[14])
local acked = {}
for i = 15, #ARGV do acked[ARGV[i]] = true end
local ids = {}
local answered = redis.call('GET', KEYS[3])
if answered then
  for started in string.gmatch(answered, '[^,]+') do
    if not acked[started] then ids[#ids + 1] = string.match(started, '^(.*):[^:]*$') end
  end
end
for _, id in ipairs(redis.call('LPOP', KEYS[2], 1000000) or {}) do ids[#ids + 1] = id end
local have = {}
for _, id in ipairs(ids) do have[id] = true end
for _, id in ipairs(passed_here(KEYS[5], free - #ids, have)) do ids[#ids + 1] = id end
if #ids < free then
  for _, id in ipairs(redis.call('RPOP', KEYS[4], free - #ids) or {}) do ids[#ids + 1] = id end
end
local out = take_jobs(KEYS[1], ids)
local started = {}
local passed = {}
for _, entry in ipairs(out) do
  if entry[2] == 'passed' and not redis.call('LPOS', KEYS[5], entry[1], 'MAXLEN', 1024) then
    passed[#passed + 1] = entry[1]
    redis.call('LPUSH', KEYS[5], entry[1])
  end
  if entry[2] == 'ok' then
    local attempt = ''
    for i = 3, #entry - 1, 2 do
      if entry[i] == 'attempts' then attempt = entry[i + 1] break end
    end
    started[#started + 1] = entry[1] .. ':' .. attempt
  end
end
if #passed > 0 then
  redis.call('LTRIM', KEYS[5], 0, 1023)
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
  if redis.call('LPUSH', KEYS[4], unpack(passed)) > 1024 then redis.call('LTRIM', KEYS[4], 0, 1023) end
  redis.call('PEXPIRE', KEYS[4], ARGV[6])  -- (a lease after its last id, as `dispatch` gives it)
end
if #started > 0 then
  -- (kept as long as their leases live unrenewed: a run handed over later would be reaped anyway)
  redis.call('SET', KEYS[3], table.concat(started, ','), 'PX', ARGV[6])
elseif answered then
  redis.call('DEL', KEYS[3])
end
return out
"""

# Renew the lease of one attempt while it still owns the run. Returns 1, 0 if lost, or 2 if
# its caller asked for it to be cancelled (a backstop for a lost cancel message). The attempt's
# count of output chunks its caller got so far (ARGV[4], when it has output) goes in the record
# (`out_chunks`) when it is more than the record has: a run whose worker is lost counts them
# (`REAP`). (Each emit records them too, `EMIT`: a count made as an emit went out, older, is not
# taken; a worker of an earlier version records them only here.)
# KEYS: lease, run record   ARGV: run id, lease_ttl_ms, attempt, output chunks ('' or none: none yet)
RENEW = FREES + _NOW + _WRONG + """
-- (a record of another type, written by hand, holds no run: the attempt owns none, and stops, not
-- left generating at its provider past its lease, its slot given back to another run meanwhile)
local attempts = redis.pcall('HGET', KEYS[2], 'attempts')
if wrongtype(attempts) or attempts ~= ARGV[3] then return 0 end
if redis.call('HGET', KEYS[2], 'cancel') == '1' then return 2 end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
local chunks = tonumber(ARGV[4] or '')
if chunks and chunks > (tonumber(redis.call('HGET', KEYS[2], 'out_chunks') or '') or 0) then
  redis.call('HSET', KEYS[2], 'out_chunks', ARGV[4])
end
return 1
"""

# The end of an attempt: release the slot, then either record a terminal state or put the
# run back at the tail of its model's queue. Does nothing if the attempt no longer owns the
# run (its lease was reaped and the run went on without it). A run whose cancel was recorded
# before its worker heard of it ends cancelled instead (returns 'cancel_asked'), however the attempt
# ended, but for a completed one whose answer had begun to go out.
# Also adds what the attempt showed about the provider's health to its heartbeat (`_EVIDENCE`).
# The attempt's job leaves its node's queue (with its in-progress marker), before any requeue:
# the next dispatch queues a job of the same id. The freed slot may serve any model of the
# provider: the replica holding the oldest waiting run of each is woken (`_WAKE`).
# KEYS: run record, lease, events, runs stream, heartbeat, node queue, the job's in-progress
#       marker, runs streams of the provider's models...
# ARGV: run id, state (completed|failed|cancelled|requeue|requeue_elsewhere|requeue_busy: elsewhere,
#       the provider too busy|requeue_unable: elsewhere, the provider could not do what the request asks:
#       the attempt uses up none of max_attempts, counted in the record's `unable`, and the provider
#       joins its `unable_by`, never asked again|requeue_unable_back: as requeue_unable, but the retry
#       only avoids the other providers tried, as `requeue` does; requeue_elsewhere and requeue_busy
#       add the provider to the record's `elsewhere`: a provider that answered a 5xx, a 429 or a
#       redirect is tried at most once, however later attempts end), event type, event
#       data, ttl_s, replica channel prefix, model, error code, error message, attempt,
#       evidence ('ok'|'fail'|''), strikes, failure reason, prompt tokens, completion tokens
#       (the usage the caller got, added to its key's by `_ENDED` when the run ends here), how
#       fresh an 'ok' must be to be written again (ms, `_EVIDENCE`), a completed stream's last
#       output ('' none: a `delta` event's data, added before the end; refused with 'too_many', and
#       nothing done, when the events hold `max_events_per_run`), max_events_per_run, whether the
#       provider is a suspect of a requeued run's failure ('1': it joins the record's `suspects`,
#       which `BLAME` reads once another provider served the run), the served name of the attempt (a
#       completed run starts its count of `blame` there over), how long (ms; '' or 0: not) the
#       provider asked to be left alone for that served name (it answered 429 or 503: too busy; its
#       `Retry-After`): it is benched for it that long (`bench:{{served}}`, never shortened), so no run
#       of it goes there meanwhile, where every new run went first (its in-flight count the lowest),
#       keeping a hosted API's key at its rate limit; the run's body ('' none) for `requeue_unable` to
#       put back in the record, whose attempt's start deleted it (the last attempt, as it was); the
#       event data of a run that ends failed or cancelled as it reads once output went out ('' none:
#       the same), written instead when the record says output went out where the attempt did not
#       know it (a cancel or a timeout interrupted an `emit` Redis ran, its reply not read); a requeue
#       then ends the run failed with it instead (returns 'failed_after_output'), and its key counts
#       the chunks of output the record says (`out_chunks`, as EMIT wrote them) if they are more (as
#       does any run ending failed or cancelled after output: a later emit's reply may be the one lost)
FINISH = FREES + _NOW + _WRONG + _REQUEUE + _EVIDENCE + _ENDED + _EVENTS + _WAKE + _CANCEL_REASON + f"""
-- (a record of another type, written by hand, holds no run: as a record gone, the attempt owns none;
-- its lease goes to the reaper)
local rec = redis.pcall('HMGET', KEYS[1], 'state', 'attempts', 'watchers', 'key', 'model', 'limited', 'cancel',
  'output', 'cancel_reason', 'cancel_code')
if wrongtype(rec) then rec = {{}} end
local state = rec[1]
if rec[2] ~= ARGV[10] then return 'stale' end
if state ~= 'dispatched' and state ~= 'running' then return state or 'missing' end
local last = ARGV[17] or ''
if last ~= '' and redis.call('XLEN', KEYS[3]) >= tonumber(ARGV[18]) then return 'too_many' end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('DEL', KEYS[7])
-- (a completed run's served name's blame count, read with the evidence: one that is not there is
-- not deleted below)
local served = ARGV[20] or ''
local blame = served ~= '' and ARGV[2] == 'completed' and '{keys.BLAME_FIELD}' .. served or nil
local blame_read, blamed = evidence(KEYS[5], ARGV[11], ARGV[12], ARGV[13], 'unavailable', ARGV[16], blame)
local cool = tonumber(ARGV[21] or '') or 0
if cool > 0 and (ARGV[20] or '') ~= '' and redis.call('EXISTS', KEYS[5]) == 1 then
  local bench = '{keys.BENCH_FIELD}' .. ARGV[20]
  if (tonumber(redis.call('HGET', KEYS[5], bench) or '') or 0) < now + cool then
    redis.call('HSET', KEYS[5], bench, now + cool, '{keys.BUSY_FIELD}' .. ARGV[20], now + cool)
  end
end
local ttl = tonumber(ARGV[5])
-- The completion tokens the caller of a run whose output went out got: the attempt's count, or the
-- chunks its emits recorded when more: output went out that the attempt did not know of (an emit Redis
-- ran whose reply was not read, a cancel or a timeout having interrupted it: the first, ARGV[23], or a
-- later one).
local function chunks_got()
  return math.max(tonumber(ARGV[15]) or 0, tonumber(redis.call('HGET', KEYS[1], 'out_chunks') or '') or 0)
end
if rec[7] == '1' and ARGV[2] ~= 'cancelled' and not (ARGV[2] == 'completed' and rec[8] == '1') then
  -- its cancel was asked (a DELETE, its caller leaving) before its worker heard of it: it ends
  -- cancelled, as asked, however the attempt ended (a requeue would put a cancelled run back in its
  -- queue), but for a completed one whose answer had begun to go out (its caller has the rest)
  end_cancelled(KEYS[1], KEYS[3], ARGV[1], rec[9], rec[10],
    cancel_data('cancelled', 'cancelled by the caller', rec[8] == '1'),
    rec[8] == '1', ttl, rec[3], rec[4], rec[5], rec[6],
    -- (the usage the caller got: the attempt's partial count when output went out, else none, not
    -- the provider's whole answer the caller never got; the chunks its emits recorded when more,
    -- EMIT)
    rec[8] == '1' and ARGV[14] or 0, rec[8] == '1' and chunks_got() or 0)
  redis.call('EXPIRE', KEYS[1], ttl)
  for i = 8, #KEYS do wake_head(KEYS[i], ARGV[6]) end
  return 'cancel_asked'
end
if last ~= '' then add_event(KEYS[1], KEYS[3], ARGV[1], 'delta', last, rec[3]) end
-- (the record says output went out where the attempt did not know it: before_output false, and a run
-- with output is never put back in its queue, as REAP has it: it ends failed)
local ending, etype, data, completion = ARGV[2], ARGV[3], ARGV[4], ARGV[15]
if rec[8] == '1' and (ARGV[23] or '') ~= '' then
  data = ARGV[23]
  if string.sub(ending, 1, 7) == 'requeue' then ending, etype = 'failed', 'failed' end
end
if rec[8] == '1' and ending ~= 'completed' then completion = chunks_got() end
add_event(KEYS[1], KEYS[3], ARGV[1], etype, data, rec[3])
redis.call('EXPIRE', KEYS[3], ttl)
local unable = ending == 'requeue_unable' or ending == 'requeue_unable_back'
if ending == 'requeue' or ending == 'requeue_elsewhere' or ending == 'requeue_busy' or unable then
  if ARGV[19] == '1' then
    local s = redis.call('HMGET', KEYS[1], 'provider', 'suspects')
    if s[1] then redis.call('HSET', KEYS[1], 'suspects', s[2] and (s[2] .. ',' .. s[1]) or s[1]) end
  end
  -- (never asked again: the entry and the record's `unable_by`, or `elsewhere`, name it)
  local never = unable and 'unable_by' or (ending == 'requeue_elsewhere' or ending == 'requeue_busy') and 'elsewhere'
  if never then
    local u = redis.call('HMGET', KEYS[1], 'provider', never)
    if u[1] and not (u[2] and string.find(',' .. u[2] .. ',', ',' .. u[1] .. ',', 1, true)) then
      redis.call('HSET', KEYS[1], never, u[2] and (u[2] .. ',' .. u[1]) or u[1])
    end
  end
  requeue(KEYS[1], KEYS[4], ARGV[1], ending ~= 'requeue' and ending ~= 'requeue_unable_back',
    ending == 'requeue_busy')
  if unable then  -- (the provider could not do what was asked: no attempt used up)
    redis.call('HINCRBY', KEYS[1], 'unable', 1)
    if (ARGV[22] or '') ~= '' then redis.call('HSET', KEYS[1], 'body', ARGV[22]) end
  end
else
  if ending == 'completed' then  -- its answer went to the caller (a non-stream run's is this event)
    redis.call('HSET', KEYS[1], 'state', ending, 'finished_ms', now, 'output', '1')
    if blame and (blamed or not blame_read) then redis.call('HDEL', KEYS[5], blame) end
  else
    redis.call('HSET', KEYS[1], 'state', ending, 'finished_ms', now)
  end
  if ARGV[8] ~= '' then
    redis.call('HSET', KEYS[1], 'error_code', ARGV[8], 'error_message', ARGV[9])
  end
  ended(KEYS[1], ARGV[1], ending, ARGV[14], completion, rec[4], rec[5], rec[6])
end
redis.call('EXPIRE', KEYS[1], ttl)
for i = 8, #KEYS do wake_head(KEYS[i], ARGV[6]) end
return ending ~= ARGV[2] and 'failed_after_output' or 'ok'
"""

# A run another provider served after it failed on its `suspects` (the record's: providers whose
# failure said something of them, a 5xx, a timeout, a broken answer; not a busy one, nor one the
# caller's request would get anywhere): each suspect's heartbeat counts one more `blame:{served}`,
# runs of that served name in a row that failed there and were then served elsewhere (a run it
# completes there starts the count over: `FINISH`). At `runs` it is benched for that served name:
# `bench:{served}` holds until when, and no run of it goes there meanwhile (`dispatch`, and
# `common.policy` through `ProviderSnapshot.benched`); once back, it is one blame short of benched
# again. Its health and its other models are not touched. A request that fails everywhere blames
# nobody.
# KEYS: run record, the heartbeat of each other provider the run was tried on...
# ARGV: runs, bench_ms, then for each heartbeat: its provider, the run's served name there
# Returns the providers benched.
BLAME = _NOW + _WRONG + f"""
local suspects = redis.pcall('HGET', KEYS[1], 'suspects')
local benched = {{}}
if wrongtype(suspects) or not suspects then return benched end  -- (a record of another type names none)
local listed = {{}}
for p in string.gmatch(suspects, '[^,]+') do listed[p] = true end
local runs = tonumber(ARGV[1])
for i = 2, #KEYS do
  local provider, blame = ARGV[2 * i - 1], '{keys.BLAME_FIELD}' .. ARGV[2 * i]
  if listed[provider] and redis.call('EXISTS', KEYS[i]) == 1 and redis.call('HINCRBY', KEYS[i], blame, 1) >= runs then
    local bench = '{keys.BENCH_FIELD}' .. ARGV[2 * i]
    -- (never shortened: a busy bench of its Retry-After may last longer)
    local was = tonumber(redis.call('HGET', KEYS[i], bench) or '') or 0
    redis.call('HSET', KEYS[i], blame, runs - 1, bench, math.max(was, now + tonumber(ARGV[2])))
    benched[#benched + 1] = provider
  end
end
return benched
"""

# Take a run out of its queue (timeout or cancel) if it is still waiting there; if it is
# already dispatched and `cancel_prefix` is set, tell its node to cancel it. A run not there yet
# (`missing`) whose queueing may still be on its way (its gateway's call timed out: a paused Redis
# runs what it had received when it resumes, and not always in the order it was sent over two
# connections) is recorded ended when the model id is given: the queueing then finds it there and
# queues nothing (`enqueue`'s answer to the same call made again).
# KEYS: runs stream, run record, events
# ARGV: run id, group, new state, event data, ttl_s, error code, error message, cancel channel prefix,
#       replica channel prefix (the replica holding the next waiting run is woken; '' = none), the
#       run's model id if a missing run is to be recorded ended ('' or none: it is left missing), the
#       run's entry in its queue as the caller holds it ('' or none: not known; a run queued at another
#       entry since is left queued: 'moved')
DROP_QUEUED = FREES + _NOW + _WRONG + _ENDED + _EVENTS + _WAKE + """
-- (a record of another type, written by hand, holds no run: read as missing, and nothing written to it)
local state = redis.pcall('HGET', KEYS[2], 'state')
local wrong = wrongtype(state)
if wrong then state = false end
if state == 'dispatched' or state == 'running' then
  if ARGV[8] ~= '' then
    -- the flag makes it durable: START ends a dispatched run, RENEW reports it to a running one;
    -- the reason and code are what the run ends with on its worker (the first one's: a DELETE, then
    -- its caller leaving, stays a DELETE)
    redis.call('HSET', KEYS[2], 'cancel', '1')
    if redis.call('HSETNX', KEYS[2], 'cancel_reason', ARGV[7]) == 1 and ARGV[6] ~= 'cancelled' then
      redis.call('HSET', KEYS[2], 'cancel_code', ARGV[6])
    end
    redis.call('PUBLISH', ARGV[8] .. redis.call('HGET', KEYS[2], 'node'), ARGV[1])
    return 'signalled'
  end
  return state
end
if state ~= 'queued' then
  if not state and (ARGV[11] or '') ~= '' then
    -- a run with no record (or one of another type) whose entry the caller holds (a scheduler's queue
    -- timeout): its entry leaves the queue, as `dispatch` takes out a run gone; left there, at the
    -- head, no dispatch of the model got past it, for good
    redis.call('XACK', KEYS[1], ARGV[2], ARGV[11])
    if redis.call('XDEL', KEYS[1], ARGV[11]) == 1 and ARGV[9] ~= '' then wake_head(KEYS[1], ARGV[9]) end
  end
  if not state and not wrong and ARGV[10] and ARGV[10] ~= '' then
    redis.call('HSET', KEYS[2], 'model', ARGV[10], 'state', ARGV[3], 'created_ms', now, 'finished_ms', now,
      'error_code', ARGV[6], 'error_message', ARGV[7])
    redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
    add_event(KEYS[2], KEYS[3], ARGV[1], 'failed', ARGV[4], false)  -- (as any run ended so: the runs API replays it)
    redis.call('EXPIRE', KEYS[3], tonumber(ARGV[5]))
  end
  return state or 'missing'
end
local entry = redis.call('HGET', KEYS[2], 'entry')
local held = ARGV[11] or ''
if entry and held ~= '' and entry ~= held then
  -- queued again since (its attempt failed or was lost: a new entry), while the caller still held
  -- its old entry (two replicas took it over at once, or one adopted it as its dispatch went out):
  -- that entry's timeout is not the run's, which stays queued; the old entry goes, if it is there
  redis.call('XACK', KEYS[1], ARGV[2], held)
  redis.call('XDEL', KEYS[1], held)
  return 'moved'
end
if entry then
  redis.call('XACK', KEYS[1], ARGV[2], entry)
  redis.call('XDEL', KEYS[1], entry)
  if ARGV[9] ~= '' then wake_head(KEYS[1], ARGV[9]) end  -- it may have been the oldest
end
local ttl = tonumber(ARGV[5])
redis.call('HSET', KEYS[2], 'state', ARGV[3], 'finished_ms', now, 'error_code', ARGV[6],
  'error_message', ARGV[7])
redis.call('HDEL', KEYS[2], 'entry')
ended(KEYS[2], ARGV[1], ARGV[3], 0, 0)
redis.call('EXPIRE', KEYS[2], ttl)
add_event(KEYS[2], KEYS[3], ARGV[1], 'failed', ARGV[4])
redis.call('EXPIRE', KEYS[3], ttl)
return 'ok'
"""

# Publish output of one attempt, only while that attempt still owns the run, and while the run's
# event stream holds fewer than its limit. Returns 1, 0 if the attempt lost the run, 2 if full, or
# {3, reason, code} when the run's first output comes after its cancel was recorded (a worker that
# did not hear of it: the run ends cancelled, with the reason and code it was cancelled for).
# The events' TTL stays as DISPATCH set it (see `_START`).
# Each emit of an attempt carries its number (1, 2, ...), kept in the record as `emitted`
# ("attempt:n"): the same emit made again (a dropped connection lost the reply, and the client
# sent it again) adds nothing, so the caller never gets the same output twice.
# A delta's emit also records the attempt's chunks of output with it (`out_chunks`): a run whose
# worker is lost counts them (`REAP`), each chunk its caller got (a lease renewal's count was up to
# a third of the lease old: a worker killed a moment after its first output counted none).
# KEYS: run record, events   ARGV: attempt, event type, event data, max events, run id, emit number,
#       [the attempt's chunks of output once this emit is in ('' or none: not said)]
EMIT = _WRONG + _EVENTS + """
-- (a record of another type, written by hand, holds no run: the attempt owns none)
local rec = redis.pcall('HMGET', KEYS[1], 'state', 'attempts', 'watchers', 'output', 'emitted', 'cancel')
if wrongtype(rec) then rec = {} end
if rec[1] ~= 'running' or rec[2] ~= ARGV[1] then return 0 end
local emitted = ARGV[1] .. ':' .. ARGV[6]
if rec[5] == emitted then return 1 end
if rec[6] == '1' and rec[4] ~= '1' then
  local why = redis.call('HMGET', KEYS[1], 'cancel_reason', 'cancel_code')
  return {3, why[1] or 'cancelled by the caller', why[2] or 'cancelled'}
end
if redis.call('XLEN', KEYS[2]) >= tonumber(ARGV[4]) then return 2 end
add_event(KEYS[1], KEYS[2], ARGV[5], ARGV[2], ARGV[3], rec[3])
local fields = {'emitted', emitted}
if ARGV[2] == 'delta' and rec[4] ~= '1' then table.insert(fields, 'output') table.insert(fields, '1') end
if ARGV[2] == 'delta' and (ARGV[7] or '') ~= '' then
  table.insert(fields, 'out_chunks')
  table.insert(fields, ARGV[7])
end
redis.call('HSET', KEYS[1], unpack(fields))
return 1
"""

# A lease that expired: its worker is gone. Put the run back in its queue if it may be tried
# again and sent nothing yet; else fail it with worker_lost. Also drops the job's in-progress marker.
# The freed slot may serve any model of the provider: their head runs' replicas are woken.
# KEYS: lease, run record, events, runs stream, node queue, arq in-progress marker, runs streams of
#       the provider's models...
# ARGV: run id, max_attempts, ttl_s, replica channel prefix, model, requeued data (also the failed
#       data of a run that sent no output), failed data of a run that had output (before_output
#       false), cancelled data, [failed data and message for a run no worker started: still `dispatched`]
REAP = FREES + _NOW + _WRONG + _REQUEUE + _ENDED + _EVENTS + _WAKE + _CANCEL_REASON + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > now then return 'alive' end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[6])
-- (a record of another type, written by hand, holds no run: missing, its slot given back all the same)
local state = redis.pcall('HGET', KEYS[2], 'state')
if wrongtype(state) then state = false end
for i = 7, #KEYS do wake_head(KEYS[i], ARGV[4]) end
if state ~= 'dispatched' and state ~= 'running' then return state or 'missing' end
local ttl = tonumber(ARGV[3])
local counts = redis.call('HMGET', KEYS[2], 'attempts', 'unable')
local attempts = (tonumber(counts[1] or '0') or 0) - (tonumber(counts[2] or '0') or 0)  -- (those used up: FINISH)
local output = redis.call('HGET', KEYS[2], 'output') == '1'
-- (a stream that had output counts its chunks as its worker last recorded them: RENEW)
local counted = output and tonumber(redis.call('HGET', KEYS[2], 'out_chunks') or '') or 0
if redis.call('HGET', KEYS[2], 'cancel') == '1' then
  local why = redis.call('HMGET', KEYS[2], 'cancel_reason', 'cancel_code')
  end_cancelled(KEYS[2], KEYS[3], ARGV[1], why[1], why[2], ARGV[8], output, ttl, nil, nil, nil, nil, 0, counted)
  redis.call('EXPIRE', KEYS[2], ttl)
  return 'cancelled'
end
if not output and attempts < tonumber(ARGV[2]) then
  add_event(KEYS[2], KEYS[3], ARGV[1], 'requeued', ARGV[6])
  requeue(KEYS[2], KEYS[4], ARGV[1], false, false, ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
  return 'requeued'
end
-- (a run no worker started: an older replica's call has no words for it; one that sent no output
-- fails before output, its last attempt used up: the requeued data is that, before_output true)
local unstarted = state == 'dispatched' and ARGV[10] ~= nil
add_event(KEYS[2], KEYS[3], ARGV[1], 'failed', unstarted and ARGV[9] or output and ARGV[7] or ARGV[6])
redis.call('HSET', KEYS[2], 'state', 'failed', 'finished_ms', now, 'error_code', 'worker_lost',
  'error_message', unstarted and ARGV[10] or 'the worker running this run was lost')
ended(KEYS[2], ARGV[1], 'failed', 0, counted)
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return 'failed'
"""

# A worker process stops (its heartbeats stopped first). If it was the node's last live worker, the
# node's work goes back at once instead of waiting out heartbeat_ttl_ms and the leases: each
# provider's heartbeat goes, as if it had lapsed (a new run is refused or goes elsewhere now; runs
# that wait keep waiting, for a worker that comes back or another provider, as for a lapsed
# heartbeat: a provider with no heartbeat is not known to be down), and each run dispatched to the
# node that no worker took yet is queued again, without counting the attempt it never had (its
# provider stays in `tried`, so it goes elsewhere first). A run its caller cancelled meanwhile is
# left to its lease, as before. (A worker that does not keep itself in the set, an older version,
# or one whose heartbeats lag past heartbeat_ttl_ms, is not counted: its next heartbeat puts the
# hashes back.)
# KEYS: the node's workers set, the node's queue, the node's wake list, its providers' heartbeats...
# ARGV: instance id, in-progress key prefix, requeued event data, signals channel, ttl_s (each run
#       queued again lives that long from then; none: as it was)
# Returns {1 if it was the last, runs queued again}.
WORKER_LEFT = _NOW + _WRONG + _REQUEUE + _EVENTS + f"""
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) > 0 then return {{0, 0}} end
if #KEYS >= 4 then redis.call('DEL', unpack(KEYS, 4)) end
for i = 4, #KEYS do  -- (nor is the provider among those beating)
  redis.call('ZREM', '{keys.BEATING}', string.sub(KEYS[i], {len(keys.heartbeat(""))} + 1))
end
local requeued = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local record = '{keys.run_record("")}' .. id
  -- (a record of another type, written by hand, holds no run: passed over, not the runs after it left
  -- to their leases, the schedulers not woken)
  local r = redis.pcall('HMGET', record, 'state', 'provider', 'model', 'cancel', 'attempts')
  if wrongtype(r) then r = {{}} end
  if r[1] == 'dispatched' and r[4] ~= '1' and redis.call('EXISTS', ARGV[2] .. id) == 0 then
    redis.call('ZREM', '{keys.leases("")}' .. r[2], id)
    redis.call('ZREM', KEYS[2], id)
    redis.call('HSET', record, 'attempts', math.max(0, (tonumber(r[5]) or 1) - 1))
    add_event(record, '{keys.run_events("")}' .. id, id, 'requeued', ARGV[3])
    requeue(record, '{keys.runs_stream("")}' .. r[3], id, false, false, tonumber(ARGV[5] or ''))
    requeued = requeued + 1
  end
end
redis.call('DEL', KEYS[3])
redis.call('PUBLISH', ARGV[4], '*')
return {{1, requeued}}
"""

# A worker claims the next health probe of a provider: nothing showed it alive for an interval
# and no other worker probed it since. A provider that runs' failures took down (`down` strikes
# since its last sign of life) is probed again after `down_interval_ms` since the last probe,
# however recent that sign of life: the probe says whether it is down or whether the failures
# were the requests' own (one caller's request that breaks the server's answer, sent again by
# its client, took a model's providers down for a probe interval). An `exclusive` probe (one that
# would disturb a run) is only claimed while the provider runs nothing, and takes the probing
# lock that DISPATCH honours. Nor while the server may still generate a run iop gave up
# (`busy_until_ms`: a non-stream llama-cpp-python answer goes on for nobody, and the probe would wait
# for it, time out, and strike a busy server down).
# KEYS: heartbeat, lease, probing lock
# ARGV: interval_ms, exclusive (1|0), lock ttl_ms, heartbeat ttl_ms, down strikes, down_interval_ms
PROBE = _NOW + """
local h = redis.call('HMGET', KEYS[1], 'ok_ms', 'probe_ms', 'fails', 'fail_ms', 'busy_until_ms')
local ok_ms, probe_ms = tonumber(h[1] or '0'), tonumber(h[2] or '0')
if tonumber(h[3] or '0') >= tonumber(ARGV[5]) and tonumber(h[4] or '0') >= ok_ms then
  if now - probe_ms < tonumber(ARGV[6]) then return 0 end
elseif now - math.max(ok_ms, probe_ms) < tonumber(ARGV[1]) then
  return 0
end
if ARGV[2] == '1' then
  if redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') > 0 then return 0 end
  if (tonumber(h[5] or '') or 0) > now then return 0 end
  if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], 'probe_ms', now)
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
return 1
"""

# What a probe found (`_EVIDENCE`), and the end of an exclusive probe: its lock goes and the
# schedulers are woken, since runs may wait for it.
# KEYS: heartbeat, probing lock
# ARGV: evidence ('ok'|'fail'|''), strikes, reason, failure health, observed models ('-' = keep),
#       signals channel
PROBED = _NOW + _EVIDENCE + """
evidence(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
if ARGV[5] ~= '-' and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'observed_models', ARGV[5])
end
if redis.call('DEL', KEYS[2]) == 1 then redis.call('PUBLISH', ARGV[6], '*') end
return 1
"""

# A run given up while its server goes on generating it (`workers.runner.Runner._gave_up`): the
# provider's heartbeat says until when it may be busy, if it has one. (An `EXISTS` and then an `HSET`
# made a hash of that field alone, with no TTL, for good, when the node's last worker deleted its
# heartbeats between them, `WORKER_LEFT`.)
# KEYS: heartbeat   ARGV: field, until (ms)
# Returns 1 if written, 0 if the provider has no heartbeat.
MARK_BUSY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# A replica takes over the waiting runs of one taken for dead (its liveness key lapsed): it claims
# up to `count` of the runs pending for it, and when those were all it had, deletes it from the group,
# in one step. (Claimed, then deleted in a command of its own, a stalled replica that was still alive
# read new runs in between, and the delete left them pending for nobody: at the head of their stream,
# no replica could take them over, and no later run of the model could go.)
# KEYS: runs stream   ARGV: group, the dead consumer, this replica, count (at most 4,096: `unpack`)
# Returns the entries claimed, as XCLAIM gives them (one deleted while pending has no fields).
TAKE_OVER = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[2])
local claimed = {}
if #pending > 0 then
  local ids = {}
  for i, p in ipairs(pending) do ids[i] = p[1] end
  claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids))
end
if #pending < tonumber(ARGV[4]) then redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) end
return claimed
"""

# /readyz: whether iop's Redis user may run a script and read iop's keys (its answer does not matter).
# KEYS: READY_PROBE
READY = """#!lua flags=no-writes
return redis.call('EXISTS', KEYS[1])
"""

# A gateway follows a run's every event (the runs API, maybe for a run another gateway started): it
# joins the run's watchers, or stops being an output-only one, in its place (the first watcher is
# the gateway of the run's caller: `orphans` reads it).
# KEYS: run record   ARGV: gateway id
# Returns 0 if the run is gone, else 1.
WATCH = _WRONG + f"""
local watchers = redis.pcall('HGET', KEYS[1], 'watchers')
if wrongtype(watchers) then return 0 end  -- (a record of another type, written by hand, holds no run)
if not watchers then
  if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
  redis.call('HSET', KEYS[1], 'watchers', ARGV[1])
  return 1
end
local kept, placed = {{}}, false
for watcher in string.gmatch(watchers, '[^,]+') do
  if watcher == ARGV[1] then return 1 end
  if watcher == ARGV[1] .. '{keys.OUTPUT_ONLY}' then watcher, placed = ARGV[1], true end
  kept[#kept + 1] = watcher
end
if not placed then kept[#kept + 1] = ARGV[1] end
redis.call('HSET', KEYS[1], 'watchers', table.concat(kept, ','))
return 1
"""

# An operator's change of a provider or a node, and its audit entry, in one step: a drain or a cordon
# flag (its value is the time it began, kept when it is set again), or a capacity override (with a
# TTL when it is given one). Every change wakes the schedulers: runs may wait for what it frees.
# KEYS: the control key (drain flag, cordon flag or capacity override), audit stream
# ARGV: action (drain|undrain|cordon|uncordon|capacity|capacity_clear), target kind (provider|node),
#       target id, who, capacity (for `capacity`), ttl_ms (0 = none), audit max entries, signals channel
# Returns {audit entry id, previous value, previous until (ms; '' = none)}.
CONTROL = _NOW + """
local flags = {drain = {'drained', true}, undrain = {'drained', false},
               cordon = {'cordoned', true}, uncordon = {'cordoned', false}}
-- (an audit stream of another type, written by hand, refuses the entry: nothing is changed then, where
-- the change was made before the refused entry, a script's writes before an error staying, and its
-- caller got an error for a change made unrecorded, no scheduler woken; the change still comes first,
-- so a full Redis takes one that frees: an undrain, its DEL, then its entry)
local audit = redis.call('TYPE', KEYS[2])['ok']
if audit ~= 'stream' and audit ~= 'none' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[2] .. ' is a ' .. audit ..
    ', not the stream of the audit: nothing changed')
end
local prev = redis.call('MGET', KEYS[1])[1]  -- (as the dispatch scripts read it: a key of another type is none,
if prev and string.sub(ARGV[1], 1, 8) == 'capacity' and not string.match(prev, '^%-?%d+$') then
  prev = false  -- and so is an override that is no integer in digits, '1.5' written by hand: `capped`)
end
local prev_until = ''
if prev then
  local at = redis.call('PEXPIRETIME', KEYS[1])  -- exactly the `until_ms` it was set with
  if at > 0 then prev_until = tostring(at) end
end
local value, previous, until_ms = '', '', ''
local flag = flags[ARGV[1]]
if flag then
  previous = prev and flag[1] or 'active'
  if flag[2] then
    value = flag[1]
    if not prev then redis.call('SET', KEYS[1], now) end
  else
    value = 'active'
    redis.call('DEL', KEYS[1])
  end
elseif ARGV[1] == 'capacity' then
  previous = prev or 'none'
  value = ARGV[5]
  local ttl = tonumber(ARGV[6])
  if ttl > 0 then
    -- an expiry at exactly `until_ms`, which a later change reads back as `previous_until_ms`
    redis.call('SET', KEYS[1], value)
    redis.call('PEXPIREAT', KEYS[1], now + ttl)
    until_ms = tostring(now + ttl)
  else
    redis.call('SET', KEYS[1], value)
  end
elseif ARGV[1] == 'capacity_clear' then
  previous = prev or 'none'
  value = 'none'
  redis.call('DEL', KEYS[1])
else
  return redis.error_reply('unknown control action ' .. ARGV[1])
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'at_ms', now, 'who', ARGV[4], 'action', ARGV[1],
  'target_kind', ARGV[2], 'target', ARGV[3], 'value', value, 'until_ms', until_ms,
  'previous', previous, 'previous_until_ms', prev_until)
redis.call('PUBLISH', ARGV[8], '*')
return {id, previous, prev_until}
"""

# Append a load sample to the history, unless another replica appended one less than `min_gap_ms`
# ago: every replica offers a sample every interval, one of them writes it. The stream keeps
# `retention_ms` of samples and at most `max_entries` (both trimmed with ~, in whole blocks).
# KEYS: history stream   ARGV: sample (JSON), min_gap_ms, retention_ms, max_entries
# Returns the new entry id, or '' when a recent sample made this one unneeded.
HISTORY = _NOW + """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 then
  local ms = tonumber(string.match(last[1][1], '^(%d+)'))
  if now - ms < tonumber(ARGV[2]) then return '' end
end
local id = redis.call('XADD', KEYS[1], 'MINID', '~', now - tonumber(ARGV[3]), '*', 'sample', ARGV[1])
redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[4])
return id
"""

# Of the given runs, those whose caller's gateway is gone: the run is queued or running, and the
# first of its record's watchers (the gateway its caller is connected to: `enqueue` writes it,
# `watch` keeps it first) is named in the gateways hash but its liveness key is gone. A gateway the
# hash does not name (an older version's, or one whose naming failed) counts as alive. A running
# run whose cancel is already recorded is not one again (its worker's renewal, or the reaper, ends
# it: a sweep every few seconds told its cancel again and again).
# Returns {run id, model, ...}.
# KEYS: gateways hash   ARGV: run record key prefix, gateway liveness key prefix, run ids...
ORPHANS = _WRONG + f"""
local out = {{}}
for i = 3, #ARGV do
  -- (a record of another type, written by hand, names no gateway: that run alone is passed over,
  -- not every sweep failed while it is listed, the runs of its batch with it)
  local rec = redis.pcall('HMGET', ARGV[1] .. ARGV[i], 'watchers', 'model', 'state', 'cancel')
  if wrongtype(rec) then rec = {{}} end
  if rec[1] and (rec[3] == 'queued' or ((rec[3] == 'dispatched' or rec[3] == 'running') and rec[4] ~= '1')) then
    local gateway = string.gsub(string.match(rec[1], '^[^,]*'), '{keys.OUTPUT_ONLY}$', '')
    if gateway ~= '' and redis.call('HEXISTS', KEYS[1], gateway) == 1
        and redis.call('EXISTS', ARGV[2] .. gateway) == 0 then
      out[#out + 1] = ARGV[i]
      out[#out + 1] = rec[2] or ''
    end
  end
end
return out
"""

# A worker's heartbeat of one provider: its fields, its worker among the node's live ones, the
# provider among those beating (`keys.BEATING`, whose life is the longest any beat gave it). The
# `health` and `reason` the worker judged from the evidence it read are written only if the
# evidence is still what it read: a `finish` or `probed` script that changed it meanwhile (a
# refused connection that took the provider down) is not undone by a verdict from before it
# (answer 0: the worker judges again). The schedulers are woken when the health changed.
# KEYS: heartbeat, node's workers, beating
# ARGV: ok_ms, fails, fail_ms as read ('' for none), heartbeat_ttl_ms, now (ms), provider id,
#       worker instance ('' = none), signals channel ('' = the health did not change), then the
#       fields and their values
BEAT = """
local seen = redis.call('HMGET', KEYS[1], 'ok_ms', 'fails', 'fail_ms')
local same = (seen[1] or '') == ARGV[1] and (seen[2] or '') == ARGV[2] and (seen[3] or '') == ARGV[3]
local fields = {}
for i = 9, #ARGV, 2 do
  if same or (ARGV[i] ~= 'health' and ARGV[i] ~= 'reason') then
    fields[#fields + 1] = ARGV[i]
    fields[#fields + 1] = ARGV[i + 1]
  end
end
local ttl, now = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ttl)
if ARGV[7] ~= '' then
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[7])
  -- (a worker killed without `worker_left` leaves its lapsed entry: gone here, a heartbeat's life
  -- after it lapsed, as of the providers beating below: a clock of another host a little ahead drops none live)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
if redis.call('PEXPIRE', KEYS[3], ttl, 'GT') == 0 then redis.call('PEXPIRE', KEYS[3], ttl, 'NX') end
if not same then return 0 end
if ARGV[8] ~= '' then redis.call('PUBLISH', ARGV[8], '*') end
return 1
"""

ALL: dict[str, str] = {
    "enqueue": ENQUEUE,
    "dispatch": DISPATCH,
    "dispatch_pending": DISPATCH_PENDING,
    "start": START,
    "take": TAKE,
    "take_woken": TAKE_WOKEN,
    "renew": RENEW,
    "finish": FINISH,
    "blame": BLAME,
    "drop_queued": DROP_QUEUED,
    "emit": EMIT,
    "reap": REAP,
    "worker_left": WORKER_LEFT,
    "probe": PROBE,
    "probed": PROBED,
    "mark_busy": MARK_BUSY,
    "take_over": TAKE_OVER,
    "beat": BEAT,
    "watch": WATCH,
    "control": CONTROL,
    "history": HISTORY,
    "orphans": ORPHANS,
    "ready": READY,
}

SHAS: dict[str, str] = {name: sha1(src.encode()).hexdigest() for name, src in ALL.items()}


class Scripts:
    """Runs the scripts by SHA, loading them again when Redis has forgotten them. A client made
    by `common.redisconn` sends them over its pool's `Line` (`common.redisline`): one shared
    connection, many calls in flight; any other client (fakeredis) over redis-py's own path."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.line = line_of(redis)

    async def load(self) -> None:
        """Load every script (Redis forgot them: a restart, a failover). Over the client's line when
        it has one, in one round trip: the calls that found their script missing load at once, and
        take no connection of the pool each (which the pool then kept, idle)."""
        if self.line is None:
            for src in ALL.values():
                await self.redis.script_load(src)
            return
        for answer in await self.line.execute_many([("SCRIPT", "LOAD", src) for src in ALL.values()]):
            if isinstance(answer, ResponseError):
                raise answer

    async def call_many(self, name: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Several calls of one script in one round trip (a pipeline), made in order: each one's
        answer, or the error it raised. The calls that found the script missing (Redis forgot it:
        a restart) did nothing: it is loaded and they are made again, in order."""
        answers = await self._send_many(name, calls)
        missing = [i for i, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
        if missing:
            await self.load()
            again = await self._send_many(name, [calls[i] for i in missing])
            for i, answer in zip(missing, again, strict=True):
                answers[i] = answer
        return answers

    async def _send_many(self, name: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        if self.line is not None:
            return await self.line.execute_many(
                [("EVALSHA", SHAS[name], len(run_keys), *run_keys, *args) for run_keys, args in calls])
        if len(calls) == 1:  # a pipeline costs more than a plain call
            run_keys, args = calls[0]
            try:
                return [await self.redis.evalsha(SHAS[name], len(run_keys), *run_keys, *args)]
            except ResponseError as exc:  # as a pipeline answers it (NoScriptError is one)
                return [exc]
        pipe = self.redis.pipeline(transaction=False)
        for run_keys, args in calls:
            pipe.evalsha(SHAS[name], len(run_keys), *run_keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def send_after(self, line: Line, command: Sequence[Any], name: str, keys: Sequence[str],
                         args: Sequence[Any], block_s: float) -> tuple[Any, Any]:
        """`command` (a blocking read, on `line`, its loop's own) and the script sent in one write:
        Redis runs the script as soon as it has answered the command, with no round trip between
        them. Returns both replies; an error reply of either is returned as it came (the
        exception), not raised: a script's error does not lose the command's reply, nor the
        command's the script's (a full Redis refuses a blocking pop while the script sent with it
        runs). A script Redis has forgotten (a restart) did nothing: it is loaded and called again.
        `block_s`: how long the command blocks at most (`Line.execute`)."""
        first, answer = await line.execute_many([command, ("EVALSHA", SHAS[name], len(keys), *keys, *args)], block_s)
        if isinstance(answer, NoScriptError):
            await self.load()
            try:
                answer = await self.call(name, keys, args)
            except ResponseError as exc:
                answer = exc.with_traceback(None)  # (its traceback holds this frame, which holds it)
        return first, answer

    async def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await self._evalsha(name, keys, args)
        except NoScriptError:
            await self.load()
            return await self._evalsha(name, keys, args)

    def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Awaitable[Any]:
        if self.line is not None:
            return self.line.execute("EVALSHA", SHAS[name], len(keys), *keys, *args)
        return self.redis.evalsha(SHAS[name], len(keys), *keys, *args)  # type: ignore[no-any-return]
