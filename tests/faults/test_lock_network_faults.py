"""The lock core under network faults: lost replies, partitions, a stalled server.

Each test puts the fault proxy (``proxy.py``) or SIGSTOP between a holder and its own
redis-server, and checks the two safety rules: never two holders, and the holder is
told of a loss (``on_lost``) before any other owner can acquire.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis
import redis.backoff
import redis.retry
from dlock_helpers import wait_until
from lock_kinds import ONE_SERVER_KINDS, OneServerKind

from celery_dlock import BackendUnavailable, LockLost, RedisLock
from celery_dlock.ops.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow


def _client(url: str, *, timeout: float, retries: int = 0) -> redis.Redis:
    """A client whose socket timeout and re-sends we choose (redis-py re-sends a
    command after a timeout when ``retries`` > 0, as its default client does; before
    redis-py 6 only for the errors named in ``retry_on_error``)."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def _direct(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=10)


@pytest.fixture(params=sorted(ONE_SERVER_KINDS))
def kind(request: pytest.FixtureRequest) -> OneServerKind:
    """A lock, and a semaphore of one slot: every fault here applies to both."""
    return ONE_SERVER_KINDS[request.param]


def _load_scripts(kind: OneServerKind, client: redis.Redis, prefix: str) -> None:
    """Run one cycle so that later calls are EVALSHA of cached scripts (what the
    proxy matches on)."""
    warm = kind.make(client, "warm-up", prefix=prefix, auto_renew=False)
    warm.acquire()
    warm.release()


class _LossRecorder:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.event = threading.Event()

    def __call__(self, lock: RedisLock) -> None:
        self.times.append(time.monotonic())
        self.event.set()


def _first_acquire_time(lock: RedisLock, limit: float) -> float | None:
    """Poll ``lock.acquire(blocking=False)`` every 10 ms; when it first succeeds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if lock.acquire(blocking=False):
            return time.monotonic()
        time.sleep(0.01)
    return None


# -- 2. re-sent scripts are idempotent -------------------------------------------------


def test_resent_acquire_after_a_lost_reply_counts_once(kind, own_server, proxy, prefix,
                                                       name):
    client = _client(proxy.url, timeout=0.5, retries=2)
    _load_scripts(kind, client, prefix)
    lock = kind.make(client, name, ttl=10, prefix=prefix)
    matched = proxy.drop_reply(kind.acquire.sha.encode())
    assert lock.acquire(blocking=False)  # the reply was lost; redis-py re-sent it
    assert matched.is_set() and proxy.dropped_bytes > 0
    direct = kind.view(_direct(own_server))
    assert direct.hget(lock.keys.lock, "count") == b"1"
    lock.release()
    assert not direct.exists(lock.keys.lock), "one release must free one acquire"


def test_resent_release_after_a_lost_reply_undoes_one_acquire(kind, own_server, proxy,
                                                              prefix, name):
    client = _client(proxy.url, timeout=0.5, retries=2)
    _load_scripts(kind, client, prefix)
    lock = kind.make(client, name, ttl=10, prefix=prefix)
    lock.acquire()
    lock.acquire()
    matched = proxy.drop_reply(kind.release.sha.encode())
    lock.release()  # its reply is lost; redis-py re-sends it
    assert matched.is_set()
    direct = kind.view(_direct(own_server))
    assert direct.hget(lock.keys.lock, "count") == b"1", "a re-sent release counted twice"
    assert lock.owned() and lock.depth == 1
    lock.release()
    assert not direct.exists(lock.keys.lock)


def test_a_release_tried_again_by_the_caller_undoes_one_acquire(kind, own_server, proxy,
                                                               prefix, name):
    # No client re-sends: the release is applied, its reply is lost and the call
    # raises. The docstring says a release may be tried again: the retry must re-send
    # the same operation, not undo a second acquire (which freed the lock while its
    # holder's depth still said 1).
    client = _client(proxy.url, timeout=0.5, retries=0)
    _load_scripts(kind, client, prefix)
    lock = kind.make(client, name, ttl=10, prefix=prefix)
    lock.acquire()
    lock.acquire()
    matched = proxy.drop_reply(kind.release.sha.encode())
    with pytest.raises(BackendUnavailable):
        lock.release()
    assert matched.is_set()
    proxy.heal()
    direct = kind.view(_direct(own_server))
    assert direct.hget(lock.keys.lock, "count") == b"1"
    assert lock.depth == 2  # nothing confirmed: the local view is unchanged
    lock.release()  # tried again: the server recognises the operation
    assert direct.hget(lock.keys.lock, "count") == b"1", "the retry undid a 2nd acquire"
    assert lock.depth == 1 and lock.owned()
    lock.release()
    assert not direct.exists(lock.keys.lock)


_LOCK = ONE_SERVER_KINDS["redis"]


def _keys_of(client: redis.Redis, lock: RedisLock) -> set[str]:
    """Every key of ``lock``'s name (its hash tag), by name."""
    return {k.decode() for k in client.scan_iter(match=lock.keys.lock + "*")}


@pytest.mark.parametrize("then", ["nobody", "another owner takes it"])
def test_resent_final_release_is_not_reported_as_lost(own_server, proxy, prefix, name,
                                                      then):
    client = _client(proxy.url, timeout=0.5, retries=2)
    _load_scripts(_LOCK, client, prefix)
    lost = _LossRecorder()
    lock = RedisLock(client, name, ttl=10, prefix=prefix, on_lost=lost, fence_ttl=60)
    lock.acquire()
    direct = _direct(own_server)
    other = RedisLock(direct, name, ttl=10, prefix=prefix, owner="other",
                      auto_renew=False)
    matched = proxy.drop_reply(_LOCK.release.sha.encode())
    took = threading.Event()

    def take() -> None:  # as soon as the first send freed the lock
        if matched.wait(10) and _first_acquire_time(other, limit=5) is not None:
            took.set()

    taker = threading.Thread(target=take, daemon=True)
    if then != "nobody":
        taker.start()
    lock.release()  # freed by the first send; the re-send must say "released" too
    if taker.is_alive():
        taker.join(10)
    assert matched.is_set()
    assert not lock.lost and lock.lost_reason is None and not lost.times
    assert lock.depth == 0
    if then == "nobody":
        # Nothing is left behind but the fence counter (the answer of the re-send
        # came from it: no marker key), and it expires after the fence ttl.
        assert _keys_of(direct, lock) == {lock.keys.fence}
        assert 50_000 < direct.pttl(lock.keys.fence) <= 70_000
    else:
        assert took.is_set(), "the other owner never took the freed lock"
        assert direct.hget(lock.keys.lock, "owner") == b"other"
        other.release()
        assert _keys_of(direct, lock) == {lock.keys.fence}
        assert direct.pttl(lock.keys.fence) > 50_000  # it expires


def test_a_final_release_tried_again_later_still_says_released(own_server, proxy,
                                                               prefix, name):
    # No client re-sends: the final release is applied, its reply is lost and the call
    # raises.  Tried again after another owner took and holds the lock, it must not be
    # reported as a loss: the other hold says it was granted right after this one.
    client = _client(proxy.url, timeout=0.5, retries=0)
    _load_scripts(_LOCK, client, prefix)
    lost = _LossRecorder()
    lock = RedisLock(client, name, ttl=10, prefix=prefix, on_lost=lost)
    lock.acquire()
    matched = proxy.drop_reply(_LOCK.release.sha.encode())
    with pytest.raises(BackendUnavailable):
        lock.release()
    assert matched.is_set()
    proxy.heal()
    direct = _direct(own_server)
    other = RedisLock(direct, name, ttl=10, prefix=prefix, owner="other",
                      auto_renew=False)
    assert other.acquire(blocking=False)
    lock.release()  # the same operation again
    assert not lost.times and not lock.lost and lock.depth == 0
    assert other.owned()
    other.release()


def test_a_release_whose_hold_expired_is_still_reported_lost(own_server, prefix, name):
    # The counter tells a release from an expiry: a hold that expired (or was freed
    # by force) left it at its own fence, so its release is a loss, also after
    # another owner took and gave back the lock.
    direct = _direct(own_server)
    lost = _LossRecorder()
    lock = RedisLock(direct, name, ttl=10, prefix=prefix, on_lost=lost,
                     auto_renew=False)
    lock.acquire()
    direct.delete(lock.keys.lock)  # as an expiry does
    with pytest.raises(LockLost):
        lock.release()
    assert lost.times and lock.lost


def test_resent_final_release_is_not_reported_as_lost_on_each_kind(kind, own_server,
                                                                    proxy, prefix, name):
    client = _client(proxy.url, timeout=0.5, retries=2)
    _load_scripts(kind, client, prefix)
    lock = kind.make(client, name, ttl=10, prefix=prefix)
    lock.acquire()
    proxy.drop_reply(kind.release.sha.encode())
    lock.release()  # freed by the first send; the re-send must say "released" too
    assert not kind.view(_direct(own_server)).exists(lock.keys.lock)


# -- 3. a partitioned holder is told first ---------------------------------------------


@pytest.mark.parametrize("ttl", [3.0, 1.5])
def test_partitioned_holder_is_told_before_another_owner_acquires(kind, own_server, proxy,
                                                                   prefix, name, ttl):
    # A long socket timeout: the renewal call hangs far beyond the ttl.
    client = _client(proxy.url, timeout=30)
    lost = _LossRecorder()
    holder = kind.make(client, name, ttl=ttl, prefix=prefix, on_lost=lost)
    holder.acquire()
    proxy.black_hole()
    partitioned_at = time.monotonic()
    other = kind.make(_direct(own_server), name, ttl=10, prefix=prefix, owner="other")
    took_at = _first_acquire_time(other, limit=ttl + 5)
    assert took_at is not None, "the partitioned hold never expired"
    assert lost.times, "the holder was not told before another owner acquired"
    assert lost.times[0] < took_at
    assert lost.times[0] - partitioned_at < ttl + 0.5
    # After the loss: no Redis needed to know it.
    assert not holder.owned()
    with pytest.raises(LockLost):
        holder.ensure_held()
    proxy.heal()
    with pytest.raises(LockLost):
        holder.release()
    assert other.owned(), "a stale holder's release touched the successor's hold"
    assert len(lost.times) == 1


# -- 4. a stalled server never delays renewal on another -------------------------------


@pytest.mark.parametrize("fault", ["sigstop", "black_hole"])
def test_stalled_server_does_not_stop_renewal_on_another(kind, r, own_server, proxy,
                                                         prefix, name, fault):
    healthy = kind.make(r, name, ttl=1.5, prefix=prefix)
    stalled_client = _client(proxy.url, timeout=20)
    stalled = kind.make(stalled_client, name, ttl=1.5, prefix=prefix)
    healthy.acquire()
    stalled.acquire()
    assert own_server.process is not None
    if fault == "sigstop":
        os.kill(own_server.process.pid, signal.SIGSTOP)
    else:
        proxy.black_hole()
    try:
        other = kind.make(r, name, ttl=10, prefix=prefix, owner="other")
        assert _first_acquire_time(other, limit=4.5) is None, \
            "the healthy server's hold lapsed while another server stalled"
        assert healthy.owned()
        assert stalled.lost  # told at its deadline, though its server hangs
    finally:
        os.kill(own_server.process.pid, signal.SIGCONT)
        proxy.heal()
    healthy.release()


def test_busy_blocking_pool_does_not_starve_renewal(kind, r, redis_url, prefix, name):
    pool = redis.BlockingConnectionPool.from_url(redis_url, max_connections=2,
                                                 timeout=20)
    client = redis.Redis(connection_pool=pool)
    lock = kind.make(client, name, ttl=1.5, prefix=prefix)
    lock.acquire()
    # The user's own code keeps every connection of the pool busy.
    blockers = [threading.Thread(target=client.blpop, args=([f"{prefix}:nothing"], 4),
                                 daemon=True) for _ in range(2)]
    for t in blockers:
        t.start()
    other = kind.make(r, name, ttl=10, prefix=prefix, owner="other")
    assert _first_acquire_time(other, limit=3.5) is None, \
        "renewal waited for a connection of the user's pool and the hold lapsed"
    for t in blockers:
        t.join(10)
    assert lock.owned()
    lock.release()
    pool.disconnect()


# -- 8. the local view changes only when the server confirms ---------------------------


def test_release_that_never_reached_redis_changes_nothing(kind, own_server, proxy, prefix,
                                                          name):
    client = _client(proxy.url, timeout=0.5)
    lock = kind.make(client, name, ttl=1.5, prefix=prefix)
    lock.acquire()
    lock.acquire()
    proxy.black_hole()
    with pytest.raises(BackendUnavailable):
        lock.release()
    proxy.heal()
    direct = kind.view(_direct(own_server))
    assert direct.hget(lock.keys.lock, "count") == b"2"
    assert lock.depth == 2
    lock.release()  # a good release: count 1, still held and still renewed
    time.sleep(4.5)  # three ttls
    assert lock.owned(), "the hold lapsed after a good release"
    assert direct.hget(lock.keys.lock, "count") == b"1"
    lock.release()
    assert not direct.exists(lock.keys.lock)


def test_loss_is_told_once_and_checks_need_no_redis(kind, own_server, proxy, prefix,
                                                    name):
    client = _client(proxy.url, timeout=0.5)
    lost = _LossRecorder()
    lock = kind.make(client, name, ttl=1.0, prefix=prefix, on_lost=lost)
    lock.acquire()
    proxy.black_hole()
    assert lost.event.wait(3)
    # Redis is unreachable, yet the answers are about the loss, not the backend.
    assert not lock.owned()
    with pytest.raises(LockLost):
        lock.ensure_held()
    with pytest.raises(LockLost):
        lock.extend()
    time.sleep(1.0)
    assert len(lost.times) == 1
    with pytest.raises(LockLost):
        lock.release()
    proxy.heal()


def test_a_hold_told_lost_but_still_on_the_server_is_not_taken_again_as_new(
        kind, own_server, proxy, prefix, name):
    # The holder cannot confirm its hold in time and is told; its release does not get
    # through either, so the server keeps the hold until it expires (later than the
    # holder's deadline).  The same object's next acquire must not re-enter that
    # hold as a new one (its fence would be handed out to two holds): it ends that
    # hold and takes one of its own, with a new fence.
    client = _client(proxy.url, timeout=0.5)
    lost = _LossRecorder()
    lock = kind.make(client, name, ttl=6, prefix=prefix, on_lost=lost,
                     pause_budget=2.5)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    proxy.black_hole()
    assert lost.event.wait(8)
    with pytest.raises(LockLost):
        lock.release()  # it never reaches the server
    proxy.heal()
    direct = kind.view(_direct(own_server))
    assert direct.hget(lock.keys.lock, "count") == b"1", "the hold had already ended"
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and fence is not None and lock.fence > fence
    assert direct.hget(lock.keys.lock, "count") == b"1"  # one acquire: the new one
    assert lock.owned() and not lock.lost
    lock.release()
    assert not direct.exists(lock.keys.lock)
    assert len(lost.times) == 1


def test_a_reentry_granted_after_its_hold_was_told_lost_takes_nothing(
        kind, own_server, proxy, prefix, name):
    # The re-entry reaches the server while the hold is still there, but its reply
    # comes back after the holder's deadline: the holder has been told.  The grant
    # must not become a new hold (same fence, a fresh bound, renewed again): the
    # re-entry raises LockLost and its acquire is undone on the server, whose hold
    # then expires as a lost one does.
    client = _client(proxy.url, timeout=5)
    _load_scripts(kind, client, prefix)
    lost = _LossRecorder()
    lock = kind.make(client, name, ttl=1.0, prefix=prefix, on_lost=lost)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    proxy.delay(0.6)  # each way: a reply comes 1.2 s after its request
    try:
        with pytest.raises(LockLost):
            lock.acquire(blocking=False)
    finally:
        proxy.heal()
    assert len(lost.times) == 1 and lock.lost
    assert lock.depth == 1 and lock.fence == fence
    direct = kind.view(_direct(own_server))
    assert wait_until(lambda: not direct.exists(lock.keys.lock), timeout=5), \
        "the hold told lost is still renewed on the server"
    with pytest.raises(LockLost):
        lock.release()
    assert lock.acquire(blocking=False)  # afresh, with a new fence
    assert lock.fence is not None and fence is not None and lock.fence > fence
    lock.release()
    assert len(lost.times) == 1


# -- a grant that arrives after its own deadline -----------------------------------------


def test_grant_confirmed_after_its_deadline_is_given_back(kind, own_server, proxy, prefix,
                                                          name):
    client = _client(proxy.url, timeout=5)
    _load_scripts(kind, client, prefix)
    lost = _LossRecorder()
    lock = kind.make(client, name, ttl=0.5, prefix=prefix, on_lost=lost)
    proxy.delay(0.35)  # each way: the reply comes 0.7 s after the request, past 0.5 s
    try:
        assert lock.acquire(blocking=False) is False, \
            "acquire returned a hold that may already have expired"
        assert lock.depth == 0 and lock.fence is None
    finally:
        proxy.heal()
    assert not lost.times
    direct = kind.view(_direct(own_server))
    assert wait_until(lambda: not direct.exists(lock.keys.lock), timeout=3)
    assert lock.acquire(blocking=False)  # a prompt link: granted as usual
    lock.release()
