"""Hostile input is refused cleanly (an InvalidLockConfig naming the option) or met with
a LockKeyConflict that changes nothing: never a raw UnicodeEncodeError or TypeError,
never BackendUnavailable for another application's data."""

from __future__ import annotations

import pytest

from celery_dlock import InvalidLockConfig, LockedTask, LockKeyConflict, RedisLock


def test_a_fence_counter_that_is_not_an_integer_is_a_conflict(r, prefix, name):
    lock = RedisLock(r, name, 30, prefix=prefix)
    r.set(lock.keys.fence, "not a number")
    with pytest.raises(LockKeyConflict, match=r":fence.*not hold an integer"):
        lock.acquire(blocking=False)
    assert r.get(lock.keys.fence) == b"not a number"  # left untouched
    assert not r.exists(lock.keys.lock)  # and nothing written


def test_fail_open_does_not_run_a_body_unlocked_over_foreign_data(redis_url, prefix):
    from celery_helpers import close_app, test_app

    app = test_app("fo", redis_url, dlock_url=redis_url, dlock_key_prefix=prefix)
    ran: list[str] = []

    @app.task(base=LockedTask, shared=False, lock_key="k:{x}", lock_fail_open=True,
              on_contention="raise")
    def work(x):
        ran.append(x)

    try:
        lock = RedisLock(app.backend.client, "k:a", prefix=prefix)
        app.backend.client.set(lock.keys.fence, "foreign")
        with pytest.raises(LockKeyConflict):
            work.apply(("a",)).get()
        assert ran == []
    finally:
        close_app(app)


@pytest.mark.parametrize("bad", ["x{y", "x}", "{x}"])
def test_a_prefix_with_braces_is_refused_naming_it(r, name, bad):
    with pytest.raises(InvalidLockConfig, match="prefix"):
        RedisLock(r, name, prefix=bad)


def test_a_task_prefix_with_braces_is_refused_at_declaration(redis_url):
    from celery_helpers import close_app, test_app

    app = test_app("pfx", redis_url)
    app.finalize()
    try:
        with pytest.raises(InvalidLockConfig, match="lock_prefix"):
            @app.task(base=LockedTask, shared=False, name="pfx-bad", lock_prefix="a{b")
            def bad():
                return None
    finally:
        close_app(app)


@pytest.mark.parametrize("bad", ["lock-\ud800", "\udfff"])
def test_a_name_with_a_lone_surrogate_is_refused(r, bad):
    with pytest.raises(InvalidLockConfig, match="UTF-8"):
        RedisLock(r, bad)


@pytest.mark.parametrize("bad", ["5", [1], True, float("nan"), -1])
def test_a_bad_blocking_timeout_is_refused_naming_it(r, name, bad):
    with pytest.raises(InvalidLockConfig, match="blocking_timeout"):
        RedisLock(r, name, blocking_timeout=bad)
