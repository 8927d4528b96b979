"""Tasks for the enqueue-time uniqueness tests on real workers
(tests/integration/test_modes.py), registered on the app of :mod:`prefork_app`.

``pf.mode`` records each run (its tag, arguments, start and end) under
``<prefix>-data:mode:<key>``; its lock_mode and on_duplicate come per call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_dlock import LockedTask
from celery_dlock.core.registry import MARKERS, entry_for


def register(app: Celery, dp: str, record: Callable[..., None]) -> None:
    entry = entry_for(app.conf.get("dlock_url"))
    if entry is not None and not entry.can(MARKERS):
        return  # a test of a backend that keeps no queue markers (its workers would
        # refuse these tasks' lock_mode when they start)
    @app.task(shared=False, name="pf.mode", base=LockedTask, bind=True,
              lock_key="mode:{key}", lock_ttl=3, on_contention="wait", lock_wait=60,
              lock_mode="until_finished")
    def mode(self: Any, key: str, seconds: float, tag: str) -> str:
        start = time.time()
        record(f"{dp}:mode-start:{key}", tag=tag, start=start, task_id=self.request.id)
        time.sleep(seconds)
        record(f"{dp}:mode:{key}", tag=tag, start=start, end=time.time(),
               task_id=self.request.id, pid=os.getpid())
        return tag

    @app.task(shared=False, name="pf.mode_retry", base=LockedTask, bind=True,
              lock_key="mode:{key}", lock_ttl=3, on_contention="wait", lock_wait=60,
              lock_mode="until_finished", max_retries=3)
    def mode_retry(self: Any, key: str, seconds: float, tag: str,
                   retry_in: float | None = None) -> str:
        """``pf.mode``, which asks for one retry (in ``retry_in`` seconds) after its
        first attempt when ``retry_in`` is given."""
        start = time.time()
        attempt = self.request.retries
        record(f"{dp}:mode-start:{key}", tag=tag, start=start, attempt=attempt,
               task_id=self.request.id)
        time.sleep(seconds)
        record(f"{dp}:mode:{key}", tag=tag, start=start, end=time.time(),
               attempt=attempt, task_id=self.request.id, pid=os.getpid())
        if retry_in is not None and attempt == 0:
            raise self.retry(countdown=retry_in)
        return tag

    @app.task(shared=False, name="pf.lock_state", base=LockedTask, bind=True,
              lock_key="state:{key}", on_contention="raise",
              lock_mode="until_finished", on_duplicate="raise")
    def lock_state(self: Any, key: str) -> dict[str, Any]:
        """What the body sees of its lock (dlock_enabled=False: none)."""
        return {"key": key, "lock_is_none": self.lock is None, "pid": os.getpid()}
