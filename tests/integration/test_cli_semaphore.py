"""``celery dlock`` shows a semaphore (``lock_limit`` > 1) as its slots used/limit and
its holders, and frees its slots: on every store that keeps semaphores (the
``semaphore_store`` fixture: Redis, PostgreSQL, MySQL/MariaDB, ZooKeeper)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import cli_app
import pytest
from celery.bin.celery import celery as celery_cli
from celery_helpers import close_app
from click.testing import CliRunner, Result

from celery_dlock.core.lock_options import LockOptions


@pytest.fixture
def env(redis_url: str, semaphore_store: Any) -> Iterator[SimpleNamespace]:
    tag = uuid.uuid4().hex[:8]
    prefix = f"dlsem{tag}"
    # (the app is shared by the tests: what another test set is set again here; the
    # history, which test_cli.py turns on, is a Redis list the other stores refuse)
    url = None if semaphore_store.kind == "redis" else semaphore_store.url
    app = cli_app.configure(redis_url, prefix, f"q-sem-{tag}", dlock_url=url,
                            dlock_record_events=False)
    name = f"sem:{tag}"
    holds = [semaphore_store.backend.lock(LockOptions(
        name, 30, prefix=prefix, owner=f"owner-{i}", limit=3,
        info={"task_id": f"task-{i}", "task_name": "t.slots"})) for i in range(2)]
    for s in holds:
        assert s.acquire(blocking=False)
    yield SimpleNamespace(prefix=prefix, name=name, holds=holds)
    for s in holds:
        if s.depth:
            s.release_all()
    app.conf.update(dlock_url=None)  # the next test of the shared app: its own URL
    close_app(app)


def run_cli(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(celery_cli, ["-A", "cli_app:app", "dlock", *args],
                              input=input, catch_exceptions=False)


def test_ls_shows_slots_used_of_the_limit(env):
    rows = json.loads(run_cli("ls", "--json").stdout)
    row = next(row for row in rows if row["key"] == env.name)
    assert row["slots"] == "2/3"
    assert row["task_id"] in ("task-0", "task-1")
    text = run_cli("ls").stdout
    header, *lines = text.splitlines()
    assert header.split()[:2] == ["KEY", "SLOTS"]
    line = next(line for line in lines if line.startswith(env.name))
    assert line.split()[1] == "2/3"


def test_show_lists_every_holder(env):
    text = run_cli("show", env.name).stdout
    assert "slots:" in text and "2/3" in text
    holders = [line for line in text.splitlines() if line.startswith("holder.")]
    assert len(holders) == 2
    assert any("task-0" in line and "owner-0" in line for line in holders)
    assert any("task-1" in line and "owner-1" in line for line in holders)
    full = json.loads(run_cli("show", env.name, "--json").stdout)
    assert full["limit"] == 3 and full["slots"] == "2/3"
    assert sorted(h["owner"] for h in full["holders"]) == ["owner-0", "owner-1"]
    assert all(isinstance(h["fence"], int) for h in full["holders"])


def test_top_shows_the_slots(env):
    out = run_cli("top", "--iterations", "1", "--interval", "0.1")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "SLOTS" in lines[2]
    # (the key may be cut to fit the terminal; the slots never are)
    assert any(line.startswith("sem") and line.split()[1] == "2/3" for line in lines)


def test_release_frees_every_slot(env):
    out = run_cli("release", env.name, input="y\n")
    assert out.exit_code == 0, out.output
    assert "2/3" in out.stdout and "Released 2 slot(s)" in out.stdout
    for s in env.holds:
        assert not s.owned()
    assert run_cli("show", env.name).exit_code != 0
