"""Blocked acquirers: woken by the release (not by expiry or polling), served in
arrival order, leaving the line when they give up, and let in when a holder dies.

The tests of the line itself run on every kind that has one (``lock_kind``: Redis's
doorbells, ZooKeeper's watches; Redlock has no line); the rest test Redis's leases."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import redis
from dlock_helpers import hold_until_killed, queue_members, wait_in_line, wait_until
from lock_kinds import NO_LINE

from celery_dlock import RedisLock
from celery_dlock.backends.redis.waiters import QUEUE_LEASE, WAIT_SLICE


class Waiter(threading.Thread):
    """A thread that blocks in ``acquire`` and records when it got the lock."""

    def __init__(self, lock: RedisLock, timeout: float = 20.0, hold: float = 0.0,
                 log: list[str] | None = None) -> None:
        super().__init__(daemon=True)
        self.lock = lock
        self.timeout = timeout
        self.hold = hold
        self.log = log
        self.result: bool | None = None
        self.acquired_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.lock.acquire(timeout=self.timeout)
            self.acquired_at = time.monotonic()
            if self.result:
                if self.log is not None:
                    self.log.append(self.lock._fixed_owner or "?")
                time.sleep(self.hold)
                self.lock.release()
        except BaseException as exc:
            self.error = exc


def _start_in_line(r: redis.Redis, waiter: Waiter) -> Waiter:
    owner = waiter.lock._fixed_owner
    waiter.start()
    assert wait_until(lambda: owner in queue_members(r, waiter.lock), timeout=10)
    return waiter


def _line_kind(lock_kind):
    """The server view of a kind with a line of waiters (Redlock has none)."""
    if lock_kind.name == "redlock":
        pytest.skip(NO_LINE)
    return lock_kind.server


def test_blocked_acquirer_wakes_promptly_after_release(lock_kind, prefix, name):
    r = _line_kind(lock_kind)
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    waiter = _start_in_line(r, Waiter(lock_kind.make(name, owner="w", prefix=prefix)))
    time.sleep(0.3)
    assert waiter.result is None  # still blocked while held
    released_at = time.monotonic()
    holder.release()
    waiter.join(10)
    assert waiter.error is None
    assert waiter.result is True
    assert waiter.acquired_at is not None
    # 30 s ttl and 2 s wait slices (ZooKeeper: 5 s): only the release's doorbell
    # (ZooKeeper: the watch the server pushes) explains this
    assert waiter.acquired_at - released_at < 1.0
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.lock)


def test_blocked_waiters_are_served_in_arrival_order(lock_kind, prefix, name):
    r = _line_kind(lock_kind)
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    order: list[str] = []
    owners = [f"w{i}" for i in range(5)]
    waiters = [
        _start_in_line(r, Waiter(lock_kind.make(name, owner=o, prefix=prefix),
                                 hold=0.02, log=order))
        for o in owners
    ]
    assert queue_members(r, holder) == owners
    holder.release()
    for w in waiters:
        w.join(20)
    assert [w.error for w in waiters] == [None] * len(waiters)
    assert order == owners
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.leases)


def test_free_lock_goes_to_the_first_in_line_not_a_barger(lock_kind, prefix, name):
    r = _line_kind(lock_kind)
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    waiter = _start_in_line(r, Waiter(lock_kind.make(name, owner="w", prefix=prefix),
                                      hold=0.5))
    holder.release()
    barger = lock_kind.make(name, owner="barger", prefix=prefix)
    # whether the waiter has already taken it or not, the barger must not get it
    assert barger.acquire(blocking=False) is False
    waiter.join(10)
    assert waiter.result is True
    assert barger.acquire(blocking=False) is True
    barger.release()


def test_waiter_that_times_out_leaves_the_line(r, prefix, name):
    holder = RedisLock(r, name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    quitter = _start_in_line(r, Waiter(RedisLock(r, name, owner="quitter",
                                                 prefix=prefix), timeout=0.5))
    patient = _start_in_line(r, Waiter(RedisLock(r, name, owner="patient",
                                                 prefix=prefix), timeout=20))
    quitter.join(10)
    assert quitter.result is False and quitter.error is None
    assert queue_members(r, holder) == ["patient"]
    assert r.zscore(holder.keys.leases, "quitter") is None

    released_at = time.monotonic()
    holder.release()
    patient.join(10)
    assert patient.result is True and patient.error is None
    assert patient.acquired_at is not None
    assert patient.acquired_at - released_at < 1.0
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.leases)


@pytest.mark.slow
def test_waiter_killed_in_line_does_not_block_the_next(redis_url, r, prefix, name):
    holder = RedisLock(r, name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=wait_in_line, args=(redis_url, prefix, name, "doomed"),
                       daemon=True)
    proc.start()
    try:
        assert wait_until(lambda: "doomed" in queue_members(r, holder), timeout=30)
        patient = _start_in_line(r, Waiter(RedisLock(r, name, owner="patient",
                                                     prefix=prefix), timeout=30))
        proc.kill()
        proc.join(10)
        released_at = time.monotonic()
        holder.release()  # rings the dead waiter's doorbell: nobody answers
        patient.join(30)
        assert patient.error is None and patient.result is True
        assert patient.acquired_at is not None
        # the dead waiter's place lapses with its lease; then the next one goes
        assert patient.acquired_at - released_at < QUEUE_LEASE + WAIT_SLICE + 3
        assert not r.exists(holder.keys.queue)
        assert not r.exists(holder.keys.leases)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_single_waiter_timing_out_leaves_no_queue_keys(r, prefix, name):
    holder = RedisLock(r, name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    lock = RedisLock(r, name, owner="w", prefix=prefix)
    assert lock.acquire(timeout=0.3) is False
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.leases)
    assert not r.exists(holder.keys.doorbell("w"))
    assert r.hget(holder.keys.lock, "owner") == b"holder"
    holder.release()


def test_holder_without_renewal_that_never_releases_lets_waiter_in(r, prefix, name):
    dead = RedisLock(r, name, ttl=0.5, auto_renew=False, owner="dead", prefix=prefix)
    dead.acquire()
    started = time.monotonic()
    waiter = RedisLock(r, name, ttl=30, owner="w", prefix=prefix)
    assert waiter.acquire(timeout=10) is True
    waited = time.monotonic() - started
    assert waited >= 0.4  # it had to wait for the ttl
    # An expiry rings no doorbell: the waiter's sleep is cut to the holder's ttl, so it
    # gets in well before its 2 s wait slice would have ended.
    assert waited < WAIT_SLICE - 0.4
    assert r.hget(waiter.keys.lock, "owner") == b"w"
    waiter.release()


@pytest.mark.slow
def test_killed_holder_process_frees_the_lock_within_its_ttl(redis_url, r, prefix,
                                                              name):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=hold_until_killed,
                       args=(redis_url, prefix, name, 1.0, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        lock = RedisLock(r, name, ttl=30, owner="survivor", prefix=prefix)
        assert r.hget(lock.keys.lock, "pid") == str(proc.pid).encode()
        time.sleep(1.5)  # longer than its ttl: its scheduler keeps it alive
        assert lock.acquire(blocking=False) is False
        proc.kill()
        proc.join(10)
        killed_at = time.monotonic()
        assert lock.acquire(timeout=10) is True
        assert time.monotonic() - killed_at < 5.0
        assert lock.holder() is not None
        lock.release()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
