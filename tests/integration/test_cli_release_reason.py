"""``celery dlock release --reason``: who released which lock, and why, is recorded."""

from __future__ import annotations

import uuid

import cli_app
import redis

from celery_dlock import RedisLock
from celery_dlock.task.events import recent_events


def test_forced_release_records_who_and_why(redis_url: str) -> None:
    prefix = f"dlreason{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    lock = RedisLock(r, "job:7", ttl=60, auto_renew=False, prefix=prefix,
                     info={"task_name": "shop.sync", "task_id": "t-123"})
    assert lock.acquire(blocking=False)
    try:
        proc = cli_app.run_cli(redis_url, prefix, "release", "job:7", "--force",
                    "--reason", "worker host died, ticket 42")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Released lock 'job:7'" in proc.stdout
        assert not lock.owned()
        # the log line
        assert "released by" in proc.stderr and "ticket 42" in proc.stderr, proc.stderr
        # the event, as top shows it
        (event,) = [e for e in recent_events(r, prefix) if e.kind == "released"]
        assert event.key == "job:7" and event.detail == "worker host died, ticket 42"
        assert event.holder_task_id == "t-123" and event.holder_task_name == "shop.sync"
        assert event.worker and "@" in event.worker
        top = cli_app.run_cli(redis_url, prefix, "top", "--iterations", "1",
                              "--interval", "0.1")
        assert top.returncode == 0, top.stderr
        assert "released" in top.stdout and "ticket 42" in top.stdout, top.stdout
    finally:
        lock.release_all()
        r.delete(f"{prefix}:events")
        r.close()
