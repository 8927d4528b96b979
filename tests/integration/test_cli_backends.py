"""``celery dlock ls / show / release / top`` on the backends other than Redis: an app
whose ``dlock_url`` is ``postgresql://``, ``mysql://`` or ``zookeeper://`` (``python
-m celery -A config_app dlock ...`` in a subprocess), and ``--url`` with the same URL;
what a backend does not keep yet (the contention history) is said in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from config_app import ENV_CONF
from dlock_helpers import release_if_held

from celery_dlock import lock_from_url
from celery_dlock.task.backend import backend_from_url

#: The SQL backends whose blocked acquirers stand in a line ``show`` and ``top`` count.
LINED = ("postgres", "mysql")
#: The SQL backends that keep queue markers (``ls`` and ``show`` list them).
MARKED = ("postgres", "mysql")

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _dlock(pg_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env[ENV_CONF] = json.dumps({"dlock_url": pg_url, "broker_url": "memory://"})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO)])
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "celery", "-A", "config_app", "dlock",
                           *args], env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO, check=False)


@pytest.fixture(params=["postgres", "mysql"])
def sql_url(request: pytest.FixtureRequest) -> str:
    """The URL of the suite's PostgreSQL or MariaDB server."""
    if request.param == "mysql":
        return str(request.getfixturevalue("mariadb_url"))
    return str(request.getfixturevalue("postgres_server").url)


def test_ls_show_release_and_top_on_sql(sql_url):
    url = sql_url
    kind = "mysql" if url.startswith("mysql://") else "postgres"
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    lock = lock_from_url(url, "stock:42", ttl=60, prefix=prefix,
                         info={"task_name": "shop.buy", "task_id": "t-1"})
    lock.acquire()
    # A blocked acquirer: it stands in line until the force release below frees the
    # lock, then takes it and lets go.
    waiter = lock_from_url(url, "stock:42", ttl=60, prefix=prefix, owner="waiter")
    waited = threading.Thread(target=lambda: waiter.acquire(timeout=30) and
                              waiter.release(), daemon=True)
    waited.start()
    try:
        if kind in LINED:
            deadline = time.monotonic() + 10
            while waiter.waiting_count() < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waiter.waiting() == ["waiter"]
        queued_name = "report:7"  # a call sent with a lock_mode, still queued
        if kind in MARKED:
            store = backend_from_url(url).markers()
            assert store.claim(prefix, queued_name, "t-q", 60, running_counts=False,
                               replace=False, requeue=False, op="op-q")[0] == 0
        listed = _dlock(url, "--prefix", prefix, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        if kind in MARKED:
            [queued_row] = [r for r in rows if r["key"] == queued_name]
            assert queued_row["queued_task_id"] == "t-q"
            assert 0 < queued_row["queued_ttl"] <= 60
            marked = _dlock(url, "--prefix", prefix, "show", queued_name)
            assert marked.returncode == 0 and "t-q" in marked.stdout, marked.stderr
            store.clear(prefix, queued_name, "t-q")
        [row] = [r for r in rows if r["key"] != queued_name]
        assert row["key"] == "stock:42" and row["task_name"] == "shop.buy"
        assert row["fence"] == lock.fence and row["count"] == 1
        assert 0 < row["ttl"] <= 60

        shown = _dlock(url, "--prefix", prefix, "show", "stock:42")
        assert shown.returncode == 0, shown.stderr
        assert "shop.buy" in shown.stdout
        assert f"waiting: {1 if kind in LINED else 0}" in " ".join(shown.stdout.split())
        assert f"stored_at: dlock_locks[{prefix}, stock:42]" in shown.stdout
        # where the store keeps it, as show prints it, names the lock too
        by_key = _dlock(url, "--prefix", prefix, "show",
                        f"dlock_locks[{prefix}, stock:42]")
        assert by_key.returncode == 0 and "shop.buy" in by_key.stdout, by_key.stderr

        by_url = _dlock(url, "--url", url, "--prefix", prefix, "ls")
        assert by_url.returncode == 0 and "stock:42" in by_url.stdout, by_url.stderr

        top = _dlock(url, "--prefix", prefix, "top", "--iterations", "1")
        assert top.returncode == 0, top.stderr
        assert "1 held" in top.stdout and "stock:42" in top.stdout
        [row] = [line.split() for line in top.stdout.splitlines()
                 if "stock:42" in line]
        assert row[-1] == str(1 if kind in LINED else 0), top.stdout
        assert f"not kept by the {kind} backend yet" in top.stdout

        freed = _dlock(url, "--prefix", prefix, "release", "stock:42", "--force",
                       "--reason", "stuck job")
        assert freed.returncode == 0, freed.stderr
        assert "Released lock 'stock:42'" in freed.stdout
        # the holder learns who released it, and why
        assert not lock.owned()
        assert lock.lost_reason is not None and "stuck job" in lock.lost_reason
        waited.join(30)
        assert not waited.is_alive()
        after = _dlock(url, "--prefix", prefix, "ls", "--json")
        assert json.loads(after.stdout) == []
    finally:
        waited.join(30)
        release_if_held(lock)


def test_an_unknown_scheme_is_one_line_naming_the_known_ones(postgres_server):
    out = _dlock(postgres_server.url, "--url", "mongodb://u:secret@db/x", "ls")
    assert out.returncode != 0
    assert "--url must be a URL of a known scheme" in out.stderr
    assert "postgresql://" in out.stderr and "mysql://" in out.stderr
    assert "secret" not in out.stderr
    assert "Traceback" not in out.stderr


def test_ls_show_release_and_top_on_zookeeper(zk_server):
    """The same commands on a ZooKeeper ``dlock_url`` (the reason of a force release
    is not kept there: docs/backends.md)."""
    pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")
    url = zk_server.url
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    lock = lock_from_url(url, "stock:42", ttl=60, prefix=prefix,
                         info={"task_name": "shop.buy", "task_id": "t-1"})
    lock.acquire()
    try:
        listed = _dlock(url, "--prefix", prefix, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert row["key"] == "stock:42" and row["task_name"] == "shop.buy"
        assert row["fence"] == lock.fence and row["count"] == 1

        shown = _dlock(url, "--prefix", prefix, "show", "stock:42")
        assert shown.returncode == 0, shown.stderr
        assert "shop.buy" in shown.stdout
        stored_at = next(line.split(":", 1)[1].strip()
                         for line in shown.stdout.splitlines()
                         if line.strip().startswith("stored_at:"))
        by_key = _dlock(url, "--prefix", prefix, "show", stored_at)
        assert by_key.returncode == 0 and "shop.buy" in by_key.stdout, by_key.stderr

        top = _dlock(url, "--prefix", prefix, "top", "--iterations", "1")
        assert top.returncode == 0, top.stderr
        assert "1 held" in top.stdout and "stock:42" in top.stdout
        assert "not kept by the zookeeper backend yet" in top.stdout

        freed = _dlock(url, "--prefix", prefix, "release", "stock:42", "--force")
        assert freed.returncode == 0, freed.stderr
        assert "Released lock 'stock:42'" in freed.stdout
        assert not lock.owned()
        after = _dlock(url, "--prefix", prefix, "ls", "--json")
        assert json.loads(after.stdout) == []
    finally:
        release_if_held(lock)


def test_ls_and_show_give_the_queued_calls_on_zookeeper(zk_server):
    """A ZooKeeper ``dlock_url`` keeps queue markers: ``ls`` lists a queued call's
    name with its task id and ttl, ``show`` has its queued line; nothing queued under
    another prefix is seen."""
    pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")
    from celery_dlock.backends.zookeeper import backend_from_url

    url = zk_server.url
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    markers = backend_from_url(url).markers()
    markers.claim(prefix, "mail:7", "queued-1", 60, running_counts=False,
                  replace=False, requeue=False)
    listed = _dlock(url, "--prefix", prefix, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["key"] == "mail:7" and row["queued_task_id"] == "queued-1"
    assert 50 < row["queued_ttl"] <= 60 and row["owner"] is None
    shown = _dlock(url, "--prefix", prefix, "show", "mail:7")
    assert shown.returncode == 0, shown.stderr
    assert "queued-1 (ttl " in shown.stdout
    other = _dlock(url, "--prefix", prefix + "x", "ls", "--json")
    assert json.loads(other.stdout) == []


def test_a_long_name_is_listed_shown_and_released_by_itself(sql_url):
    """PostgreSQL keys a name it cannot index as it is by its digest: the commands
    still list it, and take it, by the name itself."""
    import secrets

    name = secrets.token_urlsafe(2250)  # 3,000 characters no codec shrinks
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    lock = lock_from_url(sql_url, name, ttl=60, prefix=prefix,
                         info={"task_name": "shop.long"})
    lock.acquire()
    try:
        listed = _dlock(sql_url, "--prefix", prefix, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert row["key"] == name and row["task_name"] == "shop.long"
        assert "dlock_name" not in json.dumps(row)
        shown = _dlock(sql_url, "--prefix", prefix, "show", name)
        assert shown.returncode == 0 and "shop.long" in shown.stdout, shown.stderr
        freed = _dlock(sql_url, "--prefix", prefix, "release", name, "--force")
        assert freed.returncode == 0, freed.stderr
        assert not lock.owned()
    finally:
        release_if_held(lock)


# -- celery dlock check ----------------------------------------------------------------

@pytest.fixture(params=["redis", "zookeeper"])
def store_url(request: pytest.FixtureRequest) -> str:
    """A Redis or ZooKeeper URL of the suite's (the SQL stores' check is in
    tests/faults/test_sql_faults.py, with a user lacking its grants)."""
    if request.param == "zookeeper":
        pytest.importorskip("kazoo", reason="kazoo is not installed")
        return str(request.getfixturevalue("zk_server").url)
    return str(request.getfixturevalue("redis_url"))


def test_check_says_a_usable_store_is_usable(store_url):
    out = _dlock(store_url, "check")
    assert out.returncode == 0, out.stderr
    store = "ZooKeeper" if store_url.startswith("zookeeper") else "Redis"
    assert out.stdout.startswith(f"ok: the {store} at "), out.stdout


def test_check_names_what_keeps_a_redis_from_keeping_locks(own_server):
    import redis

    server = redis.Redis.from_url(own_server.url)
    server.config_set("maxmemory", 100 * 1024 * 1024)
    server.config_set("maxmemory-policy", "volatile-lru")
    out = _dlock(own_server.url, "check")
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("Redis at ") and "maxmemory-policy volatile-lru" in line
    server.config_set("maxmemory-policy", "noeviction")
    assert _dlock(own_server.url, "check").returncode == 0
    server.close()


def test_check_of_a_store_that_does_not_answer_is_one_line():
    out = _dlock("redis://:secret@127.0.0.1:1/0", "check")
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("cannot reach Redis at redis://:**@127.0.0.1:1/0"), line
