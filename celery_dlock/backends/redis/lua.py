"""The pieces every script of :mod:`celery_dlock.backends.redis.scripts` is made of:
:class:`LuaScript`, which runs one, and the Lua helpers pasted in front of them (EVAL
has no imports)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from ...core.lock_options import DEFAULT_FENCE_TTL
from .keyspace import HOLD_NUMBERS, LINE_FIELD, SUFFIXES
from .refusals import NOT_A_FENCE, NOT_A_HOLD, REFUSED
from .script_call import plain, run
from .waiters import DOORBELL_TTL_MS, LINE_TTL_MS, WAKE_GRACE_MS

__all__ = ["CALL", "COMMON", "HOLD_SHAPE", "OPS_KEPT", "LuaScript", "trimmed"]

#: How many operation ids a hold remembers (re-sends come right after the original).
OPS_KEPT = 8


class LuaScript:
    """A Lua script identified by its SHA1; runs with ``EVALSHA``, loading on a miss.

    Every call goes through the client's connection pool (:mod:`.script_call`): a
    connection the server closed is replaced before use as the pool does it, the
    client's re-send policy applies, and ``pool.disconnect()``, ``client.close()``
    and the pool's ``max_connections`` govern the lock's calls as they govern the
    application's own.

    Holds no per-client state, so it is safe to share between clients, threads and
    forked processes.
    """

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = trimmed(source)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        if plain(client):  # (script_call.py: the pool's connection, packed once)
            try:
                return run(client, "EVALSHA", self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return run(client, "EVAL", self.source, len(keys), *keys, *args)
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # EVAL caches the script, so the next EVALSHA finds it.
            return client.eval(self.source, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<LuaScript {self.name} {self.sha[:8]}>"


# ``call``: what every script calls Redis with.  A command the connection's user may
# not run (ACL) stops the script with an error that names it (``REFUSED CMD (what
# Redis said)``); Redis's own error says only "this command".  Every other error is
# raised as redis.call raises it (a table on Redis 7+, its text before), so
# WRONGTYPE, READONLY, OOM and the rest keep their codes.  A script stopped by an error
# keeps the writes it made before it: so the scripts try the expiry of a key (on a key
# that does not exist, where it changes nothing) before they create it, and make every
# other write that could be refused before the ones that could not be undone.
CALL = """
local NEW_ERRORS = redis.REDIS_VERSION ~= nil
local function call(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    local e = reply.err
    if string.find(e, 'NOPERM', 1, true) or string.find(e, "can't run", 1, true)
        or string.find(e, "can't access", 1, true)
        or string.find(e, 'no permissions', 1, true) then
      error('""" + REFUSED + """ ' .. string.upper((...)) .. ' (' .. e .. ')', 0)
    end
    if NEW_ERRORS then error(reply) end
    error(e)
  end
  return reply
end
"""

# Whether the key of a lock is one of its holds, pasted in front of the scripts that
# write to it.
HOLD_SHAPE = CALL + f"""
local HOLD_NUMBERS = {{{", ".join(repr(f) for f in HOLD_NUMBERS)}}}
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

-- The error reply for a hash at the lock's key that lacks the field ``missing``.
local function foreign_hash(missing)
  return redis.error_reply('ERR """ + NOT_A_HOLD + """ (no ' .. missing .. ')')
end

-- An error reply when the key ``lock`` holds a hash that is not a hold (another
-- application's), else nil (a hold, or no key).  ``holder``: its owner field, read.
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

-- The hash at ``lock`` read in one call: a table field -> value (empty when there is
-- no key; a hash is never empty) and the flat HGETALL reply.  For a script that needs
-- many of its fields (a re-entry, a contended acquire that returns them all).
local function read_hash(lock)
  local flat = call('HGETALL', lock)
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  return h, flat
end

-- ``not_a_hold`` for a hash read whole by ``read_hash``.
local function not_a_hold_in(h, flat)
  if #flat == 0 then return nil end
  local missing = missing_field(function(f) return h[f] end)
  if not missing then return nil end
  return foreign_hash(missing)
end
"""

# Shared helpers, pasted in front of the scripts that need them (EVAL has no imports).
COMMON = HOLD_SHAPE + f"""
local DOORBELL_TTL = {DOORBELL_TTL_MS}
local WAKE_GRACE = {WAKE_GRACE_MS}
local LINE_TTL = {LINE_TTL_MS}
local OPS_KEPT = {OPS_KEPT}
local FENCE_KEEP = {round(DEFAULT_FENCE_TTL * 1000)}
local LINE_FIELD = '{LINE_FIELD}'
""" + "".join(f"local {name} = '{suffix}'\n" for name, suffix in SUFFIXES.items()) + """
-- The expiry of a key this script just made: a PEXPIRE the user may not run deletes
-- the key first (no key is left without its expiry), then stops the script naming
-- the command.  (Where the server refuses nothing, one command, not a guard before.)
local function expire_new(key, ttl)
  local reply = redis.pcall('PEXPIRE', key, ttl)
  if type(reply) == 'table' and reply.err then
    redis.pcall('DEL', key)
    call('PEXPIRE', key, ttl)
  end
end

-- The decimal digits of ``n``, an integer below 2^53 (a fence, a time in ms), as
-- the scripts store it: ``%d`` prints it exactly (Lua 5.1 casts it to a C long) at
-- about half the server's cost of a float format; ``tostring`` would print a fence
-- in exponent form.
local function digits(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The next fencing token of ``lock``: above every token handed out before, also after
-- a data loss reset the counter: max(counter + 1, the server's clock in microseconds
-- at ``t``, a TIME reply), about 1.7e15: exact in a Lua number, and it fits a signed
-- 64-bit column.  A counter that is not an integer (foreign data) is an error reply:
-- the caller stops there, before it writes anything.  Only reads: the caller stores
-- the token (with an expiry of the hold's ttl + the name's fence ttl: the clock
-- floor keeps tokens increasing once it is gone, docs/fencing.md).  Also returns the
-- counter as found ('0' when there was none).
local function next_fence(lock, t)
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local counter = call('GET', lock .. FENCE_SUFFIX)
  if counter then
    local n = tonumber(counter)
    if not n or n ~= math.floor(n) then
      return redis.error_reply('ERR value is """ + NOT_A_FENCE + """')
    end
    if n + 1 > fence then fence = n + 1 end
  end
  return fence, counter or '0'
end

-- How a hold ended, left in the fence counter so that a re-sent call can tell what
-- its first execution did without a marker key: its owner's final release leaves
-- the counter at the hold's fence + FREED_BY_OWNER, a force release with operation
-- id OP at fence + by_force(OP) (2 + the first 8 bits of OP: a force release with
-- another id rarely passes for it); an expiry leaves it at the fence.  (Never
-- lowered; the next hold still gets max(counter + 1, the clock), which is the clock
-- unless the hold ended within 258 microseconds of its grant.)
local FREED_BY_OWNER = 1

local function by_force(op)
  local tag = op and tonumber(string.sub(op, 1, 2), 16)
  if not tag then return 2 end
  return 2 + tag
end

-- The counter is written with an expiry of ``keep`` ms (a number; nil: FENCE_KEEP)
-- or the one it had when that is later: the counter of a name never outlives its
-- last hold by less than the name's fence ttl, and never lives for ever.
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

-- Whether the hold with fence ``fence`` (a string; '' or nil: unknown) ended ``how``
-- and at most one more hold happened since: the counter still says so (no hash,
-- ``holder`` nil), or the hold there now was granted right after it (its ``prev``
-- field is the counter it found).  A later end moves the counter further.
local function freed(lock, holder, fence, how)
  if not fence or fence == '' or not tonumber(fence) then return false end
  local after = digits(tonumber(fence) + how)
  if holder then return call('HGET', lock, 'prev') == after end
  return call('GET', lock .. FENCE_SUFFIX) == after
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

-- ``ops`` with ``op`` and its result remembered: the last OPS_KEPT.  The caller
-- writes it in the HSET that changes the hold, so that both happen or neither.
local function remembered(ops, op, result)
  ops = (ops or '') .. '|' .. op .. '=' .. result
  local _, n = string.gsub(ops, '|', '')
  while n > OPS_KEPT do
    ops = string.sub(ops, (string.find(ops, '|', 2, true)))
    n = n - 1
  end
  return ops
end

-- Drop waiters whose lease ran out (they died or gave up without saying so).
local function purge(queue, leases, now)
  local stale = call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)
  if #stale > 0 then
    call('ZREM', queue, unpack(stale))
    call('ZREM', leases, unpack(stale))
  end
end

-- Ring a waiter's doorbell (it holds at most one element, which expires unanswered)
-- and give the waiter WAKE_GRACE to take the free lock: one that died in line is
-- dropped from it then, instead of when its whole lease runs out.
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

-- Put ``owner`` in the FIFO line (keeping its place when it is in it already), with a
-- lease of ``lease`` ms from ``now``.  The expiry first (on a line that does not exist
-- yet it changes nothing): a user who may not run PEXPIRE is stopped before the line
-- is written.
local function join_line(queue, leases, owner, now, lease)
  call('PEXPIRE', queue, LINE_TTL)
  local t = call('TIME')
  call('ZADD', queue, 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]), owner)
  call('ZADD', leases, now + lease, owner)
  call('PEXPIRE', queue, LINE_TTL)
  call('PEXPIRE', leases, LINE_TTL)
end

-- Ring the doorbell of the first waiter in line of ``lock``, if any.
local function wake_head(lock, now)
  local queue, leases = lock .. QUEUE_SUFFIX, lock .. LEASES_SUFFIX
  purge(queue, leases, now)
  local head = call('ZRANGE', queue, 0, 0)[1]
  if head then
    ring(lock, head, now)
  end
  return head
end

-- ``owner`` leaves the line of the lock or semaphore at ``key``: its place, its lease
-- and its doorbell.  Returns 1 when it had a place.
local function leave_line(key, owner)
  local was = call('ZREM', key .. QUEUE_SUFFIX, owner)
  call('ZREM', key .. LEASES_SUFFIX, owner)
  call('DEL', bell(key, owner))
  return was
end

-- Not acquired: the caller joins the line when it passed a lease (ARGV[3], ms; 0:
-- it does not wait), and is told the holder's remaining ``pttl`` and ``fields``.
local function refused(queue, leases, owner, now, pttl, fields)
  local lease = tonumber(ARGV[3])
  if lease > 0 then
    join_line(queue, leases, owner, now, lease)
  end
  local reply = {0, pttl, now}
  for i = 1, #fields do reply[i + 3] = fields[i] end
  return reply
end

-- One more acquire of the owner's hold in hash ``key``: its count, the operation
-- remembered with it, and its ttl field raised to ``ttl`` (written as ``ttl_value``)
-- when ``held_ttl`` is shorter; one HSET.
local function count_again(key, ops, op, count, held_ttl, ttl, ttl_value)
  local fields = {'count', count, 'ops', remembered(ops, op, count)}
  if tonumber(held_ttl or 0) < ttl then
    fields[5], fields[6] = 'ttl', ttl_value
  end
  call('HSET', key, unpack(fields))
end
"""


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINES = re.compile(r"local (?:function )?([A-Za-z_][A-Za-z0-9_, ]*)")


def _definitions(prelude: str) -> list[tuple[set[str], str]]:
    """The prelude's top-level definitions in order, as (names defined, text), its
    comment lines left out.  Every top-level line of the preludes is a ``local``
    definition, its ``end`` or a comment."""
    items: list[tuple[set[str], list[str]]] = []
    for line in prelude.splitlines():
        if not line.strip() or line.startswith("--"):
            continue
        if line.startswith("local "):
            found = _DEFINES.match(line)
            assert found is not None, line
            items.append(({n.strip() for n in found.group(1).split(",")}, [line]))
        else:
            items[-1][1].append(line)
    return [(names, "\n".join(lines) + "\n") for names, lines in items]


def trimmed(source: str) -> str:
    """``source`` with only the definitions of its prelude (COMMON, HOLD_SHAPE or
    CALL) that the rest of it uses, directly or through another: Lua runs every
    definition of a script at each call, and the whole prelude cost a short script
    about as much as its own body."""
    for prelude in (COMMON, HOLD_SHAPE, CALL):
        if source.startswith(prelude):
            break
    else:
        return source
    rest = source[len(prelude):]
    used = set(_WORD.findall(rest))
    kept: list[str] = []
    for names, text in reversed(_definitions(prelude)):  # a definition uses earlier ones
        if names & used:
            kept.append(text)
            used |= set(_WORD.findall(text))
    return "".join(reversed(kept)) + rest
