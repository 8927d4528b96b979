"""``celery dlock`` against locks held by real tasks running on an in-process worker.

The commands go through Celery's own click group (``celery -A cli_app:app dlock ...``),
so the ``celery.commands`` entry point, the ``CLIContext`` and option parsing are the
real ones; one test runs ``python -m celery`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import cli_app
import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from celery.bin.celery import celery as celery_cli
from celery.contrib.testing.worker import start_worker
from celery.utils import nodenames
from celery_helpers import close_app
from click.testing import CliRunner, Result
from dlock_helpers import closed_port, wait_until

from celery_dlock import LockLost, is_skipped
from celery_dlock.backends.redis.inspect import SUMMARY_FIELDS, get_lock
from celery_dlock.ops.cli import dlock

RESULT_TIMEOUT = 30
#: What ls --json and show --json add for a queued call (tests/integration/
#: test_cli_markers.py); None here, where nothing is sent with a lock_mode.
QUEUED = ("queued_task_id", "queued_ttl")


@pytest.fixture(scope="module")
def env(redis_url: str) -> Iterator[SimpleNamespace]:
    tag = uuid.uuid4().hex[:8]
    prefix = f"dlcli{tag}"
    app = cli_app.configure(redis_url, prefix, f"q-cli-{tag}", dlock_record_events=True)
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    started: list[str] = []
    hostname = f"cli-{tag}@localhost"
    # What a task on this worker sees as request.hostname, so what LockedTask stores
    # as "worker": the pools that trace through trace_task_ret (threads) report the
    # machine's host name, not the worker's node name.
    workers = {hostname, nodenames.gethostname()}
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                      shutdown_timeout=20, hostname=hostname):
        yield SimpleNamespace(app=app, r=r, prefix=prefix, workers=workers,
                              started=started, url=redis_url)
        for x in started:  # let every blocked task finish before the worker stops
            cli_app.open_gate(r, prefix, x)
    close_app(app)
    r.close()


def run_cli(*args: str, input: str | None = None) -> Result:
    """``celery -A cli_app:app dlock ARGS`` through Celery's click group."""
    return CliRunner().invoke(celery_cli, ["-A", "cli_app:app", "dlock", *args],
                              input=input, catch_exceptions=False)


def start_hold(env: SimpleNamespace) -> tuple[str, Any]:
    """A running ``hold`` task holding ``cli:X``: (X, its AsyncResult)."""
    x = uuid.uuid4().hex[:8]
    env.started.append(x)
    result = cli_app.hold.delay(x)
    assert wait_until(lambda: get_lock(env.r, env.prefix, f"cli:{x}") is not None,
                      timeout=10), "the task never took its lock"
    return x, result


def finish(env: SimpleNamespace, x: str, result: Any) -> Any:
    cli_app.open_gate(env.r, env.prefix, x)
    return result.get(timeout=RESULT_TIMEOUT)


# -- ls --------------------------------------------------------------------------------

def test_ls_json_describes_the_running_task(env):
    x, result = start_hold(env)
    try:
        out = run_cli("ls", "--json")
        assert out.exit_code == 0, out.output
        rows = json.loads(out.stdout)
        assert isinstance(rows, list)
        assert all(list(row) == [*SUMMARY_FIELDS, *QUEUED, "rate"] for row in rows)
        assert all(row["rate"] is None for row in rows)  # no lock_rate
        assert all(row["queued_task_id"] is None for row in rows)  # nothing queued
        row = next(row for row in rows if row["key"] == f"cli:{x}")
        assert row["task_id"] == result.id
        assert row["task_name"] == "cli_app.hold"
        assert row["worker"] in env.workers
        assert row["pid"] == os.getpid()  # threads pool: the task runs in this process
        assert row["count"] == 1
        assert isinstance(row["fence"], int) and row["fence"] >= 1
        assert 0 < row["ttl"] <= 10
        assert row["held_for"] >= 0
        assert row["owner"].split(":")[1] == str(os.getpid())
    finally:
        finish(env, x, result)
    # released when the task ended
    rows = json.loads(run_cli("ls", "--json").stdout)
    assert not [row for row in rows if row["key"] == f"cli:{x}"]


def test_ls_table_has_a_row_per_lock(env):
    x, result = start_hold(env)
    try:
        out = run_cli("ls")
        assert out.exit_code == 0, out.output
        lines = out.stdout.splitlines()
        assert lines[0].split() == [f.upper() for f in SUMMARY_FIELDS]
        row = next(line for line in lines if line.startswith(f"cli:{x} "))
        assert result.id in row and "cli_app.hold" in row
        assert any(worker in row for worker in env.workers)
    finally:
        finish(env, x, result)


def test_ls_and_show_give_the_arguments_of_a_hashed_name(env):
    """A hashed name (``cli_app.hold_hashed:<sha256>``) says nothing to a person: the
    hold carries the arguments that made it, and ls and show print them."""
    x = uuid.uuid4().hex[:8]
    env.started.append(x)
    result = cli_app.hold_hashed.delay(x, note="not keyed")
    name = cli_app.hold_hashed.lock_name((x,), {"note": "not keyed"})
    assert wait_until(lambda: get_lock(env.r, env.prefix, name) is not None, timeout=10)
    try:
        table = run_cli("ls")
        assert table.exit_code == 0, table.output
        header, *rows = table.stdout.splitlines()
        assert header.split()[:2] == ["KEY", "ARGS"]
        (row,) = [line for line in rows if line.startswith(name)]
        assert f"x='{x}'" in row and "not keyed" not in row
        (listed,) = [r for r in json.loads(run_cli("ls", "--json").stdout)
                     if r["key"] == name]
        assert listed["args"] == f"x='{x}'"
        shown = run_cli("show", name)
        assert f"x='{x}'" in shown.stdout, shown.output
    finally:
        cli_app.open_gate(env.r, env.prefix, x)
    assert result.get(timeout=RESULT_TIMEOUT) == name


def test_ls_with_no_locks_under_a_prefix(env):
    out = run_cli("--prefix", f"empty{uuid.uuid4().hex[:6]}", "ls")
    assert out.exit_code == 0
    assert "No locks held" in out.stdout
    out = run_cli("--prefix", f"empty{uuid.uuid4().hex[:6]}", "ls", "--json")
    assert json.loads(out.stdout) == []


# -- show ------------------------------------------------------------------------------

def test_show_prints_every_field(env):
    x, result = start_hold(env)
    try:
        out = run_cli("show", f"cli:{x}")
        assert out.exit_code == 0, out.output
        fields = dict(line.split(":", 1) for line in out.stdout.splitlines())
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        assert fields["key"] == f"cli:{x}"
        assert fields["task_id"] == result.id
        assert fields["worker"] in env.workers
        assert fields["pid"] == str(os.getpid())
        assert fields["host"]
        assert fields["waiting"] == "0"
        assert fields["redis_key"] == f"{env.prefix}:{{cli:{x}}}"
        for name in ("task_name", "owner", "count", "fence", "ttl", "held_for"):
            assert fields[name] not in ("", "-"), name
        as_json = json.loads(run_cli("show", f"cli:{x}", "--json").stdout)
        assert set(as_json) == {*SUMMARY_FIELDS, "host", "extra", *QUEUED, "rate"}
        assert as_json["rate"] is None  # no lock_rate
        assert as_json["task_id"] == result.id
        # the redis_key it printed names the same lock
        by_key = run_cli("show", fields["redis_key"])
        assert by_key.exit_code == 0
        assert f"key: cli:{x}" in " ".join(by_key.stdout.split())
    finally:
        finish(env, x, result)


def test_release_takes_the_storage_key_show_prints(env):
    x, result = start_hold(env)
    try:
        freed = run_cli("release", f"{env.prefix}:{{cli:{x}}}", "--force")
        assert freed.exit_code == 0, freed.output
        assert f"Released lock 'cli:{x}'" in freed.stdout
        assert get_lock(env.r, env.prefix, f"cli:{x}") is None
    finally:
        cli_app.open_gate(env.r, env.prefix, x)
    with pytest.raises(LockLost):  # the holder is told
        result.get(timeout=RESULT_TIMEOUT)


def test_show_unknown_key_exits_1(env):
    out = run_cli("show", "no-such-lock")
    assert out.exit_code == 1
    assert "No lock named 'no-such-lock'" in out.stderr
    assert "Traceback" not in out.output


# -- release ---------------------------------------------------------------------------

def test_release_asks_and_no_frees_nothing(env):
    x, result = start_hold(env)
    try:
        before = get_lock(env.r, env.prefix, f"cli:{x}")
        out = run_cli("release", f"cli:{x}", input="n\n")
        assert out.exit_code == 1
        assert "Release it?" in out.output and result.id in out.output
        assert "Aborted" in out.output
        after = get_lock(env.r, env.prefix, f"cli:{x}")
        assert after is not None and before is not None
        assert (after.owner, after.fence) == (before.owner, before.fence)
        assert is_skipped(cli_app.probe.delay(x).get(timeout=RESULT_TIMEOUT))
    finally:
        finish(env, x, result)


def test_release_force_frees_the_lock_and_the_next_task_runs(env):
    x, result = start_hold(env)
    try:
        held = get_lock(env.r, env.prefix, f"cli:{x}")
        assert held is not None
        assert is_skipped(cli_app.probe.delay(x).get(timeout=RESULT_TIMEOUT))
        out = run_cli("release", f"cli:{x}", "--force")
        assert out.exit_code == 0, out.output
        assert f"Released lock 'cli:{x}'" in out.stdout
        assert f"cli_app.hold[{result.id}]" in out.stdout
        assert f"owner {held.owner}" in out.stdout
        assert f"fence {held.fence}" in out.stdout
        assert get_lock(env.r, env.prefix, f"cli:{x}") is None
        assert cli_app.probe.delay(x).get(timeout=RESULT_TIMEOUT) == "ran"
    finally:
        cli_app.open_gate(env.r, env.prefix, x)
    # The running task lost its lock: it fails (lock_lost_action="fail").
    with pytest.raises(LockLost):
        result.get(timeout=RESULT_TIMEOUT)


def test_release_confirmed_frees_the_hold_it_showed(env):
    x, result = start_hold(env)
    try:
        out = run_cli("release", f"cli:{x}", input="y\n")
        assert out.exit_code == 0, out.output
        assert f"Released lock 'cli:{x}'" in out.stdout
        assert get_lock(env.r, env.prefix, f"cli:{x}") is None
    finally:
        cli_app.open_gate(env.r, env.prefix, x)
    with pytest.raises(LockLost):
        result.get(timeout=RESULT_TIMEOUT)


def test_release_unknown_key_exits_1(env):
    for args in (("release", "no-such-lock", "--force"), ("release", "no-such-lock")):
        out = run_cli(*args)
        assert out.exit_code == 1, args
        assert "No lock named 'no-such-lock'" in out.stderr


# -- top -------------------------------------------------------------------------------

def test_top_once_shows_the_lock_and_recent_contention(env):
    x, result = start_hold(env)
    try:
        skipped = cli_app.probe.delay(x)
        assert is_skipped(skipped.get(timeout=RESULT_TIMEOUT))
        out = run_cli("top", "--iterations", "1", "--interval", "0.1")
        assert out.exit_code == 0, out.output
        text = out.stdout
        assert f"cli:{x}" in text and result.id in text
        assert "WAITING" in text.splitlines()[2]
        assert "Recent contention" in text
        line = next(line for line in text.splitlines()
                    if "contended" in line and f"cli:{x}" in line)
        assert f"cli_app.probe[{skipped.id}]" in line
        assert "-> skip" in line
        assert f"cli_app.hold[{result.id}]" in line
    finally:
        finish(env, x, result)


def test_top_refreshes_then_stops_on_ctrl_c(env, monkeypatch):
    """A real SIGINT during the second wait ends the view at its next check, quietly:
    the first press is recorded and raised where it cannot be dropped."""
    import time

    real_sleep = time.sleep
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        real_sleep(seconds)
        if sum(sleeps) > 0.6:  # well into the second interval
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(time, "sleep", sleep)
    before = signal.getsignal(signal.SIGINT)
    out = run_cli("top", "--interval", "0.5")
    assert out.exit_code == 0
    assert out.stdout.count("celery dlock top") == 2
    assert 0.6 < sum(sleeps) < 0.7
    assert max(sleeps) <= 0.05  # waits in steps, checking between them
    assert "Traceback" not in out.output
    assert signal.getsignal(signal.SIGINT) is before


# -- Redis unreachable -----------------------------------------------------------------

def test_unreachable_redis_is_one_line_and_exit_2(env):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    for command in (("ls",), ("ls", "--json"), ("show", "x"), ("release", "x", "-f"),
                    ("top", "--iterations", "1")):
        out = run_cli("--url", url, *command)
        assert out.exit_code == 2, (command, out.output)
        assert out.stderr.startswith(f"cannot reach Redis at {url}: "), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
        assert "Traceback" not in out.output


def test_unreachable_redis_from_the_app_settings(redis_url):
    port = closed_port()
    app = Celery("down", broker=redis_url, set_as_current=False)
    app.conf.dlock_url = f"redis://:secret@127.0.0.1:{port}/0"
    obj = CLIContext(app=app, no_color=True, workdir=None)
    out = CliRunner().invoke(dlock, ["ls"], obj=obj)
    assert out.exit_code == 2
    assert f"cannot reach Redis at redis://:**@127.0.0.1:{port}/0: " in out.stderr
    assert "secret" not in out.output


# -- discovery through the entry point -------------------------------------------------

def test_celery_finds_the_dlock_command_in_a_subprocess(env):
    x, result = start_hold(env)
    try:
        proc = cli_app.run_cli(env.url, env.prefix, "ls", "--json")
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        row = next(row for row in rows if row["key"] == f"cli:{x}")
        assert row["task_id"] == result.id and row["worker"] in env.workers
        assert row["ttl"] > 0
    finally:
        finish(env, x, result)


def test_help_lists_the_subcommands():
    out = CliRunner().invoke(celery_cli, ["dlock", "--help"])
    assert out.exit_code == 0
    for name in ("ls", "show", "release", "top"):
        assert name in out.stdout
    # every store, not "the Redis locks"
    assert "Redis locks" not in out.stdout
    assert all(store in " ".join(out.stdout.split())
               for store in ("Redis", "PostgreSQL", "MySQL", "ZooKeeper"))


def test_no_app_given_says_to_pass_it(tmp_path):
    """``celery dlock ls`` without -A reads Celery's default app, which has no lock
    store: the one line says so, and what to pass."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CELERY_", "DLOCK_"))}
    out = subprocess.run([sys.executable, "-m", "celery", "dlock", "ls"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "needs a lock store" in line and "pass -A / --app" in line, line
    with_url = subprocess.run([sys.executable, "-m", "celery", "dlock", "--url",
                               "redis://127.0.0.1:1/0", "ls"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
    assert "--app" not in with_url.stderr  # a store was given: no app is needed

