"""The short chaos run (about a minute of faults): real ``celery worker`` prefork
children running a ``LockedTask`` and a standalone client increment a fenced counter
in SQLite while the fault driver kills them, pauses them past the ttl, restarts the
lock's server from what it synced, pauses it, delays and black-holes the lock's links
and restarts the broker when it is a server of its own.

One run per variant (:data:`VARIANTS`: the lock's server and the broker); the default
test run takes :data:`DEFAULT_VARIANTS`, ``$DLOCK_CHAOS_VARIANTS`` (comma-separated,
or ``all``) others.  The seed (``$DLOCK_CHAOS_SEED``, default 1) fixes the fault
schedule; ``$DLOCK_CHAOS_DB=postgresql`` writes to PostgreSQL instead of SQLite.  A
variant whose servers are missing here is skipped, saying why.  The run directory is
kept in the test's tmp dir.  The long run: ``python tests/chaos/run.py``
(docs/chaos.md)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import chaos_check
import chaos_driver
import chaos_servers
import pytest
from chaos_faults import BROKER_KINDS, KINDS, WORKER_KINDS, schedule

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

SEED = int(os.environ.get("DLOCK_CHAOS_SEED", "1"))
DB = os.environ.get("DLOCK_CHAOS_DB", "sqlite")

#: variant -> (the lock's server, the broker).
VARIANTS = {
    "redis": ("redis", "redis"),  # one Redis: lock and broker
    "postgresql": ("postgresql", "redis"),
    "zookeeper": ("zookeeper", "redis"),
    "rabbitmq": ("postgresql", "amqp"),  # the stack without Redis
}
#: What the default test run (and CI) runs; the others on demand.
DEFAULT_VARIANTS = ("redis", "postgresql")
_asked = os.environ.get("DLOCK_CHAOS_VARIANTS", ",".join(DEFAULT_VARIANTS))
WANTED = set(VARIANTS) if _asked == "all" else {v.strip() for v in _asked.split(",")}


def test_variants_asked_for_exist() -> None:
    assert not WANTED - set(VARIANTS), f"DLOCK_CHAOS_VARIANTS: known {sorted(VARIANTS)}"


def test_schedule_is_a_function_of_the_seed() -> None:
    every = [*KINDS, *BROKER_KINDS]
    a = schedule(SEED, 60, 0.4, 2.0, every)
    assert a == schedule(SEED, 60, 0.4, 2.0, every)
    assert a != schedule(SEED + 1, 60, 0.4, 2.0, every)
    assert {f.kind for f in a} == set(every)  # every kind of fault, in one minute
    for channel in ("proxy", "server", "stop", "broker"):
        mine = [f for f in a if f.channel == channel]
        for before, after in itertools.pairwise(mine):
            assert after.at >= before.at + before.duration, (before, after)
    # Leaving the broker's restarts out leaves the lock's faults as they were.
    assert schedule(SEED, 60, 0.4, 2.0) == [
        f for f in schedule(SEED, 60, 0.4, 2.0) if f.kind in KINDS]
    lock_faults = [(f.at, f.kind) for f in a if f.kind in KINDS]
    assert lock_faults == [(f.at, f.kind) for f in schedule(SEED, 60, 0.4, 2.0)]
    # The modes scenario's kills of whole workers leave every other fault as it was.
    with_kills = schedule(SEED, 60, 0.4, 2.0, [*every, *WORKER_KINDS])
    assert [(f.at, f.kind) for f in with_kills if f.kind not in WORKER_KINDS] == [
        (f.at, f.kind) for f in a]
    assert any(f.kind in WORKER_KINDS for f in with_kills)


@pytest.mark.xdist_group("chaos")  # one run at a time: they share the machine
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_short_chaos_run_has_no_unfenced_overlap_and_no_stale_write(
        variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if variant not in WANTED:
        pytest.skip(f"on demand: DLOCK_CHAOS_VARIANTS={variant} (default "
                    f"{','.join(DEFAULT_VARIANTS)})")
    lock, broker = VARIANTS[variant]
    why = chaos_servers.unavailable(lock, broker)
    if why is None and DB == "postgresql":
        why = chaos_servers.unavailable("postgresql", "redis")
    if why is not None:
        pytest.skip(why)
    cfg = chaos_driver.Config(seed=SEED, seconds=60, mean_gap=0.4, drain=45, db=DB,
                              lock=lock, broker=broker)
    out = chaos_driver.run(cfg, tmp_path / "run")
    report = chaos_check.check(out)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    with capsys.disabled():
        print("\n" + chaos_check.markdown(report))

    # The run did what it says: every scheduled fault was injected, of every kind the
    # variant gets, while tasks and the client kept taking the one lock and writing.
    scheduled = schedule(SEED, cfg.seconds, cfg.mean_gap, cfg.ttl, cfg.kinds())
    assert report["faults_injected"] == report["faults_scheduled"] == len(scheduled)
    assert len(scheduled) > 40
    kinds = {f.kind for f in scheduled}
    assert set(KINDS) <= kinds
    assert set(report["faults_by_kind"]) == kinds
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
