"""The counterexamples the marker model (model/markers.pml) found in the code, replayed
against each store that keeps queue markers (Redis, PostgreSQL, MySQL/MariaDB: the
``markers`` fixture): each test drives the store (or the send) in the order of the
model's trace, a lost reply standing for the re-sent claim a client makes (see
docs/protocol.md, "The marker protocol").
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from celery_helpers import close_app, test_app
from marker_stores import MarkerCase

from celery_dlock import LockedTask
from celery_dlock.task.markers import (
    CLAIMED,
    MARKER_HEADER,
    QUEUED,
    REPLACED,
    RUNNING,
    MarkerRecord,
    MarkerStore,
)

pytestmark = pytest.mark.slow


def claim(m: MarkerStore, prefix: str, task_id: str, op: str, *,
          replace: bool = False, ttl: float = 60.0) -> tuple[int, str, float | None]:
    return m.claim(prefix, "n", task_id, ttl, running_counts=True, replace=replace,
                   requeue=False, op=op)


def start(m: MarkerStore, prefix: str, task_id: str) -> str | None:
    return m.hand_over(prefix, "n", task_id, remove=True, replaced_check=True,
                       running_counts=True)  # as claim(): until_finished


def test_a_resent_claim_is_known_after_a_failed_replace_gave_its_marker_back(
        markers: MarkerCase, prefix: str) -> None:
    """(OP_IN_RECORD) 1 claims and its reply is lost; 2 replaces 1, and 2's publish
    fails: the name goes back to 1.  1's claim, sent again, gets its first reply (the
    claim stands) and is published, rather than being told a duplicate of itself."""
    m = markers.store
    assert claim(m, prefix, "1", "op1")[0] == CLAIMED  # the reply is lost
    assert claim(m, prefix, "2", "op2", replace=True)[:2] == (REPLACED, "1")
    assert m.undo(prefix, "n", "2", "op2", 60) is True
    assert claim(m, prefix, "1", "op1")[:2] == (CLAIMED, "")  # the re-sent claim
    assert (m.read(prefix, "n") or ("",))[0] == "1"
    assert start(m, prefix, "1") is None  # it runs


def test_a_resent_claim_of_a_replace_taken_back_is_not_claimed_anew(
        markers: MarkerCase, prefix: str) -> None:
    """(CLAIM_REPLACED) 3 is queued; 2 replaces it and the reply of 2's claim is lost;
    3 starts and takes the replace back (2 is recorded replaced).  2's claim, sent
    again, must not claim the free name: it is a duplicate (never published).  Were it
    published, a later replace whose publish fails would give the name back to 2,
    which would then run after 3."""
    m = markers.store
    assert claim(m, prefix, "3", "op3")[0] == CLAIMED
    assert claim(m, prefix, "2", "op2", replace=True)[:2] == (REPLACED, "3")  # lost
    assert start(m, prefix, "3") is None  # 3 runs
    assert claim(m, prefix, "2", "op2", replace=True)[0] == QUEUED  # re-sent
    assert m.read(prefix, "n") is None
    assert claim(m, prefix, "1", "op1", replace=True)[0] == CLAIMED
    assert m.undo(prefix, "n", "1", "op1", 60) is True  # 1's publish fails
    assert m.read(prefix, "n") is None
    assert start(m, prefix, "2") is not None  # 2 never runs


def test_an_undo_gives_a_parked_replaced_call_a_marker_as_long_as_its_message(
        markers: MarkerCase, prefix: str) -> None:
    """(NO_PDL_RAISE) 3 is queued (1 s marker); 2 replaces it, pending; 3 is delivered
    and parked by the rate (its re-queue waits up to 60 s, and stays replaced); 2's
    publish fails: the name goes back to 3 for as long as its parked message waits,
    not for the second its first marker had left (the name then freed while 3 waited,
    and a third call was accepted beside it)."""
    m = markers.store
    assert claim(m, prefix, "3", "op3", ttl=1)[0] == CLAIMED
    assert claim(m, prefix, "2", "op2", replace=True, ttl=1)[:2] == (REPLACED, "3")
    code, _, _ = m.claim(prefix, "n", "3", 60, running_counts=True, replace=False,
                         requeue=True, op="op4")  # the park's re-queue
    assert code == QUEUED
    assert m.undo(prefix, "n", "2", "op2", 60) is True  # 2's publish fails
    task_id, left = m.read(prefix, "n") or ("", None)
    assert task_id == "3" and left is not None and left > 50
    time.sleep(1.2)  # past the first marker's time
    assert claim(m, prefix, "1", "op1")[:2] == (QUEUED, "3")
    assert start(m, prefix, "3") is None  # the parked call runs


def _producer(redis_url: str, prefix: str, queue: str, dlock_url: str) -> Any:
    """An app that sends on the suite's Redis broker and keeps its locks and markers
    at ``dlock_url``."""
    app = test_app("marker-orders", redis_url, queue=queue, prefix=prefix,
                   dlock_url=dlock_url)

    @app.task(shared=False, name="pf.mode", base=LockedTask, lock_key="mode:{key}",
              lock_ttl=3)
    def mode(key: str, seconds: float, tag: str) -> str:
        raise AssertionError("never runs here")

    return app


@pytest.mark.parametrize("mode", ("until_started", "queued_and_running"))
def test_a_task_id_sent_while_its_retry_is_re_queued_is_the_same_call(
        redis_url: str, r: redis.Redis, markers: MarkerCase, prefix: str,
        mode: str) -> None:
    """(RESULT_STORE_CHECK) A started call re-queues its retry (it holds no marker in
    these modes) and has not yet released its lock nor been recorded RETRY by the
    result store: its task id sent now is still that call, never a second message.
    Once the retry starts (its hand-over), the task id is the lock's to answer for.
    (The broker is Redis on every store: ``r`` reads the queue.)"""
    queue = f"q-{prefix}"
    app = _producer(redis_url, prefix, queue, markers.url)
    try:
        task, args = app.tasks["pf.mode"], ("k", 0.0, "a")
        name = task.lock_name(args, {})
        record = MarkerRecord(name, prefix, mode, "return_existing", "report-r1",
                              started=True).header()
        task.apply_async(args, task_id="report-r1", lock_mode=mode,
                         headers={MARKER_HEADER: record})  # the retry, from its attempt
        again = task.apply_async(args, task_id="report-r1", lock_mode=mode)
        assert again.id == "report-r1"
        del again  # its result consumer goes with the app, below
        queued = [json.loads(raw)["headers"]["id"] for raw in r.lrange(queue, 0, -1)]
        assert queued == ["report-r1"]
        m = markers.store
        assert m.hand_over(prefix, name, "report-r1", remove=False,
                           replaced_check=False) is None  # the retry starts
        assert m.claim(prefix, name, "report-r1", 60, running_counts=False, replace=False,
                       requeue=False, op="op1")[0] == CLAIMED
    finally:
        close_app(app)


def test_a_replace_sent_with_the_running_calls_id_is_that_call(
        markers: MarkerCase, prefix: str) -> None:
    """(until_started) 1 started (its marker gone, its lock held) and 2 is queued: a
    replace sent with 1's task id is a duplicate of the running call 1, never a second
    message of 1 that would replace 2 and run 1's body again."""
    m = markers.store
    assert m.claim(prefix, "n", "1", 60, running_counts=False, replace=False,
                   requeue=False, op="op1")[0] == CLAIMED
    assert start(m, prefix, "1") is None
    running = markers.running(prefix, "n", "1")
    try:
        assert m.claim(prefix, "n", "2", 60, running_counts=False, replace=False,
                       requeue=False, op="op2")[0] == CLAIMED
        code, other, _ = m.claim(prefix, "n", "1", 60, running_counts=False,
                                 replace=True, requeue=False, op="op3")
        assert (code, other) == (RUNNING, "1")
        assert (m.read(prefix, "n") or ("",))[0] == "2", "2 stays queued"
    finally:
        running.release()
