"""The deadline rule: drift, the pause budget and the clock (no server needed)."""

from __future__ import annotations

import time

import pytest

from celery_dlock.core.deadline import (
    DRIFT_RATE,
    clock,
    lease_end,
    margin_of,
    pause_budget,
)
from celery_dlock.core.scheduler import RenewalScheduler


def test_the_default_pause_budget_covers_a_second_long_pause_at_ttl_30():
    assert pause_budget(30.0) >= 1.0
    # and the deadline keeps both the drift and that budget back from the ttl
    assert lease_end(100.0, 30_000) <= 100.0 + 30.0 * (1 - DRIFT_RATE) - 1.0


@pytest.mark.parametrize("ttl", [0.5, 1.0, 3.0, 10.0, 30.0, 300.0])
def test_the_margin_beyond_drift_is_at_least_50ms_and_leaves_room_to_renew(ttl):
    budget = pause_budget(ttl)
    assert budget >= 0.05
    # renewals come every ttl/3: the deadline leaves room for more than one
    assert lease_end(0.0, int(ttl * 1000)) > ttl / 3 * 1.4


def test_a_configured_budget_is_used_up_to_half_the_ttl():
    assert pause_budget(30.0, 5.0) == 5.0
    assert pause_budget(30.0, 0.0) == 0.0
    assert pause_budget(4.0, 10.0) == 2.0
    assert margin_of(30_000, 5.0) == pytest.approx(30.0 * DRIFT_RATE + 5.0)


def test_a_bad_pause_budget_is_refused_naming_it(lock_kind, name):
    from celery_dlock import InvalidLockConfig

    for bad in (-1, float("nan"), "2", True):
        with pytest.raises(InvalidLockConfig, match="pause_budget"):
            lock_kind.make(name, 30, pause_budget=bad)


def test_a_lock_s_deadline_keeps_its_pause_budget(r, prefix, name):
    from celery_dlock import RedisLock

    t = [1000.0]
    hb = RenewalScheduler(clock=lambda: t[0], start_thread=False)
    told: list[object] = []
    lock = RedisLock(r, name, 30, prefix=prefix, scheduler=hb, auto_renew=False,
                     pause_budget=5.0, on_lost=told.append)
    lock.acquire()
    try:
        hb.renew_due(1000.0 + 30 - 0.3 - 5.0 - 0.01)
        assert told == []
        hb.renew_due(1000.0 + 30 - 0.3 - 5.0 + 0.01)
        assert told == [lock]
    finally:
        lock.release_all()


def test_extend_moves_the_deadline_with_the_new_ttl_s_margin(r, prefix, name):
    from celery_dlock import RedisLock

    t = [1000.0]
    hb = RenewalScheduler(clock=lambda: t[0], start_thread=False)
    told: list[object] = []
    lock = RedisLock(r, name, 3, prefix=prefix, scheduler=hb, auto_renew=False,
                     on_lost=told.append)
    lock.acquire()
    try:
        lock.extend(60)  # sent at 1000: deadline 1000 + 60 - 0.6 - 2.0
        hb.renew_due(1000.0 + 57.3)
        assert told == []
        hb.renew_due(1000.0 + 57.5)
        assert told == [lock]
    finally:
        lock.release_all()


def test_the_clock_counts_suspended_time_where_the_platform_can():
    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("no CLOCK_BOOTTIME on this platform: time.monotonic is used")
    assert abs(clock() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 0.5
    assert RenewalScheduler(start_thread=False).now() == pytest.approx(
        time.clock_gettime(time.CLOCK_BOOTTIME), abs=0.5)


def test_a_task_s_pause_budget_reaches_its_lock(redis_url):
    from celery_helpers import close_app, test_app

    from celery_dlock import InvalidLockConfig, LockedTask

    app = test_app("pb", redis_url, dlock_url=redis_url, dlock_pause_budget=3.0)
    seen: dict[str, object] = {}

    @app.task(base=LockedTask, bind=True, shared=False, lock_ttl=30)
    def by_app(self):
        seen["app"] = self.lock.pause_budget

    @app.task(base=LockedTask, bind=True, shared=False, lock_ttl=30,
              lock_pause_budget=0.5)
    def by_task(self):
        seen["task"] = self.lock.pause_budget

    try:
        by_app.apply().get()
        by_task.apply().get()
        assert seen == {"app": 3.0, "task": 0.5}
        app.finalize()  # the decorator builds the task class at once
        with pytest.raises(InvalidLockConfig, match="lock_pause_budget"):
            @app.task(base=LockedTask, shared=False, name="pb-bad", lock_pause_budget=-1)
            def bad():
                return None
    finally:
        close_app(app)
