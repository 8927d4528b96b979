"""A writer process for the fenced-write tests: takes a real ``RedisLock`` (or, with
``--lock-url``, the lock that URL names: ``lock_from_url``) and
increments a fenced counter row in SQLite, PostgreSQL or MariaDB, as the test tells it.

Commands arrive on stdin, one JSON object a line; each gets one JSON line back:

``{"op": "acquire"}``            take the lock (waiting up to 30 s) -> ``{"fence": N}``
``{"op": "write"}``              one fenced increment with the current hold's fence
                                 -> ``{"ok": true, ...}`` or ``{"stale": true, ...}``
``{"op": "release"}``            -> ``{"released": true}`` or ``{"error": "..."}``
``{"op": "loop", "seconds": S}`` acquire, write, release until S seconds have passed
                                 -> ``{"accepted": n, "stale": m, "fences": [...]}``
``{"op": "exit"}``

A write is one transaction: claim the row with the fence, read the counter, write
counter + 1 with the fence, append ``(who, fence, value)`` to the log table, commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import redis

from celery_dlock import DLockError, RedisLock, lock_from_url
from celery_dlock.fencing import StaleFence, claim, fenced_update

THINK = 0.005  # seconds between reading the counter and writing it


def connect(kind: str, dsn: str) -> Any:
    if kind == "sqlite":
        return sqlite3.connect(dsn, timeout=60)
    if kind == "mariadb":
        import pymysql

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from mariadb_server import connect_args

        return pymysql.connect(**connect_args(dsn), connect_timeout=10)
    import psycopg

    return psycopg.connect(dsn, connect_timeout=10)


def write(conn: Any, table: str, who: str, fence: int | None) -> dict[str, Any]:
    key = {"name": "counter"}
    try:
        claim(conn, table, key, fence)
        cur = conn.cursor()
        cur.execute(f"SELECT value FROM {table} WHERE name = 'counter'")
        value = int(cur.fetchone()[0]) + 1
        time.sleep(THINK)
        fenced_update(conn, table, key, fence, {"value": value})
        log = "%s" if not isinstance(conn, sqlite3.Connection) else "?"
        cur.execute(f"INSERT INTO {table}_log (who, fence, value) "
                    f"VALUES ({log}, {log}, {log})", (who, fence, value))
        cur.close()
        conn.commit()
    except StaleFence as exc:
        conn.rollback()
        return {"stale": True, "fence": exc.fence, "found": exc.found,
                "error": str(exc)}
    return {"ok": True, "fence": fence, "value": value}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--no-renew", action="store_true")
    parser.add_argument("--lock-url", default=None)
    parser.add_argument("--db", choices=("sqlite", "postgresql", "mariadb"),
                        required=True)
    # the database's path or URL; else $DLOCK_FENCING_DSN (a URL with a password)
    parser.add_argument("--dsn", default=os.environ.get("DLOCK_FENCING_DSN"))
    parser.add_argument("--table", required=True)
    parser.add_argument("--who", required=True)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn or $DLOCK_FENCING_DSN is required")

    lock: Any
    if args.lock_url:
        lock = lock_from_url(args.lock_url, args.name, ttl=args.ttl, prefix=args.prefix,
                             auto_renew=not args.no_renew)
    else:
        client = redis.Redis.from_url(args.redis_url, socket_timeout=10)
        lock = RedisLock(client, args.name, ttl=args.ttl, prefix=args.prefix,
                         auto_renew=not args.no_renew)
    conn = connect(args.db, args.dsn)

    def reply(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "acquire":
            held = lock.acquire(blocking=True, timeout=30)
            reply({"held": held, "fence": lock.fence})
        elif op == "write":
            reply(write(conn, args.table, args.who, lock.fence))
        elif op == "release":
            try:
                lock.release()
                reply({"released": True})
            except Exception as exc:
                reply({"released": False, "error": f"{type(exc).__name__}: {exc}"})
        elif op == "loop":
            accepted, stale, lost, fences = 0, 0, 0, []
            deadline = time.monotonic() + float(cmd["seconds"])
            while time.monotonic() < deadline:
                if not lock.acquire(blocking=True, timeout=30):
                    continue
                try:
                    outcome = write(conn, args.table, args.who, lock.fence)
                finally:
                    try:
                        lock.release()
                    except DLockError:  # lost meanwhile: the write said so already
                        lost += 1
                accepted += bool(outcome.get("ok"))
                stale += bool(outcome.get("stale"))
                fences.append(outcome["fence"])
            reply({"accepted": accepted, "stale": stale, "lost": lost,
                   "fences": fences})
        elif op == "exit":
            break
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
