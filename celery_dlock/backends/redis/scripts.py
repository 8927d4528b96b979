"""Every Lua script celery-dlock runs, each headed by its contract.

One lock named ``NAME`` under prefix ``P`` is a handful of keys that share the hash tag
``{NAME}``, so that on Redis Cluster they all live in one slot:

``P:{NAME}``          hash: owner, count, fence, acquired_at (ms, server clock), ttl (ms,
                      the longest asked for), ops (the last few operation ids with their
                      results) and free-form metadata (task_id, task_name, worker, pid,
                      host).  It expires at least ``ttl`` after the last acquire, extend
                      or renewal: no operation ever brings its expiry closer.
``P:{NAME}:fence``    integer, the last fencing token handed out; never expires.  A fresh
                      hold gets ``max(counter + 1, server clock in microseconds)``,
                      so tokens strictly increase across holders, and also after the
                      server lost its data (an empty restart, a failover to a replica
                      that missed the write): the clock kept going while the counter
                      was lost.  Assumes the server's clock never goes back and hands
                      out fewer than one token per microsecond per lock (a script
                      call takes longer than that).  See docs/fencing.md.
``P:{NAME}:q``        sorted set of blocked acquirers (owner -> arrival time in us): FIFO.
``P:{NAME}:ql``       sorted set owner -> lease deadline (ms); a waiter that stops
                      refreshing its lease (it died) is dropped from the line.  A waiter
                      woken because the lock is free has :data:`WAKE_GRACE_MS` to take
                      it.  Both keys expire when no waiter has refreshed its lease.
``P:{NAME}:w:H``      list used as a doorbell, ``H`` = sha1 of the waiter's owner (so no
                      owner string can spell another lock's key): a release pushes one
                      element to the waiter first in line, whose ``BLPOP`` returns.
``P:{NAME}:r:OP``     a short-lived marker that the final release with operation id
                      ``OP`` freed the lock, so that a re-sent release says "released".
``P:{NAME}:released`` hash: a short-lived marker left by a force release that says
                      who it is (``celery dlock release``): the owner and fence of
                      the hold it freed, who freed it, why, when and the call's
                      operation id.  The holder reads it when it finds its hold
                      gone, to say why (:mod:`celery_dlock.redis.released`).

**Idempotence.**  Clients re-send a command when its reply is lost (redis-py's
``Retry`` does by default).  Every script that changes a hold takes an operation id
(``OP``, random hex, one per call) and remembers the last :data:`OPS_KEPT` ids of the
hold with their results; a re-sent call finds its id and returns the first result
without changing anything.  Renewal and extend only ever move the expiry later, so a
second execution of them changes nothing either.

**Foreign data.**  Every script reads each key before it writes any, so a key of the
wrong type (``WRONGTYPE``) aborts the script before it has written anything.  A hash
at the lock's key that lacks one of the fields every hold has
(:data:`~celery_dlock.backends.redis.keyspace.HOLD_FIELDS`) is no hold either: acquire,
release, extend and force release stop with :data:`~.refusals.NOT_A_HOLD` before any
write (one ``EXISTS`` when the key is free, a few ``HGET`` when another owner's hash is
there, nothing when the hash names the caller's own owner token).  Renewal writes only
to a hash whose owner is the renewing holder's token, so it never writes to one
either: it finds the hold gone.

Every script is given only the lock hash's name (``KEYS[1]``) and derives the helper
keys from it, which keeps the arguments (and redis-py's packing of them) short on the
hot path; the helper keys share the hash tag, so this is safe on a cluster.  Return
values are Lua tables (Redis arrays) of integers and strings.  Times are taken from
the server's ``TIME`` so that every client agrees on ages and deadlines.  Scripts stay
within Redis 6.2 (no functions, no ``PEXPIRETIME``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from .keyspace import HOLD_FIELDS, SUFFIXES
from .refusals import NOT_A_FENCE, NOT_A_HOLD
from .waiters import DOORBELL_TTL_MS, LINE_TTL_MS, WAKE_GRACE_MS

__all__ = [
    "ACQUIRE",
    "EXTEND",
    "FORCE_RELEASE",
    "LEAVE_QUEUE",
    "OPS_KEPT",
    "OP_MEMORY_MS",
    "READ_HOLD",
    "RELEASE",
    "RELEASED_MAX_MS",
    "RELEASED_MIN_MS",
    "RENEW_MANY",
    "LuaScript",
]

#: How many operation ids a hold remembers (re-sends come right after the original).
OPS_KEPT = 8
#: How long a final release is remembered after the hold is gone (ms).
OP_MEMORY_MS = 60_000
#: The shortest and longest a force release's marker is kept (ms): as long as the
#: freed hold had left, within these bounds.
RELEASED_MIN_MS = 60_000
RELEASED_MAX_MS = 3_600_000


class LuaScript:
    """A Lua script identified by its SHA1; runs with ``EVALSHA``, loading on a miss.

    Holds no per-client state, so it is safe to share between clients, threads and
    forked processes.
    """

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # EVAL caches the script, so the next EVALSHA finds it.
            return client.eval(self.source, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<LuaScript {self.name} {self.sha[:8]}>"


# Whether the key of a lock is one of its holds, pasted in front of the scripts that
# write to it.
_HOLD_SHAPE = f"""
local HOLD_NUMBERS = {{{", ".join(repr(f) for f in HOLD_FIELDS
                                  if f not in ("owner", "ops"))}}}
""" + """
-- The field of a hold that ``get`` (a field's name -> its value or nil/false) lacks,
-- or nil when it has them all: every hold has an owner, ops and HOLD_NUMBERS as
-- numbers; other fields are free-form metadata.
local function missing_field(get)
  if not get('owner') then return 'owner' end
  for _, f in ipairs(HOLD_NUMBERS) do
    if not tonumber(get(f)) then return f end
  end
  if not get('ops') then return 'ops' end
  return nil
end

-- An error reply when the key ``lock`` holds a hash that is not a hold (another
-- application's), else nil (a hold, or no key).  ``holder``: its owner field, read.
local function not_a_hold(lock, holder)
  local missing = 'owner'
  if not holder then
    if redis.call('EXISTS', lock) == 0 then return nil end
  else
    missing = missing_field(function(f) return redis.call('HGET', lock, f) end)
    if not missing then return nil end
  end
  return redis.error_reply('ERR """ + NOT_A_HOLD + """ (no ' .. missing .. ')')
end
"""

# Shared helpers, pasted in front of the scripts that need them (EVAL has no imports).
_COMMON = _HOLD_SHAPE + f"""
local DOORBELL_TTL = {DOORBELL_TTL_MS}
local WAKE_GRACE = {WAKE_GRACE_MS}
local LINE_TTL = {LINE_TTL_MS}
local OPS_KEPT = {OPS_KEPT}
local OP_MEMORY = {OP_MEMORY_MS}
""" + "".join(f"local {name} = '{suffix}'\n" for name, suffix in SUFFIXES.items()) + """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The next fencing token of ``lock``: above every token handed out before, also after
-- a data loss reset the counter: max(counter + 1, the server's clock in microseconds
-- at ``t``, a TIME reply), about 1.7e15: exact in a Lua number, and it fits a signed
-- 64-bit column.  A counter that is not an integer (foreign data) stops the script
-- here, before the hold is written.
local function next_fence(lock, t)
  local key = lock .. FENCE_SUFFIX
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local counter = redis.call('GET', key)
  if counter then
    local n = tonumber(counter)
    if not n or n ~= math.floor(n) then
      return redis.error_reply('ERR value is """ + NOT_A_FENCE + """')
    end
    if n + 1 > fence then fence = n + 1 end
  end
  redis.call('SET', key, string.format('%.0f', fence))
  return fence
end

-- The doorbell of ``owner``: named by a digest, so no owner string reaches other keys.
local function bell(lock, owner)
  return lock .. DOORBELL_SUFFIX .. redis.sha1hex(owner)
end

-- The result remembered for operation ``op`` of this hold (nil when unknown).  Op ids
-- are hex, so they are safe in a pattern.
local function seen(ops, op)
  if not ops then return nil end
  return string.match(ops, '|' .. op .. '=([^|]*)')
end

-- Remember ``op`` and its result; keep the last OPS_KEPT.
local function remember(lock, ops, op, result)
  ops = (ops or '') .. '|' .. op .. '=' .. result
  local _, n = string.gsub(ops, '|', '')
  while n > OPS_KEPT do
    ops = string.sub(ops, (string.find(ops, '|', 2, true)))
    n = n - 1
  end
  redis.call('HSET', lock, 'ops', ops)
end

-- Drop waiters whose lease ran out (they died or gave up without saying so).
local function purge(queue, leases, now)
  local stale = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  if #stale > 0 then
    redis.call('ZREM', queue, unpack(stale))
    redis.call('ZREM', leases, unpack(stale))
  end
end

-- Ring a waiter's doorbell (it holds at most one element, which expires unanswered)
-- and give the waiter WAKE_GRACE to take the free lock: one that died in line is
-- dropped from it then, instead of when its whole lease runs out.
local function ring(lock, owner, now)
  local b = bell(lock, owner)
  redis.call('DEL', b)
  redis.call('RPUSH', b, 1)
  redis.call('PEXPIRE', b, DOORBELL_TTL)
  redis.call('ZADD', lock .. LEASES_SUFFIX, 'XX', 'LT', now + WAKE_GRACE, owner)
end

-- Ring the doorbell of the first waiter in line of ``lock``, if any.
local function wake_head(lock, now)
  local queue, leases = lock .. QUEUE_SUFFIX, lock .. LEASES_SUFFIX
  purge(queue, leases, now)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    ring(lock, head, now)
  end
  return head
end
"""

# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] ttl (ms), ARGV[3] queue lease (ms; 0 = do not join the line),
# ARGV[4] operation id, ARGV[5] re-entry: '' (a plain acquire), '*' (the owner expects
# to hold the lock already) or a fence (the owner expects to hold the hold with that
# fence), ARGV[6..] metadata field/value pairs
# Returns
#   {1, fence, count}                       acquired (count > 1: re-entered)
#   {2, code}                               a re-entry whose hold is gone: nothing
#                                           taken; code 0 nobody holds the lock, -1
#                                           another owner (or another hold) does
#   {0, pttl, now_ms, field, value, ...}    not acquired; pttl is the holder's remaining
#                                           ttl in ms, or -1 when the lock is free but
#                                           promised to the first waiter in line (for
#                                           at most WAKE_GRACE); the fields are the
#                                           holder's hash (may be empty)
# A caller that passes a lease joins the FIFO line when it fails (keeping its place if it
# is already in it).  A free lock goes to the first live waiter in line, or to anyone
# when the line is empty: no barging past a waiter.  Re-entry never brings the expiry
# closer.  A re-sent call (same operation id) returns its first result.
ACQUIRE = LuaScript(
    "acquire",
    _COMMON
    + """
local lock, owner, op = KEYS[1], ARGV[1], ARGV[4]
local ttl = tonumber(ARGV[2])
local expect = ARGV[5]
local holder = redis.call('HGET', lock, 'owner')
if holder ~= owner then
  local foreign = not_a_hold(lock, holder)
  if foreign then return foreign end
end
if holder == owner then
  local ops = redis.call('HGET', lock, 'ops')
  local fence = tonumber(redis.call('HGET', lock, 'fence'))
  local done = seen(ops, op)
  if done then return {1, fence, tonumber(done)} end
  if expect ~= '' and expect ~= '*' and tonumber(expect) ~= fence then
    return {2, -1}
  end
  local count = redis.call('HINCRBY', lock, 'count', 1)
  if redis.call('PTTL', lock) < ttl then
    redis.call('PEXPIRE', lock, ttl)
  end
  if tonumber(redis.call('HGET', lock, 'ttl') or 0) < ttl then
    redis.call('HSET', lock, 'ttl', ttl)
  end
  remember(lock, ops, op, count)
  return {1, fence, count}
end
if expect ~= '' then
  -- The owner's hold is gone (expired, released by force, lost with the server's
  -- data): take nothing, so that the holder learns of the loss.
  if holder then return {2, -1} end
  return {2, 0}
end
local queue, leases = lock .. QUEUE_SUFFIX, lock .. LEASES_SUFFIX
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pttl
if not holder then
  local head = false
  if redis.call('EXISTS', queue) == 1 then
    purge(queue, leases, now)
    head = redis.call('ZRANGE', queue, 0, 0)[1]
  end
  if (not head) or head == owner then
    local fence = next_fence(lock, t)
    if type(fence) == 'table' then return fence end
    redis.call('HSET', lock, 'owner', owner, 'count', 1,
               'fence', string.format('%.0f', fence), 'acquired_at', now, 'ttl', ttl,
               'ops', '|' .. op .. '=1', unpack(ARGV, 6))
    redis.call('PEXPIRE', lock, ttl)
    if head then
      redis.call('ZREM', queue, owner)
      redis.call('ZREM', leases, owner)
      redis.call('DEL', bell(lock, owner))
    end
    return {1, fence, 1}
  end
  -- Free, but promised to the first in line: make sure it has heard.
  ring(lock, head, now)
  pttl = -1
else
  pttl = redis.call('PTTL', lock)
end
local lease = tonumber(ARGV[3])
if lease > 0 then
  local t = redis.call('TIME')
  redis.call('ZADD', queue, 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]), owner)
  redis.call('ZADD', leases, now + lease, owner)
  redis.call('PEXPIRE', queue, LINE_TTL)
  redis.call('PEXPIRE', leases, LINE_TTL)
end
local reply = {0, pttl, now}
local fields = redis.call('HGETALL', lock)
for i = 1, #fields do reply[i + 3] = fields[i] end
return reply
""",
)

# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] operation id
# Returns {1} released (the key is gone; the first waiter was woken),
#         {2, count} still held by this owner (count > 0 acquisitions left),
#         {0} already expired (nothing to release), {-1} held by another owner
#         (left alone).  A re-sent call (same operation id) returns its first result.
RELEASE = LuaScript(
    "release",
    _COMMON
    + """
local lock, op = KEYS[1], ARGV[2]
local holder = redis.call('HGET', lock, 'owner')
if holder ~= ARGV[1] then
  if redis.call('EXISTS', lock .. RELEASE_OP_SUFFIX .. op) == 1 then return {1} end
  local foreign = not_a_hold(lock, holder)
  if foreign then return foreign end
  if not holder then return {0} end
  return {-1}
end
local ops = redis.call('HGET', lock, 'ops')
local done = seen(ops, op)
if done then return {2, tonumber(done)} end
local count = redis.call('HINCRBY', lock, 'count', -1)
if count > 0 then
  remember(lock, ops, op, count)
  return {2, count}
end
redis.call('DEL', lock)
redis.call('SET', lock .. RELEASE_OP_SUFFIX .. op, 1, 'PX', OP_MEMORY)
if redis.call('EXISTS', lock .. QUEUE_SUFFIX) == 1 then
  wake_head(lock, now_ms())
end
return {1}
""",
)

# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] ttl (ms)
# Returns 1 extended (expires at least ttl from now; never sooner than before),
#         0 already expired, -1 held by another owner.
EXTEND = LuaScript(
    "extend",
    _HOLD_SHAPE
    + """
local lock, ttl = KEYS[1], tonumber(ARGV[2])
local holder = redis.call('HGET', lock, 'owner')
if holder ~= ARGV[1] then
  local foreign = not_a_hold(lock, holder)
  if foreign then return foreign end
end
if not holder then return 0 end
if holder ~= ARGV[1] then return -1 end
if redis.call('PTTL', lock) < ttl then
  redis.call('PEXPIRE', lock, ttl)
end
if tonumber(redis.call('HGET', lock, 'ttl') or 0) < ttl then
  redis.call('HSET', lock, 'ttl', ttl)
end
return 1
""",
)

# KEYS[1..n] lock hashes (one slot on a cluster)
# ARGV[2i-1] owner expected for KEYS[i], ARGV[2i] its ttl (ms)
# Returns a list of n integers: 1 renewed, 0 gone (expired), -1 held by another owner.
# A lost lock is never re-created: renewal only touches keys that still hold our owner,
# and it never brings an expiry closer (a longer extend() or re-entry stays).
RENEW_MANY = LuaScript(
    "renew_many",
    """
local out = {}
for i = 1, #KEYS do
  local holder = redis.call('HGET', KEYS[i], 'owner')
  if not holder then
    out[i] = 0
  elseif holder ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    local ttl = tonumber(ARGV[2 * i])
    if redis.call('PTTL', KEYS[i]) < ttl then
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
    out[i] = 1
  end
end
return out
""",
)

# KEYS[1] lock hash
# ARGV[1..] field/value pairs: conditions (for example 'fence', F or 'task_id', T, 'pid',
#           P; none means whoever holds it), and notes for the marker, whose field
#           starts with ':' (':by' who, ':reason' why, ':op' an operation id)
# Returns {1, field, value, ...} freed (the hash as it was), {0} nothing was held,
#         {-1, field, value, ...} a condition did not match (left alone),
#         {2, field, value, ...} nothing done: the call with this operation id already
#         freed a hold (this is a re-send); the fields are the marker's.
# For operators (``celery dlock release``) and for a worker freeing the lock of a child
# process that died (conditions: that task id in that pid).  A call that frees a hold
# and says who it is (':by') leaves the marker ``P:{NAME}:released`` (owner, fence,
# by, reason, at, op of the hold it freed), kept for as long as the hold had left but
# at least RELEASED_MIN_MS and at most RELEASED_MAX_MS, so that the holder learns why
# at its next renewal.
FORCE_RELEASE = LuaScript(
    "force_release",
    _COMMON
    + f"""
local RELEASED_MIN, RELEASED_MAX = {RELEASED_MIN_MS}, {RELEASED_MAX_MS}
""" + """
local lock = KEYS[1]
local marker = lock .. RELEASED_SUFFIX
local notes, conds = {}, {}
for i = 1, #ARGV - 1, 2 do
  if string.sub(ARGV[i], 1, 1) == ':' then
    notes[string.sub(ARGV[i], 2)] = ARGV[i + 1]
  else
    conds[#conds + 1] = i
  end
end
-- Read the marker first: foreign data under its name aborts before any write.
local last_op = redis.call('HGET', marker, 'op')
if notes.op and notes.op ~= '' and last_op == notes.op then
  local reply = {2}
  local m = redis.call('HGETALL', marker)
  for i = 1, #m do reply[i + 1] = m[i] end
  return reply
end
local fields = redis.call('HGETALL', lock)
if #fields == 0 then return {0} end
local hold = {}
for i = 1, #fields - 1, 2 do hold[fields[i]] = fields[i + 1] end
local missing = missing_field(function(f) return hold[f] end)
if missing then
  return redis.error_reply('ERR """ + NOT_A_HOLD + """ (no ' .. missing .. ')')
end
local reply = {1}
for _, i in ipairs(conds) do
  if redis.call('HGET', lock, ARGV[i]) ~= ARGV[i + 1] then
    reply = {-1}
    break
  end
end
if reply[1] == 1 then
  local pttl = redis.call('PTTL', lock)
  local now = now_ms()
  redis.call('DEL', lock)
  if notes.by then
    redis.call('DEL', marker)
    redis.call('HSET', marker, 'owner', hold.owner, 'fence', hold.fence or '',
               'by', notes.by or '', 'reason', notes.reason or '', 'at', now,
               'op', notes.op or '')
    redis.call('PEXPIRE', marker, math.min(math.max(pttl, RELEASED_MIN), RELEASED_MAX))
  end
  wake_head(lock, now)
end
for i = 1, #fields do reply[i + 1] = fields[i] end
return reply
""",
)

# KEYS[1] lock hash
# ARGV[1] owner
# Returns 1 when the caller was in line, 0 when it was not.
# A waiter that gives up (timeout) leaves the line; if it was first and the lock is free,
# the next in line is woken so that nobody waits for a doorbell that rang for a leaver.
LEAVE_QUEUE = LuaScript(
    "leave_queue",
    _COMMON
    + """
local lock, owner = KEYS[1], ARGV[1]
local queue = lock .. QUEUE_SUFFIX
local head = redis.call('ZRANGE', queue, 0, 0)[1]
local was = redis.call('ZREM', queue, owner)
redis.call('ZREM', lock .. LEASES_SUFFIX, owner)
redis.call('DEL', bell(lock, owner))
if head == owner and redis.call('EXISTS', lock) == 0 then
  wake_head(lock, now_ms())
end
return was
""",
)

# KEYS[1] lock hash
# Returns {pttl, server seconds, server microseconds, field, value, ...}: the hash
#         (empty when nobody holds the lock), its remaining ttl and the server's clock.
# Read-only.  One script rather than a pipeline of HGETALL, PTTL and TIME: a cluster
# client refuses TIME in a pipeline, and the three answers come from one moment.
READ_HOLD = LuaScript(
    "read_hold",
    """
local t = redis.call('TIME')
local reply = {redis.call('PTTL', KEYS[1]), t[1], t[2]}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields do reply[i + 3] = fields[i] end
return reply
""",
)
