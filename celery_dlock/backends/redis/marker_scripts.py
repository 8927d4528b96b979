"""The Lua scripts of the queue markers on Redis (:mod:`celery_dlock.backends.redis.
markers` says what the keys hold and what the replies mean; each script's header
says its KEYS, ARGV and reply)."""

from __future__ import annotations

from .lua import CALL, LuaScript

__all__ = ["CLAIM", "CLEAR", "CONFIRM", "HAND_OVER", "RECORD_SUFFIX", "REDELIVERY",
           "REPLACED_SUFFIX", "TAKEN_BACK_SUFFIX", "UNDO", "WAITING_SUFFIX"]

# The keys of one lock name's markers, after the marker's own (``P:{NAME}:m``): the
# replaced calls (a sorted set: task id -> the ms, on the server's clock, until which
# its message could still be delivered) and the claim record (a hash: ``op``, ``code``
# and ``other`` of the last send's claim that wrote, so a re-sent claim gets its first
# reply; ``pend``, ``pold`` and ``pdl``: a replace whose publish is not confirmed yet,
# the call it replaced and that call's marker's deadline in ms, and ``pop``, ``pcode``
# and ``pother``: the ``op``, ``code`` and ``other`` of the claim that wrote the
# replaced call's marker (a failed publish gives them back with the marker, so that
# claim, re-sent, still gets its first reply); ``conf``: the last
# replace confirmed; ``back``: the last replace taken back by the replaced call's
# start; ``x`` and ``xr``: the operation id of the last claim taken back and the
# take-back's reply (a claim taken back before it ran does nothing when it runs; a
# re-sent take-back gets the first reply); ``run``: the
# started call whose retry holds the marker, never replaced); and the retries waiting
# (a sorted set: the task id of a started call whose retry holds no marker, in
# ``until_started`` and ``queued_and_running`` -> the ms until which that retry's
# message could still be delivered; its start, or its end without running, removes
# it), so that a send of that task id is a duplicate of the call, read in the claim's
# own step.
REPLACED_SUFFIX = "r"
RECORD_SUFFIX = "c"
WAITING_SUFFIX = "w"
# The replaces taken back that do not stop the replacing call (until_started,
# queued_and_running: the replaced call started first, the replacing one stays
# queued): a hash, task id of the replacing call -> 1, read once by that call's
# CONFIRM (so that it revokes nothing, also after its record was rewritten or
# deleted), kept TAKEN_BACK_MS.
TAKEN_BACK_SUFFIX = "b"
TAKEN_BACK_MS = 60_000

# The server's clock in ms, for the scripts that read it.
_NOW = """
local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Keep ``id`` in the replaced set until ``deadline`` at least (the set lives as long as
# its longest-lived member); members whose time is past are dropped first.
_REMEMBER = """
local function remember(replaced, id, deadline, now)
  call('ZREMRANGEBYSCORE', replaced, '-inf', now)
  local was = tonumber(call('ZSCORE', replaced, id))
  if not was or was < deadline then call('ZADD', replaced, deadline, id) end
  local keep = deadline - now
  if call('PTTL', replaced) < keep then call('PEXPIRE', replaced, keep) end
end
"""

CLAIM = LuaScript("marker_claim", CALL + _NOW + _REMEMBER + """
-- KEYS[1] marker, KEYS[2] the lock's hash, KEYS[3] the replaced calls, KEYS[4] the
-- claim record, KEYS[5] the retries waiting.  ARGV[1] task id, ARGV[2] ttl (ms),
-- ARGV[3] '1': a running holder (another task holding the lock) is a duplicate too,
-- ARGV[4] '1': replace a queued call, ARGV[5] '1': a re-queue of an accepted call
-- (never a duplicate: it keeps or takes the marker, unless another call's is there),
-- ARGV[6] the send's operation id (a re-send of this claim gets the first reply; a
-- claim taken back by UNDO before it ran does nothing: reply 2 naming no call),
-- ARGV[7] '1': the re-queue (ARGV[5]) of a call that has started (its retry): the
-- marker it keeps or takes is never replaced (the record's ``run``): a replace finds
-- it queued (reply 2), as a replace finds a running call,
-- ARGV[8] '1': the re-queue of a call that has started and holds no marker in its mode
-- (until_started, queued_and_running: its retry): it claims nothing, and its task id
-- is kept among the retries waiting for ARGV[2] (reply 1 naming itself).
-- A re-queue of a task id found among the started calls waiting (a started call's
-- message come back after its worker died, then re-queued by contention or its rate)
-- is that started call's re-queue: as ARGV[8] in those modes, as ARGV[7] where a
-- running call is a duplicate (ARGV[3], until_finished); never replaced.
-- A send (not a re-queue) of a task id that is queued (the marker holds it) or running
-- (the lock's holder is it, whether or not another call is queued) or waits for its
-- retry (the retries waiting hold it) is a
-- duplicate of that call, in every mode; so is a send of a replaced task id (a claim
-- re-sent after its replace was taken back): it never runs.  A re-queue of a replaced
-- call takes nothing (reply 2) and keeps it replaced for ARGV[2] more.
local marker, lock, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1]
local requeue = ARGV[5] == '1'
local current = call('GET', marker)
local r = call('HMGET', rec, 'op', 'code', 'other', 'pend', 'pold', 'pdl', 'x',
                    'run')
if r[7] == ARGV[6] then return {2, '', 0} end
local started_call, bare = ARGV[7] == '1', ARGV[8] == '1'
if requeue and not (started_call or bare) then
  local waits = tonumber(call('ZSCORE', KEYS[5], id))
  if waits and waits > now_ms() then
    if ARGV[3] == '1' then started_call = true else bare = true end
  end
end
if bare then
  local now = now_ms()
  remember(KEYS[5], id, now + tonumber(ARGV[2]), now)
  return {1, id, 0}
end
local until_ms, now = tonumber(call('ZSCORE', replaced, id)), nil
if until_ms then
  now = now_ms()
  if until_ms <= now then until_ms = nil end
end
if requeue and until_ms then
  -- A replaced call delivered all the same (its revoke lost) and re-queued before its
  -- start (a contention retry, a rate park) takes nothing, and stays replaced as long
  -- as its new message could be delivered.  A pending replace's failed publish gives
  -- it its marker back: for as long as that message could be delivered too.
  local ttl = tonumber(ARGV[2])
  remember(replaced, id, now + ttl, now)
  if r[4] and r[5] == id and (tonumber(r[6]) or 0) < now + ttl then
    call('HSET', rec, 'pdl', now + ttl)
    if call('PTTL', rec) < ttl then call('PEXPIRE', rec, ttl) end
  end
  return {2, current or '', call('PTTL', marker)}
end
local function started()  -- a started call's re-queue holds the marker from now on
  if started_call then
    call('HSET', rec, 'run', id)
    if call('PTTL', rec) < tonumber(ARGV[2]) then
      call('PEXPIRE', rec, ARGV[2])
    end
  end
end
if current == id then
  if requeue then
    -- It was delivered, so its publish went through: a replace it made is confirmed.
    if r[4] == id then
      call('HDEL', rec, 'pend', 'pold', 'pdl', 'pop', 'pcode', 'pother')
    end
    call('PEXPIRE', marker, ARGV[2])
    started()
    return {1, id, 0}
  end
  if r[1] == ARGV[6] then return {tonumber(r[2]), r[3], 0} end  -- a re-sent claim
  return {2, id, call('PTTL', marker)}
end
if not requeue then  -- a started call (running, or waiting for its retry): that call
  local waits = tonumber(call('ZSCORE', KEYS[5], id))
  if waits then
    now = now or now_ms()
    if waits > now and not (call('TYPE', lock)['ok'] == 'hash'
                            and call('HGET', lock, 'task_id') == id) then
      return {2, id, waits - now}
    end  -- (running: the holder's answer below)
  end
end
if until_ms then  -- replaced (its replace taken back, or its claim re-sent late)
  return {2, current or '', call('PTTL', marker)}
end
-- The running call: a send of its own task id is that call, also while another call
-- is queued (a replace must not publish the running call's id a second time).
if not requeue and ((not current and ARGV[3] == '1')
    or call('TYPE', lock)['ok'] == 'hash') then
  if call('EXISTS', lock) == 1 then
    local holder = call('HGET', lock, 'task_id')
    if holder == id or (ARGV[3] == '1' and not current) then
      return {3, holder or '', call('PTTL', lock)}
    end
  end
end
if current then
  if requeue then
    return {2, current, call('PTTL', marker)}
  end
  if ARGV[4] == '1' and r[8] ~= current and r[4] == current then
    -- The queued call is itself a replace whose publish is not confirmed yet: wait
    -- (reply 5, nothing written) until it stands or is taken back, so a failed
    -- publish never takes a published call's place.
    return {5, current, call('PTTL', marker)}
  end
  if ARGV[4] == '1' and r[8] ~= current then
    -- The replaced call's id is kept as long as its message could be delivered (its
    -- marker's time) and as the new marker, so that its start finds it replaced, also
    -- after the new call started and removed the marker, and after a worker restart
    -- lost the revoke.  Until the caller confirms its publish the replace is pending:
    -- a failed publish gives the name back to the call queued before (``pold``).
    call('ZSCORE', replaced, current)
    local now, ttl = now_ms(), tonumber(ARGV[2])
    local left = call('PTTL', marker)
    if left < 0 then left = ttl end
    local pold, pdl = current, now + left
    if r[4] == current then pold, pdl = r[5], tonumber(r[6]) end
    remember(replaced, current, now + math.max(left, ttl), now)
    call('SET', marker, id, 'PX', ttl)
    call('HDEL', rec, 'pold', 'pdl', 'conf', 'back', 'pop', 'pcode', 'pother')
    call('HSET', rec, 'op', ARGV[6], 'code', 4, 'other', current, 'pend', id)
    if pold then call('HSET', rec, 'pold', pold, 'pdl', pdl) end
    if r[1] then  -- the claim that wrote the replaced call's marker, for an undo
      call('HSET', rec, 'pop', r[1], 'pcode', r[2] or 0, 'pother', r[3] or '')
    end
    if call('PTTL', rec) < ttl then call('PEXPIRE', rec, ttl) end
    return {4, current, 0}
  end
  return {2, current, call('PTTL', marker)}
end
call('SET', marker, id, 'PX', ARGV[2])
if not (r[1] or r[4] or r[5] or r[7] or r[8]) then
  -- no record of a claim, a replace or a take-back (the usual case): written anew
  call('HSET', rec, 'op', ARGV[6], 'code', 0, 'other', '')
  call('PEXPIRE', rec, ARGV[2])
else
  call('HDEL', rec, 'pend', 'pold', 'pdl', 'conf', 'back', 'pop', 'pcode',
             'pother')
  call('HSET', rec, 'op', ARGV[6], 'code', 0, 'other', '')
  if call('PTTL', rec) < tonumber(ARGV[2]) then
    call('PEXPIRE', rec, ARGV[2])
  end
end
started()
return {0, '', 0}
""")

CONFIRM = LuaScript("marker_confirm", CALL + _NOW + """
-- KEYS[1] the claim record, KEYS[2] the replaced calls, KEYS[3] the replaces taken
-- back.  ARGV[1] the task id of a
-- replace whose publish went through.  1: the replace stands (the replaced call is to
-- be revoked); 0: the replaced call started first and took the replace back (this
-- call runs after it, or, in until_finished, never), or this call is replaced itself
-- (a later replace, whose confirm or take-back decides for the call queued before):
-- revoke nothing; -1: nothing is known of
-- it (the record expired or was lost with a restart): the replaced call is to be
-- revoked all the same.
if call('HDEL', KEYS[3], ARGV[1]) == 1 then return 0 end
local r = call('HMGET', KEYS[1], 'pend', 'conf', 'back')
if r[2] == ARGV[1] then return 1 end  -- a re-sent confirm, or it started first
if r[3] == ARGV[1] then return 0 end
if r[1] ~= ARGV[1] then
  local until_ms = tonumber(call('ZSCORE', KEYS[2], ARGV[1]))
  if until_ms and until_ms > now_ms() then return 0 end
  return -1
end
call('HDEL', KEYS[1], 'pend', 'pold', 'pdl', 'pop', 'pcode', 'pother')
call('HSET', KEYS[1], 'conf', ARGV[1])
return 1
""")

UNDO = LuaScript("marker_undo", CALL + _NOW + """
-- KEYS[1] marker, KEYS[2] the replaced calls, KEYS[3] the claim record.  ARGV[1] the
-- task id whose publish failed (or whose claim's reply never came), ARGV[2] its
-- claim's operation id, ARGV[3] ttl (ms) of what is kept of it.  The claim is taken
-- back: a replace gives the name back to the call queued before it (its marker, with
-- the time it had left, and no longer replaced, and the record of the claim that
-- wrote its marker, so that claim re-sent gets its first reply); a plain claim removes
-- its marker.  A
-- claim that has not run yet (a stalled server runs it later) does nothing when it
-- runs (``x``).  1: taken back; 0: nothing of it was left (not run yet, replaced in
-- turn, or expired).  A re-sent take-back gets the first reply (``xr``).
local marker, replaced, rec, id, op = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]
local current = call('GET', marker)
local r = call('HMGET', rec, 'op', 'pend', 'pold', 'pdl', 'x', 'xr', 'pop',
                    'pcode', 'pother')
call('ZSCORE', replaced, id)
if r[5] == op then return tonumber(r[6]) end  -- a re-sent take-back
local undone = 0
if r[1] == op then
  local back = false
  if r[2] == id and r[3] then
    call('ZREM', replaced, r[3])
    local left = tonumber(r[4]) - now_ms()
    if current == id then
      if left > 0 then call('SET', marker, r[3], 'PX', left); back = true
      else call('DEL', marker) end
    end
  elseif current == id then
    call('DEL', marker)
  end
  call('HDEL', rec, 'op', 'code', 'other', 'pend', 'pold', 'pdl', 'pop', 'pcode',
             'pother')
  if back and r[7] then  -- the marker given back is known by the claim that wrote it
    call('HSET', rec, 'op', r[7], 'code', r[8], 'other', r[9])
  end
  undone = 1
elseif r[3] == id then
  -- This call, never published, was replaced by one still pending: that one's failed
  -- publish gives the name back to no call.
  call('HDEL', rec, 'pold', 'pdl')
end
call('HSET', rec, 'x', op, 'xr', undone)
if call('PTTL', rec) < tonumber(ARGV[3]) then
  call('PEXPIRE', rec, ARGV[3])
end
return undone
""")

HAND_OVER = LuaScript("marker_hand_over", CALL + _NOW + _REMEMBER
                      + f"local TAKEN_BACK_MS = {TAKEN_BACK_MS}\n" + """
-- KEYS[1] marker, KEYS[2] the replaced calls, KEYS[3] the claim record, KEYS[4] the
-- started calls waiting (the starting call's task id is among them from here to its
-- end), KEYS[5] the replaces taken back that leave the replacing call queued.
-- ARGV[1] the starting call's task id, ARGV[2] '1': remove the marker, ARGV[3] '1':
-- another task id in the marker means this call was replaced, ARGV[4] '1': a running
-- call is a duplicate (until_finished), ARGV[5] ms: a call that goes on is kept among
-- the waiting that long (0: not), until its end (CLEAR) or its retry takes it out,
-- so that its message, should its worker die, comes back as this call: never
-- superseded, and a send of its task id meanwhile a duplicate.  A call found among
-- the waiting (a started call whose message came back after its worker process
-- died) is never superseded: it started before any call that took the marker since.
-- 1: go on; 0: this call was replaced (element 2: by which task id, or 'a later
-- call' when the one that replaced it has started already).
-- A call replaced by one whose publish is not confirmed yet starts all the same: the
-- replace is taken back.  Where a running call is a duplicate (until_finished), the
-- replacing call, if its publish went through, is recorded replaced and never runs;
-- in the other modes it stays queued under the marker and runs after this one, as a
-- call sent just after this one started would.  The replacing call starting first
-- confirms it.
local marker, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local current = call('GET', marker)
local r = call('HMGET', rec, 'pend', 'pold')
local until_ms = tonumber(call('ZSCORE', replaced, id))
local waited = call('ZREM', KEYS[4], id) == 1
local check = ARGV[3] == '1' and not waited
local function go_on()
  local keep = tonumber(ARGV[5])
  if keep > 0 then
    local now = now_ms()
    remember(KEYS[4], id, now + keep, now)
  end
  return {1, ''}
end
if r[1] and r[1] == id then
  call('HDEL', rec, 'pend', 'pold', 'pdl', 'pop', 'pcode', 'pother')
  call('HSET', rec, 'conf', id)
elseif r[1] and r[2] == id and check and ARGV[4] ~= '1' then
  -- The replacing call's confirm reads this even after the record is rewritten (a
  -- later claim) or deleted (that call's own start): it revokes nothing.
  local back = KEYS[5]
  call('HGET', back, r[1])  -- another application's key there stops it before a write
  if call('PTTL', back) < TAKEN_BACK_MS then call('PEXPIRE', back, TAKEN_BACK_MS) end
  call('HSET', back, r[1], 1)
  if call('PTTL', back) < TAKEN_BACK_MS then call('PEXPIRE', back, TAKEN_BACK_MS) end
  call('ZREM', replaced, id)
  call('HDEL', rec, 'pend', 'pold', 'pdl', 'pop', 'pcode', 'pother')
  call('HSET', rec, 'back', r[1])
  return go_on()
elseif r[1] and r[2] == id and check then
  local now = now_ms()
  local left = call('PTTL', marker)
  if left < 0 then left = 0 end
  call('ZREM', replaced, id)
  remember(replaced, r[1], now + math.max(left, 1), now)
  if ARGV[2] == '1' and current == r[1] then call('DEL', marker) end
  call('HDEL', rec, 'op', 'code', 'other', 'pend', 'pold', 'pdl', 'pop', 'pcode',
             'pother')
  call('HSET', rec, 'back', r[1])
  return go_on()
end
if check and until_ms and until_ms > now_ms() then
  return {0, current or 'a later call'}
end
if current == id then
  if ARGV[2] == '1' then call('DEL', marker, rec) end
  return go_on()
end
if current and check then return {0, current} end
return go_on()
""")

REDELIVERY = LuaScript("marker_redelivery", CALL + _NOW + _REMEMBER + """
-- KEYS[1] marker, KEYS[2] the replaced calls, KEYS[3] the claim record, KEYS[4] the
-- retries waiting.  ARGV[1] task id, ARGV[2] ttl (ms), ARGV[3] '1': until_finished.
-- The worker process running ARGV[1] died, and its message will come back: if the
-- call had started (its marker no longer names it, and it was not replaced), it is
-- kept live as its retry would be: in until_finished it takes the marker again,
-- marked as a started call's (never replaced); in the other modes its task id joins
-- the retries waiting (HAND_OVER then never takes its redelivery for superseded).
-- 1: kept; 0: nothing written (it had not started: its marker or its replace says
-- what it is; or another call holds the marker).
local marker, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local current = call('GET', marker)
if current == id then return 0 end
local now = now_ms()
local until_ms = tonumber(call('ZSCORE', replaced, id))
if until_ms and until_ms > now then return 0 end
local ttl = tonumber(ARGV[2])
if ARGV[3] == '1' then
  if current then return 0 end
  call('SET', marker, id, 'PX', ttl)
  call('HSET', rec, 'run', id)
  if call('PTTL', rec) < ttl then call('PEXPIRE', rec, ttl) end
  return 1
end
remember(KEYS[4], id, now + ttl, now)
return 1
""")

CLEAR = LuaScript("marker_clear", CALL + """
-- KEYS[1] marker, KEYS[2] the retries waiting.  ARGV[1] task id: the call ends
-- without running (or ended): remove the marker if it is this call's, and the task id
-- from the retries waiting.  1: the marker was removed.
local current = call('GET', KEYS[1])
call('ZREM', KEYS[2], ARGV[1])
if current == ARGV[1] then
  return call('DEL', KEYS[1])
end
return 0
""")
