"""Where a LockedTask's options come from, and misconfiguration refused early
(issue 11, items 2, 5, 6 and 9).

Precedence, as Celery's own task options: per call (message headers) >
``task_annotations`` > task class (most derived first) > ``app.conf.dlock_*`` >
default.  The lock a task takes is observed in the real Redis while the body runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_helpers import QUICK_POLLING, close_app, needs_inprocess_eta, test_app

from celery_dlock import InvalidLockConfig, LockedTask, LockNotAcquired, RedisLock
from celery_dlock.task import config
from celery_dlock.task.config import get_client, resolve_url
from celery_dlock.task.event_counts import minute_counts

RESULT_TIMEOUT = 30


def _conf_app(redis_url: str, tag: str, **conf: Any) -> Celery:
    return test_app(f"cfg{tag}", redis_url, queue=f"q-cfg{tag}", prefix=f"dlt{tag}",
                    result_expires=600, **conf)


def _held(r: redis.Redis, prefix: str) -> list[str]:
    """Names of the locks held under ``prefix`` right now."""
    head = f"{prefix}:{{"
    return sorted(k.decode()[len(head):-1] for k in r.scan_iter(match=f"{prefix}:{{*}}",
                                                                 _type="hash"))


# -- class-based subclasses and annotations, on a real worker --------------------------

class ParentTask(LockedTask):
    name = "cfgtests.parent"
    lock_key = "parent:{k}"
    lock_ttl = 20

    def run(self, k: str) -> dict[str, Any]:
        lock = self.lock
        assert lock is not None
        return {"key": lock.name, "ttl": lock.ttl}


class ChildTask(ParentTask):
    name = "cfgtests.child"
    lock_key = "child:{k}"
    lock_ttl = 7


class GrandChildTask(ChildTask):
    name = "cfgtests.grandchild"
    # inherits the child's key; its own ttl
    lock_ttl = 3


@pytest.fixture
def annotated(redis_url: str) -> Iterator[Any]:
    tag = uuid.uuid4().hex[:8]
    app = _conf_app(redis_url, tag, dlock_ttl=11, task_annotations={
        f"cfg{tag}.annotated": {"lock_key": "annotated:{k}", "lock_ttl": 9},
        f"cfg{tag}.class_annotated": {"lock_ttl": 4},
    })
    parent = app.register_task(ParentTask())
    child = app.register_task(ChildTask())
    grandchild = app.register_task(GrandChildTask())

    @app.task(base=LockedTask, bind=True, shared=False, name=f"cfg{tag}.annotated",
              lock_key="decorated:{k}", lock_ttl=30)
    def annotated_task(self: Any, k: str) -> dict[str, Any]:
        return {"key": self.lock.name, "ttl": self.lock.ttl}

    @app.task(base=ChildTask, bind=True, shared=False, name=f"cfg{tag}.class_annotated")
    def class_annotated(self: Any, k: str) -> dict[str, Any]:
        return {"key": self.lock.name, "ttl": self.lock.ttl}

    @app.task(base=LockedTask, bind=True, shared=False, name=f"cfg{tag}.plain",
              lock_key="plain:{k}")
    def plain(self: Any, k: str) -> dict[str, Any]:
        return {"key": self.lock.name, "ttl": self.lock.ttl}

    tasks = {"parent": parent, "child": child, "grandchild": grandchild,
             "annotated": annotated_task, "class_annotated": class_annotated,
             "plain": plain}
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        yield app, tasks, f"dlt{tag}"
    close_app(app)


def test_subclass_locks_with_its_own_key_and_ttl(annotated):
    _, tasks, _ = annotated
    assert tasks["parent"].delay("a").get(timeout=RESULT_TIMEOUT) == {
        "key": "parent:a", "ttl": 20.0}
    assert tasks["child"].delay("a").get(timeout=RESULT_TIMEOUT) == {
        "key": "child:a", "ttl": 7.0}
    assert tasks["grandchild"].delay("a").get(timeout=RESULT_TIMEOUT) == {
        "key": "child:a", "ttl": 3.0}


def test_annotations_beat_the_task_class_and_app_conf(annotated):
    _, tasks, _ = annotated
    assert tasks["annotated"].delay("b").get(timeout=RESULT_TIMEOUT) == {
        "key": "annotated:b", "ttl": 9.0}
    # A decorated task on a class-based base: the base's key, the annotation's ttl.
    assert tasks["class_annotated"].delay("b").get(timeout=RESULT_TIMEOUT) == {
        "key": "child:b", "ttl": 4.0}
    # No task option at all: app.conf.dlock_ttl.
    assert tasks["plain"].delay("b").get(timeout=RESULT_TIMEOUT)["ttl"] == 11.0


def test_per_call_headers_beat_everything(annotated, r):
    _, tasks, prefix = annotated
    out = tasks["annotated"].apply_async(("c",), headers={"lock_ttl": 2}).get(
        timeout=RESULT_TIMEOUT)
    assert out == {"key": "annotated:c", "ttl": 2.0}
    # A per-call policy: "raise" instead of the app's default "retry".
    with RedisLock(r, "plain:c", prefix=prefix, auto_renew=False, ttl=30):
        result = tasks["plain"].apply_async(("c",), headers={"on_contention": "raise"})
        with pytest.raises(LockNotAcquired) as caught:
            result.get(timeout=RESULT_TIMEOUT)
    assert caught.value.lock_name == "plain:c"


@needs_inprocess_eta
def test_per_call_headers_ride_with_contention_retries(annotated, r):
    """Without the call's bound (app default: 20 retries, backoff from 1 s doubling to
    30 s) this would take minutes; the headers travel with each re-queued message."""
    _, tasks, prefix = annotated
    with RedisLock(r, "plain:f", prefix=prefix, auto_renew=False, ttl=60):
        result = tasks["plain"].apply_async(("f",), headers={
            "lock_retry_max": 2, "lock_retry_backoff": 0.01,
            "lock_retry_backoff_max": 0.02})
        with pytest.raises(LockNotAcquired) as caught:
            result.get(timeout=RESULT_TIMEOUT)
    assert caught.value.lock_name == "plain:f"
    assert "2 contention retries" in str(caught.value)


@pytest.mark.parametrize(("headers", "named"), [
    ({"lock_ttl": 0}, "lock_ttl"),
    ({"lock_tll": 5}, "lock_ttl"),
    ({"lock_key": "other:{k}"}, "lock_key"),
    ({"lock_prefix": "x"}, "lock_prefix"),
    ({"lock_lost_action": "interrupt"}, "lock_lost_action"),
    ({"on_contention": "sometimes"}, "on_contention"),
])
def test_bad_per_call_options_are_refused_where_the_call_is_made(annotated, headers,
                                                                 named):
    _, tasks, _ = annotated
    with pytest.raises(InvalidLockConfig, match=named):
        tasks["plain"].apply_async(("d",), headers=headers)


def test_bad_per_call_option_sent_by_name_fails_the_task(annotated):
    """Refused where it is sent; and a message that carries one anyway (sent by a
    producer whose send_task is not celery-dlock's) fails on the worker."""
    from celery_dlock.task.enqueue import original_send_task

    app, tasks, _ = annotated
    with pytest.raises(InvalidLockConfig, match="per-call header lock_ttl"):
        app.send_task(tasks["plain"].name, ("e",), headers={"lock_ttl": -1})
    result = original_send_task(app)(tasks["plain"].name, ("e",),
                                     headers={"lock_ttl": -1})
    with pytest.raises(InvalidLockConfig, match="per-call header lock_ttl"):
        result.get(timeout=RESULT_TIMEOUT)


def test_a_callable_option_is_called_as_given(redis_url, r, prefix):
    """``on_contention=fn`` on the decorator is a class attribute of the task class;
    read through the task it would be a bound method, called with the task first."""
    app = Celery("callable", broker="memory://", set_as_current=False)
    app.conf.update(dlock_url=redis_url, dlock_key_prefix=prefix)

    def keep_going(contention: Any) -> str:
        return f"held by {contention.holder.owner}"

    @app.task(base=LockedTask, shared=False, name="callable.t", lock_key="cb:{x}",
              on_contention=keep_going)
    def t(x: str) -> str:
        return "ran"

    with RedisLock(r, "cb:1", prefix=prefix, owner="someone", auto_renew=False):
        assert t.apply(("1",)).get() == "held by someone"
    assert t.apply(("1",)).get() == "ran"
    close_app(app)


# -- misspelt options and settings (item 9) --------------------------------------------

def _declare(app: Celery, **options: Any) -> Any:
    @app.task(base=LockedTask, shared=False, name=f"t{uuid.uuid4().hex[:6]}",
              lock_key="k:{x}", **options)
    def t(x: str) -> str:
        return x

    return t


@pytest.mark.parametrize(("option", "closest"), [
    ("lock_tll", "lock_ttl"),
    ("lock_keys", "lock_key"),
    ("lock_retries_max", "lock_retry_max"),
    ("on_contension", "on_contention"),
    ("dlock_ttl", "lock_ttl"),
])
def test_misspelt_task_option_is_refused_at_declaration(option, closest):
    app = Celery("typo", broker="memory://", set_as_current=False)
    app.finalize()  # the decorator builds the task class at once
    with pytest.raises(InvalidLockConfig) as caught:
        _declare(app, **{option: 5})
    text = str(caught.value)
    assert option in text and f"did you mean {closest}?" in text
    assert "\n" not in text


def test_misspelt_class_attribute_is_refused_at_declaration():
    with pytest.raises(InvalidLockConfig, match=r"lock_tll .*did you mean lock_ttl"):
        class Typo(LockedTask):
            lock_tll = 5

            def run(self) -> None: ...


def test_a_subclass_may_have_methods_named_lock_something():
    class Helpers(LockedTask):
        name = "cfgtests.helpers"

        def lock_report(self) -> str:
            return "fine"

        def run(self) -> None: ...

    assert Helpers().lock_report() == "fine"


def test_misspelt_annotation_is_refused_when_the_task_is_bound():
    app = Celery("typo", broker="memory://", set_as_current=False)
    app.conf.task_annotations = {"ann.t": {"lock_ttll": 3}}

    @app.task(base=LockedTask, shared=False, name="ann.t", lock_key="k:{x}")
    def t(x: str) -> str:
        return x

    with pytest.raises(InvalidLockConfig, match=r"lock_ttll .*did you mean lock_ttl"):
        app.finalize()


@pytest.mark.parametrize(("key", "closest"), [
    ("dlock_tll", "dlock_ttl"),
    ("dlock_prefix", "dlock_key_prefix"),
    ("dlock_urll", "dlock_url"),
    ("DLOCK_TTL", "dlock_ttl"),
])
def test_misspelt_app_setting_is_refused_at_first_use(redis_url, key, closest):
    app = Celery("typo", broker=redis_url, set_as_current=False)
    app.conf[key] = 5
    with pytest.raises(InvalidLockConfig) as caught:
        get_client(app)
    assert key in str(caught.value) and f"did you mean {closest}?" in str(caught.value)


def test_every_known_setting_passes_the_check(redis_url):
    app = Celery("ok", broker=redis_url, set_as_current=False)
    app.conf.update(dlock_url=redis_url, dlock_ttl=5, dlock_key_prefix="p",
                    dlock_on_contention="skip", dlock_wait=1, dlock_retry_backoff=1,
                    dlock_retry_backoff_max=2, dlock_retry_max=3, dlock_fail_open=False,
                    dlock_lock_lost_action="interrupt", dlock_redis_options={},
                    dlock_record_events=True)
    config.check_conf(app.conf)
    assert get_client(app).ping()


@pytest.mark.parametrize(("conf", "named"), [
    ({"dlock_redis_options": {"sockettimeout": 1}}, "dlock_redis_options"),
    ({"dlock_redis_options": [("socket_timeout", 1)]}, "dlock_redis_options"),
    ({"dlock_client": "redis.Redis"}, "dlock_client"),
    ({"dlock_record_events": "yes"}, "dlock_record_events"),
    ({"dlock_url": "redis://h:notaport/0"}, "dlock_url"),
    ({"dlock_url": "redis://h/0?socket_timeout=soon"}, "dlock_url"),
    ({"dlock_url": "rediss://h/0?ssl_cert_reqs=sometimes"}, "dlock_redis_options"),
])
def test_client_settings_are_checked_without_connecting(conf, named):
    app = Celery("cc", broker="memory://", set_as_current=False)
    app.conf.update({"dlock_url": "redis://127.0.0.1:1/0", **conf})
    with pytest.raises(InvalidLockConfig, match=named) as caught:
        config.check_conf(app.conf)
    assert "\n" not in str(caught.value)


# -- finding Redis as Celery does (items 5 and 6) --------------------------------------

def test_broker_url_from_the_environment(redis_url, monkeypatch, r):
    """No broker in code; CELERY_BROKER_URL (what ``celery -b`` sets) names Redis."""
    monkeypatch.setenv("CELERY_BROKER_URL", redis_url)
    tag = uuid.uuid4().hex[:8]
    app = test_app(f"env{tag}", queue=f"q-env{tag}", prefix=f"dlt{tag}",
                   result_backend=redis_url, **QUICK_POLLING)
    assert resolve_url(app.conf) == redis_url

    @app.task(base=LockedTask, bind=True, shared=False, name=f"env{tag}.t",
              lock_key="env:{k}")
    def t(self: Any, k: str) -> list[str]:
        return _held(r, f"dlt{tag}")

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        assert t.delay("1").get(timeout=RESULT_TIMEOUT) == ["env:1"]
    close_app(app)


def test_result_backend_from_the_environment(redis_url, monkeypatch):
    monkeypatch.setenv("CELERY_RESULT_BACKEND", redis_url)
    app = Celery("envbk", broker="amqp://guest:pw@localhost//", set_as_current=False)
    assert resolve_url(app.conf) == redis_url


def test_filesystem_broker_with_a_redis_result_backend(redis_url, tmp_path: Path, r):
    folder = tmp_path / "broker"
    folder.mkdir()
    tag = uuid.uuid4().hex[:8]
    app = test_app(f"fs{tag}", queue=f"q-fs{tag}", prefix=f"dlt{tag}",
                   broker_url="filesystem://", result_backend=redis_url,
                   broker_transport_options={
                       "data_folder_in": str(folder), "data_folder_out": str(folder),
                       "control_folder": str(tmp_path / "control"),
                       **QUICK_POLLING["broker_transport_options"]})
    assert resolve_url(app.conf) == redis_url

    @app.task(base=LockedTask, bind=True, shared=False, name=f"fs{tag}.t",
              lock_key="fs:{k}")
    def t(self: Any, k: str) -> list[str]:
        return _held(r, f"dlt{tag}")

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=20):
        assert t.delay("1").get(timeout=RESULT_TIMEOUT) == ["fs:1"]
    close_app(app)


@pytest.mark.parametrize(("conf", "expected"), [
    ({"broker_url": "redis+socket:///tmp/r.sock?virtual_host=3"}, "unix:///tmp/r.sock?db=3"),
    ({"broker_url": "amqp://guest@localhost//",
      "result_backend": "rediss://:pw@cache:6380/2"}, "rediss://:pw@cache:6380/2"),
    ({"broker_url": "redis://b:6379/0", "result_backend": "redis://other:6379/1"},
     "redis://b:6379/0"),
    ({"broker_url": "redis://b:6379/0", "dlock_url": "redis://d:6379/4"},
     "redis://d:6379/4"),
    # Celery's documented TLS spelling, as redis-py takes it
    ({"broker_url": "rediss://:pw@b:6380/0?ssl_cert_reqs=CERT_REQUIRED"},
     "rediss://:pw@b:6380/0?ssl_cert_reqs=required"),
])
def test_resolution_order(conf, expected):
    app = Celery("order", set_as_current=False)
    app.conf.update(conf)
    assert resolve_url(app.conf) == expected


def test_neither_broker_nor_backend_is_redis_names_dlock_url():
    app = Celery("none", broker="amqp://guest:hunter2@rabbit//", backend="rpc://",
                 set_as_current=False)
    with pytest.raises(InvalidLockConfig) as caught:
        resolve_url(app.conf)
    text = str(caught.value)
    assert "dlock_url" in text and "hunter2" not in text
    assert "amqp://guest:**@rabbit//" in text and "'rpc://'" in text
    assert json.dumps(text)  # one plain line
    assert "\n" not in text


# -- per-call keywords that look like misspelt lock options ------------------------------

@pytest.fixture
def typo_app(redis_url: str, r: redis.Redis) -> Iterator[tuple[Celery, Any, str]]:
    tag = uuid.uuid4().hex[:8]
    app = _conf_app(redis_url, tag)

    @app.task(base=LockedTask, shared=False, name=f"cfg{tag}.report",
              lock_key="report:{day}")
    def report(day: str) -> str:
        return day

    yield app, report, f"q-cfg{tag}"
    r.delete(f"q-cfg{tag}")
    close_app(app)


_ROUTES = {
    "apply_async": lambda task, kw: task.apply_async(("d1",), **kw),
    "signature.set": lambda task, kw: task.signature(("d1",)).set(**kw).apply_async(),
    "send_task": lambda task, kw: task.app.send_task(task.name, ("d1",), **kw),
}


@pytest.mark.parametrize("route", sorted(_ROUTES))
@pytest.mark.parametrize(("keyword", "closest"), [
    ("lock_mdoe", "lock_mode"),
    ("on_duplicat", "on_duplicate"),
    ("on_contension", "on_contention"),
    ("lockmode", "lock_mode"),
    ("lock_tll", "lock_ttl"),
])
def test_a_misspelt_per_call_keyword_is_refused_before_anything_is_sent(
        typo_app, r, route, keyword, closest):
    _, task, queue = typo_app
    with pytest.raises(InvalidLockConfig) as caught:
        _ROUTES[route](task, {keyword: "until_finished", "on_duplicate": "raise"})
    assert f"{keyword} is not a celery-dlock option" in str(caught.value)
    assert f"did you mean {closest}?" in str(caught.value)
    assert r.llen(queue) == 0


@pytest.mark.parametrize("route", sorted(_ROUTES))
def test_lock_options_and_celery_options_as_keywords_are_sent(typo_app, r, route):
    """The control: the check refuses near misses only, never an option of the lock or
    of Celery's own ``apply_async``."""
    _, task, queue = typo_app
    _ROUTES[route](task, {"lock_ttl": 5, "on_contention": "skip", "countdown": 0,
                          "expires": 600, "shadow": "report(d1)",
                          "retry_policy": {"max_retries": 1}})
    assert r.llen(queue) == 1


def test_dlock_record_events_is_read_once_per_task_and_process(redis_url):
    """docs/cli.md: a task reads ``dlock_record_events`` the first time it records or
    counts something; a change made afterwards is not seen by that task, and is by a
    task that had not read it yet."""
    tag = uuid.uuid4().hex[:8]
    app = _conf_app(redis_url, tag, dlock_record_events=False)
    r = redis.Redis.from_url(redis_url)

    @app.task(base=LockedTask, name=f"cfg{tag}.first", lock_key="rec1:{x}")
    def first(x: str) -> str:
        return x

    @app.task(base=LockedTask, name=f"cfg{tag}.second", lock_key="rec2:{x}")
    def second(x: str) -> str:
        return x

    def acquisitions() -> int:
        counts = minute_counts(r, f"dlt{tag}", time.time(), 5)
        return sum(counts.get("acquired", []))

    try:
        assert first.apply(("a",)).get() == "a"
        app.conf.dlock_record_events = True
        assert first.apply(("b",)).get() == "b"
        assert acquisitions() == 0
        assert second.apply(("c",)).get() == "c"
        assert acquisitions() == 1
    finally:
        close_app(app)
        r.close()
