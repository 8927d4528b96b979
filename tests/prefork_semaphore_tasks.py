"""Tasks for the semaphore tests on real workers
(tests/integration/test_semaphore_workers.py), registered on the app of
:mod:`prefork_app`.

``pf.slot_wait`` and ``pf.slot_retry`` take one of ``lock_limit=3`` slots of one key
(contention policy ``wait``, ``retry``), count the bodies running at once in Redis
(``<prefix>-data:slots:<key>:inside``, the peak in ``...:peak``) and record each run;
``pf.slot_hold`` holds one of 2 slots (ttl 10 s) for a while, to be killed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_dlock import LockedTask

#: Raise the peak to ``inside`` when it is higher (one atomic step).
_PEAK = """
local n = tonumber(redis.call('GET', KEYS[1]) or 0)
if n > tonumber(redis.call('GET', KEYS[2]) or 0) then redis.call('SET', KEYS[2], n) end
return n
"""


def register(app: Celery, dp: str, record: Callable[..., None],
             data: Callable[[], redis.Redis]) -> None:
    if str(app.conf.get("dlock_url") or "").startswith("redlock"):
        return  # Redlock keeps no semaphores
    def body(task: Any, key: str, seconds: float) -> int:
        r = data()
        base = f"{dp}:slots:{key}"
        r.incr(f"{base}:inside")
        r.eval(_PEAK, 2, f"{base}:inside", f"{base}:peak")
        fence = task.lock.fence
        time.sleep(seconds)
        r.decr(f"{base}:inside")
        record(f"{base}:runs", task_id=task.request.id, pid=os.getpid(), fence=fence)
        return int(fence)

    @app.task(shared=False, name="pf.slot_wait", base=LockedTask, bind=True,
              lock_key="slots:{key}", lock_limit=3, lock_ttl=5, on_contention="wait",
              lock_wait=60)
    def slot_wait(self: Any, key: str, seconds: float) -> int:
        return body(self, key, seconds)

    @app.task(shared=False, name="pf.slot_retry", base=LockedTask, bind=True,
              lock_key="slots:{key}", lock_limit=3, lock_ttl=5, on_contention="retry")
    def slot_retry(self: Any, key: str, seconds: float) -> int:
        return body(self, key, seconds)

    @app.task(shared=False, name="pf.slot_hold", base=LockedTask, bind=True,
              lock_key="slots:{key}", lock_limit=2, lock_ttl=10, on_contention="wait",
              lock_wait=60)
    def slot_hold(self: Any, key: str, seconds: float) -> int:
        record(f"{dp}:slots:{key}:holding", task_id=self.request.id, pid=os.getpid(),
               fence=self.lock.fence)
        time.sleep(seconds)
        return os.getpid()
