"""What every store that keeps queue markers answers alike (Redis, PostgreSQL,
MySQL/MariaDB: the ``markers`` fixture): reading and listing markers, their expiry,
a clear by another call, and a running holder (a lock held with a task id) in the
claim.  The orders of replaces and starts are in tests/faults/test_marker_faults.py
and tests/faults/test_marker_model_orders.py.
"""

from __future__ import annotations

import time
import uuid

import pytest
from marker_stores import MarkerCase
from worker_harness import wait_for

from celery_dlock.task.markers import CLAIMED, QUEUED, RUNNING


def _claim(markers: MarkerCase, prefix: str, name: str, task_id: str, ttl: float,
           *, running_counts: bool = False) -> tuple[int, str, float | None]:
    return markers.store.claim(prefix, name, task_id, ttl,
                               running_counts=running_counts, replace=False,
                               requeue=False, op=uuid.uuid4().hex)


def test_a_name_never_marked_reads_none(markers: MarkerCase, prefix: str) -> None:
    assert markers.store.read(prefix, "never-marked") is None
    assert list(markers.store.queued(prefix)) == []


def test_queued_lists_every_marker_with_its_task_id_and_time_left(
        markers: MarkerCase, prefix: str, name: str) -> None:
    """Each marker under the prefix, once, with its task id and its seconds left (as
    ``read`` gives them); not one that expired, nor another prefix's."""
    odd = "odd:name é/1"
    assert _claim(markers, prefix, name, "a", 60)[0] == CLAIMED
    assert _claim(markers, prefix, odd, "b", 30)[0] == CLAIMED
    assert _claim(markers, prefix, name + "-short", "c", 0.3)[0] == CLAIMED
    assert _claim(markers, prefix + "x", name, "other", 60)[0] == CLAIMED
    time.sleep(0.6)  # past c's time
    listed = {n: (task_id, left) for n, task_id, left in markers.store.queued(prefix)}
    assert sorted(listed) == sorted([name, odd])
    assert listed[name][0] == "a" and listed[odd][0] == "b"
    left_a, left_b = listed[name][1], listed[odd][1]
    assert left_a is not None and 55 < left_a <= 60
    assert left_b is not None and 25 < left_b <= 30
    read = markers.store.read(prefix, odd)
    assert read is not None and read[0] == "b"
    assert read[1] is not None and abs(read[1] - left_b) < 2
    assert markers.store.read(prefix, name + "-short") is None


def test_a_marker_expires_after_its_ttl(markers: MarkerCase, prefix: str,
                                        name: str) -> None:
    assert _claim(markers, prefix, name, "a", 0.5)[0] == CLAIMED
    read = markers.store.read(prefix, name)
    assert read is not None and read[0] == "a"
    assert read[1] is not None and 0 < read[1] <= 0.5
    code, other, left = _claim(markers, prefix, name, "b", 60)
    assert (code, other) == (QUEUED, "a") and left is not None and left <= 0.5
    wait_for(lambda: markers.store.read(prefix, name) is None, 5, 0.05,
             what="the marker to expire")
    assert _claim(markers, prefix, name, "b", 60)[0] == CLAIMED


def test_a_clear_by_another_task_id_leaves_the_marker(markers: MarkerCase,
                                                      prefix: str, name: str) -> None:
    assert _claim(markers, prefix, name, "a", 60)[0] == CLAIMED
    assert markers.store.clear(prefix, name, "b") is False
    assert (markers.store.read(prefix, name) or ("",))[0] == "a"
    assert markers.store.clear(prefix, name, "a") is True
    assert markers.store.read(prefix, name) is None
    assert markers.store.clear(prefix, name, "a") is False  # nothing left to clear


@pytest.mark.parametrize("holder", ("a task", "not a task"))
def test_a_running_holder_counts_only_where_the_mode_says(
        markers: MarkerCase, prefix: str, name: str, holder: str) -> None:
    """The lock of the name held (by a task: its info carries ``task_id``; or by
    code that is not a task): a claim that counts a running holder
    (``until_finished``) is told RUNNING, with the holder's task id ("" when it is
    not a task) and the hold's time left; one that does not claims the marker."""
    if holder == "a task":
        lock = markers.running(prefix, name, "runner", ttl=20)
    else:
        from celery_dlock.core.lock_options import LockOptions

        lock = markers.backend.lock(LockOptions(name, 20, prefix=prefix))
        assert lock.acquire(blocking=False)
    try:
        code, other, left = _claim(markers, prefix, name, "new", 60,
                                   running_counts=True)
        assert (code, other) == (RUNNING, "runner" if holder == "a task" else "")
        assert left is not None and 15 < left <= 20
        assert markers.store.read(prefix, name) is None, "nothing was written"
        assert _claim(markers, prefix, name, "new", 60)[0] == CLAIMED
        # Queued now: the marker answers, also where a running holder counts.
        code, other, _ = _claim(markers, prefix, name, "third", 60,
                                running_counts=True)
        assert (code, other) == (QUEUED, "new")
    finally:
        lock.release()
