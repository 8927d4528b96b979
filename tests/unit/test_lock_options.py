"""``LockOptions``: a lock's options as one frozen object, checked once where it is
made, and what every lock kind is made with (``Backend.lock(options)``,
``with_options``, the public constructors)."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from celery_dlock import InvalidLockConfig, RedisLock, RedisSemaphore, RedlockLock
from celery_dlock.backends.redis.backend import RedisBackend
from celery_dlock.backends.redis.redlock.backend import RedlockBackend
from celery_dlock.core.lock_options import LockOptions


@pytest.mark.parametrize(("changes", "said"), [
    ({"name": ""}, "non-empty name"),
    ({"prefix": "a{b"}, "prefix may not contain"),
    ({"owner": ""}, "owner must be a non-empty string"),
    ({"ttl": 0}, "ttl"),
    ({"ttl": float("nan")}, "ttl"),
    ({"blocking_timeout": -1}, "blocking_timeout"),
    ({"pause_budget": True}, "pause_budget"),
    ({"max_hold": 0}, "max_hold"),
    ({"limit": 0}, "limit must be an int >= 1"),
    ({"limit": True}, "limit must be an int >= 1"),
    ({"info": {"fence": "1"}}, "reserved field 'fence'"),
    ({"fence_ttl": 0}, "fence_ttl"),
    ({"fence_ttl": -1}, "fence_ttl"),
    ({"fence_ttl": float("nan")}, "fence_ttl"),
    ({"fence_ttl": "1"}, "fence_ttl"),
    ({"fence_ttl": True}, "fence_ttl"),
    ({"fence_ttl": 31 * 86400.0}, "fence_ttl"),
    ({"fence_ttl": 5}, r"fence_ttl \(5 s.*may not be shorter than the lock's ttl \(10"),
])
def test_a_bad_option_is_refused_where_the_options_are_made(
        changes: dict[str, object], said: str) -> None:
    fields = {"name": "n", "ttl": 10.0, **changes}
    with pytest.raises(InvalidLockConfig, match=said):
        LockOptions(**fields)  # type: ignore[arg-type]


def test_options_are_frozen_and_keep_their_own_copy_of_info() -> None:
    info = {"task_name": "t"}
    options = LockOptions("n", 10, info=info)
    info["task_name"] = "changed"
    assert options.info is not None and options.info["task_name"] == "t"
    assert options.info_fields["task_name"] == "t" and "host" in options.info_fields
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.ttl = 5  # type: ignore[misc]
    longer = options.replace(ttl=20)
    assert longer.ttl == 20 and options.ttl == 10 and longer.info_fields == \
        options.info_fields
    with pytest.raises(InvalidLockConfig):
        options.replace(ttl=-1)


def _clients(n: int) -> list[redis.Redis]:
    return [redis.Redis(host="127.0.0.1", port=1 + i) for i in range(n)]  # never used


def test_every_redis_kind_is_made_with_its_options() -> None:
    options = LockOptions("n", 12.5, prefix="p", owner="me", max_hold=60,
                          info={"task_name": "t"})
    one = RedisBackend(_clients(1)[0])
    lock = one.lock(options)
    assert isinstance(lock, RedisLock) and lock.options is options
    assert (lock.name, lock.prefix, lock.ttl, lock.max_hold) == ("n", "p", 12.5, 60)
    semaphore = one.lock(options.replace(limit=3))
    assert isinstance(semaphore, RedisSemaphore) and semaphore.limit == 3
    quorum = RedlockBackend(_clients(3)).lock(options)
    assert isinstance(quorum, RedlockLock) and quorum.options is options
    with pytest.raises(InvalidLockConfig, match="not supported with Redlock"):
        RedlockBackend(_clients(3)).lock(options.replace(limit=2))


def test_the_public_constructors_make_the_same_options() -> None:
    client = _clients(1)[0]
    lock = RedisLock(client, "n", 7, prefix="p", owner="me")
    assert lock.options == LockOptions("n", 7, prefix="p", owner="me")
    assert lock.options.fence_ttl is None and lock.options.fence_ttl_ms == 86_400_000
    # Unset, it stretches to a ttl longer than a day; given shorter, it is refused.
    assert LockOptions("n", 2 * 86400).fence_ttl_ms == 2 * 86_400_000
    sem = RedisSemaphore(client, "n", 2, 7, fence_ttl=7)
    assert sem.options.fence_ttl_ms == 7000
    with pytest.raises(InvalidLockConfig, match="one holder"):
        RedisLock.with_options(client, LockOptions("n", 7, limit=2))
