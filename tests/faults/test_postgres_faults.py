"""The PostgreSQL lock under faults of its own: a partition, a server restart while
held (short and past the ttl), a re-sent release, an unreachable server, a table of
another application at the lease table's name, and a user without CREATE.

The contract tests (``lock_kind``) run on PostgreSQL too; these are the faults whose
staging is PostgreSQL's (its own throwaway server, the fault proxy in front of it).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from dlock_helpers import wait_until
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

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.slow


@pytest.fixture
def own_pg() -> Iterator[Any]:
    """A PostgreSQL server of this test's own (it may be killed and restarted)."""
    from fencing.pg_server import PostgresServer, Unavailable

    try:
        server = PostgresServer().start()
    except Unavailable as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


def _name() -> str:
    return f"pg-{uuid.uuid4().hex[:8]}"


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


def test_partitioned_holder_is_told_before_another_owner_acquires(own_pg):
    name = _name()
    with FaultProxy(own_pg.port) as proxy:
        behind = own_pg.url.replace(f":{own_pg.port}/", f":{proxy.port}/")
        lost = _Lost()
        holder = lock_from_url(behind, name, ttl=2, on_lost=lost)
        holder.acquire()
        proxy.black_hole()
        cut_at = time.monotonic()
        other = lock_from_url(own_pg.url, name, ttl=10, owner="other")
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


def test_a_short_restart_while_held_keeps_the_hold(own_pg):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own_pg.url, name, ttl=6, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own_pg.halt()
    time.sleep(0.5)
    own_pg.restart()
    # The row survived on the server's disk; the renewals reach it again.
    assert wait_until(holder.owned, timeout=10)
    time.sleep(6.5)  # longer than the ttl: only renewals after the restart keep it
    assert holder.owned() and not lost.times
    other = lock_from_url(own_pg.url, name, ttl=5, owner="other")
    assert other.acquire(blocking=False) is False
    holder.release()
    assert other.acquire(blocking=False)
    assert other.fence is not None and fence is not None and other.fence > fence
    other.release()


def test_a_restart_longer_than_the_ttl_tells_the_holder_and_never_two_hold(own_pg):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own_pg.url, name, ttl=2, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own_pg.halt()
    down_at = time.monotonic()
    assert wait_until(lambda: bool(lost.times), timeout=5), "the holder was not told"
    assert lost.times[0] - down_at < 2.5
    own_pg.restart()
    other = lock_from_url(own_pg.url, name, ttl=10, owner="other")
    took_at = _first_acquire_time(other, limit=15)
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
    third = lock_from_url(own_pg.url, name, ttl=10)
    with third:
        assert third.fence is not None and third.fence > second_fence


def test_a_resent_release_undoes_one_acquire(own_pg):
    # The operation id a caller's retry re-sends (core/hold.py) is recognised.
    lock = lock_from_url(own_pg.url, _name(), ttl=10, owner="me")
    lock.acquire()
    lock.acquire()
    op = new_op_id()
    assert lock._send_release("me", op) == STILL_HELD
    assert lock._send_release("me", op) == STILL_HELD, "the re-send undid a 2nd acquire"
    holder = lock.holder()
    assert holder is not None and holder.count == 1


def test_an_unreachable_server_is_backend_unavailable(own_pg):
    url = own_pg.url.replace(f":{own_pg.port}/", ":1/").replace("dlock@", "dlock:pw@")
    lock = lock_from_url(url, _name())
    with pytest.raises(BackendUnavailable) as info:
        lock.acquire(blocking=False)
    assert "pw" not in str(info.value)
    assert "PostgreSQL unavailable" in str(info.value)


@pytest.mark.parametrize("at", ["lease table", "line table"])
def test_another_applications_table_at_our_name_is_a_conflict(own_pg, at):
    """A table of another application at the lease table's name, or at its line's
    (the lease table's and ``_waiters``): a conflict, and neither table is touched
    or made."""
    lease_table = "theirs" if at == "lease table" else "ours"
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE theirs (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO theirs VALUES (1, 'kept')")
        if at == "line table":
            conn.execute("ALTER TABLE theirs RENAME TO ours_waiters")
    lock = lock_from_url(own_pg.url + f"?dlock_table={lease_table}", _name())
    with pytest.raises(LockKeyConflict) as info:
        lock.acquire(blocking=False)
    found = "theirs" if at == "lease table" else "ours_waiters"
    assert found in str(info.value) and "nothing was changed" in str(info.value)
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        assert conn.execute(f"SELECT * FROM {found}").fetchall() == [(1, "kept")]
        columns = conn.execute("SELECT count(*) FROM information_schema.columns "
                               "WHERE table_name = %s", (found,)).fetchone()
        assert columns == (2,)
        made = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename "
                            "LIKE 'ours%%' OR tablename LIKE 'theirs%%'").fetchone()
        assert made == (1,)  # nothing made beside it


def test_a_user_without_create_is_told_the_grants_it_needs(own_pg):
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute("CREATE ROLE limited LOGIN")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    limited = own_pg.url.replace("dlock@", "limited@")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", _name())
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(blocking=False)
    assert "GRANT SELECT, INSERT, UPDATE ON made_for_you" in str(info.value)
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in \
        str(info.value)
    from celery_dlock.backends.sql.schema import create_line_sql, create_sql

    # The setup of releases without a line: the lease table and its GRANT only.  A
    # user of it is told, at once, what the line needs (it is never left waiting).
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute(create_sql("made_for_you"))
        conn.execute("GRANT SELECT, INSERT, UPDATE ON made_for_you TO limited")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", _name(), ttl=5)
    started = time.monotonic()
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert time.monotonic() - started < 10
    assert "line of waiters made_for_you_waiters does not exist" in str(info.value)
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in \
        str(info.value)
    # The line made, but without DELETE: refused with the GRANT it lacks.
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute(create_line_sql("made_for_you_waiters"))
        conn.execute("GRANT SELECT, INSERT, UPDATE ON made_for_you_waiters TO limited")
    lock = lock_from_url(limited + "?dlock_table=made_for_you", _name(), ttl=5)
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in \
        str(info.value)
    # The documented least-privilege setup: an administrator makes both tables once.
    with psycopg.connect(own_pg.url, autocommit=True) as conn:
        conn.execute("GRANT DELETE ON made_for_you_waiters TO limited")
    name = _name()
    lock = lock_from_url(limited + "?dlock_table=made_for_you", name, ttl=5)
    with lock:
        assert lock.owned() and lock.fence is not None
        # a blocked acquirer stands in line, and leaves it when it gives up
        other = lock_from_url(limited + "?dlock_table=made_for_you", name, ttl=5,
                              owner="other")
        assert other.acquire(timeout=0.5) is False
        assert other.waiting_count() == 0


def test_many_holds_are_renewed_in_one_statement_per_interval(own_pg):
    """However many holds a process has on one server, one renewal statement per
    interval renews them all: counted on the server, in transactions (each statement
    is one) and in updated rows."""
    locks = [lock_from_url(own_pg.url, _name(), ttl=1.5) for _ in range(20)]
    for lock in locks:
        lock.acquire()
    watch = psycopg.connect(own_pg.url, autocommit=True)

    def counters() -> tuple[int, int]:
        watch.execute("SELECT pg_stat_force_next_flush()")
        xacts = watch.execute("SELECT xact_commit FROM pg_stat_database "
                              "WHERE datname = current_database()").fetchone()
        rows = watch.execute("SELECT n_tup_upd FROM pg_stat_user_tables "
                             "WHERE relname = 'dlock_locks'").fetchone()
        assert xacts is not None and rows is not None
        return int(xacts[0]), int(rows[0])

    try:
        time.sleep(0.2)
        xacts_before, rows_before = counters()
        time.sleep(3.0)  # about six renewal intervals of 0.5 s
        xacts_after, rows_after = counters()
    finally:
        watch.close()
    for lock in locks:
        assert lock.owned()
        lock.release()
    rounds = (rows_after - rows_before) / len(locks)
    assert 3 <= rounds <= 12, (rows_before, rows_after)  # every hold, every round
    # one statement a round (and the 3 of the watch's own reads), not one a hold
    statements = xacts_after - xacts_before - 3
    assert statements <= 2 * rounds + 2, (statements, rounds)


def test_threads_waiting_on_one_name_all_get_it_in_turn(own_pg):
    name = _name()
    holder = lock_from_url(own_pg.url, name, ttl=10, owner="holder")
    holder.acquire()
    got: list[str] = []

    def wait(who: str) -> None:
        lock = lock_from_url(own_pg.url, name, ttl=10, owner=who)
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
