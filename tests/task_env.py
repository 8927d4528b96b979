"""An app on the session's Redis with its own queue and key prefix, for the task fault
tests that run an in-process worker (threads pool)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import RedisLock


@dataclass
class TaskEnv:
    app: Celery
    r: redis.Redis
    prefix: str
    tasks: dict[str, Any] = field(default_factory=dict)

    @property
    def events_key(self) -> str:
        return f"{self.prefix}-data:events"

    def log(self, **fields: Any) -> None:
        self.r.rpush(self.events_key, json.dumps(fields))

    def events(self, **match: Any) -> list[dict[str, Any]]:
        found = [json.loads(x) for x in self.r.lrange(self.events_key, 0, -1)]
        return [e for e in found if all(e.get(k) == v for k, v in match.items())]

    def lock_key(self, name: str) -> str:
        return f"{self.prefix}:{{{name}}}"

    def hold(self, name: str, owner: str = "test-holder") -> RedisLock:
        lock = RedisLock(self.r, name, prefix=self.prefix, owner=owner,
                         info={"task_id": "holder-task"})
        assert lock.acquire(blocking=False)
        return lock


def new_app(redis_url: str, **conf: Any) -> TaskEnv:
    tag = uuid.uuid4().hex[:8]
    prefix = f"dlt{tag}"
    app = test_app(
        f"dlt{tag}", redis_url, queue=f"q-{tag}", prefix=prefix,
        dlock_retry_backoff=0.05,
        dlock_retry_backoff_max=0.2,
        dlock_retry_max=200,
        result_expires=600,
    )
    app.conf.update(conf)
    return TaskEnv(app=app, r=redis.Redis.from_url(redis_url), prefix=prefix)


@contextmanager
def running(env: TaskEnv, concurrency: int = 4) -> Iterator[TaskEnv]:
    """An in-process worker (threads pool) for ``env.app`` while the block runs."""
    try:
        with start_worker(env.app, pool="threads", concurrency=concurrency,
                          perform_ping_check=False, shutdown_timeout=20):
            yield env
    finally:
        close_app(env.app)
        env.r.close()
