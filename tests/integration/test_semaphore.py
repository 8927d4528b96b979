"""What a semaphore of several slots adds to the lock's contract (a semaphore of one
slot runs every lock test: the ``semaphore`` kind of tests/lock_kinds.py): N holders
at once, a FIFO line woken by releases, a fence per hold, slots freed by expiry and by
a holder's death, re-entry in its own slot, owner-only release, one cluster slot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
from celery import Celery
from dlock_helpers import wait_until

from celery_dlock import (
    InvalidLockConfig,
    LockKeyConflict,
    LockNotAcquired,
    LockNotOwned,
    RedisLock,
    RedisSemaphore,
)
from celery_dlock.backends.redis.backend import RedisBackend
from celery_dlock.backends.redis.hashtag import lock_key
from celery_dlock.core.lock_options import LockOptions


def _sem(r, name, prefix, owner, limit=3, ttl=30.0, **kw):
    return RedisSemaphore(r, name, limit, ttl, owner=owner, prefix=prefix, **kw)


def test_limit_holders_at_once_and_the_next_is_refused(r, name, prefix):
    holders = [_sem(r, name, prefix, f"o{i}") for i in range(3)]
    assert all(s.acquire(blocking=False) for s in holders)
    extra = _sem(r, name, prefix, "o3")
    assert extra.acquire(blocking=False) is False
    assert extra.last_holder is not None and extra.last_holder.owner in \
        {"o0", "o1", "o2"}
    with pytest.raises(LockNotAcquired), _sem(r, name, prefix, "o4",
                                              blocking_timeout=0.2):
        pytest.fail("a fourth holder ran")
    fences = [s.fence for s in holders]
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(fences) and len(set(fences)) == 3, fences
    holders[1].release()
    assert extra.acquire(blocking=False)
    assert extra.fence is not None and extra.fence > max(fences)
    for s in (holders[0], holders[2], extra):
        s.release()
    assert not r.exists(lock_key(prefix, name))


def test_reentry_takes_no_second_slot(r, name, prefix):
    a = _sem(r, name, prefix, "a", limit=2)
    assert a.acquire() and a.acquire()
    fence = a.fence
    b = _sem(r, name, prefix, "b", limit=2)
    assert b.acquire(blocking=False), "re-entry took a second slot"
    assert a.fence == fence and a.depth == 2
    assert not _sem(r, name, prefix, "c", limit=2).acquire(blocking=False)
    a.release()
    assert a.owned() and a.depth == 1
    assert not _sem(r, name, prefix, "c", limit=2).acquire(blocking=False)
    a.release()
    assert not a.owned()
    b.release()


def test_release_is_owner_only(r, name, prefix):
    a = _sem(r, name, prefix, "a", limit=2)
    a.acquire()
    stranger = _sem(r, name, prefix, "stranger", limit=2)
    with pytest.raises(LockNotOwned):
        stranger.release()
    with pytest.raises(LockNotOwned):
        stranger.extend()
    assert a.owned()
    assert [h.owner for h in a.holders()] == ["a"]
    a.release()


def test_waiters_are_woken_in_line_by_releases(r, name, prefix):
    holders = [_sem(r, name, prefix, f"h{i}", limit=2) for i in range(2)]
    for s in holders:
        s.acquire()
    order: list[str] = []
    woke_at: dict[str, float] = {}
    done = threading.Event()

    def wait(owner: str) -> None:
        s = _sem(r, name, prefix, owner, limit=2)
        assert s.acquire(timeout=20)
        order.append(owner)
        woke_at[owner] = time.monotonic()
        done.wait(20)
        s.release()

    first = threading.Thread(target=wait, args=("w1",))
    first.start()
    assert wait_until(lambda: r.zcard(lock_key(prefix, name) + ":q") == 1)
    second = threading.Thread(target=wait, args=("w2",))
    second.start()
    assert wait_until(lambda: r.zcard(lock_key(prefix, name) + ":q") == 2)
    released_at = time.monotonic()
    holders[0].release()
    try:
        assert wait_until(lambda: order, timeout=10)
        time.sleep(0.3)
        assert order == ["w1"], "the first in line did not get the freed slot alone"
        # Woken by the release's doorbell, well before the holder's ttl (30 s) or a
        # re-try of the line (every 2 s).
        assert woke_at["w1"] - released_at < 1.5
        holders[1].release()
        assert wait_until(lambda: len(order) == 2, timeout=10)
        assert order == ["w1", "w2"]
    finally:
        done.set()
        first.join(10)
        second.join(10)


def test_an_expired_slot_is_free_again(r, name, prefix):
    gone = _sem(r, name, prefix, "gone", limit=1, ttl=0.3, auto_renew=False)
    gone.acquire()
    other = _sem(r, name, prefix, "other", limit=1)
    assert not other.acquire(blocking=False)
    assert other.acquire(timeout=5), "an expired holder kept its slot"
    other.release()


def test_a_renewed_slot_outlives_three_ttls(r, name, prefix):
    kept = _sem(r, name, prefix, "kept", limit=1, ttl=0.6)
    kept.acquire()
    time.sleep(3 * 0.6 + 0.3)
    assert kept.owned() and not kept.lost
    assert not _sem(r, name, prefix, "other", limit=1).acquire(blocking=False)
    kept.release()


_CHILD = """
import sys, time, redis
from celery_dlock import RedisSemaphore
s = RedisSemaphore(redis.Redis.from_url(sys.argv[1]), sys.argv[2], 2, 1.5,
                   prefix=sys.argv[3], owner="child")
assert s.acquire(blocking=False)
print("held", flush=True)
time.sleep(60)
"""


def test_a_killed_holder_frees_its_slot_within_the_ttl(r, redis_url, name, prefix):
    keeper = _sem(r, name, prefix, "keeper", limit=2)
    keeper.acquire()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, redis_url, name, prefix],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        other = _sem(r, name, prefix, "other", limit=2)
        time.sleep(2.0)  # past the ttl: the child's renewal keeps its slot
        assert not other.acquire(blocking=False)
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert other.acquire(timeout=10)
        assert time.monotonic() - killed_at < 1.5 + 1.0
        other.release()
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    keeper.release()


def test_many_threads_never_exceed_the_limit_and_reach_it(r, name, prefix):
    running = 0
    peak = 0
    done = 0
    guard = threading.Lock()

    def body(i: int) -> None:
        nonlocal running, peak, done
        with _sem(r, name, prefix, f"t{i}", limit=3, blocking_timeout=30):
            with guard:
                running += 1
                peak = max(peak, running)
            time.sleep(0.15)
            with guard:
                running -= 1
                done += 1

    threads = [threading.Thread(target=body, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert done == 12
    assert peak == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True, None])
def test_a_bad_limit_is_refused_naming_it(r, name, bad):
    with pytest.raises(InvalidLockConfig, match="limit"):
        RedisSemaphore(r, name, bad)


def test_every_key_shares_the_hash_tag(r, name, prefix):
    s = _sem(r, name, prefix, "a", limit=2)
    keys = [*s.keys, s.keys.holder("a"), s.keys.doorbell("a")]
    assert all(k.startswith(f"{prefix}:{{{name}}}") for k in keys), keys


def test_a_lock_of_the_same_name_is_a_conflict(r, name, prefix):
    lock = RedisLock(r, name, prefix=prefix, owner="lock")
    lock.acquire()
    with pytest.raises(LockKeyConflict):
        _sem(r, name, prefix, "sem").acquire(blocking=False)
    assert lock.owned()
    lock.release()


def test_the_backend_shows_slots_and_holders(r, name, prefix):
    backend = RedisBackend(r)
    holders = [_sem(r, name, prefix, f"o{i}", info={"task_id": f"t{i}"})
               for i in range(2)]
    for s in holders:
        s.acquire()
    info = backend.read(prefix, name)
    assert info is not None and info.limit == 3 and info.slots == "2/3"
    assert sorted(h.task_id for h in info.holders) == ["t0", "t1"]
    listed = [i for i in backend.holds(prefix) if i.key == name]
    assert len(listed) == 1 and listed[0].slots == "2/3"
    freed = backend.force_release(prefix, name, by="ops", reason="test")
    assert freed is not None and len(freed.holders) == 2
    assert backend.read(prefix, name) is None
    for s in holders:
        assert not s.owned()


# -- LockedTask(lock_limit=N): checks ---------------------------------------------------


def _declare(app, **options):
    from celery_dlock import LockedTask

    @app.task(base=LockedTask, shared=False, name=f"t{uuid.uuid4().hex[:6]}",
              lock_key="k:{x}", **options)
    def t(x: str) -> str:
        return x

    return t


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_a_bad_lock_limit_is_refused_at_declaration(bad):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    with pytest.raises(InvalidLockConfig, match="lock_limit must be a whole number"):
        _declare(app, lock_limit=bad)


def test_until_finished_with_a_limit_is_refused_at_declaration(redis_url):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=2"):
        _declare(app, lock_limit=2, lock_mode="until_finished")
    for mode in ("until_started", "queued_and_running", "throttle"):
        _declare(app, lock_limit=2, lock_mode=mode)  # the marker bounds the queue
    _declare(app, lock_limit=1, lock_mode="until_finished")  # a lock is fine
    configured = Celery("limits", broker="memory://", set_as_current=False)
    configured.conf.update(dlock_url=redis_url, dlock_mode="until_finished")
    configured.finalize()
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=3"):
        _declare(configured, lock_limit=3)  # the app's mode, the task's limit
    limited = _declare(app, lock_limit=2)
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=2"):
        limited.apply_async(("x",), lock_mode="until_finished")  # before any send


def test_lock_limit_cannot_be_set_per_call():
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    t = _declare(app, lock_limit=2)
    with pytest.raises(InvalidLockConfig, match="lock_limit cannot be set per call"):
        t.apply_async(("x",), headers={"lock_limit": 5})


def _redlock_url(servers) -> str:
    return ";".join(s.url.replace("redis://", "redlock://") for s in servers)


def test_redlock_refuses_lock_limit_at_worker_start(redlock_servers):
    from celery_dlock.task.startup import check_app

    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    _declare(app, lock_limit=3)
    app.conf.dlock_url = _redlock_url(redlock_servers)  # configured after the tasks
    with pytest.raises(InvalidLockConfig,
                       match=r"semaphores.*the redlock backend does not keep"):
        check_app(app)


def test_redlock_refuses_lock_limit_at_declaration_on_a_configured_app(
        redlock_servers):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.dlock_url = _redlock_url(redlock_servers)
    app.finalize()
    with pytest.raises(InvalidLockConfig,
                       match="each of its independent servers would count the holders"):
        _declare(app, lock_limit=2)
    _declare(app, lock_limit=1)  # a lock is fine


def test_the_redlock_backend_refuses_a_limit(redlock_servers):
    from celery_dlock.backends.redis.redlock.backend import RedlockBackend

    clients = [redis.Redis.from_url(s.url) for s in redlock_servers]
    backend = RedlockBackend(clients)
    with pytest.raises(InvalidLockConfig, match="lock_limit > 1"):
        backend.lock(LockOptions("x", 5, prefix="p", limit=2))
    assert backend.lock(LockOptions("x", 5, prefix="p", limit=1)) is not None
    for c in clients:
        c.close()


def test_a_slot_released_by_force_is_told_who_and_why(r, name, prefix):
    told: list[object] = []
    a = _sem(r, name, prefix, "a", limit=2, on_lost=told.append)
    a.acquire()
    fence = a.fence
    RedisBackend(r).force_release(prefix, name, fence=fence, by="ops@host",
                                  reason="disk full")
    assert not a.owned()
    assert told == [a]
    assert a.lost_reason is not None and "ops@host" in a.lost_reason \
        and "disk full" in a.lost_reason
