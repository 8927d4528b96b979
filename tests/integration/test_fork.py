"""After fork() the child is a different owner: it neither owns, renews nor releases
its parent's hold, and its own acquire of the same name contends (on every lock kind,
``lock_kind``)."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import traceback
from typing import Any

import pytest

from celery_dlock import (
    FencingUnavailable,
    LockLost,
    LockNotOwned,
    RedisLock,
    owner_context,
)
from celery_dlock.core.scheduler import get_scheduler

# Python 3.12+ warns when forking a process that runs threads (the scheduler does).
pytestmark = pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")

#: While a test of this module runs, a child it forks prints every thread's stack to
#: stderr (shown with the failing test) and exits if it is still alive after 20 s: a
#: child stuck anywhere after the fork, even before its first line of test code,
#: says where.
_ARMED = False


def _arm_in_child() -> None:
    if _ARMED:
        faulthandler.dump_traceback_later(20, exit=True)


os.register_at_fork(after_in_child=_arm_in_child)


@pytest.fixture(autouse=True)
def _children_say_where_they_are_stuck() -> Any:
    global _ARMED
    _ARMED = True
    try:
        yield
    finally:
        _ARMED = False


@pytest.fixture
def mp_fork() -> Any:
    """The ``fork`` context of multiprocessing, its child running only the after-fork
    hooks of what this test makes.  A multiprocessing child runs every hook registered
    with ``multiprocessing.util.register_after_fork`` in its process; this pytest
    process keeps other tests' Celery apps, whose hooks close their result consumers'
    connections, and one of them caught mid-read by the fork can block the child
    before it runs a line of the test.  A program that forks has only its own."""
    from multiprocessing import util

    saved = dict(util._afterfork_registry)
    util._afterfork_registry.clear()
    try:
        yield multiprocessing.get_context("fork")
    finally:
        util._afterfork_registry.update(saved)


def _fence(lock: RedisLock) -> int | str | None:
    """``lock.fence``, or "unavailable" where it raises FencingUnavailable (Redlock)."""
    try:
        return lock.fence
    except FencingUnavailable:
        return "unavailable"


def _child_report(kind: Any, lock: RedisLock, prefix: str, name: str) -> dict:
    r = kind.server
    report: dict[str, object] = {"pid": os.getpid()}
    report["owned"] = lock.owned()
    report["fence"] = _fence(lock)
    report["depth"] = lock.depth
    try:
        lock.ensure_held()
        report["ensure_held"] = "passed"
    except LockLost:
        report["ensure_held"] = "LockLost"
    hb = get_scheduler()
    report["heartbeat_entries"] = len(hb)
    report["registered"] = hb.is_registered(lock)
    try:
        lock.release()
        report["release"] = "passed"
    except LockNotOwned:
        report["release"] = "LockNotOwned"
    try:
        lock.extend()
        report["extend"] = "passed"
    except LockNotOwned:
        report["extend"] = "LockNotOwned"
    report["same_object_acquire"] = lock.acquire(blocking=False)
    own = kind.make(name, prefix=prefix)
    report["own_acquire"] = own.acquire(blocking=False)
    report["own_acquire_timeout"] = own.acquire(timeout=0.2)
    report["count_seen"] = r.hget(lock.keys.lock, "count").decode()
    return report


def _fork_and_report(kind: Any, lock: RedisLock, prefix: str, name: str) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(read_fd)
            try:
                payload = _child_report(kind, lock, prefix, name)
                code = 0
            except BaseException:
                payload = {"error": traceback.format_exc()}
            with os.fdopen(write_fd, "w") as f:
                json.dump(payload, f)
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    report = json.loads(data)
    assert "error" not in report, report.get("error")
    assert os.waitstatus_to_exitcode(status) == 0
    return report


def test_forked_child_neither_owns_renews_nor_releases(lock_kind, prefix, name):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    lock = lock_kind.make(name, ttl=30, prefix=prefix)
    lock.acquire()
    lock.acquire()
    parent_owner = r.hget(lock.keys.lock, "owner")
    fence = _fence(lock)
    assert get_scheduler().is_registered(lock)

    report = _fork_and_report(lock_kind, lock, prefix, name)

    assert report["pid"] != os.getpid()
    assert report["owned"] is False
    assert report["fence"] == (None if lock_kind.fences else "unavailable")
    assert report["depth"] == 0
    assert report["ensure_held"] == "LockLost"
    assert report["heartbeat_entries"] == 0
    assert report["registered"] is False
    assert report["release"] == "LockNotOwned"
    assert report["extend"] == "LockNotOwned"
    assert report["same_object_acquire"] is False
    assert report["own_acquire"] is False
    assert report["own_acquire_timeout"] is False
    assert report["count_seen"] == "2"

    # the parent's hold is intact
    assert r.hget(lock.keys.lock, "owner") == parent_owner
    assert r.hget(lock.keys.lock, "count") == b"2"
    assert r.pttl(lock.keys.lock) > 20_000
    assert lock.owned() and _fence(lock) == fence and lock.depth == 2
    assert get_scheduler().is_registered(lock)
    assert not r.exists(lock.keys.queue)  # the child left the line
    lock.release()
    lock.release()
    assert not r.exists(lock.keys.lock)


def _answer(queue, work) -> None:
    """Put ``("ok", work())`` on ``queue``, or ``("error", its traceback)``: a child
    that fails says why at once, rather than leaving its parent to wait."""
    try:
        queue.put(("ok", work()))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def _answer_of(queue) -> Any:
    status, value = queue.get(timeout=30)
    assert status == "ok", f"the child failed:\n{value}"
    return value


def _mp_child(lock: RedisLock, queue) -> None:
    _answer(queue, lambda: (lock.owned(), _fence(lock), len(get_scheduler()),
                            lock.acquire(blocking=False)))


def test_multiprocessing_fork_child_contends(lock_kind, prefix, name, mp_fork):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    ctx = mp_fork
    with lock_kind.make(name, prefix=prefix) as lock:
        queue = ctx.Queue()
        proc = ctx.Process(target=_mp_child, args=(lock, queue))
        proc.start()
        result = _answer_of(queue)
        proc.join(30)
        assert proc.exitcode == 0
        assert result == (False, None if lock_kind.fences else "unavailable", 0, False)
        assert lock.owned()
        assert r.hget(lock.keys.lock, "count") == b"1"
    assert not r.exists(lock.keys.lock)


def _mp_child_in_context(kind: Any, prefix: str, name: str, queue) -> None:
    # The contextvar holding the parent's owner token is inherited by fork(), but the
    # child is a different owner all the same.
    _answer(queue, lambda: kind.make(name, prefix=prefix).acquire(blocking=False))


def test_context_owner_does_not_cross_fork(lock_kind, prefix, name, mp_fork):
    r = lock_kind.server  # its server (on Redlock: what a quorum of its nodes says)
    ctx = mp_fork
    with owner_context("attempt-token"):
        lock = lock_kind.make(name, prefix=prefix)
        lock.acquire()
        assert r.hget(lock.keys.lock, "owner") == b"attempt-token"
        queue = ctx.Queue()
        proc = ctx.Process(target=_mp_child_in_context,
                           args=(lock_kind, prefix, name, queue))
        proc.start()
        result = _answer_of(queue)
        proc.join(30)
        assert proc.exitcode == 0
        assert result is False
        assert r.hget(lock.keys.lock, "count") == b"1"
        lock.release()
    assert not r.exists(lock.keys.lock)
