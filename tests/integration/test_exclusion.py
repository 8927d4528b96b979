"""Mutual exclusion across processes: read-modify-write on a shared Redis counter.

Eight spawned processes each increment a counter with GET, a pause, SET.  Without the
lock the pause makes them overwrite each other's updates (the control proves the
scenario can fail); under the lock every increment survives and no two processes are
ever inside the critical section together, on every lock kind (``lock_kind``).
"""

from __future__ import annotations

import multiprocessing

import redis
from dlock_helpers import counter_worker

PROCESSES = 8
INCREMENTS = 8
PAUSE = 0.005


def _run_workers(redis_url: str, prefix: str, name: str, counter: str,
                 use_lock: bool, lock_urls: list[str]) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    procs = [
        ctx.Process(target=counter_worker,
                    args=(redis_url, prefix, name, counter, INCREMENTS, barrier,
                          use_lock, PAUSE, lock_urls))
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == [0] * PROCESSES


def test_the_control_without_a_lock_loses_updates(redis_url, r: redis.Redis, prefix,
                                                 name):
    """The scenario is able to fail: unlocked, the processes overwrite each other's
    updates (once: it takes no lock, so no lock kind changes it)."""
    counter = f"{prefix}:counter"
    _run_workers(redis_url, prefix, name, counter, False, [])
    total = int(r.get(counter) or 0)
    overlaps = int(r.get(counter + ":overlaps") or 0)
    assert overlaps > 0
    assert total < PROCESSES * INCREMENTS


def test_processes_read_modify_write_counter(redis_url, r: redis.Redis, lock_kind, prefix,
                                             name):
    counter = f"{prefix}:counter"
    _run_workers(redis_url, prefix, name, counter, True, lock_kind.urls)
    total = int(r.get(counter) or 0)
    overlaps = int(r.get(counter + ":overlaps") or 0)
    assert total == PROCESSES * INCREMENTS
    assert overlaps == 0
    keys = lock_kind.make(name, prefix=prefix).keys
    assert not lock_kind.server.exists(keys.lock)
    assert not lock_kind.server.exists(keys.queue)
