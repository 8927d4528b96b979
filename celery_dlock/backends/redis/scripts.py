"""Every Lua script celery-dlock runs, each headed by its contract.

One lock named ``NAME`` under prefix ``P`` is a handful of keys that share the hash tag
``{NAME}``, so that on Redis Cluster they all live in one slot:

``P:{NAME}``          hash: owner, count, fence, acquired_at (ms, server clock), ttl (ms,
                      the longest asked for), ops (the last few operation ids with their
                      results) and free-form metadata (task_id, task_name, worker, pid,
                      host), and ``line`` once a waiter joined the line during the
                      hold (its final release reads the line only then).  It expires
                      at least ``ttl`` after the last acquire, extend or renewal: no
                      operation ever brings its expiry closer.
``P:{NAME}:fence``    integer, the last fencing token handed out.  A fresh hold gets
                      ``max(counter + 1, server clock in microseconds)``,
                      and its owner's final release leaves it at that hold's fence
                      + 1 (how a re-sent release knows it freed the lock),
                      so tokens strictly increase across holders, and also after the
                      server lost its data (an empty restart, a failover to a replica
                      that missed the write): the clock kept going while the counter
                      was lost.  It expires: a grant writes it with an expiry of the
                      hold's ttl + the name's fence ttl (``dlock_fence_ttl``, a day by
                      default), a release or force release with at least the fence
                      ttl, so no name keeps a key for ever; once it is gone the clock
                      floor alone keeps tokens increasing.  Assumes the server's
                      clock never goes back by more than the fence ttl and hands out
                      fewer than one token per microsecond per lock (a script call
                      takes longer than that).  See docs/fencing.md.
``P:{NAME}:q``        sorted set of blocked acquirers (owner -> arrival time in us): FIFO.
``P:{NAME}:ql``       sorted set owner -> lease deadline (ms); a waiter that stops
                      refreshing its lease (it died) is dropped from the line.  A waiter
                      woken because the lock is free has :data:`WAKE_GRACE_MS` to take
                      it.  Both keys expire when no waiter has refreshed its lease.
``P:{NAME}:w:H``      list used as a doorbell, ``H`` = sha1 of the waiter's owner (so no
                      owner string can spell another lock's key): a release pushes one
                      element to the waiter first in line, whose ``BLPOP`` returns.
``P:{NAME}:released`` hash: a short-lived marker left by a force release that says
                      who it is (``celery dlock release``): the owner and fence of
                      the hold it freed, who freed it, why, when and the call's
                      operation id.  The holder reads it when it finds its hold
                      gone, to say why (:mod:`celery_dlock.backends.redis.released`).

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

from .lua import CALL, COMMON, HOLD_SHAPE, OPS_KEPT, LuaScript

__all__ = [
    "ACQUIRE",
    "EXTEND",
    "FORCE_RELEASE",
    "LEAVE_QUEUE",
    "OPS_KEPT",
    "READ_HOLD",
    "RELEASE",
    "RELEASED_MAX_MS",
    "RELEASED_MIN_MS",
    "RENEW_MANY",
    "LuaScript",
]

#: The shortest and longest a force release's marker is kept (ms): as long as the
#: freed hold had left, within these bounds.
RELEASED_MIN_MS = 60_000
RELEASED_MAX_MS = 3_600_000


# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] ttl (ms, an integer), ARGV[3] queue lease (ms; 0 = do not
# join the line), ARGV[4] operation id, ARGV[5] re-entry: '' (a plain acquire), '*'
# (the owner expects to hold the lock already) or a fence (the owner expects to hold
# the hold with that fence), ARGV[6] the name's fence ttl (ms: the fence counter is
# kept the hold's ttl + this), ARGV[7..] metadata field/value pairs
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
    COMMON
    + """
local lock, owner, op = KEYS[1], ARGV[1], ARGV[4]
-- ttl as a number for comparing, as the string it came as for writing: a number
-- handed to redis.call is formatted with %.17g, which costs the server more than
-- the rest of the call.
local ttl, ttl_arg = tonumber(ARGV[2]), ARGV[2]
local expect = ARGV[5]
-- One HGETALL: empty for a free lock; every field a re-entry or a refusal needs.
local h, flat = read_hash(lock)
local holder = h['owner']
if holder ~= owner then
  local foreign = not_a_hold_in(h, flat)
  if foreign then return foreign end
end
if holder == owner then
  local ops = h['ops']
  local fence = tonumber(h['fence'])
  local done = seen(ops, op)
  if done then return {1, fence, tonumber(done)} end
  if expect ~= '' and expect ~= '*' and tonumber(expect) ~= fence then
    return {2, -1}
  end
  -- The expiry first, then every field in one HSET: a refused command stops the
  -- script before the count changed.
  if call('PTTL', lock) < ttl then
    call('PEXPIRE', lock, ttl_arg)
  end
  local count = tonumber(h['count']) + 1
  count_again(lock, ops, op, count, h['ttl'], ttl, ttl_arg)
  return {1, fence, count}
end
if expect ~= '' then
  -- The owner's hold is gone (expired, released by force, lost with the server's
  -- data): take nothing, so that the holder learns of the loss.
  if holder then return {2, -1} end
  return {2, 0}
end
local queue, leases = lock .. QUEUE_SUFFIX, lock .. LEASES_SUFFIX
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pttl
if not holder then
  local head = false
  if call('EXISTS', queue) == 1 then
    purge(queue, leases, now)
    head = call('ZRANGE', queue, 0, 0)[1]
  end
  if (not head) or head == owner then
    local fence, prev = next_fence(lock, t)
    if type(fence) == 'table' then return fence end
    local line = false
    if head then
      leave_line(lock, owner)
      line = call('EXISTS', queue) == 1
    end
    local token = digits(fence)
    call('SET', lock .. FENCE_SUFFIX, token, 'PX', digits(ttl + tonumber(ARGV[6])))
    call('HSET', lock, 'owner', owner, 'count', '1', 'fence', token,
         'acquired_at', digits(now), 'ttl', ttl_arg,
         'ops', '|' .. op .. '=1', 'prev', prev, unpack(ARGV, 7))
    if line then
      call('HSET', lock, LINE_FIELD, '1')
    end
    expire_new(lock, ttl_arg)
    return {1, fence, 1}
  end
  -- Free, but promised to the first in line: make sure it has heard.
  ring(lock, head, now)
  pttl = -1
else
  pttl = call('PTTL', lock)
  if tonumber(ARGV[3]) > 0 and not h[LINE_FIELD] then
    -- It joins the line: its holder's release is to ring the first in line.
    call('HSET', lock, LINE_FIELD, '1')
  end
end
return refused(queue, leases, owner, now, pttl, flat)
""",
)

# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] operation id, ARGV[3] the fence of the owner's hold ('' when
# unknown), ARGV[4] the operation id of an acquire that counted in that hold (a
# give-back names the acquire it undoes; '' or absent: none), ARGV[5] the name's
# fence ttl (ms; '' or absent: the default): the final release keeps the counter at
# least that long
# Returns {1} released (the key is gone; the first waiter was woken),
#         {2, count} still held by this owner (count > 0 acquisitions left),
#         {0} already expired (nothing to release), {-1} held by another owner
#         (left alone).  A re-sent call (same operation id) returns its first result:
#         a non-final one from the hold's ``ops``; a final one from the fence counter,
#         which the final release leaves at the hold's fence + 1 (see ``freed``: the
#         answer holds until the next hold of the name ends).
# A release takes back a count only from the hold it names: when the owner's hold there
# has another fence, or never counted the named acquire (it never ran there, or its
# hold ended and the owner took a new one since), it returns as for a hold that ended
# ({1} when the counter shows that hold freed, else {0}) and leaves the hold alone, so
# a release or give-back that arrives late never removes the owner's later hold.
# The final release leaves no key behind but the fence counter, which expires.
RELEASE = LuaScript(
    "release",
    COMMON
    + """
local lock, op = KEYS[1], ARGV[2]
-- The owner's release reads the fields it needs in one HMGET (cheaper for the server
-- than an HGETALL of a hold with a task's metadata, and than one HGET per field).
local got = call('HMGET', lock, 'owner', 'ops', 'fence', 'count', LINE_FIELD)
local holder = got[1]
if holder ~= ARGV[1] then
  local foreign = not_a_hold(lock, holder)
  if foreign then return foreign end
  if freed(lock, holder, ARGV[3], FREED_BY_OWNER) then return {1} end
  if not holder then return {0} end
  return {-1}
end
local ops = got[2]
local done = seen(ops, op)
if done then return {2, tonumber(done)} end
-- A release that names its hold (by fence, or by the acquire that counted in it) and
-- finds another hold of the owner there is for a hold that ended: it leaves this one.
local fence, undoes = ARGV[3], ARGV[4]
local hold_fence = got[3]
if (fence and fence ~= '' and hold_fence and hold_fence ~= fence)
    or (undoes and undoes ~= '' and not seen(ops, undoes)) then
  if freed(lock, holder, fence, FREED_BY_OWNER) then return {1} end
  return {0}
end
local count = tonumber(got[4]) - 1
if count > 0 then
  call('HSET', lock, 'count', count, 'ops', remembered(ops, op, count))
  return {2, count}
end
-- The final release.  The counter first: a command refused there stops the script
-- before any other write.  It is written without being read: the grant of this
-- hold wrote it at the hold's fence, and only the end of this hold changes it
-- (a force release of it leaves another owner, or none, at the key).  The first in
-- line is woken before the hold goes, so that a command refused on the way leaves
-- the hold held (a counter written and a doorbell rung early change nothing a holder
-- relies on); there is a line to wake only when someone joined it during this hold.
call('SET', lock .. FENCE_SUFFIX, digits(tonumber(hold_fence) + FREED_BY_OWNER), 'PX',
     digits(tonumber(ARGV[5]) or FENCE_KEEP))
if got[5] and call('EXISTS', lock .. QUEUE_SUFFIX) == 1 then
  wake_head(lock, now_ms())
end
call('DEL', lock)
return {1}
""",
)

# KEYS[1] lock hash
# ARGV[1] owner, ARGV[2] ttl (ms)
# Returns 1 extended (expires at least ttl from now; never sooner than before),
#         0 already expired, -1 held by another owner.
EXTEND = LuaScript(
    "extend",
    HOLD_SHAPE
    + """
local lock, ttl = KEYS[1], tonumber(ARGV[2])
local holder = call('HGET', lock, 'owner')
if holder ~= ARGV[1] then
  local foreign = not_a_hold(lock, holder)
  if foreign then return foreign end
end
if not holder then return 0 end
if holder ~= ARGV[1] then return -1 end
if call('PTTL', lock) < ttl then
  call('PEXPIRE', lock, ttl)
end
if tonumber(call('HGET', lock, 'ttl') or 0) < ttl then
  call('HSET', lock, 'ttl', ttl)
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
    CALL
    + """
local out = {}
for i = 1, #KEYS do
  local holder = call('HGET', KEYS[i], 'owner')
  if not holder then
    out[i] = 0
  elseif holder ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    local ttl = tonumber(ARGV[2 * i])
    if call('PTTL', KEYS[i]) < ttl then
      call('PEXPIRE', KEYS[i], ttl)
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
#         freed a hold (this is a re-send); the fields are the marker's (none when
#         it left no marker).
# For operators (``celery dlock release``) and for a worker freeing the lock of a child
# process that died (conditions: that task id in that pid).  A call that frees a hold
# and gives a reason (':reason') leaves the marker ``P:{NAME}:released`` (owner,
# fence, by, reason, at, op of the hold it freed), kept for as long as the hold had
# left but at least RELEASED_MIN_MS and at most RELEASED_MAX_MS, so that the holder
# learns who and why at its next renewal.  Without a reason it leaves no key but the
# fence counter (kept at least a day, or longer when its expiry was later), at the
# freed hold's fence + 2 + a tag of the operation id: a re-send
# that names that fence learns from it (or from the next hold's ``prev``) that it
# freed the hold.
FORCE_RELEASE = LuaScript(
    "force_release",
    COMMON
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
local last_op = call('HGET', marker, 'op')
if notes.op and notes.op ~= '' and last_op == notes.op then
  local reply = {2}
  local m = call('HGETALL', marker)
  for i = 1, #m do reply[i + 1] = m[i] end
  return reply
end
local fields = call('HGETALL', lock)
local hold = {}
for i = 1, #fields - 1, 2 do hold[fields[i]] = fields[i + 1] end
if #fields > 0 then
  local missing = missing_field(function(f) return hold[f] end)
  if missing then return foreign_hash(missing) end
end
local named = nil
for _, i in ipairs(conds) do
  if ARGV[i] == 'fence' then named = ARGV[i + 1] end
end
if notes.op and named and freed(lock, hold.owner, named, by_force(notes.op)) then
  return {2}
end
if #fields == 0 then return {0} end
local reply = {1}
for _, i in ipairs(conds) do
  if call('HGET', lock, ARGV[i]) ~= ARGV[i + 1] then
    reply = {-1}
    break
  end
end
if reply[1] == 1 then
  local pttl = call('PTTL', lock)
  local now = now_ms()
  -- Every write that could be refused comes before the hold is deleted, and the
  -- marker's expiry is tried before the marker is written (once deleted, PEXPIRE
  -- changes nothing on it).
  mark_freed(lock, tonumber(hold.fence), by_force(notes.op))
  wake_head(lock, now)
  if notes.reason and notes.reason ~= '' then
    call('DEL', marker)
    call('PEXPIRE', marker, RELEASED_MIN)
    call('HSET', marker, 'owner', hold.owner, 'fence', hold.fence,
         'by', notes.by or '', 'reason', notes.reason, 'at', now, 'op', notes.op or '')
    call('PEXPIRE', marker, math.min(math.max(pttl, RELEASED_MIN), RELEASED_MAX))
  end
  call('DEL', lock)
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
    COMMON
    + """
local lock, owner = KEYS[1], ARGV[1]
local queue = lock .. QUEUE_SUFFIX
local head = call('ZRANGE', queue, 0, 0)[1]
local was = leave_line(lock, owner)
if head == owner and call('EXISTS', lock) == 0 then
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
    CALL
    + """
local t = call('TIME')
local reply = {call('PTTL', KEYS[1]), t[1], t[2]}
local fields = call('HGETALL', KEYS[1])
for i = 1, #fields do reply[i + 3] = fields[i] end
return reply
""",
)
