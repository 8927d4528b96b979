"""Enqueue-time uniqueness by task id, and replace, on a real broker and real prefork
workers: a task id sent again while its call is queued or running, a replaced call
whose countdown outlives the call that replaced it across a worker restart, and a
replace whose publish fails.

Messages are counted in the broker's own list (as in test_modes.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.signals import before_task_publish
from kombu import Connection
from kombu.exceptions import EncodeError, OperationalError
from worker_harness import Harness, open_harness, wait_for

from celery_dlock import DROPPED, AlreadyQueued, DroppedResult

pytestmark = pytest.mark.slow

MODES = ("until_started", "until_finished", "queued_and_running", "throttle")


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


def queued_ids(h: Harness, key: str) -> list[str]:
    headers = [json.loads(raw)["headers"] for raw in h.r.lrange(h.queue, 0, -1)]
    return [m["id"] for m in headers if f"'{key}'" in m.get("argsrepr", "")]


def send(h: Harness, key: str, tag: str, seconds: Any = 0.0, **options: Any) -> Any:
    return h.app.tasks["pf.mode"].apply_async((key, seconds, tag), **options)


def tags(h: Harness, key: str) -> list[str]:
    return [run["tag"] for run in h.records("mode", key)]


def marker(h: Harness, key: str) -> str | None:
    value = h.r.get(h.lock_key(f"mode:{key}") + ":m")
    return value.decode() if value is not None else None


def _every_policy_is_a_duplicate(h: Harness, key: str, task_id: str, mode: str) -> None:
    opts: dict[str, Any] = {"lock_mode": mode, "task_id": task_id}
    assert send(h, key, "again", **opts).id == task_id  # return_existing
    with pytest.raises(AlreadyQueued) as raised:
        send(h, key, "again", on_duplicate="raise", **opts)
    assert raised.value.task_id == task_id
    dropped = send(h, key, "again", on_duplicate="drop", **opts)
    assert isinstance(dropped, DroppedResult) and dropped.state == DROPPED
    assert dropped.duplicate_of == task_id
    if mode != "throttle":  # (refused with throttle)
        # A call cannot replace itself: the one queued or running stays.
        assert send(h, key, "again", on_duplicate="replace", **opts).id == task_id


@pytest.mark.parametrize("mode", MODES)
def test_a_task_id_sent_again_while_queued_is_the_same_call(harness: Harness,
                                                            mode: str) -> None:
    h = harness
    key, task_id = f"sid-{mode}", f"report-d1-{mode}"
    first = send(h, key, "first", lock_mode=mode, task_id=task_id)
    _every_policy_is_a_duplicate(h, key, task_id, mode)
    assert queued_ids(h, key) == [task_id]
    h.start_workers(count=1, concurrency=2)
    assert first.get(timeout=30) == "first"
    time.sleep(1.0)  # a second message would have run by now
    assert tags(h, key) == ["first"]
    assert queued_ids(h, key) == []


@pytest.mark.parametrize("mode", ("until_started", "until_finished",
                                  "queued_and_running"))
def test_a_task_id_sent_again_while_it_runs_is_the_same_call(harness: Harness,
                                                             mode: str) -> None:
    """The marker was handed over at the start; the running call's lock names its task
    id, and a send of that id is a duplicate of it, whatever the mode."""
    h = harness
    h.start_workers(count=1, concurrency=2)
    key, task_id = f"rid-{mode}", f"report-r1-{mode}"
    first = send(h, key, "first", 1.5, lock_mode=mode, task_id=task_id)
    wait_for(lambda: h.records("mode-start", key), 20, what="the call to start")
    _every_policy_is_a_duplicate(h, key, task_id, mode)
    assert queued_ids(h, key) == []
    assert first.get(timeout=30) == "first"
    time.sleep(1.0)
    assert tags(h, key) == ["first"]


def test_a_replaced_call_never_runs_after_a_worker_restart(harness: Harness) -> None:
    """The replaced call's countdown outlives the call that replaced it (and that
    call's marker), and the worker that got the revoke restarts (a revoke lives in its
    memory): the replaced call is delivered again, and still never runs."""
    h = harness
    worker, = h.start_workers(count=1, concurrency=2)
    opts = {"lock_mode": "until_started", "on_duplicate": "replace",
            "lock_queue_ttl": 3}
    old = send(h, "late", "old", countdown=10, **opts)
    due = time.monotonic() + 10
    wait_for(lambda: not queued_ids(h, "late"), 15, what="the worker to reserve it")
    new = send(h, "late", "new", **opts)
    assert new.get(timeout=30) == "new"
    worker.stop(signal.SIGTERM)  # the eta message goes back to the queue, unacked
    wait_for(lambda: queued_ids(h, "late") == [old.id], 15,
             what="the replaced call's message back in the queue")
    second, = h.start_workers(count=1, concurrency=2)
    wait_for(lambda: time.monotonic() > due + 1 and not queued_ids(h, "late"), 40,
             0.1, what="the replaced call's eta to pass and its message to be taken")
    dropped = f"{old.id}] does not run"
    wait_for(lambda: dropped in second.log_text() or len(tags(h, "late")) > 1, 20,
             0.1, what="the restarted worker to run or drop the replaced call")
    assert tags(h, "late") == ["new"]
    assert dropped in second.log_text()


@pytest.mark.parametrize("failure", ("serializer", "broker down"))
def test_a_replace_whose_publish_fails_replaces_nothing(harness: Harness,
                                                       failure: str) -> None:
    h = harness
    opts = {"lock_mode": "until_finished", "on_duplicate": "replace"}
    old = send(h, "pub", "old", **opts)
    if failure == "serializer":
        # On a connection of its own: kombu closing a pooled connection whose channel
        # still waits on an earlier BRPOP can block (see test_modes.py).
        with h.app.connection_for_write() as own, \
                pytest.raises(EncodeError):  # (the lock name reads only the key)
            send(h, "pub", "new", object(), connection=own, **opts)
    else:
        with Connection("redis://127.0.0.1:1/0", connect_timeout=2) as down, \
                pytest.raises(OperationalError):
            send(h, "pub", "new", connection=down, retry=False, **opts)
    assert marker(h, "pub") == old.id
    with pytest.raises(AlreadyQueued) as raised:
        send(h, "pub", "again", lock_mode="until_finished", on_duplicate="raise")
    assert raised.value.task_id == old.id
    assert queued_ids(h, "pub") == [old.id]
    h.start_workers(count=1, concurrency=2)
    assert old.get(timeout=30) == "old"
    time.sleep(0.5)
    assert tags(h, "pub") == ["old"]


@pytest.mark.parametrize("mode", ("until_started", "queued_and_running"))
def test_a_task_id_sent_again_while_its_retry_waits_is_the_same_call(
        harness: Harness, mode: str) -> None:
    """The call started and asked for a retry in 3 s: in these modes it holds no
    marker meanwhile (the name freed at its start), yet its task id sent again is
    still that call."""
    h = harness
    h.start_workers(count=1, concurrency=2)
    key, task_id = f"rt-{mode}", f"report-rt-{mode}"
    task = h.app.tasks["pf.mode_retry"]
    first = task.apply_async((key, 0.0, "a"), {"retry_in": 3.0}, lock_mode=mode,
                             task_id=task_id)
    wait_for(lambda: first.state == "RETRY", 20, 0.05, what="the retry to be asked for")
    again = task.apply_async((key, 0.0, "b"), lock_mode=mode, task_id=task_id)
    assert again.id == task_id
    with pytest.raises(AlreadyQueued):
        task.apply_async((key, 0.0, "b"), lock_mode=mode, task_id=task_id,
                         on_duplicate="raise")
    assert first.get(timeout=30) == "a"
    time.sleep(1.0)
    assert [(run["tag"], run["attempt"]) for run in h.records("mode", key)] == \
        [("a", 0), ("a", 1)]


def test_a_failed_replace_never_takes_the_place_of_a_published_one(
        harness: Harness) -> None:
    """old is queued; mid replaces it and is held between its claim and its publish;
    meanwhile new replaces too, and its publish fails. new waits for mid's publish to
    settle, then replaces mid, fails and gives the name back to mid: mid (published,
    the latest arguments that reached the broker) runs, old never does."""
    h = harness
    opts = {"lock_mode": "until_started", "on_duplicate": "replace"}
    old = send(h, "chain", "old", **opts)
    claimed, go = threading.Event(), threading.Event()

    def hold(headers: Any = None, **_: Any) -> None:
        if threading.current_thread().name == "mid-sender":
            claimed.set()
            go.wait(10)

    before_task_publish.connect(hold, weak=False)
    try:
        results: list[Any] = []
        sender = threading.Thread(target=lambda: results.append(
            send(h, "chain", "mid", **opts)), name="mid-sender")
        sender.start()
        assert claimed.wait(10)
        failed: list[BaseException] = []

        def new() -> None:
            try:
                send(h, "chain", "new", object(), **opts)
            except EncodeError as exc:
                failed.append(exc)

        failing = threading.Thread(target=new)
        failing.start()
        time.sleep(0.3)  # new waits for mid's publish to settle
        go.set()
        sender.join(10)
        failing.join(10)
    finally:
        before_task_publish.disconnect(hold)
    assert failed and results
    mid = results[0]
    assert marker(h, "chain") == mid.id
    h.start_workers(count=1, concurrency=2)
    assert mid.get(timeout=30) == "mid"
    time.sleep(0.5)
    assert tags(h, "chain") == ["mid"]
    assert old.id not in queued_ids(h, "chain")


def _kill_running_call(h: Harness, monkeypatch: pytest.MonkeyPatch, key: str,
                       task_id: str, mode: str) -> tuple[Any, Any]:
    """A worker (``acks_late``, ``reject_on_worker_lost``, one child) whose child
    running the call ``task_id`` (tag "first", 1.5 s) is SIGKILLed, once its main
    process freed the lock: the worker and the call's result."""
    monkeypatch.setenv("DLOCK_PF_CONF", json.dumps(
        {"task_acks_late": True, "task_reject_on_worker_lost": True}))
    (worker,) = h.start_workers(count=1, concurrency=1)
    first = send(h, key, "first", 1.5, lock_mode=mode, task_id=task_id)
    wait_for(lambda: h.records("mode-start", key), 20, what="the call to start")
    pid = int(h.r.hget(h.lock_key(f"mode:{key}"), "pid") or 0)
    assert pid and pid != worker.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: h.owner(f"mode:{key}") is None, 10, 0.01,
             what="the main process to free the dead child's lock")
    return worker, first


@pytest.mark.parametrize("mode", ("until_started", "until_finished",
                                  "queued_and_running"))
def test_a_task_id_sent_again_while_its_killed_run_comes_back_is_the_same_call(
        harness: Harness, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """``acks_late`` with ``reject_on_worker_lost``: the child running a call is
    killed, and its message will be delivered again.  A send of its task id between
    the kill and that delivery is that call, not a second message: only the
    redelivery runs.  (The worker's main process held back meanwhile, so that the
    redelivery cannot start first.)"""
    h = harness
    key, task_id = f"kr-{mode}", f"killed-{mode}"
    worker, _ = _kill_running_call(h, monkeypatch, key, task_id, mode)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        assert len(h.records("mode-start", key)) == 1  # not delivered again yet
        again = send(h, key, "again", 0.0, lock_mode=mode, task_id=task_id)
        assert again.id == task_id
        assert queued_ids(h, key) in ([], [task_id])  # (its redelivery, if requeued)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert again.get(timeout=30) == "first"  # the call's own run: the redelivery
    time.sleep(0.5)
    assert [s["tag"] for s in h.records("mode-start", key)] == ["first", "first"]
    assert tags(h, key) == ["first"]


@pytest.mark.parametrize("mode", ("until_started", "until_finished",
                                  "queued_and_running"))
def test_a_killed_run_that_comes_back_runs_whatever_was_sent_meanwhile(
        harness: Harness, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """As above, but a call of another task id is sent between the kill and the
    redelivery.  ``until_finished``: the name is still taken (by the call coming
    back): a duplicate.  The other modes: it is queued, and runs after the
    redelivery, which runs and is never taken for superseded by it."""
    h = harness
    key, task_id = f"kn-{mode}", f"killed-then-other-{mode}"
    worker, first = _kill_running_call(h, monkeypatch, key, task_id, mode)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        other = send(h, key, "other", 0.0, lock_mode=mode)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert first.get(timeout=30) == "first"
    if mode == "until_finished":
        assert other.id == task_id
        time.sleep(0.5)
        assert tags(h, key) == ["first"]
    else:
        assert other.id != task_id
        assert other.get(timeout=30) == "other"
        assert sorted(tags(h, key)) == ["first", "other"]  # (in either order)
