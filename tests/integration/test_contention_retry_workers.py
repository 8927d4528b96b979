"""Contention retries on real ``celery worker`` processes: an attempt that meets a held
lock is re-queued with a countdown (an ETA message) and runs once the lock is free.

The in-process test worker of ``celery.contrib.testing`` covers the same in
tests/integration/test_task.py; before Celery 5.7 that worker never runs an ETA
message once an earlier test used it, so at the dependency floors (``.ci/floors``) this
file is what shows the retries work on every pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from worker_harness import Harness, open_harness

from celery_dlock import RedisLock

pytestmark = pytest.mark.slow


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_a_retried_attempt_runs_once_the_lock_is_free(harness: Harness, r: redis.Redis,
                                                      pool: str) -> None:
    h = harness
    h.start_workers(count=1, concurrency=2, pool=pool)
    key = f"retry-{pool}"
    held = RedisLock(r, f"hold:{key}", prefix=h.prefix, owner="the-test", ttl=30,
                     auto_renew=False)
    assert held.acquire(blocking=False)
    result = h.app.tasks["pf.hold"].apply_async((key, 0.0), headers={
        "on_contention": "retry", "lock_retry_backoff": 0.05,
        "lock_retry_backoff_max": 0.1})
    time.sleep(1.5)
    assert h.hold_event(key, "start") is None, "the body ran while the lock was held"
    released_at = time.time()
    held.release()
    assert result.get(timeout=30) >= 0.0
    start = h.hold_event(key, "start")
    assert start is not None and start["time"] >= released_at
