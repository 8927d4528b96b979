"""dlock_* settings: task option > app.conf > default; the per-process client."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import redis
from celery import Celery

from celery_dlock import InvalidLockConfig, LockedTask
from celery_dlock.task.config import SETTINGS, get_client, read_setting, resolve_url


def _app(**conf: object) -> Celery:
    app = Celery("cfg", set_as_current=False, broker="memory://")
    app.conf.update(conf)
    return app


def _task(app: Celery, **options: object) -> LockedTask:
    @app.task(base=LockedTask, lock_key="k:{x}", shared=False, name=f"t{len(app.tasks)}",
              **options)
    def t(x):
        return x

    return t


def test_defaults_apply_without_settings():
    task = _task(_app())
    assert read_setting(task, "lock_ttl") == 30.0
    assert read_setting(task, "on_contention") == "retry"
    assert read_setting(task, "lock_prefix") == "dlock"
    assert read_setting(task, "lock_fail_open") is False
    assert read_setting(task, "lock_retry_max") == 20


def test_app_setting_beats_default_and_task_option_beats_app():
    app = _app(dlock_ttl=12, dlock_on_contention="skip", dlock_key_prefix="p")
    plain = _task(app)
    assert read_setting(plain, "lock_ttl") == 12.0
    assert read_setting(plain, "on_contention") == "skip"
    assert read_setting(plain, "lock_prefix") == "p"
    tuned = _task(app, lock_ttl=5, on_contention="raise")
    assert read_setting(tuned, "lock_ttl") == 5.0
    assert read_setting(tuned, "on_contention") == "raise"
    assert read_setting(tuned, "lock_prefix") == "p"


@pytest.mark.parametrize(("conf", "option"), [
    ({"dlock_ttl": 0}, "lock_ttl"),
    ({"dlock_ttl": "30"}, "lock_ttl"),
    ({"dlock_on_contention": "maybe"}, "on_contention"),
    ({"dlock_retry_max": -1}, "lock_retry_max"),
    ({"dlock_fail_open": "yes"}, "lock_fail_open"),
    ({"dlock_wait": -2}, "lock_wait"),
    ({"dlock_lock_lost_action": "explode"}, "lock_lost_action"),
    ({"dlock_key_prefix": ""}, "lock_prefix"),
])
def test_bad_app_settings_are_named_in_the_error(conf, option):
    task = _task(_app(**conf))
    with pytest.raises(InvalidLockConfig, match=next(iter(conf))):
        read_setting(task, option)


def test_every_setting_has_docs_and_a_conf_key():
    for option, setting in SETTINGS.items():
        assert setting.conf.startswith("dlock_"), option
        assert setting.doc
        if setting.default is not None:  # None: unset, the lock's own default
            assert setting.check(option, setting.default) == setting.default


def test_url_defaults_to_a_redis_broker():
    assert resolve_url(_app(broker_url="redis://h:1/2").conf) == "redis://h:1/2"
    assert resolve_url(_app(broker_url="redis://h:1/2",
                            dlock_url="redis://other:3/0").conf) == "redis://other:3/0"


@pytest.mark.parametrize("conf", [{"broker_url": "amqp://guest@localhost//"},
                                  {"broker_url": "memory://"},
                                  {"dlock_url": "http://nope"}])
def test_url_errors_say_what_to_set(conf):
    with pytest.raises(InvalidLockConfig, match="dlock_url"):
        resolve_url(_app(**conf).conf)


def _in_child(check: Callable[[], object]) -> bool:
    """Whether ``check()`` is true in a child this process forks now."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.write(write, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        return os.read(read, 1) == b"1"
    finally:
        os.waitpid(pid, 0)
        os.close(read)


def test_one_client_per_process_and_a_new_one_after_fork(redis_url):
    app = _app(dlock_url=redis_url)
    client = get_client(app)
    assert get_client(app) is client
    assert client.ping()
    # the child must not reuse the parent's client object
    assert _in_child(lambda: get_client(app) is not client and get_client(app).ping())


def test_an_apps_client_and_backend_are_kept_once_and_made_anew_after_fork(redis_url):
    from celery_dlock.task.app_cache import lookup
    from celery_dlock.task.backend import backend_for, forget_app

    app = _app(dlock_url=redis_url)
    backend = backend_for(app)
    client = get_client(app)
    kept = lookup(app)
    assert kept is not None and kept.client is client and kept.backend is backend
    assert backend_for(app) is backend and get_client(app) is client
    # nothing of the parent's entry is the child's own
    assert _in_child(lambda: lookup(app) is None and backend_for(app) is not backend
                     and get_client(app) is not client)
    # forget_app drops the one entry: both are made again from the settings
    forget_app(app)
    assert lookup(app) is None
    assert backend_for(app) is not backend
    assert get_client(app) is not client
    client.close()
    get_client(app).close()


def test_client_factory_is_used(redis_url):
    made: list[redis.Redis] = []

    def factory() -> redis.Redis:
        made.append(redis.Redis.from_url(redis_url))
        return made[-1]

    app = _app(dlock_client=factory)
    assert get_client(app) is made[0]
    assert get_client(app) is made[0]
    assert len(made) == 1


def test_redis_options_are_merged(redis_url):
    app = _app(dlock_url=redis_url, dlock_redis_options={"socket_timeout": 1.5})
    kwargs = get_client(app).connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 1.5
    assert kwargs["socket_connect_timeout"] == 3.0
