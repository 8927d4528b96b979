"""The PostgreSQL statements of the lease table and its line, one per operation.

Each is a single autocommitted statement on the server's clock
(``clock_timestamp()``), so it needs no session state and may run through a pooler;
``{t}`` is the lease table, ``{w}`` its line of waiters.  Operation ids (``ops``, the
last :data:`OPS_KEPT`) let a re-sent acquire or release be answered as the first one
was (a re-sent acquire that joined the line only renews the caller's place).  Fences are
``max(last + 1, server microseconds)``: they grow across holders, and after the table
lost its rows (a restore) they restart above every token given before, as long as the
server's clock did not go back (docs/fencing.md).  A semaphore's slot rows
(:mod:`..slots`) step by the limit from the slot's own residue (``%(fstep)s``,
``%(fslot)s``; a lock's row: 1 and 0), so no two slots ever give the same fence.
"""

from __future__ import annotations

from psycopg import sql

__all__ = ["ACQUIRE", "EXTEND", "FORCE_RELEASE", "HEAD", "HOLD", "LEAVE", "LINE",
           "OPS_KEPT", "REENTER", "RELEASE", "RENEW_MANY", "RENEW_SLACK_MS", "SLOTS",
           "STATUS",
           "STATUS_MANY", "WAITING_MANY"]

#: How many operation ids each row keeps.
OPS_KEPT = 64
#: A waiter's place is renewed only when its lease has less than this left to gain
#: (ms): a waiter woken many times in a row writes its row about once a second.
RENEW_SLACK_MS = 1000

_TTL = "%(ttl)s::bigint * interval '1 millisecond'"
_OPS = ("(l.ops || ARRAY[%(op)s]::text[])"
        f"[GREATEST(1, cardinality(l.ops) - {OPS_KEPT - 2}):]")
_KEY = "l.prefix = %(prefix)s AND l.name = %(name)s"
_SAME = "(l.owner = EXCLUDED.owner AND l.expires_at > EXCLUDED.acquired_at)"

_LINE_KEY = "w.prefix = %(prefix)s AND w.name = %(name)s"
#: The first live waiter in line (``c`` is the statement's clock).
_HEAD = (f"SELECT w.owner, w.expires_at FROM {{w}} w, c WHERE {_LINE_KEY} "
         "AND w.expires_at > c.now ORDER BY w.arrived_at, w.owner LIMIT 1")

#: A fresh acquire (or the same owner's re-entry of its live hold): ``fence, count``
#: when granted, no row when refused.  A free (or expired) lock is granted only when
#: no live waiter other than the caller is first in line (``turn``); the same owner's
#: live hold is re-entered whoever waits.  Granted, the caller leaves the line (and
#: the places of waiters whose lease ran out are dropped); refused with a lease
#: (``%(lease)s`` ms > 0), it joins the line, or keeps its place and renews its lease
#: (not more often than :data:`RENEW_SLACK_MS` allows).
#: The insert is tried only when it is the caller's turn or the row exists (its
#: conflict then decides), so a row is never made past a waiter.  Each statement
#: that drops other waiters' places locks the lease row first (the grant's upsert),
#: so such statements never wait on each other in two orders.
ACQUIRE = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now), "
    f"head AS ({_HEAD}), "
    "turn AS (SELECT NOT EXISTS (SELECT 1 FROM head WHERE head.owner <> %(owner)s)"
    " AS ok), "
    "a AS (INSERT INTO {t} AS l (prefix, name, owner, count, fence, acquired_at,"
    " expires_at, ttl_ms, info, ops) "
    "SELECT %(prefix)s, %(name)s, %(owner)s, 1,"
    " floor(extract(epoch FROM c.now) * 1000000)::bigint * %(fstep)s::bigint"
    " + %(fslot)s::bigint, c.now,"
    f" c.now + {_TTL}, %(ttl)s, %(info)s::jsonb, ARRAY[%(op)s]::text[] FROM c, turn "
    "WHERE turn.ok OR EXISTS (SELECT 1 FROM {t} x WHERE x.prefix = %(prefix)s "
    "AND x.name = %(name)s) "
    "ON CONFLICT (prefix, name) DO UPDATE SET "
    f"count = CASE WHEN {_SAME} THEN l.count + "
    "(CASE WHEN %(op)s = ANY(l.ops) THEN 0 ELSE 1 END) ELSE 1 END, "
    f"fence = CASE WHEN {_SAME} THEN l.fence "
    "ELSE GREATEST(l.fence + %(fstep)s::bigint, EXCLUDED.fence) END, "
    f"acquired_at = CASE WHEN {_SAME} THEN l.acquired_at ELSE EXCLUDED.acquired_at END, "
    f"expires_at = CASE WHEN {_SAME} THEN GREATEST(l.expires_at, EXCLUDED.expires_at) "
    "ELSE EXCLUDED.expires_at END, "
    f"ttl_ms = CASE WHEN {_SAME} THEN GREATEST(l.ttl_ms, EXCLUDED.ttl_ms) "
    "ELSE EXCLUDED.ttl_ms END, "
    f"info = CASE WHEN {_SAME} THEN l.info ELSE EXCLUDED.info END, "
    f"owner = EXCLUDED.owner, ops = {_OPS} "
    f"WHERE {_SAME} OR ((l.owner IS NULL OR l.expires_at <= EXCLUDED.acquired_at) "
    "AND (SELECT turn.ok FROM turn)) "
    "RETURNING l.fence, l.count), "
    "gone AS (DELETE FROM {w} w USING a, c WHERE " + _LINE_KEY +
    " AND (w.owner = %(owner)s OR w.expires_at <= c.now) RETURNING 1), "
    "j AS (INSERT INTO {w} AS w (prefix, name, owner, arrived_at, expires_at) "
    "SELECT %(prefix)s, %(name)s, %(owner)s, c.now,"
    " c.now + %(lease)s::bigint * interval '1 millisecond' FROM c "
    "WHERE %(lease)s::bigint > 0 AND NOT EXISTS (SELECT 1 FROM a) "
    "ON CONFLICT (prefix, name, owner) DO UPDATE SET "
    "arrived_at = CASE WHEN w.expires_at > EXCLUDED.arrived_at THEN w.arrived_at "
    "ELSE EXCLUDED.arrived_at END, "
    "expires_at = GREATEST(w.expires_at, EXCLUDED.expires_at) "
    f"WHERE w.expires_at < EXCLUDED.expires_at - interval '{RENEW_SLACK_MS} ms' "
    "RETURNING 1) "
    "SELECT a.fence, a.count FROM a")

#: Leave the line of a lock (a blocked acquire gave up): when the caller was first
#: in line and the lock is free, the waiters are told (the next one is now first).
LEAVE = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now), "
    f"head AS ({_HEAD}), "
    "d AS (DELETE FROM {w} w WHERE " + _LINE_KEY + " AND w.owner = %(owner)s "
    "RETURNING 1) "
    "SELECT pg_notify(%(channel)s, '') FROM head, c "
    "WHERE head.owner = %(owner)s AND EXISTS (SELECT 1 FROM d) "
    f"AND NOT EXISTS (SELECT 1 FROM {{t}} l WHERE {_KEY} AND l.owner IS NOT NULL "
    "AND l.expires_at > c.now)")

#: The first live waiter in line: its owner and the seconds its place has left.
HEAD = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now) "
    "SELECT h.owner, extract(epoch FROM h.expires_at - c.now)::float8 "
    f"FROM ({_HEAD}) h, c")

#: The live waiters of a lock, first in line first: owner, seconds their place has
#: left.
LINE = sql.SQL(
    "SELECT w.owner, extract(epoch FROM w.expires_at - clock_timestamp())::float8 "
    f"FROM {{w}} w WHERE {_LINE_KEY} AND w.expires_at > clock_timestamp() "
    "ORDER BY w.arrived_at, w.owner")

#: How many live waiters each of several names (``%(names)s``) has: name, count.
WAITING_MANY = sql.SQL(
    "SELECT w.name, count(*) FROM {w} w WHERE w.prefix = %(prefix)s "
    "AND w.name = ANY(%(names)s::text[]) AND w.expires_at > clock_timestamp() "
    "GROUP BY w.name")

#: The re-entry of the hold with fence ``%(fence)s`` (NULL: any) of ``owner``:
#: ``fence, count``, or no row when that hold is gone.
REENTER = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now) "
    "UPDATE {t} l SET count = l.count + "
    "(CASE WHEN %(op)s = ANY(l.ops) THEN 0 ELSE 1 END), "
    f"expires_at = GREATEST(l.expires_at, c.now + {_TTL}), ops = {_OPS}, "
    "ttl_ms = GREATEST(l.ttl_ms, %(ttl)s) "
    f"FROM c WHERE {_KEY} AND l.owner = %(owner)s AND l.expires_at > c.now "
    "AND (%(fence)s::bigint IS NULL OR l.fence = %(fence)s::bigint) "
    "RETURNING l.fence, l.count")

#: Undo one acquire of ``owner`` (not already done under ``op``): the new count (0:
#: freed, and the waiters are told), or no row.
RELEASE = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now), "
    "u AS (UPDATE {t} l SET count = l.count - 1, "
    "owner = CASE WHEN l.count <= 1 THEN NULL ELSE l.owner END, "
    "expires_at = CASE WHEN l.count <= 1 THEN '-infinity' ELSE l.expires_at END, "
    f"ops = {_OPS} "
    f"FROM c WHERE {_KEY} AND l.owner = %(owner)s AND l.expires_at > c.now "
    "AND NOT (%(op)s = ANY(l.ops)) RETURNING l.count) "
    "SELECT u.count, CASE WHEN u.count = 0 THEN pg_notify(%(channel)s, '') END FROM u")

#: ``owner`` (NULL while free), whether the hold is live, its count, whether ``op``
#: was applied, its fence and the last force release's note.
STATUS = sql.SQL(
    "SELECT l.owner, l.expires_at > clock_timestamp(), l.count, "
    "coalesce(%(op)s = ANY(l.ops), false), l.fence, l.forced "
    f"FROM {{t}} l WHERE {_KEY}")

#: Make ``owner``'s live hold expire no sooner than ttl from now: one row when held.
EXTEND = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now) "
    f"UPDATE {{t}} l SET expires_at = GREATEST(l.expires_at, c.now + {_TTL}), "
    "ttl_ms = GREATEST(l.ttl_ms, %(ttl)s) "
    f"FROM c WHERE {_KEY} AND l.owner = %(owner)s AND l.expires_at > c.now "
    "RETURNING 1")

_HOLD_COLUMNS = (
    "l.name, l.owner, l.count, l.fence, "
    "extract(epoch FROM clock_timestamp() - l.acquired_at)::float8, "
    "extract(epoch FROM l.expires_at - clock_timestamp())::float8, l.info, "
    "l.ttl_ms")

#: The live hold of a name: name, owner, count, fence, age, ttl left (s), info, and
#: the longest ttl (ms) it was taken or extended with.
HOLD = sql.SQL(
    f"SELECT {_HOLD_COLUMNS} FROM {{t}} l WHERE {_KEY} AND l.owner IS NOT NULL "
    "AND l.expires_at > clock_timestamp()")

#: The live holds of several names (``%(names)s``) of a prefix: the row's name, then
#: HOLD's columns (a semaphore's slots, :mod:`..slots`).
SLOTS = sql.SQL(
    f"SELECT l.name, {_HOLD_COLUMNS} FROM {{t}} l WHERE l.prefix = %(prefix)s "
    "AND l.name = ANY(%(names)s::text[]) AND l.owner IS NOT NULL "
    "AND l.expires_at > clock_timestamp()")

#: Every live hold under a prefix.
HOLDS = sql.SQL(
    f"SELECT {_HOLD_COLUMNS} FROM {{t}} l WHERE l.prefix = %(prefix)s "
    "AND l.owner IS NOT NULL AND l.expires_at > clock_timestamp() ORDER BY l.name")

#: Renew many holds at once (arrays of prefix, name, owner, ttl): the renewed rows.
RENEW_MANY = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now), "
    "v AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[]) "
    "AS v(prefix, name, owner, ttl)) "
    "UPDATE {t} l SET expires_at = GREATEST(l.expires_at, "
    "c.now + v.ttl * interval '1 millisecond') "
    "FROM c, v WHERE l.prefix = v.prefix AND l.name = v.name AND l.owner = v.owner "
    "AND l.expires_at > c.now RETURNING l.prefix, l.name, l.owner")

#: For the holds a renewal missed: prefix, name, owner, live, forced.
STATUS_MANY = sql.SQL(
    "SELECT l.prefix, l.name, l.owner, l.expires_at > clock_timestamp(), l.forced "
    "FROM {t} l, unnest(%s::text[], %s::text[]) AS v(prefix, name) "
    "WHERE l.prefix = v.prefix AND l.name = v.name")

#: Free a name whoever holds it (only the hold with ``fence``, or whose info contains
#: ``cond``): the hold found (name, owner, count, fence, age, ttl, info) and how many
#: rows were freed; the waiters are told.
FORCE_RELEASE = sql.SQL(
    "WITH c AS (SELECT clock_timestamp() AS now), "
    "old AS (SELECT l.*, c.now AS now FROM {t} l, c WHERE " + _KEY +
    " AND l.owner IS NOT NULL AND l.expires_at > c.now FOR UPDATE OF l), "
    "u AS (UPDATE {t} l SET owner = NULL, count = 0, expires_at = '-infinity', "
    "forced = jsonb_build_object('fence', old.fence, 'owner', old.owner, "
    "'by', %(by)s::text, 'reason', %(reason)s::text) "
    "FROM old WHERE l.prefix = old.prefix AND l.name = old.name "
    "AND (%(fence)s::bigint IS NULL OR old.fence = %(fence)s::bigint) "
    "AND old.info @> %(cond)s::jsonb RETURNING 1) "
    "SELECT old.name, old.owner, old.count, old.fence, "
    "extract(epoch FROM old.now - old.acquired_at)::float8, "
    "extract(epoch FROM old.expires_at - old.now)::float8, old.info, "
    "(SELECT count(*) FROM u), "
    "CASE WHEN (SELECT count(*) FROM u) > 0 THEN pg_notify(%(channel)s, '') END "
    "FROM old")
