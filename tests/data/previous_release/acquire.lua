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
local function read_hash(lock)
  local flat = call('HGETALL', lock)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h, flat
end
local function not_a_hold_in(h, flat)
  if #flat == 0 then return nil end
  local missing = missing_field(function(f) return h[f] end)
  if not missing then return nil end
  return foreign_hash(missing)
end
local DOORBELL_TTL = 5000
local WAKE_GRACE = 500
local LINE_TTL = 6000
local OPS_KEPT = 8
local FENCE_SUFFIX = ':fence'
local QUEUE_SUFFIX = ':q'
local LEASES_SUFFIX = ':ql'
local DOORBELL_SUFFIX = ':w:'
local function digits(n)
  return string.format('%d', n)
end
local function next_fence(lock, t)
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local counter = call('GET', lock .. FENCE_SUFFIX)
  if counter then
    local n = tonumber(counter)
    if not n or n ~= math.floor(n) then
      return redis.error_reply('ERR value is not an integer fence counter')
    end
    if n + 1 > fence then fence = n + 1 end
  end
  return fence, counter or '0'
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
local function leave_line(key, owner)
  local was = call('ZREM', key .. QUEUE_SUFFIX, owner)
  call('ZREM', key .. LEASES_SUFFIX, owner)
  call('DEL', bell(key, owner))
  return was
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
local function count_again(key, ops, op, count, held_ttl, ttl, ttl_value)
  local fields = {'count', count, 'ops', remembered(ops, op, count)}
  if tonumber(held_ttl or 0) < ttl then
    fields[5], fields[6] = 'ttl', ttl_value
  end
  call('HSET', key, unpack(fields))
end

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
    -- The key does not exist (not_a_hold_in saw to it), so PEXPIRE changes nothing
    -- here: it stops a user who may not run it before the hold is written.
    call('PEXPIRE', lock, ttl_arg)
    local fence, prev = next_fence(lock, t)
    if type(fence) == 'table' then return fence end
    if head then
      leave_line(lock, owner)
    end
    local token = digits(fence)
    call('SET', lock .. FENCE_SUFFIX, token, 'PX', digits(ttl + tonumber(ARGV[6])))
    call('HSET', lock, 'owner', owner, 'count', '1', 'fence', token,
         'acquired_at', digits(now), 'ttl', ttl_arg,
         'ops', '|' .. op .. '=1', 'prev', prev, unpack(ARGV, 7))
    call('PEXPIRE', lock, ttl_arg)
    return {1, fence, 1}
  end
  -- Free, but promised to the first in line: make sure it has heard.
  ring(lock, head, now)
  pttl = -1
else
  pttl = call('PTTL', lock)
end
return refused(queue, leases, owner, now, pttl, flat)
