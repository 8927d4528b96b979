"""Renewal: the per-process scheduler thread (on every lock kind, ``lock_kind``), and the
RenewalScheduler registry driven by an injected clock (``start_thread=False`` plus
``renew_due(now)``; its batching and retries are checked on one Redis)."""

from __future__ import annotations

import os
import signal
import time
import weakref

import pytest
import redis
from celery_helpers import collect_garbage
from dlock_helpers import wait_until

from celery_dlock import LockLost, RedisLock
from celery_dlock.core.scheduler import (
    ERROR_RETRY_INTERVAL,
    RenewalScheduler,
    get_scheduler,
)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hb(clock: FakeClock) -> RenewalScheduler:
    return RenewalScheduler(clock=clock, start_thread=False)


def _commandstat(r: redis.Redis, command: str) -> int:
    stats = r.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


# -- the real scheduler thread ----------------------------------------------------------


def test_renewal_keeps_a_short_lock_alive_then_stops_after_release(lock_kind, prefix,
                                                                    name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=1.0, prefix=prefix)
    lock.acquire()
    owner = r.hget(lock.keys.lock, "owner")
    assert get_scheduler().is_registered(lock)
    until = time.monotonic() + 3.5
    while time.monotonic() < until:  # 3.5 ttls: only renewal keeps it
        assert r.hget(lock.keys.lock, "owner") == owner
        time.sleep(0.1)
    assert lock.owned()
    lock.ensure_held()
    lock.release()
    assert not r.exists(lock.keys.lock)
    assert not get_scheduler().is_registered(lock)
    time.sleep(0.5)  # more than one renewal interval: nothing brings it back
    assert not r.exists(lock.keys.lock)


def test_without_auto_renew_the_hold_expires_and_the_holder_is_told_first(lock_kind,
                                                                          prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    told: list[float] = []
    lock = lock_kind.make(name, ttl=0.5, auto_renew=False, prefix=prefix,
                          on_lost=lambda lk: told.append(time.monotonic()))
    started = time.monotonic()
    lock.acquire()
    # Watched for its deadline, never renewed.
    assert get_scheduler().is_registered(lock)
    assert wait_until(lambda: not r.exists(lock.keys.lock), timeout=5)
    gone = time.monotonic()
    assert gone - started >= 0.4  # it was the ttl, not something else
    assert told and started + 0.4 < told[0] <= gone
    assert not lock.owned()
    with pytest.raises(LockLost):
        lock.ensure_held()
    with pytest.raises(LockLost):
        lock.release()


def test_lost_lock_is_reported_once_and_never_recreated(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    calls: list[RedisLock] = []
    lock = lock_kind.make(name, ttl=0.6, prefix=prefix, on_lost=calls.append)
    lock.acquire()
    lock_kind.drop_hold(lock)
    other = lock_kind.make(name, ttl=30, owner="other", prefix=prefix, auto_renew=False)
    assert other.acquire(blocking=False)

    assert wait_until(lambda: calls, timeout=5)
    time.sleep(0.5)  # a few more renewal intervals
    assert calls == [lock]
    assert lock.lost
    assert not lock.owned()
    assert not get_scheduler().is_registered(lock)
    with pytest.raises(LockLost):
        lock.ensure_held()
    # the other owner's hold is untouched by the loser
    assert r.hget(lock.keys.lock, "owner") == b"other"
    assert r.pttl(lock.keys.lock) > 20_000
    with pytest.raises(LockLost):
        lock.release()
    assert r.hget(lock.keys.lock, "owner") == b"other"
    other.release()
    time.sleep(0.5)
    assert not r.exists(lock.keys.lock)  # nobody holds it: not re-created either
    assert calls == [lock]


def test_lock_dropped_while_held_stops_being_renewed(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=0.6, prefix=prefix)
    lock.acquire()
    key = lock.keys.lock
    ref = weakref.ref(lock)
    del lock
    collect_garbage()
    assert ref() is None
    assert wait_until(lambda: not r.exists(key), timeout=5)


def test_on_lost_errors_do_not_kill_the_heartbeat(lock_kind, prefix, name):
    def explode(lock: RedisLock) -> None:
        raise RuntimeError("callback bug")

    bad = lock_kind.make(name + "-bad", ttl=0.6, prefix=prefix, on_lost=explode)
    bad.acquire()
    lock_kind.drop_hold(bad)
    assert wait_until(lambda: bad.lost, timeout=5)
    good = lock_kind.make(name, ttl=0.6, prefix=prefix)
    good.acquire()
    time.sleep(1.5)  # well past its ttl: only a live scheduler keeps it
    assert good.owned()
    good.release()


# -- the registry, driven by an injected clock ------------------------------------------


def test_due_and_next_due(r, prefix, name, hb, clock):
    assert hb.renew_due() is None  # nothing registered
    a = RedisLock(r, name + "-a", ttl=3, prefix=prefix, scheduler=hb)  # every 1 s
    a.acquire()
    assert hb.is_registered(a)
    assert not get_scheduler().is_registered(a)
    r.pexpire(a.keys.lock, 2000)

    assert hb.renew_due(1000.2) == pytest.approx(1001.0)  # not yet due
    assert hb.renewal_calls == 0
    assert r.pttl(a.keys.lock) <= 2000

    clock.now = 1000.4
    b = RedisLock(r, name + "-b", ttl=3, prefix=prefix, scheduler=hb)
    b.acquire()  # next due at 1001.4
    r.pexpire(b.keys.lock, 2000)

    # a is due; b is due within half an interval, so it is renewed in the same call
    assert hb.renew_due(1001.0) == pytest.approx(1002.0)
    assert hb.renewal_calls == 1
    assert r.pttl(a.keys.lock) > 2500
    assert r.pttl(b.keys.lock) > 2500

    assert hb.renew_due(1001.4) == pytest.approx(1002.0)
    assert hb.renewal_calls == 1

    a.release()
    b.release()
    assert len(hb) == 0
    assert hb.renew_due(1003.0) is None
    assert hb.renewal_calls == 1


def test_extend_moves_the_renewal_schedule(r, prefix, name, hb, clock):
    lock = RedisLock(r, name, ttl=3, prefix=prefix, scheduler=hb)
    lock.acquire()
    clock.now = 1000.5
    lock.extend(30)  # now every 10 s, from 1000.5
    assert hb.renew_due(1001.0) == pytest.approx(1010.5)
    assert hb.renewal_calls == 0
    r.pexpire(lock.keys.lock, 2000)
    hb.renew_due(1010.5)
    assert hb.renewal_calls == 1
    assert r.pttl(lock.keys.lock) > 25_000  # renewed with the extended ttl
    lock.release()


def test_two_hundred_holds_cost_one_call_per_pass(r, prefix, hb, clock):
    locks = [RedisLock(r, f"bulk-{i}", ttl=30, prefix=prefix, scheduler=hb)
             for i in range(200)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    assert len(hb) == 200
    hb.renew_due(1010.0)  # first pass (may load the script: EVALSHA miss + EVAL)
    assert hb.renewal_calls == 1

    process_hb = get_scheduler()
    for n, now in enumerate((1020.0, 1030.0, 1040.0), start=2):
        for lock in locks:
            r.pexpire(lock.keys.lock, 5000)
        before_thread = process_hb.renewal_calls
        before = _commandstat(r, "evalsha"), _commandstat(r, "eval")
        hb.renew_due(now)
        after = _commandstat(r, "evalsha"), _commandstat(r, "eval")
        others = process_hb.renewal_calls - before_thread  # this process's own thread
        assert hb.renewal_calls == n
        assert 1 <= after[0] - before[0] <= 1 + others
        assert after[1] - before[1] <= others
        pipe = r.pipeline(transaction=False)
        for lock in locks:
            pipe.pttl(lock.keys.lock)
        assert min(pipe.execute()) > 25_000  # every one of them was renewed
    for lock in locks:
        lock.release()
    assert len(hb) == 0


def test_reentry_by_two_objects_renews_the_key_once(r, prefix, name, hb):
    a = RedisLock(r, name, ttl=3, owner="o", prefix=prefix, scheduler=hb)
    b = RedisLock(r, name, ttl=3, owner="o", prefix=prefix, scheduler=hb)
    a.acquire()
    b.acquire()
    assert len(hb) == 2
    r.pexpire(a.keys.lock, 1000)
    hb.renew_due(1001.0)
    assert hb.renewal_calls == 1
    assert r.pttl(a.keys.lock) > 2500
    assert not a.lost and not b.lost
    a.release()
    assert not hb.is_registered(a) and hb.is_registered(b)
    b.release()
    assert not r.exists(a.keys.lock)


def test_expired_hold_is_lost_and_not_recreated(r, prefix, name, hb, clock):
    calls: list[RedisLock] = []
    lock = RedisLock(r, name, ttl=0.3, prefix=prefix, scheduler=hb,
                     on_lost=calls.append)
    lock.acquire()
    assert wait_until(lambda: not r.exists(lock.keys.lock))  # no pass ran: it expired
    assert hb.renew_due(1000.1) is None
    assert calls == [lock]
    assert lock.lost and not lock.owned()
    assert not hb.is_registered(lock)
    assert not r.exists(lock.keys.lock)
    hb.renew_due(1000.2)
    assert calls == [lock]
    assert hb.renewal_calls == 1
    assert not r.exists(lock.keys.lock)
    with pytest.raises(LockLost):
        lock.ensure_held()
    with pytest.raises(LockLost):
        lock.release()


def test_taken_hold_is_lost_and_left_to_the_new_owner(r, prefix, name, hb, clock):
    calls: list[RedisLock] = []
    lock = RedisLock(r, name, ttl=3, prefix=prefix, scheduler=hb, on_lost=calls.append)
    lock.acquire()
    r.delete(lock.keys.lock)
    thief = RedisLock(r, name, ttl=3, owner="thief", prefix=prefix, auto_renew=False)
    thief.acquire()
    r.pexpire(thief.keys.lock, 1500)
    hb.renew_due(1001.0)
    assert calls == [lock]
    assert r.hget(lock.keys.lock, "owner") == b"thief"
    assert r.pttl(lock.keys.lock) <= 1500  # the loser did not renew the thief's hold
    with pytest.raises(LockLost):
        lock.ensure_held()
    thief.release()


def test_dead_weakrefs_are_dropped(r, prefix, name, hb):
    lock = RedisLock(r, name, ttl=3, prefix=prefix, scheduler=hb)
    lock.acquire()
    key = lock.keys.lock
    r.pexpire(key, 2000)
    ref = weakref.ref(lock)
    del lock
    collect_garbage()
    assert ref() is None
    assert hb.renew_due(1001.0) is None
    assert len(hb) == 0
    assert hb.renewal_calls == 0
    assert r.pttl(key) <= 2000  # not renewed


def test_transient_errors_are_retried_until_the_deadline_then_lost(own_server, prefix,
                                                                   name, hb, clock):
    client = redis.Redis(host=own_server.host, port=own_server.port, socket_timeout=0.5,
                         socket_connect_timeout=0.5,
                         retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    calls: list[RedisLock] = []
    lock = RedisLock(client, name, ttl=3, prefix=prefix, scheduler=hb,
                     on_lost=calls.append)
    lock.acquire()  # deadline 1002.67: ttl 3 less 1% drift and the 0.3 s pause budget
    own_server.stop()  # the port is closed now

    assert hb.renew_due(1001.0) == pytest.approx(1001.0 + ERROR_RETRY_INTERVAL)
    assert hb.renewal_calls == 1
    assert hb.is_registered(lock) and not lock.lost and calls == []

    hb.renew_due(1002.6)  # still before the deadline: retried, not lost
    assert hb.renewal_calls == 2
    assert hb.is_registered(lock) and not lock.lost and calls == []

    # Past the deadline: lost there, without waiting for another renewal call.
    assert hb.renew_due(1003.0) is None
    assert hb.renewal_calls == 2
    assert calls == [lock]
    assert lock.lost
    assert not hb.is_registered(lock)
    with pytest.raises(LockLost):
        lock.ensure_held()
    assert not lock.owned()
    hb.renew_due(1010.0)
    assert hb.renewal_calls == 2
    assert calls == [lock]


def test_transient_error_then_recovery_keeps_the_hold(own_server, prefix, name, hb,
                                                      clock):
    client = redis.Redis(host=own_server.host, port=own_server.port, socket_timeout=0.3,
                         socket_connect_timeout=0.3,
                         retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    watcher = redis.Redis.from_url(own_server.url, socket_timeout=10)
    calls: list[RedisLock] = []
    lock = RedisLock(client, name, ttl=3, prefix=prefix, scheduler=hb,
                     on_lost=calls.append)
    lock.acquire()
    assert own_server.process is not None
    os.kill(own_server.process.pid, signal.SIGSTOP)  # frozen: calls time out
    try:
        hb.renew_due(1001.0)
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
    assert hb.renewal_calls == 1
    assert hb.is_registered(lock) and calls == []

    watcher.pexpire(lock.keys.lock, 1000)
    assert hb.renew_due(1001.0 + ERROR_RETRY_INTERVAL) == pytest.approx(
        1001.0 + ERROR_RETRY_INTERVAL + 1.0)  # back on the normal schedule
    assert hb.renewal_calls == 2
    assert watcher.pttl(lock.keys.lock) > 2500
    assert calls == [] and not lock.lost
    lock.release()
    assert not watcher.exists(lock.keys.lock)
    watcher.close()



def test_reacquiring_after_a_loss_starts_a_fresh_renewed_hold(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=1, prefix=prefix)
    assert lock.acquire()
    old_fence = lock_kind.fence_of(lock)
    lock_kind.drop_hold(lock)
    with pytest.raises(LockLost):
        lock.ensure_held()
    # The lost hold is not replaced behind the holder's back: a re-entry raises, and
    # the holder ends it with a release (which raises too) before a fresh hold.
    with pytest.raises(LockLost):
        lock.acquire(blocking=False)
    assert lock.depth == 1 and lock_kind.fence_of(lock) == old_fence
    with pytest.raises(LockLost):
        lock.release()
    assert lock.acquire(blocking=False)
    assert lock.depth == 1
    if lock_kind.fences:  # (Redlock: fence_of checked above that fence raises)
        assert lock.fence is not None and lock.fence > old_fence
    assert lock.owned()
    time.sleep(1.6)  # past the ttl: only renewal keeps it
    assert lock.owned()
    lock.release()
    assert not r.exists(lock.keys.lock)
