"""Queue markers on Redis: the enqueue-time record that a call of a lock name is
queued (:mod:`celery_dlock.task.markers` says what they mean to the Celery face).

``P:{NAME}:m`` is a string holding the task id of the queued call, with an expiry
(the caller's queue ttl); ``P:{NAME}:mr`` the calls replaced by a later one
(``on_duplicate="replace"``), a sorted set whose scores are the ms (server clock) until
which each one's message could still be delivered (its own marker's time, and at least
the new marker's), so that a replaced call never runs, also when the call that
replaced it has started and a worker restart lost the revoke; ``P:{NAME}:mc`` the
claim record (see :data:`CLAIM`): the reply of the last send's claim, so a re-sent
claim (its reply lost) gets its first answer and not "a duplicate of itself", and a
replace pending until its publish is confirmed (:data:`CONFIRM`) or taken back
(:data:`UNDO`).  They share the lock's hash tag, so one script reads the marker and
the lock's hash together, also on a cluster.  Every script here reads a
key before it writes one, so another application's data at the marker's key
(``WRONGTYPE``) stops it before any write: :class:`LockKeyConflict`.

A send of a task id already queued or running is a duplicate of that call (reply 2
or 3 naming its own id); only a re-queue (``requeue``: a message carrying its own
marker record) takes the marker again.  A replace is done in three steps: the claim
(the marker names the new call at once, the old one is recorded replaced), the
publish, then :data:`CONFIRM`; a failed publish runs :data:`UNDO` instead, which
gives the name back to the old call.  The old call starting in between takes the
replace back itself (:data:`HAND_OVER`): it runs, and the new one never does.

Replies of :data:`CLAIM` (first element):

* ``0`` CLAIMED: the marker now holds this task id, with the ttl given;
* ``1`` OURS: it held this task id already (the call's own re-queue): its
  expiry is moved to the ttl given, nothing else changes;
* ``2`` QUEUED: another call (element 2, its task id) is queued; element 3 is the
  marker's time left in ms;
* ``3`` RUNNING: another call (element 2; empty when the holder is not a task) holds
  the lock (``until_finished``), or this very task id does (every mode); element 3 is
  the hold's time left in ms;
* ``4`` REPLACED: the queued call (element 2) was replaced: the marker now holds this
  task id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.errors import BackendUnavailable, LockKeyConflict
from .cluster import node_clients
from .hashtag import name_of_key, scan_pattern
from .keyspace import MARKER_SUFFIX, LockKeys, decode
from .scripts import LuaScript

__all__ = ["CLAIM", "CLEAR", "CONFIRM", "HAND_OVER", "UNDO", "RedisMarkers"]

# The keys of one lock name's markers, after the marker's own (``P:{NAME}:m``): the
# replaced calls (a sorted set: task id -> the ms, on the server's clock, until which
# its message could still be delivered) and the claim record (a hash: ``op``, ``code``
# and ``other`` of the last send's claim that wrote, so a re-sent claim gets its first
# reply; ``pend``, ``pold`` and ``pdl``: a replace whose publish is not confirmed yet,
# the call it replaced and that call's marker's deadline in ms; ``conf``: the last
# replace confirmed).
REPLACED_SUFFIX = "r"
RECORD_SUFFIX = "c"

# The server's clock in ms, for the scripts that read it.
_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Keep ``id`` in the replaced set until ``deadline`` at least (the set lives as long as
# its longest-lived member); members whose time is past are dropped first.
_REMEMBER = """
local function remember(replaced, id, deadline, now)
  redis.call('ZREMRANGEBYSCORE', replaced, '-inf', now)
  local was = tonumber(redis.call('ZSCORE', replaced, id))
  if not was or was < deadline then redis.call('ZADD', replaced, deadline, id) end
  local keep = deadline - now
  if redis.call('PTTL', replaced) < keep then redis.call('PEXPIRE', replaced, keep) end
end
"""

CLAIM = LuaScript("marker_claim", _NOW + _REMEMBER + """
-- KEYS[1] marker, KEYS[2] the lock's hash, KEYS[3] the replaced calls, KEYS[4] the
-- claim record.  ARGV[1] task id, ARGV[2] ttl (ms),
-- ARGV[3] '1': a running holder (another task holding the lock) is a duplicate too,
-- ARGV[4] '1': replace a queued call, ARGV[5] '1': a re-queue of an accepted call
-- (never a duplicate: it keeps or takes the marker, unless another call's is there),
-- ARGV[6] the send's operation id (a re-send of this claim gets the first reply).
-- A send (not a re-queue) of a task id that is queued (the marker holds it) or running
-- (the lock's holder is it) is a duplicate of that call, in every mode.
local marker, lock, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1]
local requeue = ARGV[5] == '1'
local current = redis.call('GET', marker)
local r = redis.call('HMGET', rec, 'op', 'code', 'other', 'pend', 'pold', 'pdl')
if current == id then
  if requeue then
    -- It was delivered, so its publish went through: a replace it made is confirmed.
    if r[4] == id then redis.call('HDEL', rec, 'pend', 'pold', 'pdl') end
    redis.call('PEXPIRE', marker, ARGV[2])
    return {1, id, 0}
  end
  if r[1] == ARGV[6] then return {tonumber(r[2]), r[3], 0} end  -- a re-sent claim
  return {2, id, redis.call('PTTL', marker)}
end
if not current and not requeue and (ARGV[3] == '1'
    or redis.call('TYPE', lock)['ok'] == 'hash') then
  if redis.call('EXISTS', lock) == 1 then
    local holder = redis.call('HGET', lock, 'task_id')
    if ARGV[3] == '1' or holder == id then
      return {3, holder or '', redis.call('PTTL', lock)}
    end
  end
end
if current then
  if requeue then
    return {2, current, redis.call('PTTL', marker)}
  end
  if ARGV[4] == '1' then
    -- The replaced call's id is kept as long as its message could be delivered (its
    -- marker's time) and as the new marker, so that its start finds it replaced, also
    -- after the new call started and removed the marker, and after a worker restart
    -- lost the revoke.  Until the caller confirms its publish the replace is pending:
    -- a failed publish gives the name back to the call queued before (``pold``).
    redis.call('ZSCORE', replaced, current)
    local now, ttl = now_ms(), tonumber(ARGV[2])
    local left = redis.call('PTTL', marker)
    if left < 0 then left = ttl end
    local pold, pdl = current, now + left
    if r[4] == current and r[5] then pold, pdl = r[5], tonumber(r[6]) end
    remember(replaced, current, now + math.max(left, ttl), now)
    redis.call('SET', marker, id, 'PX', ttl)
    redis.call('DEL', rec)
    redis.call('HSET', rec, 'op', ARGV[6], 'code', 4, 'other', current, 'pend', id,
               'pold', pold, 'pdl', pdl)
    redis.call('PEXPIRE', rec, ttl)
    return {4, current, 0}
  end
  return {2, current, redis.call('PTTL', marker)}
end
redis.call('SET', marker, id, 'PX', ARGV[2])
if not requeue then
  redis.call('DEL', rec)
  redis.call('HSET', rec, 'op', ARGV[6], 'code', 0, 'other', '')
  redis.call('PEXPIRE', rec, ARGV[2])
end
return {0, '', 0}
""")

CONFIRM = LuaScript("marker_confirm", """
-- KEYS[1] the claim record.  ARGV[1] the task id of a replace whose publish went
-- through.  1: the replace stands (the replaced call is to be revoked); 0: it was
-- taken back (the replaced call started first: it runs, this one never does) or
-- replaced in turn.
local r = redis.call('HMGET', KEYS[1], 'pend', 'conf')
if r[2] == ARGV[1] then return 1 end  -- a re-sent confirm
if r[1] ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'pend', 'pold', 'pdl')
redis.call('HSET', KEYS[1], 'conf', ARGV[1])
return 1
""")

UNDO = LuaScript("marker_undo", _NOW + """
-- KEYS[1] marker, KEYS[2] the replaced calls, KEYS[3] the claim record.  ARGV[1] the
-- task id whose publish failed.  Its claim is taken back: a replace gives the name
-- back to the call queued before it (its marker, with the time it had left, and no
-- longer replaced); a plain claim removes its marker.  1: taken back; 0: nothing of
-- it was left (replaced in turn, or expired).
local marker, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local current = redis.call('GET', marker)
local r = redis.call('HMGET', rec, 'pend', 'pold', 'pdl')
redis.call('ZSCORE', replaced, id)
if r[1] == id and r[2] then
  redis.call('ZREM', replaced, r[2])
  redis.call('DEL', rec)
  local left = tonumber(r[3]) - now_ms()
  if current == id then
    if left > 0 then redis.call('SET', marker, r[2], 'PX', left)
    else redis.call('DEL', marker) end
  end
  return 1
end
if current == id then
  redis.call('DEL', marker, rec)
  return 1
end
return 0
""")

HAND_OVER = LuaScript("marker_hand_over", _NOW + _REMEMBER + """
-- KEYS[1] marker, KEYS[2] the replaced calls, KEYS[3] the claim record.  ARGV[1] the
-- starting call's task id, ARGV[2] '1': remove the marker, ARGV[3] '1': another task
-- id in the marker means this call was replaced.
-- 1: go on; 0: this call was replaced (element 2: by which task id, or 'a later
-- call' when the one that replaced it has started already).
-- A call replaced by one whose publish is not confirmed yet starts all the same: the
-- replace is taken back (the replacing call, if its publish went through, is
-- recorded replaced and never runs).  The replacing call starting first confirms it.
local marker, replaced, rec, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local current = redis.call('GET', marker)
local r = redis.call('HMGET', rec, 'pend', 'pold')
local until_ms = tonumber(redis.call('ZSCORE', replaced, id))
if r[1] and r[1] == id then
  redis.call('HDEL', rec, 'pend', 'pold', 'pdl')
  redis.call('HSET', rec, 'conf', id)
elseif r[1] and r[2] == id and ARGV[3] == '1' then
  local now = now_ms()
  local left = redis.call('PTTL', marker)
  if left < 0 then left = 0 end
  redis.call('ZREM', replaced, id)
  remember(replaced, r[1], now + math.max(left, 1), now)
  if ARGV[2] == '1' and current == r[1] then redis.call('DEL', marker) end
  redis.call('DEL', rec)
  return {1, ''}
end
if ARGV[3] == '1' and until_ms and until_ms > now_ms() then
  return {0, current or 'a later call'}
end
if current == id then
  if ARGV[2] == '1' then redis.call('DEL', marker, rec) end
  return {1, ''}
end
if current and ARGV[3] == '1' then return {0, current} end
return {1, ''}
""")

CLEAR = LuaScript("marker_clear", """
-- KEYS[1] marker, ARGV[1] task id: remove the marker if it is this call's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
""")


class RedisMarkers:
    """The queue markers of one Redis (what :class:`~celery_dlock.task.markers.
    MarkerStore` asks of a backend)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @staticmethod
    def key(prefix: str, name: str) -> str:
        return LockKeys.for_name(prefix, name).lock + MARKER_SUFFIX

    def _run(self, script: LuaScript, keys: tuple[str, ...], args: tuple[Any, ...],
             name: str) -> Any:
        try:
            return script(self.client, keys, args)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise LockKeyConflict(
                    f"{keys[0]!r} or {keys[-1]!r} holds another application's data "
                    f"(not a queue marker or a lock): it was left untouched (use another "
                    f"prefix or lock name)", lock_name=name) from exc
            raise BackendUnavailable(f"Redis refused {script.name}: {exc}",
                                     lock_name=name) from exc
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable during {script.name}: {exc}",
                                     lock_name=name) from exc

    def claim(self, prefix: str, name: str, task_id: str, ttl: float, *,
              running_counts: bool, replace: bool, requeue: bool,
              op: str = "") -> tuple[int, str, float | None]:
        """Claim the marker of ``name`` for ``task_id`` (see the module's reply
        codes): ``(code, other task id, its seconds left or None)``.  ``op``: the
        send's operation id (a re-sent claim gets the first reply)."""
        lock = LockKeys.for_name(prefix, name).lock
        marker = lock + MARKER_SUFFIX
        reply = self._run(CLAIM, (marker, lock, marker + REPLACED_SUFFIX,
                                  marker + RECORD_SUFFIX),
                          (task_id, max(1, int(ttl * 1000)), _flag(running_counts),
                           _flag(replace), _flag(requeue), op or task_id), name)
        left = int(reply[2])
        return int(reply[0]), decode(reply[1]), (left / 1000.0 if left > 0 else None)

    def confirm(self, prefix: str, name: str, task_id: str) -> bool:
        """The publish of ``task_id``, which replaced a queued call, went through:
        True when the replace stands (the replaced call is to be revoked)."""
        marker = self.key(prefix, name)
        return bool(self._run(CONFIRM, (marker + RECORD_SUFFIX,), (task_id,), name))

    def undo(self, prefix: str, name: str, task_id: str) -> bool:
        """The publish of ``task_id`` failed: take its claim back (a replace gives
        the name back to the call it replaced)."""
        marker = self.key(prefix, name)
        return bool(self._run(UNDO, (marker, marker + REPLACED_SUFFIX,
                                     marker + RECORD_SUFFIX), (task_id,), name))

    def hand_over(self, prefix: str, name: str, task_id: str, *, remove: bool,
                  replaced_check: bool) -> str | None:
        """At the start of ``task_id``'s run: remove its marker (``remove``); the task
        id that replaced it, or None to go on."""
        marker = self.key(prefix, name)
        reply = self._run(HAND_OVER, (marker, marker + REPLACED_SUFFIX,
                                      marker + RECORD_SUFFIX),
                          (task_id, _flag(remove), _flag(replaced_check)), name)
        return None if int(reply[0]) == 1 else decode(reply[1])

    def clear(self, prefix: str, name: str, task_id: str) -> bool:
        """Remove the marker of ``name`` if it is ``task_id``'s."""
        return bool(self._run(CLEAR, (self.key(prefix, name),), (task_id,), name))

    def read(self, prefix: str, name: str) -> tuple[str, float | None] | None:
        """The marker of ``name``: ``(task id, seconds left)``, or None."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.get(self.key(prefix, name))
                pipe.pttl(self.key(prefix, name))
                value, pttl = pipe.execute(raise_on_error=False)
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable reading the marker of "
                                     f"{name!r}: {exc}", lock_name=name) from exc
        if value is None or isinstance(value, Exception):
            return None  # none, or another application's data at its key
        try:
            task_id = decode(value)
        except UnicodeDecodeError:
            return None
        left = pttl if isinstance(pttl, int) else -1
        return task_id, (left / 1000.0 if left > 0 else None)

    def queued(self, prefix: str, *,
               page_size: int = 500) -> Iterator[tuple[str, str, float | None]]:
        """Every marker under ``prefix``: ``(lock name, task id, seconds left)``.

        ``SCAN ... TYPE string`` on each master (a cluster's in turn), a page of keys
        read with one pipeline (``GET`` and ``PTTL`` per key).  A key that is not
        UTF-8, or holds a value that is not, was not written here: it is skipped, as
        is a marker that expires between the scan and the read."""
        seen: set[str] = set()
        try:
            for node in node_clients(self.client):
                page: list[tuple[str, str]] = []
                for raw in node.scan_iter(match=scan_pattern(prefix) + MARKER_SUFFIX,
                                          count=page_size, _type="string"):
                    try:
                        key = decode(raw)
                    except UnicodeDecodeError:
                        continue
                    name = name_of_key(prefix, key[:-len(MARKER_SUFFIX)])
                    if name is None or key in seen:
                        continue
                    seen.add(key)
                    page.append((key, name))
                    if len(page) >= page_size:
                        yield from _read_markers(node, page)
                        page = []
                if page:
                    yield from _read_markers(node, page)
        except ResponseError as exc:
            raise BackendUnavailable(f"Redis refused reading markers: {exc}") from exc
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable reading markers: {exc}") from exc


def _read_markers(node: Any, page: list[tuple[str, str]]
                  ) -> Iterator[tuple[str, str, float | None]]:
    with node.pipeline(transaction=False) as pipe:
        for key, _ in page:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
    for i, (_, name) in enumerate(page):
        value, pttl = replies[2 * i], replies[2 * i + 1]
        if value is None or isinstance(value, Exception):
            continue  # gone since the scan, or another type by now
        try:
            task_id = decode(value)
        except UnicodeDecodeError:
            continue
        left = pttl if isinstance(pttl, int) else -1
        yield name, task_id, (left / 1000.0 if left > 0 else None)


def _flag(value: bool) -> str:
    return "1" if value else "0"
