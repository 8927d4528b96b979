"""What a Redis semaphore adds to the semaphore contract every store keeps
(tests/integration/test_semaphore_stores.py: N holders at once, fences, re-entry,
owner-only release, expiry, a killed holder, force release), and to the lock's (a
semaphore of one slot runs every lock test: the ``semaphore`` kind of
tests/lock_kinds.py): a FIFO line woken by releases, one cluster slot, a lock of the
same name is a conflict, and the checks of ``lock_limit`` at declaration."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
from celery import Celery
from dlock_helpers import wait_until

from celery_dlock import (
    InvalidLockConfig,
    LockKeyConflict,
    RedisLock,
    RedisSemaphore,
)
from celery_dlock.backends.redis.hashtag import lock_key
from celery_dlock.core.lock_options import LockOptions


def _sem(r, name, prefix, owner, limit=3, ttl=30.0, **kw):
    return RedisSemaphore(r, name, limit, ttl, owner=owner, prefix=prefix, **kw)


def test_waiters_are_woken_in_line_by_releases(r, name, prefix):
    holders = [_sem(r, name, prefix, f"h{i}", limit=2) for i in range(2)]
    for s in holders:
        s.acquire()
    order: list[str] = []
    woke_at: dict[str, float] = {}
    done = threading.Event()

    def wait(owner: str) -> None:
        s = _sem(r, name, prefix, owner, limit=2)
        assert s.acquire(timeout=20)
        order.append(owner)
        woke_at[owner] = time.monotonic()
        done.wait(20)
        s.release()

    first = threading.Thread(target=wait, args=("w1",))
    first.start()
    assert wait_until(lambda: r.zcard(lock_key(prefix, name) + ":q") == 1)
    second = threading.Thread(target=wait, args=("w2",))
    second.start()
    assert wait_until(lambda: r.zcard(lock_key(prefix, name) + ":q") == 2)
    released_at = time.monotonic()
    holders[0].release()
    try:
        assert wait_until(lambda: order, timeout=10)
        time.sleep(0.3)
        assert order == ["w1"], "the first in line did not get the freed slot alone"
        # Woken by the release's doorbell, well before the holder's ttl (30 s) or a
        # re-try of the line (every 2 s).
        assert woke_at["w1"] - released_at < 1.5
        holders[1].release()
        assert wait_until(lambda: len(order) == 2, timeout=10)
        assert order == ["w1", "w2"]
    finally:
        done.set()
        first.join(10)
        second.join(10)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True, None])
def test_a_bad_limit_is_refused_naming_it(r, name, bad):
    with pytest.raises(InvalidLockConfig, match="limit"):
        RedisSemaphore(r, name, bad)


def test_every_key_shares_the_hash_tag(r, name, prefix):
    s = _sem(r, name, prefix, "a", limit=2)
    keys = [*s.keys, s.keys.holder("a"), s.keys.doorbell("a")]
    assert all(k.startswith(f"{prefix}:{{{name}}}") for k in keys), keys


def test_a_lock_of_the_same_name_is_a_conflict(r, name, prefix):
    lock = RedisLock(r, name, prefix=prefix, owner="lock")
    lock.acquire()
    with pytest.raises(LockKeyConflict):
        _sem(r, name, prefix, "sem").acquire(blocking=False)
    assert lock.owned()
    lock.release()


# -- LockedTask(lock_limit=N): checks ---------------------------------------------------


def _declare(app, **options):
    from celery_dlock import LockedTask

    @app.task(base=LockedTask, shared=False, name=f"t{uuid.uuid4().hex[:6]}",
              lock_key="k:{x}", **options)
    def t(x: str) -> str:
        return x

    return t


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_a_bad_lock_limit_is_refused_at_declaration(bad):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    with pytest.raises(InvalidLockConfig, match="lock_limit must be a whole number"):
        _declare(app, lock_limit=bad)


def test_until_finished_with_a_limit_is_refused_at_declaration(redis_url):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=2"):
        _declare(app, lock_limit=2, lock_mode="until_finished")
    for mode in ("until_started", "queued_and_running", "throttle"):
        _declare(app, lock_limit=2, lock_mode=mode)  # the marker bounds the queue
    _declare(app, lock_limit=1, lock_mode="until_finished")  # a lock is fine
    configured = Celery("limits", broker="memory://", set_as_current=False)
    configured.conf.update(dlock_url=redis_url, dlock_mode="until_finished")
    configured.finalize()
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=3"):
        _declare(configured, lock_limit=3)  # the app's mode, the task's limit
    limited = _declare(app, lock_limit=2)
    with pytest.raises(InvalidLockConfig, match=r"until_finished.*lock_limit=2"):
        limited.apply_async(("x",), lock_mode="until_finished")  # before any send


def test_lock_limit_cannot_be_set_per_call():
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    t = _declare(app, lock_limit=2)
    with pytest.raises(InvalidLockConfig, match="lock_limit cannot be set per call"):
        t.apply_async(("x",), headers={"lock_limit": 5})


def _redlock_url(servers) -> str:
    return ";".join(s.url.replace("redis://", "redlock://") for s in servers)


def test_redlock_refuses_lock_limit_at_worker_start(redlock_servers):
    from celery_dlock.task.startup import check_app

    app = Celery("limits", broker="memory://", set_as_current=False)
    app.finalize()
    _declare(app, lock_limit=3)
    app.conf.dlock_url = _redlock_url(redlock_servers)  # configured after the tasks
    with pytest.raises(InvalidLockConfig,
                       match=r"semaphores.*the redlock backend does not keep"):
        check_app(app)


def test_redlock_refuses_lock_limit_at_declaration_on_a_configured_app(
        redlock_servers):
    app = Celery("limits", broker="memory://", set_as_current=False)
    app.conf.dlock_url = _redlock_url(redlock_servers)
    app.finalize()
    with pytest.raises(InvalidLockConfig,
                       match="each of its independent servers would count the holders"):
        _declare(app, lock_limit=2)
    _declare(app, lock_limit=1)  # a lock is fine


def test_the_redlock_backend_refuses_a_limit(redlock_servers):
    from celery_dlock.backends.redis.redlock.backend import RedlockBackend

    clients = [redis.Redis.from_url(s.url) for s in redlock_servers]
    backend = RedlockBackend(clients)
    with pytest.raises(InvalidLockConfig, match="lock_limit > 1"):
        backend.lock(LockOptions("x", 5, prefix="p", limit=2))
    assert backend.lock(LockOptions("x", 5, prefix="p", limit=1)) is not None
    for c in clients:
        c.close()


