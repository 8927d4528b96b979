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
    from celery_dlock.backends.sql.pg_server import PgServer

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
