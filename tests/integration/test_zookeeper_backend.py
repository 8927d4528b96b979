"""The ZooKeeper backend's ``Backend`` face on a real server: reading, listing,
counting waiters and releasing by force (the lock itself runs the ``lock_kind``
contract tests)."""

from __future__ import annotations

import os
import threading

import pytest
from dlock_helpers import wait_until

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import LockLost
from celery_dlock.backends.zookeeper import ZooKeeperLock, backend_from_url
from celery_dlock.core.holds import HoldChanged
from celery_dlock.core.lock_options import LockOptions
from celery_dlock.core.protocol import Backend


def test_read_holds_and_waiting_show_the_holder_and_its_line(zk_server, prefix, name):
    backend = backend_from_url(zk_server.url)
    as_protocol: Backend = backend  # what task/ and ops/ see of it
    assert as_protocol.kind == "zookeeper"
    assert backend.read(prefix, name) is None
    assert list(backend.holds(prefix)) == []
    lock = backend.lock(LockOptions(
        name, 30, prefix=prefix, owner="me",
        info={"task_name": "proj.job", "task_id": "t-1", "worker": "w1", "extra": "x"}))
    other = backend.lock(LockOptions("other", 30, prefix=prefix))
    with lock, other:
        found = backend.read(prefix, name)
        assert found is not None
        assert (found.key, found.owner, found.count, found.fence) == (
            name, "me", 1, lock.fence)
        assert (found.task_name, found.task_id, found.worker) == ("proj.job", "t-1",
                                                                  "w1")
        assert found.pid == os.getpid() and found.extra == {"extra": "x"}
        assert found.ttl == 30 and found.held_for is not None
        assert sorted(h.key for h in backend.holds(prefix)) == sorted([name, "other"])

        waiter = ZooKeeperLock(zk_server.url, name, 30, prefix=prefix, owner="w")
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=1.5))
        thread.start()
        assert wait_until(lambda: backend.waiting(prefix, [name, "other"]) ==
                          {name: 1, "other": 0})
        thread.join(10)
        assert backend.waiting(prefix, [name]) == {name: 0}  # it gave up and left
    assert backend.read(prefix, name) is None
    assert list(backend.holds(prefix)) == []


def test_force_release_frees_the_hold_and_the_holder_is_told(zk_server, prefix, name):
    backend = backend_from_url(zk_server.url)
    told: list[object] = []
    lock = backend.lock(LockOptions(name, 30, prefix=prefix, on_lost=told.append))
    lock.acquire()
    fence = lock.fence
    assert fence is not None
    with pytest.raises(HoldChanged):
        backend.force_release(prefix, name, fence=fence + 1)
    assert backend.force_release(prefix, name, conditions={"pid": "1"}) is None
    assert lock.owned() and not told
    freed = backend.force_release(prefix, name, fence=fence, by="ops", reason="stuck")
    assert freed is not None and freed.fence == fence
    assert backend.read(prefix, name) is None
    assert backend.force_release(prefix, name) is None
    with pytest.raises(LockLost, match="node is gone"):
        lock.ensure_held()
    assert told == [lock]
    with pytest.raises(LockLost):
        lock.release()
