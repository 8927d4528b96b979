"""``celery dlock ls | show | top`` show queue markers: calls sent with an enqueue-time
``lock_mode`` that are queued and not yet started, with their task ids.

Markers are planted as a producer does: by sending with ``lock_mode="until_started"``
from an app that no worker consumes (the messages stay in their queue), then the CLI
runs as an operator runs it (``python -m celery -A cli_app dlock ...``, a subprocess)
against the same Redis and prefix.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import cli_app
import pytest
import redis
from celery import Celery
from celery_helpers import close_app, test_conf

from celery_dlock import LockedTask, RedisLock
from celery_dlock.backends.redis.inspect import SUMMARY_FIELDS

LS_FIELDS = [*SUMMARY_FIELDS, "queued_task_id", "queued_ttl", "rate"]
QUEUE_TTL = 120
_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # every control character but \n


@pytest.fixture
def env(redis_url: str) -> Iterator[SimpleNamespace]:
    tag = uuid.uuid4().hex[:8]
    prefix = f"dlqm{tag}"
    queue = f"q-idle-{tag}"  # no worker reads it: every call stays queued
    app = Celery("markers_app", set_as_current=False)
    # No result backend: nothing here waits for a result.
    app.conf.update(test_conf(redis_url, queue=queue, prefix=prefix,
                              result_backend=None))

    @app.task(base=LockedTask, bind=True, name="markers_app.job", lock_key="job:{x}",
              shared=False,
              lock_queue_ttl=QUEUE_TTL)
    def job(self: Any, x: str) -> None:  # never runs
        return None

    r = redis.Redis.from_url(redis_url)
    try:
        yield SimpleNamespace(app=app, job=job, r=r, prefix=prefix, url=redis_url)
    finally:
        r.delete(queue)
        for key in r.scan_iter(match=f"{prefix}*"):
            r.delete(key)
        close_app(app)
        r.close()


def queue_call(env: SimpleNamespace, x: str, **options: Any) -> Any:
    return env.job.apply_async((x,), lock_mode="until_started", **options)


def hold(env: SimpleNamespace, name: str) -> tuple[RedisLock, str]:
    """A lock held on ``name`` under the test's prefix, and its owner token."""
    owner = f"test:1:{uuid.uuid4().hex}"
    lock = RedisLock(env.r, name, ttl=60, auto_renew=False, prefix=env.prefix,
                     owner=owner,
                     info={"task_name": "markers_app.job",
                           "task_id": str(uuid.uuid4()), "worker": "celery@w1"})
    assert lock.acquire(blocking=False)
    return lock, owner


def cli(env: SimpleNamespace, *args: str) -> Any:
    return cli_app.run_cli(env.url, env.prefix, *args)


def test_ls_shows_the_queued_task_id_of_held_and_queued_only_names(env):
    both = queue_call(env, "both")          # queued, and its name is held
    only = queue_call(env, "only")          # queued, not held
    lock, owner = hold(env, "job:both")
    other, _ = hold(env, "job:plain")          # held, nothing queued
    try:
        proc = cli(env, "ls")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split() == [f.upper() for f in LS_FIELDS if f != "rate"]
        rows = {line.split()[0]: line for line in lines[1:]}
        assert sorted(rows) == ["job:both", "job:only", "job:plain"]
        assert both.id in rows["job:both"] and owner in rows["job:both"]
        cells = rows["job:only"].split()
        assert cells[0] == "job:only" and cells[-2] == only.id
        assert cells[1:-2] == ["-"] * (len(SUMMARY_FIELDS) - 1)  # not held
        assert re.fullmatch(r"1m[45]\ds|2m00s", cells[-1]), cells[-1]  # QUEUE_TTL
        assert rows["job:plain"].split()[-2:] == ["-", "-"]
    finally:
        lock.release_all()
        other.release_all()


def test_ls_json_has_the_marker_fields_with_raw_values(env):
    queued = queue_call(env, "q")
    lock, owner = hold(env, "job:h")
    try:
        proc = cli(env, "ls", "--json")
        assert proc.returncode == 0, proc.stderr
        rows = {row["key"]: row for row in json.loads(proc.stdout)}
        assert all(list(row) == LS_FIELDS for row in rows.values())
        q = rows["job:q"]
        assert q["queued_task_id"] == queued.id
        assert isinstance(q["queued_ttl"], float) and 0 < q["queued_ttl"] <= QUEUE_TTL
        assert all(q[f] is None for f in SUMMARY_FIELDS if f != "key")  # not held
        h = rows["job:h"]
        assert h["owner"] == owner and h["count"] == 1
        assert h["queued_task_id"] is None and h["queued_ttl"] is None
    finally:
        lock.release_all()


def test_without_markers_the_table_keeps_its_columns(env):
    lock, _ = hold(env, "job:alone")
    try:
        proc = cli(env, "ls")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0].split() == [f.upper() for f in SUMMARY_FIELDS]
        (row,) = json.loads(cli(env, "ls", "--json").stdout)
        assert (row["queued_task_id"], row["queued_ttl"]) == (None, None)
    finally:
        lock.release_all()


def _fields(text: str) -> dict[str, str]:
    pairs = (line.split(":", 1) for line in text.splitlines())
    return {k.strip(): v.strip() for k, v in pairs}


def test_show_has_a_queued_line(env):
    queued = queue_call(env, "s")
    lock, owner = hold(env, "job:s")
    try:
        proc = cli(env, "show", "job:s")
        assert proc.returncode == 0, proc.stderr
        fields = _fields(proc.stdout)
        assert fields["owner"] == owner
        match = re.fullmatch(r"(\S+) \(ttl ([0-9.]+)s\)", fields["queued"])
        assert match, fields["queued"]
        task_id, ttl = match.groups()
        assert task_id == queued.id and 0 < float(ttl) <= QUEUE_TTL
        shown = json.loads(cli(env, "show", "job:s", "--json").stdout)
        assert shown["queued_task_id"] == queued.id
        assert 0 < shown["queued_ttl"] <= QUEUE_TTL and shown["owner"] == owner
    finally:
        lock.release_all()
    # Queued and not held: shown (exit 0), with no hold.
    proc = cli(env, "show", "job:s")
    assert proc.returncode == 0, proc.stderr
    fields = _fields(proc.stdout)
    assert fields["held"] == "no" and fields["queued"].startswith(f"{queued.id} (ttl ")
    assert fields["redis_key"] == f"{env.prefix}:{{job:s}}"
    shown = json.loads(cli(env, "show", "job:s", "--json").stdout)
    assert shown["owner"] is None and shown["queued_task_id"] == queued.id
    # Held and not queued: "queued: -".
    lock, owner = hold(env, "job:n")
    try:
        assert _fields(cli(env, "show", "job:n").stdout)["queued"] == "-"
    finally:
        lock.release_all()
    proc = cli(env, "show", "job:none")
    assert proc.returncode == 1 and "No lock named 'job:none'" in proc.stderr


def test_top_counts_and_lists_the_queued_calls(env):
    ids = [queue_call(env, f"t{i}").id for i in range(7)]
    lock, _ = hold(env, "job:t0")
    try:
        proc = cli(env, "top", "--iterations", "1", "--interval", "0.1")
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        assert "- 1 held, 7 queued" in text.splitlines()[0]
        assert "Queued calls (queue markers, 7):" in text
        listed = [i for i in ids if i in text]
        assert len(listed) == 5 and "... and 2 more (celery dlock ls)" in text
    finally:
        lock.release_all()


def test_control_characters_in_marker_names_and_task_ids_are_escaped(env):
    evil_id = "id\x1b[31mRED\r\nFORGED\x07"
    queue_call(env, "e\x1b]0;title\x07\nFORGED ROW", task_id=evil_id)
    runs = {"ls": cli(env, "ls"),
            "show": cli(env, "show", "job:e\x1b]0;title\x07\nFORGED ROW"),
            "top": cli(env, "top", "--iterations", "1", "--interval", "0.1")}
    for what, proc in runs.items():
        assert proc.returncode == 0, (what, proc.stderr)
        out = proc.stdout + proc.stderr
        assert not _RAW.search(out), (what, out)
        assert "FORGED ROW" not in [line.strip() for line in out.splitlines()]
        assert "id\\x1b[31mRED\\r\\nFORGED\\x07" in out, what
    (row,) = json.loads(cli(env, "ls", "--json").stdout)
    assert row["queued_task_id"] == evil_id
    assert row["key"] == "job:e\x1b]0;title\x07\nFORGED ROW"


def test_a_foreign_key_where_a_marker_would_be_is_skipped(env):
    queued = queue_call(env, "ok")
    env.r.hset(f"{env.prefix}:{{job:foreign}}:m", "x", "1")  # another program's hash
    env.r.set(f"{env.prefix}:{{\xff}}:m".encode("latin-1"), "x")  # not UTF-8
    env.r.set(f"{env.prefix}:{{job:bin}}:m", b"\xff\xfe")  # a value that is not UTF-8
    proc = cli(env, "ls", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    shown = [(row["key"], row["queued_task_id"]) for row in rows]
    assert shown == [("job:ok", queued.id)]
