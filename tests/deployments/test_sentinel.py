"""Celery's Sentinel spelling for the lock: ``dlock_url="sentinel://...;..."`` with
``dlock_transport_options``, or the broker's Sentinel setup when there is no dlock_url.

Each test starts a small group of its own (a master with a password, one sentinel with
another password): well under a second.  Failover is in test_sentinel_failover.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery_helpers import test_app
from servers import SentinelGroup

from celery_dlock import BackendUnavailable, InvalidLockConfig, RedisLock
from celery_dlock.task.config import get_client

MASTER_PW = "m-secret-1"
SENTINEL_PW = "s-secret-2"


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    g = SentinelGroup(f"g{uuid.uuid4().hex[:6]}", replicas=0, sentinels=1,
                      password=MASTER_PW, sentinel_password=SENTINEL_PW)
    try:
        g.start()
    except RuntimeError as exc:
        pytest.skip(f"could not start a Sentinel group with this redis-server: {exc}")
    yield g
    g.stop()


def _app(**conf: object) -> Celery:
    return test_app(f"dls{uuid.uuid4().hex[:6]}", **conf)


def _takes_a_lock_on_the_master(client: object, group: SentinelGroup) -> None:
    prefix = f"dls{uuid.uuid4().hex[:8]}"
    with RedisLock(client, "job", prefix=prefix, ttl=5) as lock:
        master = group.master.client()
        owner = master.hget(lock.keys.lock, "owner")
        master.close()
        assert owner is not None and owner.decode() == lock.holder().owner


def test_dlock_url_in_celerys_sentinel_spelling(group):
    app = _app(dlock_url=group.url(), dlock_transport_options={
        "master_name": group.master_name,
        "sentinel_kwargs": {"password": SENTINEL_PW}})
    _takes_a_lock_on_the_master(get_client(app), group)


def test_several_sentinels_the_first_one_down(group):
    down = f"sentinel://:{MASTER_PW}@127.0.0.1:{group.sentinels[0].port + 1}"
    url = f"{down};sentinel://127.0.0.1:{group.sentinels[0].port}/0"
    app = _app(dlock_url=url, dlock_transport_options={
        "master_name": group.master_name,
        "sentinel_kwargs": {"password": SENTINEL_PW}})
    _takes_a_lock_on_the_master(get_client(app), group)


def test_the_lock_follows_the_brokers_sentinel_setup(group):
    app = _app(broker_url=group.url(), broker_transport_options={
        "master_name": group.master_name,
        "sentinel_kwargs": {"password": SENTINEL_PW}})
    _takes_a_lock_on_the_master(get_client(app), group)


def test_the_master_name_is_required(group):
    app = _app(dlock_url=group.url())
    with pytest.raises(InvalidLockConfig, match="master_name"):
        get_client(app)


def test_a_wrong_sentinel_password_is_one_line_without_secrets(group):
    app = _app(dlock_url=group.url(), dlock_transport_options={
        "master_name": group.master_name,
        "sentinel_kwargs": {"password": "wrong-pw"}})
    client = get_client(app)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        RedisLock(client, "job", ttl=5).acquire(blocking=False)
    assert time.monotonic() - started < 10
    text = str(caught.value)
    assert len(text.splitlines()) == 1
    for secret in (MASTER_PW, SENTINEL_PW, "wrong-pw"):
        assert secret not in text


def test_locked_task_through_a_sentinel_url(group, redis_url):
    from celery.contrib.testing.worker import start_worker
    from celery_helpers import close_app

    from celery_dlock import LockedTask

    prefix = f"dls{uuid.uuid4().hex[:8]}"
    app = test_app(f"dls{prefix}", redis_url, queue=f"q-{prefix}", prefix=prefix,
                   dlock_url=group.url(), dlock_transport_options={
                       "master_name": group.master_name,
                       "sentinel_kwargs": {"password": SENTINEL_PW}})
    master = group.master.client()

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="s:{x}")
    def work(self, x):
        return {"fence": self.lock.fence,
                "on_master": master.hget(self.lock.keys.lock, "owner") is not None}

    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                          shutdown_timeout=20):
            first = work.delay("a").get(timeout=30)
            second = work.delay("a").get(timeout=30)
        assert first["on_master"] and second["on_master"]
        assert second["fence"] > first["fence"]
    finally:
        close_app(app)
        master.close()
