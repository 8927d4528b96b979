"""The lock's contract on every lock kind (``lock_kind``, tests/lock_kinds.py): exclusion
between owners, re-entry, fencing, owner checks, construction errors and the context
manager.  What only RedisLock has (its client argument) is tested on RedisLock alone."""

from __future__ import annotations

import math
import os
import pickle
import socket
import threading
import time

import pytest
import redis
from dlock_helpers import queue_members, wait_until
from lock_kinds import NO_FENCE, NO_LONGER_SESSION

from celery_dlock import (
    DLockError,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    RedisLock,
    owner_context,
)
from celery_dlock.core.scheduler import get_scheduler


def _in_thread(fn):
    """Run ``fn`` in a new thread (a different default owner); its result."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return out[0]


def _field(r: redis.Redis, lock: RedisLock, field: str) -> str | None:
    value = r.hget(lock.keys.lock, field)
    return None if value is None else value.decode()


# -- exclusion between owners ---------------------------------------------------------


def test_explicit_owners_exclude_each_other(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    a = lock_kind.make(name, owner="owner-a", prefix=prefix)
    b = lock_kind.make(name, owner="owner-b", prefix=prefix)
    assert a.acquire(blocking=False) is True
    assert b.acquire(blocking=False) is False
    assert a.owned() and not b.owned()
    assert a.locked() and b.locked()
    assert _field(r, a, "owner") == "owner-a"
    # b's failed attempt learned who holds it.
    assert b.last_holder is not None and b.last_holder.owner == "owner-a"
    a.release()
    assert not a.locked()
    assert b.acquire(blocking=False) is True
    assert _field(r, b, "owner") == "owner-b"
    b.release()
    assert not r.exists(b.keys.lock)


def test_threads_are_distinct_default_owners(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    with lock:
        # another thread contends, through a new object or through this very object
        assert _in_thread(lambda: lock_kind.make(name, prefix=prefix)
                          .acquire(blocking=False)) is False
        assert _in_thread(lambda: lock.acquire(blocking=False)) is False
        assert _field(r, lock, "count") == "1"
    assert not lock.locked()
    assert _in_thread(lambda: lock_kind.make(name, prefix=prefix, auto_renew=False)
                      .acquire(blocking=False)) is True


def test_threads_never_overlap_in_critical_section(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    state = {"inside": 0, "max_inside": 0, "counter": 0}
    errors: list[BaseException] = []
    n_threads, n_rounds = 4, 10

    def work() -> None:
        try:
            for _ in range(n_rounds):
                with lock_kind.make(name, prefix=prefix, blocking_timeout=30):
                    state["inside"] += 1
                    state["max_inside"] = max(state["max_inside"], state["inside"])
                    value = state["counter"]
                    time.sleep(0.002)
                    state["counter"] = value + 1
                    state["inside"] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert state["max_inside"] == 1
    assert state["counter"] == n_threads * n_rounds
    assert not r.exists(lock_kind.make(name, prefix=prefix).keys.lock)


def test_owner_context_sets_the_owner(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    with owner_context("ctx-token-1") as token:
        assert token == "ctx-token-1"
        outer = lock_kind.make(name, prefix=prefix)
        outer.acquire()
        assert _field(r, outer, "owner") == "ctx-token-1"
        # a nested acquisition in the same context re-enters
        inner = lock_kind.make(name, prefix=prefix)
        assert inner.acquire(blocking=False)
        assert _field(r, outer, "count") == "2"
        with owner_context():
            # a fresh context is another owner: it contends
            assert lock_kind.make(name, prefix=prefix).acquire(blocking=False) is False
        inner.release()
        outer.release()
    assert not r.exists(outer.keys.lock)


# -- re-entry -------------------------------------------------------------------------


def test_same_object_reenters_and_frees_when_releases_match(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    assert lock.acquire()
    assert lock.acquire()
    assert lock.acquire(blocking=False)
    assert _field(r, lock, "count") == "3"
    assert lock.depth == 3
    lock.release()
    assert _field(r, lock, "count") == "2"
    lock.release()
    assert _field(r, lock, "count") == "1"
    assert lock.owned()
    lock.release()
    assert not r.exists(lock.keys.lock)
    assert lock.depth == 0
    assert not lock.owned()
    with pytest.raises(LockNotOwned):
        lock.release()


def test_two_objects_of_one_owner_share_the_hold(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    a = lock_kind.make(name, owner="shared", prefix=prefix)
    b = lock_kind.make(name, owner="shared", prefix=prefix)
    other = lock_kind.make(name, owner="other", prefix=prefix)
    assert a.acquire(blocking=False)
    assert b.acquire(blocking=False)
    assert _field(r, a, "count") == "2"
    assert not lock_kind.fences or a.fence == b.fence
    assert other.acquire(blocking=False) is False
    a.release()
    assert _field(r, a, "count") == "1"
    assert b.owned()
    assert other.acquire(blocking=False) is False
    b.release()
    assert not r.exists(a.keys.lock)
    assert other.acquire(blocking=False)
    other.release()


def test_nested_with_in_one_thread_reenters_and_other_thread_contends(lock_kind, prefix,
                                                                     name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    with lock_kind.make(name, prefix=prefix) as outer:
        with lock_kind.make(name, prefix=prefix) as inner:
            assert _field(r, outer, "count") == "2"
            assert not lock_kind.fences or inner.fence == outer.fence
            assert _in_thread(lambda: lock_kind.make(name, prefix=prefix)
                              .acquire(blocking=False)) is False
        assert _field(r, outer, "count") == "1"
        assert outer.owned()
        assert _in_thread(lambda: lock_kind.make(name, prefix=prefix)
                          .acquire(blocking=False)) is False
    assert not r.exists(outer.keys.lock)


# -- fencing ----------------------------------------------------------------------------


def test_fence_strictly_increases_across_holders_and_stays_on_reentry(lock_kind, prefix,
                                                                     name):
    if not lock_kind.fences:
        pytest.skip(NO_FENCE)
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    seen: list[int] = []
    for i in range(4):
        lock = lock_kind.make(name, owner=f"holder-{i}", prefix=prefix)
        assert lock.fence is None
        lock.acquire()
        fence = lock.fence
        assert fence is not None
        lock.acquire()  # re-entry keeps the token
        assert lock.fence == fence
        assert _field(r, lock, "fence") == str(fence)
        seen.append(fence)
        lock.release()
        assert lock.fence == fence
        lock.release()
        assert lock.fence is None
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_fence_survives_expiry_of_the_hold(lock_kind, prefix, name):
    if not lock_kind.fences:
        pytest.skip(NO_FENCE)
    first = lock_kind.make(name, ttl=0.2, auto_renew=False, owner="a", prefix=prefix)
    first.acquire()
    fence = first.fence
    assert fence is not None
    assert wait_until(lambda: lock_kind.gone_everywhere(first.keys.lock))
    second = lock_kind.make(name, owner="b", prefix=prefix, auto_renew=False)
    second.acquire()
    assert second.fence is not None and second.fence > fence
    second.release()


# -- owner checks -----------------------------------------------------------------------


def test_stale_release_after_expiry_leaves_new_holder_alone(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    stale = lock_kind.make(name, ttl=0.3, auto_renew=False, owner="stale", prefix=prefix)
    stale.acquire()
    assert wait_until(lambda: lock_kind.gone_everywhere(stale.keys.lock))
    new = lock_kind.make(name, ttl=30, owner="new", prefix=prefix)
    new.acquire()
    with pytest.raises(LockLost) as info:
        stale.release()
    assert info.value.lock_name == name
    assert new.owned()
    assert r.exists(new.keys.lock)
    assert _field(r, new, "owner") == "new"
    assert _field(r, new, "count") == "1"
    assert stale.depth == 0
    new.release()


def test_stale_extend_after_expiry_raises_lost_and_leaves_new_holder(lock_kind, prefix,
                                                                     name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    stale = lock_kind.make(name, ttl=0.3, auto_renew=False, owner="stale", prefix=prefix)
    stale.acquire()
    assert wait_until(lambda: lock_kind.gone_everywhere(stale.keys.lock))
    new = lock_kind.make(name, ttl=30, owner="new", prefix=prefix)
    new.acquire()
    with pytest.raises(LockLost):
        stale.extend(60)
    assert stale.lost
    assert not stale.owned()
    assert _field(r, new, "owner") == "new"
    assert 0 < r.pttl(new.keys.lock) <= 30_000
    new.release()


def test_release_and_extend_by_non_owner_raise_and_delete_nothing(lock_kind, prefix,
                                                                  name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    holder = lock_kind.make(name, owner="holder", prefix=prefix)
    holder.acquire()
    holder.acquire()
    intruder = lock_kind.make(name, owner="intruder", prefix=prefix)
    with pytest.raises(LockNotOwned):
        intruder.release()
    with pytest.raises(LockNotOwned):
        intruder.extend()
    with pytest.raises(LockNotOwned):
        intruder.extend(1)
    with pytest.raises(LockLost):
        intruder.ensure_held()
    assert _field(r, holder, "owner") == "holder"
    assert _field(r, holder, "count") == "2"
    assert r.pttl(holder.keys.lock) > 20_000
    assert holder.owned()
    holder.release()
    holder.release()


def test_release_of_this_object_from_another_thread_is_refused(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    lock.acquire()
    err = _in_thread(lock.release)
    assert isinstance(err, LockNotOwned)
    assert lock.depth == 1
    assert _field(r, lock, "count") == "1"
    lock.release()
    assert not r.exists(lock.keys.lock)


def test_release_or_extend_of_a_free_lock_raises_not_owned(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    with pytest.raises(LockNotOwned):
        lock.release()
    with pytest.raises(LockNotOwned):
        lock.extend()
    assert not r.exists(lock.keys.lock)


def test_extend_by_owner_sets_new_ttl(lock_kind, prefix, name):
    if lock_kind.name == "zookeeper":
        pytest.skip(NO_LONGER_SESSION)
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=5, prefix=prefix)
    with lock:
        lock.extend(60)
        assert 50_000 < r.pttl(lock.keys.lock) <= 60_000
        assert lock.ttl == 60
        assert _field(r, lock, "ttl") == "60000"
        with pytest.raises(InvalidLockConfig):
            lock.extend(0)
        assert lock.ttl == 60


def test_holder_describes_the_current_hold(lock_kind, prefix, name):
    lock = lock_kind.make(name, ttl=30, owner="me", prefix=prefix,
                          info={"task_id": "t-1", "task_name": "proj.job",
                                "worker": "w1"})
    assert lock.holder() is None
    with lock:
        holder = lock.holder()
        assert holder is not None
        assert holder.owner == "me"
        assert holder.count == 1
        assert holder.fence == lock_kind.fence_of(lock)
        assert holder.ttl is not None and 20 < holder.ttl <= 30
        assert holder.age is not None and 0 <= holder.age < 10
        assert holder.task_id == "t-1" and holder.task_name == "proj.job"
        assert holder.worker == "w1"
        assert holder.pid == os.getpid()
        assert holder.info["host"] == socket.gethostname()


# -- context manager and acquire arguments -----------------------------------------------


def test_blocking_timeout_raises_not_acquired_with_holder_info(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    holder = lock_kind.make(name, ttl=30, owner="holder-owner", prefix=prefix,
                            info={"task_id": "abc-123"})
    holder.acquire()
    waiter = lock_kind.make(name, prefix=prefix, blocking_timeout=0.3)
    ran = False
    started = time.monotonic()
    with pytest.raises(LockNotAcquired) as info, waiter:
        ran = True
    assert not ran
    assert time.monotonic() - started >= 0.25  # it did wait
    err = info.value
    assert err.lock_name == name
    assert name in str(err)
    assert err.holder is not None
    assert err.holder.owner == "holder-owner"
    assert err.holder.ttl is not None and 0 < err.holder.ttl <= 30
    assert err.holder.info["pid"] == str(os.getpid())
    assert err.holder.info["host"] == socket.gethostname()
    assert err.holder.task_id == "abc-123"
    assert "abc-123" in str(err)
    # the error travels (Celery results): it survives pickling with its holder
    copy = pickle.loads(pickle.dumps(err))
    assert copy.holder == err.holder and copy.lock_name == name
    # the waiter left the line; the holder is untouched
    assert not r.exists(waiter.keys.queue)
    assert _field(r, holder, "owner") == "holder-owner"
    holder.release()


def test_non_blocking_acquire_returns_false_without_joining_the_line(lock_kind, prefix,
                                                                     name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    holder = lock_kind.make(name, owner="h", prefix=prefix)
    holder.acquire()
    other = lock_kind.make(name, owner="o", prefix=prefix)
    assert other.acquire(blocking=False) is False
    assert other.acquire(False) is False
    assert other.acquire(blocking=False, timeout=-1) is False
    assert not r.exists(other.keys.queue)
    assert other.depth == 0 and lock_kind.fence_of(other) is None
    holder.release()


def test_acquire_with_timeout_gives_up_and_leaves_the_line(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    holder = lock_kind.make(name, owner="h", prefix=prefix)
    holder.acquire()
    other = lock_kind.make(name, owner="o", prefix=prefix)
    started = time.monotonic()
    assert other.acquire(timeout=0.3) is False
    assert time.monotonic() - started >= 0.25
    assert other.acquire(timeout=0) is False
    assert not r.exists(other.keys.queue)
    assert not r.exists(other.keys.leases)
    holder.release()
    assert other.acquire(timeout=5) is True
    other.release()


@pytest.mark.parametrize(
    ("blocking", "timeout"),
    [(False, 1), (False, 0), (False, 0.5), (True, -2), (True, -0.5),
     (True, math.nan), (False, math.nan)],
)
def test_acquire_bad_timeout_combinations_raise_value_error(lock_kind, prefix, name,
                                                            blocking, timeout):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    with pytest.raises(ValueError):
        lock.acquire(blocking=blocking, timeout=timeout)
    assert not r.exists(lock.keys.lock)
    assert lock.depth == 0


def test_exit_never_hides_the_body_exception(lock_kind, prefix, name):
    lock = lock_kind.make(name, prefix=prefix)
    with pytest.raises(ValueError, match="from the body") as info, lock:
        lock_kind.lose_data(lock)
        raise ValueError("from the body")
    assert lock.depth == 0
    # the failed release is not lost either: it is noted on the body's exception
    notes = getattr(info.value, "__notes__", [])
    assert any(name in note and "also failed" in note for note in notes)


def test_exit_body_exception_wins_over_a_lost_lock_taken_by_another(lock_kind, prefix,
                                                                    name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    thief = lock_kind.make(name, owner="thief", prefix=prefix, auto_renew=False)
    with pytest.raises(KeyError), lock:
        for server in lock_kind.clients:
            server.delete(lock.keys.lock)
        thief.acquire()
        raise KeyError("body")
    assert _field(r, thief, "owner") == "thief"
    thief.release()


def test_exit_without_body_exception_raises_failed_release(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    with pytest.raises(LockLost), lock:
        lock_kind.lose_data(lock)
    assert lock.depth == 0
    assert not r.exists(lock.keys.lock)


# -- construction -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl", [0, 0.0, -1, -0.001, math.nan, math.inf, -math.inf, True, False, "30", None,
            [30]],
)
def test_bad_ttl_is_refused(lock_kind, ttl):
    with pytest.raises(InvalidLockConfig) as info:
        lock_kind.make("some-lock", ttl=ttl)
    assert info.value.lock_name == "some-lock"
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, DLockError)


@pytest.mark.parametrize("name_", ["", None, 7, b"bytes"])
def test_bad_name_is_refused(lock_kind, name_):
    with pytest.raises(InvalidLockConfig):
        lock_kind.make(name_)


@pytest.mark.parametrize("field", ["owner", "count", "fence", "acquired_at", "ttl",
                                   "pid"])
def test_reserved_info_fields_are_refused(lock_kind, field):
    with pytest.raises(InvalidLockConfig, match=field):
        lock_kind.make("x", info={field: "1"})


@pytest.mark.parametrize(
    "kwargs",
    [{"prefix": ""}, {"owner": ""}, {"blocking_timeout": -1},
     {"blocking_timeout": math.nan}],
)
def test_other_bad_settings_are_refused(lock_kind, kwargs):
    with pytest.raises(InvalidLockConfig):
        lock_kind.make("x", **kwargs)


def test_missing_client_is_refused():
    """RedisLock's own client argument (RedlockLock's clients:
    tests/deployments/test_redlock.py::test_bad_construction_is_refused)."""
    with pytest.raises(InvalidLockConfig):
        RedisLock(None, "x")


def test_good_ttls_are_kept_in_milliseconds(lock_kind, prefix, name):
    assert lock_kind.make(name, ttl=1, prefix=prefix).ttl_ms == 1000
    assert lock_kind.make(name, ttl=2.5, prefix=prefix).ttl_ms == 2500
    assert lock_kind.make(name, ttl=0.0001, prefix=prefix).ttl_ms == 1


def test_lock_leaves_nothing_registered_after_release(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, prefix=prefix)
    lock.acquire()
    assert get_scheduler().is_registered(lock)
    assert queue_members(r, lock) == []
    lock.release()
    assert not get_scheduler().is_registered(lock)
