"""The Celery app that ``tests/test_prefork.py`` runs in real ``celery worker``
subprocesses (prefork pool).

The worker imports this module as ``tests.prefork_app`` and builds its app from the
environment (:data:`ENV_URL`, :data:`ENV_PREFIX`, :data:`ENV_QUEUE`); the test process
calls :func:`make_app` with the same values to send tasks and read results, so both
sides agree on task names, the queue (one per test: tests never take each other's
messages) and the lock key prefix (one per test).

Tasks record what they did under ``<prefix>-data:...`` in the same Redis, away from the
lock keys (``<prefix>:...``), so a test can list the lock keys left behind with one
``SCAN``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery.utils.nodenames import host_format

from celery_dlock import LockedTask

try:  # the worker imports this module as tests.prefork_app, pytest as prefork_app
    from tests.celery_helpers import test_app
    from tests.prefork_compat_tasks import register as _register_compat_tasks
    from tests.prefork_fault_tasks import register as _register_fault_tasks
    from tests.prefork_mode_tasks import register as _register_mode_tasks
    from tests.prefork_rate_tasks import register as _register_rate_tasks
    from tests.prefork_semaphore_tasks import register as _register_semaphore_tasks
except ImportError:
    from celery_helpers import test_app
    from prefork_compat_tasks import register as _register_compat_tasks
    from prefork_fault_tasks import register as _register_fault_tasks
    from prefork_mode_tasks import register as _register_mode_tasks
    from prefork_rate_tasks import register as _register_rate_tasks
    from prefork_semaphore_tasks import register as _register_semaphore_tasks

ENV_URL = "DLOCK_PF_REDIS_URL"
ENV_PREFIX = "DLOCK_PF_PREFIX"
ENV_QUEUE = "DLOCK_PF_QUEUE"
#: The worker's node name as given to ``-n`` (``%h`` not yet expanded).
ENV_NODE = "DLOCK_PF_NODE"
#: JSON object of extra ``app.conf`` settings for the worker (fault tests).
ENV_CONF = "DLOCK_PF_CONF"

_clients: dict[int, redis.Redis] = {}
_config: dict[str, str] = {}


def data_prefix(prefix: str) -> str:
    return f"{prefix}-data"


def data() -> redis.Redis:
    """This process's client for the tasks' own records (rebuilt in a forked child)."""
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        client = _clients[pid] = redis.Redis.from_url(_config["url"], socket_timeout=30)
    return client


def _record(key: str, **fields: Any) -> None:
    data().rpush(key, json.dumps(fields))


class FlakyError(Exception):
    """What ``pf.autoretrying`` raises until its last attempt."""


def make_app(url: str, prefix: str, queue: str) -> Celery:
    """An app whose broker, result backend and lock store are the test Redis."""
    _config["url"] = url
    dp = data_prefix(prefix)
    app: Celery = test_app(
        "prefork_app", url, queue=queue, prefix=prefix,
        dlock_url=url,
        # Contention retries (after a wait runs out) come back quickly and keep coming.
        dlock_retry_backoff=0.01,
        dlock_retry_backoff_max=0.2,
        dlock_retry_max=10_000,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        worker_hijack_root_logger=True,
    )
    app.conf.update(json.loads(os.environ.get(ENV_CONF) or "{}"))

    # -- inventory: read stock, pause, write stock - 1 ---------------------------------

    def buy(product_id: str) -> bool:
        r = data()
        base = f"{dp}:inv:{product_id}"
        if r.incr(f"{base}:inside") > 1:
            r.incr(f"{base}:overlaps")
        stock = int(r.get(f"{base}:stock") or 0)
        time.sleep(0.002)
        bought = stock > 0
        if bought:
            r.set(f"{base}:stock", stock - 1)
            r.incr(f"{base}:sold")
        r.decr(f"{base}:inside")
        return bought

    @app.task(shared=False, name="pf.buy_plain")
    def buy_plain(product_id: str) -> bool:
        return buy(product_id)

    @app.task(shared=False, name="pf.buy_locked", base=LockedTask, bind=True,
              lock_key="stock:{product_id}", on_contention="wait", lock_wait=60)
    def buy_locked(self: Any, product_id: str) -> bool:
        return buy(product_id)

    # -- runs recorded as intervals ----------------------------------------------------

    @app.task(shared=False, name="pf.interval", base=LockedTask, bind=True,
              lock_key="iv:{key}", lock_ttl=1, on_contention="wait", lock_wait=30)
    def interval(self: Any, key: str, seconds: float) -> float:
        start = time.time()
        fence = self.lock.fence
        time.sleep(seconds)
        end = time.time()
        _record(f"{dp}:iv:{key}", start=start, end=end, task_id=self.request.id,
                pid=os.getpid(), fence=fence, owned=self.lock.owned(),
                lost=self.lock.lost)
        return end - start

    # -- long holds, to be killed ------------------------------------------------------

    def hold_body(task: Any, key: str, seconds: float) -> float:
        lock = task.lock
        owner = data().hget(lock.keys.lock, "owner")
        start = time.time()
        _record(f"{dp}:hold:{key}", event="start", time=start, task_id=task.request.id,
                pid=os.getpid(), fence=lock.fence,
                owner=owner.decode() if owner else None)
        time.sleep(seconds)
        end = time.time()
        _record(f"{dp}:hold:{key}", event="end", time=end, task_id=task.request.id,
                pid=os.getpid(), owned=lock.owned(), lost=lock.lost)
        return end - start

    @app.task(shared=False, name="pf.hold", base=LockedTask, bind=True,
              lock_key="hold:{key}", lock_ttl=10, on_contention="wait", lock_wait=60)
    def hold(self: Any, key: str, seconds: float) -> float:
        return hold_body(self, key, seconds)

    @app.task(shared=False, name="pf.hold_limited", base=LockedTask, bind=True,
              lock_key="hold:{key}", lock_ttl=10, on_contention="wait", lock_wait=60,
              time_limit=1)
    def hold_limited(self: Any, key: str, seconds: float) -> float:
        return hold_body(self, key, seconds)

    # -- retries from inside a locked task ---------------------------------------------

    def retry_record(task: Any, kind: str, key: str) -> None:
        lock = task.lock
        _record(f"{dp}:{kind}:{key}", retries=task.request.retries,
                task_id=task.request.id, pid=os.getpid(), fence=lock.fence,
                owned=lock.owned(), time=time.time())

    @app.task(shared=False, name="pf.retrying", base=LockedTask, bind=True,
              lock_key="retry:{key}", lock_ttl=30, on_contention="wait", lock_wait=30,
              max_retries=10)
    def retrying(self: Any, key: str, times: int) -> int:
        retry_record(self, "retry", key)
        if self.request.retries < times:
            raise self.retry(countdown=0)
        return int(self.request.retries)

    @app.task(shared=False, name="pf.autoretrying", base=LockedTask, bind=True,
              lock_key="retry:{key}", lock_ttl=30, on_contention="wait", lock_wait=30,
              autoretry_for=(FlakyError,), retry_backoff=False,
              retry_kwargs={"countdown": 0, "max_retries": 10})
    def autoretrying(self: Any, key: str, times: int) -> int:
        retry_record(self, "autoretry", key)
        if self.request.retries < times:
            raise FlakyError(f"attempt {self.request.retries}")
        return int(self.request.retries)

    _register_fault_tasks(app, dp, _record)
    _register_mode_tasks(app, dp, _record)
    _register_compat_tasks(app, dp, _record)
    _register_rate_tasks(app, dp, _record, data)
    _register_semaphore_tasks(app, dp, _record, data)
    return app


def _connect_markers(prefix: str) -> None:
    """Readiness markers the test polls: one per started worker, one per child."""
    dp = data_prefix(prefix)

    def on_process_init(sender: Any = None, **_: Any) -> None:
        # Celery before 5.6 sends this signal without the node name: the harness gives
        # the worker's -n value in the environment, expanded here as Celery does.
        node = sender or host_format(os.environ.get(ENV_NODE, ""))
        data().incr(f"{dp}:children:{node}")

    def on_ready(sender: Any = None, **_: Any) -> None:
        data().sadd(f"{dp}:ready", str(sender.hostname))

    signals.worker_process_init.connect(on_process_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)


if os.environ.get(ENV_URL):  # the worker subprocess
    app = make_app(os.environ[ENV_URL], os.environ[ENV_PREFIX], os.environ[ENV_QUEUE])
    _connect_markers(os.environ[ENV_PREFIX])
