"""The rate's decision, written once (celery_dlock.core.rates.gcra_take): the rule the
Redis script keeps, decided in Python for the SQL stores, on given clocks."""

from __future__ import annotations

import pytest

from celery_dlock.core.rates import (
    OPS_KEPT,
    RateDocument,
    gcra_take,
    ops_of,
    ops_text,
    rate_state,
    slots_of,
    slots_text,
)

T = 200_000  # 5/s
NOW = 1_700_000_000_000_000


def test_a_first_call_starts_and_moves_tat_by_one_interval():
    take = gcra_take(None, NOW, T, 0, None, "a")
    assert (take.code, take.wait_us, take.given_us) == (1, 0, NOW)
    doc = take.document
    assert doc is not None and doc.tat == NOW + T
    assert doc.ops == (("a", 1, NOW),) and doc.slots == ()
    assert doc.expires == NOW + T + 1_000_000  # a second after tat, whole ms


def test_the_state_lapses_a_second_after_tat_rounded_up_to_a_millisecond():
    doc = gcra_take(None, NOW, 1_500, 0, None, "a").document
    assert doc is not None and doc.expires == NOW + 2_000 + 1_000_000


def test_a_second_call_is_parked_for_a_reserved_slot_and_tat_moves_on():
    doc = gcra_take(None, NOW, T, 0, None, "a").document
    take = gcra_take(doc, NOW + 10, T, 0, None, "b")
    assert (take.code, take.wait_us, take.given_us) == (0, T - 10, NOW + T)
    assert take.document is not None and take.document.tat == NOW + 2 * T
    assert take.document.slots == (NOW + T,)
    third = gcra_take(take.document, NOW + 20, T, 0, None, "c")
    assert third.given_us == NOW + 2 * T and third.document is not None
    assert third.document.slots == (NOW + T, NOW + 2 * T)


def test_a_re_sent_op_gets_its_first_answer_and_changes_nothing():
    first = gcra_take(None, NOW, T, 0, None, "a")
    again = gcra_take(first.document, NOW + 5, T, 0, None, "a")
    assert (again.code, again.document) == (1, None)
    parked = gcra_take(first.document, NOW + 10, T, 0, None, "b")
    resent = gcra_take(parked.document, NOW + 50, T, 0, None, "b")
    assert (resent.code, resent.wait_us, resent.given_us, resent.document) == \
        (0, T - 50, NOW + T, None)
    # Re-sent once its slot has come: the answer stands, wait 0 (as the script).
    late = gcra_take(parked.document, NOW + T + 1, T, 0, None, "b")
    assert (late.code, late.wait_us, late.given_us, late.document) == \
        (0, 0, NOW + T, None)


def test_only_the_last_ops_are_kept():
    doc = None
    for i in range(OPS_KEPT + 3):
        doc = gcra_take(doc, NOW + i * T, T, 0, None, f"op{i}").document
    assert doc is not None and len(doc.ops) == OPS_KEPT
    assert doc.ops[0][0] == f"op{OPS_KEPT + 2}"  # newest first


def test_back_too_early_for_its_slot_changes_nothing():
    doc = gcra_take(gcra_take(None, NOW, T, 0, None, "a").document, NOW, T, 0, None,
                    "b").document
    early = gcra_take(doc, NOW + T - 7, T, 0, NOW + T, "c")
    assert (early.code, early.wait_us, early.given_us, early.document) == \
        (2, 7, NOW + T, None)


def test_a_slot_is_claimed_once_at_its_time_and_tat_stays():
    doc = gcra_take(gcra_take(None, NOW, T, 0, None, "a").document, NOW, T, 0, None,
                    "b").document
    assert doc is not None
    claim = gcra_take(doc, NOW + T + 3, T, 0, NOW + T, "c")
    assert (claim.code, claim.given_us) == (1, NOW + T)
    claimed = claim.document
    assert claimed is not None and claimed.tat == doc.tat and claimed.slots == ()
    assert claimed.expires == doc.expires and claimed.ops[0] == ("c", 1, NOW + T)
    # The same slot again (a message delivered twice) asks afresh: parked anew.
    again = gcra_take(claimed, NOW + T + 4, T, 0, NOW + T, "d")
    assert again.code == 0 and again.given_us == doc.tat
    assert again.document is not None and again.document.tat == doc.tat + T


def test_a_slot_claimed_more_than_an_interval_late_asks_afresh():
    doc = gcra_take(gcra_take(None, NOW, T, 0, None, "a").document, NOW, T, 0, None,
                    "b").document
    late = gcra_take(doc, NOW + 2 * T + 1, T, 0, NOW + T, "c")
    # Free again (tat passed): granted anew, and the stale slot is gone.
    assert late.code == 1 and late.given_us == NOW + 2 * T + 1
    assert late.document is not None and late.document.slots == ()
    assert late.document.tat == NOW + 3 * T + 1


def test_slots_older_than_an_interval_are_dropped_at_a_write():
    doc = RateDocument(NOW, T, 0, (), (NOW - 2 * T, NOW - T, NOW - T + 1), NOW)
    take = gcra_take(doc, NOW, T, 0, None, "x")
    assert take.document is not None and take.document.slots == (NOW - T, NOW - T + 1)


def test_a_burst_lets_b_through_then_parks():
    tau = 2 * T
    doc = None
    codes = []
    for op in "abcd":
        take = gcra_take(doc, NOW, T, tau, None, op)
        codes.append(take.code)
        doc = take.document
    assert codes == [1, 1, 1, 0]


@pytest.mark.parametrize(("tat", "tau", "now", "available", "next_in"), [
    (NOW - 5, 0, NOW, 1, 0.0),
    (NOW + T, 0, NOW, 0, 0.2),
    (NOW + T, 2 * T, NOW, 2, 0.0),
    (NOW + 3 * T, 2 * T, NOW, 0, 0.2),
])
def test_rate_state_counts_the_burst_left(tat, tau, now, available, next_in):
    state = rate_state(tat, T, tau, now)
    assert state.available == available and state.next_in == pytest.approx(next_in)
    assert state.interval == pytest.approx(0.2) and state.burst == tau // T + 1


def test_ops_and_slots_read_back_as_written():
    ops = (("ab12", 1, NOW), ("cd34", 0, NOW + T))
    assert ops_of(ops_text(ops)) == ops and ops_of("") == ()
    assert slots_of(slots_text((NOW, NOW + T))) == (NOW, NOW + T)
    assert ops_text(ops) == f" ab12:1:{NOW} cd34:0:{NOW + T}"  # the Redis hash's form
