"""The MySQL/MariaDB lock under faults of its own: a server that does not answer, a
user who may read but not write, first acquires of one name racing to insert its row,
and ``mariadb://`` URLs.

The faults both SQL locks share (a partition, restarts, a re-sent release, a refusing
server, another application's table, a user without CREATE, the renewal's cost,
waiting threads) are tests/faults/test_sql_faults.py's, the ``[mysql]`` cases; the
contract tests (``lock_kind``) run on MySQL too.  Staging: a MariaDB server of this
module's (tests/mariadb_server.py), the fault proxy in front of it.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from proxy import FaultProxy
from sql_dbs import MariaDBServer, mysql_user

from celery_dlock import BackendUnavailable, InvalidLockConfig, lock_from_url

pytestmark = pytest.mark.slow


@pytest.fixture
def my_db(shared_mariadb: MariaDBServer) -> MariaDBServer:
    """This module's MariaDB server (tests/faults/conftest.py)."""
    return shared_mariadb


def _name() -> str:
    return f"my-{uuid.uuid4().hex[:8]}"


def test_a_server_that_does_not_answer_is_backend_unavailable_in_bounded_time(my_db):
    with FaultProxy(my_db.port) as proxy:
        proxy.black_hole()
        url = (my_db.url.replace(f":{my_db.port}/", f":{proxy.port}/")
               + "?connect_timeout=1&read_timeout=1")
        lock = lock_from_url(url.replace("mysql://", "mariadb://", 1), _name())
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as info:
            lock.acquire(blocking=False)
        assert time.monotonic() - started < 10
        assert my_db.password not in str(info.value)


def test_a_user_who_may_read_but_not_write_is_told_the_grant_it_lacks(my_db):
    with lock_from_url(my_db.url + "?dlock_table=read_only", _name(), ttl=5):
        pass  # the table made by a user who may
    reader = mysql_user(my_db, "reader", "GRANT SELECT ON dlock.read_only TO {user}")
    lock = lock_from_url(reader + "?dlock_table=read_only", _name())
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(blocking=False)
    said = str(info.value)
    assert "command denied" in said and "GRANT SELECT, INSERT, UPDATE ON read_only" \
        in said
    assert "pw-reader" not in said


def test_first_acquires_of_a_new_name_at_once_give_one_holder(my_db):
    """Several processes' first acquires of a name race to insert its row: one gets
    it, the others are refused (none fails), and the fence is given once."""
    from celery_dlock.backends.sql.my_server import MyServer
    from celery_dlock.backends.sql.mysql import MySQLLock

    name = _name()
    locks = [MySQLLock(MyServer(my_db.url), name, ttl=10, owner=f"o{i}")
             for i in range(6)]
    barrier = threading.Barrier(len(locks))
    got: list[bool] = []
    errors: list[BaseException] = []

    def take(lock: MySQLLock) -> None:
        try:
            barrier.wait(10)
            got.append(lock.acquire(blocking=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(got) == [False] * 5 + [True]
    [winner] = [lock for lock in locks if lock.depth]
    holder = winner.holder()
    assert holder is not None and holder.owner == winner._fixed_owner
    assert holder.fence == winner.fence
    winner.release()


def test_mariadb_url_and_repr_hide_the_password(my_db):
    url = my_db.url.replace("mysql://", "mariadb://", 1)
    lock = lock_from_url(url, _name(), ttl=5)
    assert type(lock).__name__ == "MySQLLock"
    assert my_db.password not in repr(lock)
    assert my_db.password not in repr(lock.server)  # type: ignore[attr-defined]
    with lock:
        assert lock.owned()
