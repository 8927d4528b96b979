"""Semaphores (``lock_limit`` above 1) on ZooKeeper, on a real server
(docs/backends.md, "Semaphores on ZooKeeper"): the ``limit`` lowest children of the
lock node hold a slot each, the others wait in arrival order, woken by a watch on the
line.  The lock itself (limit 1) runs the ``lock_kind`` contract tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dlock_helpers import wait_until

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import LockLost, LockNotOwned
from celery_dlock.backends.zookeeper import ZooKeeperLock, backend_from_url
from celery_dlock.backends.zookeeper.lock import WAIT_SLICE
from celery_dlock.backends.zookeeper.nodes import lock_path
from celery_dlock.core.lock_options import LockOptions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def zk(zk_server: Any) -> Iterator[Any]:
    """A plain kazoo client of the suite's server, to look at the nodes."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=zk_server.hosts, timeout=10)
    client.start(timeout=20)
    yield client
    client.stop()
    client.close()


def _slot(url: str, prefix: str, name: str, owner: str, limit: int = 3,
          ttl: float = 30.0, **kw: Any) -> ZooKeeperLock:
    lock: ZooKeeperLock = backend_from_url(url).lock(LockOptions(
        name, ttl, prefix=prefix, owner=owner, limit=limit, **kw))
    return lock


def _line(zk: Any, prefix: str, name: str) -> list[dict[str, Any]]:
    """The children's data of ``name``'s lock node, in line order."""
    path = lock_path(prefix, name)
    kids = sorted(zk.get_children(path), key=lambda n: n[-10:])
    return [json.loads(zk.get(f"{path}/{kid}")[0]) for kid in kids]


def test_limit_owners_hold_at_once_and_the_next_is_refused(zk_server, prefix, name):
    slots = [_slot(zk_server.url, prefix, name, f"o{n}") for n in range(3)]
    for lock in slots:
        assert lock.acquire(blocking=False)
    fences = [lock.fence for lock in slots]
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(fences) and len(set(fences)) == 3  # distinct, increasing
    late = _slot(zk_server.url, prefix, name, "late")
    assert not late.acquire(blocking=False)
    assert late.last_holder is not None and late.last_holder.owner == "o0"
    assert late.waiting_count() == 0  # the refused acquire left no child
    assert [h.owner for h in late.holders()] == ["o0", "o1", "o2"]
    assert late.locked() and late.holder() is not None
    assert all(lock.owned() for lock in slots)
    slots[1].release()
    assert late.acquire(blocking=False)
    assert late.fence is not None and late.fence > max(f or 0 for f in fences)
    for lock in (slots[0], slots[2], late):
        lock.release()
    assert not late.locked()


def test_a_non_blocking_acquire_that_loses_the_race_leaves_the_line(
        zk_server, zk, prefix, name, monkeypatch):
    a = _slot(zk_server.url, prefix, name, "a", limit=2)
    assert a.acquire(blocking=False)
    b = _slot(zk_server.url, prefix, name, "b", limit=2)
    c = _slot(zk_server.url, prefix, name, "c", limit=2)
    join = b._join_line

    def overtaken(owner: str, op: str) -> None:
        # b saw one free slot; c takes it before b's create lands
        assert c.acquire(blocking=False)
        join(owner, op)

    monkeypatch.setattr(b, "_join_line", overtaken)
    assert not b.acquire(blocking=False)
    assert [d["owner"] for d in _line(zk, prefix, name)] == ["a", "c"]  # b left
    assert b.last_holder is not None and b.last_holder.owner == "a"
    c.release()
    a.release()


def test_reentry_takes_no_second_slot(zk_server, zk, prefix, name):
    a = _slot(zk_server.url, prefix, name, "a", limit=2)
    a_again = _slot(zk_server.url, prefix, name, "a", limit=2)
    assert a.acquire(blocking=False) and a.acquire(blocking=False)
    assert a_again.acquire(blocking=False)  # the same owner through another object
    assert a_again.fence == a.fence
    line = _line(zk, prefix, name)
    assert [(d["owner"], d["count"], d["limit"]) for d in line] == [("a", 3, 2)]
    b = _slot(zk_server.url, prefix, name, "b", limit=2)
    assert b.acquire(blocking=False)  # the second slot is still free
    assert not _slot(zk_server.url, prefix, name, "c", limit=2).acquire(blocking=False)
    a_again.release()
    a.release()
    assert [(d["owner"], d["count"]) for d in _line(zk, prefix, name)] == [
        ("a", 1), ("b", 1)]
    a.release()
    b.release()
    assert not b.locked()


def test_release_is_owner_only(zk_server, zk, prefix, name):
    a = _slot(zk_server.url, prefix, name, "a")
    assert a.acquire(blocking=False)
    stranger = _slot(zk_server.url, prefix, name, "stranger")
    with pytest.raises(LockNotOwned):
        stranger.release()
    assert not stranger.owned()
    with pytest.raises(LockNotOwned):
        stranger.extend()
    assert [d["owner"] for d in _line(zk, prefix, name)] == ["a"]
    assert a.owned()
    a.release()
    with pytest.raises(LockNotOwned):
        a.release()


def test_a_waiter_is_woken_by_a_holder_that_is_not_its_predecessor(zk_server, prefix,
                                                                   name):
    first = _slot(zk_server.url, prefix, name, "first", limit=2)
    second = _slot(zk_server.url, prefix, name, "second", limit=2)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    waiter = _slot(zk_server.url, prefix, name, "waiter", limit=2)
    got: list[float] = []
    thread = threading.Thread(
        target=lambda: waiter.acquire(timeout=30) and got.append(time.monotonic()))
    thread.start()
    try:
        assert wait_until(lambda: waiter.waiting_count() == 1, timeout=10)
        time.sleep(0.3)  # it is asleep on its watch now
        released = time.monotonic()
        first.release()  # the child before the waiter's is second's: still there
        thread.join(10)
        assert got, "the waiter never got the freed slot"
        woke = got[0] - released
        # A watch on the predecessor alone would sleep out WAIT_SLICE (5 s) here.
        assert woke < min(1.5, WAIT_SLICE / 3), woke
        assert waiter.owned() and second.owned()
    finally:
        thread.join(30)
        waiter.release_all()
        second.release_all()
        first.release_all()


def test_waiters_are_served_in_arrival_order(zk_server, prefix, name):
    holders = [_slot(zk_server.url, prefix, name, f"h{n}", limit=2) for n in range(2)]
    for lock in holders:
        assert lock.acquire(blocking=False)
    order: list[str] = []
    owners = ("early", "late")
    waiters = [_slot(zk_server.url, prefix, name, w, limit=2) for w in owners]
    threads = []
    for n, lock in enumerate(waiters):
        thread = threading.Thread(target=lambda lock=lock, n=n: lock.acquire(timeout=30)
                                  and order.append(owners[n]))
        thread.start()
        threads.append(thread)
        assert wait_until(lambda n=n: holders[0].waiting_count() == n + 1, timeout=10)
    try:
        holders[1].release()
        assert wait_until(lambda: order == ["early"], timeout=10), order
        time.sleep(0.5)
        assert order == ["early"]  # "late" still waits: one slot was freed
        holders[0].release()
        assert wait_until(lambda: order == ["early", "late"], timeout=10), order
    finally:
        for thread in threads:
            thread.join(30)
        for lock in (*waiters, *holders):
            lock.release_all()


_HOLDER = """
import json, sys, time
from celery_dlock.backends.zookeeper.backend import backend_from_url
from celery_dlock.core.lock_options import LockOptions
url, name, ttl, prefix = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
lock = backend_from_url(url).lock(LockOptions(name, ttl, prefix=prefix, owner="doomed",
                                              limit=2))
assert lock.acquire(blocking=False)
print(json.dumps({"fence": lock.fence}), flush=True)
time.sleep(600)
"""


def test_a_killed_holder_frees_its_slot_within_its_ttl(zk_server, prefix, name):
    ttl = 3.0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, zk_server.url, name,
                             str(ttl), prefix], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        took = json.loads(proc.stdout.readline() or "null")
        assert took is not None, proc.stderr.read() if proc.stderr else ""
        mine = _slot(zk_server.url, prefix, name, "alive", limit=2, ttl=ttl)
        assert mine.acquire(blocking=False)
        other = _slot(zk_server.url, prefix, name, "other", limit=2, ttl=ttl)
        assert not other.acquire(blocking=False)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert other.acquire(timeout=ttl + 10)
        waited = time.monotonic() - killed
        # The session times out (ttl) after the killed holder's last ping, plus the
        # server's expiry tick and the watch: a generous margin on 2 shared cores.
        assert waited < ttl + 3.0, waited
        assert other.fence is not None and other.fence > took["fence"]
        assert mine.owned()
        other.release()
        mine.release()
    finally:
        proc.kill()
        proc.communicate(timeout=10)  # and closes its pipes


def test_twelve_threads_never_exceed_the_limit_and_reach_it(zk_server, prefix, name):
    limit, inside, most, runs = 3, [0], [0], []
    guard = threading.Lock()
    errors: list[BaseException] = []

    def work(n: int) -> None:
        lock = _slot(zk_server.url, prefix, name, f"t{n}", limit=limit, ttl=10)
        try:
            for _ in range(3):
                assert lock.acquire(timeout=60)
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    runs.append(lock.fence)
                time.sleep(0.05)
                with guard:
                    inside[0] -= 1
                lock.release()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(runs) == 36 and len(set(runs)) == 36  # every hold its own fence
    assert most[0] == limit, most


def test_backend_read_holds_waiting_show_the_slots(zk_server, prefix, name):
    backend = backend_from_url(zk_server.url)
    slots = [backend.lock(LockOptions(
        name, 30, prefix=prefix, owner=f"s{n}", limit=3,
        info={"task_name": "media.thumb", "task_id": f"task-{n}"})) for n in range(2)]
    plain = backend.lock(LockOptions("plain", 30, prefix=prefix))
    with slots[0], slots[1], plain:
        found = backend.read(prefix, name)
        assert found is not None
        assert found.limit == 3 and found.slots == "2/3"
        assert [h.task_id for h in found.holders] == ["task-0", "task-1"]
        assert [h.fence for h in found.holders] == [slots[0].fence, slots[1].fence]
        assert (found.owner, found.fence, found.task_id) == ("s0", slots[0].fence,
                                                             "task-0")
        assert all(h.limit is None for h in found.holders)
        listed = {h.key: h for h in backend.holds(prefix)}
        assert sorted(listed) == sorted([name, "plain"])  # the semaphore once
        assert listed[name].slots == "2/3" and listed["plain"].limit is None
        assert found.as_dict()["slots"] == "2/3"
        assert backend.waiting(prefix, [name, "plain"]) == {name: 0, "plain": 0}
    assert backend.read(prefix, name) is None
    assert list(backend.holds(prefix)) == []


def test_backend_waiting_counts_beyond_the_limit(zk_server, prefix, name):
    backend = backend_from_url(zk_server.url)
    held = [_slot(zk_server.url, prefix, name, f"h{n}", limit=2) for n in range(2)]
    for lock in held:
        assert lock.acquire(blocking=False)
    waiter = ZooKeeperLock(zk_server.url, name, 30, prefix=prefix, owner="w", limit=2)
    assert waiter.limit == 2 and "limit=2" in repr(waiter)
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=1.5))
    thread.start()
    try:
        assert wait_until(lambda: backend.waiting(prefix, [name]) == {name: 1})
        info = backend.read(prefix, name)
        assert info is not None and info.slots == "2/2"  # the waiter holds no slot
    finally:
        thread.join(10)
        for lock in held:
            lock.release()
    assert backend.waiting(prefix, [name]) == {name: 0}


def test_force_release_frees_the_chosen_holders_and_they_are_told(zk_server, zk,
                                                                 prefix, name):
    backend = backend_from_url(zk_server.url)
    told: list[ZooKeeperLock] = []
    slots = [_slot(zk_server.url, prefix, name, f"s{n}", ttl=3, on_lost=told.append,
                   info={"task_id": f"task-{n}"}) for n in range(3)]
    for lock in slots:
        assert lock.acquire(blocking=False)
    # by fence: that holder only
    freed = backend.force_release(prefix, name, fence=slots[0].fence, by="op@box",
                                  reason="disk\nfull")
    assert freed is not None and freed.limit == 3 and freed.slots == "1/3"
    assert [h.owner for h in freed.holders] == ["s0"]
    assert freed.fence == slots[0].fence
    # its renewal (every second) finds the node gone, and the note says who and why
    assert wait_until(lambda: slots[0].lost, timeout=10)
    assert told == [slots[0]]
    assert slots[0].lost_reason == "released by op@box: disk full"
    assert slots[1].owned() and slots[2].owned()
    # a fence nobody holds frees nothing
    assert backend.force_release(prefix, name, fence=1) is None
    # by conditions, without a reason: told its node is gone
    freed = backend.force_release(prefix, name, conditions={"task_id": "task-2"})
    assert freed is not None and [h.owner for h in freed.holders] == ["s2"]
    with pytest.raises(LockLost, match="node is gone"):
        slots[2].ensure_held()
    assert slots[1].owned()
    # neither: every holder, each told at its next contact
    newcomer = _slot(zk_server.url, prefix, name, "new")
    assert newcomer.acquire(blocking=False)
    freed = backend.force_release(prefix, name, by="op@box", reason="all of them")
    assert freed is not None and sorted(h.owner for h in freed.holders) == ["new",
                                                                           "s1"]
    assert backend.read(prefix, name) is None
    with pytest.raises(LockLost, match="released by op@box: all of them"):
        newcomer.ensure_held()
    assert wait_until(lambda: slots[1].lost, timeout=10)
    assert slots[1].lost_reason == "released by op@box: all of them"
    assert told == [slots[0], slots[2], slots[1]]  # each once
    assert backend.force_release(prefix, name) is None
    # the notes live beside the lock nodes, never listed as a hold
    assert [h.key for h in backend.holds(prefix)] == []
    notes = json.loads(zk.get(f"{lock_path(prefix, name).rsplit('/', 1)[0]}"
                              f"/.released/{lock_path(prefix, name).rsplit('/', 1)[1]}"
                              )[0])
    assert [(n["owner"], n["reason"]) for n in notes["holds"]] == [
        ("s0", "disk full"), ("s1", "all of them"), ("new", "all of them")]
    with pytest.raises(LockLost):
        newcomer.release()


def test_a_lock_s_children_keep_their_data_unchanged(zk_server, zk, prefix, name):
    lock = backend_from_url(zk_server.url).lock(LockOptions(name, 30, prefix=prefix,
                                                            owner="solo"))
    with lock:
        (data,) = _line(zk, prefix, name)
        assert sorted(data) == ["acquired_at", "count", "dlock", "info", "op",
                                "owner", "pid", "ttl"]
        raw = zk.get(lock_path(prefix, name) + "/" + zk.get_children(
            lock_path(prefix, name))[0])[0]
        assert b"limit" not in raw
    sem = _slot(zk_server.url, prefix, "sem-" + name, "one")
    with sem:
        (data,) = _line(zk, prefix, "sem-" + name)
        assert data["limit"] == 3


def test_a_noted_delete_is_all_or_nothing(zk_server, zk, prefix, name):
    """A force release's note and the child's delete are one transaction: a child
    that changed since it was read is neither deleted nor noted."""
    from celery_dlock.backends.zookeeper.released import released_path

    backend = backend_from_url(zk_server.url)
    a = _slot(zk_server.url, prefix, name, "a")
    assert a.acquire(blocking=False)
    path = lock_path(prefix, name)
    child = f"{path}/{zk.get_children(path)[0]}"
    read_at = zk.exists(child).version
    assert a.acquire(blocking=False)  # re-entry: the child's version moves on
    assert not backend._delete_noted(prefix, name, child, read_at, "a", a.fence or 0,
                                     "ops", "stale read")
    assert a.owned() and zk.exists(released_path(prefix, name)) is None
    assert backend._delete_noted(prefix, name, child, read_at + 1, "a", a.fence or 0,
                                 "ops", "fresh read")
    assert zk.exists(child) is None
    with pytest.raises(LockLost, match="released by ops: fresh read"):
        a.ensure_held()
