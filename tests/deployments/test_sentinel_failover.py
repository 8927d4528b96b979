"""A Sentinel failover under a renewed hold: SIGKILL the master, a replica is promoted.

One group for the module (a master, a replica, three sentinels, down-after 1000 ms).
Each test kills the current master, then brings the killed server back (empty: no
persistence), which the sentinels turn into a replica of the new master, so the next
test can fail over again.

* ttl longer than the failover: the holder's renewals reach the promoted replica, the
  hold survives and no other owner gets the lock meanwhile.
* ttl shorter than the failover: the holder is told (``on_lost``, at its local
  deadline) before any other owner acquires, and the new owner's fence is higher.

Before each kill the test waits (``WAIT 1``) until the replica has the hold: what
asynchronous replication can lose when it has not is in docs/deployments.md.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest
import redis
from dlock_helpers import try_acquire, until_while, wait_until
from servers import SentinelGroup

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.backends.redis.topology import client_from_url, default_client_options

pytestmark = pytest.mark.slow


def _client(group: SentinelGroup) -> Any:
    return client_from_url(group.url(), default_client_options(),
                           {"master_name": group.master_name})


def _replicated(group: SentinelGroup) -> None:
    master = group.server_on(group.current_master_port()).client(socket_timeout=5)
    try:
        assert int(master.execute_command("WAIT", 1, 5000)) >= 1
    finally:
        master.close()


def _kill_master(group: SentinelGroup) -> int:
    port = group.current_master_port()
    group.server_on(port).kill(signal.SIGKILL)
    return port


def _bring_back(group: SentinelGroup, port: int) -> None:
    """Restart the killed server and wait until it replicates the new master."""
    back = group.server_on(port).start()
    master_port = group.current_master_port()
    # (the sentinels would reconfigure it too, within about ten seconds)
    replica = back.client(socket_timeout=2)
    replica.execute_command("REPLICAOF", "127.0.0.1", master_port)
    replica.close()
    assert wait_until(group.replicas_ready, 30, 0.1), \
        "the old master never became a healthy replica of the new one"


def test_a_hold_with_a_longer_ttl_survives_the_failover(sentinel_group):
    group = sentinel_group
    prefix = f"dlf{uuid.uuid4().hex[:8]}"
    lost: list[str] = []
    holder_client, other_client = _client(group), _client(group)
    a = RedisLock(holder_client, "long", ttl=15, owner="A", prefix=prefix,
                  on_lost=lambda lock: lost.append("A"))
    b = RedisLock(other_client, "long", ttl=15, owner="B", prefix=prefix,
                  auto_renew=False)
    assert a.acquire()
    fence = a.fence
    _replicated(group)
    old = _kill_master(group)
    b_got: list[float] = []

    def contend() -> None:
        if try_acquire(b):
            b_got.append(time.monotonic())

    try:
        assert until_while(lambda: group.current_master_port() != old, 30, contend), \
            "no failover"

        def a_holds_on_the_new_master() -> bool:
            try:
                return a.owned()
            except BackendUnavailable:
                return False

        assert until_while(a_holds_on_the_new_master, 15, contend)
        # a few renewal rounds on the new master, still contended
        until_while(lambda: False, 1.5, contend)
        assert not b_got, "another owner got the lock during the failover"
        assert not lost and not a.lost
        assert a.fence == fence
        a.release()
        assert b.acquire(blocking=False)
        assert b.fence is not None and fence is not None and b.fence > fence
        b.release()
    finally:
        _bring_back(group, old)
        holder_client.close()
        other_client.close()


def test_a_hold_with_a_shorter_ttl_is_lost_before_anyone_else_acquires(
        sentinel_group):
    group = sentinel_group
    prefix = f"dlf{uuid.uuid4().hex[:8]}"
    told_at: list[float] = []
    holder_client, other_client = _client(group), _client(group)
    a = RedisLock(holder_client, "short", ttl=1.0, owner="A", prefix=prefix,
                  on_lost=lambda lock: told_at.append(time.time()))
    b = RedisLock(other_client, "short", ttl=10, owner="B", prefix=prefix,
                  auto_renew=False)
    assert a.acquire()
    fence = a.fence
    _replicated(group)
    killed_at = time.time()
    old = _kill_master(group)
    try:
        assert until_while(lambda: try_acquire(b), 30, lambda: None), \
            "B never got the lock"
        assert told_at, "the holder was never told"
        acquired_at_ms = int(other_client.hget(b.keys.lock, "acquired_at"))
        # told at its deadline (within the ttl of the kill), before B's acquire ran
        assert told_at[0] - killed_at < 1.0
        assert int(told_at[0] * 1000) <= acquired_at_ms, (told_at[0], acquired_at_ms)
        assert a.lost
        assert b.fence is not None and fence is not None and b.fence > fence
        b.release()
    finally:
        _bring_back(group, old)
        holder_client.close()
        other_client.close()


def test_the_client_found_the_new_master(sentinel_group):
    # (after two failovers the group still answers, through the same URL)
    client = _client(sentinel_group)
    try:
        with RedisLock(client, "after", prefix=f"dlf{uuid.uuid4().hex[:8]}") as lock:
            port = sentinel_group.current_master_port()
            direct = redis.Redis(port=port)
            assert direct.hget(lock.keys.lock, "owner") is not None
            direct.close()
    finally:
        client.close()
