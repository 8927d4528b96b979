"""The chaos checker can fail: fed the records of a run in which an older holder's write
was taken after a newer holder's, or an increment was lost, or a lock was left behind,
it reports each (so the zeros of a real run mean something); and it flags the recorded
runs of three broken locks (no owner check on release, no mutual exclusion, a constant
fence), and passes the real lock's run of the same scenario."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import broken_locks
import chaos_check
import mini_run
import pytest


def write_run(out: Path, rows: list[list[Any]], counter: int,
              records: dict[str, list[dict[str, Any]]], left: list[str]) -> Path:
    (out / "records").mkdir(parents=True)
    for name, recs in records.items():
        (out / "records" / name).write_text(
            "".join(json.dumps(r) + "\n" for r in recs))
    (out / "driver.jsonl").write_text(json.dumps(
        {"ev": "fault", "kind": "stop_holder", "start": 0.2, "end": 0.9, "n": 0,
         "target": 1, "t": 0.9, "pid": 9}) + "\n")
    meta = {"config": {"seed": 7, "db": "sqlite", "workers": 1, "concurrency": 1,
                       "ttl": 2.0},
            "scheduled": 1, "t0": 0.0, "end": 3.0,
            "left": {"keys": left, "cleared_after": 7.0},
            "db_read": [counter, max(r[3] for r in rows), rows]}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def hold(pid: int, fence: int, start: float, end: float,
         writes: list[tuple[float, float, bool]]) -> list[dict[str, Any]]:
    acq = 1
    recs: list[dict[str, Any]] = [
        {"ev": "acquired", "pid": pid, "fence": fence, "acq": acq, "t": start,
         "name": "chaos:counter"}]
    for seq, (t0, t, ok) in enumerate(writes):
        recs.append({"ev": "write", "pid": pid, "fence": fence, "acq": acq, "seq": seq,
                     "t0": t0, "t": t, "ok": ok})
    recs.append({"ev": "released", "pid": pid, "fence": fence, "acq": acq, "t": end})
    return recs


def test_a_stale_write_taken_after_a_newer_holders_is_reported(tmp_path: Path) -> None:
    # A (fence 5) is paused; B (fence 6) acquires and writes; A wakes and its write is
    # taken although B's came first: the database did not check the fence.
    records = {
        "worker-1.jsonl": hold(1, 5, 0.0, 2.0, [(0.1, 0.11, True), (1.5, 1.51, True)]),
        "client-2.jsonl": hold(2, 6, 1.0, 1.2, [(1.0, 1.01, True)]),
    }
    rows = [[1, "task-1.1", 0, 5, 1], [2, "client-2.1", 0, 6, 2],
            [3, "task-1.1", 1, 5, 3]]
    rep = chaos_check.check(write_run(tmp_path, rows, 3, records, []))
    assert rep["stale_writes_accepted"] == 1
    assert rep["unfenced_overlaps"] == 1
    assert rep["unfenced_examples"][0]["older"] == (1, 5)
    kinds = sorted(v["kind"] for v in rep["violations"])
    # The pause of A (pid 1, 0.2-0.9 s, + a ttl of slack) explains the overlap; A's
    # write taken after B's does not (stale, and interleaved).
    assert "stale_write_accepted" in kinds and "interleaved_writes" in kinds, kinds
    assert rep["overlapping_holds_holder_view"] == 1
    assert rep["lost_increments"] == 0
    assert rep["recovery_s"]["stop_holder"]["n"] == 1


def test_the_same_run_fenced_is_clean(tmp_path: Path) -> None:
    records = {
        "worker-1.jsonl": hold(1, 5, 0.0, 2.0, [(0.1, 0.11, True), (1.5, 1.51, False)]),
        "client-2.jsonl": hold(2, 6, 1.0, 1.2, [(1.0, 1.01, True)]),
    }
    rows = [[1, "task-1.1", 0, 5, 1], [2, "client-2.1", 0, 6, 2]]
    rep = chaos_check.check(write_run(tmp_path, rows, 2, records, []))
    assert rep["stale_writes_accepted"] == rep["unfenced_overlaps"] == 0
    assert rep["violations"] == [], rep["violations"]
    assert rep["stale_writes_refused"] == 1
    assert rep["overlapping_holds_holder_view"] == 1
    assert rep["lost_increments"] == 0 and rep["locks_left"] == []


def test_lost_increments_and_a_lock_left_behind_are_reported(tmp_path: Path) -> None:
    # Two writers read the same value (no lock at all), and a hold key stayed.
    records = {
        "worker-1.jsonl": hold(1, 5, 0.0, 1.0, [(0.1, 0.11, True)]),
        "client-2.jsonl": hold(2, 6, 2.0, 3.0, [(2.1, 2.11, True), (2.2, 2.21, True)]),
    }
    rows = [[1, "task-1.1", 0, 5, 1], [2, "client-2.1", 0, 6, 1]]  # value 1 twice
    rep = chaos_check.check(write_run(tmp_path, rows, 1, records, ["p:{x}:lock"]))
    assert rep["lost_increments"] >= 2  # counter 1 for 2 rows; the missing seq 1
    assert rep["accepted_writes_missing_from_db"] == 1
    assert rep["locks_left"] == ["p:{x}:lock"]


def test_an_overlap_no_pause_explains_is_a_violation(tmp_path: Path) -> None:
    # The same holds as above (A 0.0-2.0, B 1.0-1.2), but the only pause in the run hit
    # another process: nothing explains A and B holding at once.
    records = {
        "worker-1.jsonl": hold(1, 5, 0.0, 2.0, [(0.1, 0.11, True)]),
        "client-2.jsonl": hold(2, 6, 1.0, 1.2, [(1.0, 1.01, True)]),
    }
    rows = [[1, "task-1.1", 0, 5, 1], [2, "client-2.1", 0, 6, 2]]
    out = write_run(tmp_path, rows, 2, records, [])
    driver = json.loads((out / "driver.jsonl").read_text())
    driver["target"] = 3
    (out / "driver.jsonl").write_text(json.dumps(driver) + "\n")
    rep = chaos_check.check(out)
    assert [v["kind"] for v in rep["violations"]] == ["overlap"]
    assert rep["violations"][0]["holds"] == [(1, 1), (2, 1)]


def test_one_fence_for_two_holds_is_a_violation(tmp_path: Path) -> None:
    records = {
        "worker-1.jsonl": hold(1, 5, 0.0, 0.5, [(0.1, 0.11, True)]),
        "client-2.jsonl": hold(2, 5, 1.0, 1.5, [(1.1, 1.11, True)]),
    }
    rows = [[1, "task-1.1", 0, 5, 1], [2, "client-2.1", 0, 5, 2]]
    rep = chaos_check.check(write_run(tmp_path, rows, 2, records, []))
    assert [v["kind"] for v in rep["violations"]] == ["fence_reused"]


#: What each broken lock's run must show (the real lock's: nothing).
EXPECTED = {"real": set(), "no_owner_check": {"overlap"}, "no_exclusion": {"overlap"},
            "constant_fence": {"fence_reused"}}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_recorded_runs_of_broken_locks_are_flagged(tmp_path: Path, redis_url: str,
                                                   prefix: str, kind: str) -> None:
    out = mini_run.run(tmp_path / kind, broken_locks.KINDS[kind], redis_url, prefix)
    rep = chaos_check.check(out)
    assert rep["holds"] >= 6 and rep["writes_accepted"] > 0, rep
    found = {v["kind"] for v in rep["violations"]}
    if not EXPECTED[kind]:
        assert rep["violations"] == [], rep["violations"][:10]
    else:
        assert EXPECTED[kind] <= found, (kind, rep["violations"][:10])


def test_a_task_is_lost_only_when_its_message_left_the_broker(tmp_path: Path) -> None:
    # Three tasks sent: one ran, one's message is still in the broker after the stop
    # (not run yet, not lost), one's message is gone (lost).
    records = {"worker-1.jsonl": [
        *hold(1, 5, 0.0, 0.5, [(0.1, 0.11, True)]),
        {"ev": "task_start", "pid": 1, "task_id": "ran", "t": 0.0},
        {"ev": "task_end", "pid": 1, "task_id": "ran", "state": "SUCCESS", "t": 0.6}]}
    out = write_run(tmp_path, [[1, "task-1.1", 0, 5, 1]], 1, records, [])
    with (out / "driver.jsonl").open("a") as fh:
        for task_id in ("ran", "queued", "gone"):
            fh.write(json.dumps({"ev": "sent", "task_id": task_id, "t": 0.0}) + "\n")
    meta = json.loads((out / "meta.json").read_text())
    meta["broker_left"] = {"ids": ["queued"]}
    (out / "meta.json").write_text(json.dumps(meta))
    broker = chaos_check.check(out)["broker"]
    assert (broker["sent"], broker["succeeded"]) == (3, 1)
    assert (broker["lost"], broker["still_queued_at_end"]) == (1, 1)
    # A run that did not read its broker says so, rather than counting losses.
    meta["broker_left"] = {"ids": None, "error": "ConnectionError"}
    (out / "meta.json").write_text(json.dumps(meta))
    assert chaos_check.check(out)["broker"]["lost"] is None
