"""The lock over a unix socket: ``unix:///path/redis.sock?db=0``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from task_helpers import check_runs, run_locked_task

from celery_dlock import RedisLock
from celery_dlock.ops.embedded import EmbeddedRedis
from celery_dlock.task.config import get_client


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(unix_socket=True) as s:
        yield s


def _url(server: EmbeddedRedis) -> str:
    return f"unix://{server.unix_socket_path}?db=0"


def test_redis_lock_over_a_unix_socket(server):
    client = get_client(_configured(server))
    assert client.connection_pool.connection_kwargs["path"] == server.unix_socket_path
    prefix = f"dlu{uuid.uuid4().hex[:8]}"
    a = RedisLock(client, "job", ttl=5, owner="A", prefix=prefix)
    b = RedisLock(client, "job", ttl=5, owner="B", prefix=prefix)
    with a:
        assert not b.acquire(blocking=False)
        over_tcp = redis.Redis.from_url(server.url)
        assert over_tcp.hget(a.keys.lock, "owner") == b"A"
        over_tcp.close()
    assert b.acquire(blocking=False)
    b.release()


def _configured(server: EmbeddedRedis) -> Celery:
    app = Celery(f"dlu{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.dlock_url = _url(server)
    return app


def test_locked_task_over_a_unix_socket(server, redis_url):
    probe = redis.Redis.from_url(server.url)
    try:
        check_runs(run_locked_task(redis_url, probe, dlock_url=_url(server)))
    finally:
        probe.close()
