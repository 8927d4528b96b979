"""On a Redis Cluster, the holder of a force-released lock is told who and why too:
the marker shares the lock's slot, and renewal reads it on the master it renews on."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis.cluster

from celery_dlock import LockLost, RedisLock
from celery_dlock.backends.redis.inspect import force_release, iter_locks


@pytest.fixture
def prefix() -> str:
    return f"dlr{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("name", ["job:7", "}锁{"])
def test_renewing_holder_on_a_cluster_gets_the_reason(cluster_client: redis.cluster.
                                                      RedisCluster, prefix: str,
                                                      name: str) -> None:
    told = threading.Event()
    reasons: list[str | None] = []

    def on_lost(lock: RedisLock) -> None:
        reasons.append(lock._lost_reason)
        told.set()

    lock = RedisLock(cluster_client, name, ttl=3, prefix=prefix, on_lost=on_lost)
    assert lock.acquire(blocking=False)
    marker = lock.keys.released
    assert cluster_client.keyslot(marker) == cluster_client.keyslot(lock.keys.lock)
    freed = force_release(cluster_client, prefix, name, by="ops@admin",
                          reason="rebalancing shards")
    assert freed is not None and freed.fence == lock.fence
    assert told.wait(10), "the holder was never told"
    assert reasons == ["released by ops@admin: rebalancing shards"]
    with pytest.raises(LockLost, match="rebalancing shards"):
        lock.ensure_held()
    assert list(iter_locks(cluster_client, prefix)) == []
    cluster_client.delete(marker)
