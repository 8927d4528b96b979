"""Renewal on a cluster: one renewer per master, so a stalled master delays no other.

A module of its own: it stops a master of its cluster (SIGSTOP), which the other tests
of a shared cluster should not see.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

from dlock_helpers import wait_until

from celery_dlock import RedisLock
from celery_dlock.core.scheduler import get_scheduler


def _by_node(client, locks):
    nodes: dict[str, list[RedisLock]] = {}
    for lock in locks:
        nodes.setdefault(client.get_node_from_key(lock.keys.lock).name, []).append(lock)
    return nodes


def test_one_renewal_round_trip_per_master(cluster_client):
    prefix = f"dlr{uuid.uuid4().hex[:8]}"
    locks = [RedisLock(cluster_client, f"n{i}", ttl=3, prefix=prefix)
             for i in range(60)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    try:
        assert len(_by_node(cluster_client, locks)) == 3
        hb = get_scheduler()
        before = hb.renewal_calls
        time.sleep(2.2)  # two renewal passes at ttl/3 = 1 s
        calls = hb.renewal_calls - before
        # one call per master and pass (not one per slot: 60 names span ~60 slots)
        assert 3 <= calls <= 12, calls
        renewers = [t for t in threading.enumerate()
                    if t.name == "celery-dlock-renewer"]
        assert len(renewers) >= 3
        assert not any(lock.lost for lock in locks)
    finally:
        for lock in locks:
            lock.release()


def test_a_stalled_master_does_not_delay_renewals_on_the_others(cluster, cluster_client):
    prefix = f"dlr{uuid.uuid4().hex[:8]}"
    lost: list[str] = []
    locks = [RedisLock(cluster_client, f"s{i}", ttl=1.5, prefix=prefix,
                       on_lost=lambda lock: lost.append(lock.name)) for i in range(30)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    nodes = _by_node(cluster_client, locks)
    assert len(nodes) == 3
    stalled_name = sorted(nodes)[0]
    stalled = next(s for s in cluster.servers if f"127.0.0.1:{s.port}" == stalled_name)
    stalled.kill(signal.SIGSTOP)
    try:
        on_stalled = {lock.name for lock in nodes[stalled_name]}
        # the holds on the stalled master are declared lost at their deadline...
        assert wait_until(lambda: on_stalled <= set(lost), timeout=5), lost
        # ...while the others keep being renewed, well past their ttl
        time.sleep(3.0)
        others = [lock for name, group in nodes.items() if name != stalled_name
                  for lock in group]
        assert not [lock.name for lock in others if lock.lost]
        assert set(lost) == on_stalled
    finally:
        stalled.kill(signal.SIGCONT)
    for lock in locks:
        if lock.lost:
            continue
        lock.release()
