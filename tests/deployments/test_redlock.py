"""RedlockLock against three redis-servers of each test's own (no persistence), which
the tests SIGSTOP, kill and restart empty.

Timing bounds are generous (a loaded CI machine); every wait is bounded.
"""

from __future__ import annotations

import importlib.util
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from dlock_helpers import wait_until
from servers import Server

from celery_dlock import (
    BackendUnavailable,
    FencingUnavailable,
    InvalidLockConfig,
    LockNotAcquired,
    RedlockLock,
)
from celery_dlock.core.scheduler import RenewalScheduler

_TESTS = Path(__file__).resolve().parents[1]


def _load_proxy() -> Any:
    spec = importlib.util.spec_from_file_location("dlock_fault_proxy",
                                                  _TESTS / "faults" / "proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FaultProxy


def _lock(clients: list[redis.Redis], name: str, owner: str,
          **kwargs: Any) -> RedlockLock:
    kwargs.setdefault("ttl", 2.0)
    kwargs.setdefault("node_timeout", 0.2)
    return RedlockLock(clients, name, owner=owner, prefix="rl", **kwargs)


def test_mutual_exclusion_between_owners(trio):
    a = _lock(trio.clients(), "x", "owner-a")
    b = _lock(trio.clients(), "x", "owner-b")
    assert a.acquire(blocking=False)
    # a quorum at once; the third node's answer may come just after the grant
    assert trio.holders(a.keys.lock).count("owner-a") >= 2
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    assert not b.acquire(blocking=False)
    assert b.last_holder is not None and b.last_holder.owner == "owner-a"
    started = time.monotonic()
    assert not b.acquire(timeout=0.3)
    assert 0.25 <= time.monotonic() - started < 3.0
    with pytest.raises(LockNotAcquired), \
            _lock(trio.clients(), "x", "owner-b", blocking_timeout=0.1):
        pass
    holder = b.holder()
    assert holder is not None and holder.owner == "owner-a" and holder.fence is None
    assert a.owned() and not b.owned() and b.locked()
    a.release()
    assert b.acquire(timeout=2.0)
    # a quorum at once; a's release may reach the third node just after b asked it
    assert trio.holders(b.keys.lock).count("owner-b") >= 2
    assert wait_until(lambda: "owner-a" not in trio.holders(b.keys.lock))
    b.release()
    assert not a.locked()


def test_reentrancy_and_release_on_all_nodes(trio):
    a = _lock(trio.clients(), "re", "owner-a")
    a2 = _lock(trio.clients(), "re", "owner-a")
    assert a.acquire(blocking=False)
    assert a2.acquire(blocking=False)  # another object of the same owner re-enters
    with a:
        assert a.depth == 2
        nodes = trio.clients()
        assert wait_until(lambda: [int(c.hget(a.keys.lock, "count") or 0)
                                   for c in nodes] == [3, 3, 3])
    a2.release()
    assert trio.holders(a.keys.lock) == ["owner-a"] * 3
    a.release()
    assert a.depth == 0
    # the release is back once a quorum confirmed; the last node follows
    assert wait_until(lambda: trio.holders(a.keys.lock) == [None, None, None])


def test_renewal_keeps_the_hold_past_several_ttls(trio):
    a = _lock(trio.clients(), "renew", "owner-a", ttl=0.9, node_timeout=0.2)
    b = _lock(trio.clients(), "renew", "owner-b", ttl=0.9, node_timeout=0.2)
    assert a.acquire(blocking=False)
    end = time.monotonic() + 3.0  # over three ttls
    while time.monotonic() < end:
        assert not b.acquire(blocking=False)
        time.sleep(0.1)
    a.ensure_held()
    assert not a.lost
    # on a quorum at least (a node whose renewals time out on a loaded machine may
    # drop out: a hold is not re-made on a node that lost it)
    assert sum(c.pttl(a.keys.lock) > 0 for c in trio.clients()) >= 2
    a.release()


def test_one_node_stopped(trio):
    a = _lock(trio.clients(), "stop", "owner-a", ttl=1.0, node_timeout=0.2)
    b = _lock(trio.clients(), "stop", "owner-b", ttl=1.0, node_timeout=0.2)
    trio.stop_process(1)
    try:
        started = time.monotonic()
        assert a.acquire(blocking=False)
        assert time.monotonic() - started < 1.0
        end = time.monotonic() + 3.0  # three ttls: renewed by the two others
        while time.monotonic() < end:
            started = time.monotonic()
            assert not b.acquire(blocking=False)
            assert time.monotonic() - started < 1.5  # node_timeout, give-back included
            time.sleep(0.1)
        assert not a.lost
        a.ensure_held()
        assert a.holder() is not None
        a.release()
        assert b.acquire(blocking=False)
        b.release()
    finally:
        trio.resume(1)


def test_one_node_killed_then_restarted_empty(trio):
    a = _lock(trio.clients(), "kill", "owner-a", ttl=1.0, node_timeout=0.2)
    b = _lock(trio.clients(), "kill", "owner-b", ttl=1.0, node_timeout=0.2)
    assert a.acquire(blocking=False)
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    trio.servers[0].kill(signal.SIGKILL)
    assert not b.acquire(blocking=False)
    trio.servers[0].start()  # empty: it would grant anyone
    assert trio.holders(a.keys.lock)[0] is None
    for _ in range(10):
        assert not b.acquire(blocking=False)
        time.sleep(0.1)
    # b's grant on the empty node was given back
    assert trio.holders(a.keys.lock) == [None, "owner-a", "owner-a"]
    time.sleep(1.5)  # past a ttl: renewed by the quorum that kept it
    assert not a.lost
    a.ensure_held()
    a.release()
    # the release is back once a quorum confirmed; the last node follows
    assert wait_until(lambda: trio.holders(a.keys.lock) == [None, None, None])


def test_reentry_after_one_node_restarted_empty_keeps_the_outer_hold(trio):
    """A node restarted empty does not end a re-entered hold: the re-entry counts on
    the quorum that kept the hold (the empty node takes nothing), the inner release
    leaves depth 1 there, renewal goes on, and no other owner can acquire."""
    a = _lock(trio.clients(), "reenter", "owner-a", ttl=1.0, node_timeout=0.2)
    b = _lock(trio.clients(), "reenter", "owner-b", ttl=1.0, node_timeout=0.2)
    assert a.acquire(blocking=False)
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    trio.restart_empty(0)
    assert a.acquire(blocking=False)  # the inner block
    assert a.depth == 2 and not a.lost
    assert trio.holders(a.keys.lock)[0] is None  # the empty node took nothing
    a.release()  # the inner block ends
    assert a.depth == 1 and not a.lost
    for _ in range(3):  # past several ttls: renewed by the quorum
        time.sleep(0.5)
        assert not b.acquire(blocking=False)
    assert not a.lost
    a.ensure_held()
    a.release()
    assert wait_until(lambda: b.acquire(blocking=False))
    b.release()


def test_the_first_calls_after_every_node_restarted_work(trio):
    """Each node's idle connection was closed by its restarted server: the node's
    pool replaces it before use (the nodes' calls are never re-sent), so the first
    acquire after the restarts is granted, and renewal goes on."""
    a = _lock(trio.clients(), "restarted", "owner-a", ttl=1.5, node_timeout=0.3)
    assert a.acquire(blocking=False)
    a.release()
    for i in range(3):
        trio.restart_empty(i)
    assert a.acquire(blocking=False)
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    time.sleep(2.0)  # past the ttl: renewed on the restarted nodes
    assert not a.lost, a.lost_reason
    a.ensure_held()
    a.release()
    assert wait_until(lambda: trio.holders(a.keys.lock) == [None] * 3)


def test_reentry_after_one_node_restarted_with_another_slow_keeps_depth_2(trio):
    """Node 0 restarted with its data (the hold is there, its connection is gone)
    and node 2 stopped: the re-entry's quorum is nodes 0 and 1, so node 0's first call
    after its restart must work."""
    a = _lock(trio.clients(), "reenter-slow", "owner-a", ttl=3.0, node_timeout=0.3)
    assert a.acquire(blocking=False)
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    trio.restart_keeping_data(0)
    assert trio.holders(a.keys.lock)[0] == "owner-a"
    trio.stop_process(2)
    try:
        assert a.acquire(blocking=False)  # the inner block
        assert a.depth == 2 and not a.lost
        a.release()
        assert a.depth == 1 and not a.lost
    finally:
        trio.resume(2)
    a.ensure_held()
    a.release()
    assert wait_until(lambda: trio.holders(a.keys.lock) == [None] * 3)


def test_two_nodes_restarted_empty_within_a_ttl_break_exclusion(trio):
    """The documented limit: without persistence (or a delayed restart), two of three
    nodes restarted empty hand the lock to another owner while the first still holds
    it; the first is told only at its next renewal."""
    lost = threading.Event()
    a = _lock(trio.clients(), "two", "owner-a", ttl=6.0, node_timeout=0.2,
              on_lost=lambda _: lost.set())
    b = _lock(trio.clients(), "two", "owner-b", ttl=6.0, node_timeout=0.2)
    assert a.acquire(blocking=False)
    trio.restart_empty(0)
    trio.restart_empty(1)
    assert b.acquire(blocking=False)  # two holders at once
    assert not lost.is_set() and not a.lost
    assert wait_until(lost.is_set, timeout=5.0)  # at a's next renewal (ttl/3)
    b.release()


def test_holder_that_lost_its_quorum_is_told_before_another_owner_acquires(trio):
    told: list[float] = []
    ttl = 1.0
    a = _lock(trio.clients(), "quorum", "owner-a", ttl=ttl, node_timeout=0.15,
              on_lost=lambda _: told.append(time.monotonic()))
    b = _lock(trio.clients(), "quorum", "owner-b", ttl=ttl, node_timeout=0.15)
    assert a.acquire(blocking=False)
    got: list[float] = []
    stop = threading.Event()

    def contender() -> None:
        while not stop.is_set() and not got:
            try:
                if b.acquire(blocking=False):
                    got.append(time.monotonic())
            except BackendUnavailable:
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=contender, daemon=True)
    stopped_at = time.monotonic()
    trio.stop_process(1)
    trio.stop_process(2)
    thread.start()
    try:
        assert wait_until(lambda: bool(told), timeout=3 * ttl)
        time.sleep(ttl)
    finally:
        trio.resume(1)
        trio.resume(2)
    assert wait_until(lambda: bool(got), timeout=5.0)
    stop.set()
    thread.join(5)
    assert told[0] < got[0]
    assert told[0] - stopped_at < ttl  # within the validity of the last renewal
    assert a.lost
    b.release()


def test_a_grant_slower_than_its_validity_is_given_back(trio):
    proxy_class = _load_proxy()
    proxies = [proxy_class(s.port) for s in trio.servers]
    try:
        clients = [redis.Redis(host="127.0.0.1", port=p.port, socket_timeout=5)
                   for p in proxies]
        # validity: ttl 1 s - drift (0.3 * 1 s + 2 ms) = ~0.7 s
        lock = _lock(clients, "slow", "owner-a", ttl=1.0, drift_factor=0.3,
                     node_timeout=0.95)
        assert lock.acquire(blocking=False)  # fast links: granted
        lock.release()
        for p in proxies:
            p.delay(0.4)  # each way: a round trip of 0.8 s
        started = time.monotonic()
        assert not lock.acquire(blocking=False)
        assert time.monotonic() - started >= 0.7
        assert lock.last_holder is None and lock.depth == 0
        assert wait_until(lambda: trio.holders(lock.keys.lock) == [None] * 3,
                          timeout=5.0)
        for c in clients:
            c.close()
    finally:
        for p in proxies:
            p.close()


def test_fence_raises_and_the_error_travels(trio):
    a = _lock(trio.clients(), "fence", "owner-a")
    with a, pytest.raises(FencingUnavailable) as caught:
        _ = a.fence
    assert "restarts" in str(caught.value) and caught.value.lock_name == "fence"
    again = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(again, FencingUnavailable) and str(again) == str(caught.value)
    rebuilt = FencingUnavailable(*caught.value.args)
    assert str(rebuilt) == str(caught.value)


def test_bad_construction_is_refused(trio):
    c = trio.clients()
    cases = [
        (c[:2], "3 or more"),
        ([c[0], c[1], trio.servers[0].client()], "nodes 0 and 2"),
        ([c[0], c[1], "redis://127.0.0.1:1/0"], "not a URL"),
        (c[0], "list of 3 or more"),
    ]
    for clients, text in cases:
        with pytest.raises(InvalidLockConfig) as caught:
            RedlockLock(clients, "bad")
        message = str(caught.value)
        assert text in message and "\n" not in message
    with pytest.raises(InvalidLockConfig, match="node_timeout"):
        RedlockLock(c, "bad", ttl=1.0, node_timeout=1.0)
    with pytest.raises(InvalidLockConfig, match="drift_factor"):
        RedlockLock(c, "bad", drift_factor=0.5)
    # an even number is allowed: 4 nodes, quorum 3
    fourth = Server(str(trio.servers[0].dir.parent), []).start()
    try:
        lock = RedlockLock([*c, fourth.client()], "even")
        assert lock.quorum == 3
    finally:
        fourth.stop()


def test_own_heartbeat_clock_is_used_for_validity(trio):
    """The validity check reads the scheduler's clock: a clock that jumps past the ttl
    between send and reply makes a fast quorum invalid (given back)."""
    ticks = iter([0.0, 10.0])
    hb = RenewalScheduler(clock=lambda: next(ticks, 20.0), start_thread=False)
    lock = _lock(trio.clients(), "clock", "owner-a", scheduler=hb)
    assert not lock.acquire(blocking=False)
    # a node that had not answered yet is undone in the background
    assert wait_until(lambda: trio.holders(lock.keys.lock) == [None] * 3)


def test_an_undecided_release_changes_nothing_and_can_be_sent_again(trio):
    a = _lock(trio.clients(), "undecided", "owner-a", ttl=5.0, node_timeout=0.2)
    assert a.acquire(blocking=False)
    assert wait_until(lambda: trio.holders(a.keys.lock) == ["owner-a"] * 3)
    trio.stop_process(1)
    trio.stop_process(2)
    try:
        with pytest.raises(BackendUnavailable, match="1 of 3 nodes answered"):
            a.release()  # only node 0 released: nobody can tell
        assert a.depth == 1 and not a.lost
    finally:
        trio.resume(1)
        trio.resume(2)
    a.release()  # the same operation again: node 0 says "released" again
    assert a.depth == 0 and not a.lost
    assert wait_until(lambda: trio.holders(a.keys.lock) == [None] * 3)


def test_a_cluster_client_is_refused(trio, cluster_client):
    c = trio.clients()
    with pytest.raises(InvalidLockConfig, match="not a cluster client") as caught:
        RedlockLock([c[0], c[1], cluster_client], "bad")
    assert "\n" not in str(caught.value)


def test_extend_uses_the_new_ttl_s_drift_allowance(trio):
    t = [1000.0]
    sched = RenewalScheduler(clock=lambda: t[0], start_thread=False)
    told: list[object] = []
    lock = _lock(trio.clients(), "ext", "owner-a", ttl=2.0, drift_factor=0.3,
                 scheduler=sched, auto_renew=False, on_lost=told.append)
    assert lock.acquire(blocking=False)
    try:
        lock.extend(6)  # sent at 1000: 6 - (6 * 0.3 + 0.002) - 0.6 (pause budget)
        sched.renew_due(1000.0 + 3.59)
        assert told == []
        sched.renew_due(1000.0 + 3.61)
        assert told == [lock]
    finally:
        lock.release_all()


def test_a_contended_redlock_names_its_holder_without_a_fence(trio):
    a = _lock(trio.clients(), "nofence", "owner-a")
    b = _lock(trio.clients(), "nofence", "owner-b")
    assert a.acquire(blocking=False)
    try:
        assert not b.acquire(blocking=False)
        assert b.last_holder is not None and b.last_holder.owner == "owner-a"
        assert b.last_holder.fence is None  # one node's counter is no fencing token
    finally:
        a.release()


def test_check_reports_a_node_down_as_passing_and_no_quorum_as_unavailable(trio):
    """``celery dlock check`` and a worker's start on a Redlock: one node down is a
    problem that may pass (the quorum works: a worker starts), two of three down is a
    store that does not answer."""
    from celery_dlock.backends.redis.redlock.backend import RedlockBackend

    backend = RedlockBackend(trio.clients(socket_timeout=1, socket_connect_timeout=1))
    assert backend.check("chk") == []
    trio.servers[2].kill(signal.SIGKILL)
    (problem,) = backend.check("chk")
    assert problem.text.startswith("Redlock node 3 of 3 does not answer")
    assert problem.lasting is False
    trio.servers[1].kill(signal.SIGKILL)
    with pytest.raises(BackendUnavailable, match="no quorum"):
        backend.check("chk")
