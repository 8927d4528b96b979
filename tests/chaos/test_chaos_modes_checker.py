"""The modes checker can fail: fed the records of a run with a second call accepted
while the first was queued, a task id published twice, a replaced call that ran, an
accepted call dropped without cause, two bodies of one name at once, or a rate
exceeded, it reports each, and the same runs done right are clean; and it flags the
recorded runs of broken marker stores (a claim that always answers "ours", a replace
that records nothing) on a real Redis and a real ``celery worker``, and passes the
shipped store's run of the same calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import broken_markers
import modes_check
import modes_mini
import pytest


class Run:
    """A run directory written by hand: ``call``/``replaced``/``revoke`` records of the
    producer, worker records, meta."""

    def __init__(self, out: Path, rate: dict[str, Any] | None = None) -> None:
        self.out = out
        self.driver: list[dict[str, Any]] = []
        self.worker: list[dict[str, Any]] = []
        self.n = 0
        self.rate = rate

    def call(self, t: float, task_id: str, key: str = "k", mode: str = "until_finished",
             policy: str = "raise", outcome: str = "accepted",
             other: str | None = None) -> None:
        self.n += 1
        self.driver.append({"ev": "call", "n": self.n, "task": "chaos.mode",
                            "task_id": task_id, "key": key, "mode": mode,
                            "policy": policy, "t0": t, "t": t + 0.01,
                            "outcome": outcome, "other": other, "pid": 1})

    def body(self, task_id: str, start: float, end: float | None, pid: int = 10,
             key: str = "k", outcome: str = "ok", state: str = "SUCCESS",
             name: str | None = None) -> None:
        name = name or f"mode:{key}"
        self.worker.append({"ev": "task_start", "task_id": task_id, "t": start - 0.01,
                            "pid": pid})
        self.worker.append({"ev": "body_start", "task_id": task_id, "key": key,
                            "name": name, "t": start, "pid": pid})
        if end is not None:
            self.worker.append({"ev": "body_end", "task_id": task_id, "key": key,
                                "outcome": outcome, "t": end, "pid": pid})
            self.worker.append({"ev": "task_end", "task_id": task_id, "state": state,
                                "t": end + 0.01, "pid": pid})

    def ignored(self, task_id: str, t: float, pid: int = 10,
                by: str | None = None) -> None:
        self.worker.append({"ev": "task_start", "task_id": task_id, "t": t, "pid": pid})
        self.worker.append({"ev": "task_end", "task_id": task_id, "state": "IGNORED",
                            "t": t + 0.01, "pid": pid,
                            "reason": f"{task_id} was superseded by {by}" if by else ""})

    def check(self) -> dict[str, Any]:
        (self.out / "records").mkdir(parents=True, exist_ok=True)
        by_pid: dict[int, list[dict[str, Any]]] = {}
        for r in self.worker:
            by_pid.setdefault(r["pid"], []).append(r)
        for pid, recs in by_pid.items():
            (self.out / "records" / f"worker-{pid}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in recs))
        (self.out / "driver.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in self.driver))
        cfg: dict[str, Any] = {"seed": 3, "lock": "redis"}
        if self.rate:
            cfg["rate"] = self.rate
        (self.out / "meta.json").write_text(json.dumps(
            {"config": cfg, "t0": 0.0, "end": 30.0, "broker_left": {"ids": []}}))
        return modes_check.check(self.out)


def kinds(rep: dict[str, Any]) -> list[str]:
    return sorted(v["kind"] for v in rep["violations"])


@pytest.mark.parametrize("second_at", [1.0, 3.0])
def test_a_call_accepted_while_another_is_queued_is_two_live(tmp_path: Path,
                                                            second_at: float) -> None:
    # until_finished: A accepted at 0, runs 2.0-2.5; B accepted at 1.0 (A queued) is a
    # violation, at 3.0 (A ended) is not.
    run = Run(tmp_path)
    run.call(0.0, "A")
    run.call(second_at, "B")
    run.body("A", 2.0, 2.5)
    run.body("B", 4.0, 4.5)
    rep = run.check()
    assert kinds(rep) == (["two_live"] if second_at < 2.5 else []), rep["violations"]


def test_a_call_killed_before_its_body_frees_its_name(tmp_path: Path) -> None:
    # until_finished: A's delivery dies with its worker (its process records nothing
    # more): the name frees within lock_ttl, so B accepted later is no violation.
    run = Run(tmp_path)
    run.call(0.0, "A")
    run.worker.append({"ev": "task_start", "task_id": "A", "t": 0.5, "pid": 10})
    run.call(3.0, "B")
    run.body("B", 3.5, 4.0, pid=11)
    rep = run.check()
    assert rep["violations"] == [] and rep["broker"]["killed_not_redelivered"] == 1
    # Alive (it goes on to run another call later), A was never ended: B is second.
    run.body("C", 9.0, 9.5, pid=10)
    assert "two_live" in kinds(run.check())


def test_the_same_id_published_twice_while_queued_is_flagged(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.call(0.0, "A", mode="until_started")
    run.call(0.5, "A", mode="until_started")  # published again while queued
    run.body("A", 1.0, 1.5)
    run.call(2.0, "A", mode="until_started")  # again once it ended: a new call
    run.body("A", 2.5, 3.0)
    rep = run.check()
    assert kinds(rep) == ["same_id_twice"], rep["violations"]
    assert rep["violations"][0]["again"] == 2
    # A duplicate told "existing" (nothing published) is no violation.
    run.driver[1]["outcome"] = "existing"
    run.driver[1]["other"] = "A"
    assert run.check()["violations"] == []


@pytest.mark.parametrize(("again_at", "flagged"), [(1.0, True), (2.5, False)])
def test_in_throttle_the_same_id_is_a_duplicate_within_the_window(
        tmp_path: Path, again_at: float, flagged: bool) -> None:
    # The window is lock_ttl (2 s) from the accepted enqueue: past it, a call of the
    # name is a new one, also while the first is still queued (it starts at 3.0).
    run = Run(tmp_path)
    run.call(0.0, "A", mode="throttle", policy="drop")
    run.call(again_at, "A", mode="throttle", policy="drop")
    run.body("A", 3.0, 3.5)
    assert kinds(run.check()) == (["same_id_twice"] if flagged else [])


def test_a_replace_accepts_the_new_call_and_the_replaced_never_runs(
        tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.call(0.0, "A", policy="replace", mode="until_started")
    run.driver.append({"ev": "replaced", "old": "A", "new": "B", "t": 1.02, "pid": 1})
    run.call(1.0, "B", policy="replace", mode="until_started")
    run.body("B", 1.5, 2.0)
    run.ignored("A", 3.0, pid=11)  # A's start finds it replaced: no body
    assert run.check()["violations"] == []
    run.worker = [r for r in run.worker if r["task_id"] != "A"]
    run.body("A", 3.0, 3.5, pid=11)  # ... or it runs
    rep = run.check()
    assert kinds(rep) == ["replaced_ran"], rep["violations"]


@pytest.mark.parametrize("by", [None, "B"])
def test_an_accepted_call_dropped_without_cause_is_lost(tmp_path: Path,
                                                        by: str | None) -> None:
    # A ran its body once and retried; its retry was dropped (as superseded by B, a
    # call queued meanwhile: a started call's retry keeps its name).
    run = Run(tmp_path)
    run.call(0.0, "A", mode="queued_and_running")
    run.body("A", 0.5, 1.0, outcome="retry", state="RETRY")
    run.call(1.1, "B", mode="queued_and_running")
    run.ignored("A", 1.5, by=by)
    run.body("B", 2.0, 2.5, pid=11)
    rep = run.check()
    assert kinds(rep) == ["lost"], rep["violations"]
    # Revoked by its caller, it is not lost; nor when the broker never delivered it
    # (counted apart, as the lock scenario does).
    run.driver.append({"ev": "revoke", "task_id": "A", "t0": 1.2, "t": 1.2, "pid": 1})
    assert run.check()["violations"] == []
    run2 = Run(tmp_path / "2")
    run2.call(0.0, "A")
    rep = run2.check()
    assert rep["violations"] == [] and rep["broker"]["never_delivered"] == 1


@pytest.mark.parametrize("cause", ["OperationalError", "LockLostInterrupt"])
def test_a_retry_rejected_is_lost_unless_the_broker_was_down(tmp_path: Path,
                                                             cause: str) -> None:
    """A body asked for a retry and its attempt ended REJECTED: Celery rejects a
    retry whose publish raised.  Raised by the broker being down (kombu's
    OperationalError) it is the broker's loss, counted apart; raised by anything
    else (an interrupt inside the publish) it is lost."""
    run = Run(tmp_path)
    run.call(0.0, "A", mode="queued_and_running")
    run.body("A", 0.5, 1.0, outcome="retry", state="REJECTED")
    run.worker[-1]["reason"] = f"({cause}('...'), False)"
    rep = run.check()
    if cause == "OperationalError":
        assert rep["violations"] == []
        assert rep["broker"]["retry_unpublished_broker_down"] == 1
    else:
        assert kinds(rep) == ["lost"], rep["violations"]
        assert rep["broker"]["retry_unpublished_broker_down"] == 0


def test_a_call_superseded_before_it_started_is_not_lost(tmp_path: Path) -> None:
    # B replaced A, but the replace was not confirmed (no signal): A's start finds it
    # superseded by B; and no second call of the name was live meanwhile.
    run = Run(tmp_path)
    run.call(0.0, "A", policy="replace")
    run.call(1.0, "B", policy="replace")
    run.ignored("A", 1.5, by="B")
    run.body("B", 2.0, 2.5, pid=11)
    rep = run.check()
    assert rep["violations"] == [] and rep["broker"]["superseded_at_start"] == 1
    # The same without a replace (B sent with "raise") is a second call accepted
    # while A was queued, and A is lost.
    for r in run.driver:
        r["policy"] = "raise"
    assert sorted(kinds(run.check())) == ["lost", "two_live"]


@pytest.mark.parametrize("mode", ("until_finished", "until_started",
                                  "queued_and_running"))
def test_a_replace_lost_to_the_start_of_the_call_it_replaced(
        tmp_path: Path, mode: str) -> None:
    # B replaced A, and A started before B's replace was confirmed: A runs.  Where a
    # running call is a duplicate (until_finished) B then never runs, superseded by
    # A; in the other modes B stays queued and must run: superseded by A, it is lost.
    run = Run(tmp_path)
    run.call(0.0, "A", policy="replace", mode=mode)
    run.call(1.0, "B", policy="replace", mode=mode)
    run.body("A", 1.2, 1.4, pid=10)
    run.ignored("B", 1.5, by="A")
    rep = run.check()
    if mode == "until_finished":
        assert rep["violations"] == [] and rep["broker"]["superseded_at_start"] == 1
    else:
        assert kinds(rep) == ["lost"], rep["violations"]


def test_a_replace_whose_publish_failed_replaces_nothing(tmp_path: Path) -> None:
    # B's replace of A could not be published (the serializer refused it): A must
    # still run; superseded at its start by B, it is lost.
    run = Run(tmp_path)
    run.call(0.0, "A", policy="replace")
    run.call(1.0, "B", policy="replace", outcome="publish_failed")
    run.ignored("A", 1.5, by="B")
    assert kinds(run.check()) == ["lost"]


def test_a_caller_told_of_a_call_never_sent_is_flagged(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.call(0.0, "B", outcome="existing", other="X")
    assert kinds(run.check()) == ["existing_never_sent"]


def test_two_bodies_of_one_name_at_once_overlap(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.call(0.0, "A", mode="queued_and_running")
    run.call(0.1, "B", mode="queued_and_running")
    run.body("A", 1.0, 2.0, pid=10)
    run.body("B", 1.5, 2.5, pid=11)
    assert kinds(run.check()) == ["overlap"]
    # Told its lock is lost at 1.4, A's body stops believing it holds it there.
    run.worker.append({"ev": "lost", "task_id": "A", "t": 1.4, "pid": 10})
    run.worker.sort(key=lambda r: r["t"])
    assert run.check()["violations"] == []


def test_a_process_dead_after_its_body_ended_in_retry_frees_its_name(
        tmp_path: Path) -> None:
    # until_finished: A's body ends in self.retry() at 1.0; its retry runs at 5.0.
    # B accepted at 3.0 is a second live call while A waits for its retry, unless A's
    # process died before its delivery ended (in self.retry(), waiting for the
    # store): the name frees within lock_ttl then, and A's message comes back.
    run = Run(tmp_path)
    run.call(0.0, "A")
    run.worker.append({"ev": "task_start", "task_id": "A", "t": 0.4, "pid": 10})
    run.worker.append({"ev": "body_start", "task_id": "A", "key": "k",
                       "name": "mode:k", "t": 0.5, "pid": 10})
    run.worker.append({"ev": "body_end", "task_id": "A", "key": "k",
                       "outcome": "retry", "t": 1.0, "pid": 10})
    run.call(3.0, "B")
    run.body("B", 3.5, 4.0, pid=11)
    run.body("A", 5.0, 5.5, pid=12)
    assert run.check()["violations"] == []
    # Its delivery ended (task_end RETRY) and its process went on: A stays live.
    run.worker.append({"ev": "task_end", "task_id": "A", "state": "RETRY", "t": 1.1,
                       "pid": 10})
    run.body("C", 9.0, 9.5, pid=10)
    assert kinds(run.check()) == ["two_live"]


def test_more_starts_than_the_rate_allows_are_flagged(tmp_path: Path) -> None:
    rate = {"n": 2, "period": 1.0, "burst": 1}  # at most 3 starts in any second
    run = Run(tmp_path, rate)
    for i, start in enumerate((0.0, 0.5, 0.99, 1.6)):
        run.call(start - 0.1, f"R{i}", mode="while_running")
        run.body(f"R{i}", start, start + 0.001, pid=10 + i, name="rated:r")
    rep = run.check()
    assert rep["violations"] == [] and rep["rated_most_starts_in_a_period"] == 3
    run.call(0.6, "R9", mode="while_running")
    run.body("R9", 0.7, 0.701, pid=20, name="rated:r")
    rep = run.check()
    assert kinds(rep) == ["rate"] and rep["rated_most_starts_in_a_period"] == 4


def test_a_start_held_back_by_a_store_fault_stands_for_an_earlier_grant(
        tmp_path: Path) -> None:
    """The bound is on grants (the store's clock): a start just after a latency fault
    (0.12 s a reply) may stand for a grant up to 0.36 s earlier, so four starts in
    0.9 s are no violation there, and are one without the fault; a fifth start among
    them (four in 0.4 s) is one even with it."""
    rate = {"n": 2, "period": 1.0, "burst": 1}
    run = Run(tmp_path, rate)
    for i, start in enumerate((10.0, 10.1, 10.4, 10.9)):
        run.call(start - 0.5, f"R{i}", mode="while_running")
        run.body(f"R{i}", start, start + 0.001, pid=10 + i, name="rated:r")
    assert kinds(run.check()) == ["rate"]
    run.driver.append({"ev": "fault", "kind": "latency", "amount": 0.12, "start": 8.0,
                       "end": 9.95, "t": 9.95})
    assert run.check()["violations"] == []
    run.call(10.0, "R9", mode="while_running")
    run.body("R9", 10.2, 10.201, pid=20, name="rated:r")
    assert kinds(run.check()) == ["rate"]


#: What each broken marker store's run must show (the shipped store's: nothing).
EXPECTED = {"real": set(), "always_ours": {"two_live"},
            "replace_records_nothing": {"replaced_ran"}}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_recorded_runs_of_broken_marker_stores_are_flagged(
        tmp_path: Path, redis_url: str, prefix: str, kind: str) -> None:
    out = modes_mini.run(tmp_path / kind, broken_markers.KINDS[kind], redis_url,
                         prefix)
    rep = modes_check.check(out)
    assert rep["accepted"] >= 3 and rep["bodies"] >= 2, rep
    found = {v["kind"] for v in rep["violations"]}
    if not EXPECTED[kind]:
        assert rep["violations"] == [], rep["violations"]
        assert rep["replaced"] == 1 and rep["outcomes"]["raised"] == 1, rep
    else:
        assert EXPECTED[kind] <= found, (kind, rep["violations"])
