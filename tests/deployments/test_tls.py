"""The lock over TLS: ``rediss://host:port/0?ssl_ca_certs=CA`` (a CA and a server
certificate made with ``openssl`` for the test: the ``tls`` fixture of conftest.py)."""

from __future__ import annotations

import uuid

import pytest
import redis
from celery import Celery
from celery_helpers import test_app
from task_helpers import check_runs, run_locked_task

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.task.config import get_client


def _app(url: str) -> Celery:
    return test_app(f"dlt{uuid.uuid4().hex[:6]}", dlock_url=url)


def test_redis_lock_over_tls(tls):
    client = get_client(_app(tls.url))
    prefix = f"dlt{uuid.uuid4().hex[:8]}"
    a = RedisLock(client, "job", ttl=5, owner="A", prefix=prefix)
    b = RedisLock(client, "job", ttl=5, owner="B", prefix=prefix)
    with a:
        assert not b.acquire(blocking=False)
        plain = redis.Redis.from_url(tls.plain)
        assert plain.hget(a.keys.lock, "owner") == b"A"  # the same server
        plain.close()
        assert a.holder() is not None
    assert b.acquire(blocking=False)
    b.release()


def test_an_unknown_certificate_authority_is_refused(tls):
    client = get_client(_app(tls.bare_url))  # verifies against the system CAs
    with pytest.raises(BackendUnavailable) as caught:
        RedisLock(client, "job", ttl=5).acquire(blocking=False)
    assert "certificate" in str(caught.value).lower()


def test_locked_task_over_tls(tls, redis_url):
    probe = redis.Redis.from_url(tls.plain)
    try:
        check_runs(run_locked_task(redis_url, probe, dlock_url=tls.url))
    finally:
        probe.close()
