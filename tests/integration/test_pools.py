"""LockedTask on the other worker pools: threads, solo and gevent.

The same property as the prefork test of a short-ttl lock: three messages of one key,
each running longer than ``lock_ttl`` (1 s), on two workers, never overlap, and each
run still holds its lock at its end. That needs the scheduler to renew under each pool
(a thread; a greenlet under gevent's monkey-patching) and the attempt's owner to stay
apart from the other runs of the same process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from worker_harness import Harness, assert_disjoint, open_harness, spans

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.mark.parametrize(("pool", "concurrency"), [("threads", 2), ("solo", 1),
                                                   ("gevent", 4)])
def test_short_ttl_lock_is_renewed_and_exclusive(harness: Harness, pool: str,
                                                 concurrency: int) -> None:
    if pool == "gevent":
        pytest.importorskip("gevent")
    h = harness
    h.start_workers(count=2, concurrency=concurrency, pool=pool)
    interval = h.app.tasks["pf.interval"]
    key = f"pool-{pool}"
    results = [interval.delay(key, 1.6) for _ in range(3)]
    for res in results:
        res.get(timeout=60)
    runs = h.records("iv", key)
    print(f"\n{pool}: runs of a 1.6 s task with lock_ttl=1 (start, end): {spans(runs)}")
    assert len(runs) == 3
    assert_disjoint(runs)
    for run in runs:
        assert run["end"] - run["start"] >= 1.6
        assert run["owned"] is True and run["lost"] is False, run
    assert h.lock_keys_left() == []
