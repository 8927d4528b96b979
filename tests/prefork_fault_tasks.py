"""Tasks for the fault tests on real prefork workers (retries that unwind, redelivered
messages), registered on the app of :mod:`prefork_app` by :func:`register`.

Each task records what it did under ``<prefix>-data:...`` with ``record``: a run's
start and end, the pid, and whether the run still owned its lock at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.exceptions import MaxRetriesExceededError

from celery_dlock import LockedTask

POLICIES = ("retry", "wait", "skip", "raise")


class Flaky(Exception):
    """What ``pf.autoretry_unwind`` raises on every attempt."""


def register(app: Celery, dp: str, record: Callable[..., None]) -> None:
    def run_record(task: Any, key: str, kind: str, start: float, **fields: Any) -> None:
        record(f"{dp}:runs:{key}", kind=kind, start=start, end=time.time(),
               task_id=task.request.id, retries=task.request.retries, pid=os.getpid(),
               owned=task.lock.owned(), **fields)

    # -- code after self.retry() ------------------------------------------------------

    @app.task(shared=False, name="pf.retry_unwind", base=LockedTask, bind=True,
              lock_key="unwind:{key}", lock_ttl=10, on_contention="wait", lock_wait=60,
              max_retries=1)
    def retry_unwind(self: Any, key: str, cleanup: float) -> str:
        start = time.time()
        try:
            raise self.retry(countdown=0)
        except MaxRetriesExceededError:
            time.sleep(cleanup)
            run_record(self, key, "fallback", start)
            return "fallback"
        finally:
            time.sleep(cleanup)
            run_record(self, key, "attempt", start)

    @app.task(shared=False, name="pf.autoretry_unwind", base=LockedTask, bind=True,
              lock_key="unwind:{key}", lock_ttl=10, on_contention="wait", lock_wait=60,
              autoretry_for=(Flaky,), retry_backoff=False,
              retry_kwargs={"countdown": 0, "max_retries": 1})
    def autoretry_unwind(self: Any, key: str, cleanup: float) -> str:
        start = time.time()
        try:
            raise Flaky(f"attempt {self.request.retries}")
        finally:
            time.sleep(cleanup)
            run_record(self, key, "attempt", start)

    @app.task(shared=False, name="pf.unwind_other", base=LockedTask, bind=True,
              lock_key="unwind:{key}", lock_ttl=10, on_contention="wait", lock_wait=60)
    def unwind_other(self: Any, key: str, seconds: float) -> str:
        start = time.time()
        time.sleep(seconds)
        run_record(self, key, "other", start)
        return "other"

    # -- a message redelivered while its first run is alive ----------------------------

    def redelivered_body(task: Any, key: str, seconds: float) -> dict[str, Any]:
        start = time.time()
        record(f"{dp}:starts:{key}", task_id=task.request.id, pid=os.getpid(),
               start=start)
        time.sleep(seconds)
        run_record(task, key, "run", start)
        return {"pid": os.getpid(), "start": start}

    for policy in POLICIES:
        def body(self: Any, key: str, seconds: float) -> dict[str, Any]:
            return redelivered_body(self, key, seconds)

        app.task(shared=False, name=f"pf.redelivered_{policy}", base=LockedTask,
                 bind=True, lock_key="rd:{key}", lock_ttl=10, on_contention=policy,
                 lock_wait=30, acks_late=True)(body)

    @app.task(shared=False, name="pf.recoverable", base=LockedTask, bind=True,
              lock_key="rd:{key}", lock_ttl=2, on_contention="wait", lock_wait=30)
    def recoverable(self: Any, key: str, seconds: float) -> dict[str, Any]:
        return redelivered_body(self, key, seconds)
