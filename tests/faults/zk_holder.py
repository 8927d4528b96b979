"""A holder process for the ZooKeeper fault tests, driven by JSON lines on stdin.

It takes a real ``ZooKeeperLock`` and answers ``{"op": ...}`` lines:

* ``acquire``: ``{"held": bool, "fence": int}``;
* ``write``: a fenced write of its fence to the SQLite row ``stock``
  (``{"ok": true}`` or ``{"stale": true, "found": ...}``), and whether its lock was
  told it is lost (``lost``, ``told_at``: this process's monotonic clock);
* ``status``: ``lost`` and ``told_at`` alone;
* ``exit``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from typing import Any

from celery_dlock.backends.zookeeper import ZooKeeperLock
from celery_dlock.fencing import StaleFence, fenced_update


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--db", required=True)
    args = parser.parse_args()
    told: list[float] = []
    lock = ZooKeeperLock(args.url, args.name, args.ttl, owner="child",
                         on_lost=lambda _lock: told.append(time.monotonic()))
    conn = sqlite3.connect(args.db, timeout=30)

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True})
    fence = None
    for line in sys.stdin:
        op = json.loads(line)["op"]
        if op == "acquire":
            held = lock.acquire(timeout=30)
            fence = lock.fence
            reply({"held": held, "fence": fence})
        elif op == "write":
            out: dict[str, Any] = {"lost": lock.lost, "told_at": told[:1]}
            try:
                fenced_update(conn, "stock", {"sku": "a"}, fence, {"units": 1})
                conn.commit()
                out["ok"] = True
            except StaleFence as exc:
                conn.rollback()
                out.update(stale=True, found=exc.found)
            reply(out)
        elif op == "status":
            reply({"lost": lock.lost, "told_at": told[:1]})
        elif op == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
