"""A Redis Cluster failover under renewed holds: SIGKILL the master of a lock's slot,
Cluster promotes its replica (three masters with a replica each, node timeout 2 s).

Renewal goes to the master that served the slot when the hold was taken, over a
connection of its own (:mod:`celery_dlock.backends.redis.cluster`); when that master is
gone,
renewal falls back to the user's cluster client, which finds the promoted replica.

* ttl longer than the failover: the hold survives on the promoted replica and no other
  owner gets the lock meanwhile; holds on the other masters are untouched.
* ttl shorter than the failover: the holder is told (``on_lost``) before any other
  owner acquires, and the new owner's fence is higher.

Before the kill the test waits (``WAIT 1``) until the replica has the hold.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from dlock_helpers import try_acquire, until_while
from servers import Cluster, supports_cluster

from celery_dlock import RedisLock
from celery_dlock.backends.redis.keyspace import LockKeys

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster_with_replicas() -> Iterator[Cluster]:
    """One cluster for the module: each test kills a different master."""
    why = supports_cluster()
    if why:
        pytest.skip(why)
    cluster = Cluster(masters=3, replicas=1).start()
    yield cluster
    cluster.stop()


def _client(cluster: Cluster) -> Any:
    return cluster.client(socket_timeout=2, socket_connect_timeout=1)


def _kill_master_of(cluster: Cluster, key: str) -> int:
    master = cluster.master_of(key)
    assert master in cluster.servers[:cluster.masters], "a master with no replica"
    direct = master.client(socket_timeout=5)
    try:
        assert int(direct.execute_command("WAIT", 1, 5000)) >= 1, "not replicated"
    finally:
        direct.close()
    master.kill(signal.SIGKILL)
    return master.port


def _name_on_a_replicated_master(cluster: Cluster, prefix: str, stem: str) -> str:
    """A lock name served by one of the first masters (each has a replica; a master
    promoted by an earlier test has none)."""
    return next(n for n in (f"{stem}-{i}" for i in range(500))
                if cluster.master_of(LockKeys.for_name(prefix, n).lock)
                in cluster.servers[:cluster.masters])


def _promoted(cluster: Cluster, key: str, old_port: int) -> Callable[[], bool]:
    alive = next(s for s in cluster.servers if s.port != old_port)

    def check() -> bool:
        probe = redis.Redis(port=alive.port, socket_timeout=1)
        try:
            slot = int(probe.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_ in probe.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1]) != old_port
            return False
        except redis.RedisError:
            return False
        finally:
            probe.close()

    return check


def test_a_hold_with_a_longer_ttl_survives_a_master_failover(cluster_with_replicas):
    cluster = cluster_with_replicas
    prefix = f"dlcf{uuid.uuid4().hex[:8]}"
    holder_client, other_client = _client(cluster), _client(cluster)
    lost: list[str] = []
    name = _name_on_a_replicated_master(cluster, prefix, "long")
    a = RedisLock(holder_client, name, ttl=8, owner="A", prefix=prefix,
                  on_lost=lambda lock: lost.append(lock.name))
    b = RedisLock(other_client, name, ttl=8, owner="B", prefix=prefix,
                  auto_renew=False)
    # a hold on another master, which the failover must not disturb
    key = a.keys.lock
    elsewhere = next(n for n in (f"other-{i}" for i in range(500))
                     if cluster.master_of(LockKeys.for_name(prefix, n).lock).port !=
                     cluster.master_of(key).port)
    c = RedisLock(holder_client, elsewhere, ttl=8, owner="A", prefix=prefix,
                  on_lost=lambda lock: lost.append(lock.name))
    assert a.acquire(blocking=False) and c.acquire(blocking=False)
    fence = a.fence
    b_got: list[float] = []

    def contend() -> None:
        if try_acquire(b):
            b_got.append(time.monotonic())

    try:
        old = _kill_master_of(cluster, key)
        assert until_while(_promoted(cluster, key, old), 30, contend), "no failover"
        # two ttls on: the hold was renewed on the promoted replica all along
        until_while(lambda: False, 16, contend)
        assert not b_got, "another owner got the lock during the failover"
        assert not lost and not a.lost and a.owned() and c.owned()
        holder = b.holder()
        assert holder is not None and holder.owner == "A"
        a.release()
        assert b.acquire(blocking=False)
        assert b.fence is not None and fence is not None and b.fence > fence
        b.release()
        c.release()
    finally:
        holder_client.close()
        other_client.close()


def test_a_hold_with_a_shorter_ttl_is_lost_before_anyone_else_acquires(
        cluster_with_replicas):
    cluster = cluster_with_replicas
    prefix = f"dlcf{uuid.uuid4().hex[:8]}"
    holder_client, other_client = _client(cluster), _client(cluster)
    told_at: list[float] = []
    name = _name_on_a_replicated_master(cluster, prefix, "short")
    a = RedisLock(holder_client, name, ttl=1.0, owner="A", prefix=prefix,
                  on_lost=lambda lock: told_at.append(time.time()))
    b = RedisLock(other_client, name, ttl=10, owner="B", prefix=prefix,
                  auto_renew=False)
    assert a.acquire(blocking=False)
    fence = a.fence
    try:
        killed_at = time.time()
        _kill_master_of(cluster, a.keys.lock)
        assert until_while(lambda: try_acquire(b), 40, lambda: None), \
            "B never got the lock"
        assert told_at, "the holder was never told"
        acquired_at_ms = int(other_client.hget(b.keys.lock, "acquired_at"))
        assert told_at[0] - killed_at < 1.0
        assert int(told_at[0] * 1000) <= acquired_at_ms, (told_at[0], acquired_at_ms)
        assert a.lost
        assert b.fence is not None and fence is not None and b.fence > fence
        b.release()
    finally:
        holder_client.close()
        other_client.close()
