"""The backend registry (``celery_dlock.core.registry``): which backend a URL names,
what each can do, and that every backend, the Celery face's checks and
docs/backends.md's table say the same."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_dlock import InvalidLockConfig
from celery_dlock.core import registry
from celery_dlock.core.registry import (
    CAPABILITIES,
    ENTRIES,
    LIMIT,
    MARKERS,
    RATES,
    Entry,
    entry_for,
    entry_named,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


@pytest.mark.parametrize(("url", "kind"), [
    ("redis://localhost:6379/0", "redis"),
    ("REDISS://h:6380/1", "redis"),
    ("unix:///tmp/r.sock?db=2", "redis"),
    ("redis+cluster://h:7000", "redis"),
    ("sentinel://h:26379;sentinel://g:26379", "redis"),
    ("redis+socket:///tmp/r.sock", "redis"),
    ("redlock://a:1/0;redlock://b:1/0;redlock://c:1/0", "redlock"),
    (["redis://a/0", "redis://b/0", "redis://c/0"], "redlock"),
    ("postgresql://u@db/app", "postgres"),
    ("postgres://u@db/app", "postgres"),
    ("mysql://u@db/app", "mysql"),
    ("mariadb://u@db/app", "mysql"),
    ("zookeeper://a:2181,b:2181/locks", "zookeeper"),
])
def test_a_url_names_its_backend_by_its_form(url: object, kind: str) -> None:
    entry = entry_for(url)
    assert entry is not None and entry.kind == kind


@pytest.mark.parametrize("url", ["amqp://guest@h//", "http://x", "localhost:6379", None,
                                 42, "", "filesystem:///tmp"])
def test_no_backend_reads_other_urls(url: object) -> None:
    assert entry_for(url) is None


def _backend_classes() -> dict[str, type]:
    from celery_dlock.backends.redis.backend import RedisBackend
    from celery_dlock.backends.redis.redlock.backend import RedlockBackend
    from celery_dlock.backends.sql.mysql.backend import MySQLBackend
    from celery_dlock.backends.sql.postgres.backend import PostgresBackend
    from celery_dlock.backends.zookeeper.backend import ZooKeeperBackend
    return {"redis": RedisBackend, "redlock": RedlockBackend, "postgres": PostgresBackend,
            "mysql": MySQLBackend, "zookeeper": ZooKeeperBackend}


def test_every_backend_declares_the_registrys_capabilities() -> None:
    classes = _backend_classes()
    assert set(classes) == {e.kind for e in ENTRIES}
    for kind, cls in classes.items():
        entry = entry_named(kind)
        assert cls.kind == kind  # type: ignore[attr-defined]
        assert cls.capabilities == entry.capabilities, kind  # type: ignore[attr-defined]
        assert entry.capabilities <= set(CAPABILITIES)
        # what it says it keeps, it offers: markers(), rates(), fencing tokens
        if entry.can(MARKERS):
            assert callable(getattr(cls, "markers", None)), kind
        if entry.can(RATES):
            assert callable(getattr(cls, "rates", None)), kind
        assert cls.fences == entry.can("fencing"), kind  # type: ignore[attr-defined]


def test_docs_table_says_what_the_registry_says() -> None:
    text = DOCS.read_text(encoding="utf-8")
    header = re.search(r"^\| capability \| what needs it \|(.*)\|$", text, re.M)
    assert header is not None, "docs/backends.md has the capability table"
    kinds = [k.strip() for k in header.group(1).split("|")]
    assert kinds == [e.kind for e in ENTRIES]
    block = text[header.end():].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\|(.*)\|$", block, re.M)
    table = {cap: [c.strip() for c in cells.split("|")] for cap, cells in rows}
    assert set(table) == set(CAPABILITIES)
    for cap, cells in table.items():
        said = {k for k, c in zip(kinds, cells, strict=True) if c == "yes"}
        assert said == {e.kind for e in ENTRIES if e.can(cap)}, cap


def test_a_backend_whose_driver_is_missing_names_the_extra() -> None:
    entry = Entry("nodriver", ("nodriver",), "celery_dlock_no_such_module.backend",
                  frozenset(), "nodriver", "a driver")
    with pytest.raises(InvalidLockConfig,
                       match=r"nodriver:// locks need a driver: pip install "
                             r"'celery-dlock\[nodriver\]'"):
        entry.driver()


@pytest.mark.parametrize(("kind", "driver", "extra"), [
    ("postgres", "psycopg", "postgres"), ("mysql", "pymysql", "mysql")])
def test_a_sql_dialects_package_without_its_driver_names_the_extra(
        kind: str, driver: str, extra: str) -> None:
    """Each SQL dialect's package imports its driver when imported (its modules need
    it), so the registry names the extra; the shared SQL modules need no driver."""
    code = (f"import sys\nsys.modules[{driver!r}] = None\n"
            "import celery_dlock.backends.sql.lease, celery_dlock.backends.sql.server\n"
            "from celery_dlock.core.registry import entry_named\n"
            "try:\n"
            f"    entry_named({kind!r}).driver()\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("InvalidLockConfig "), out.stdout
    assert f"pip install 'celery-dlock[{extra}]'" in out.stdout


def test_a_driver_is_imported_once() -> None:
    first = entry_named("redis").driver()
    assert entry_named("redlock").driver() is first  # the family shares its module
    assert registry.redis_driver() is first


def test_a_missing_capability_names_the_setting_and_who_has_it() -> None:
    text = entry_named("redlock").missing(LIMIT, "task 't': lock_limit=3")
    assert text.startswith("task 't': lock_limit=3 needs semaphores")
    assert "redlock backend does not keep" in text
    assert "kept by: redis, postgres, mysql, zookeeper" in text


@pytest.mark.parametrize(("settings", "refused", "keeps_rates"), [
    ({"dlock_url": "zookeeper://127.0.0.1:1/x"}, None, True),
    ({"dlock_url": "mysql://u@127.0.0.1:1/app"}, None, True),
    ({"dlock_url": ["redis://a:1/0", "redis://b:1/0", "redis://c:1/0"]}, "redlock",
     False),
    # no dlock_url: the locks follow a PostgreSQL broker, and so does the check
    # (PostgreSQL keeps rates and semaphores)
    ({"broker_url": "sqla+postgresql://u@127.0.0.1:1/app"}, None, True),
    ({"broker_url": "redis://127.0.0.1:1/0"}, None, True),
    ({"dlock_url": "redis+cluster://127.0.0.1:1"}, None, True),
])
def test_the_checks_at_declaration_ask_the_backend_the_settings_name(
        settings: dict[str, object], refused: str | None, keeps_rates: bool) -> None:
    from celery import Celery

    from celery_dlock.core.errors import NotSupported
    from celery_dlock.task.backend import check_limit_supported
    from celery_dlock.task.rate import check_rates_supported

    app = Celery("registry-check", set_as_current=False)
    app.conf.update(settings)
    if refused is None:
        check_limit_supported(app, 3, "task 't'")
        check_rates_supported(app, "task 't'")
        return
    with pytest.raises(InvalidLockConfig, match=f"the {refused} backend does not keep"):
        check_limit_supported(app, 3, "task 't'")
    if keeps_rates:
        check_rates_supported(app, "task 't'")
        return
    with pytest.raises(NotSupported, match=f"the {refused} backend does not keep"):
        check_rates_supported(app, "task 't'")
