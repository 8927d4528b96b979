"""Per-name rates on Redis (``lock_rate``): GCRA in one script, on the server's clock.

The rule is :mod:`celery_dlock.core.rates`.  ``P:{NAME}:rate`` is a hash beside the
lock's, sharing its hash tag (one Cluster slot): ``tat`` (the theoretical arrival
time), ``interval`` and ``tau`` (``(burst - 1) * interval``), all in server
microseconds, and ``ops``: the last few calls' operation ids with their answers, so a
call the client re-sends (a lost reply, a request the server ran late) takes one
slot, not two; and ``slots``: the slots reserved for parked calls and not yet
claimed, so that each is claimed once.  It expires one second after ``tat``: a name
with no calls lately keeps nothing.  It is a hash with none of a hold's fields, so
``celery dlock ls`` (which lists the lock hashes) never shows it as a lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.errors import BackendUnavailable, LockKeyConflict
from ...core.rates import (
    OPS_KEPT,
    Rate,
    RateDecision,
    RateState,
    TakesByOperation,
    interval_tau,
    rate_state,
)
from .cluster import node_clients
from .hashtag import lock_key, name_of_key, scan_pattern
from .keyspace import UNTOUCHED, decode
from .lua import CALL
from .refusals import acl_refusal
from .scripts import LuaScript

__all__ = ["RATE_SUFFIX", "TAKE", "RedisRates", "rate_key"]

#: The suffix of a name's rate state after its lock's key.
RATE_SUFFIX = ":rate"

# KEYS[1] the rate state.  ARGV[1] interval (us), ARGV[2] tau (us), ARGV[3] the slot
# (us) a parked call comes back for, or '', ARGV[4] the call's operation id (hex).
# Replies {code, wait (us), slot (us)}: 1 start now; 0 parked: wait for the slot,
# reserved; 2 back too early for its slot: wait again (nothing changed).
# Idempotent: the last OPS_KEPT operation ids that changed the state are kept in
# ``ops`` (" id:code:slot" each, newest first); a re-sent call (a lost reply, a request
# the server ran late) finds its id and gets its first answer, ``tat`` unmoved.
# A slot is claimed once: the reserved slots not yet claimed are kept in ``slots``
# (" slot" each); a parked call that comes back for a slot found there takes it out
# and starts; one whose slot is not there (claimed already: the same message
# delivered again after a worker died, or a retry that kept the header) asks afresh,
# as one back more than an interval late does.  Slots past their last moment are
# dropped at every write.  The same rule, in Python, for the stores that decide
# outside the server: celery_dlock.core.rates.gcra_take (keep the two alike).
TAKE = LuaScript("rate_take", CALL + """
local key = KEYS[1]
local interval, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local op = ARGV[4]
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local slot = nil
if ARGV[3] ~= '' then
  slot = tonumber(ARGV[3])
  if now < slot then return {2, slot - now, slot} end
end
local state = call('HMGET', key, 'tat', 'ops', 'slots')
local ops = state[2] or ''
if op ~= '' then
  local code, given = string.match(ops, ' ' .. op .. ':(%d):(%d+)')
  if code then
    given = tonumber(given)
    if code == '1' or given <= now then return {tonumber(code), 0, given} end
    return {0, given - now, given}
  end
end
local pending, mine = '', false
for entry in string.gmatch(state[3] or '', '%d+') do
  local s = tonumber(entry)
  if s == slot then mine = true
  elseif s + interval >= now then pending = pending .. ' ' .. entry end
end
local function remember(code, given)
  local kept, n = ' ' .. op .. ':' .. code .. ':' .. string.format('%.0f', given), 1
  for entry in string.gmatch(ops, ' [^ ]+') do
    if n >= OPS_KEPT then break end
    kept, n = kept .. entry, n + 1
  end
  return kept
end
if mine and now <= slot + interval then
  -- The key lives at least one interval past every slot it reserved: no expiry here.
  call('HSET', key, 'slots', pending, 'ops', remember(1, slot))
  return {1, 0, slot}
end
local tat = tonumber(state[1] or '0')
if tat < now then tat = now end
local at = tat - tau
if at < now then at = now end
local new = tat + interval
local ms = math.ceil((new - now) / 1000) + 1000
local code = 0
if at <= now then code = 1 else pending = pending .. ' ' .. string.format('%.0f', at) end
-- The expiry first (on a missing key it changes nothing): a refused command stops the
-- script before the write.
call('PEXPIRE', key, ms)
call('HSET', key, 'tat', string.format('%.0f', new), 'interval', ARGV[1],
           'tau', ARGV[2], 'ops', remember(code, at), 'slots', pending)
call('PEXPIRE', key, ms)
if code == 1 then return {1, 0, now} end
return {0, at - now, at}
""".replace("OPS_KEPT", str(OPS_KEPT)))

# KEYS[1] the rate state.  Replies {tat, interval, tau, now} (us; empty when none).
READ = LuaScript("rate_read", CALL + """
local tat = call('HGET', KEYS[1], 'tat')
if not tat then return {} end
local t = call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return {tat, call('HGET', KEYS[1], 'interval'), call('HGET', KEYS[1], 'tau'),
        string.format('%.0f', now)}
""")


def rate_key(prefix: str, name: str) -> str:
    """Where the rate state of ``name`` lives."""
    return lock_key(prefix, name) + RATE_SUFFIX


class RedisRates(TakesByOperation):
    """The :class:`~celery_dlock.core.protocol.RateStore` of one Redis (any topology
    one client reaches)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def _run(self, script: LuaScript, key: str, args: tuple[Any, ...], name: str
             ) -> Any:
        try:
            return script(self.client, (key,), args)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise LockKeyConflict(f"{key!r} is not a hash: {UNTOUCHED}",
                                      lock_name=name) from exc
            refused = acl_refusal(exc, "the rate's scripts need it", name)
            if refused is not None:
                raise refused from exc
            raise BackendUnavailable(f"Redis refused the rate of {name!r}: {exc}",
                                     lock_name=name) from exc
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable during {script.name}: {exc}",
                                     lock_name=name) from exc

    def take_op(self, prefix: str, name: str, rate: Rate, slot: int | None,
                op: str) -> RateDecision:
        """:meth:`take` as the call ``op`` (the same op twice takes one slot)."""
        interval, tau = interval_tau(rate)
        reply = self._run(TAKE, rate_key(prefix, name),
                          (interval, tau, "" if slot is None else int(slot), op), name)
        code, wait, given = (int(x) for x in reply)
        if code == 1:
            return RateDecision(True)
        return RateDecision(False, wait / 1_000_000, given)

    def state(self, prefix: str, name: str) -> RateState | None:
        reply = self._run(READ, rate_key(prefix, name), (), name)
        if not reply:
            return None
        tat, interval, tau, now = (int(float(decode(x))) for x in reply)
        return rate_state(tat, interval, tau, now)

    def states(self, prefix: str) -> Iterator[tuple[str, RateState]]:
        """Every name under ``prefix`` with a rate state, each once."""
        seen: set[str] = set()
        try:
            nodes = list(node_clients(self.client))
            keys = [decode(raw) for node in nodes for raw in node.scan_iter(
                match=scan_pattern(prefix) + RATE_SUFFIX, count=500, _type="hash")]
        except (RedisError, UnicodeDecodeError) as exc:
            raise BackendUnavailable(f"Redis unavailable while listing rates: "
                                     f"{exc}") from exc
        for key in keys:
            name = name_of_key(prefix, key[:-len(RATE_SUFFIX)])
            if name is None or name in seen:
                continue
            seen.add(name)
            state = self.state(prefix, name)
            if state is not None:
                yield name, state
