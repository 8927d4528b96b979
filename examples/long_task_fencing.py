"""A long task with a short ttl, and a fencing token that stops a stale holder.

``rebuild`` runs for about 4 s with ``lock_ttl=1``: it keeps its lock because the
worker process's scheduler renews it every ttl/3.  Short ttls are what you want (a
crashed worker's lock frees itself within a second), but renewal cannot make a lock
safe on its own: a holder that stalls (a GC pause, a frozen VM, a network partition)
longer than the ttl loses the lock without knowing, and its next write would clobber
the work of the next holder.

The defence is the fencing token.  Every hold gets ``self.lock.fence``, a number that
only grows from one holder to the next; the task passes it with every write, and the
storage (here a document in Redis, updated by a tiny Lua compare-and-set) refuses a
write whose fence is lower than the highest it has seen.

The runner stages the accident on a real prefork worker:

1. writer A takes the lock (fence N) and writes four times, 1 s apart: 3 s, three
   times its ttl, all accepted;
2. the lock is deleted behind A's back (what an expiry during a stall looks like);
3. writer B takes the lock (fence N+1) and writes: accepted;
4. A wakes up and writes with fence N: **refused** by the storage; and
   ``self.lock.ensure_held()`` raises :class:`~celery_dlock.LockLost`.

One command::

    python examples/long_task_fencing.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

if not __package__:  # run as a file, python examples/long_task_fencing.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from celery_dlock import LockedTask, LockLost
from celery_dlock.backends.redis.keyspace import LockKeys
from examples.celery_app import app, data, use_redis, wait_for_signal

__all__ = ["FencedStore", "app", "main", "rebuild"]

TTL = 1.0
STEPS = 4
STEP = 1.0

#: The storage's compare-and-set.
#: KEYS[1]  the document (a hash: value, fence, writer)
#: ARGV[1]  the writer's fence;  ARGV[2] the value;  ARGV[3] the writer
#: returns  {1, highest fence seen before} when written,
#:          {0, highest fence seen} when refused (ARGV[1] < highest)
FENCED_WRITE = """
local highest = tonumber(redis.call('HGET', KEYS[1], 'fence') or '-1')
if tonumber(ARGV[1]) < highest then
    return {0, highest}
end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2], 'writer', ARGV[3])
return {1, highest}
"""


@dataclass
class Write:
    accepted: bool
    highest: int


class FencedStore:
    """Documents that refuse writes from a fence lower than the highest seen."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._write = client.register_script(FENCED_WRITE)

    def key(self, doc: str) -> str:
        return f"fencing:doc:{doc}"

    def write(self, doc: str, value: str, fence: int, writer: str) -> Write:
        accepted, highest = self._write(keys=[self.key(doc)],
                                        args=[fence, value, writer])
        return Write(bool(accepted), int(highest))

    def read(self, doc: str) -> dict[str, str]:
        return dict(self.client.hgetall(self.key(doc)))


def _log(doc: str, who: str, text: str) -> None:
    data().rpush(f"fencing:{doc}:log", json.dumps({"t": time.time(), "who": who,
                                                   "text": text}))


def _pttl(task: Any) -> float:
    return float(data().pttl(task.lock.keys.lock)) / 1000.0


# lock_lost_action="warn": the stale writer's outcome is this demo's point, so its
# result is kept; by default an attempt that lost its lock ends FAILURE LockLost.
@app.task(name="examples.long_task_fencing.rebuild", base=LockedTask, bind=True,
          lock_key="doc:{doc}", lock_ttl=TTL, on_contention="raise",
          lock_lost_action="warn")
def rebuild(self: Any, doc: str, writer: str, steps: int = 1, step: float = 0.0,
            wait_for_takeover: bool = False) -> dict[str, Any]:
    """Write ``steps`` versions of ``doc``, ``step`` seconds apart, with the fence."""
    store = FencedStore(data())
    fence = self.lock.fence
    started = time.monotonic()
    _log(doc, writer, f"took the lock, fence {fence} (lock_ttl={TTL:g}s, pid "
                      f"{os.getpid()})")
    outcome: dict[str, Any] = {"writer": writer, "fence": fence, "writes": []}
    for i in range(1, steps + 1):
        if i > 1:
            time.sleep(step)
        w = store.write(doc, f"{writer} v{i}", fence, writer)
        outcome["writes"].append(w.accepted)
        _log(doc, writer, f"write v{i} with fence {fence}: "
                          f"{'accepted' if w.accepted else 'REFUSED'} "
                          f"(lock ttl left {_pttl(self):.2f}s)")
    if not wait_for_takeover:
        return outcome
    self.lock.ensure_held()
    outcome["held_for"] = time.monotonic() - started
    _log(doc, writer, f"still holds the lock after {outcome['held_for']:.2f}s, "
                      f"{outcome['held_for'] / TTL:.1f}x its ttl: renewed")
    r = data()
    r.rpush(f"fencing:{doc}:stalled", "1")          # the runner may now take over
    r.blpop([f"fencing:{doc}:resume"], timeout=20)  # ... a long stall ...
    w = store.write(doc, f"{writer} late write", fence, writer)
    outcome["late_write"] = w.accepted
    _log(doc, writer, f"late write with fence {fence}: "
                      f"{'accepted' if w.accepted else 'REFUSED'} "
                      f"(storage has seen fence {w.highest})")
    try:
        self.lock.ensure_held()
        outcome["ensure_held"] = "held"
    except LockLost as exc:  # a real task would let it propagate (or retry)
        outcome["ensure_held"] = f"LockLost: {exc}"
    _log(doc, writer, f"ensure_held(): {outcome['ensure_held']}")
    return outcome


def run(args: argparse.Namespace) -> int:
    from examples._cluster import Cluster, redis_server, say, worker_argv

    with redis_server(args.redis_url) as url:
        use_redis(url)
        r = data()
        doc = f"report-{uuid.uuid4().hex[:6]}"
        node = f"fencing-{os.getpid()}@localhost"
        with Cluster(url) as cluster:
            cluster.start("worker", worker_argv("examples.long_task_fencing", node, 2))
            cluster.wait_for_workers(app, [node])
            say(f"1 worker x 2 processes (prefork) up; document {doc!r}")
            a = rebuild.delay(doc, "A", steps=STEPS, step=STEP, wait_for_takeover=True)
            if not wait_for_signal(f"fencing:{doc}:stalled", a):
                raise RuntimeError(f"writer A never got to its stall: {a.state} "
                                   f"{a.result!r}")
            lock_key = LockKeys.for_name(app.conf.dlock_key_prefix, f"doc:{doc}").lock
            r.delete(lock_key)
            _log(doc, "--", f"A stalls; its lock expires meanwhile (DEL {lock_key})")
            b = rebuild.delay(doc, "B", steps=1).get(timeout=20)
            r.rpush(f"fencing:{doc}:resume", "1")
            a_out = a.get(timeout=20)
        entries = [json.loads(e) for e in r.lrange(f"fencing:{doc}:log", 0, -1)]
        t0 = entries[0]["t"]
        for e in entries:
            say(f"  t={e['t'] - t0:5.2f}s  {e['who']:>2}  {e['text']}")
        stored = FencedStore(r).read(doc)
        say(f"stored: {stored.get('value')!r} written by {stored.get('writer')} "
            f"with fence {stored.get('fence')}")
    checks = {
        "A outlived its ttl thanks to renewal": a_out.get("held_for", 0) > 2.5 * TTL
            and all(a_out["writes"]),
        "B's fence is higher than A's": b["fence"] > a_out["fence"],
        "B's write was accepted": all(b["writes"]),
        "A's late write was refused": a_out.get("late_write") is False,
        "A's ensure_held() raised LockLost":
            str(a_out.get("ensure_held", "")).startswith("LockLost"),
        "the stored value is B's": stored.get("writer") == "B",
    }
    for what, held in checks.items():
        say(f"  [{'ok' if held else 'FAILED'}] {what}")
    if all(checks.values()):
        say("OK: the stale holder's write was refused by its fence")
        return 0
    say("FAILED")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/long_task_fencing.py",
        description="A 4 s task with lock_ttl=1, and a stale holder fenced off.")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
