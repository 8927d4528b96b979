"""celery-once's and celery-singleton's options, translated to celery-dlock's (no
Redis: the settings a task resolves to; what they do is tests/integration/
test_compat.py)."""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
from celery import Celery

from celery_dlock import AlreadyQueued, InvalidLockConfig
from celery_dlock.compat import DuplicateTaskError, QueueOnce, Singleton


def make_app(**conf: Any) -> Celery:
    app = Celery("compat-unit", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def settings(app: Celery, base: type, **options: Any) -> dict[str, Any]:
    """The resolved options (and lock_args) of a task ``f(a, b)`` on ``base``."""
    def f(a: Any, b: Any = None) -> None:
        return None

    name = f"t{len(app.tasks)}"
    app.task(shared=False, name=name, base=base, **options)(f)
    task = app.tasks[name]
    return {**task.dlock_settings(), "lock_args": type(task).lock_args}


def pick(found: dict[str, Any]) -> tuple[Any, ...]:
    return (found["lock_mode"], found["on_duplicate"], found["lock_queue_ttl"],
            found["lock_args"])


# -- QueueOnce -----------------------------------------------------------------------

@pytest.mark.parametrize(("once", "expected"), [
    (None, ("until_finished", "raise", 3600.0, None)),
    ({"graceful": True}, ("until_finished", "drop", 3600.0, None)),
    ({"keys": ["a"]}, ("until_finished", "raise", 3600.0, ("a",))),
    ({"keys": []}, ("until_finished", "raise", 3600.0, ())),
    ({"timeout": 60}, ("until_finished", "raise", 60.0, None)),
    ({"unlock_before_run": True}, ("until_started", "raise", 3600.0, None)),
])
def test_once_options_translate(once: dict[str, Any] | None,
                                expected: tuple[Any, ...]) -> None:
    options = {} if once is None else {"once": once}
    found = settings(make_app(), QueueOnce, **options)
    assert pick(found) == expected
    assert found["lock_ttl"] == 30.0  # the runtime lock keeps its own (renewed) ttl


def test_a_task_option_wins_over_once() -> None:
    found = settings(make_app(), QueueOnce, once={"unlock_before_run": True,
                                                  "timeout": 5},
                     lock_mode="queued_and_running", lock_queue_ttl=7)
    assert (found["lock_mode"], found["lock_queue_ttl"]) == ("queued_and_running", 7)


def test_once_default_timeout_from_the_app_and_a_warning_for_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(ONCE={"backend": "celery_once.backends.Redis",
                         "settings": {"url": "redis://x:6379/0",
                                      "default_timeout": 120}})
    with caplog.at_level(logging.WARNING, "celery_dlock.compat"):
        assert settings(app, QueueOnce)["lock_queue_ttl"] == 120.0
        assert settings(app, QueueOnce, once={"timeout": 9})["lock_queue_ttl"] == 9.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "backend" in warnings[0] and "dlock_url" in warnings[0]
    assert "redis://x" not in warnings[0]


def test_a_subclass_once_is_inherited_and_replaced_as_a_whole() -> None:
    class GracefulOnce(QueueOnce):
        abstract = True
        once = {"graceful": True}

    app = make_app()
    assert settings(app, GracefulOnce)["on_duplicate"] == "drop"
    # As in celery-once, a task's own ``once`` replaces the inherited one.
    assert settings(app, GracefulOnce, once={"keys": ["a"]})["on_duplicate"] == "raise"


@pytest.mark.parametrize(("once", "match"), [
    ({"gracefull": True}, "did you mean graceful"),
    ({"graceful": "yes"}, "graceful"),
    ({"timeout": 0}, "timeout"),
    ({"keys": "a"}, "list of argument names"),
    ({"keys": ["c"]}, "lock_args"),
    (["graceful"], "must be a dict"),
])
def test_bad_once_is_refused_when_the_task_is_declared(once: Any, match: str) -> None:
    with pytest.raises(InvalidLockConfig, match=match):
        settings(make_app(), QueueOnce, once=once)


# -- Singleton -----------------------------------------------------------------------

@pytest.mark.parametrize(("options", "expected"), [
    ({}, ("until_finished", "return_existing", 3600.0, None)),
    ({"unique_on": ["a"]}, ("until_finished", "return_existing", 3600.0, ("a",))),
    ({"unique_on": "a"}, ("until_finished", "return_existing", 3600.0, ("a",))),
    ({"unique_on": []}, ("until_finished", "return_existing", 3600.0, ())),
    ({"raise_on_duplicate": True}, ("until_finished", "raise", 3600.0, None)),
    ({"lock_expiry": 10}, ("until_finished", "return_existing", 10.0, None)),
])
def test_singleton_options_translate(options: dict[str, Any],
                                     expected: tuple[Any, ...]) -> None:
    assert pick(settings(make_app(), Singleton, **options)) == expected


def test_singleton_app_settings_are_defaults_a_task_option_overrides(
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(singleton_raise_on_duplicate=True, singleton_lock_expiry=30,
                   singleton_backend_url="redis://y:6379/1")
    with caplog.at_level(logging.WARNING, "celery_dlock.compat"):
        found = settings(app, Singleton)
        assert (found["on_duplicate"], found["lock_queue_ttl"]) == ("raise", 30.0)
        found = settings(app, Singleton, raise_on_duplicate=False, lock_expiry=5)
        assert (found["on_duplicate"], found["lock_queue_ttl"]) == \
            ("return_existing", 5.0)
    assert len(caplog.records) == 1
    assert "singleton_backend_url" in caplog.records[0].getMessage()


def test_bad_singleton_options_are_refused() -> None:
    with pytest.raises(InvalidLockConfig, match="lock_expiry"):
        settings(make_app(), Singleton, lock_expiry=-1)
    with pytest.raises(InvalidLockConfig, match="raise_on_duplicate"):
        settings(make_app(), Singleton, raise_on_duplicate="yes")
    with pytest.raises(InvalidLockConfig, match="singleton_lock_expiry"):
        settings(make_app(singleton_lock_expiry="soon"), Singleton)
    # lock_expiry is an option of Singleton only: on a LockedTask it is unknown.
    from celery_dlock import LockedTask

    with pytest.raises(InvalidLockConfig, match="unknown option lock_expiry"):
        settings(make_app(), LockedTask, lock_expiry=5)


def test_duplicate_task_error_is_already_queued_with_the_task_id() -> None:
    err = DuplicateTaskError("Attempted to queue a duplicate of task ID x", "x",
                             lock_name="n", countdown=3.0)
    assert isinstance(err, AlreadyQueued)
    assert (err.task_id, err.countdown, err.lock_name) == ("x", 3.0, "n")
    for copy in (type(err)(*err.args), pickle.loads(pickle.dumps(err))):
        assert type(copy) is DuplicateTaskError
        assert (copy.task_id, copy.countdown, copy.lock_name) == ("x", 3.0, "n")
