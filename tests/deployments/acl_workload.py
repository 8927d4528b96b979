"""Everything celery-dlock sends to Redis, driven through its public faces.

Used by test_acl.py twice: as the ACL user of docs/deployments.md (it must all work)
and under ``MONITOR`` (every command the rule allows must be one it sent).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from celery.bin.base import CLIContext
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app
from click.testing import CliRunner

from celery_dlock import (
    LockedTask,
    LockKeyConflict,
    RedisLock,
    RedisSemaphore,
    is_skipped,
)
from celery_dlock.backends.redis.inspect import (
    force_release,
    get_lock,
    iter_locks,
    waiting_counts,
)
from celery_dlock.ops.cli import dlock
from celery_dlock.task.config import get_client


def run_workload(lock_url: str, broker_url: str, prefix: str,
                 foreign_key_name: str) -> None:
    """``foreign_key_name``: a lock name whose key another application holds (a
    string), set up beforehand."""
    app = test_app(f"acl{uuid.uuid4().hex[:6]}", broker_url, queue=f"q-{prefix}",
                   prefix=prefix, dlock_url=lock_url, dlock_record_events=True,
                   # so that an idle connection's health check (PING) runs too
                   dlock_redis_options={"health_check_interval": 1})
    client = get_client(app)

    # -- RedisLock: acquire, re-enter, contend, wait, hand off, extend, checks, renew
    a = RedisLock(client, "job", ttl=1.2, owner="A", prefix=prefix)
    b = RedisLock(client, "job", ttl=5, owner="B", prefix=prefix)
    assert a.acquire() and a.acquire()
    assert not b.acquire(blocking=False)
    assert not b.acquire(timeout=0.2)
    a.extend(1.2)
    assert a.owned() and a.locked() and a.holder() is not None
    a.ensure_held()
    time.sleep(1.5)  # past the ttl: renewed; and past the health-check interval
    assert a.owned()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=10)))
    waiter.start()
    time.sleep(0.3)
    a.release()
    a.release()
    waiter.join(15)
    assert got == [True]
    assert waiting_counts(client, prefix, ["job"]) == {"job": 0}
    assert get_lock(client, prefix, "job") is not None
    assert [i.key for i in iter_locks(client, prefix)] == ["job"]
    assert force_release(client, prefix, "job", fence=b.fence) is not None
    try:
        RedisLock(client, foreign_key_name, prefix=prefix).acquire(blocking=False)
    except LockKeyConflict:
        pass
    else:
        raise AssertionError("foreign data went unnoticed")

    # -- a semaphore: a slot taken, a waiter in line, handed the slot at a release
    s1 = RedisSemaphore(client, "slots", 1, ttl=5, owner="S1", prefix=prefix)
    s2 = RedisSemaphore(client, "slots", 1, ttl=5, owner="S2", prefix=prefix)
    assert s1.acquire(blocking=False)
    slotted: list[bool] = []
    in_line = threading.Thread(target=lambda: slotted.append(s2.acquire(timeout=10)))
    in_line.start()
    deadline = time.monotonic() + 10
    while not client.zcard(f"{prefix}:{{slots}}:q") and time.monotonic() < deadline:
        time.sleep(0.02)  # until S2 waits in line (the release then hands it the slot)
    s1.release()
    in_line.join(15)
    assert slotted == [True]
    s2.release()

    # -- LockedTask on a worker, with contention recorded as an event
    @app.task(base=LockedTask, shared=False, bind=True, lock_key="t:{x}",
              on_contention="skip")
    def hold(self: Any, x: str, seconds: float) -> int | None:
        time.sleep(seconds)
        return self.lock.fence

    # -- the enqueue-time modes (queue markers), a rate and a semaphore
    @app.task(base=LockedTask, shared=False, lock_key="m:{x}", lock_mode="until_finished",
              on_duplicate="return_existing")
    def once(x: str) -> str:
        time.sleep(0.5)  # still running when its duplicate is sent, however fast
        return x

    # (on_contention="wait": the replacing call may meet the first one running, and
    # a contention retry's countdown is a message celery.contrib.testing's worker
    # does not always run before Celery 5.7)
    @app.task(base=LockedTask, shared=False, lock_key="q:{x}",
              lock_mode="queued_and_running", on_duplicate="replace",
              on_contention="wait")
    def newest(x: str) -> str:
        return x

    @app.task(base=LockedTask, shared=False, lock_key="th:{x}", lock_mode="throttle",
              lock_ttl=5)
    def throttled(x: str) -> str:
        return x

    @app.task(base=LockedTask, shared=False, lock_key="r:{x}", lock_rate="100/s")
    def rated(x: str) -> str:
        return x

    @app.task(base=LockedTask, shared=False, lock_key="s:{x}", lock_limit=2)
    def slot(x: str) -> str:
        return x

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=20):
            long = hold.delay("x", 1.5)
            time.sleep(0.5)
            assert is_skipped(hold.delay("x", 0).get(timeout=30))
            assert isinstance(long.get(timeout=30), int)
            first = once.delay("a")
            again = once.delay("a")  # a duplicate: the queued or running call's result
            assert again.id == first.id
            assert first.get(timeout=30) == "a"
            # a replace of a call still queued (its countdown keeps it so), so that
            # the replace's own commands are sent; the latest runs
            replaced = newest.apply_async(("b",), countdown=2)
            latest = newest.delay("b")
            assert latest.id != replaced.id
            assert latest.get(timeout=30) == "b"
            assert throttled.delay("c").get(timeout=30) == "c"
            assert rated.delay("d").get(timeout=30) == "d"
            assert slot.delay("e").get(timeout=30) == "e"
    finally:
        close_app(app)

    # -- the CLI
    held = RedisLock(client, "cli", ttl=10, prefix=prefix, owner="C")
    assert held.acquire(blocking=False)
    obj = CLIContext(app=app, no_color=True, workdir=None)
    for args in (["ls"], ["ls", "--json"], ["show", "cli"], ["top", "--iterations", "1"],
                 ["release", "cli", "--force"]):
        out = CliRunner().invoke(dlock, args, obj=obj, catch_exceptions=False)
        assert out.exit_code == 0, (args, out.output)
    assert held.holder() is None
