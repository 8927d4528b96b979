"""A force release re-sent after its reply was lost changes nothing the second time.

redis-py re-sends a command whose reply it did not get.  ``celery dlock release``
(:func:`celery_dlock.backends.redis.inspect.force_release`) names the hold it read
(its fence) and
carries an operation id, so when another owner took the lock between the first
execution and the re-send, that newer hold is left alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis.backoff
import redis.retry
from proxy import FaultProxy

from celery_dlock import RedisLock
from celery_dlock.backends.redis.inspect import force_release
from celery_dlock.backends.redis.keyspace import LockKeys
from celery_dlock.backends.redis.scripts import FORCE_RELEASE
from celery_dlock.ops.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow


def test_resent_force_release_leaves_the_next_hold_alone(own_server: EmbeddedRedis,
                                                         proxy: FaultProxy, prefix: str,
                                                         name: str) -> None:
    direct = redis.Redis.from_url(own_server.url, socket_timeout=10)
    direct.script_load(FORCE_RELEASE.source)  # EVALSHA: what the proxy matches on
    first = RedisLock(direct, name, ttl=30, prefix=prefix, auto_renew=False,
                      owner="first")
    assert first.acquire(blocking=False)
    second = RedisLock(direct, name, ttl=30, prefix=prefix, auto_renew=False,
                       owner="second")
    # As soon as the first send has freed the lock, another owner takes it; the
    # operator's client meanwhile waits for a reply that never comes, and re-sends.
    matched = proxy.drop_reply(FORCE_RELEASE.sha.encode())
    took = threading.Event()

    def take() -> None:
        if not matched.wait(10):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if second.acquire(blocking=False):
                took.set()
                return
            time.sleep(0.005)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    operator = redis.Redis.from_url(
        proxy.url, socket_timeout=1.0, socket_connect_timeout=1.0,
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 2))
    freed = force_release(operator, prefix, name)
    taker.join(10)
    assert matched.is_set() and took.is_set()
    assert freed is not None and freed.owner == "first"
    assert second.owned(), "the re-sent release freed the newer hold"
    assert direct.hget(LockKeys.for_name(prefix, name).lock, "owner") == b"second"
    second.release()
    operator.close()
    direct.close()


def test_resent_call_with_the_same_operation_id_changes_nothing(r: redis.Redis,
                                                                prefix: str, name: str
                                                                ) -> None:
    key = LockKeys.for_name(prefix, name).lock
    first = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False, owner="first")
    assert first.acquire(blocking=False)
    fence = str(first.fence)
    args = ("fence", fence, ":by", "op@box", ":reason", "why", ":op", "0123456789abcdef")
    assert int(FORCE_RELEASE(r, (key,), args)[0]) == 1
    second = RedisLock(r, name, ttl=30, prefix=prefix, auto_renew=False, owner="second")
    assert second.acquire(blocking=False)
    again = FORCE_RELEASE(r, (key,), args)  # the same call, sent again
    assert int(again[0]) == 2
    assert second.owned()
    # Even without a fence, the operation id alone keeps the re-send harmless.
    assert int(FORCE_RELEASE(r, (key,), args[2:])[0]) == 2
    assert second.owned()
    second.release()
