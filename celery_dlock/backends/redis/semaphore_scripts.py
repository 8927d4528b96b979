"""The Lua scripts of :class:`~celery_dlock.RedisSemaphore`, each headed by its contract.

A semaphore named ``NAME`` under prefix ``P`` with ``limit`` slots is these keys, all
sharing the hash tag ``{NAME}`` (one Redis Cluster slot, as a lock's keys):

``P:{NAME}``          sorted set of the holders: owner -> expiry (ms, server clock).  It
                      expires with its latest holder (``PEXPIREAT`` its highest score).
                      A member whose expiry passed holds nothing: every script reaps
                      such members (and their hashes) before it counts the holders.
``P:{NAME}:h:H``      hash of one hold, ``H`` = sha1 of its owner: the fields a lock's
                      hash has (owner, count, fence, acquired_at, ttl, ops and
                      metadata) plus ``limit`` (the limit its acquire asked for, for
                      operators).  It expires with its member of the sorted set.
``P:{NAME}:fence``    the fence counter, the same rule as a lock's: a fresh hold gets
                      ``max(counter + 1, server clock in us)`` (docs/fencing.md), so
                      every hold of every slot has its own strictly increasing token.
                      Each grant writes it with an expiry of the hold's ttl + the
                      name's fence ttl (``dlock_fence_ttl``): it outlives the last
                      grant by at least that, and no name keeps a key for ever.
``P:{NAME}:q``, ``:ql``, ``:w:H``
                      the line of waiters, their leases and their doorbells, exactly
                      as a lock's (:mod:`celery_dlock.backends.redis.scripts`).
``P:{NAME}:r:OP``     a final release's marker (60 s), so that a re-sent release says
                      "released".  A lock needs none (its fence counter says how its
                      one hold ended), but a semaphore's counter moves with every slot,
                      so it cannot tell one holder's release from its expiry.

A fresh acquire is granted when fewer than ``limit`` live holders remain and fewer
waiters stand in line ahead of the caller than slots are free: FIFO, no barging past a
waiter.  A release (or a waiter leaving) rings the doorbells of as many waiters, from
the head of the line, as slots are free.  An expiry rings no doorbell: a waiter's sleep
is bounded by the soonest holder's remaining ttl.

Every acquire passes its ``limit``; processes that share a name must use one limit (an
acquire counts the holders against its own).  Idempotence (operation ids kept with each
hold), foreign data (every key read before any write; ``WRONGTYPE`` or
:data:`~.refusals.NOT_A_HOLD` before anything is written) and the ACL write order follow
the lock's scripts.
"""

from __future__ import annotations

from .keyspace import HOLDER_SUFFIX
from .lua import COMMON, LuaScript

__all__ = ["HOLDER_SUFFIX", "SEM_ACQUIRE", "SEM_EXTEND", "SEM_FORCE_RELEASE",
           "SEM_LEAVE_QUEUE", "SEM_READ", "SEM_RELEASE", "SEM_RENEW_MANY", "SEM_STATUS"]

#: A final release's marker: the semaphore's key, this suffix, the operation id.
RELEASE_OP_SUFFIX = ":r:"
#: How long a final release's marker is kept (ms): a re-send comes right after.
OP_MEMORY_MS = 60_000

_SEM = COMMON + f"""
local HOLDER_SUFFIX = '{HOLDER_SUFFIX}'
local RELEASE_OP_SUFFIX = '{RELEASE_OP_SUFFIX}'
local OP_MEMORY = {OP_MEMORY_MS}
""" + """
local function holder_key(main, owner)
  return main .. HOLDER_SUFFIX .. redis.sha1hex(owner)
end

local function ms(n) return string.format('%.0f', n) end

-- Drop the holders whose expiry passed (and their hashes).
local function reap(main, now)
  local dead = call('ZRANGEBYSCORE', main, '-inf', now, 'LIMIT', 0, 256)
  if #dead > 0 then
    for _, o in ipairs(dead) do call('DEL', holder_key(main, o)) end
    call('ZREM', main, unpack(dead))
  end
end

-- The sorted set expires with its latest holder.
local function touch(main)
  local last = call('ZRANGE', main, -1, -1, 'WITHSCORES')
  if last[2] then call('PEXPIREAT', main, last[2]) end
end

-- Ring the doorbells of the first ``free`` waiters in line.
local function wake_n(main, now, free)
  if free <= 0 then return end
  local queue, leases = main .. QUEUE_SUFFIX, main .. LEASES_SUFFIX
  if call('EXISTS', queue) == 0 then return end
  purge(queue, leases, now)
  for _, w in ipairs(call('ZRANGE', queue, 0, free - 1)) do ring(main, w, now) end
end

-- Whether ``owner`` holds a live slot: its expiry (ms) and hash key, or false.
-- Reads the sorted set (WRONGTYPE on foreign data) and the hash (foreign: an error
-- reply, returned as the second value) before anything is written.
local function own_slot(main, owner, now)
  local h = holder_key(main, owner)
  local score = call('ZSCORE', main, owner)
  local holder = call('HGET', h, 'owner')
  if holder ~= owner then
    local foreign = not_a_hold(h, holder)
    if foreign then return false, foreign, h end
  end
  if score and tonumber(score) > now and holder == owner then
    return tonumber(score), nil, h
  end
  return false, nil, h
end

-- Make the hold of ``owner`` (hash ``h``, expiry ``score``) expire at least ``ttl``
-- from ``now``; never sooner.
local function lengthen(main, h, owner, score, now, ttl)
  local until_ = now + ttl
  if score < until_ then
    call('PEXPIREAT', h, ms(until_))
    call('ZADD', main, 'XX', ms(until_), owner)
    touch(main)
  end
end
"""

# KEYS[1] the semaphore's sorted set
# ARGV[1] owner, ARGV[2] ttl (ms), ARGV[3] queue lease (ms; 0 = do not join the line),
# ARGV[4] operation id, ARGV[5] re-entry ('' plain, '*' or a fence: as ACQUIRE),
# ARGV[6] limit, ARGV[7] the name's fence ttl (ms; the counter is kept the hold's ttl
# + this), ARGV[8..] metadata field/value pairs (a ``task_id`` among them: one
# slot per task id, so that a redelivered running task contends with itself)
# Returns what ACQUIRE returns: {1, fence, count}, {2, code} (a re-entry whose hold is
# gone: code 0, or -1 when the owner holds another hold), or
# {0, pttl, now_ms, field, value, ...}: not acquired; pttl the soonest holder's
# remaining ttl (-1: a slot is free but promised to waiters ahead in line), the fields
# that holder's hash.
SEM_ACQUIRE = LuaScript(
    "sem_acquire",
    _SEM
    + """
local main, owner, op, expect = KEYS[1], ARGV[1], ARGV[4], ARGV[5]
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[6])
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score, foreign, h = own_slot(main, owner, now)
if foreign then return foreign end
if score then
  local got = call('HMGET', h, 'ops', 'fence', 'count', 'ttl')
  local ops = got[1]
  local fence = tonumber(got[2])
  local done = seen(ops, op)
  if done then return {1, fence, tonumber(done)} end
  if expect ~= '' and expect ~= '*' and tonumber(expect) ~= fence then
    return {2, -1}
  end
  lengthen(main, h, owner, score, now, ttl)
  local count = tonumber(got[3]) + 1
  count_again(h, ops, op, count, got[4], ttl, ttl)
  return {1, fence, count}
end
if expect ~= '' then
  return {2, 0}
end
local fence = next_fence(main, t)
if type(fence) == 'table' then return fence end
reap(main, now)
local queue, leases = main .. QUEUE_SUFFIX, main .. LEASES_SUFFIX
local free = limit - call('ZCARD', main)
local pttl
-- A call whose task id already holds a slot (a redelivery of a running task) is
-- refused, with that holder's hash: one slot per task id.
local task_id
for i = 8, #ARGV - 1, 2 do
  if ARGV[i] == 'task_id' then task_id = ARGV[i + 1] end
end
local twin
if task_id and free > 0 then
  local live = call('ZRANGE', main, 0, -1, 'WITHSCORES')
  for i = 1, #live - 1, 2 do
    if call('HGET', holder_key(main, live[i]), 'task_id') == task_id then
      twin = {live[i], tonumber(live[i + 1])}
      break
    end
  end
end
if twin then
  free = 0
end
if free > 0 then
  local ahead = 0
  if call('EXISTS', queue) == 1 then
    purge(queue, leases, now)
    ahead = call('ZRANK', queue, owner) or call('ZCARD', queue)
  end
  if ahead < free then
    call('PEXPIRE', h, ttl)
    leave_line(main, owner)
    call('SET', main .. FENCE_SUFFIX, ms(fence), 'PX', ms(ttl + tonumber(ARGV[7])))
    call('DEL', h)
    call('HSET', h, 'owner', owner, 'count', 1, 'fence', ms(fence),
         'acquired_at', now, 'ttl', ttl, 'ops', '|' .. op .. '=1', 'limit', limit,
         unpack(ARGV, 8))
    call('PEXPIREAT', h, ms(now + ttl))
    call('ZADD', main, ms(now + ttl), owner)
    touch(main)
    return {1, fence, 1}
  end
  -- Free, but promised to the waiters ahead: make sure they have heard.
  wake_n(main, now, free)
  pttl = -1
end
local first = call('ZRANGE', main, 0, 0, 'WITHSCORES')
if twin then first = twin end
local fields = {}
if first[1] then
  if not pttl then pttl = tonumber(first[2]) - now end
  fields = call('HGETALL', holder_key(main, first[1]))
end
if not pttl then pttl = -1 end
return refused(queue, leases, owner, now, pttl, fields)
""",
)

# KEYS[1] the semaphore's sorted set
# ARGV[1] owner, ARGV[2] operation id, ARGV[3] limit
# Returns {1} released (the slot is free; waiters woken), {2, count} still held,
#         {0} the owner holds no slot (expired, or never held).  A re-sent call (same
#         operation id) returns its first result.
SEM_RELEASE = LuaScript(
    "sem_release",
    _SEM
    + """
local main, owner, op, limit = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local score, foreign, h = own_slot(main, owner, now)
if foreign then return foreign end
if not score then
  if call('EXISTS', main .. RELEASE_OP_SUFFIX .. op) == 1 then return {1} end
  return {0}
end
local got = call('HMGET', h, 'ops', 'count')
local ops = got[1]
local done = seen(ops, op)
if done then return {2, tonumber(done)} end
local count = tonumber(got[2]) - 1
if count > 0 then
  call('HSET', h, 'count', count, 'ops', remembered(ops, op, count))
  return {2, count}
end
local marker = main .. RELEASE_OP_SUFFIX .. op
call('DEL', marker)
call('SET', marker, 1, 'PX', OP_MEMORY)
call('ZREM', main, owner)
call('DEL', h)
reap(main, now)
wake_n(main, now, limit - call('ZCARD', main))
return {1}
""",
)

# KEYS[1] the semaphore's sorted set
# ARGV[1] owner, ARGV[2] ttl (ms)
# Returns 1 extended (never sooner than before), 0 the owner holds no slot.
SEM_EXTEND = LuaScript(
    "sem_extend",
    _SEM
    + """
local main, owner, ttl = KEYS[1], ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local score, foreign, h = own_slot(main, owner, now)
if foreign then return foreign end
if not score then return 0 end
lengthen(main, h, owner, score, now, ttl)
if tonumber(call('HGET', h, 'ttl') or 0) < ttl then
  call('HSET', h, 'ttl', ttl)
end
return 1
""",
)

# KEYS[1..n] semaphores' sorted sets (one slot on a cluster)
# ARGV[2i-1] owner for KEYS[i], ARGV[2i] its ttl (ms)
# Returns n integers: 1 renewed, 0 the owner holds no slot there.  Never re-creates a
# hold, never brings an expiry closer; writes only to the owner's own live hold.
SEM_RENEW_MANY = LuaScript(
    "sem_renew_many",
    _SEM
    + """
local now = now_ms()
local out = {}
for i = 1, #KEYS do
  local main, owner = KEYS[i], ARGV[2 * i - 1]
  local score = call('ZSCORE', main, owner)
  local h = holder_key(main, owner)
  if score and tonumber(score) > now and call('HGET', h, 'owner') == owner then
    lengthen(main, h, owner, tonumber(score), now, tonumber(ARGV[2 * i]))
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
""",
)

# KEYS[1] the semaphore's sorted set
# ARGV[1] owner
# Returns 1 when the owner holds a live slot, else 0.  Read-only.
SEM_STATUS = LuaScript(
    "sem_status",
    _SEM
    + """
local score, foreign = own_slot(KEYS[1], ARGV[1], now_ms())
if foreign then return foreign end
if score then return 1 end
return 0
""",
)

# KEYS[1] the semaphore's sorted set
# Returns {server seconds, server microseconds, n, then per live holder: pttl,
#          field count, field, value, ...}, soonest expiry first.  Read-only.
SEM_READ = LuaScript(
    "sem_read",
    _SEM
    + """
local main = KEYS[1]
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = call('ZRANGEBYSCORE', main, '(' .. now, '+inf', 'WITHSCORES')
local reply = {t[1], t[2], #live / 2}
for i = 1, #live - 1, 2 do
  local fields = call('HGETALL', holder_key(main, live[i]))
  reply[#reply + 1] = tonumber(live[i + 1]) - now
  reply[#reply + 1] = #fields
  for j = 1, #fields do reply[#reply + 1] = fields[j] end
end
return reply
""",
)

# KEYS[1] the semaphore's sorted set
# ARGV[1] owner, ARGV[2] limit
# Returns 1 when the caller was in line, 0 when it was not.  Wakes as many waiters as
# slots are free, so that nobody waits for a doorbell that rang for a leaver.
SEM_LEAVE_QUEUE = LuaScript(
    "sem_leave_queue",
    _SEM
    + """
local main, owner = KEYS[1], ARGV[1]
local was = leave_line(main, owner)
local now = now_ms()
local free = tonumber(ARGV[2]) - call('ZCOUNT', main, '(' .. now, '+inf')
wake_n(main, now, free)
return was
""",
)

# KEYS[1] the semaphore's sorted set
# ARGV[1..] field/value pairs: conditions on a hold's hash (none: every holder), and
#           notes for the marker, whose field starts with ':' (as FORCE_RELEASE)
# Returns {n, then per freed hold: its field count, field, value, ...}: the live holds
#         that matched, freed; waiters woken for the slots freed.  When one hold was
#         freed and ':by' given, leaves the marker ``P:{NAME}:released`` naming it
#         (kept RELEASED_MIN_MS), so that its holder learns why.
SEM_FORCE_RELEASE = LuaScript(
    "sem_force_release",
    _SEM
    + """
local main = KEYS[1]
local marker = main .. RELEASED_SUFFIX
local notes, conds = {}, {}
for i = 1, #ARGV - 1, 2 do
  if string.sub(ARGV[i], 1, 1) == ':' then
    notes[string.sub(ARGV[i], 2)] = ARGV[i + 1]
  else
    conds[#conds + 1] = i
  end
end
call('HGET', marker, 'op')
local now = now_ms()
local live = call('ZRANGEBYSCORE', main, '(' .. now, '+inf')
local freed = {}
for _, o in ipairs(live) do
  local h = holder_key(main, o)
  local fields = call('HGETALL', h)
  local hold = {}
  for i = 1, #fields - 1, 2 do hold[fields[i]] = fields[i + 1] end
  local ok = hold.owner == o
  for _, i in ipairs(conds) do
    if hold[ARGV[i]] ~= ARGV[i + 1] then ok = false end
  end
  if ok then freed[#freed + 1] = {o, h, fields, hold} end
end
for _, f in ipairs(freed) do
  call('ZREM', main, f[1])
  call('DEL', f[2])
end
if #freed == 1 and notes.by then
  call('DEL', marker)
  call('PEXPIRE', marker, """ + "60000" + """)
  call('HSET', marker, 'owner', freed[1][4].owner, 'fence', freed[1][4].fence,
       'by', notes.by, 'reason', notes.reason or '', 'at', now, 'op', notes.op or '')
  call('PEXPIRE', marker, """ + "60000" + """)
end
if #freed > 0 then
  reap(main, now)
  local limit = 0
  for _, f in ipairs(freed) do limit = math.max(limit, tonumber(f[4].limit or 1)) end
  wake_n(main, now, limit - call('ZCARD', main))
end
local reply = {#freed}
for _, f in ipairs(freed) do
  reply[#reply + 1] = #f[3]
  for j = 1, #f[3] do reply[#reply + 1] = f[3][j] end
end
return reply
""",
)
