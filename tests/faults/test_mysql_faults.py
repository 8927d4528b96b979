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
    from celery_dlock.backends.sql.mysql.lock import MySQLLock
    from celery_dlock.backends.sql.mysql.server import MyServer

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


def test_the_first_waiter_takes_a_freed_lock_within_its_short_poll(my_db):
    """Only the first in line can take a freed lock, so it polls every POLL_FIRST
    however long it has waited (a waiter further back, less often, up to POLL_MAX):
    a hand-off costs tens of ms, not the half second of a backoff run out."""
    from celery_dlock.backends.sql.mysql.lock import POLL_FIRST, POLL_MAX

    name = _name()
    holder = lock_from_url(my_db.url, name, ttl=30, owner="holder")
    waiter = lock_from_url(my_db.url, name, ttl=30, owner="waiter")
    delays: list[float] = []
    # Released after 1.5 s (a doubling backoff from 20 ms would have reached POLL_MAX
    # by then), at seven phases of a POLL_MAX-long sleep: a schedule of sleeps is
    # fixed but for its jitter, so one fixed wait would always hit it at one phase.
    for phase in range(7):
        assert holder.acquire(blocking=False)
        got = threading.Event()

        def wait(got: threading.Event = got) -> None:
            if waiter.acquire(timeout=30):
                got.set()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(1.5 + phase * POLL_MAX / 7)
        assert not got.is_set()
        released = time.monotonic()
        holder.release()
        assert got.wait(10)
        delays.append(time.monotonic() - released)
        thread.join(10)
        waiter.release()
    delays.sort()
    assert delays[len(delays) // 2] < 2 * POLL_FIRST < POLL_MAX / 4, delays


def test_waiters_poll_more_often_the_nearer_they_are_to_the_front(my_db):
    """A waiter's sleep between tries is POLL_FIRST times its place in line, at most
    POLL_MAX: the first polls fast, the ones behind it less and less often."""
    from celery_dlock.backends.sql.mysql.lock import POLL_FIRST, POLL_MAX, MySQLLock

    name = _name()
    holder = lock_from_url(my_db.url, name, ttl=30, owner="holder")
    assert holder.acquire(blocking=False)
    tries: dict[str, list[float]] = {}
    waiters = []
    for i in range(3):
        lock = lock_from_url(my_db.url, name, ttl=30, owner=f"w{i}")
        assert isinstance(lock, MySQLLock)
        seen = tries.setdefault(f"w{i}", [])
        original = lock._try_acquire

        def counted(*args, _original=original, _seen=seen, **kwargs):
            _seen.append(time.monotonic())
            return _original(*args, **kwargs)

        lock._try_acquire = counted  # type: ignore[method-assign]
        waiters.append(lock)
    threads = []
    for lock in waiters:  # they join the line in this order
        thread = threading.Thread(target=lock.acquire, kwargs={"timeout": 2.5})
        thread.start()
        threads.append(thread)
        time.sleep(0.2)
    for thread in threads:
        thread.join(10)
    holder.release()

    def rate(times: list[float]) -> float:
        late = [t for t in times if t >= times[0] + 1.0]  # after the line settled
        return (len(late) - 1) / (late[-1] - late[0]) if len(late) > 1 else 0.0

    rates = [rate(tries[f"w{i}"]) for i in range(3)]
    assert rates[0] > rates[1] > rates[2] > 0, rates
    assert rates[0] <= 1.5 / POLL_FIRST and rates[2] >= 0.5 / POLL_MAX, rates
