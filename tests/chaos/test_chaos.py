"""The short chaos run (about a minute of faults): real ``celery worker`` prefork
children running a ``LockedTask`` and a standalone ``RedisLock`` client increment a
fenced counter in SQLite while the fault driver kills them, pauses them past the ttl,
restarts Redis from its AOF, delays and black-holes the lock's links and pauses every
client.  The seed (``$DLOCK_CHAOS_SEED``, default 1) fixes the fault schedule;
``$DLOCK_CHAOS_DB=postgresql`` writes to PostgreSQL instead of SQLite (skipped, saying
why, when no server can start).  The run directory is kept in the test's tmp dir.
The long run: ``python tests/chaos/run.py`` (docs/chaos.md)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import chaos_check
import chaos_driver
import pytest
from chaos_faults import KINDS, schedule

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

SEED = int(os.environ.get("DLOCK_CHAOS_SEED", "1"))
DB = os.environ.get("DLOCK_CHAOS_DB", "sqlite")


def test_schedule_is_a_function_of_the_seed() -> None:
    a = schedule(SEED, 60, 0.4, 2.0)
    assert a == schedule(SEED, 60, 0.4, 2.0)
    assert a != schedule(SEED + 1, 60, 0.4, 2.0)
    assert {f.kind for f in a} == set(KINDS)  # every kind of fault, in one minute
    for channel in ("proxy", "redis", "stop"):
        mine = [f for f in a if f.channel == channel]
        for before, after in itertools.pairwise(mine):
            assert after.at >= before.at + before.duration, (before, after)


def test_short_chaos_run_has_no_unfenced_overlap_and_no_stale_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = chaos_driver.Config(seed=SEED, seconds=60, mean_gap=0.4, drain=45, db=DB)
    if DB == "postgresql":
        from pg_server import PostgresServer, Unavailable

        try:
            PostgresServer().start().stop()
        except Unavailable as exc:
            pytest.skip(f"no PostgreSQL server: {exc}")
    out = chaos_driver.run(cfg, tmp_path / "run")
    report = chaos_check.check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    with capsys.disabled():
        print("\n" + chaos_check.markdown(report))

    # The run did what it says: every scheduled fault was injected, of every kind, while
    # tasks and the client kept taking the one lock and writing.
    assert report["faults_injected"] == report["faults_scheduled"] > 40
    assert set(report["faults_by_kind"]) == set(KINDS)
    assert not report["fault_errors"], report["fault_errors"]
    assert report["lock_names"] == ["chaos:counter"]
    assert report["holds"] > 30 and report["writes_accepted"] > 100, report

    # Safety: of the lock (no overlap no pause explains, no fence handed out twice, no
    # two holds' writes interleaved) and of the fenced resource.
    assert report["violations"] == [], report["violations"][:10]
    assert report["unfenced_overlaps"] == 0, report["unfenced_examples"]
    assert report["stale_writes_accepted"] == 0
    assert report["lost_increments"] == 0, report
    assert report["counter"] == report["log_rows"] == report["writes_accepted"] + \
        report["commits_unrecorded_by_writer"]
    assert report["locks_left"] == [], report["locks_left"]
    # And the system came back after each fault (the lock's ttl is 2 s).
    for kind, rec in report["recovery_s"].items():
        assert rec["max"] is not None and rec["max"] < 30, (kind, rec)
