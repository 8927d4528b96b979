"""Tasks for the migration tests on real workers (tests/integration/test_compat.py),
registered on the app of :mod:`prefork_app`: the peers' README examples, written as
their users write them, with only the import changed.

Each run is recorded (its task name, arguments, start and end) under
``<prefix>-data:compat:<task name>``; a start also under ``...:compat-start:...``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_dlock import LockedTask
from celery_dlock.compat import QueueOnce, Singleton
from celery_dlock.core.registry import MARKERS, entry_for


def register(app: Celery, dp: str, record: Callable[..., None]) -> None:
    entry = entry_for(app.conf.get("dlock_url"))
    if entry is not None and not entry.can(MARKERS):
        return  # a test of a backend that keeps no queue markers (its workers would
        # refuse these tasks' lock_mode when they start)
    def run(task: Any, seconds: float, **fields: Any) -> None:
        start = time.time()
        record(f"{dp}:compat-start:{task.name}", start=start, task_id=task.request.id,
               **fields)
        time.sleep(seconds)
        record(f"{dp}:compat:{task.name}", start=start, end=time.time(),
               task_id=task.request.id, pid=os.getpid(), **fields)

    # -- celery-once's README ------------------------------------------------------

    @app.task(shared=False, name="pf.slow_task", base=QueueOnce, bind=True)
    def slow_task(self: Any, seconds: float = 1.0) -> str:
        run(self, seconds)
        return "Done!"

    @app.task(shared=False, name="pf.graceful_task", base=QueueOnce, bind=True,
              once={"graceful": True})
    def graceful_task(self: Any, seconds: float = 1.0) -> str:
        run(self, seconds)
        return "Done!"

    @app.task(shared=False, name="pf.slow_add", base=QueueOnce, bind=True,
              once={"keys": ["a"]})
    def slow_add(self: Any, a: int, b: int) -> int:
        run(self, 0.0, a=a, b=b)
        return a + b

    @app.task(shared=False, name="pf.slow_add_any", base=QueueOnce, bind=True,
              once={"keys": []})
    def slow_add_any(self: Any, a: int, b: int) -> int:
        run(self, 0.0, a=a, b=b)
        return a + b

    @app.task(shared=False, name="pf.long_running_task", base=QueueOnce, bind=True,
              once={"timeout": 2})
    def long_running_task(self: Any, tag: str = "") -> str:
        run(self, 0.0, tag=tag)
        return tag

    @app.task(shared=False, name="pf.unlock_task", base=QueueOnce, bind=True,
              once={"unlock_before_run": True})
    def unlock_task(self: Any, seconds: float, tag: str = "") -> str:
        run(self, seconds, tag=tag)
        return tag

    # -- celery-singleton's README ---------------------------------------------------

    @app.task(shared=False, name="pf.do_stuff", base=Singleton, bind=True)
    def do_stuff(self: Any, *args: Any, **kwargs: Any) -> str:
        run(self, float(kwargs.get("seconds", 0.0)), args=list(args))
        return "I just woke up"

    @app.task(shared=False, name="pf.do_something", base=Singleton, bind=True,
              unique_on=["username"])
    def do_something(self: Any, username: str, otherarg: Any = None) -> str:
        run(self, 0.0, username=username, otherarg=otherarg)
        return username

    @app.task(shared=False, name="pf.do_something_raising", base=Singleton, bind=True,
              raise_on_duplicate=True)
    def do_something_raising(self: Any, username: str) -> str:
        run(self, 0.0, username=username)
        return username

    @app.task(shared=False, name="pf.expiring", base=Singleton, bind=True,
              lock_expiry=30)
    def expiring(self: Any, tag: str) -> str:
        run(self, 0.0, tag=tag)
        return tag

    # -- clear_locks -----------------------------------------------------------------

    @app.task(shared=False, name="pf.compat_hold", base=Singleton, bind=True,
              lock_key="chold:{key}", lock_ttl=60)
    def compat_hold(self: Any, key: str, seconds: float) -> str:
        run(self, seconds, item=key)
        return key

    # Renewed every 4/3 s; its holder's deadline comes 2 s after its last renewal
    # (a pause budget of 2 s), its expiry 4 s after.
    @app.task(shared=False, name="pf.compat_short", base=Singleton, bind=True,
              lock_key="cshort:{key}", lock_ttl=4, lock_pause_budget=2)
    def compat_short(self: Any, key: str, seconds: float) -> str:
        run(self, seconds, item=key)
        return key

    @app.task(shared=False, name="pf.compat_throttle", base=LockedTask, bind=True,
              lock_key="cthr:{key}", lock_ttl=60, lock_mode="throttle")
    def compat_throttle(self: Any, key: str) -> str:
        run(self, 0.0, item=key)
        return key
