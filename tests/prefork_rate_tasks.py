"""Tasks for the ``lock_rate`` tests on real workers (tests/integration/test_rate.py),
registered on the app of :mod:`prefork_app`.

``pf.rated`` records each start (the Redis server's time, its task id, retries and
node) under ``<prefix>-data:rated:<key>``; ``pf.rated_slow`` (1/s) likewise, under
``<prefix>-data:rated_slow:<key>``, then holds its lock ``seconds``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_dlock import LockedTask
from celery_dlock.core.registry import RATES, entry_for


def register(app: Celery, dp: str, record: Callable[..., None],
             data: Callable[[], Any]) -> None:
    entry = entry_for(app.conf.get("dlock_url"))
    if entry is None or not entry.can(RATES):
        return  # a test of another backend (one that keeps no rates)

    @app.task(shared=False, name="pf.rated", base=LockedTask, bind=True,
              lock_key="rated:{key}", lock_rate="5/s", max_retries=0)
    def rated(self: Any, key: str, n: int) -> int:
        secs, usecs = data().time()
        record(f"{dp}:rated:{key}", n=n, start=secs + usecs / 1e6,
               task_id=self.request.id, retries=self.request.retries,
               node=self.request.hostname or socket.gethostname())
        return n

    @app.task(shared=False, name="pf.rated_slow", base=LockedTask, bind=True,
              lock_key="rated_slow:{key}", lock_rate="1/s", max_retries=0)
    def rated_slow(self: Any, key: str, n: int, seconds: float) -> int:
        secs, usecs = data().time()
        record(f"{dp}:rated_slow:{key}", n=n, start=secs + usecs / 1e6,
               task_id=self.request.id)
        time.sleep(seconds)
        return n
