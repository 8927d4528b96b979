"""A short run without fault injection, for any lock class: a few holders (threads,
each its own owner) take one lock, write to the fenced counter and release, and record
what they saw in the chaos run's format, so :func:`chaos_check.check` can judge it.

Holds are short-lived (``ttl``) and not renewed, and every few holds a body runs past
its ttl (a slow body: the holder is told at its deadline), so that a lock that frees
another owner's hold, or hands one fence to two holds, shows it within seconds.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import chaos_db
import redis
from chaos_records import Recorder

from celery_dlock import DLockError


def run(out: Path, lock_class: Any, redis_url: str, prefix: str, *,
        holders: int = 3, seconds: float = 4.0, ttl: float = 0.5) -> Path:
    (out / "records").mkdir(parents=True)
    dsn = str(out / "counter.sqlite3")
    chaos_db.create("sqlite", dsn)
    t0 = time.time()
    stop_at = t0 + seconds

    def holder(n: int) -> None:
        rec = Recorder(out / "records" / f"client-{n}.jsonl")

        def record(ev: str, **fields: Any) -> None:
            rec(ev, **fields, pid=n)

        conn = chaos_db.connect("sqlite", dsn)
        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        state: dict[str, Any] = {"acq": 0, "fence": None}

        def on_lost(lock: Any) -> None:
            record("lost", fence=state["fence"], acq=state["acq"],
                   reason=str(lock.lost_reason))

        lock = lock_class(client, "chaos:counter", ttl, prefix=prefix, auto_renew=False,
                          on_lost=on_lost)
        while time.time() < stop_at:
            try:
                if not lock.acquire(blocking=True, timeout=2):
                    continue
            except DLockError:
                continue
            state["acq"] += 1
            acq, fence = state["acq"], lock.fence
            state["fence"] = fence
            record("acquired", who="client", name="chaos:counter", fence=fence, acq=acq)
            slow = (acq + n) % 4 == 0
            for seq in range(3):
                outcome = chaos_db.increment(conn, f"client-{n}.{acq}", seq, fence)
                record("write", fence=fence, acq=acq, seq=seq, ok=outcome["ok"],
                       t0=outcome["t0"], t=outcome["t"])
                time.sleep(ttl * 0.6 if slow else 0.01)
            record("releasing", fence=fence, acq=acq)  # it stops believing here
            try:
                lock.release()
            except DLockError:
                pass
            record("released", fence=fence, acq=acq)
            time.sleep(0.005)
        client.close()
        conn.close()

    threads = [threading.Thread(target=holder, args=(n,)) for n in range(1, holders + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    (out / "driver.jsonl").write_text("")
    meta = {"config": {"seed": 0, "db": "sqlite", "workers": 0, "concurrency": 0,
                       "ttl": ttl, "lock": getattr(lock_class, "__name__", "?")},
            "scheduled": 0, "t0": t0, "end": time.time(),
            "left": {"keys": [], "cleared_after": None},
            "db_read": chaos_db.read("sqlite", dsn)}
    (out / "meta.json").write_text(json.dumps(meta))
    return out
