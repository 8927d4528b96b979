"""``app.conf.dlock_enabled = False``: every lock and queue marker is a no-op.

The lock's Redis is a closed port, so any attempt to reach it would fail the call
(fail closed: ``on_contention="raise"`` raises ``BackendUnavailable``); a body that runs,
with ``self.lock`` None, shows that nothing tried.  Checked eagerly, on an in-process
worker whose broker is ``memory://`` (no Redis anywhere), and on a real ``celery
worker`` prefork subprocess whose broker is the session's Redis.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app
from dlock_helpers import closed_port
from prefork_app import ENV_CONF
from worker_harness import Harness, open_harness

from celery_dlock import InvalidLockConfig, LockedTask
from celery_dlock.task.config import check_conf
from celery_dlock.task.startup import check_app


def _closed_url() -> str:
    return f"redis://127.0.0.1:{closed_port()}/0"


def _app(**conf: Any) -> Celery:
    app = Celery("disabled", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(dlock_enabled=False, dlock_url=_closed_url(),
                    dlock_redis_options={"socket_connect_timeout": 0.3}, **conf)
    return app


def _task(app: Celery, **options: Any) -> Any:
    @app.task(base=LockedTask, bind=True, shared=False, name="disabled.probe",
              lock_key="stock:{sku}", on_contention="raise", **options)
    def probe(self: Any, sku: int) -> dict[str, Any]:
        return {"sku": sku, "lock_is_none": self.lock is None}

    return probe


# -- the configuration check ----------------------------------------------------------

def test_the_check_accepts_it_and_needs_no_redis() -> None:
    # No dlock_url, a memory:// broker: no Redis anywhere, and nothing to refuse.
    check_conf({"dlock_enabled": False, "broker_url": "memory://"})
    app = Celery("off", broker="memory://", set_as_current=False)
    app.conf.dlock_enabled = False
    _task(app)
    check_app(app)  # what a worker runs at start


def test_the_check_still_refuses_a_bad_value() -> None:
    with pytest.raises(InvalidLockConfig, match="dlock_enabled must be True or False"):
        check_conf({"dlock_enabled": "no", "dlock_url": "redis://localhost/0"})
    with pytest.raises(InvalidLockConfig, match="dlock_tll"):
        check_conf({"dlock_enabled": False, "dlock_tll": 5})
    with pytest.raises(InvalidLockConfig, match="dlock_ttl"):
        check_conf({"dlock_enabled": False, "dlock_ttl": -1})
    # A Redis given is checked as usual, even when the locks are off.
    with pytest.raises(InvalidLockConfig):
        check_conf({"dlock_enabled": False, "dlock_url": "http://localhost/0"})


def test_enabled_is_still_the_default() -> None:
    with pytest.raises(InvalidLockConfig, match="needs a lock store"):
        check_conf({"broker_url": "memory://"})


# -- eager ----------------------------------------------------------------------------

def test_eager_body_runs_without_any_redis() -> None:
    app = _app(task_always_eager=True, task_eager_propagates=True)
    probe = _task(app, lock_mode="until_finished", on_duplicate="raise")
    try:
        assert probe.delay(1).get() == {"sku": 1, "lock_is_none": True}
        assert probe.apply((2,)).get() == {"sku": 2, "lock_is_none": True}
        assert probe(3) == {"sku": 3, "lock_is_none": True}  # a direct call
        assert probe.lock is None  # outside a run
    finally:
        app.close()


def test_turned_back_on_the_same_app_fails_closed() -> None:
    """The control: the same call, locks on, reaches for the closed port."""
    from celery_dlock import BackendUnavailable

    app = _app(task_always_eager=True, task_eager_propagates=True)
    probe = _task(app)
    try:
        app.conf.dlock_enabled = True
        with pytest.raises(BackendUnavailable):
            probe.delay(1).get()
    finally:
        app.close()


# -- workers --------------------------------------------------------------------------

def test_in_process_worker_runs_it_with_no_redis_anywhere() -> None:
    app = _app()
    probe = _task(app, lock_mode="until_finished", on_duplicate="raise")
    try:
        with start_worker(app, pool="solo", perform_ping_check=False,
                          shutdown_timeout=10):
            # The same key twice, queued at once: with markers on, the second could
            # be refused (AlreadyQueued) while the first is queued or running; off,
            # both are sent and both run.
            first, second = probe.delay(7), probe.delay(7)
            assert first.get(timeout=20) == {"sku": 7, "lock_is_none": True}
            assert second.get(timeout=20) == {"sku": 7, "lock_is_none": True}
    finally:
        close_app(app)


@pytest.fixture
def disabled_harness(redis_url: str, r: redis.Redis, prefix: str, tmp_path: Path,
                     request: pytest.FixtureRequest,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    # Both sides (this process's app and the worker's) read the extra settings.
    monkeypatch.setenv(ENV_CONF, json.dumps({
        "dlock_enabled": False, "dlock_url": _closed_url(),
        "dlock_redis_options": {"socket_connect_timeout": 0.3}}))
    yield from open_harness(redis_url, r, prefix, tmp_path, request)


@pytest.mark.slow
def test_prefork_worker_runs_it_with_the_lock_redis_unreachable(
        disabled_harness: Harness) -> None:
    h = disabled_harness
    h.start_workers(1, concurrency=2)
    task = h.app.tasks["pf.lock_state"]
    results = [task.delay("k") for _ in range(3)]  # one key: no marker, no lock
    for result in results:
        value = result.get(timeout=30)
        assert value["key"] == "k" and value["lock_is_none"] is True
    assert h.lock_keys_left() == []
