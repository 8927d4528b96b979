"""The counterexamples the marker model (model/markers.pml) found in the code, replayed
against a real Redis: each test drives the marker scripts (or the send) in the order
of the model's trace, a lost reply standing for the re-sent claim redis-py makes
(see docs/protocol.md, "The marker protocol").
"""

from __future__ import annotations

import time

import pytest
import redis

from celery_dlock.backends.redis.markers import RedisMarkers
from celery_dlock.task.markers import CLAIMED, QUEUED, REPLACED

pytestmark = pytest.mark.slow


def claim(m: RedisMarkers, prefix: str, task_id: str, op: str, *,
          replace: bool = False, ttl: float = 60.0) -> tuple[int, str, float | None]:
    return m.claim(prefix, "n", task_id, ttl, running_counts=True, replace=replace,
                   requeue=False, op=op)


def start(m: RedisMarkers, prefix: str, task_id: str) -> str | None:
    return m.hand_over(prefix, "n", task_id, remove=True, replaced_check=True)


def test_a_resent_claim_is_known_after_a_failed_replace_gave_its_marker_back(
        r: redis.Redis, prefix: str) -> None:
    """(OP_IN_RECORD) 1 claims and its reply is lost; 2 replaces 1, and 2's publish
    fails: the name goes back to 1.  1's claim, sent again, gets its first reply (the
    claim stands) and is published, rather than being told a duplicate of itself."""
    m = RedisMarkers(r)
    assert claim(m, prefix, "1", "op1")[0] == CLAIMED  # the reply is lost
    assert claim(m, prefix, "2", "op2", replace=True)[:2] == (REPLACED, "1")
    assert m.undo(prefix, "n", "2", "op2", 60) is True
    assert claim(m, prefix, "1", "op1")[:2] == (CLAIMED, "")  # the re-sent claim
    assert (m.read(prefix, "n") or ("",))[0] == "1"
    assert start(m, prefix, "1") is None  # it runs


def test_a_resent_claim_of_a_replace_taken_back_is_not_claimed_anew(
        r: redis.Redis, prefix: str) -> None:
    """(CLAIM_REPLACED) 3 is queued; 2 replaces it and the reply of 2's claim is lost;
    3 starts and takes the replace back (2 is recorded replaced).  2's claim, sent
    again, must not claim the free name: it is a duplicate (never published).  Were it
    published, a later replace whose publish fails would give the name back to 2,
    which would then run after 3."""
    m = RedisMarkers(r)
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
        r: redis.Redis, prefix: str) -> None:
    """(NO_PDL_RAISE) 3 is queued (1 s marker); 2 replaces it, pending; 3 is delivered
    and parked by the rate (its re-queue waits up to 60 s, and stays replaced); 2's
    publish fails: the name goes back to 3 for as long as its parked message waits,
    not for the second its first marker had left (the name then freed while 3 waited,
    and a third call was accepted beside it)."""
    m = RedisMarkers(r)
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
