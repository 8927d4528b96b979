"""``RedisSemaphore`` on Redis Cluster: every key of a semaphore (its holders, each
hold's hash, the fence counter, the line, the doorbells) lives in one slot, as a
lock's do, and the slots, renewal and listing work across masters."""

from __future__ import annotations

import uuid

import redis.cluster
from test_cluster import odd_names

from celery_dlock import RedisSemaphore
from celery_dlock.backends.redis.inspect import iter_locks


def test_every_key_of_a_semaphore_is_in_one_slot(
        cluster_client: redis.cluster.RedisCluster) -> None:
    for name in odd_names(200):
        keys = RedisSemaphore(cluster_client, name, 3, prefix="cs").keys
        slots = {cluster_client.keyslot(k)
                 for k in (*keys[:4], keys.released, keys.doorbell("o"),
                           keys.holder("o"))}
        assert len(slots) == 1, (name, keys.lock, slots)


def test_slots_fences_and_listing_across_masters(
        cluster_client: redis.cluster.RedisCluster) -> None:
    prefix = f"csm{uuid.uuid4().hex[:6]}"
    names = [*odd_names(12, seed=3), "plain"]
    held = []
    for name in names:
        sems = [RedisSemaphore(cluster_client, name, 2, ttl=20, prefix=prefix,
                               owner=f"o{i}") for i in range(3)]
        assert sems[0].acquire(blocking=False), name
        assert sems[1].acquire(blocking=False), name
        assert not sems[2].acquire(blocking=False), name  # both slots taken
        assert sems[1].fence is not None and sems[0].fence is not None
        assert sems[1].fence > sems[0].fence
        assert {h.owner for h in sems[2].holders()} == {"o0", "o1"}
        held.append(sems[:2])
    try:
        listed = {info.key: info for info in iter_locks(cluster_client, prefix)}
        assert set(listed) == set(names)  # from every master, each once
        assert all(info.limit == 2 for info in listed.values())
        nodes = {cluster_client.get_node_from_key(pair[0].keys.lock).name
                 for pair in held}
        assert len(nodes) == 3  # the names spread over every master
    finally:
        for pair in held:
            for sem in pair:
                sem.release()
    assert not list(iter_locks(cluster_client, prefix))
