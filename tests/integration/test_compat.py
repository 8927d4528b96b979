"""The one-import migration (``celery_dlock.compat``) on a real broker and real prefork
workers: celery-once's and celery-singleton's README examples, written as their users
write them, checked in the broker's queue (the messages counted) and on a worker (what
runs); and ``clear_locks`` next to live and dead holders.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.result import EagerResult
from worker_harness import Harness, assert_disjoint, open_harness, wait_for

import celery_dlock
from celery_dlock import InvalidLockConfig
from celery_dlock.compat import AlreadyQueued, DuplicateTaskError, clear_locks
from celery_dlock.task.backend import backend_for, markers_for

pytestmark = pytest.mark.slow


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


def queued(h: Harness, task: str, queue: str | None = None) -> list[str]:
    """The ids of ``task``'s messages waiting in the broker's queue, oldest first."""
    found = []
    for raw in reversed(h.r.lrange(queue or h.queue, 0, -1)):  # oldest first
        headers = json.loads(raw)["headers"]
        if headers["task"] == task:
            found.append(headers["id"])
    return found


def runs(h: Harness, task: str) -> list[dict[str, Any]]:
    return h.records("compat", task)


def started(h: Harness, task: str) -> list[dict[str, Any]]:
    return h.records("compat-start", task)


def marker(h: Harness, task: str, args: tuple[Any, ...] = (),
           kwargs: dict[str, Any] | None = None) -> str | None:
    """The task id in the queue marker of ``task`` called with these arguments, read
    through the app's store (whichever it is)."""
    found = markers_for(h.app).read(h.prefix, h.app.tasks[task].lock_name(args,
                                                                      kwargs or {}))
    return found[0] if found is not None else None


def marker_pttl(h: Harness, task: str, args: tuple[Any, ...] = ()) -> int:
    """The milliseconds the marker has left (-2: none, -1: no expiry)."""
    found = markers_for(h.app).read(h.prefix, h.app.tasks[task].lock_name(args, {}))
    if found is None:
        return -2
    return -1 if found[1] is None else int(found[1] * 1000)


def owner(h: Harness, name: str) -> str | None:
    """The owner of lock ``name``'s hold (None: free), read through the app's store."""
    hold = backend_for(h.app).read(h.prefix, name)
    return hold.owner if hold is not None else None


# -- celery-once ---------------------------------------------------------------------

def test_once_second_delay_raises_already_queued_while_queued_or_running(
        store_harness: Harness) -> None:
    """celery-once's ``slow_task``: a second ``delay`` raises ``AlreadyQueued`` while
    the first is queued and while it runs; once it has finished, a call queues."""
    h = store_harness
    slow_task = h.app.tasks["pf.slow_task"]
    first = slow_task.delay(2.0)
    with pytest.raises(AlreadyQueued) as raised:
        slow_task.delay(2.0)
    # One class: code written against celery-once catches celery-dlock's error.
    assert AlreadyQueued is celery_dlock.AlreadyQueued
    assert raised.value.task_id == first.id
    assert raised.value.countdown is not None and 3500 < raised.value.countdown <= 3600
    with pytest.raises(AlreadyQueued):
        slow_task.apply_async(args=(2.0,))
    assert queued(h, "pf.slow_task") == [first.id]
    other = slow_task.delay(0.1)  # other arguments: another lock
    assert other.id != first.id

    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: started(h, "pf.slow_task"), 20, what="slow_task to start")
    with pytest.raises(AlreadyQueued) as running:
        slow_task.delay(2.0)
    assert running.value.task_id == first.id
    assert first.get(timeout=30) == "Done!" and other.get(timeout=30) == "Done!"
    wait_for(lambda: owner(h, slow_task.lock_name((2.0,), {})) is None, 10,
             what="the release")
    again = slow_task.delay(2.0)
    assert again.id != first.id and again.get(timeout=30) == "Done!"
    assert sorted(run["task_id"] for run in runs(h, "pf.slow_task")) == \
        sorted([first.id, other.id, again.id])


def test_once_graceful_returns_celery_once_result(harness: Harness) -> None:
    h = harness
    graceful_task = h.app.tasks["pf.graceful_task"]
    first = graceful_task.delay(1.0)
    again = graceful_task.delay(1.0)
    assert isinstance(again, EagerResult)
    assert (again.id, again.state, again.get()) == (None, "REJECTED", None)
    # Per call, both ways.
    with pytest.raises(AlreadyQueued):
        graceful_task.apply_async((1.0,), once={"graceful": False})
    slow_task = h.app.tasks["pf.slow_task"]
    slow_task.delay(1.0)
    per_call = slow_task.apply_async((1.0,), once={"graceful": True})
    assert isinstance(per_call, EagerResult) and per_call.state == "REJECTED"
    assert queued(h, "pf.graceful_task") == [first.id]
    assert len(queued(h, "pf.slow_task")) == 1


def test_once_keys_choose_the_arguments_of_the_lock(harness: Harness) -> None:
    h = harness
    slow_add = h.app.tasks["pf.slow_add"]
    a = slow_add.delay(1, 1)
    with pytest.raises(AlreadyQueued) as raised:  # a=1 is queued
        slow_add.delay(1, 2)
    assert raised.value.task_id == a.id
    # the hashed name's arguments, for a person: which a is blocked
    assert raised.value.arguments == "a=1" and "(arguments: a=1)" in str(raised.value)
    b = slow_add.delay(2, 2)
    assert queued(h, "pf.slow_add") == [a.id, b.id]

    slow_add_any = h.app.tasks["pf.slow_add_any"]  # keys=[]: one, whatever arguments
    c = slow_add_any.delay(1, 1)
    with pytest.raises(AlreadyQueued):
        slow_add_any.delay(2, 2)
    assert queued(h, "pf.slow_add_any") == [c.id]
    with pytest.raises(InvalidLockConfig, match="keys"):
        slow_add.apply_async((3, 3), once={"keys": ["b"]})
    with pytest.raises(InvalidLockConfig, match="gracefull"):
        slow_add.apply_async((3, 3), once={"gracefull": True})
    assert len(queued(h, "pf.slow_add")) == 2


def test_once_timeout_bounds_how_long_a_queued_call_keeps_the_name(
        store_harness: Harness) -> None:
    """timeout=2: a call whose message sits (or was lost) in the queue keeps the name
    for 2 s; then a new call is accepted, and it is the one that runs."""
    h = store_harness
    task = h.app.tasks["pf.long_running_task"]
    old = task.delay()
    assert 1000 < marker_pttl(h, "pf.long_running_task") <= 2000
    with pytest.raises(AlreadyQueued):
        task.delay()
    wait_for(lambda: marker(h, "pf.long_running_task") is None, 5, 0.05,
             what="the marker to expire")
    new = task.delay()
    assert new.id != old.id
    per_call = h.app.tasks["pf.slow_task"].apply_async((0.0,), once={"timeout": 30})
    assert per_call.id and 29_000 < marker_pttl(h, "pf.slow_task", (0.0,)) <= 30_000
    assert queued(h, "pf.long_running_task") == [old.id, new.id]

    h.start_workers(count=1, concurrency=1)  # one at a time, oldest first
    assert new.get(timeout=30) == ""
    # The older call starts while the newer one is queued: it finds its name taken,
    # is recorded as revoked and does not run (celery-once would run both).
    wait_for(lambda: old.state == "REVOKED", 20, what="the older call to end")
    assert [run["task_id"] for run in runs(h, "pf.long_running_task")] == [new.id]


def test_once_unlock_before_run_frees_the_name_when_the_task_starts(
        harness: Harness) -> None:
    h = harness
    task = h.app.tasks["pf.unlock_task"]
    a = task.delay(1.5, "x")
    with pytest.raises(AlreadyQueued):  # queued: a duplicate
        task.delay(1.5, "x")
    assert queued(h, "pf.unlock_task") == [a.id]
    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: started(h, "pf.unlock_task"), 20, what="a to start")
    b = task.delay(1.5, "x")  # a runs: the name is free to queue, not to run
    assert b.id != a.id
    assert a.get(timeout=30) == "x" and b.get(timeout=30) == "x"
    done = runs(h, "pf.unlock_task")
    assert [run["task_id"] for run in done] == [a.id, b.id]
    assert_disjoint(done)  # the runtime lock keeps the two runs apart


# -- celery-singleton ----------------------------------------------------------------

def test_singleton_second_delay_returns_the_same_task(
        store_harness: Harness) -> None:
    """celery-singleton's quick start: the second ``delay`` is the first's result;
    other arguments queue their own; after the first ends, a call queues again."""
    h = store_harness
    do_stuff = h.app.tasks["pf.do_stuff"]
    async_result = do_stuff.delay(1, 2, 3, a="b", seconds=1.0)
    async_result2 = do_stuff.delay(1, 2, 3, a="b", seconds=1.0)
    assert async_result == async_result2
    c = do_stuff.delay(4, 5, 6)
    assert c != async_result
    assert queued(h, "pf.do_stuff") == [async_result.id, c.id]

    h.start_workers(count=1, concurrency=2)
    wait_for(lambda: started(h, "pf.do_stuff"), 20, what="the first to start")
    assert do_stuff.delay(1, 2, 3, a="b", seconds=1.0) == async_result  # running
    assert async_result.get(timeout=30) == "I just woke up"
    wait_for(lambda: marker(h, "pf.do_stuff", (1, 2, 3), {"a": "b", "seconds": 1.0})
             is None and owner(h, do_stuff.lock_name(
                 (1, 2, 3), {"a": "b", "seconds": 1.0})) is None, 10,
             what="the release")
    d = do_stuff.delay(1, 2, 3, a="b", seconds=1.0)
    assert d != async_result and d.get(timeout=30) == "I just woke up"
    assert c.get(timeout=30) == "I just woke up"
    assert len(runs(h, "pf.do_stuff")) == 3


def test_singleton_unique_on_and_raise_on_duplicate(
        store_harness: Harness) -> None:
    h = store_harness
    do_something = h.app.tasks["pf.do_something"]
    task1 = do_something.delay(username="bob", otherarg=99)
    task2 = do_something.delay(username="bob", otherarg=100)
    assert task1 == task2
    assert do_something.delay("bob") == task1  # positional: the same call
    alice = do_something.delay(username="alice")
    assert queued(h, "pf.do_something") == [task1.id, alice.id]

    raising = h.app.tasks["pf.do_something_raising"]
    first = raising.delay("bob")
    with pytest.raises(DuplicateTaskError) as raised:
        raising.delay("bob")
    assert raised.value.task_id == first.id
    assert isinstance(raised.value, AlreadyQueued)
    assert f"task ID {first.id}" in str(raised.value)
    assert "(arguments: username='bob')" in str(raised.value)
    assert queued(h, "pf.do_something_raising") == [first.id]

    h.start_workers(count=1, concurrency=2)
    assert task1.get(timeout=30) == "bob" and alice.get(timeout=30) == "alice"
    assert first.get(timeout=30) == "bob"
    assert [(run["username"], run["otherarg"]) for run in
            sorted(runs(h, "pf.do_something"), key=lambda x: x["start"])] in (
        [("bob", 99), ("alice", None)], [("alice", None), ("bob", 99)])


def test_singleton_lock_expiry_bounds_the_queued_name(harness: Harness) -> None:
    h = harness
    expiring = h.app.tasks["pf.expiring"]
    task1 = expiring.delay("t")
    assert expiring.delay("t") == task1
    assert 0 < marker_pttl(h, "pf.expiring", ("t",)) <= 30_000
    # Its lock_expiry runs out (fast-forwarded: the second call's marker must outlive
    # the worker's start, which a 1 s expiry did not always).
    name = expiring.lock_name(("t",), {})
    assert h.r.pexpire(h.lock_key(name) + ":m", 1)
    time.sleep(0.05)
    task2 = expiring.delay("t")
    assert task1 != task2
    assert queued(h, "pf.expiring") == [task1.id, task2.id]
    h.start_workers(count=1, concurrency=1)
    assert task2.get(timeout=30) == "t"
    wait_for(lambda: task1.state == "REVOKED", 20, what="the first call to end")
    assert [run["task_id"] for run in runs(h, "pf.expiring")] == [task2.id]


# -- clear_locks ---------------------------------------------------------------------

def test_clear_locks_removes_only_what_nobody_will_release(
        store_harness: Harness) -> None:
    h = store_harness
    hold = h.app.tasks["pf.compat_hold"]
    throttle = h.app.tasks["pf.compat_throttle"]
    markers = markers_for(h.app)

    # A hold whose worker is killed, all of it (lock_ttl 60 s: it stays, and as its
    # worker cannot answer, nothing says it is dead until its renewal has stopped
    # for longer than its holder's deadline).
    w1, = h.start_workers(count=1, concurrency=1)
    hold.delay("dead", 60.0)
    wait_for(lambda: started(h, "pf.compat_hold"), 20, what="the doomed run")
    os.killpg(w1.pid, signal.SIGKILL)
    w1.stop(signal.SIGKILL)
    assert owner(h, "chold:dead") is not None

    # A live holder, a queued call, a throttle window, and two stale markers.
    h.start_workers(count=1, concurrency=2)
    live = hold.delay("live", 4.0)
    wait_for(lambda: len(started(h, "pf.compat_hold")) == 2, 20, what="the live run")
    waiting = hold.apply_async(("waiting", 0.0), queue="nobody-reads")
    window = throttle.delay("w")
    assert window.get(timeout=30) == "w"
    done = hold.delay("done", 0.0)
    assert done.get(timeout=30) == "done"
    # The marker a failed hand-over would leave behind, for a call that has run.
    markers.claim(h.prefix, "chold:done", done.id, 600, running_counts=False,
                  replace=False, requeue=False)
    revoked = hold.apply_async(("revoked", 0.0), queue="nobody-reads")
    # What a worker records when it gets the revoke (Celery 5.7; older workers when
    # they discard the message): the call will not run.
    revoked.revoke()
    h.app.backend.mark_as_revoked(revoked.id, reason="revoked")
    assert revoked.state == "REVOKED" and marker(h, "pf.compat_hold",
                                                 ("revoked", 0.0)) == revoked.id

    removed = clear_locks(h.app, timeout=0.5)

    assert sorted((x.kind, x.name, x.task_id) for x in removed) == sorted([
        ("marker", "chold:done", done.id),
        ("marker", "chold:revoked", revoked.id),
    ])
    assert owner(h, "chold:dead") is not None  # a silent worker proves nothing
    assert owner(h, "chold:live") is not None  # the live holder keeps its lock
    assert marker(h, "pf.compat_hold", ("waiting", 0.0)) == waiting.id  # PENDING
    assert marker(h, "pf.compat_throttle", ("w",)) == window.id  # the window
    assert live.get(timeout=30) == "live"
    # The window still refuses.
    assert throttle.delay("w").id == window.id
    assert clear_locks(h.app, timeout=0.5) == []


def test_clear_locks_keeps_the_hold_of_a_worker_that_cannot_answer(
        harness: Harness) -> None:
    """A solo pool runs the task in its main process, so the worker answers no
    question while it runs: that is no evidence of death, and its hold (renewed all
    along) is kept."""
    h = harness
    hold = h.app.tasks["pf.compat_short"]
    h.start_workers(count=1, concurrency=1, pool="solo")
    busy = hold.delay("solo", 6.0)
    wait_for(lambda: started(h, "pf.compat_short"), 20, what="the solo run")
    first = owner(h, "cshort:solo")
    deadline = time.monotonic() + 4.5  # past its holder's deadline and its ttl
    while time.monotonic() < deadline:
        assert clear_locks(h.app, timeout=0.3) == []
        assert owner(h, "cshort:solo") == first, "the live holder keeps its lock"
        time.sleep(0.2)
    assert busy.get(timeout=30) == "solo"


def test_clear_locks_frees_a_hold_whose_renewal_stopped(
        store_harness: Harness, request: pytest.FixtureRequest) -> None:
    """A worker killed with its pool: its hold (ttl 4 s) is freed by clear_locks once
    the server shows it unrenewed past its holder's deadline (2 s after its last
    renewal), before it would have expired (4 s after).  On ZooKeeper a hold lives
    as long as its session, whose last heartbeat the server does not show: never
    judged, it ends with the session, within its ttl."""
    h = store_harness
    judged = request.node.callspec.params["store_harness"] != "zookeeper"
    hold = h.app.tasks["pf.compat_short"]
    w, = h.start_workers(count=1, concurrency=1)
    doomed = hold.delay("gone", 30.0)
    wait_for(lambda: started(h, "pf.compat_short"), 20, what="the doomed run")
    assert clear_locks(h.app, timeout=0.3) == []  # renewed, its worker answers
    os.killpg(w.pid, signal.SIGKILL)
    w.stop(signal.SIGKILL)
    killed = time.monotonic()
    removed: list[Any] = []
    deadline = killed + 6.0
    while not removed and owner(h, "cshort:gone") is not None and \
            time.monotonic() < deadline:
        removed = clear_locks(h.app, timeout=0.2)
        time.sleep(0.05)
    assert owner(h, "cshort:gone") is None
    if judged:
        assert [(x.kind, x.name, x.task_id) for x in removed] == [
            ("lock", "cshort:gone", doomed.id)], "freed by clear_locks, not by its ttl"
        assert "renewal stopped" in removed[0].reason
    else:
        assert removed == [] and time.monotonic() - killed < 5.5, \
            "ended with its session, within its ttl"
