"""The protected resource of the chaos runs: a counter row and a log table in SQLite
or PostgreSQL, written only through ``celery_dlock.fencing``.

One write is one transaction: :func:`~celery_dlock.fencing.claim` the counter row with
the hold's fence (from then on an older holder can no longer write it), read the value,
write value + 1 with the fence, append ``(who, seq, fence, value)`` to the log, commit.
The counter row is locked by the claim until the commit, so the log's ids are in commit
order: the checker reads the accepted writes in the order the database took them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from celery_dlock.fencing import StaleFence, claim, fenced_update

TABLE = "chaos_counter"
LOG = "chaos_log"
KEY = {"name": "counter"}

#: Seconds between reading the counter and writing it back: a window in which a
#: second writer without the lock would lose an increment.
THINK = 0.003


def connect(kind: str, dsn: str) -> Any:
    if kind == "sqlite":
        return sqlite3.connect(dsn, timeout=120)
    import psycopg

    return psycopg.connect(dsn, connect_timeout=10)


def create(kind: str, dsn: str) -> None:
    """Create both tables and the counter row (value 0, never fenced)."""
    conn = connect(kind, dsn)
    serial = ("INTEGER PRIMARY KEY AUTOINCREMENT" if kind == "sqlite"
              else "BIGSERIAL PRIMARY KEY")
    cur = conn.cursor()
    for stmt in (f"DROP TABLE IF EXISTS {LOG}", f"DROP TABLE IF EXISTS {TABLE}",
                 f"CREATE TABLE {TABLE} (name TEXT PRIMARY KEY, value BIGINT NOT NULL, "
                 f"last_fence BIGINT NOT NULL DEFAULT 0)",
                 f"CREATE TABLE {LOG} (id {serial}, who TEXT NOT NULL, "
                 f"seq BIGINT NOT NULL, fence BIGINT NOT NULL, value BIGINT NOT NULL)",
                 f"INSERT INTO {TABLE} (name, value) VALUES ('counter', 0)"):
        cur.execute(stmt)
    cur.close()
    conn.commit()
    conn.close()


def increment(conn: Any, who: str, seq: int, fence: int | None) -> dict[str, Any]:
    """One fenced increment; what happened, for the writer's record."""
    mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    t0 = time.time()
    try:
        claim(conn, TABLE, KEY, fence)
        cur = conn.cursor()
        cur.execute(f"SELECT value FROM {TABLE} WHERE name = 'counter'")
        value = int(cur.fetchone()[0]) + 1
        time.sleep(THINK)
        fenced_update(conn, TABLE, KEY, fence, {"value": value})
        cur.execute(f"INSERT INTO {LOG} (who, seq, fence, value) "
                    f"VALUES ({mark}, {mark}, {mark}, {mark})", (who, seq, fence, value))
        cur.close()
        conn.commit()
    except StaleFence as exc:
        conn.rollback()
        return {"ok": False, "fence": fence, "found": exc.found, "t0": t0,
                "t": time.time()}
    return {"ok": True, "fence": fence, "value": value, "t0": t0, "t": time.time()}


def read(kind: str, dsn: str) -> tuple[int, int, list[tuple[int, str, int, int, int]]]:
    """(counter value, its last_fence, the log rows in id order)."""
    conn = connect(kind, dsn)
    cur = conn.cursor()
    cur.execute(f"SELECT value, last_fence FROM {TABLE} WHERE name = 'counter'")
    value, last = cur.fetchone()
    cur.execute(f"SELECT id, who, seq, fence, value FROM {LOG} ORDER BY id")
    rows = [tuple(r) for r in cur.fetchall()]
    cur.close()
    conn.close()
    return int(value), int(last), rows
