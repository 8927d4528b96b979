"""The chaos app on a stack already running (``docker compose --profile amqp up``,
docker-compose.yml): send tasks to its workers, wait until each has succeeded, and
judge the records and the fenced counter with :func:`chaos_check.check`, as a chaos
run does.  The faults are yours to inject meanwhile (``docker compose restart
rabbitmq``, ``docker compose kill -s SIGKILL postgres``, ...)::

    python tests/chaos/stack.py --tasks 100 --out /data/run

It reads the chaos app's environment (:data:`chaos_app.ENV`): the broker, the lock's
URL, the counter's database and the records directory the workers write to (shared
with them).  It creates the counter's tables, so start it before sending other tasks
to the queue.  Exit status 1 when a safety figure is not zero, a task was lost, or
not every task succeeded within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

import chaos_app
import chaos_check
import chaos_db
from chaos_records import Recorder, read_all, read_lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=100)
    p.add_argument("--writes", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    db, dsn = os.environ["CHAOS_DB"], os.environ["CHAOS_DSN"]
    records = Path(os.environ["CHAOS_RECORDS"])
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    (out / "records").mkdir(parents=True)
    chaos_db.create(db, dsn)
    t0 = time.time()
    log = Recorder(out / "driver.jsonl")
    sent: set[str] = set()
    for _ in range(args.tasks):
        task_id = uuid.uuid4().hex
        chaos_app.app.send_task("chaos.bump", task_id=task_id, kwargs={
            "key": "counter", "writes": args.writes, "gap": 0.1})
        log("sent", task_id=task_id)
        sent.add(task_id)
    deadline = time.monotonic() + args.timeout
    done: set[str] = set()
    while time.monotonic() < deadline and done != sent:
        time.sleep(1)
        done = {r["task_id"] for r in read_all(records)
                if r["ev"] == "task_end" and r.get("state") == "SUCCESS"
                and r["t"] >= t0} & sent
        print(f"\r{len(done)} of {len(sent)} tasks succeeded", end="", flush=True)
    print()
    # This run's records only (the workers keep appending to their files).
    for path in records.glob("*.jsonl"):
        mine = [r for r in read_lines(path) if r.get("t", 0) >= t0]
        (out / "records" / path.name).write_text(
            "".join(json.dumps(r) + "\n" for r in mine))
    meta = {"config": {"seed": 0, "db": db, "workers": 0, "concurrency": 0,
                       "ttl": float(os.environ.get("CHAOS_TTL", "2")),
                       "lock": os.environ["CHAOS_LOCK_URL"].split(":")[0],
                       "broker": os.environ.get("CHAOS_BROKER", "redis")},
            "scheduled": 0, "t0": t0, "end": time.time(),
            "left": {"keys": [], "cleared_after": None},
            "db_read": chaos_db.read(db, dsn)}
    (out / "meta.json").write_text(json.dumps(meta))
    report = chaos_check.check(out)
    print(chaos_check.markdown(report))
    print(f"\nrun directory: {out}")
    bad = (report["violations"] or report["unfenced_overlaps"]
           or report["stale_writes_accepted"] or report["lost_increments"]
           or done != sent)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
