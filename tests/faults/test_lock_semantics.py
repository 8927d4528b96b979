"""The lock core's semantics where the happy path does not look: re-entry with mixed
ttls, dead waiters, threads, stale reports, bad input, hostile names and owners.

The contract's tests run on every lock kind (``lock_kind``, tests/lock_kinds.py); those
about Redis itself (the line of waiters, key layout, the client argument, eviction)
run on RedisLock alone, and those about dead waiters and foreign data also on a
one-slot RedisSemaphore (``kind``)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest
import redis
from dlock_helpers import queue_members, wait_in_line, wait_until
from lock_kinds import NO_LONGER_SESSION, ONE_SERVER_KINDS, OneServerKind

from celery_dlock import (
    BackendUnavailable,
    DLockError,
    InvalidLockConfig,
    LockLost,
    LockNotOwned,
    RedisLock,
)
from celery_dlock.ops.embedded import EmbeddedRedis

# -- 1. re-entry never shortens --------------------------------------------------------


@pytest.mark.slow
def test_reentry_with_a_shorter_ttl_never_shortens_the_outer_hold(lock_kind, prefix,
                                                                   name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    outer = lock_kind.make(name, ttl=9, prefix=prefix)
    other = lock_kind.make(name, ttl=9, prefix=prefix, owner="other")
    with outer:
        inner = lock_kind.make(name, ttl=1, prefix=prefix)
        with inner:
            time.sleep(1.5)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert not other.acquire(blocking=False), \
                "another owner acquired while the outer hold was running"
            time.sleep(0.05)
        assert r.pttl(outer.keys.lock) > 4000


# -- 12. renewal never undoes extend() -------------------------------------------------


@pytest.mark.slow
def test_renewal_does_not_undo_an_extend_by_another_object(lock_kind, prefix, name):
    if lock_kind.name == "zookeeper":
        pytest.skip(NO_LONGER_SESSION)
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    l1 = lock_kind.make(name, ttl=2, prefix=prefix)
    l1.acquire()
    l2 = lock_kind.make(name, ttl=2, prefix=prefix)  # same thread: same owner
    l2.extend(30)
    time.sleep(5)
    assert r.pttl(l1.keys.lock) > 20_000
    l1.release()


# -- 5. a killed waiter does not reserve a free lock -----------------------------------


@pytest.fixture(params=sorted(ONE_SERVER_KINDS))
def kind(request: pytest.FixtureRequest) -> OneServerKind:
    """A lock, and a semaphore of one slot: a dead waiter is the same fault on both."""
    return ONE_SERVER_KINDS[request.param]


def _kill_a_waiter_in_line(redis_url: str, r: redis.Redis, holder: Any) -> None:
    """Start a process that waits in ``holder``'s line, check the line's keys carry a
    TTL, and SIGKILL it there.  (Redis only: a blocked RedlockLock waits in no line, it
    tries again after a random delay; docs/deployments.md, Redlock.)"""
    ctx = multiprocessing.get_context("spawn")
    waiter = ctx.Process(target=wait_in_line,
                         args=(redis_url, holder.prefix, holder.name, "doomed",
                               getattr(holder, "limit", None)))
    waiter.start()
    try:
        assert wait_until(lambda: queue_members(r, holder) == ["doomed"], timeout=20)
        # The line's keys expire by themselves.
        assert r.pttl(holder.keys.queue) > 0 and r.pttl(holder.keys.leases) > 0
        assert waiter.pid is not None
        os.kill(waiter.pid, signal.SIGKILL)
        waiter.join(10)
    finally:
        if waiter.is_alive():
            waiter.kill()


@pytest.mark.slow
def test_killed_waiter_does_not_reserve_the_freed_lock(kind, redis_url, r, prefix,
                                                       name):
    holder = kind.make(r, name, ttl=30, prefix=prefix)
    holder.acquire()
    _kill_a_waiter_in_line(redis_url, r, holder)
    holder.release()
    released = time.monotonic()
    newcomer = kind.make(r, name, ttl=30, prefix=prefix, owner="newcomer")
    assert newcomer.acquire(timeout=5)
    waited = time.monotonic() - released
    assert waited < 1.5, f"a dead waiter kept the free lock for {waited:.2f}s"
    newcomer.release()


@pytest.mark.slow
def test_wait_line_keys_expire_when_every_waiter_is_gone(kind, redis_url, r, prefix,
                                                         name):
    holder = kind.make(r, name, ttl=30, prefix=prefix)
    holder.acquire()
    _kill_a_waiter_in_line(redis_url, r, holder)
    # Nobody releases or acquires: the line's keys still go away.
    assert wait_until(lambda: not r.exists(holder.keys.queue, holder.keys.leases),
                      timeout=15)
    holder.release()


# -- 6. checks answer for the calling owner --------------------------------------------


def _in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return out


def test_checks_from_another_thread_answer_for_that_thread(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=10, prefix=prefix)
    lock.acquire()
    pttl = r.pttl(lock.keys.lock)
    assert _in_thread(lock.owned) == {"value": False}
    assert isinstance(_in_thread(lock.ensure_held).get("error"), LockLost)
    assert isinstance(_in_thread(lambda: lock.extend(60)).get("error"), LockNotOwned)
    assert r.pttl(lock.keys.lock) <= pttl, "another thread extended our hold"
    # The holder's own answers are unchanged.
    assert lock.owned()
    lock.ensure_held()
    lock.release()


# -- 7. a stale loss report never touches a newer hold ---------------------------------


class _SlowWarnings(logging.Handler):
    """Takes its time over each record, as a slow log shipper does (the loss line is
    DEBUG where an ``on_lost`` tells the holder, WARNING otherwise: both are shipped)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.entered = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        time.sleep(0.3)


@pytest.mark.slow
def test_stale_loss_report_does_not_kill_a_new_hold(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    handler = _SlowWarnings()
    log = logging.getLogger("celery_dlock.scheduler")  # where the loss is logged
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        lost: list[int] = []
        lock = lock_kind.make(name, ttl=0.9, prefix=prefix,
                              on_lost=lambda lk: lost.append(1))
        lock.acquire()
        for server in lock_kind.clients:  # the hold is gone; the scheduler will notice
            server.delete(lock.keys.lock)
        assert handler.entered.wait(5)
        # While the loss is being reported, the holder ends its lost hold (a re-entry
        # of a lost hold raises: it never takes a new hold in its place) and the same
        # object takes a new hold.
        with pytest.raises(LockLost):
            lock.acquire(blocking=False)
        with pytest.raises(LockLost):
            lock.release()
        assert wait_until(lambda: lock.acquire(blocking=False), timeout=3)
        time.sleep(1.0)  # the report of the old hold completes meanwhile
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    time.sleep(2.0)  # over two ttls: only renewal keeps the new hold alive
    assert not lock.lost, "the old hold's report marked the new hold lost"
    assert lock.owned()
    assert lost == [1]
    lock.release()  # the new hold is a fresh one: one acquire, one release
    assert not r.exists(lock.keys.lock)


# -- 9. ttl bounds ---------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [1e11, 1e14, 10 * 365 * 86400.0])
def test_ttl_beyond_the_bound_is_refused_up_front(lock_kind, prefix, name, ttl):
    with pytest.raises(InvalidLockConfig, match="ttl"):
        lock_kind.make(name, ttl=ttl, prefix=prefix)


def test_extend_beyond_the_bound_is_refused_and_writes_nothing(lock_kind, prefix, name):
    if lock_kind.name == "zookeeper":
        pytest.skip(NO_LONGER_SESSION)
    from celery_dlock.core.ttl import MAX_TTL

    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=5, prefix=prefix)
    with lock:
        pttl = r.pttl(lock.keys.lock)
        with pytest.raises(InvalidLockConfig, match="ttl"):
            lock.extend(1e14)
        with pytest.raises(InvalidLockConfig, match="ttl"):
            lock.extend(MAX_TTL + 1)
        assert r.pttl(lock.keys.lock) <= pttl
        lock.extend(MAX_TTL)  # the bound itself is allowed
        assert r.pttl(lock.keys.lock) > (MAX_TTL - 60) * 1000
    assert not r.exists(lock.keys.lock)


def test_the_longest_ttl_allowed_writes_a_whole_lock(lock_kind, prefix, name):
    if lock_kind.name == "zookeeper":
        pytest.skip(NO_LONGER_SESSION)
    from celery_dlock.core.ttl import MAX_TTL

    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=MAX_TTL, prefix=prefix, auto_renew=False)
    with lock:
        assert r.pttl(lock.keys.lock) > (MAX_TTL - 60) * 1000
    assert not r.exists(lock.keys.lock)


# -- 10. foreign data under a lock key -------------------------------------------------


def test_foreign_data_where_the_lock_hash_lives(kind, r, prefix, name):
    lock = kind.make(r, name, ttl=5, prefix=prefix)
    r.set(lock.keys.lock, "not a lock")
    for call in (lock.acquire, lock.release, lock.owned, lock.ensure_held,
                 lock.extend, lock.holder, lambda: lock.acquire(timeout=0.2)):
        with pytest.raises(DLockError) as info:
            call()
        assert lock.keys.lock in str(info.value)
        assert info.value.lock_name == name
    assert r.get(lock.keys.lock) == b"not a lock"


def test_foreign_data_where_the_fence_counter_lives(kind, r, prefix, name):
    lock = kind.make(r, name, ttl=5, prefix=prefix)
    r.hset(lock.keys.fence, "mine", "yes")
    with pytest.raises(DLockError) as info:
        lock.acquire()
    assert lock.keys.fence in str(info.value)
    assert r.hgetall(lock.keys.fence) == {b"mine": b"yes"}
    assert not r.exists(lock.keys.lock), "half a lock was written"


# -- 11. not a client ------------------------------------------------------------------


@pytest.mark.parametrize("client", ["redis://127.0.0.1:6379/0", object(), 42,
                                    b"redis://x"])
def test_something_that_is_not_a_client_is_refused(client):
    with pytest.raises((TypeError, InvalidLockConfig), match="client"):
        RedisLock(client, "n")


def test_an_asyncio_client_is_refused():
    import redis.asyncio

    client = redis.asyncio.Redis()
    with pytest.raises((TypeError, InvalidLockConfig), match="asyncio"):
        RedisLock(client, "n")


# -- 13. owner strings never reach another lock's keys ---------------------------------


@pytest.mark.parametrize(("waiter_owner", "victim_name"),
                         [("7}", "job}:w:7"), ("}", "job}:w:")])
def test_owner_strings_never_touch_another_locks_keys(r, prefix, waiter_owner,
                                                      victim_name):
    victim = RedisLock(r, victim_name, ttl=30, prefix=prefix, owner="victim")
    victim.acquire()
    job = RedisLock(r, "job", ttl=30, prefix=prefix, owner="holder")
    job.acquire()
    waiter = RedisLock(r, "job", ttl=30, prefix=prefix, owner=waiter_owner)
    assert waiter.acquire(timeout=0.3) is False  # no raw WRONGTYPE, no damage
    assert victim.owned(), "a waiter's keys reached another lock"
    assert r.hget(victim.keys.lock, "owner") == b"victim"
    job.release()
    victim.release()


# -- 14. eviction ----------------------------------------------------------------------


def _warnings_about_eviction(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.levelno == logging.WARNING and "maxmemory-policy" in rec.getMessage()]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_an_evicting_server_is_warned_about_once_per_client(caplog, prefix, name,
                                                            policy):
    with EmbeddedRedis(extra_args=("--maxmemory", "100mb",
                                   "--maxmemory-policy", policy)) as server:
        client = redis.Redis.from_url(server.url)
        caplog.set_level(logging.WARNING, logger="celery_dlock")
        for i in range(3):
            with RedisLock(client, f"{name}-{i}", prefix=prefix):
                pass
        found = _warnings_about_eviction(caplog)
        assert len(found) == 1, found
        assert "noeviction" in found[0] and policy in found[0]
        client.close()


def test_a_noeviction_server_gets_no_warning(caplog, prefix, name):
    with EmbeddedRedis(extra_args=("--maxmemory", "100mb",
                                   "--maxmemory-policy", "noeviction")) as server:
        client = redis.Redis.from_url(server.url)
        caplog.set_level(logging.WARNING, logger="celery_dlock")
        with RedisLock(client, name, prefix=prefix):
            pass
        assert _warnings_about_eviction(caplog) == []
        client.close()


def test_a_full_noeviction_server_refuses_a_grant_and_keeps_nothing(prefix, name):
    """docs/deployments.md: with ``noeviction`` a full server refuses writes, and a
    grant is refused before it wrote anything: no hold, no fence counter."""
    with EmbeddedRedis(extra_args=("--maxmemory-policy", "noeviction")) as server:
        client = redis.Redis.from_url(server.url)
        lock = RedisLock(client, name, ttl=30, prefix=prefix, auto_renew=False)
        client.config_set("maxmemory", 1)
        with pytest.raises(BackendUnavailable, match="maxmemory"):
            lock.acquire(blocking=False)
        assert client.keys(f"{prefix}:*") == []
        client.config_set("maxmemory", 0)
        assert lock.acquire(blocking=False)  # room again: granted
        lock.release()
        client.close()


# -- 15. redis-py habits ---------------------------------------------------------------


def test_constructor_blocking_timeout_bounds_a_plain_acquire(lock_kind, prefix, name):
    holder = lock_kind.make(name, ttl=30, prefix=prefix, owner="holder")
    holder.acquire()
    waiter = lock_kind.make(name, prefix=prefix, blocking_timeout=0.4)
    started = time.monotonic()
    out = _in_thread(waiter.acquire)
    assert out == {"value": False}, "acquire() ignored the constructor's blocking_timeout"
    assert 0.3 < time.monotonic() - started < 5
    # redis-py's spelling in acquire() works as well.
    assert waiter.acquire(blocking_timeout=0.2) is False
    holder.release()
