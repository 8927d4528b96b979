"""The benchmarks in ``benchmarks/`` still run: each one's ``--smoke`` mode, as a
subprocess, exits 0 and prints its results table.  No timing is asserted here; the
numbers are recorded in benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# The module runs on one process of pytest-xdist (its group), in order, so the plot
# and backends tests read what the smoke runs wrote; each runs what it lacks itself
# otherwise (a run of one test, say), so it never skips for want of results.
pytestmark = pytest.mark.xdist_group("benchmarks-smoke")

#: script -> the header row of the table it prints
SCRIPTS = {
    "bench_core.py": "| variant | cycles/s | us/cycle | x floor |",
    "bench_handoff.py": "| variant | P | hand-offs | hand-offs/s | acquisitions/s |",
    "bench_renewal.py": "| variant | holds | round trips/pass | EVALSHA/pass |",
    "bench_waiters.py": "| variant | waiters | hand-offs | acquisitions |",
    "bench_e2e.py": "| variant | tasks/s | x plain | CPU ms/task | +CPU ms/task |",
    "bench_send.py": "| store | variant | sends/s | us/send | x plain |",
    "bench_memory.py": "| variant | locks | keys/lock held | bytes/lock held |",
    "bench_contention.py": "| variant | waiting | P | hand-offs | hand-offs/s |",
    "bench_backends.py": "| backend | names | p50 us | p99 us | mean us | x Redis |",
    "bench_web.py": "| page | locks | median ms | max ms | CPU ms |",
    "bench_commands.py": "| variant | lock store cmds/task | EVALSHA+EVAL/task |",
}
#: The pool sizes of the e2e scaling smoke run: two small workers, one after the other.
SCALING_ARGS = ["bench_e2e.py", "--smoke", "--concurrency", "1,2", "--tasks", "20",
                "--rounds", "1", "--warmup", "0", "--variants",
                "LockedTask (hashed args)"]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    extra = []
    url = os.environ.get("DLOCK_TEST_REDIS_URL")
    if url and args[0] != "plot.py":
        extra = ["--redis-url", url]
    # bench_backends.py and bench_send.py start the other backends' servers
    # themselves (skipping, with the reason, those they cannot), or take the suite's.
    pg_url = os.environ.get("DLOCK_TEST_POSTGRES_URL")
    if pg_url and args[0] in ("bench_backends.py", "bench_send.py"):
        extra += ["--postgres-url", pg_url]
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / args[0]), *args[1:], *extra],
        capture_output=True, text=True, timeout=120, cwd=BENCHMARKS.parent,
        check=False,
    )


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-results")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_mode_runs_and_prints_its_table(script: str, results_dir: Path) -> None:
    out = results_dir / script.replace(".py", ".json")
    proc = _run([script, "--smoke", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert SCRIPTS[script] in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["smoke"] is True
    assert data["machine"]["redis_server"]


def _per_store_smoke(results_dir: Path, script: str, key: str
                     ) -> tuple[dict[str, Any], set[str]]:
    """``script --smoke``'s JSON and the stores it measured: Redis always, each
    other store measured or skipped with a reason, never both."""
    out = results_dir / f"{script.removesuffix('.py')}.json"
    if not out.exists():
        proc = _run([script, "--smoke", "--json", str(out)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    measured, skipped = set(data[key]), set(data["skipped"])
    assert "redis" in measured, data["skipped"]
    assert measured | skipped == {"redis", "postgres", "mysql", "zookeeper"}
    assert not measured & skipped
    assert all(why for why in data["skipped"].values())
    return data, measured


def test_backends_measures_or_skips_each_backend(results_dir: Path) -> None:
    data, measured = _per_store_smoke(results_dir, "bench_backends.py", "backends")
    assert {(r["backend"], r["names"]) for r in data["cycle"]} == {
        (b, n) for b in measured for n in ("distinct", "hot", "slot of 3")}
    assert {(r["backend"], r["holds"]) for r in data["renewal"]} == {
        (b, n) for b in measured for n in data["holds"]}
    assert {r["variant"] for r in data["tasks"]["rows"]} == {
        "plain task", *(f"LockedTask (hashed args), {b}" for b in measured)}
    # Every cycle sent requests to its server, as counted on the client.
    assert all(r["requests"] >= 2 for r in data["cycle"]), data["cycle"]


def test_send_measures_each_mode_on_each_store_or_says_why_not(
        results_dir: Path) -> None:
    data, measured = _per_store_smoke(results_dir, "bench_send.py", "stores")
    per_store = {"LockedTask until_started", "LockedTask until_finished",
                 "LockedTask queued_and_running", "LockedTask throttle",
                 "duplicate until_started, return_existing",
                 "duplicate until_started, drop"}
    assert {(r["store"], r["variant"]) for r in data["rows"]} == {
        ("-", "plain Task"), ("-", "LockedTask while_running"),
        *((s, v) for s in measured for v in per_store)}
    for row in data["rows"]:
        # A send in a mode asks its store at least once (a claim); the plain task and
        # while_running ask none, and only a queued message reaches the broker.
        assert (row["store_requests"] >= 1) == (row["store"] != "-"), row
        assert row["redis_cmds"] >= (0 if row["variant"].startswith("duplicate")
                                     else 1), row


def test_e2e_runs_one_worker_per_pool_size(results_dir: Path) -> None:
    out = results_dir / "bench_e2e_scaling.json"
    proc = _run([*SCALING_ARGS, "--json", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| variant | -c 1 | -c 2 |" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["concurrency"] == [1, 2]
    assert [run["pool_children"] for run in data["runs"]] == [1, 2]
    assert {(r["workers"], r["variant"]) for r in data["rows"]} == {
        (n, v) for n in (1, 2) for v in ("plain task", "LockedTask (hashed args)")}


def test_commands_counts_each_mode_on_a_lock_store_of_its_own(
        results_dir: Path) -> None:
    out = results_dir / "bench_commands.json"
    if not out.exists():
        proc = _run(["bench_commands.py", "--smoke", "--json", str(out)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    modes = ("while_running", "until_started", "until_finished", "queued_and_running",
             "throttle")
    assert set(rows) == {"plain task", *(f"LockedTask {m}" for m in modes),
                         "LockedTask while_running, lock_limit=2",
                         "celery-once QueueOnce", "celery-singleton Singleton"}
    # The lock store serves the locks only: a plain task sends it nothing, and an
    # idle worker nothing either.
    assert rows["plain task"]["lock_cmds"] == 0, rows["plain task"]
    assert sum(data["idle_lock_cmds"].values()) == 0, data["idle_lock_cmds"]
    running = rows["LockedTask while_running"]
    assert running["lock_cmds"] > 0 and running["script_calls"] == 2, running
    assert rows["LockedTask until_finished"]["lock_cmds"] > running["lock_cmds"]
    # docs/modes.md's cost: a marker costs one script call at the send, one at the
    # start (the hand-over) and one at the end (the started call leaves the
    # waiting), throttle none at the start or end; a lock none at the send.
    for mode, more in (("until_started", 3), ("until_finished", 3),
                       ("queued_and_running", 3), ("throttle", 1)):
        row = rows[f"LockedTask {mode}"]
        assert row["script_calls"] == running["script_calls"] + more, row
    # celery-once and celery-singleton: SET NX at the send, DEL after the run.
    for peer in ("celery-once QueueOnce", "celery-singleton Singleton"):
        assert rows[peer]["lock_cmds_by_name"] == {"SET": 1.0, "DEL": 1.0}, rows[peer]
        assert rows[peer]["plain_cmds"] == 2, rows[peer]
    for row in rows.values():
        # Every command the MONITOR saw is one INFO commandstats counted, and the
        # split adds up.
        assert row["monitor"]["agrees_with_commandstats"], row
        assert row["script_calls"] + row["in_scripts"] + row["plain_cmds"] == \
            pytest.approx(row["lock_cmds"]), row
        # Nothing is kept for ever; only throttle keeps its marker (its window).
        assert not row["keys_left_no_expiry"], row
        if row["variant"] != "LockedTask throttle":
            assert ":m" not in row["keys_left_by_kind"], row


def test_plot_draws_the_smoke_results(results_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    for script in ("bench_core.py", "bench_handoff.py", "bench_e2e.py",
                   "bench_renewal.py", "bench_memory.py", "bench_contention.py"):
        out = results_dir / script.replace(".py", ".json")
        if not out.exists():
            proc = _run([script, "--smoke", "--json", str(out)])
            assert proc.returncode == 0, proc.stdout + proc.stderr
    scaling = results_dir / "bench_e2e_scaling.json"
    if not scaling.exists():
        proc = _run([*SCALING_ARGS, "--json", str(scaling)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run(["plot.py", "--results", str(results_dir), "--out", str(results_dir)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for png in ("handoff.png", "core.png", "e2e.png", "growth.png"):
        assert (results_dir / png).stat().st_size > 0


def test_instructions_counts_client_and_server_of_every_variant(
        results_dir: Path) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("bench_instructions.py counts under callgrind: needs valgrind "
                    "(Debian package valgrind), which .ci/run installs")
    out = results_dir / "bench_instructions.json"
    # Not _run: it starts its own server under valgrind, never the suite's.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_instructions.py"), "--smoke",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| variant | client instr/cycle | server instr/cycle |" in proc.stdout
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"floor: 2x PING", "celery_dlock", "celery_dlock renew=on",
                         "redis-py Lock", "python-redis-lock", "SET NX PX + DEL"}
    assert all(r["client"] > 0 and r["server"] > 0 for r in rows.values()), rows
    # Each count is of its own variant: two scripts cost the server more than two
    # PINGs, and python-redis-lock's three calls through redis-py cost its client
    # more than two PINGs through redis-py.
    floor = rows["floor: 2x PING"]
    assert rows["celery_dlock"]["server"] > 5 * floor["server"], rows
    assert rows["python-redis-lock"]["client"] > floor["client"], rows


def test_profile_parts_runs_and_prints_its_table() -> None:
    proc = _run(["profile_e2e.py", "--parts", "--rounds", "1", "--calls", "20"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| piece | CPU us/call | wall us/call | Redis round trips |" in proc.stdout
    assert "| LockedTask call, hashed args (body included) |" in proc.stdout
