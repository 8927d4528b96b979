"""A LockedTask run on an in-process worker, for the deployment tests.

The broker and result backend are the session's Redis; the lock lives wherever the
``dlock_*`` settings given point (a cluster, a Sentinel master, TLS, a unix socket).
"""

from __future__ import annotations

import uuid
from typing import Any

from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import LockedTask, RedisLock


def run_locked_task(broker_url: str, probe: Any,
                    **dlock_conf: Any) -> list[dict[str, Any]]:
    """Run a LockedTask twice on one lock; each result has the task's fence and what
    ``probe`` (a client of the lock's server) saw of the hold while the body ran."""
    prefix = f"dlt{uuid.uuid4().hex[:8]}"
    app = test_app(f"dep{prefix}", broker_url, queue=f"q-{prefix}", prefix=prefix,
                   **dlock_conf)

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="dep:{x}", lock_ttl=5)
    def work(self: Any, x: str) -> dict[str, Any]:
        seen = RedisLock(probe, f"dep:{x}", prefix=prefix).holder()
        return {"fence": self.lock.fence, "owned": self.lock.owned(),
                "seen_fence": seen.fence if seen else None}

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                          shutdown_timeout=20):
            return [work.delay("x").get(timeout=30) for _ in range(2)]
    finally:
        close_app(app)


def check_runs(runs: list[dict[str, Any]]) -> None:
    first, second = runs
    for run in runs:
        assert run["owned"] and run["fence"] == run["seen_fence"], run
    assert second["fence"] > first["fence"]
