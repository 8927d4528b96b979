"""Re-entry: nested locked calls inside one run share the hold; a redelivery does not.

``transfer`` locks ``account:{account}``.  While it holds the lock it calls ``audit``,
another locked task with the *same* key, twice: directly (``audit(...)``) and eagerly
(``audit.apply(...)``); ``audit`` in turn opens ``with RedisLock(client,
"account:..."):`` in its body.  None of them waits for the lock its caller holds: all
of them run in the same execution attempt, which is one owner, so each re-enters and
the hold count in Redis goes 1 -> 2 -> 3 and back.

Then the same message is delivered again while the first attempt still runs (what the
broker does after a visibility timeout or a lost connection, with ``acks_late``): same
task id, another worker process.  That is a *different* attempt, hence a different
owner: it contends instead of re-entering, and finding its own task id holding the lock
it is a duplicate (``lock_contended`` with policy ``"duplicate"``): it never runs the
body and writes no state, whatever ``on_contention`` says.

One command, on a throwaway redis-server and one prefork worker with 2 processes::

    python examples/nested_reentry.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a file, python examples/nested_reentry.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_dlock import LockedTask, RedisLock, signals
from celery_dlock.backends.redis.keyspace import LockKeys
from celery_dlock.core.owner import current_owner
from examples.celery_app import app, data, use_redis, wait_for_signal

__all__ = ["app", "audit", "main", "transfer"]


def _trace(account: str, depth: int, what: str, lock: RedisLock) -> None:
    holder = lock.holder()
    data().rpush(f"nested:{account}:trace", json.dumps({
        "depth": depth, "what": what, "count": holder.count if holder else 0,
        "owner": holder.owner if holder else None, "pid": os.getpid()}))


@app.task(name="examples.nested_reentry.audit", base=LockedTask, bind=True,
          lock_key="account:{account}", lock_ttl=10, on_contention="raise")
def audit(self: Any, account: str, how: str) -> None:
    _trace(account, 2, f"audit, called {how}", self.lock)
    # The plain lock of the core, same name: the same owner, so it re-enters too.
    with RedisLock(data(), f"account:{account}", ttl=10) as lock:
        _trace(account, 3, "RedisLock in audit's body", lock)


@app.task(name="examples.nested_reentry.transfer", base=LockedTask, bind=True,
          lock_key="account:{account}", lock_ttl=10, on_contention="skip")
def transfer(self: Any, account: str) -> str:
    _trace(account, 1, "transfer, run by a worker", self.lock)
    audit(account, "directly")                             # re-enters: count 2, 3
    audit.apply(args=(account, "with .apply()"), throw=True)  # re-enters: 2, 3
    _trace(account, 1, "transfer, after the nested calls", self.lock)
    r = data()
    r.rpush(f"nested:{account}:holding", "1")   # the runner redelivers us now
    r.blpop([f"nested:{account}:go"], timeout=20)
    return "transferred"


@signals.lock_contended.connect
def _record_contention(sender: Any, name: str, policy: str, holder: Any,
                       task_id: str, **_: Any) -> None:
    if getattr(sender, "name", None) == transfer.name:
        data().rpush(f"nested:{name.split(':', 1)[1]}:contended", json.dumps({
            "task_id": task_id, "policy": policy, "pid": os.getpid(),
            "owner": current_owner(),  # this (redelivered) attempt's owner
            "holder_task_id": holder.task_id if holder else None,
            "holder_owner": holder.owner if holder else None}))


def run(args: argparse.Namespace) -> int:
    from examples._cluster import Cluster, redis_server, say, worker_argv

    with redis_server(args.redis_url) as url:
        use_redis(url)
        r = data()
        account = f"acct-{uuid.uuid4().hex[:6]}"
        node = f"nested-{os.getpid()}@localhost"
        with Cluster(url) as cluster:
            cluster.start("worker", worker_argv("examples.nested_reentry", node, 2))
            cluster.wait_for_workers(app, [node])
            task_id = str(uuid.uuid4())
            say(f"1 worker x 2 processes (prefork) up; transfer[{task_id}] "
                f"on account {account!r}")
            first = transfer.apply_async((account,), task_id=task_id)
            if not wait_for_signal(f"nested:{account}:holding", first):
                raise RuntimeError(f"transfer did not get to hold its lock: "
                                   f"{first.state} {first.result!r}")
            # The same message again, while the first attempt still holds the lock.
            transfer.apply_async((account,), task_id=task_id)
            contended = r.blpop([f"nested:{account}:contended"], timeout=20)
            r.rpush(f"nested:{account}:go", "1")
            lock_key = LockKeys.for_name(app.conf.dlock_key_prefix,
                                         f"account:{account}").lock
            if not _wait_free(r, lock_key, 20):
                raise RuntimeError("the lock was not released after the run")
        trace = [json.loads(t) for t in r.lrange(f"nested:{account}:trace", 0, -1)]
        first_owner = trace[0]["owner"] if trace else None
        say("hold count at each level (one execution attempt, one owner):")
        for t in trace:
            same = "same owner" if t["owner"] == first_owner else "OTHER owner"
            say(f"  {'  ' * (t['depth'] - 1)}{t['what']:<{44 - 2 * t['depth']}} "
                f"hold count {t['count']}  ({same}, pid {t['pid']})")
        dup = json.loads(contended[1]) if contended else None
        if dup:
            say(f"the same message again (task id {dup['task_id']}), pid {dup['pid']}:")
            say(f"  its owner   {dup['owner']}")
            say(f"  holder      {dup['holder_owner']} (task id "
                f"{dup['holder_task_id']})")
            say(f"  -> contention, not re-entry: policy {dup['policy']!r}, the body "
                f"did not run")
        say(f"after transfer returned, lock {lock_key} is free")
    counts = [t["count"] for t in trace]
    checks = {
        "hold counts 1, 2, 3, 2, 3, 1": counts == [1, 2, 3, 2, 3, 1],
        "one owner for every level": len({t["owner"] for t in trace}) == 1,
        "the redelivery (same task id) contended": dup is not None
            and dup["task_id"] == task_id and dup["holder_task_id"] == task_id
            and dup["holder_owner"] == first_owner and dup["owner"] != first_owner,
        "the body ran once": sum(t["what"] == "transfer, run by a worker"
                                 for t in trace) == 1,
    }
    for what, held in checks.items():
        say(f"  [{'ok' if held else 'FAILED'}] {what}")
    if all(checks.values()):
        say("OK: nested calls re-entered (1, 2, 3); the redelivery was refused")
        return 0
    say("FAILED")
    return 1


def _wait_free(r: Any, key: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while r.exists(key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/nested_reentry.py",
        description="Nested locked calls re-enter; a redelivery contends.")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
