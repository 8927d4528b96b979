"""The MySQL/MariaDB lock under faults of its own: a partition, a server restart while
held (short and past the ttl), a re-sent release, a server that refuses or does not
answer, a table of another application at the lease table's name, users missing a
privilege, and first acquires of one name racing to insert its row.

The contract tests (``lock_kind``) run on MySQL too; these are the faults whose
staging is MySQL's (a MariaDB server of this module's or this test's own, the fault
proxy in front of it: tests/mariadb_server.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from dlock_helpers import wait_until
from mariadb_server import MariaDBServer, Unavailable, connect_args
from proxy import FaultProxy

from celery_dlock import (
    BackendUnavailable,
    InvalidLockConfig,
    LockKeyConflict,
    LockLost,
    lock_from_url,
)
from celery_dlock.core.hold import new_op_id
from celery_dlock.core.protocol import STILL_HELD

pymysql = pytest.importorskip("pymysql")

pytestmark = pytest.mark.slow


def _start() -> MariaDBServer:
    try:
        server = MariaDBServer()
    except Unavailable as exc:
        pytest.skip(f"no MariaDB server: {exc}")
    try:
        return server.start()
    except Unavailable as exc:
        server.stop()
        pytest.skip(f"no MariaDB server: {exc}")


@pytest.fixture(scope="module")
def my_db() -> Iterator[MariaDBServer]:
    """A MariaDB server for this module's tests that do not stop it."""
    server = _start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_db() -> Iterator[MariaDBServer]:
    """A MariaDB server of this test's own (it may be stopped and started again)."""
    server = _start()
    try:
        yield server
    finally:
        server.stop()


def _connect(url: str) -> Any:
    return pymysql.connect(**connect_args(url), autocommit=True, connect_timeout=10)


def _name() -> str:
    return f"my-{uuid.uuid4().hex[:8]}"


class _Lost:
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, lock: Any) -> None:
        self.times.append(time.monotonic())


def _first_acquire_time(lock: Any, limit: float) -> float | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if lock.acquire(blocking=False):
                return time.monotonic()
        except BackendUnavailable:
            pass  # the server is still starting
        time.sleep(0.01)
    return None


def test_partitioned_holder_is_told_before_another_owner_acquires(my_db):
    name = _name()
    with FaultProxy(my_db.port) as proxy:
        behind = my_db.url.replace(f":{my_db.port}/", f":{proxy.port}/")
        lost = _Lost()
        holder = lock_from_url(behind, name, ttl=2, on_lost=lost)
        holder.acquire()
        proxy.black_hole()
        cut_at = time.monotonic()
        other = lock_from_url(my_db.url, name, ttl=10, owner="other")
        took_at = _first_acquire_time(other, limit=10)
        assert took_at is not None, "the partitioned hold never expired"
        assert lost.times and lost.times[0] < took_at, \
            "the holder was not told before another owner acquired"
        assert lost.times[0] - cut_at < 2.5
        with pytest.raises(LockLost):
            holder.ensure_held()
        proxy.heal()
        with pytest.raises(LockLost):
            holder.release()
        assert other.owned(), "a stale holder's release touched the successor's hold"
        other.release()


def test_a_short_restart_while_held_keeps_the_hold(own_db):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own_db.url, name, ttl=8, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own_db.halt()
    time.sleep(0.5)
    own_db.restart()
    # The row survived on the server's disk; the renewals reach it again.
    assert wait_until(holder.owned, timeout=10)
    time.sleep(8.5)  # longer than the ttl: only renewals after the restart keep it
    assert holder.owned() and not lost.times
    other = lock_from_url(own_db.url, name, ttl=5, owner="other")
    assert other.acquire(blocking=False) is False
    holder.release()
    assert other.acquire(blocking=False)
    assert other.fence is not None and fence is not None and other.fence > fence
    other.release()


def test_a_restart_longer_than_the_ttl_tells_the_holder_and_never_two_hold(own_db):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own_db.url, name, ttl=2, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own_db.halt()
    down_at = time.monotonic()
    assert wait_until(lambda: bool(lost.times), timeout=5), "the holder was not told"
    assert lost.times[0] - down_at < 2.5
    own_db.restart()
    other = lock_from_url(own_db.url, name, ttl=10, owner="other")
    took_at = _first_acquire_time(other, limit=30)
    assert took_at is not None and lost.times[0] < took_at
    # fences strictly increase across holders and the restart
    assert other.fence is not None and fence is not None and other.fence > fence
    with pytest.raises(LockLost):
        holder.ensure_held()
    with pytest.raises(LockLost):
        holder.release()
    assert other.owned()
    second_fence = other.fence
    other.release()
    third = lock_from_url(own_db.url, name, ttl=10)
    with third:
        assert third.fence is not None and third.fence > second_fence


def test_a_resent_release_undoes_one_acquire(my_db):
    # The operation id a caller's retry re-sends (core/hold.py) is recognised.
    lock = lock_from_url(my_db.url, _name(), ttl=10, owner="me")
    lock.acquire()
    lock.acquire()
    op = new_op_id()
    assert lock._send_release("me", op) == STILL_HELD
    assert lock._send_release("me", op) == STILL_HELD, "the re-send undid a 2nd acquire"
    holder = lock.holder()
    assert holder is not None and holder.count == 1
    lock.release()
    assert lock.holder() is None


def test_a_refusing_server_is_backend_unavailable_without_the_password(my_db):
    url = my_db.url.replace(f":{my_db.port}/", ":1/")
    lock = lock_from_url(url, _name())
    with pytest.raises(BackendUnavailable) as info:
        lock.acquire(blocking=False)
    assert my_db.password not in str(info.value)
    assert my_db.password not in repr(lock) + repr(info.value)
    assert "MySQL unavailable" in str(info.value)


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


@pytest.mark.parametrize("at", ["lease table", "line table"])
def test_another_applications_table_at_our_name_is_a_conflict(my_db, at):
    """A table of another application at the lease table's name, or at its line's
    (the lease table's and ``_waiters``): a conflict, and neither table is touched
    or made."""
    lease_table = f"theirs_{at[0]}" if at == "lease table" else f"ours_{at[0]}"
    found = lease_table if at == "lease table" else lease_table + "_waiters"
    with _connect(my_db.url) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {found} (id INT PRIMARY KEY, name TEXT)")
        cur.execute(f"INSERT INTO {found} VALUES (1, 'kept')")
    lock = lock_from_url(my_db.url + f"?dlock_table={lease_table}", _name())
    with pytest.raises(LockKeyConflict) as info:
        lock.acquire(blocking=False)
    assert found in str(info.value) and "nothing was changed" in str(info.value)
    with _connect(my_db.url) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {found}")
        assert cur.fetchall() == ((1, "kept"),)
        cur.execute("SELECT count(*) FROM information_schema.COLUMNS "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s", (found,))
        assert cur.fetchone() == (2,)
        cur.execute("SELECT count(*) FROM information_schema.TABLES WHERE "
                    "TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE %s",
                    (lease_table + "%",))
        assert cur.fetchone() == (1,)  # nothing made beside it


def _user(db: MariaDBServer, user: str, *grants: str) -> str:
    """A user of the test's own with only ``grants``: its URL."""
    with _connect(db.url) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'pw-{user}'")
        for grant in grants:
            cur.execute(grant.format(user=f"'{user}'@'127.0.0.1'"))
    return db.url.replace(f"dlock:{db.password}@", f"{user}:pw-{user}@")


def test_a_user_without_create_is_told_the_grants_it_needs(my_db):
    with _connect(my_db.url) as conn, conn.cursor() as cur:  # it may use the database
        cur.execute("CREATE TABLE some_table (id INT PRIMARY KEY)")
    limited = _user(my_db, "limited", "GRANT SELECT ON dlock.some_table TO {user}")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", _name())
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(blocking=False)
    said = str(info.value)
    assert "GRANT SELECT, INSERT, UPDATE ON made_for_you" in said
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in said
    assert "pw-limited" not in said
    from celery_dlock.backends.sql.my_schema import create_line_sql, create_sql

    # The setup of releases without a line: the lease table and its GRANT only.  A
    # user of it is told, at once, what the line needs (it is never left waiting).
    with _connect(my_db.url) as conn, conn.cursor() as cur:
        cur.execute(create_sql("made_for_you"))
        cur.execute("GRANT SELECT, INSERT, UPDATE ON dlock.made_for_you "
                    "TO 'limited'@'127.0.0.1'")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", _name(), ttl=5)
    started = time.monotonic()
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert time.monotonic() - started < 10
    said = str(info.value)
    assert "line of waiters made_for_you_waiters" in said
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in said
    # The line made, but without DELETE: refused with the GRANT it lacks.
    with _connect(my_db.url) as conn, conn.cursor() as cur:
        cur.execute(create_line_sql("made_for_you_waiters"))
        cur.execute("GRANT SELECT, INSERT, UPDATE ON dlock.made_for_you_waiters "
                    "TO 'limited'@'127.0.0.1'")
    name = _name()
    lock = lock_from_url(limited + "?dlock_table=made_for_you", name, ttl=5)
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in \
        str(info.value)
    # The documented least-privilege setup: an administrator makes both tables once.
    with _connect(my_db.url) as conn, conn.cursor() as cur:
        cur.execute("GRANT DELETE ON dlock.made_for_you_waiters "
                    "TO 'limited'@'127.0.0.1'")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", name, ttl=5)
    with lock:
        assert lock.owned() and lock.fence is not None
        # a blocked acquirer stands in line, and leaves it when it gives up
        other = lock_from_url(limited + "?dlock_table=made_for_you", name, ttl=5,
                              owner="other")
        assert other.acquire(timeout=0.5) is False
        assert other.waiting_count() == 0


def test_a_user_who_may_read_but_not_write_is_told_the_grant_it_lacks(my_db):
    with lock_from_url(my_db.url + "?dlock_table=read_only", _name(), ttl=5):
        pass  # the table made by a user who may
    reader = _user(my_db, "reader", "GRANT SELECT ON dlock.read_only TO {user}")
    lock = lock_from_url(reader + "?dlock_table=read_only", _name())
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(blocking=False)
    said = str(info.value)
    assert "command denied" in said and "GRANT SELECT, INSERT, UPDATE ON read_only" \
        in said
    assert "pw-reader" not in said


def test_many_holds_are_renewed_in_one_statement_per_interval(own_db):
    """However many holds a process has on one server, one UPDATE per interval renews
    them all: counted on the server (the statements and the rows it updated)."""
    locks = [lock_from_url(own_db.url, _name(), ttl=1.5) for _ in range(20)]
    for lock in locks:
        lock.acquire()
    watch = _connect(own_db.url)

    def counters() -> tuple[int, int]:
        with watch.cursor() as cur:
            cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN "
                        "('Com_update', 'Handler_update')")
            found = {str(k): int(v) for k, v in cur.fetchall()}
        return found["Com_update"], found["Handler_update"]

    try:
        time.sleep(0.2)
        updates_before, rows_before = counters()
        time.sleep(3.0)  # about six renewal intervals of 0.5 s
        updates_after, rows_after = counters()
    finally:
        watch.close()
    for lock in locks:
        assert lock.owned()
        lock.release()
    rounds = (rows_after - rows_before) / len(locks)
    assert 3 <= rounds <= 12, (rows_before, rows_after)  # every hold, every round
    statements = updates_after - updates_before
    assert statements <= rounds + 2, (statements, rounds)  # one a round, not one a hold


def test_threads_waiting_on_one_name_all_get_it_in_turn(my_db):
    name = _name()
    holder = lock_from_url(my_db.url, name, ttl=10, owner="holder")
    holder.acquire()
    got: list[str] = []

    def wait(who: str) -> None:
        lock = lock_from_url(my_db.url, name, ttl=10, owner=who)
        if lock.acquire(timeout=20):
            got.append(who)
            time.sleep(0.05)
            lock.release()

    threads = [threading.Thread(target=wait, args=(f"w{i}",), daemon=True)
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    holder.release()
    for t in threads:
        t.join(30)
    assert sorted(got) == ["w0", "w1", "w2", "w3"]


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
