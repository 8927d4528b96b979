local NEW_ERRORS = redis.REDIS_VERSION ~= nil
local function call(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    local e = reply.err
    if string.find(e, 'NOPERM', 1, true) or string.find(e, "can't run", 1, true)
        or string.find(e, "can't access", 1, true)
        or string.find(e, 'no permissions', 1, true) then
      error('celery-dlock: refused ' .. string.upper((...)) .. ' (' .. e .. ')', 0)
    end
    if NEW_ERRORS then error(reply) end
    error(e)
  end
  return reply
end
local HOLD_NUMBERS = {'count', 'fence', 'acquired_at', 'ttl'}
local function missing_field(get)
  if not get('owner') then return 'owner' end
  for _, f in ipairs(HOLD_NUMBERS) do
    if not tonumber(get(f)) then return f end
  end
  if not get('ops') then return 'ops' end
  return nil
end
local function foreign_hash(missing)
  return redis.error_reply('ERR not a celery-dlock hold (no ' .. missing .. ')')
end
local function not_a_hold(lock, holder)
  local missing = 'owner'
  if not holder then
    if call('EXISTS', lock) == 0 then return nil end
  else
    missing = missing_field(function(f) return call('HGET', lock, f) end)
    if not missing then return nil end
  end
  return foreign_hash(missing)
end
local DOORBELL_TTL = 5000
local WAKE_GRACE = 500
local LINE_TTL = 6000
local OPS_KEPT = 8
local FENCE_KEEP = 86400000
local FENCE_SUFFIX = ':fence'
local QUEUE_SUFFIX = ':q'
local LEASES_SUFFIX = ':ql'
local DOORBELL_SUFFIX = ':w:'
local function digits(n)
  return string.format('%d', n)
end
local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local FREED_BY_OWNER = 1
local function mark_freed(lock, fence, how, keep)
  local key = lock .. FENCE_SUFFIX
  local counter = tonumber(call('GET', key) or 0)
  if counter and counter < fence + how then
    local left = call('PTTL', key)
    keep = keep or FENCE_KEEP
    if left > keep then keep = left end
    call('SET', key, digits(fence + how), 'PX', digits(keep))
  end
end
local function freed(lock, holder, fence, how)
  if not fence or fence == '' or not tonumber(fence) then return false end
  local after = digits(tonumber(fence) + how)
  if holder then return call('HGET', lock, 'prev') == after end
  return call('GET', lock .. FENCE_SUFFIX) == after
end
local function bell(lock, owner)
  return lock .. DOORBELL_SUFFIX .. redis.sha1hex(owner)
end
local function seen(ops, op)
  if not ops then return nil end
  return string.match(ops, '|' .. op .. '=([^|]*)')
end
local function remembered(ops, op, result)
  ops = (ops or '') .. '|' .. op .. '=' .. result
  local _, n = string.gsub(ops, '|', '')
  while n > OPS_KEPT do
    ops = string.sub(ops, (string.find(ops, '|', 2, true)))
    n = n - 1
  end
  return ops
end
local function purge(queue, leases, now)
  local stale = call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  if #stale > 0 then
    call('ZREM', queue, unpack(stale))
    call('ZREM', leases, unpack(stale))
  end
end
local function ring(lock, owner, now)
  local b = bell(lock, owner)
  call('DEL', b)
  -- b is gone, so this changes nothing: it stops a user who may not run PEXPIRE
  -- before RPUSH makes a doorbell that would never expire.
  call('PEXPIRE', b, DOORBELL_TTL)
  call('RPUSH', b, 1)
  call('PEXPIRE', b, DOORBELL_TTL)
  call('ZADD', lock .. LEASES_SUFFIX, 'XX', 'LT', now + WAKE_GRACE, owner)
end
local function join_line(queue, leases, owner, now, lease)
  call('PEXPIRE', queue, LINE_TTL)
  local t = call('TIME')
  call('ZADD', queue, 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]), owner)
  call('ZADD', leases, now + lease, owner)
  call('PEXPIRE', queue, LINE_TTL)
  call('PEXPIRE', leases, LINE_TTL)
end
local function wake_head(lock, now)
  local queue, leases = lock .. QUEUE_SUFFIX, lock .. LEASES_SUFFIX
  purge(queue, leases, now)
  local head = call('ZRANGE', queue, 0, 0)[1]
  if head then
    ring(lock, head, now)
  end
  return head
end
local function refused(queue, leases, owner, now, pttl, fields)
  local lease = tonumber(ARGV[3])
  if lease > 0 then
    join_line(queue, leases, owner, now, lease)
  end
  local reply = {0, pttl, now}
  for i = 1, #fields do reply[i + 3] = fields[i] end
  return reply
end

local lock, op = KEYS[1], ARGV[2]
-- The owner's release reads the fields it needs in one HMGET (cheaper for the server
-- than an HGETALL of a hold with a task's metadata, and than one HGET per field).
local got = call('HMGET', lock, 'owner', 'ops', 'fence', 'count')
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
-- The final release.  The counter first (never lowered): a command refused there
-- stops the script before any other write.  The first in line is woken before the
-- hold goes, so that a command refused on the way leaves the hold held (a bumped
-- counter and a doorbell rung early change nothing a holder relies on).
mark_freed(lock, tonumber(hold_fence), FREED_BY_OWNER, tonumber(ARGV[5]))
if call('EXISTS', lock .. QUEUE_SUFFIX) == 1 then
  wake_head(lock, now_ms())
end
call('DEL', lock)
return {1}
