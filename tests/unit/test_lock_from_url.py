"""``lock_from_url``: one entry point that picks the backend from the URL's scheme;
``import celery_dlock`` imports no SQL driver; an unknown scheme is one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_dlock import (
    InvalidLockConfig,
    RedisLock,
    RedisSemaphore,
    RedlockLock,
    lock_from_url,
)


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_celery_dlock_imports_no_sql_driver():
    code = ("import sys, celery_dlock\n"
            "celery_dlock.lock_from_url('redis://127.0.0.1:1/0', 'n')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'psycopg'"
            " or m.startswith('celery_dlock.backends.sql')))")
    assert _python(code) == "[]"


def test_a_postgresql_url_imports_the_driver_only_then():
    pytest.importorskip("psycopg")
    code = ("import sys, celery_dlock\n"
            "lock = celery_dlock.lock_from_url('postgresql://u@127.0.0.1:1/db', 'n')\n"
            "print(type(lock).__name__, 'psycopg' in sys.modules)")
    assert _python(code) == "PostgresLock True"


def test_without_the_driver_the_error_names_the_extra():
    code = ("import sys\n"
            "sys.modules['psycopg'] = None\n"
            "import celery_dlock\n"
            "try:\n"
            "    celery_dlock.lock_from_url('postgres://u:secret@h/db', 'n')\n"
            "except celery_dlock.InvalidLockConfig as exc:\n"
            "    print(exc)\n")
    said = _python(code)
    assert "pip install 'celery-dlock[postgres]'" in said and "secret" not in said


def test_redis_urls_give_the_redis_kinds():
    assert isinstance(lock_from_url("redis://127.0.0.1:1/0", "n"), RedisLock)
    assert isinstance(lock_from_url("unix:///tmp/nothing.sock", "n"), RedisLock)
    trio = ";".join(f"redlock://127.0.0.1:{p}/0" for p in (1, 2, 3))
    assert isinstance(lock_from_url(trio, "n"), RedlockLock)
    assert isinstance(lock_from_url([f"redis://127.0.0.1:{p}/0" for p in (1, 2, 3)],
                                    "n"), RedlockLock)


def test_options_reach_the_lock():
    lock = lock_from_url("redis://127.0.0.1:1/0", "n", ttl=7, prefix="p", owner="o",
                         blocking_timeout=3)
    assert lock.ttl == 7 and lock.blocking_timeout == 3  # type: ignore[attr-defined]
    with pytest.raises(InvalidLockConfig):
        lock_from_url("redis://127.0.0.1:1/0", "n", blocking_timeout=-1)


def test_max_hold_and_limit_reach_the_lock():
    lock = lock_from_url("redis://127.0.0.1:1/0", "n", ttl=5, max_hold=60)
    assert isinstance(lock, RedisLock) and lock.max_hold == 60
    slots = lock_from_url("redis://127.0.0.1:1/0", "n", ttl=5, limit=3)
    assert isinstance(slots, RedisSemaphore) and slots.limit == 3
    assert lock_from_url("redis://127.0.0.1:1/0", "n", ttl=5, max_hold=1).max_hold == 1
    with pytest.raises(InvalidLockConfig, match="max_hold"):
        lock_from_url("redis://127.0.0.1:1/0", "n", ttl=5, max_hold=0)
    trio = ";".join(f"redlock://127.0.0.1:{p}/0" for p in (1, 2, 3))
    with pytest.raises(InvalidLockConfig, match="lock_limit"):
        lock_from_url(trio, "n", limit=2)


@pytest.mark.parametrize("url", ["ftp://u:secret@host/x", "nonsense",
                                 "mongodb://u:secret@h/x", 42])
def test_an_unknown_scheme_names_the_known_ones(url):
    with pytest.raises(InvalidLockConfig) as info:
        lock_from_url(url, "n")
    text = str(info.value)
    assert "postgresql://" in text and "redis://" in text and "zookeeper://" in text
    assert "mysql://" in text and "mariadb://" in text
    assert "secret" not in text


@pytest.mark.parametrize("scheme", ["mysql", "mariadb", "MySQL"])
def test_a_mysql_url_imports_the_driver_only_then(scheme):
    pytest.importorskip("pymysql")
    code = ("import sys, celery_dlock\n"
            f"lock = celery_dlock.lock_from_url('{scheme}://u:pw@127.0.0.1:1/db', 'n')\n"
            "print(type(lock).__name__, 'pymysql' in sys.modules, 'psycopg' in "
            "sys.modules, 'pw' in repr(lock))")
    assert _python(code) == "MySQLLock True False False"


def test_import_celery_dlock_imports_no_mysql_driver():
    code = ("import sys, celery_dlock\n"
            "celery_dlock.lock_from_url('redis://127.0.0.1:1/0', 'n')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pymysql'))")
    assert _python(code) == "[]"


def test_without_pymysql_the_error_names_the_extra():
    code = ("import sys\n"
            "sys.modules['pymysql'] = None\n"
            "import celery_dlock\n"
            "try:\n"
            "    celery_dlock.lock_from_url('mysql://u:secret@h/db', 'n')\n"
            "except celery_dlock.InvalidLockConfig as exc:\n"
            "    print(exc)\n")
    said = _python(code)
    assert "pip install 'celery-dlock[mysql]'" in said and "secret" not in said


@pytest.mark.parametrize(("url", "says"), [
    ("mysql://u:secret@h/db?colour=red", "unknown parameter 'colour'"),
    ("mysql://u:secret@h", "names no database"),
    ("mysql://u:secret@h/db?dlock_table=a;drop", "not a table name"),
    ("mysql://u:secret@h/db?read_timeout=soon", "not a number of seconds"),
    ("mysql://u:secret@h:port/db", "port"),
])
def test_a_mysql_url_it_cannot_read_is_one_clear_error(url, says):
    pytest.importorskip("pymysql")
    with pytest.raises(InvalidLockConfig) as info:
        lock_from_url(url, "n")
    assert says in str(info.value) and "secret" not in str(info.value)


def test_a_zookeeper_url_gives_a_zookeeper_lock():
    pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")
    from celery_dlock.backends.zookeeper import ZooKeeperLock

    lock = lock_from_url("zookeeper://127.0.0.1:1,127.0.0.1:2/locks", "n", ttl=5)
    assert isinstance(lock, ZooKeeperLock) and lock.ttl == 5  # no server call yet


@pytest.mark.parametrize("url", ["postgresql://u@h/db", "mysql://u:pw@h/db",
                                 "mariadb://u@h/db"])
def test_a_sql_dlock_url_is_accepted_and_record_events_refused(url):
    from celery_dlock.task.config import check_conf

    check_conf({"dlock_url": url})  # no server call
    with pytest.raises(InvalidLockConfig, match="dlock_record_events needs a Redis"):
        check_conf({"dlock_url": url, "dlock_record_events": True})
    with pytest.raises(InvalidLockConfig, match="known schemes"):
        check_conf({"dlock_url": "ftp://h/x"})


@pytest.mark.parametrize(("conf", "found"), [
    ({"dlock_url": "postgresql://u@h/db"}, "postgresql://u@h/db"),
    ({"broker_url": "amqp://h//", "result_backend": "db+postgresql://u@h/db"},
     "postgresql://u@h/db"),
    ({"broker_url": "sqla+postgresql+psycopg://u@h/db"}, "postgresql://u@h/db"),
    # a Redis is found first, as before
    ({"broker_url": "redis://h:6379/0", "result_backend": "db+postgresql://u@h/db"},
     None),
    ({"dlock_url": "redis://h:6379/0"}, None),
    ({"broker_url": "amqp://h//", "result_backend": "rpc://"}, None),
])
def test_postgresql_is_found_as_redis_is(conf, found):
    from celery_dlock.task.connection import sql_url_of

    assert sql_url_of(conf) == found


@pytest.mark.parametrize(("driver", "url", "kind"), [
    ("psycopg", "postgresql://u@127.0.0.1:1/db", "postgres"),
    ("pymysql", "mysql://u@127.0.0.1:1/db", "mysql"),
])
def test_the_sql_stores_keep_queue_markers(driver, url, kind):
    """Enqueue-time modes on a SQL lock store: its marker store, with no server
    call (the markers table is made at the first marker step)."""
    pytest.importorskip(driver)
    from celery_dlock.backends.sql.markers import SqlMarkers
    from celery_dlock.task.backend import backend_from_url, markers_for

    backend = backend_from_url(url)
    assert backend.kind == kind
    assert isinstance(markers_for(None, backend), SqlMarkers)


def test_zookeeper_keeps_queue_markers():
    """Enqueue-time modes on ZooKeeper: its marker store, with no server call (the
    nodes are made at the first marker step)."""
    pytest.importorskip("kazoo")
    from celery_dlock.backends.zookeeper.markers import ZkMarkers
    from celery_dlock.task.backend import backend_from_url, markers_for

    backend = backend_from_url("zookeeper://127.0.0.1:1")
    store = markers_for(None, backend)
    assert isinstance(store, ZkMarkers)
    assert markers_for(None, backend) is store  # one per backend


def test_enqueue_time_modes_are_refused_on_redlock_in_one_line():
    """Redlock is the one backend that keeps no queue markers: said in one line, with
    the backends that keep them."""
    from celery_dlock.core.errors import NotSupported
    from celery_dlock.task.backend import backend_from_url, markers_for

    trio = ";".join(f"redlock://127.0.0.1:{p}/0" for p in (1, 2, 3))
    with pytest.raises(NotSupported, match="redlock backend does not keep") as info:
        markers_for(None, backend_from_url(trio))
    assert "\n" not in str(info.value) and "zookeeper" in str(info.value)


def _mode_body() -> None:
    """A task body (Celery needs a named function)."""


@pytest.mark.parametrize(("url", "refused"), [
    (";".join(f"redlock://127.0.0.1:{port}/0" for port in (1, 2, 3)), True),
    ("postgresql://dlock@127.0.0.1:1/dlock", False),
    ("mysql://dlock@127.0.0.1:1/dlock", False),
    ("redis://127.0.0.1:1/0", False),
    ("zookeeper://127.0.0.1:1/dlock", False),
])
def test_a_declared_lock_mode_is_checked_against_the_store_at_worker_start(
        url, refused):
    """A task declared with a lock_mode on a store without queue markers is refused
    when the worker starts (naming the option and the stores that keep them), not at
    its first send; a store that keeps them passes (no server is asked)."""
    from celery import Celery

    from celery_dlock import LockedTask
    from celery_dlock.core.errors import NotSupported
    from celery_dlock.task.startup import check_app

    app = Celery("modes-at-start", broker="memory://", set_as_current=False)
    app.finalize()
    app.conf.dlock_url = url
    app.task(base=LockedTask, name="once_only", lock_mode="until_finished",
             shared=False)(_mode_body)
    if refused:
        with pytest.raises(NotSupported, match=r"lock_mode='until_finished'.*redis"):
            check_app(app)
    else:
        check_app(app)
    app.conf.dlock_enabled = False
    check_app(app)  # locks and markers off: nothing to keep
