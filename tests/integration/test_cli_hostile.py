"""``celery dlock`` shows what it reads safely: control characters in lock names, owners,
task names, workers and reasons never reach the terminal (escaped), ``--json`` keeps
the raw values, and another program's binary key under the prefix crashes nothing."""

from __future__ import annotations

import json
import re

import cli_app
import redis

from celery_dlock import RedisLock

# ESC (a colour), BEL, BS, CR, a newline that would forge a row, DEL and a C1 control.
EVIL_NAME = "job\x1b[31mRED\x07\x08\r\nFORGED ROW\x7f\x9b"
EVIL_WORKER = "w\x1b]0;title\x07"
_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # every control character but \n


def _lock(r: redis.Redis, prefix: str) -> RedisLock:
    lock = RedisLock(r, EVIL_NAME, ttl=60, auto_renew=False, prefix=prefix,
                     owner="own\x1b[2Jer", info={"worker": EVIL_WORKER,
                                                  "task_name": "t\x1b[1m"})
    assert lock.acquire(blocking=False)
    return lock


def test_control_characters_never_reach_the_terminal(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    lock = _lock(r, prefix)
    r.hset(f"{prefix}:{{\xff\xfe}}".encode("latin-1"), "owner", b"\xff")  # not UTF-8
    try:
        runs = {
            "ls": cli_app.run_cli(redis_url, prefix, "ls"),
            "show": cli_app.run_cli(redis_url, prefix, "show", EVIL_NAME),
            "top": cli_app.run_cli(redis_url, prefix, "top", "--iterations", "1",
                                   "--interval", "0.1"),
            "release": cli_app.run_cli(redis_url, prefix, "release", EVIL_NAME,
                                       "--force", "--reason", "bad\x1b[5mreason"),
        }
        for what, proc in runs.items():
            assert proc.returncode == 0, (what, proc.stderr)
            out = proc.stdout + proc.stderr
            assert not _RAW.search(out), (what, out)
            assert "FORGED ROW" not in [line.strip() for line in out.splitlines()]
        (row,) = [line for line in runs["ls"].stdout.splitlines()
                  if line.startswith("job")]
        assert "\\x1b[31mRED\\x07" in row and "\\n" in row
        assert "\\x1b" in runs["release"].stdout
    finally:
        lock.release_all()
        r.close()


def test_json_keeps_the_raw_values_and_a_binary_key_is_skipped(redis_url, prefix):
    r = redis.Redis.from_url(redis_url)
    lock = _lock(r, prefix)
    other = RedisLock(r, "plain", ttl=60, auto_renew=False, prefix=prefix)
    assert other.acquire(blocking=False)
    r.hset(f"{prefix}:{{\xff}}".encode("latin-1"), "owner", "x")
    try:
        proc = cli_app.run_cli(redis_url, prefix, "ls", "--json")
        assert proc.returncode == 0, proc.stderr
        keys = sorted(row["key"] for row in json.loads(proc.stdout))
        assert keys == sorted([EVIL_NAME, "plain"])
        shown = json.loads(cli_app.run_cli(redis_url, prefix, "show", EVIL_NAME,
                                           "--json").stdout)
        assert shown["worker"] == EVIL_WORKER and shown["owner"] == "own\x1b[2Jer"
    finally:
        lock.release_all()
        other.release_all()
        r.close()
