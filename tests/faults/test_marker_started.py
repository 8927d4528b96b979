"""A started call stays live from its start to its end, on every store that keeps
queue markers: its task id is kept among the started calls waiting (``hand_over``'s
``keep``), so that, should its worker die with nothing written for it (the whole
worker killed, or the store out of reach then: the chaos run on PostgreSQL found
the second), its message comes back as that call: never superseded by a call queued
meanwhile, never replaced, and a send of its task id meanwhile a duplicate of it.
Its end (``clear``) takes it out.  (docs/modes.md, "A worker that dies";
model/markers.pml, ``-DDEATH``.)
"""

from __future__ import annotations

from typing import Any

import pytest
from marker_stores import MarkerCase

from celery_dlock.task.markers import CLAIMED, OURS, QUEUED, REPLACED, RUNNING

pytestmark = pytest.mark.slow

US, UF = False, True  # running_counts: until_started (and queued_and_running), UF


def send(m: Any, prefix: str, task_id: str, *, counts: bool, replace: bool = False
         ) -> tuple[int, str]:
    code, other, _ = m.claim(prefix, "n", task_id, 60, running_counts=counts,
                             replace=replace, requeue=False, op=f"op-{task_id}")
    return code, other


def start(m: Any, prefix: str, task_id: str, *, counts: bool, keep: float = 60.0
          ) -> str | None:
    return m.hand_over(prefix, "n", task_id, remove=True, replaced_check=True,
                       running_counts=counts, keep=keep)


@pytest.mark.parametrize("keep", [60.0, 0.0], ids=["kept", "not-kept"])
def test_a_started_calls_message_that_comes_back_is_never_superseded(
        markers: MarkerCase, prefix: str, keep: float) -> None:
    """until_started: x starts, its worker dies with nothing written, y is queued
    meanwhile (the name was freed at x's start), then x's message comes back.  Kept:
    x runs (and y after it).  Not kept (the old protocol): x is taken for
    superseded by y, so the call that started never ends: the test shows the
    difference."""
    m = markers.store
    assert send(m, prefix, "x", counts=US) == (CLAIMED, "")
    assert start(m, prefix, "x", counts=US, keep=keep) is None
    assert send(m, prefix, "y", counts=US) == (CLAIMED, "")
    back = start(m, prefix, "x", counts=US, keep=keep)  # x's message, again
    if keep:
        assert back is None, "x comes back as the call that started"
        assert (m.read(prefix, "n") or ("",))[0] == "y", "y stays queued"
        assert start(m, prefix, "y", counts=US) is None
    else:
        assert back == "y"


def test_a_send_of_a_started_calls_id_is_that_call_until_it_ends(
        markers: MarkerCase, prefix: str) -> None:
    """While x runs (its lock held: the holder's answer) and after its worker died
    (no holder: the waiting's answer), a send of x's task id is x; after x's end
    (``clear``) it is a new call."""
    m = markers.store
    assert send(m, prefix, "x", counts=US) == (CLAIMED, "")
    assert start(m, prefix, "x", counts=US) is None
    lock = markers.running(prefix, "n", "x")
    try:
        assert send(m, prefix, "x", counts=US) == (RUNNING, "x")
    finally:
        lock.release()  # (the worker died: its lock lapsed)
    code, other, left = m.claim(prefix, "n", "x", 60, running_counts=US,
                                replace=False, requeue=False, op="op-again")
    assert (code, other) == (QUEUED, "x") and left is not None and 50 < left <= 60
    assert m.clear(prefix, "n", "x") is False  # its end: no marker of its own
    assert send(m, prefix, "x", counts=US) == (CLAIMED, "")


@pytest.mark.parametrize("counts", [US, UF], ids=["until_started", "until_finished"])
def test_a_started_calls_message_re_queued_is_never_replaced(
        markers: MarkerCase, prefix: str, counts: bool) -> None:
    """x started; its worker died; its message came back and was re-queued (the lock
    was busy: a contention retry, or its rate parked it), carrying the record it was
    sent with (not ``started``).  Its re-queue is the started call's: until_started
    claims nothing (a call sent then is queued, and a replace replaces that one, not
    x); until_finished takes the marker as a started call's (a replace finds it
    queued, a duplicate)."""
    m = markers.store
    assert send(m, prefix, "x", counts=counts) == (CLAIMED, "")
    assert start(m, prefix, "x", counts=counts) is None
    code, other, _ = m.claim(prefix, "n", "x", 60, running_counts=counts,
                             replace=False, requeue=True, op="op-requeue")
    if counts:
        assert code == CLAIMED  # until_finished: x holds the name again
        assert (m.read(prefix, "n") or ("",))[0] == "x"
        assert send(m, prefix, "z", counts=counts, replace=True) == (QUEUED, "x")
    else:
        assert (code, other) == (OURS, "x")
        assert m.read(prefix, "n") is None  # x's re-queue claimed nothing
        assert send(m, prefix, "y", counts=counts) == (CLAIMED, "")
        assert send(m, prefix, "z", counts=counts, replace=True) == (REPLACED, "y")
    assert start(m, prefix, "x", counts=counts) is None  # x runs when it comes
