"""A semaphore's contract (``lock_limit`` above 1) on every store that keeps them, each
test once per store (Redis, PostgreSQL, MySQL/MariaDB, ZooKeeper): N holders at once
and the next refused, a fence per hold that no other hold has, re-entry in the owner's
own slot, a re-sent acquire taking one slot, owner-only release, slots freed by
expiry, by a holder's death and by force (the holder told who and why), renewal,
waiters woken by a release, many threads never above the limit, and the operators'
view (one entry per semaphore, its slots and holders). Redis-only details (hash tags,
the FIFO line's keys) stay in test_semaphore.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from celery_dlock import LockNotAcquired, LockNotOwned
from celery_dlock.core.lock_options import LockOptions
from celery_dlock.core.protocol import Grant, new_op_id

pytestmark = pytest.mark.timeout(120)


def _sem(store: Any, name: str, prefix: str, owner: str, limit: int = 3,
         ttl: float = 30.0, **kw: Any) -> Any:
    return store.backend.lock(LockOptions(name, ttl, prefix=prefix, owner=owner,
                                          limit=limit, **kw))


def test_limit_holders_at_once_and_the_next_is_refused(semaphore_store, name, prefix):
    s = semaphore_store
    holders = [_sem(s, name, prefix, f"o{i}") for i in range(3)]
    assert all(h.acquire(blocking=False) for h in holders)
    extra = _sem(s, name, prefix, "o3")
    assert extra.acquire(blocking=False) is False
    assert extra.last_holder is not None and extra.last_holder.owner in \
        {"o0", "o1", "o2"}
    with pytest.raises(LockNotAcquired), _sem(s, name, prefix, "o4",
                                              blocking_timeout=0.3):
        pytest.fail("a fourth holder ran")
    fences = [h.fence for h in holders]
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(fences) and len(set(fences)) == 3, fences
    holders[1].release()
    assert extra.acquire(blocking=False)
    assert extra.fence is not None and extra.fence > max(fences)
    for h in (holders[0], holders[2], extra):
        h.release()
    assert s.backend.read(prefix, name) is None


def test_fences_of_slots_granted_together_never_meet(semaphore_store, name, prefix):
    """Holders granted at the same moment (threads released at once) each get a
    fence no other hold of the name had, over several rounds."""
    s = semaphore_store
    seen: list[int] = []
    for _ in range(5):
        sems = [_sem(s, name, prefix, f"t{i}", limit=4) for i in range(4)]
        start = threading.Barrier(4)
        got: list[Any] = []

        def take(sem: Any, start: threading.Barrier = start,
                 got: list[Any] = got) -> None:
            start.wait(10)
            got.append(sem.acquire(timeout=10))

        threads = [threading.Thread(target=take, args=(m,)) for m in sems]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == [True] * 4
        seen += [m.fence for m in sems]
        for m in sems:
            m.release()
    assert len(set(seen)) == len(seen) == 20, seen
    if s.kind in ("postgres", "mysql"):
        # By construction (docs/backends.md): slot i's fences are i modulo the limit
        # (on Redis one counter, on ZooKeeper the children's creation zxids, order
        # every hold of the name).
        for round_ in range(5):
            assert sorted(f % 4 for f in seen[4 * round_:4 * round_ + 4]) == \
                [0, 1, 2, 3], seen


def test_reentry_takes_no_second_slot(semaphore_store, name, prefix):
    s = semaphore_store
    a = _sem(s, name, prefix, "a", limit=2)
    assert a.acquire() and a.acquire()
    fence = a.fence
    other_object_of_a = _sem(s, name, prefix, "a", limit=2)
    assert other_object_of_a.acquire(blocking=False)
    assert other_object_of_a.fence == fence, "the owner's second object took a slot"
    other_object_of_a.release()
    b = _sem(s, name, prefix, "b", limit=2)
    assert b.acquire(blocking=False), "re-entry took a second slot"
    assert a.fence == fence and a.depth == 2
    assert not _sem(s, name, prefix, "c", limit=2).acquire(blocking=False)
    a.release()
    assert a.owned() and a.depth == 1
    assert not _sem(s, name, prefix, "c", limit=2).acquire(blocking=False)
    a.release()
    assert not a.owned()
    assert _sem(s, name, prefix, "c", limit=2).acquire(blocking=False)
    b.release()


def test_a_re_sent_acquire_takes_one_slot(semaphore_store, name, prefix):
    """The same acquire sent twice (its first reply lost): one slot, one fence."""
    s = semaphore_store
    a = _sem(s, name, prefix, "a", limit=2)
    op = new_op_id()
    first = a._send_acquire("a", op, queue=False, reentry=False)
    again = a._send_acquire("a", op, queue=False, reentry=False)
    assert isinstance(first, Grant) and isinstance(again, Grant)
    assert again.fence == first.fence
    info = s.backend.read(prefix, name)
    assert info is not None and info.slots == "1/2" and info.count == 1
    # kept referenced: on ZooKeeper a lock object dropped while holding gives its
    # hold back (its session would keep it for the process's life)
    b = _sem(s, name, prefix, "b", limit=2)
    assert b.acquire(blocking=False)
    a._send_release("a", new_op_id())
    assert s.backend.read(prefix, name).slots == "1/2"
    b.release()


def test_release_is_owner_only(semaphore_store, name, prefix):
    s = semaphore_store
    a = _sem(s, name, prefix, "a", limit=2)
    a.acquire()
    stranger = _sem(s, name, prefix, "stranger", limit=2)
    with pytest.raises(LockNotOwned):
        stranger.release()
    with pytest.raises(LockNotOwned):
        stranger.extend()
    assert a.owned()
    assert [h.owner for h in a.holders()] == ["a"]
    a.release()
    assert a.holders() == [] and not a.locked()


@pytest.mark.parametrize("ends", ["expiry", "max_hold"])
def test_a_slot_that_ends_by_itself_is_free_again(semaphore_store, name, prefix,
                                                  ends):
    """A slot that is not renewed (expiry), or no longer renewed at its max hold, is
    free for another owner once the server's hold ends; at a max hold its holder is
    told first."""
    s = semaphore_store
    told: list[Any] = []
    kw: dict[str, Any] = ({"ttl": 0.5, "auto_renew": False} if ends == "expiry" else
                          {"ttl": 1.0, "max_hold": 1.5})
    gone = _sem(s, name, prefix, "gone", limit=2, on_lost=told.append, **kw)
    gone.acquire()
    keeper = _sem(s, name, prefix, "keeper", limit=2)
    keeper.acquire()
    other = _sem(s, name, prefix, "other", limit=2)
    assert not other.acquire(blocking=False)
    assert other.acquire(timeout=10), f"a slot ended by {ends} was never freed"
    assert gone.lost or not gone.owned()
    if ends == "max_hold":
        assert told == [gone] and "max hold" in (gone.lost_reason or "")
    other.release()
    keeper.release()


def test_a_renewed_slot_outlives_three_ttls(semaphore_store, name, prefix):
    s = semaphore_store
    kept = _sem(s, name, prefix, "kept", limit=2, ttl=0.9)
    kept.acquire()
    two = _sem(s, name, prefix, "two", limit=2, ttl=0.9)
    two.acquire()
    time.sleep(3 * 0.9 + 0.3)
    assert kept.owned() and not kept.lost and two.owned()
    assert not _sem(s, name, prefix, "other", limit=2).acquire(blocking=False)
    kept.release()
    two.release()


def test_a_waiter_is_woken_by_a_release(semaphore_store, name, prefix):
    s = semaphore_store
    holders = [_sem(s, name, prefix, f"h{i}", limit=2) for i in range(2)]
    for h in holders:
        h.acquire()
    woke: list[float] = []

    def wait() -> None:
        w = _sem(s, name, prefix, "w", limit=2)
        assert w.acquire(timeout=20)
        woke.append(time.monotonic())
        w.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    assert not woke
    released_at = time.monotonic()
    holders[1].release()
    waiter.join(20)
    assert woke, "the waiter never got the freed slot"
    # Well before the holder's ttl (30 s): a release wakes (or a poll finds) it.
    assert woke[0] - released_at < 2.5
    holders[0].release()


_CHILD = """
import sys, time
from celery_dlock.task.backend import lock_from_url
s = lock_from_url(sys.argv[1], sys.argv[2], 2.0, prefix=sys.argv[3], owner="child",
                  limit=2)
assert s.acquire(blocking=False)
print("held", flush=True)
time.sleep(60)
"""


def test_a_killed_holder_frees_its_slot_within_the_ttl(semaphore_store, name, prefix):
    s = semaphore_store
    keeper = _sem(s, name, prefix, "keeper", limit=2)
    keeper.acquire()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, s.url, name, prefix],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        other = _sem(s, name, prefix, "other", limit=2)
        time.sleep(2.5)  # past the ttl: the child's renewal keeps its slot
        assert not other.acquire(blocking=False)
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert other.acquire(timeout=15)
        assert time.monotonic() - killed_at < 2.0 + 2.0
        other.release()
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    keeper.release()


def test_many_threads_never_exceed_the_limit_and_reach_it(semaphore_store, name,
                                                          prefix):
    s = semaphore_store
    running = peak = done = 0
    guard = threading.Lock()

    def body(i: int) -> None:
        nonlocal running, peak, done
        with _sem(s, name, prefix, f"t{i}", limit=3, blocking_timeout=60):
            with guard:
                running += 1
                peak = max(peak, running)
            time.sleep(0.2)
            with guard:
                running -= 1
                done += 1

    threads = [threading.Thread(target=body, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert done == 12
    assert peak == 3


def test_the_backend_shows_slots_and_holders_and_frees_them(semaphore_store, name,
                                                            prefix):
    s = semaphore_store
    told: list[Any] = []
    holders = [_sem(s, name, prefix, f"o{i}", info={"task_id": f"t{i}"},
                    on_lost=told.append) for i in range(2)]
    for h in holders:
        h.acquire()
    lock = s.backend.lock(LockOptions(f"{name}-lock", 30, prefix=prefix))
    lock.acquire()
    info = s.backend.read(prefix, name)
    assert info is not None and info.limit == 3 and info.slots == "2/3"
    assert sorted(h.task_id for h in info.holders) == ["t0", "t1"]
    assert {h.fence for h in info.holders} == {h.fence for h in holders}
    assert not any(k.startswith("dlock_") for h in info.holders for k in h.extra)
    listed = [i for i in s.backend.holds(prefix) if i.key == name]
    assert len(listed) == 1 and listed[0].slots == "2/3"
    assert sorted(i.key for i in s.backend.holds(prefix)) == [name, f"{name}-lock"]
    one = s.backend.force_release(prefix, name, fence=holders[0].fence, by="ops",
                                  reason="one")
    assert one is not None and [h.fence for h in one.holders] == [holders[0].fence]
    assert s.backend.read(prefix, name).slots == "1/3"
    rest = s.backend.force_release(prefix, name, by="ops", reason="stuck")
    assert rest is not None and [h.task_id for h in rest.holders] == ["t1"]
    assert s.backend.read(prefix, name) is None
    assert lock.owned(), "freeing the semaphore touched a lock"
    for h in holders:
        assert not h.owned()
    assert sorted(told, key=id) == sorted(holders, key=id), "each holder told once"
    assert "ops" in (holders[1].lost_reason or "") and \
        "stuck" in (holders[1].lost_reason or ""), holders[1].lost_reason
    lock.release()

