"""``max_hold``: renewal stops at the bound, the holder is told before anyone else can
take the lock, and another owner takes it once the server's hold ends; on every kind of
lock (the ``lock_kind`` fixture; a ZooKeeper holder deletes its node once told, since
its session would keep the node alive)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_dlock import InvalidLockConfig, LockedTask, LockLost
from celery_dlock.core.owner import owner_context
from celery_dlock.core.scheduler import RenewalScheduler
from celery_dlock.task.startup import check_app

TTL = 1.0
MAX_HOLD = 2.5


@pytest.fixture
def t(lock_kind) -> SimpleNamespace:
    """The ttl, max hold and renewal interval of a kind's tests: on ZooKeeper a ttl of
    2 s, its shortest session (a 1 s ttl keeps a 2 s session, whose connection a
    loaded machine can drop and re-open within one ttl)."""
    scale = 2.0 if lock_kind.name == "zookeeper" else 1.0
    return SimpleNamespace(ttl=TTL * scale, max_hold=MAX_HOLD * scale,
                           interval=TTL * scale / 3)


def _other_takes_it(lock_kind, name, ttl: float, told_at: list[float], limit: float
                    ) -> tuple[float, bool]:
    """Another owner polls for the lock until it gets it (bounded by ``limit``
    seconds); the moment it did and whether the holder had been told by then."""
    other = lock_kind.make(name, ttl, auto_renew=False)
    deadline = time.monotonic() + limit
    with owner_context():
        while time.monotonic() < deadline:
            if other.acquire(blocking=False):
                got = time.monotonic()
                told_first = bool(told_at) and told_at[0] <= got
                other.release()
                return got, told_first
            time.sleep(0.01)
    raise AssertionError("the other owner never got the lock")


def test_renewal_stops_at_the_bound_and_the_holder_is_told_first(lock_kind, name, t):
    told_at: list[float] = []
    lock = lock_kind.make(name, t.ttl, max_hold=t.max_hold,
                          on_lost=lambda _lock: told_at.append(time.monotonic()))
    start = time.monotonic()
    assert lock.acquire(blocking=False)
    got_at, told_first = _other_takes_it(lock_kind, name, t.ttl, told_at, t.max_hold + 5)

    assert len(told_at) == 1, "on_lost runs once"
    # Told no later than one renewal interval past the bound (generous for CI).
    assert told_at[0] - start <= t.max_hold + t.interval + 0.5
    # Renewed until close to the bound: not told at the first ttl.
    assert told_at[0] - start >= t.max_hold - t.interval - 0.2, lock.lost_reason
    assert told_first, "another owner got the lock before the holder was told"
    assert got_at - start >= t.max_hold - 0.3
    assert lock.lost and "max hold" in (lock.lost_reason or "")
    with pytest.raises(LockLost, match="max hold"):
        lock.ensure_held()
    with pytest.raises(LockLost, match="max hold"):
        lock.release()
    assert lock.depth == 0


def test_reentry_and_extend_do_not_move_the_bound(lock_kind, name, t):
    told: list[object] = []
    lock = lock_kind.make(name, t.ttl, max_hold=t.max_hold, on_lost=told.append)
    start = time.monotonic()
    lock.acquire()
    # Re-enter and extend again and again: neither makes the hold outlive its bound.
    deadline = start + t.max_hold + 3
    while not lock.lost and time.monotonic() < deadline:
        try:
            lock.acquire(blocking=False)
            lock.release()
            lock.extend(t.ttl)
        except LockLost as exc:
            assert "max hold" in str(exc)
            break
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    assert lock.lost and "max hold" in (lock.lost_reason or "")
    assert told == [lock]
    assert elapsed <= t.max_hold + t.interval + 0.5
    with pytest.raises(LockLost):
        lock.acquire(blocking=False)
    with pytest.raises(LockLost):
        lock.release()
    # The server's hold ends at the bound (plus a request's delay), not a ttl later.
    end = time.monotonic() + 2.0
    while lock.locked() and time.monotonic() < end:
        time.sleep(0.02)
    assert not lock.locked()
    assert time.monotonic() - start <= t.max_hold + 0.5


def test_a_fresh_hold_gets_a_fresh_bound(lock_kind, name, t):
    lock = lock_kind.make(name, t.ttl, max_hold=t.max_hold)
    lock.acquire()
    time.sleep(0.5)
    lock.release()
    assert lock.acquire(blocking=False)
    time.sleep(t.max_hold - 0.7)  # past the first hold's bound, not the second's
    assert not lock.lost
    lock.ensure_held()
    lock.release()


def test_without_max_hold_the_hold_is_renewed_past_it(lock_kind, name, t):
    lock = lock_kind.make(name, t.ttl)
    lock.acquire()
    done = threading.Event()
    done.wait(t.max_hold + t.interval + 0.3)
    assert not lock.lost
    lock.ensure_held()
    lock.release()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "3", True, 0.0001])
def test_bad_max_hold_is_refused(lock_kind, name, bad):
    with pytest.raises(InvalidLockConfig, match="max_hold"):
        lock_kind.make(name, TTL, max_hold=bad)


def test_a_max_hold_below_the_ttl_cuts_the_grant_and_tells_the_holder_first(
        lock_kind, name, t):
    """"At most S seconds" with S below the ttl: the grant itself lasts S, the hold is
    never renewed, the holder is told before the bound, and another owner acquires at
    the bound, far sooner than the ttl would allow."""
    ttl, max_hold = t.ttl * 6, t.ttl * 1.5
    told_at: list[float] = []
    lock = lock_kind.make(name, ttl, max_hold=max_hold,
                          on_lost=lambda _lock: told_at.append(time.monotonic()))
    start = time.monotonic()
    assert lock.acquire(blocking=False)
    got_at, told_first = _other_takes_it(lock_kind, name, ttl, told_at, ttl)
    assert told_first, "another owner got the lock before the holder was told"
    assert len(told_at) == 1 and lock.lost
    assert "max hold" in (lock.lost_reason or "")
    assert told_at[0] - start <= max_hold + 0.5
    assert got_at - start >= max_hold * 0.8
    assert got_at - start <= max_hold + 1.5, "the grant outlived the max hold"
    with pytest.raises(LockLost, match="max hold"):
        lock.release()


# -- LockedTask: lock_max_hold is checked where it is given ---------------------------


def _body() -> None:
    """A task body (Celery needs a named function)."""


def _app(**conf: object) -> Celery:
    app = Celery("max-hold", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url="redis://127.0.0.1:1/0", **conf)
    app.finalize()  # the decorator builds the task class at once
    return app


def test_a_task_max_hold_below_its_ttl_is_accepted_and_a_bad_one_refused():
    task = _app().task(base=LockedTask, name="mh_short", lock_ttl=30, lock_max_hold=10,
                       shared=False)(_body)
    assert task.dlock_settings()["lock_max_hold"] == 10
    with pytest.raises(InvalidLockConfig, match="lock_max_hold"):
        _app().task(base=LockedTask, name="mh_bad", lock_max_hold="5",
                    shared=False)(_body)


def test_an_app_max_hold_below_a_task_ttl_passes_the_worker_start():
    app = _app(dlock_lock_max_hold=5)
    app.task(base=LockedTask, name="mh_app", lock_ttl=10, shared=False)(_body)
    check_app(app)
    app.conf.dlock_lock_max_hold = -1
    with pytest.raises(InvalidLockConfig, match="lock_max_hold"):
        check_app(app)


# -- the scheduler's side, on an injected clock ----------------------------------------


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_last_renewal_reaches_the_bound_and_none_follows(lock_kind, name):
    clock = _Clock()
    hb = RenewalScheduler(clock=clock, start_thread=False)
    told: list[str | None] = []
    lock = lock_kind.make(name, 3.0, max_hold=4.0, scheduler=hb,
                          on_lost=lambda lk: told.append(lk.lost_reason))
    lock.acquire()  # at 1000: bound 1004
    try:
        hb.renew_due(1001.0)  # asks for 3 s: up to 1004, the bound exactly
        hb.renew_due(1002.0)  # asks only for the 2 s left
        calls = hb.renewal_calls
        assert calls == 2
        assert not told
        hb.renew_due(1003.0)  # at its bound: not renewed again ...
        assert hb.renewal_calls == calls
        assert not told  # ... and not lost before its deadline (1004 less the margin)
        hb.renew_due(1004.0)
        assert told == ["max hold of 4s reached"]
        assert lock.lost_reason == "max hold of 4s reached"
    finally:
        lock.release_all()
