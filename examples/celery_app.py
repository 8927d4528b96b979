"""The Celery app the examples share: one Redis for broker, results and locks.

``REDIS_URL`` (default ``redis://localhost:6379/0``) names that Redis.  The app
includes every example, so a worker started on any of them
(``celery -A examples.inventory worker``) runs the tasks of all of them: one fleet of
workers serves both the producer and the beat of ``docker-compose.yml``.

The runners (``python examples/NAME.py``) start their own redis-server and call
:func:`use_redis` before anything connects.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

__all__ = ["EXAMPLES", "app", "data", "use_redis", "wait_for_signal"]

EXAMPLES = (
    "examples.inventory",
    "examples.once_per_period",
    "examples.long_task_fencing",
    "examples.nested_reentry",
)

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379/0")

app = Celery("examples", broker=REDIS_URL, backend=REDIS_URL, include=list(EXAMPLES))
app.conf.update(
    # An idle worker notices new messages within 0.1 s (kombu's default is 1 s).
    broker_transport_options={"polling_interval": 0.1},
    # One message per free process: a busy process never sits on a waiting buyer.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    # The lock settings every example shares; each task sets its own ttl and policy.
    dlock_key_prefix="dlock",
)

_data: dict[int, redis.Redis] = {}


def use_redis(url: str) -> None:
    """Point the app (broker, results, locks) and :func:`data` at ``url``."""
    app.conf.update(broker_url=url, result_backend=url)
    os.environ["REDIS_URL"] = url
    _data.clear()


def data() -> redis.Redis:
    """This process's client for the examples' own records (stock, reports, ...)."""
    pid = os.getpid()
    client = _data.get(pid)
    if client is None:
        url = app.conf.broker_url or REDIS_URL
        client = _data[pid] = redis.Redis.from_url(url, socket_timeout=30,
                                                    decode_responses=True)
    return client


def wait_for_signal(key: str, task: Any, timeout: float = 20.0) -> bool:
    """Pop one item pushed to the list ``key``; False if ``task`` ended first or time
    ran out (so a task that failed is reported at once, not after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if data().blpop([key], timeout=0.5) is not None:
            return True
        if task.ready():
            return False
    return False
