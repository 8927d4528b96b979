"""LockedTask in real ``celery worker`` subprocesses with the prefork pool.

What only real worker processes show: locks taken in forked children and renewed by
their own scheduler, children dying (SIGKILL, hard time limit, ``revoke(terminate=True)``)
with the main process freeing their locks, retries re-queued from a child, the same
message delivered twice, and a warm shutdown.

Each test gets its own queue and key prefix (see :mod:`prefork_app`), starts its own
workers (at most 2 x 4 processes) and always stops them; when a test fails, the tail of
each worker's log is written to the terminal.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult, ResultSet
from prefork_app import ENV_CONF
from worker_harness import (
    PROMPT,
    Harness,
    assert_disjoint,
    assert_held_throughout,
    open_harness,
    spans,
    wait_for,
)

from celery_dlock.backends.redis.keyspace import LockKeys

try:
    from psycopg import connect as psycopg_connect
except ImportError:  # the postgres case is skipped (postgres_server)
    psycopg_connect = None  # type: ignore[assignment]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)

# -- 1. inventory ----------------------------------------------------------------------


@pytest.fixture(params=["redis", "postgres", "mysql", "zookeeper"])
def lock_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the workers' locks live: the suite's Redis (``prefork_app``'s default),
    PostgreSQL, MariaDB or ZooKeeper (``dlock_url`` in the workers' configuration)."""
    url: str
    if request.param == "postgres":
        url = request.getfixturevalue("postgres_server").url
    elif request.param == "mysql":
        url = request.getfixturevalue("mariadb_url")
    elif request.param == "zookeeper":
        pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper "
                            "extra)")
        url = request.getfixturevalue("zk_server").url
    else:
        return ""
    monkeypatch.setenv(ENV_CONF, json.dumps({"dlock_url": url}))
    return url


def test_inventory_no_oversell_with_lock_and_oversell_without(harness: Harness,
                                                              lock_store: str) -> None:
    h = harness
    h.start_workers(count=2, concurrency=4)
    buyers, stock = 400, 200
    plain = h.app.tasks["pf.buy_plain"]
    locked = h.app.tasks["pf.buy_locked"]

    outcome: dict[str, dict[str, int | float]] = {}
    for label, task, product in (("plain", plain, "p-plain"),
                                 ("locked", locked, "p-locked")):
        base = f"{h.dp}:inv:{product}"
        h.r.set(f"{base}:stock", stock)
        started = time.monotonic()
        results = ResultSet([task.delay(product) for _ in range(buyers)])
        bought = results.get(timeout=120, interval=0.05)
        outcome[label] = {
            "sold": int(h.r.get(f"{base}:sold") or 0),
            "left": int(h.r.get(f"{base}:stock") or 0),
            "bought": sum(1 for b in bought if b),
            "overlaps": int(h.r.get(f"{base}:overlaps") or 0),
            "seconds": round(time.monotonic() - started, 2),
        }
    print(f"\ninventory ({buyers} buyers, stock {stock}, 2 workers x 4 processes): "
          f"without lock {outcome['plain']}, with lock {outcome['locked']}")

    # The control must over-sell, or the run proves nothing about the lock.
    assert outcome["plain"]["overlaps"] > 0, outcome
    assert outcome["plain"]["sold"] > stock, outcome
    assert outcome["locked"] == {**outcome["locked"], "sold": stock, "left": 0,
                                 "bought": stock, "overlaps": 0}
    assert h.lock_keys_left() == []
    if lock_store:
        from celery_dlock.task.backend import backend_from_url

        assert list(backend_from_url(lock_store).holds(h.prefix)) == []
        # and no lock was taken in Redis: no fence counter there
        assert not [k for k in h.r.scan_iter(match=f"{h.prefix}:*")
                    if k.endswith(b":fence")]
    if lock_store.startswith("postgresql://"):
        # the locks were taken there: every name has a fence row
        with psycopg_connect(lock_store) as conn:
            rows = conn.execute("SELECT count(*) FROM dlock_locks WHERE prefix = %s",
                                (h.prefix,)).fetchone()
        assert rows is not None and rows[0] >= 1
    if lock_store.startswith("mysql://"):
        import pymysql
        from mariadb_server import connect_args

        with pymysql.connect(**connect_args(lock_store)) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM dlock_locks WHERE prefix = %s",
                        (h.prefix,))
            found = cur.fetchone()
        assert found is not None and found[0] >= 1


# -- 2. a 1 s lock renewed for a 3.5 s run ---------------------------------------------


def test_renewal_in_child_keeps_short_ttl_lock_for_long_run(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    interval = h.app.tasks["pf.interval"]
    key = "renew"
    results = [interval.delay(key, 3.5) for _ in range(3)]  # three messages, one key
    for res in results:
        res.get(timeout=60)
    runs = h.records("iv", key)
    print(f"\nruns of a 3.5 s task with lock_ttl=1 (start, end): {spans(runs)}")
    assert len(runs) == 3
    assert {x["task_id"] for x in runs} == {res.id for res in results}
    assert_disjoint(runs)
    for run in runs:
        assert run["end"] - run["start"] >= 3.5
        assert run["owned"] is True and run["lost"] is False, run
    fences = [x["fence"] for x in sorted(runs, key=lambda x: x["start"])]
    assert fences == sorted(fences) and len(set(fences)) == 3
    assert h.lock_keys_left() == []


# -- 3. SIGKILL of the child running a locked task -------------------------------------


def test_sigkill_of_child_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    (worker,) = h.start_workers(count=1, concurrency=4)
    hold = h.app.tasks["pf.hold"]
    key, name = "kill", "hold:kill"
    ttl = 10.0

    a = hold.delay(key, 60)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the first task to start")
    pid_a, owner_a = start_a["pid"], start_a["owner"]
    holder = {k.decode(): v.decode() for k, v in h.r.hgetall(h.lock_key(name)).items()}
    assert holder["owner"] == owner_a and holder["task_id"] == a.id
    assert holder["pid"] == str(pid_a)

    # The second attempt is a later attempt of the same task id (as its retry would
    # be), in another child: it waits for its predecessor, and freeing the dead
    # attempt's hold must never free this one's.
    hold.apply_async((key, 2.0), task_id=a.id, retries=1)
    queue = LockKeys.for_name(h.prefix, name).queue
    wait_for(lambda: h.r.zcard(queue) >= 1, 20, what="the second attempt to wait")

    pttl_ms = h.r.pttl(h.lock_key(name))
    killed = time.time()
    os.kill(pid_a, signal.SIGKILL)
    freed = h.wait_owner_not(name, owner_a, timeout=ttl + 5)
    start_b = wait_for(lambda: h.hold_event(key, "start", task_id=a.id, not_pid=pid_a),
                       ttl + 5, 0.002, "the second attempt to start")
    kill_to_free = freed - killed
    kill_to_start = start_b["time"] - killed
    print(f"\nSIGKILL -> lock freed: {kill_to_free * 1000:.0f} ms; -> second attempt "
          f"running: {kill_to_start * 1000:.0f} ms (ttl left was {pttl_ms} ms)")

    # Expiry could not free it before pttl_ms (>= 2/3 of the ttl): the main process did,
    # and without waiting for the pool's own check of its children (every 5 s).
    assert kill_to_free < min(PROMPT, pttl_ms / 1000 - 1.0)
    assert kill_to_start < min(PROMPT, pttl_ms / 1000 - 1.0)
    wait_for(lambda: "freed lock 'hold:kill'" in worker.log_text(), 5,
             what="the main process to log that it freed the lock")
    owner_b = start_b["owner"]
    assert owner_b and owner_b != owner_a
    assert_held_throughout(h, name, key, owner_b, a.id, pid_a)
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


# -- 4. hard time limit ----------------------------------------------------------------


def test_hard_time_limit_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    key, name = "limit", "hold:limit"
    a = h.app.tasks["pf.hold_limited"].delay(key, 10)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the time-limited task to start")
    b = h.app.tasks["pf.hold"].delay(key, 0.5)
    freed = h.wait_owner_not(name, start_a["owner"], timeout=15)
    # The limit counts from when the child accepted the job, a little before the body
    # started: this slightly over-states the delay.
    limit_to_free = freed - (start_a["time"] + 1.0)
    start_b = wait_for(lambda: h.hold_event(key, "start", task_id=b.id), 15,
                       what="the second task to start")
    print(f"\nhard time limit (1 s) -> lock freed: ~{limit_to_free * 1000:.0f} ms; "
          f"-> second task running: "
          f"~{(start_b['time'] - start_a['time'] - 1.0) * 1000:.0f} ms")
    assert limit_to_free < PROMPT  # expiry: >= 6.7 s (ttl 10, renewed every 3.3 s)
    with pytest.raises(TimeLimitExceeded):
        a.get(timeout=10)
    assert b.get(timeout=15) >= 0.5
    assert h.hold_event(key, "end", task_id=a.id) is None  # the body never finished
    end_b = h.hold_event(key, "end", task_id=b.id)
    assert end_b is not None and end_b["owned"] is True
    assert h.lock_keys_left() == []


# -- 5. revoke(terminate=True, signal="SIGKILL") ---------------------------------------


def test_revoke_terminate_frees_lock_promptly(harness: Harness) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    hold = h.app.tasks["pf.hold"]
    key, name = "revoke", "hold:revoke"
    a = hold.delay(key, 60)
    start_a = wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
                       what="the task to start")
    b = hold.delay(key, 0.5)
    queue = LockKeys.for_name(h.prefix, name).queue
    wait_for(lambda: h.r.zcard(queue) >= 1, 20, what="the second task to wait")
    pttl_ms = h.r.pttl(h.lock_key(name))
    revoked = time.time()
    h.app.control.revoke(a.id, terminate=True, signal="SIGKILL")
    freed = h.wait_owner_not(name, start_a["owner"], timeout=15)
    print(f"\nrevoke(terminate=True, SIGKILL) -> lock freed: "
          f"{(freed - revoked) * 1000:.0f} ms (ttl left was {pttl_ms} ms)")
    assert freed - revoked < min(PROMPT, pttl_ms / 1000 - 1.0)
    assert b.get(timeout=15) >= 0.5
    assert wait_for(lambda: a.state == "REVOKED", 10, what="REVOKED state")
    assert h.hold_event(key, "end", task_id=a.id) is None
    assert h.lock_keys_left() == []


# -- 6. retries from inside a locked task ----------------------------------------------


@pytest.mark.parametrize("task_name,kind", [("pf.retrying", "retry"),
                                            ("pf.autoretrying", "autoretry")])
def test_retry_inside_locked_task_runs_and_does_not_leak(harness: Harness,
                                                         task_name: str,
                                                         kind: str) -> None:
    h = harness
    h.start_workers(count=1, concurrency=4)
    key, times = "r1", 3
    res = h.app.tasks[task_name].delay(key, times)
    assert res.get(timeout=60) == times
    # The lock is released before the result is stored: nothing may be left now.
    assert h.lock_keys_left() == []
    runs = h.records(kind, key)
    assert [x["retries"] for x in runs] == list(range(times + 1))
    assert all(x["task_id"] == res.id and x["owned"] for x in runs), runs
    fences = [x["fence"] for x in runs]
    assert fences == sorted(fences) and len(set(fences)) == len(fences), fences
    print(f"\n{task_name}: {times} retries, attempts took the lock with fences {fences}, "
          f"{(runs[-1]['time'] - runs[0]['time']) * 1000:.0f} ms first to last")


# -- 7. the same task id delivered twice -----------------------------------------------


def test_same_task_id_twice_runs_once(harness: Harness) -> None:
    """The second delivery finds its own task id holding the lock: a duplicate, it
    never runs the body (more in test_task_redelivery.py)."""
    h = harness
    h.start_workers(count=1, concurrency=4)
    interval = h.app.tasks["pf.interval"]
    key, task_id = "twice", str(uuid.uuid4())
    first = interval.apply_async((key, 2.0), task_id=task_id)
    interval.apply_async((key, 2.0), task_id=task_id)
    assert first.get(timeout=30) >= 2.0
    time.sleep(1.5)
    runs = h.records("iv", key)
    print(f"\nsame task id twice: runs (start, end): {spans(runs)}")
    assert len(runs) == 1
    assert runs[0]["task_id"] == task_id and runs[0]["owned"], runs
    wait_for(lambda: h.lock_keys_left() == [], 5, what="the lock to be released")


# -- 8. warm shutdown ------------------------------------------------------------------


def test_warm_shutdown_finishes_task_and_leaves_no_lock(harness: Harness) -> None:
    h = harness
    (worker,) = h.start_workers(count=1, concurrency=4)
    key, name = "shutdown", "hold:shutdown"
    a = h.app.tasks["pf.hold"].delay(key, 3.0)
    wait_for(lambda: h.hold_event(key, "start", task_id=a.id), 20,
             what="the task to start")
    assert h.owner(name) is not None
    took = worker.stop(signal.SIGTERM, timeout=30.0)
    print(f"\nwarm shutdown with a 3 s locked task running: worker exited after "
          f"{took:.2f} s, code {worker.proc.returncode}")
    assert took != float("inf"), "the worker did not shut down within 30 s"
    end = h.hold_event(key, "end", task_id=a.id)
    assert end is not None and end["owned"] is True, "the task did not finish"
    assert AsyncResult(a.id, app=h.app).get(timeout=5) >= 3.0
    assert h.lock_keys_left() == []  # ttl is 10 s: only a release explains this
    assert worker.proc.returncode == 0

