"""A name's fence counter expires (``fence_ttl``, ``dlock_fence_ttl``): no key of a name
lives for ever once its holds ended, whatever ended them, and a name idle past its
fence ttl still hands out a fence above every earlier one (docs/fencing.md)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from dlock_helpers import wait_until

from celery_dlock import (
    InvalidLockConfig,
    LockedTask,
    RedisLock,
    RedisSemaphore,
    RedlockLock,
)
from celery_dlock.backends.redis.inspect import force_release
from celery_dlock.backends.redis.scripts import RELEASE
from celery_dlock.core.lock_options import DEFAULT_FENCE_TTL
from celery_dlock.core.protocol import new_op_id

DAY_MS = round(DEFAULT_FENCE_TTL * 1000)


def _keys_and_ttls(client: redis.Redis, prefix: str, name: str) -> dict[bytes, int]:
    """Every key of the name ``name`` under ``prefix``, with its PTTL (-1: none)."""
    keys = list(client.scan_iter(match=f"{prefix}:{{{name}}}*", count=1000))
    return {k: int(client.pttl(k)) for k in keys}


def _check_every_key_expires(client: redis.Redis, prefix: str, name: str,
                             fence_key: str, keep_ms: int, ttl_ms: int) -> None:
    found = _keys_and_ttls(client, prefix, name)
    assert fence_key.encode() in found, found
    assert all(pttl != -1 for pttl in found.values()), \
        f"keys without expiry after the hold ended: {found}"
    # About the fence ttl (never more than the hold's ttl + it, set at the grant).
    assert keep_ms * 0.9 < found[fence_key.encode()] <= keep_ms + ttl_ms, found


@pytest.mark.parametrize("fence_ttl", [DEFAULT_FENCE_TTL, 60.0])
@pytest.mark.parametrize("end", ["release", "force_release", "expiry", "give_back"])
def test_no_key_of_a_lock_outlives_its_hold_without_expiry(r, prefix, name, end,
                                                          fence_ttl):
    ttl = 0.3 if end == "expiry" else 5.0
    lock = RedisLock(r, name, ttl=ttl, prefix=prefix, auto_renew=False, owner="me",
                     fence_ttl=fence_ttl)
    assert lock.acquire(blocking=False)
    if end == "give_back":
        # What an acquire does with a grant it cannot use (its caller timed out or
        # was told of a loss meanwhile): a release naming no fence.
        lock._give_back("me")
        assert not r.exists(lock.keys.lock)
        _check_every_key_expires(r, prefix, name, lock.keys.fence,
                                 round(fence_ttl * 1000), round(ttl * 1000))
        return
    assert lock.acquire(blocking=False)  # a re-entry: one more count, no new counter
    if end == "release":
        lock.release()
        lock.release()
        keep = round(fence_ttl * 1000)
    elif end == "force_release":
        assert force_release(r, prefix, name, by="test", reason="expiry test")
        # An operator's release does not know the name's fence ttl: it keeps the
        # counter at least a day, or as long as the grant set it when that is later.
        keep = max(DAY_MS, round(fence_ttl * 1000))
    else:
        assert wait_until(lambda: not r.exists(lock.keys.lock), timeout=5)
        keep = round(fence_ttl * 1000)
    _check_every_key_expires(r, prefix, name, lock.keys.fence, keep, round(ttl * 1000))


@pytest.mark.parametrize("end", ["release", "expiry"])
def test_no_key_of_a_semaphore_outlives_its_slots_without_expiry(r, prefix, name, end):
    ttl = 0.3 if end == "expiry" else 5.0
    sem = RedisSemaphore(r, name, 2, ttl=ttl, prefix=prefix, auto_renew=False,
                         fence_ttl=60)
    other = RedisSemaphore(r, name, 2, ttl=ttl, prefix=prefix, auto_renew=False,
                           owner="other", fence_ttl=60)
    assert sem.acquire(blocking=False)
    assert other.acquire(blocking=False)
    if end == "release":
        sem.release()
        other.release()
    else:
        assert wait_until(lambda: not r.zcard(sem.keys.lock), timeout=5)
    _check_every_key_expires(r, prefix, name, sem.keys.fence, 60_000, round(ttl * 1000))


def test_no_key_of_a_redlock_name_outlives_its_hold_without_expiry(redlock_servers,
                                                                   prefix, name):
    clients = [redis.Redis.from_url(s.url) for s in redlock_servers]
    try:
        lock = RedlockLock(clients, name, ttl=5, prefix=prefix, auto_renew=False,
                           fence_ttl=60)
        assert lock.acquire(blocking=False)
        lock.release()
        for client in clients:
            assert wait_until(lambda c=client: not c.exists(lock.keys.lock), timeout=5)
            _check_every_key_expires(client, prefix, name, lock.keys.fence, 60_000,
                                     5_000)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_name_idle_past_its_fence_ttl_gets_a_fence_above_every_earlier_one(
        r, prefix, name, kind):
    def make(owner: str) -> Any:
        if kind == "lock":
            return RedisLock(r, name, ttl=0.5, prefix=prefix, auto_renew=False,
                             owner=owner, fence_ttl=1)
        return RedisSemaphore(r, name, 1, ttl=0.5, prefix=prefix, auto_renew=False,
                              owner=owner, fence_ttl=1)

    fences = []
    for i in range(3):  # released holds, one after the other
        lock = make(f"o{i}")
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    last = make("expires")  # and one that expires, never released
    assert last.acquire(blocking=False)
    fences.append(last.fence)
    assert fences == sorted(set(fences))
    # Idle: the counter expires (within the hold's ttl + the fence ttl of its grant).
    assert wait_until(lambda: not r.exists(last.keys.fence), timeout=5), \
        f"the fence counter never expired: pttl {r.pttl(last.keys.fence)}"
    # Nothing of the name is left but keys that expire (a semaphore's release markers).
    left = _keys_and_ttls(r, prefix, name)
    assert all(pttl != -1 for pttl in left.values()), left
    again = make("again")
    assert again.acquire(blocking=False)
    assert again.fence > max(fences), (again.fence, fences)
    again.release()


def _body() -> None:
    """A task body (Celery needs a named function)."""


def _app(**conf: object) -> Any:
    from celery import Celery

    app = Celery("fence-ttl", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url="redis://127.0.0.1:1/0", **conf)
    app.finalize()  # the decorator builds the task class at once
    return app


def test_a_task_with_a_fence_ttl_shorter_than_its_ttl_is_refused_at_declaration():
    task = _app().task(base=LockedTask, name="ft_ok", lock_ttl=30, lock_fence_ttl=600,
                       shared=False)(_body)
    assert task.dlock_settings()["lock_fence_ttl"] == 600
    with pytest.raises(InvalidLockConfig, match=r"lock_fence_ttl \(60 s.*lock_ttl"):
        _app().task(base=LockedTask, name="ft_bad", lock_ttl=600, lock_fence_ttl=60,
                    shared=False)(_body)
    with pytest.raises(InvalidLockConfig, match=r"lock_fence_ttl.*lock_ttl"):
        _app(dlock_fence_ttl=60).task(base=LockedTask, name="ft_app", lock_ttl=600,
                                      shared=False)(_body)


def test_a_counter_left_without_expiry_gets_one_at_the_next_hold(r, prefix, name):
    # A counter written before fence_ttl existed has no expiry: the next grant (and
    # release) of the name gives it one.
    lock = RedisLock(r, name, ttl=5, prefix=prefix, auto_renew=False, fence_ttl=60)
    r.set(lock.keys.fence, str(int(time.time() * 1e6) + 10**9))
    assert r.pttl(lock.keys.fence) == -1
    assert lock.acquire(blocking=False)
    assert 0 < r.pttl(lock.keys.fence) <= 65_000
    lock.release()
    assert 54_000 < r.pttl(lock.keys.fence) <= 65_000


def test_a_hold_that_outlives_its_counter_still_tells_a_resent_release(r, prefix, name):
    # Extended past its ttl + fence ttl, the hold outlives the counter its grant wrote;
    # its final release writes the counter again, so a re-send of that release (same
    # operation id, its reply lost) still learns that it freed the lock.
    lock = RedisLock(r, name, ttl=0.5, prefix=prefix, auto_renew=False, owner="me",
                     fence_ttl=1)
    assert lock.acquire(blocking=False)
    lock.extend(10)
    assert wait_until(lambda: not r.exists(lock.keys.fence), timeout=5)
    assert r.hget(lock.keys.lock, "owner") == b"me"  # the hold lives on
    args = ("me", new_op_id(), str(lock.fence), "", 1000)
    assert RELEASE(r, (lock.keys.lock,), args) == [1]
    assert RELEASE(r, (lock.keys.lock,), args) == [1]  # the re-send: "released"
    assert int(r.get(lock.keys.fence)) == lock.fence + 1
    assert 0 < r.pttl(lock.keys.fence) <= 1000
