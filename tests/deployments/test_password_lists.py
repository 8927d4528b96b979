"""Passwords with URL delimiters in the ``;``-separated lists: a Sentinel group whose
master requires one, and a Redlock over three servers that each require one.  The
``;`` of a list cuts only between URLs: a percent-encoded password works, and one whose
raw form reads one way only (a raw ``;`` among others) works unencoded too."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery_helpers import close_app
from dlock_helpers import closed_port
from servers import SentinelGroup
from url_passwords import PASSWORDS, RAW_WORKS, encoded

from celery_dlock import LockedTask, RedisLock, RedlockLock
from celery_dlock.ops.embedded import EmbeddedRedis
from celery_dlock.task.config import check_conf, get_client


def _forms(password: str) -> list[str]:
    """How the password is written in a URL: encoded, and raw when that is unambiguous."""
    return [encoded(password)] + ([password] if password == RAW_WORKS else [])


def _app(**conf: Any) -> Celery:
    app = Celery(f"dlpw{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.fixture(scope="module", params=PASSWORDS)
def group(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    g = SentinelGroup(f"g{uuid.uuid4().hex[:6]}", replicas=0, sentinels=1,
                      password=request.param)
    try:
        g.start()
    except RuntimeError as exc:
        pytest.skip(f"could not start a Sentinel group with this redis-server: {exc}")
    yield g
    g.stop()


def test_a_sentinel_list_with_the_masters_password(group):
    password = group.password
    assert password is not None
    sentinel = group.sentinels[0].port
    for written in _forms(password):
        # the first URL carries the master's password; a sentinel that is down first
        url = (f"sentinel://:{written}@127.0.0.1:{closed_port()};"
               f"sentinel://127.0.0.1:{sentinel}")
        app = _app(dlock_url=url,
                   dlock_transport_options={"master_name": group.master_name})
        check_conf(app.conf)
        with RedisLock(get_client(app), "pw", prefix=f"dlpw{uuid.uuid4().hex[:6]}",
                       ttl=5) as lock:
            master = group.master.client()
            try:
                owner = master.hget(lock.keys.lock, "owner")
            finally:
                master.close()
            assert owner is not None and owner.decode() == lock.holder().owner
        assert not lock.locked()
        close_app(app)


@pytest.fixture(scope="module", params=PASSWORDS)
def guarded_trio(request: pytest.FixtureRequest) -> Iterator[list[EmbeddedRedis]]:
    servers = [EmbeddedRedis(password=request.param) for _ in range(3)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _holders(servers: list[EmbeddedRedis], key: str) -> list[bytes | None]:
    out = []
    for server in servers:
        client = redis.Redis.from_url(server.url)
        try:
            out.append(client.hget(key, "owner"))
        finally:
            client.close()
    return out


def test_a_redlock_list_with_passwords(guarded_trio):
    password = guarded_trio[0].password
    assert password is not None
    for written in _forms(password):
        urls = [f"redis://:{written}@127.0.0.1:{s.port}/0" for s in guarded_trio]
        spelled = ";".join("redlock://" + u[len("redis://"):] for u in urls)
        for dlock_url in (urls, spelled):
            prefix = f"dlpw{uuid.uuid4().hex[:6]}"
            app = _app(dlock_url=dlock_url, dlock_key_prefix=prefix)
            check_conf(app.conf)
            clients = get_client(app)
            assert isinstance(clients, tuple) and len(clients) == 3
            with RedlockLock(clients, "pw", ttl=5) as lock:
                held = _holders(guarded_trio, lock.keys.lock)
                assert sum(h is not None for h in held) >= 2

            @app.task(base=LockedTask, shared=False, bind=True, lock_key="k:{x}")
            def task(self: Any, x: int) -> list[bytes | None]:
                return _holders(guarded_trio, self.lock.keys.lock)

            held = task.apply(args=(1,)).get()
            assert sum(h is not None for h in held) >= 2
            close_app(app)
