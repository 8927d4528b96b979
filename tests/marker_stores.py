"""The queue-marker stores, one test run per store: Redis, PostgreSQL, MySQL/MariaDB,
ZooKeeper.

Fixtures, loaded by tests/conftest.py: ``store_harness`` (real prefork workers
whose locks and markers are on each store; ``semaphore_harness`` the same over the
stores that keep semaphores, and ``semaphore_store`` one of their backends), and
``markers``, which gives a test a
:class:`MarkerCase`: the store (what :class:`~celery_dlock.task.markers.MarkerStore`
says), the backend it belongs to (for locks: a running holder is the holder of the
lock of the same prefix and name whose hold's info carries ``task_id``, taken with
:meth:`MarkerCase.running`), its kind and URL.  PostgreSQL, MariaDB and ZooKeeper are
skipped, with the reason, where there is no server (the ``postgres_server``,
``mariadb_url`` and ``zk_server`` fixtures).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from celery_helpers import collect_garbage

from celery_dlock.core.lock_options import LockOptions

#: The stores that keep queue markers, in the order the tests run on them.
MARKER_STORES = ("redis", "postgres", "mysql", "zookeeper")
#: The stores that keep semaphores (``lock_limit`` above 1).
SEMAPHORE_STORES = ("redis", "postgres", "mysql", "zookeeper")


class MarkerCase(NamedTuple):
    """A marker store under test: its kind, URL, store and backend."""

    kind: str
    url: str
    store: Any  # a MarkerStore
    backend: Any

    def running(self, prefix: str, name: str, task_id: str, ttl: float = 30.0) -> Any:
        """``task_id`` running: the lock of ``name`` held with its task id (the
        caller releases it)."""
        lock = self.backend.lock(LockOptions(name, ttl, prefix=prefix,
                                             info={"task_id": task_id}))
        assert lock.acquire(blocking=False), f"{name!r} is held already"
        return lock


def store_url(kind: str, request: pytest.FixtureRequest) -> str:
    """The URL of a server of ``kind`` (a skip, with the reason, where none)."""
    if kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    if kind == "postgres":
        return str(request.getfixturevalue("postgres_server").url)
    if kind == "zookeeper":
        return str(request.getfixturevalue("zk_server").url)
    return str(request.getfixturevalue("mariadb_url"))


def backend_of(kind: str, url: str) -> Any:
    """A backend of its own for ``url`` (not the process's cached one)."""
    if kind == "redis":
        import redis

        from celery_dlock.backends.redis.backend import RedisBackend

        return RedisBackend(redis.Redis.from_url(url, socket_timeout=10,
                                                 socket_connect_timeout=5))
    if kind == "postgres":
        from celery_dlock.backends.sql.postgres.backend import PostgresBackend

        return PostgresBackend(url)
    if kind == "zookeeper":
        from celery_dlock.backends.zookeeper.backend import backend_from_url

        return backend_from_url(url)
    from celery_dlock.backends.sql.mysql.backend import MySQLBackend

    return MySQLBackend(url)


def open_markers(kind: str, request: pytest.FixtureRequest) -> Iterator[MarkerCase]:
    """The body of a ``markers`` fixture for ``kind``.

    Garbage is collected first: these tests allocate many small documents, so the
    collector runs inside them, and a socket an earlier test left in a reference
    cycle (Celery's per-thread result clients of a race test) would be reported as
    this test's failure (its warning is that test's, see ``collect_garbage``)."""
    collect_garbage()
    url = store_url(kind, request)
    backend = backend_of(kind, url)
    try:
        yield MarkerCase(kind, url, backend.markers(), backend)
    finally:
        close_backend(kind, backend)


def close_backend(kind: str, backend: Any) -> None:
    """Close what a backend of :func:`backend_of` opened (a socket left to the
    garbage collector is reported, as an error, in whichever test it is collected)."""
    client = getattr(backend, "client", None)
    if kind == "redis" and client is not None:
        client.close()
    server = getattr(backend, "server", None)
    if kind in ("postgres", "mysql") and server is not None:
        server.close()


@pytest.fixture(params=MARKER_STORES)
def markers(request: pytest.FixtureRequest) -> Iterator[MarkerCase]:
    """Each store that keeps queue markers in turn."""
    yield from open_markers(request.param, request)


def open_store_harness(kind: str, request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A worker harness (:func:`worker_harness.open_harness`) whose locks and queue
    markers are on the store ``kind`` (the broker, results and the tasks' records
    stay on Redis).  The workers and the test's own app (the producer,
    :func:`prefork_app.make_app`) both read ``ENV_CONF``: they send and run with the
    same ``dlock_url``."""
    from prefork_app import ENV_CONF
    from worker_harness import open_harness

    if kind != "redis":
        url = store_url(kind, request)
        monkeypatch.setenv(ENV_CONF, json.dumps({"dlock_url": url}))
    yield from open_harness(request.getfixturevalue("redis_url"),
                            request.getfixturevalue("r"),
                            request.getfixturevalue("prefix"),
                            request.getfixturevalue("tmp_path"), request)


@pytest.fixture(params=MARKER_STORES)
def store_harness(request: pytest.FixtureRequest,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """:func:`open_store_harness` on each store that keeps queue markers in turn."""
    yield from open_store_harness(request.param, request, monkeypatch)


class StoreCase(NamedTuple):
    """A lock store under test: its kind, URL and backend."""

    kind: str
    url: str
    backend: Any


@pytest.fixture(params=SEMAPHORE_STORES)
def semaphore_store(request: pytest.FixtureRequest) -> Iterator[StoreCase]:
    """Each store that keeps semaphores in turn."""
    url = store_url(request.param, request)
    backend = backend_of(request.param, url)
    try:
        yield StoreCase(request.param, url, backend)
    finally:
        close_backend(request.param, backend)


@pytest.fixture(params=SEMAPHORE_STORES)
def semaphore_harness(request: pytest.FixtureRequest,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """:func:`open_store_harness` on each store that keeps semaphores in turn."""
    yield from open_store_harness(request.param, request, monkeypatch)
