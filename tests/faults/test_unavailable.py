"""Redis unreachable: every operation fails fast and closed with BackendUnavailable."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from dlock_helpers import closed_port, fast_failing_client

from celery_dlock import BackendUnavailable, DLockError, RedisLock

BOUND = 5.0  # generous: each call below fails on a refused connection


@pytest.fixture
def dead_client() -> redis.Redis:
    client = fast_failing_client(closed_port())
    yield client
    client.close()


OPERATIONS: dict[str, Callable[[RedisLock], object]] = {
    "acquire": lambda lock: lock.acquire(),
    "acquire-nonblocking": lambda lock: lock.acquire(blocking=False),
    "acquire-timeout": lambda lock: lock.acquire(timeout=1),
    "release": lambda lock: lock.release(),
    "extend": lambda lock: lock.extend(),
    "owned": lambda lock: lock.owned(),
    "locked": lambda lock: lock.locked(),
    "ensure_held": lambda lock: lock.ensure_held(),
    "holder": lambda lock: lock.holder(),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_operation_raises_backend_unavailable_quickly(dead_client, prefix, name,
                                                      operation):
    lock = RedisLock(dead_client, name, prefix=prefix)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        OPERATIONS[operation](lock)
    assert time.monotonic() - started < BOUND
    err = info.value
    assert isinstance(err, DLockError)
    assert err.lock_name == name
    assert name in str(err)
    assert isinstance(err.__cause__, redis.exceptions.ConnectionError)
    assert lock.depth == 0 and lock.fence is None


def test_context_manager_fails_closed(dead_client, prefix, name):
    ran = False
    with pytest.raises(BackendUnavailable), RedisLock(dead_client, name, prefix=prefix):
        ran = True
    assert not ran


def test_timeout_from_a_frozen_server_is_backend_unavailable(prefix, name):
    # A listener that accepts connections but never answers: a socket timeout.
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        client = fast_failing_client(server.getsockname()[1], timeout=0.3)
        lock = RedisLock(client, name, prefix=prefix)
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as info:
            lock.acquire(blocking=False)
        assert time.monotonic() - started < BOUND
        assert isinstance(info.value.__cause__, redis.exceptions.TimeoutError)
        client.close()
