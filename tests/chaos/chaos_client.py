"""The standalone-lock client of a chaos run: a plain process (no Celery) that takes
the same lock as the tasks directly (:class:`~celery_dlock.RedisLock`, or the lock
:func:`~celery_dlock.lock_from_url` gives for a PostgreSQL or ZooKeeper URL), makes a few
fenced increments per hold and releases; it records like the workers do
(:mod:`chaos_app`).  It keeps writing after it is told of a loss: the database has to
refuse it.  Runs until killed (the driver restarts it after a SIGKILL)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import chaos_db
import redis
from chaos_records import Recorder

from celery_dlock import DLockError, RedisLock, lock_from_url


def release(lock: Any, rec: Recorder, fence: int | None, acq: int) -> None:
    """Release the hold; when the server did not confirm, try again until it does or the
    hold is found lost (a lock object that still counts a hold keeps renewing it)."""
    deadline = time.monotonic() + 120
    error = None
    while lock.depth > 0 and time.monotonic() < deadline:
        try:
            lock.release()
        except (DLockError, redis.RedisError) as exc:
            error = type(exc).__name__
            if lock.depth > 0:
                time.sleep(0.1)
    rec("released", fence=fence, acq=acq, error=error, left=lock.depth)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lock-url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--dsn", required=True)
    p.add_argument("--records", required=True)
    p.add_argument("--writes", type=int, default=4)
    p.add_argument("--gap", type=float, default=0.1)
    args = p.parse_args()

    rec = Recorder(Path(args.records) / f"client-{os.getpid()}.jsonl")
    conn = chaos_db.connect(args.db, args.dsn)
    holding: dict[str, int | None] = {"fence": None, "acq": 0}

    def on_lost(lock: Any) -> None:
        rec("lost", fence=holding["fence"], acq=holding["acq"],
            reason=str(lock.lost_reason))

    lock: Any
    if args.lock_url.startswith("redis://"):
        client = redis.Redis.from_url(args.lock_url, socket_timeout=1,
                                      socket_connect_timeout=1)
        lock = RedisLock(client, args.name, ttl=args.ttl, prefix=args.prefix,
                         on_lost=on_lost)
    else:
        lock = lock_from_url(args.lock_url, args.name, args.ttl, prefix=args.prefix,
                             on_lost=on_lost)
    rec("child_up")
    while True:
        try:
            if not lock.acquire(blocking=True, timeout=10):
                continue
        except (DLockError, redis.RedisError) as exc:
            rec("error", where="acquire", error=type(exc).__name__)
            time.sleep(0.2)
            continue
        fence = holding["fence"] = lock.fence
        acq = holding["acq"] = (holding["acq"] or 0) + 1
        rec("acquired", who="client", name=lock.name, fence=fence, acq=acq)
        for seq in range(args.writes):
            out = chaos_db.increment(conn, f"client-{os.getpid()}.{acq}", seq, fence)
            rec("write", fence=fence, acq=acq, seq=seq, ok=out["ok"], t0=out["t0"],
                t=out["t"], found=out.get("found"), value=out.get("value"))
            time.sleep(args.gap)
        rec("releasing", fence=fence, acq=acq)  # the end of its hold, as it sees it
        release(lock, rec, fence, acq)
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
