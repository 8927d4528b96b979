"""The PostgreSQL lock under a fault of its own: connections making the lease table
at the same moment.

The faults both SQL locks share (a partition, restarts, a re-sent release, an
unreachable server, another application's table, a user without CREATE, the renewal's
cost, waiting threads) are tests/faults/test_sql_faults.py's, the ``[postgres]`` cases;
the contract tests (``lock_kind``) run on PostgreSQL too.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from sql_dbs import SqlDb, own_db

from celery_dlock import lock_from_url

pytestmark = pytest.mark.slow


@pytest.fixture
def own_pg() -> Iterator[SqlDb]:
    """A PostgreSQL server of this test's own."""
    yield from own_db("postgres")


def _name() -> str:
    return f"pg-{uuid.uuid4().hex[:8]}"


def test_processes_making_the_table_at_once_all_get_it(own_pg):
    """``CREATE TABLE IF NOT EXISTS`` run at the same moment by several connections
    can fail in one of them (PostgreSQL's catalog); none of the locks may."""
    from celery_dlock.backends.sql.postgres.server import PgServer

    url = own_pg.url + "?dlock_table=made_at_once"
    servers = [PgServer(url) for _ in range(8)]
    barrier = threading.Barrier(len(servers))
    errors: list[BaseException] = []

    def make(server: PgServer) -> None:
        try:
            barrier.wait(10)
            server.ensure_table()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    with lock_from_url(url, _name(), ttl=5) as lock:
        assert lock.owned()


@pytest.mark.parametrize("table, said", [
    ("", "not a table name"),
    ("a.", "not a table name"),
    (".a", "not a table name"),
    ("db.schema.t", "not a table name"),
    ("t" * 56, "too long"),  # its line, t..._waiters, passes 63 bytes
    ("é" * 28, "too long"),  # 56 bytes, and the line's 64
    ("s" * 64 + ".t", "too long"),
])
def test_a_table_name_postgresql_cannot_keep_is_refused_where_the_lock_is_made(
        table, said):
    """PostgreSQL cuts a name past 63 bytes short without an error: two tables
    (``..._waiters`` of two long names) could meet.  Refused at once, with no server
    asked."""
    from celery_dlock import InvalidLockConfig

    url = f"postgresql://dlock:secret-pw@127.0.0.1:1/postgres?dlock_table={table}"
    with pytest.raises(InvalidLockConfig, match=said) as info:
        lock_from_url(url, _name())
    assert "secret-pw" not in str(info.value)


def test_the_longest_table_names_work_and_a_missing_schema_is_invalid_config(own_pg):
    from celery_dlock import InvalidLockConfig

    longest = "t" * 55  # and its line, 63 bytes
    with lock_from_url(f"{own_pg.url}?dlock_table=public.{longest}", _name(),
                       ttl=5) as lock:
        assert lock.owned()
    lock = lock_from_url(f"{own_pg.url}?dlock_table=nosuch.locks", _name(), ttl=5)
    with pytest.raises(InvalidLockConfig, match="no such schema"):
        lock.acquire(blocking=False)
