"""``lock_limit=N`` on real prefork workers: never more than N bodies of one key at
once, N reached, every call run; with the ``wait`` and ``retry`` policies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery.result import ResultSet
from worker_harness import Harness, open_harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.mark.parametrize("policy", ["wait", "retry"])
def test_twelve_calls_on_five_processes_run_three_at_a_time(harness: Harness,
                                                            policy: str) -> None:
    h = harness
    h.start_workers(count=1, concurrency=5)
    task = h.app.tasks[f"pf.slot_{policy}"]
    key = f"k-{policy}"
    fences = ResultSet([task.delay(key, 0.6) for _ in range(12)]).get(
        timeout=120, interval=0.05)
    base = f"{h.dp}:slots:{key}"
    assert int(h.r.get(f"{base}:peak") or 0) == 3, "never more than 3, and 3 reached"
    assert int(h.r.get(f"{base}:inside") or 0) == 0
    assert h.r.llen(f"{base}:runs") == 12
    assert len(set(fences)) == 12, "each hold has its own fence"
    assert h.lock_keys_left() == []
