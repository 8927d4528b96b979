"""A holder whose lock was freed by ``celery dlock release`` learns who did it and why.

The release script leaves a short-lived marker (``P:{NAME}:released``) naming the freed
hold; the holder reads it when it finds its hold gone (renewal, ``ensure_held``,
``extend``, ``release``) and its loss reason, ``on_lost``, ``LockLost`` and the
``lock_lost`` signal say ``released by USER@HOST with celery dlock release --force:
REASON``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import cli_app
import pytest
import redis
from dlock_helpers import wait_until
from task_env import TaskEnv, new_app, running

from celery_dlock import LockedTask, LockKeyConflict, LockLost, RedisLock, signals
from celery_dlock.backends.redis.inspect import force_release, iter_locks
from celery_dlock.backends.redis.scripts import FORCE_RELEASE

RESULT_TIMEOUT = 30




def _release(url: str, prefix: str, name: str, reason: str) -> None:
    proc = cli_app.run_cli(url, prefix, "release", name, "--force", "--reason", reason)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Released lock {name!r}" in proc.stdout


def _marker(prefix: str, name: str) -> str:
    return f"{prefix}:{{{name}}}:released"


class _Lost:
    """An ``on_lost`` callback recording the reason each time it is called."""

    def __init__(self) -> None:
        self.reasons: list[str | None] = []
        self.event = threading.Event()

    def __call__(self, lock: RedisLock) -> None:
        self.reasons.append(lock._lost_reason)
        self.event.set()


def test_renewing_holder_is_told_who_released_it_and_why(redis_url: str, r: redis.Redis,
                                                          prefix: str, name: str
                                                          ) -> None:
    lost = _Lost()
    lock = RedisLock(redis.Redis.from_url(redis_url), name, ttl=3, prefix=prefix,
                     on_lost=lost)
    assert lock.acquire(blocking=False)
    _release(redis_url, prefix, name, "disk full on db-2, ticket 42")
    # The scheduler renews every ttl/3 (1 s): it finds the hold gone and says why.
    assert lost.event.wait(10), "the holder was never told"
    (reason,) = lost.reasons
    assert reason is not None
    assert reason.startswith("released by ") and "@" in reason, reason
    assert "with celery dlock release --force" in reason, reason
    assert reason.endswith(": disk full on db-2, ticket 42"), reason
    assert lock._lost_reason == reason and lock.lost
    with pytest.raises(LockLost) as info:
        lock.ensure_held()
    assert "disk full on db-2, ticket 42" in str(info.value)
    with pytest.raises(LockLost) as info:
        lock.release()
    assert "disk full on db-2, ticket 42" in str(info.value)


@pytest.mark.parametrize("how", ["ensure_held", "extend", "release"])
def test_holder_without_renewal_finds_the_reason_when_it_asks(redis_url: str,
                                                               r: redis.Redis,
                                                               prefix: str, name: str,
                                                               how: str) -> None:
    lost = _Lost()
    lock = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False, on_lost=lost)
    assert lock.acquire(blocking=False)
    _release(redis_url, prefix, name, "stuck since Monday")
    with pytest.raises(LockLost) as info:
        getattr(lock, how)()
    assert "stuck since Monday" in str(info.value), str(info.value)
    assert "with celery dlock release --force" in str(info.value)
    assert lost.reasons == [lock._lost_reason]
    assert lock._lost_reason is not None and "stuck since Monday" in lock._lost_reason


def test_marker_of_an_older_hold_does_not_explain_a_newer_loss(r: redis.Redis,
                                                               prefix: str, name: str
                                                               ) -> None:
    lock = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False, owner="same")
    assert lock.acquire(blocking=False)
    assert force_release(r, prefix, name, by="op@box", reason="first hold") is not None
    with pytest.raises(LockLost):
        lock.ensure_held()
    # The same owner takes the lock again (a new fence); that hold then expires.
    with pytest.raises(LockLost):
        lock.release()
    assert lock.acquire(blocking=False)
    r.delete(lock.keys.lock)
    assert r.exists(_marker(prefix, name))  # the first hold's marker is still there
    with pytest.raises(LockLost) as info:
        lock.ensure_held()
    assert "first hold" not in str(info.value) and "expired" in str(info.value)


def test_reason_is_one_short_line_without_passwords(r: redis.Redis, prefix: str,
                                                    name: str) -> None:
    lock = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    long_text = "see redis://admin:hunter2@db:6379/0\nthen " + "x" * 5000
    force_release(r, prefix, name, by="op@box", reason=long_text)
    stored = r.hget(_marker(prefix, name), "reason")
    assert stored is not None and b"hunter2" not in stored and b"\n" not in stored
    assert len(stored) <= 200
    with pytest.raises(LockLost) as info:
        lock.ensure_held()
    assert "hunter2" not in str(info.value) and "redis://admin:**@db" in str(info.value)
    assert len(str(info.value)) < 400


def test_marker_expires_and_is_never_listed_as_a_lock(redis_url: str, r: redis.Redis,
                                                      prefix: str, name: str) -> None:
    # ttl 30 s: less than the marker's minute, and more than the four CLI runs below
    # take on a loaded machine (at 5 s the holder's own deadline could come first).
    short = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False)
    long_ = RedisLock(r, name + "-long", ttl=600, prefix=prefix, auto_renew=False)
    assert short.acquire(blocking=False) and long_.acquire(blocking=False)
    _release(redis_url, prefix, name, "short")
    _release(redis_url, prefix, name + "-long", "long")
    # Kept for what the hold had left, but at least a minute and at most an hour.
    assert 50_000 < r.pttl(_marker(prefix, name)) <= 60_000
    assert 590_000 < r.pttl(_marker(prefix, name + "-long")) <= 600_000
    assert list(iter_locks(r, prefix)) == []
    proc = cli_app.run_cli(redis_url, prefix, "ls", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    proc = cli_app.run_cli(redis_url, prefix, "show", name)
    assert proc.returncode != 0 and "No lock named" in proc.stderr
    # The lock itself works as before: its holder learns of the loss at its next
    # contact (a re-entry takes nothing), and a new hold is listed alone.
    with pytest.raises(LockLost, match="released by"):
        short.acquire(blocking=False)
    with pytest.raises(LockLost):
        short.release()
    assert short.acquire(blocking=False)
    assert [i.key for i in iter_locks(r, prefix)] == [name]
    short.release()


def test_no_marker_when_nothing_was_removed(redis_url: str, r: redis.Redis, prefix: str,
                                            name: str) -> None:
    proc = cli_app.run_cli(redis_url, prefix, "release", name, "--force", "--reason",
                           "nothing")
    assert proc.returncode != 0 and "No lock named" in proc.stderr
    assert not r.exists(_marker(prefix, name))
    lock = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    with pytest.raises(Exception, match="nothing was released"):
        force_release(r, prefix, name, fence=(lock.fence or 0) + 100, reason="wrong")
    assert not r.exists(_marker(prefix, name))
    assert lock.owned()
    # A release that does not say who it is (a worker freeing the lock of a dead
    # child: the holder is gone) frees the hold and leaves no marker either.
    reply = FORCE_RELEASE(r, (lock.keys.lock,), ("fence", str(lock.fence)))
    assert int(reply[0]) == 1 and not r.exists(lock.keys.lock)
    assert not r.exists(_marker(prefix, name))


def test_foreign_data_under_the_marker_is_a_key_conflict(r: redis.Redis, prefix: str,
                                                         name: str) -> None:
    lock = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    r.set(_marker(prefix, name), "someone else's")
    with pytest.raises(LockKeyConflict) as info:
        force_release(r, prefix, name, reason="x")
    assert ":released" in str(info.value)
    assert lock.owned()  # nothing was written
    assert r.get(_marker(prefix, name)) == b"someone else's"
    lock.release()
    r.delete(_marker(prefix, name))


# -- a LockedTask on a real worker --------------------------------------------------


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[TaskEnv]:
    e = new_app(redis_url)

    def body(self: Any, x: str) -> str:
        e.log(kind="started", x=x, fence=self.lock.fence)
        deadline = time.monotonic() + 20
        while not self.lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        e.log(kind="end", x=x, lost=self.lock.lost)
        return "done"

    e.tasks["held"] = e.app.task(base=LockedTask, shared=False, bind=True,
                                 name="reason_held", lock_key="r:{x}",
                                 lock_ttl=3)(body)
    with running(e, concurrency=1):
        yield e


def test_locked_task_lock_lost_signal_has_the_reason(env: TaskEnv, redis_url: str
                                                     ) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kw: Any) -> None:
        seen.append(kw)

    signals.lock_lost.connect(receiver, weak=False)
    try:
        x = uuid.uuid4().hex[:8]
        res = env.tasks["held"].delay(x)
        assert wait_until(lambda: env.events(kind="started", x=x), timeout=20)
        _release(redis_url, env.prefix, f"r:{x}", "deploy froze, INC-9")
        assert wait_until(lambda: [s for s in seen if s["name"] == f"r:{x}"], timeout=15)
        (sig,) = [s for s in seen if s["name"] == f"r:{x}"]
        assert "with celery dlock release --force: deploy froze, INC-9" in sig["reason"]
        (started,) = env.events(kind="started", x=x)
        assert sig["fence"] == started["fence"]
        with pytest.raises(LockLost) as info:
            res.get(timeout=RESULT_TIMEOUT)
        assert "deploy froze, INC-9" in str(info.value)
    finally:
        signals.lock_lost.disconnect(receiver)
