"""Blocked acquirers: woken by the release (not by expiry or polling), served in
arrival order, leaving the line when they give up, and let in when a holder dies.

The tests of waking and of a dead holder run on every kind whose waiters are woken by
the server (``lock_kind``: Redis doorbells, a one-slot semaphore's, PostgreSQL
LISTEN/NOTIFY, ZooKeeper watches); the tests of the line itself on every kind that keeps
one (a Redis lock, a one-slot semaphore, PostgreSQL, MySQL, ZooKeeper; not Redlock:
docs/backends.md); those of the waiters' leases (leaving the line, a waiter that died
in it) on the kinds whose line is leased (``LEASED``: not ZooKeeper, whose line is its
sessions')."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import redis
from dlock_helpers import hold_until_killed, queue_members, wait_in_line, wait_until
from lock_kinds import KINDS, NO_LINE

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
        self.released_at: float | None = None
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
                self.released_at = time.monotonic()
        except BaseException as exc:
            self.error = exc


#: The kinds whose waiters hold their places in line by a lease they renew (a Redis
#: lock, a one-slot semaphore: the line is the same; the SQL backends' line tables).
LEASED = pytest.mark.parametrize(
    "lock_kind", [k for k in ("redis", "semaphore", "postgres", "mysql") if k in KINDS],
    indirect=True)


def _lease_bounds(kind: str) -> tuple[float, float]:
    """How long a waiter of ``kind`` keeps its place without trying again, and the
    longest it sleeps between two tries (seconds)."""
    if kind == "postgres":
        from celery_dlock.backends.sql.postgres import waiting

        return waiting.QUEUE_LEASE, waiting.WAIT_SLICE
    if kind == "mysql":
        from celery_dlock.backends.sql.mysql import lock as mysql

        return mysql.QUEUE_LEASE, mysql.POLL_MAX
    return QUEUE_LEASE, WAIT_SLICE


def _start_in_line(r: redis.Redis, waiter: Waiter) -> Waiter:
    owner = waiter.lock._fixed_owner
    waiter.start()
    assert wait_until(lambda: owner in queue_members(r, waiter.lock), timeout=10)
    return waiter


def _line_kind(lock_kind):
    """The server view of a kind with a line of waiters (Redlock has none:
    docs/backends.md)."""
    if not lock_kind.has_line:
        pytest.skip(NO_LINE if lock_kind.name == "redlock" else
                    f"the {lock_kind.name} backend keeps no line of waiters "
                    f"(docs/backends.md)")
    return lock_kind.server


#: The kinds whose blocked acquirers the server wakes (Redlock's retry after a delay),
#: and MySQL, whose waiters poll with a backoff bounded at 0.5 s (docs/backends.md).
WOKEN = pytest.mark.parametrize(
    "lock_kind", [k for k in ("redis", "semaphore", "postgres", "mysql", "zookeeper")
                  if k in KINDS], indirect=True)


@WOKEN
def test_blocked_acquirer_wakes_promptly_after_release(lock_kind, prefix, name):
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    waiter = Waiter(lock_kind.make(name, owner="w", prefix=prefix))
    if lock_kind.has_line:
        _start_in_line(r, waiter)
    else:
        waiter.start()
    time.sleep(0.5)  # blocked, past its first try (and on PostgreSQL, listening)
    assert waiter.result is None  # still blocked while held
    released_at = time.monotonic()
    holder.release()
    waiter.join(10)
    assert waiter.error is None
    assert waiter.result is True
    assert waiter.acquired_at is not None
    # 30 s ttl and 2 s wait slices (ZooKeeper: 5 s): only the release's doorbell
    # (ZooKeeper: the watch the server pushes; MySQL: the 0.5 s bound of its poll)
    # explains this
    assert waiter.acquired_at - released_at < 1.0
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.lock)


@WOKEN
def test_a_hold_taken_from_the_line_wakes_the_next_in_line_when_released(
        lock_kind, prefix, name):
    """Two waiters behind a holder: the holder's release wakes the first; the first's
    release (of a hold taken from the line, the second still in it) wakes the second
    as promptly: no hand-off waits for a waiter's next try."""
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    first = Waiter(lock_kind.make(name, owner="w1", prefix=prefix), hold=0.1)
    second = Waiter(lock_kind.make(name, owner="w2", prefix=prefix))
    for waiter in (first, second):
        if lock_kind.has_line:
            _start_in_line(r, waiter)
        else:
            waiter.start()
            time.sleep(0.3)
    time.sleep(0.5)  # both blocked, past their first tries
    holder.release()
    first.join(10)
    second.join(10)
    assert [first.error, second.error] == [None, None]
    assert first.result is True and second.result is True
    assert first.released_at is not None and second.acquired_at is not None
    # the second's wait slice (2 s; ZooKeeper 5 s) began before the holder's release:
    # only a doorbell (a watch, MySQL's poll of at most 0.5 s) explains this
    assert second.acquired_at - first.released_at < 1.0


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


@LEASED
def test_waiter_that_times_out_leaves_the_line(lock_kind, prefix, name):
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    quitter = _start_in_line(r, Waiter(lock_kind.make(name, owner="quitter",
                                                      prefix=prefix), timeout=0.5))
    patient = _start_in_line(r, Waiter(lock_kind.make(name, owner="patient",
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
@LEASED
def test_waiters_keep_their_places_for_longer_than_a_lease(lock_kind, prefix, name):
    """A waiter renews its lease by trying again: after waiting for longer than a
    lease and a wait slice, each keeps the place (and arrival) it joined with."""
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    order: list[str] = []
    waiters = [_start_in_line(r, Waiter(lock_kind.make(name, owner=o, prefix=prefix),
                                        timeout=60, log=order))
               for o in ("first", "second")]
    arrived = [r.zscore(holder.keys.queue, o) for o in ("first", "second")]
    assert None not in arrived
    lease, slice_ = _lease_bounds(lock_kind.name)
    time.sleep(lease + slice_ + 1)
    assert queue_members(r, holder) == ["first", "second"]
    assert [r.zscore(holder.keys.queue, o) for o in ("first", "second")] == arrived
    holder.release()
    for w in waiters:
        w.join(20)
    assert [w.error for w in waiters] == [None, None]
    assert order == ["first", "second"]


@pytest.mark.slow
@LEASED
def test_waiter_killed_in_line_does_not_block_the_next(lock_kind, redis_url, prefix,
                                                       name):
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    ctx = multiprocessing.get_context("spawn")
    lock_url = lock_kind.urls[0] if lock_kind.name in ("postgres", "mysql") else None
    proc = ctx.Process(target=wait_in_line, args=(redis_url, prefix, name, "doomed",
                                                  getattr(holder, "limit", None),
                                                  lock_url),
                       daemon=True)
    proc.start()
    try:
        assert wait_until(lambda: "doomed" in queue_members(r, holder), timeout=30)
        patient = _start_in_line(r, Waiter(lock_kind.make(name, owner="patient",
                                                          prefix=prefix), timeout=30))
        proc.kill()
        proc.join(10)
        released_at = time.monotonic()
        holder.release()  # wakes the dead waiter first in line: nobody answers
        patient.join(30)
        assert patient.error is None and patient.result is True
        assert patient.acquired_at is not None
        # the dead waiter's place lapses with its lease; then the next one goes
        lease, slice_ = _lease_bounds(lock_kind.name)
        assert patient.acquired_at - released_at < lease + slice_ + 3
        assert not r.exists(holder.keys.queue)
        assert not r.exists(holder.keys.leases)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@LEASED
def test_single_waiter_timing_out_leaves_no_queue_keys(lock_kind, prefix, name):
    r = lock_kind.server
    holder = lock_kind.make(name, ttl=30, owner="holder", prefix=prefix)
    holder.acquire()
    lock = lock_kind.make(name, owner="w", prefix=prefix)
    assert lock.acquire(timeout=0.3) is False
    assert not r.exists(holder.keys.queue)
    assert not r.exists(holder.keys.leases)
    assert not r.exists(holder.keys.doorbell("w"))
    assert r.hget(holder.keys.lock, "owner") == b"holder"
    holder.release()


@WOKEN
def test_holder_without_renewal_that_never_releases_lets_waiter_in(lock_kind, prefix,
                                                                   name):
    r = lock_kind.server
    dead = lock_kind.make(name, ttl=0.5, auto_renew=False, owner="dead", prefix=prefix)
    # The ttl counts from the acquire's send (several round trips on ZooKeeper, the
    # first one making its session): the wait is measured from there.
    started = time.monotonic()
    dead.acquire()
    waiter = lock_kind.make(name, ttl=30, owner="w", prefix=prefix)
    assert waiter.acquire(timeout=10) is True
    waited = time.monotonic() - started
    assert waited >= 0.4  # it had to wait for the ttl
    # An expiry rings no doorbell: the waiter's sleep is cut to the holder's ttl, so it
    # gets in well before its 2 s wait slice would have ended.
    assert waited < WAIT_SLICE - 0.4
    assert r.hget(waiter.keys.lock, "owner") == b"w"
    waiter.release()


@pytest.mark.slow
# (A killed semaphore holder: tests/integration/test_semaphore.py.)
@pytest.mark.parametrize("lock_kind", [k for k in ("redis", "postgres", "mysql")
                                       if k in KINDS], indirect=True)
def test_killed_holder_process_frees_the_lock_within_its_ttl(redis_url, lock_kind,
                                                              prefix, name):
    r = lock_kind.server
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    lock_url = lock_kind.urls[0] if lock_kind.name != "redis" else None
    proc = ctx.Process(target=hold_until_killed,
                       args=(redis_url, prefix, name, 1.0, ready, lock_url), daemon=True)
    proc.start()
    try:
        assert ready.wait(30)
        lock = lock_kind.make(name, ttl=30, owner="survivor", prefix=prefix)
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
