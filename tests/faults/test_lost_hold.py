"""A lost hold is reported wherever it is found, on every kind of lock.

When the servers no longer have a hold (an operator's force release, an empty restart
or a failover that lost the write, stood in for by ``FLUSHALL``) and its holder makes
contact before its next renewal (a nested ``with lock:``, an extend, ``owned()``), the
loss is reported exactly as the scheduler would: ``on_lost`` once, ``lost`` and the
reason set, ``LockLost`` from the call, depth and fence left as they were, and no new
hold taken behind the holder's back.
"""

from __future__ import annotations

import pytest
from lock_kinds import NO_FENCE

from celery_dlock import LockLost, RedisLock

# Where the servers lose the hold: each fault a function of (kind, lock).
FAULTS = {
    "force-release": lambda kind, lock: kind.force_release(lock.name),
    "data-loss": lambda kind, lock: kind.lose_data(lock),
}


def _fence(lock):
    return lock.fence if lock.fences else None


def _nobody_holds(kind, lock) -> bool:
    return all(not c.exists(lock.keys.lock) for c in kind.clients)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_reentry_after_the_hold_is_gone_reports_the_loss(lock_kind, name, fault):
    told: list[object] = []
    lock = lock_kind.make(name, 30, on_lost=told.append)
    lock.acquire()
    fence = _fence(lock)
    FAULTS[fault](lock_kind, lock)

    with pytest.raises(LockLost):
        lock.acquire(blocking=False)  # a nested ``with lock:``

    assert told == [lock], "on_lost must run once, from the re-entry"
    assert lock.lost and lock.lost_reason
    assert lock.depth == 1, "the depth is left as it was"
    assert _fence(lock) == fence, "the fence never changes in the middle of a hold"
    assert _nobody_holds(lock_kind, lock), "no new hold was taken implicitly"
    # The holder's outer block ends with the loss, not with LockNotOwned.
    with pytest.raises(LockLost):
        lock.release()
    assert told == [lock]
    assert lock.depth == 0
    # The next acquire is a fresh hold, renewed as usual.
    assert lock.acquire(blocking=False)
    assert not lock.lost and lock.owned()
    lock.release()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_nested_block_after_the_hold_is_gone_raises_lost(lock_kind, name, fault):
    told: list[object] = []
    lock = lock_kind.make(name, 30, on_lost=told.append)
    with pytest.raises(LockLost), lock:
        FAULTS[fault](lock_kind, lock)
        with lock:
            pytest.fail("the inner block ran on a hold the servers no longer have")
    assert told == [lock]
    assert lock.depth == 0


@pytest.mark.parametrize("check", ["extend", "owned", "ensure_held"])
def test_every_contact_reports_a_gone_hold_once(lock_kind, name, check):
    told: list[object] = []
    lock = lock_kind.make(name, 30, on_lost=told.append)
    lock.acquire()
    lock_kind.force_release(name)
    if check == "owned":
        assert lock.owned() is False
    else:
        with pytest.raises(LockLost):
            getattr(lock, check)()
    assert told == [lock] and lock.lost
    # Every later contact answers from the known loss, and tells nobody again.
    assert lock.owned() is False
    with pytest.raises(LockLost):
        lock.ensure_held()
    with pytest.raises(LockLost):
        lock.acquire(blocking=False)
    with pytest.raises(LockLost):
        lock.release()
    assert told == [lock]


def test_reentry_finds_another_hold_of_the_same_owner_is_not_its_own(lock_kind, prefix,
                                                                    name):
    # The hold was released by force and the same owner took the lock again through
    # another object: a re-entry of the first object's hold must not join that new
    # hold (its fence differs), or the first holder would carry on as if it had
    # held the lock all along.
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    first = lock_kind.make(name, 30, prefix=prefix, owner="same-owner")
    second = lock_kind.make(name, 30, prefix=prefix, owner="same-owner")
    first.acquire()
    lock_kind.drop_hold(first)
    second.acquire()
    with pytest.raises(LockLost):
        first.acquire(blocking=False)
    assert first.lost and not second.lost
    assert r.hget(second.keys.lock, "count") == b"1"
    second.release()
    with pytest.raises(LockLost):
        first.release()


def test_fences_never_repeat_after_the_server_lost_its_data(lock_kind, prefix, name):
    if not lock_kind.fences:
        pytest.skip(NO_FENCE)
    seen = []
    for _ in range(3):
        lock = lock_kind.make(name, 30, prefix=prefix)
        with lock:
            seen.append(lock.fence)
    lock_kind.lose_data(lock)  # an empty restart: hold and counter gone
    for _ in range(3):
        lock = lock_kind.make(name, 30, prefix=prefix)
        with lock:
            seen.append(lock.fence)
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
    assert all(isinstance(f, int) and 0 < f < 2**63 for f in seen)


def test_fences_stay_above_a_counter_left_by_an_older_version(r, prefix, name):
    """The fence counter's key as an older version left it: RedisLock's own layout."""
    lock = RedisLock(r, name, 30, prefix=prefix)
    r.set(f"{lock.keys.lock}:fence", 7)
    with lock:
        first = lock.fence
    assert first is not None and first > 7
    r.set(f"{lock.keys.lock}:fence", 2**52)  # a counter ahead of the clock
    with lock:
        assert lock.fence == 2**52 + 1


def test_reentry_keeps_its_fence(lock_kind, name):
    if not lock_kind.fences:
        pytest.skip(NO_FENCE)
    lock = lock_kind.make(name, 30)
    with lock:
        fence = lock.fence
        with lock:
            assert lock.fence == fence
        assert lock.fence == fence


@pytest.mark.parametrize("callback", [False, True], ids=["no-on-lost", "on-lost"])
def test_a_loss_the_renewal_finds_is_one_warning_naming_the_lock(lock_kind, name,
                                                                 callback, caplog):
    """Without ``on_lost`` the loss is one WARNING, ``lock 'NAME' lost: ...``, naming
    the lock as its user named it (not the storage key); with ``on_lost`` the callback
    is how its owner is told, and the line drops to DEBUG."""
    import time

    told: list[object] = []
    ttl = 2.0 if lock_kind.name == "zookeeper" else 1.0
    lock = lock_kind.make(name, ttl, on_lost=told.append if callback else None)
    with caplog.at_level("DEBUG", logger="celery_dlock"):
        lock.acquire()
        lock_kind.force_release(name)
        deadline = time.monotonic() + ttl * 3 + 2
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost
        time.sleep(0.2)
    ours = [r for r in caplog.records if r.name.startswith("celery_dlock")
            and "lost" in r.getMessage() and r.levelno >= 30]
    if callback:
        assert ours == [] and told == [lock]
        assert [r for r in caplog.records
                if r.getMessage().startswith(f"lock {name!r} lost")]
    else:
        assert [r.getMessage().split(":")[0] for r in ours] == [f"lock {name!r} lost"]
