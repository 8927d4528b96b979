"""The MySQL/MariaDB statements of the lease table (PyMySQL's ``%(name)s``
parameters; ``{t}`` is the quoted table).

Every time is the server's: ``UTC_TIMESTAMP(6)`` (one value per statement, whatever
the session's time zone).  The rows are keyed by ``lock_id``
(:func:`~.schema.lock_id`).  Operation ids (``ops``, a comma-separated list of the
last :data:`OPS_KEPT`) let a re-sent acquire or release be answered as the first.
The statements that decide (acquire, re-entry, release, force release) run in one
short transaction after :data:`ROW` locked the row (:mod:`.lock`): MySQL has no
``RETURNING`` and evaluates an ``UPDATE``'s assignments left to right, so one
statement cannot both decide and report; the decision is made on the locked row, the
write is one statement.  Extend and renewal only ever move the expiry later and are
one autocommitted ``UPDATE`` each.  ``{w}`` is the line of waiters' table: an acquire
refused joins it (:data:`JOIN`), one granted leaves it (:data:`LEFT`), in the
acquire's transaction, after the lease row was locked.
"""

from __future__ import annotations

__all__ = ["EXTEND", "FORCE_FREE", "FORCE_ROW", "HEAD", "HOLD", "HOLDS", "INSERT",
           "JOIN", "LEAVE", "LEFT", "LINE", "OPS_KEPT", "REENTER", "RELEASE", "ROW",
           "STATUS", "TAKE", "renew_many", "slots", "status_many", "waiting_many"]

#: How many operation ids each row keeps.
OPS_KEPT = 64

NOW = "UTC_TIMESTAMP(6)"
_EPOCH_US = f"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {NOW})"
_EXPIRY = f"{NOW} + INTERVAL %(ttl_us)s MICROSECOND"
_OPS = f"SUBSTRING_INDEX(CONCAT_WS(',', NULLIF(ops, ''), %(op)s), ',', -{OPS_KEPT})"
_APPLIED = "(%(op)s <> '' AND FIND_IN_SET(%(op)s, ops) > 0)"
_LIVE = f"owner IS NOT NULL AND expires_at > {NOW}"

#: The row, locked: owner, count, fence, live, whether ``op`` was applied, and the
#: server's time in microseconds since the epoch (the floor of a fresh fence).
ROW = (f"SELECT owner, `count`, fence, expires_at > {NOW}, {_APPLIED}, {_EPOCH_US} "
       "FROM {t} WHERE lock_id = %(id)s FOR UPDATE")

#: The first hold of a name (its row did not exist): fence = the server's time.
INSERT = ("INSERT INTO {t} (lock_id, prefix, name, owner, `count`, fence, acquired_at, "
          "expires_at, ttl_ms, info, ops) VALUES (%(id)s, %(prefix)s, %(name)s, "
          f"%(owner)s, 1, {_EPOCH_US} * %(fstep)s + %(fslot)s, {NOW}, {_EXPIRY}, "
          "%(ttl)s, %(info)s, %(op)s)")

#: A fresh hold on an existing row (free, expired, or another hold of the caller's
#: that lapsed), with the fence the transaction chose.
TAKE = (f"UPDATE {{t}} SET owner = %(owner)s, `count` = 1, fence = %(fence)s, "
        f"acquired_at = {NOW}, expires_at = {_EXPIRY}, ttl_ms = %(ttl)s, "
        f"info = %(info)s, ops = {_OPS} WHERE lock_id = %(id)s")

#: A re-entry (``add``: 1, or 0 for a re-sent one): never shortens the hold.
REENTER = (f"UPDATE {{t}} SET `count` = `count` + %(add)s, "
           f"expires_at = GREATEST(expires_at, {_EXPIRY}), "
           f"ttl_ms = GREATEST(ttl_ms, %(ttl)s), ops = {_OPS} WHERE lock_id = %(id)s")

#: One release: the new ``count`` (0 frees the row; its fence stays).
RELEASE = ("UPDATE {t} SET `count` = %(count)s, "
           "owner = IF(%(count)s = 0, NULL, owner), "
           "expires_at = IF(%(count)s = 0, '1970-01-01 00:00:00', expires_at), "
           f"ops = {_OPS} WHERE lock_id = %(id)s")

#: Make ``owner``'s live hold expire no sooner than ttl from now (matched rows: 1
#: when held).
EXTEND = (f"UPDATE {{t}} SET expires_at = GREATEST(expires_at, {_EXPIRY}), "
          "ttl_ms = GREATEST(ttl_ms, %(ttl)s) "
          f"WHERE lock_id = %(id)s AND owner = %(owner)s AND expires_at > {NOW}")

#: owner, live, whether ``op`` was applied, the last force release's note.
STATUS = (f"SELECT owner, expires_at > {NOW}, {_APPLIED}, forced "
          "FROM {t} WHERE lock_id = %(id)s")

_HOLD_COLUMNS = (
    "name, owner, `count`, fence, "
    f"TIMESTAMPDIFF(MICROSECOND, acquired_at, {NOW}) / 1000000, "
    f"TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) / 1000000, info, ttl_ms")

#: The live hold of a name: name, owner, count, fence, age, ttl left (s), info, and
#: the longest ttl (ms) it was taken or extended with.
HOLD = f"SELECT {_HOLD_COLUMNS} FROM {{t}} WHERE lock_id = %(id)s AND {_LIVE}"

def slots(table: str, count: int) -> str:
    """The live holds of ``count`` rows (parameters: their lock_ids): the lock_id,
    then HOLD's columns (a semaphore's slots, :mod:`..slots`)."""
    ids = ", ".join(["%s"] * count)
    return (f"SELECT lock_id, {_HOLD_COLUMNS} FROM {table} WHERE lock_id IN ({ids}) "
            f"AND {_LIVE}")


#: Every live hold under a prefix.
HOLDS = (f"SELECT {_HOLD_COLUMNS} FROM {{t}} WHERE prefix = %(prefix)s AND {_LIVE} "
         "ORDER BY name")

#: The live hold, locked, for a force release (HOLD's columns).
FORCE_ROW = f"{HOLD} FOR UPDATE"

#: Free the row whoever holds it, leaving who did it and why.
FORCE_FREE = ("UPDATE {t} SET owner = NULL, `count` = 0, "
              "expires_at = '1970-01-01 00:00:00', forced = %(forced)s "
              "WHERE lock_id = %(id)s")


_LINE_LIVE = f"lock_id = %(id)s AND expires_at > {NOW}"
_LEASE = f"{NOW} + INTERVAL %(lease_us)s MICROSECOND"

#: The first live waiter in line: owner, the seconds its place has left.
HEAD = (f"SELECT owner, TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) / 1000000 "
        f"FROM {{w}} WHERE {_LINE_LIVE} ORDER BY arrived_at, owner_id LIMIT 1")

#: How many live waiters stand before ``owner_id`` in line (0: it is first).
AHEAD = (f"SELECT COUNT(*) FROM {{w}} AS o JOIN {{w}} AS me "
         f"ON me.lock_id = o.lock_id AND me.owner_id = %(owner_id)s "
         f"WHERE o.lock_id = %(id)s AND o.expires_at > {NOW} "
         f"AND (o.arrived_at < me.arrived_at "
         f"OR (o.arrived_at = me.arrived_at AND o.owner_id < me.owner_id))")

#: The live waiters, first in line first: owner.
LINE = f"SELECT owner FROM {{w}} WHERE {_LINE_LIVE} ORDER BY arrived_at, owner_id"

#: Join the line, or keep one's place in it and renew its lease (a place that lapsed
#: is taken again at the back).  The assignments run left to right: ``arrived_at``
#: reads the old ``expires_at``.  A lease with less than a second to gain is left as
#: it is (no write): a waiter polling twice a second writes its row about once.
JOIN = ("INSERT INTO {w} (lock_id, owner_id, owner, arrived_at, expires_at) VALUES "
        f"(%(id)s, %(owner_id)s, %(owner)s, {NOW}, {_LEASE}) ON DUPLICATE KEY UPDATE "
        f"arrived_at = IF(expires_at > {NOW}, arrived_at, {NOW}), "
        f"expires_at = IF(expires_at > {_LEASE} - INTERVAL 1 SECOND, expires_at, "
        f"{_LEASE})")

#: A granted acquirer leaves the line, and the places that lapsed are dropped.
LEFT = (f"DELETE FROM {{w}} WHERE lock_id = %(id)s "
        f"AND (owner_id = %(owner_id)s OR expires_at <= {NOW})")

#: A waiter that gave up leaves the line.
LEAVE = "DELETE FROM {w} WHERE lock_id = %(id)s AND owner_id = %(owner_id)s"


def waiting_many(table: str, count: int) -> str:
    """How many live waiters each of ``count`` locks has (parameters: their
    lock_ids): lock_id, count."""
    ids = ", ".join(["%s"] * count)
    return (f"SELECT lock_id, COUNT(*) FROM {table} WHERE lock_id IN ({ids}) "
            f"AND expires_at > {NOW} GROUP BY lock_id")


def renew_many(table: str, count: int) -> str:
    """Renew ``count`` holds in one statement; its parameters: ``(lock_id, ttl_us)``
    per hold, then ``(lock_id, owner)`` per hold.  Matched rows: the holds renewed."""
    cases = " ".join(["WHEN %s THEN %s"] * count)
    pairs = ", ".join(["(%s, %s)"] * count)
    return (f"UPDATE {table} SET expires_at = GREATEST(expires_at, {NOW} + INTERVAL "
            f"(CASE lock_id {cases} END) MICROSECOND) "
            f"WHERE (lock_id, owner) IN ({pairs}) AND expires_at > {NOW}")


def status_many(table: str, count: int) -> str:
    """For the holds a renewal missed: lock_id, owner, live, forced."""
    ids = ", ".join(["%s"] * count)
    return (f"SELECT lock_id, owner, expires_at > {NOW}, forced FROM {table} "
            f"WHERE lock_id IN ({ids})")
