"""The short modes run (docs/chaos.md, "The modes scenario"): real ``celery worker``
prefork processes run calls sent with every ``lock_mode`` and ``on_duplicate`` (and a
``lock_rate`` task) while the producer sends duplicates with new and with the same
task ids, storms of replaces, calls that retry, revokes and calls whose publish fails,
and the fault driver SIGKILLs pool children and whole workers, restarts and pauses
the lock's server, and delays and cuts the lock's links.

Variants: ``redis`` (one Redis: lock, markers, rates and broker) and ``postgresql``
(the lock, its markers and rates on PostgreSQL, the broker on Redis, so a fault of the
lock's server never takes the broker with it); both send every mode and duplicate
policy, and rated calls, and are judged by the same checks.

The run is made once per variant (a module fixture); each invariant of
:mod:`modes_check` is its own test, so that one found broken can be marked alone.
``$DLOCK_CHAOS_SEED`` fixes the schedule (default 1); ``$DLOCK_CHAOS_VARIANTS`` as for
the lock's runs (``test_chaos.py``) also picks these (default: both);
``$DLOCK_CHAOS_OUT`` keeps the run directories there."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import chaos_driver
import chaos_modes
import chaos_servers
import modes_check
import pytest
from chaos_faults import schedule

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.xdist_group("chaos")]

SEED = int(os.environ.get("DLOCK_CHAOS_SEED", "1"))
#: variant -> (the lock's server, the broker, a broker of its own), seconds of faults.
VARIANTS = {"redis": ("redis", "redis", False),
            "redis-broker": ("redis", "redis", True),
            "postgresql": ("postgresql", "redis", True)}
SECONDS = {"redis": 30.0, "redis-broker": 30.0, "postgresql": 30.0}
DEFAULT_VARIANTS = "redis,postgresql"
_asked = os.environ.get("DLOCK_CHAOS_VARIANTS", DEFAULT_VARIANTS)
WANTED = set(VARIANTS) if _asked == "all" else {v.strip() for v in _asked.split(",")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def report(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    variant = request.param
    if variant not in WANTED:
        pytest.skip(f"on demand: DLOCK_CHAOS_VARIANTS={variant} (default "
                    f"{DEFAULT_VARIANTS})")
    lock, broker, own_broker = VARIANTS[variant]
    why = chaos_servers.unavailable(lock, broker)
    if why is not None:
        pytest.skip(why)
    cfg = chaos_driver.Config(seed=SEED, seconds=SECONDS[variant], mean_gap=0.5,
                              settle=3, drain=40,
                              lock=lock, broker=broker, own_broker=own_broker,
                              workers=2, concurrency=2, scenario="modes")
    keep = os.environ.get("DLOCK_CHAOS_OUT")  # a directory to keep the run in
    base = Path(keep) if keep else tmp_path_factory.mktemp(f"modes-{variant}")
    out = chaos_driver.run(cfg, base / f"modes-{variant}-seed{SEED}")
    rep = modes_check.check(out)
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    rep["variant"] = variant
    rep["scheduled"] = schedule(SEED, cfg.seconds, cfg.mean_gap, cfg.ttl, cfg.kinds())
    return rep


def test_the_run_did_what_it_says(report: dict[str, Any],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + modes_check.markdown(report))
    scheduled = report["scheduled"]
    assert report["faults_injected"] == len(scheduled) > 10
    assert set(report["faults_by_kind"]) == {f.kind for f in scheduled}
    assert {"kill_child", "kill_worker", "server_restart"} <= set(
        report["faults_by_kind"])
    assert not report["fault_errors"], report["fault_errors"]
    out = report["outcomes"]
    assert report["accepted"] > 20 and report["bodies"] > 20, report
    assert out.get("publish_failed", 0) > 0 and report["same_id_sends"] > 0, out
    assert report["bodies_retried"] > 0, report
    if VARIANTS[report["variant"]][0] in chaos_modes.MARKER_STORES:
        assert report["accepted"] > 60 and report["revoked"] > 0, report
        assert report["modes"] == ["queued_and_running", "throttle", "until_finished",
                                   "until_started", "while_running"]
        assert report["policies"] == ["drop", "raise", "replace", "return_existing"]
        for told in ("existing", "raised", "dropped"):
            assert out.get(told, 0) > 0, out
        assert report["replaced"] > 0, report
        assert report["rated_most_starts_in_a_period"] > 0, report
    else:
        assert report["modes"] == ["while_running"]


#: (variant, invariant) -> why the short run (seed 1) finds it broken today.
KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("kind", ["overlap", "two_live", "same_id_twice", "replaced_ran",
                                  "lost", "existing_never_sent", "rate"])
def test_no_violation_of(report: dict[str, Any], kind: str,
                         request: pytest.FixtureRequest) -> None:
    why = KNOWN.get((report["variant"], kind))
    if why is not None and SEED == 1:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))
    found = [v for v in report["violations"] if v["kind"] == kind]
    assert found == [], (report["seed"], found[:5])
