"""Hostile input is refused cleanly (an InvalidLockConfig naming the option) or met with
a LockKeyConflict that changes nothing: never a raw UnicodeEncodeError or TypeError,
never BackendUnavailable for another application's data."""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from typing import Any

import cli_app
import pytest
from lock_kinds import NO_KEYS

from celery_dlock import InvalidLockConfig, LockedTask, LockKeyConflict, RedisLock
from celery_dlock.backends.redis.backend import RedisBackend
from celery_dlock.backends.redis.inspect import force_release
from celery_dlock.backends.redis.keyspace import LockKeys

#: What another application may keep at a lock's key: hashes that are not holds (no
#: owner; an owner and nothing else of a hold; a few of a hold's fields), and keys of
#: other types.  Each plants it with a client.
FOREIGN: dict[str, Callable[[Any, str], object]] = {
    "hash-without-owner": lambda c, k: c.hset(k, mapping={"name": "alice", "age": "7"}),
    "hash-with-only-an-owner": lambda c, k: c.hset(k, mapping={"owner": "bob",
                                                               "since": "monday"}),
    "hash-with-part-of-a-hold": lambda c, k: c.hset(k, mapping={
        "owner": "bob", "count": "1", "fence": "12", "extra": "x"}),
    # every field of a hold, one number in a form Python's float reads and Lua's
    # tonumber does not
    "hash-with-a-number-only-python-reads": lambda c, k: c.hset(k, mapping={
        "owner": "bob", "count": "1", "fence": "1_2", "acquired_at": "1", "ttl": "30",
        "ops": "|ab=1"}),
    "string": lambda c, k: c.set(k, "someone else's"),
    "list": lambda c, k: c.rpush(k, "a", "b"),
}


@pytest.fixture(params=sorted(FOREIGN))
def foreign(request: pytest.FixtureRequest) -> Callable[[Any, str], object]:
    return FOREIGN[request.param]


def _plant(clients: list[Any], key: str,
           foreign: Callable[[Any, str], object]) -> dict[int, bytes]:
    """``foreign`` at ``key`` on every client; what DUMP says of it on each."""
    for c in clients:
        foreign(c, key)
    return {i: c.dump(key) for i, c in enumerate(clients)}


def _assert_conflict(what: str, call: Callable[[], object], key: str) -> None:
    """``call`` raises LockKeyConflict naming ``key``."""
    try:
        call()
    except LockKeyConflict as exc:
        assert repr(key) in str(exc), (what, str(exc))
    else:
        pytest.fail(f"{what}: no LockKeyConflict")


def _assert_untouched(clients: list[Any], key: str, dumps: dict[int, bytes],
                      prefix: str) -> None:
    """``key`` is byte for byte as planted, still without an expiry, and nothing else
    was written under ``prefix`` (no fence counter, line of waiters or marker)."""
    for i, c in enumerate(clients):
        assert c.dump(key) == dumps[i]
        assert c.ttl(key) == -1
        assert [k.decode() for k in c.scan_iter(match=f"{prefix}:*")] == [key]


def test_foreign_data_at_the_lock_key_is_a_conflict_and_left_untouched(
        lock_kind, prefix, name, foreign):
    if lock_kind.name in ("postgres", "pg_semaphore", "mysql"):
        pytest.skip(NO_KEYS)
    if lock_kind.name == "zookeeper":
        pytest.skip("Redis values at a Redis key; ZooKeeper's foreign nodes at a lock's "
                    "path: tests/faults/test_zookeeper_faults.py::"
                    "test_another_applications_znode_at_the_lock_path_is_a_conflict")
    lock = lock_kind.make(name, 30, prefix=prefix, auto_renew=False)
    key = lock.keys.lock
    dumps = _plant(lock_kind.clients, key, foreign)
    calls = {"acquire": lambda: lock.acquire(blocking=False),
             "blocking acquire": lambda: lock.acquire(timeout=0.3),
             "release": lock.release, "extend": lock.extend}
    for what, call in calls.items():
        _assert_conflict(what, call, key)
        _assert_untouched(lock_kind.clients, key, dumps, prefix)


@pytest.mark.parametrize("lock_kind", ["redlock"], indirect=True)
def test_a_redlock_node_with_foreign_data_does_not_grant(lock_kind, prefix, name):
    """A foreign hash on a minority of the nodes: they do not grant and are left alone,
    the others make the quorum; on a majority: LockKeyConflict."""
    lock = lock_kind.make(name, 30, prefix=prefix, auto_renew=False)
    key = lock.keys.lock
    first, *others = lock_kind.clients
    dumps = _plant([first], key, FOREIGN["hash-without-owner"])
    assert lock.acquire(blocking=False)
    lock.extend(20)
    lock.release()
    assert first.dump(key) == dumps[0] and first.ttl(key) == -1
    assert not any(c.exists(key) for c in others)
    _plant(others[:1], key, FOREIGN["hash-without-owner"])
    with pytest.raises(LockKeyConflict, match=re.escape(repr(key))):
        lock.acquire(blocking=False)
    assert first.dump(key) == dumps[0] and first.ttl(key) == -1


def test_a_force_release_leaves_foreign_data_alone(r, prefix, name, foreign):
    key = LockKeys.for_name(prefix, name).lock
    dumps = _plant([r], key, foreign)
    backend = RedisBackend(r)
    calls = {
        "force_release": lambda: force_release(r, prefix, name, by="ops@host",
                                               reason="stuck"),
        "force_release with a fence": lambda: force_release(r, prefix, name, fence=12),
        "backend.force_release": lambda: backend.force_release(prefix, name),
        # the fields a worker names to free the hold of a child that died
        "release_matching": lambda: backend.force_release(
            prefix, name, conditions={"owner": "bob"}),
        "release_matching on other fields": lambda: backend.force_release(
            prefix, name, conditions={"name": "alice", "age": "7"}),
    }
    for what, call in calls.items():
        _assert_conflict(what, call, key)
        _assert_untouched([r], key, dumps, prefix)


def test_celery_dlock_release_force_leaves_foreign_data_alone(redis_url, r, prefix,
                                                              name, foreign):
    key = LockKeys.for_name(prefix, name).lock
    dumps = _plant([r], key, foreign)
    proc = cli_app.run_cli(redis_url, prefix, "release", "--force", name)
    assert proc.returncode != 0, proc.stdout
    assert repr(key) in proc.stderr and "left untouched" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    _assert_untouched([r], key, dumps, prefix)


def test_a_fence_counter_that_is_not_an_integer_is_a_conflict(r, prefix, name):
    lock = RedisLock(r, name, 30, prefix=prefix)
    r.set(lock.keys.fence, "not a number")
    with pytest.raises(LockKeyConflict, match=r":fence.*not hold an integer"):
        lock.acquire(blocking=False)
    assert r.get(lock.keys.fence) == b"not a number"  # left untouched
    assert not r.exists(lock.keys.lock)  # and nothing written


@pytest.mark.parametrize("where", ["fence counter", "lock key"])
def test_fail_open_does_not_run_a_body_unlocked_over_foreign_data(redis_url, prefix,
                                                                  where):
    from celery_helpers import close_app, test_app

    app = test_app("fo", redis_url, dlock_url=redis_url, dlock_key_prefix=prefix)
    ran: list[str] = []

    @app.task(base=LockedTask, shared=False, lock_key="k:{x}", lock_fail_open=True,
              on_contention="raise")
    def work(x):
        ran.append(x)

    try:
        client = app.backend.client
        lock = RedisLock(client, "k:a", prefix=prefix)
        if where == "fence counter":
            client.set(lock.keys.fence, "foreign")
        else:
            FOREIGN["hash-without-owner"](client, lock.keys.lock)
        dump = client.dump(lock.keys.lock)
        with pytest.raises(LockKeyConflict):
            work.apply(("a",)).get()
        assert ran == []
        assert client.dump(lock.keys.lock) == dump
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


#: Names every store must take, each as a lock of its own: 5,000 characters no codec
#: shrinks, a NUL, Unicode past the BMP (tests/faults/test_sql_faults.py checks how
#: the SQL stores list them).
HARD_NAMES = {
    "long": "".join(random.Random(31).choices(string.ascii_letters + string.digits,
                                              k=5000)),
    "nul": "a\x00b",
    "unicode": "ключ-日本-\U0001f512",
}


@pytest.mark.parametrize("label", sorted(HARD_NAMES))
def test_every_store_takes_every_name_as_one_lock(lock_kind, label):
    """One contract: a name one store takes, every store takes (PostgreSQL refused a
    long name or a NUL as an outage); and ``name + NUL`` is another lock."""
    name = HARD_NAMES[label]
    holder = lock_kind.make(name, ttl=10, owner="holder")
    other = lock_kind.make(name, ttl=10, owner="other")
    beside = lock_kind.make(name + "\x00", ttl=10, owner="other")
    assert holder.acquire(blocking=False)
    try:
        assert other.acquire(blocking=False) is False
        assert beside.acquire(blocking=False)  # a name of its own
        beside.release()
        assert holder.holder().owner == "holder"
    finally:
        holder.release()
    assert other.acquire(blocking=False)
    other.release()
