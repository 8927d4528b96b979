"""The SQL locks (PostgreSQL, MySQL/MariaDB) under the faults they share: a partition,
a server restart while held (short and past the ttl), a re-sent release, a server
that refuses, a table of another application at the lease table's name, a user
without CREATE, the renewal's cost, threads waiting in turn.

Each test runs on both (``[postgres]``, ``[mysql]``), on a server of the test's own
or of this module's (tests/faults/sql_dbs.py), the fault proxy in front of it.  The
faults whose staging is one server's alone are in ``test_postgres_faults.py`` and
``test_mysql_faults.py``; the contract tests (``lock_kind``) run on both too.
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
from sql_dbs import MySQLDb, SqlDb, own_db

from celery_dlock import (
    BackendUnavailable,
    InvalidLockConfig,
    LockKeyConflict,
    LockLost,
    lock_from_url,
)
from celery_dlock.core.hold import new_op_id
from celery_dlock.core.protocol import STILL_HELD

pytestmark = pytest.mark.slow

KINDS = ["postgres", "mysql"]


@pytest.fixture(params=KINDS)
def db(request: pytest.FixtureRequest) -> Iterator[SqlDb]:
    """A server the test does not stop: PostgreSQL's its own, MariaDB's this
    module's."""
    if request.param == "mysql":
        yield MySQLDb(request.getfixturevalue("shared_mariadb"))
    else:
        yield from own_db(request.param)


@pytest.fixture(params=KINDS)
def own(request: pytest.FixtureRequest) -> Iterator[SqlDb]:
    """A server of the test's own (it may be stopped and started again)."""
    yield from own_db(request.param)


def _name() -> str:
    return f"sql-{uuid.uuid4().hex[:8]}"


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


def test_partitioned_holder_is_told_before_another_owner_acquires(db):
    name = _name()
    with FaultProxy(db.port) as proxy:
        lost = _Lost()
        holder = lock_from_url(db.behind(proxy.port), name, ttl=2, on_lost=lost)
        holder.acquire()
        proxy.black_hole()
        cut_at = time.monotonic()
        other = lock_from_url(db.url, name, ttl=10, owner="other")
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


def test_a_short_restart_while_held_keeps_the_hold(own):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own.url, name, ttl=own.restart_ttl, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own.halt()
    time.sleep(0.5)
    own.restart()
    # The row survived on the server's disk; the renewals reach it again.
    assert wait_until(holder.owned, timeout=10)
    time.sleep(own.restart_ttl + 0.5)  # only renewals after the restart keep it
    assert holder.owned() and not lost.times
    other = lock_from_url(own.url, name, ttl=5, owner="other")
    assert other.acquire(blocking=False) is False
    holder.release()
    assert other.acquire(blocking=False)
    assert other.fence is not None and fence is not None and other.fence > fence
    other.release()


def test_a_restart_longer_than_the_ttl_tells_the_holder_and_never_two_hold(own):
    name = _name()
    lost = _Lost()
    holder = lock_from_url(own.url, name, ttl=2, on_lost=lost)
    holder.acquire()
    fence = holder.fence
    own.halt()
    down_at = time.monotonic()
    assert wait_until(lambda: bool(lost.times), timeout=5), "the holder was not told"
    assert lost.times[0] - down_at < 2.5
    own.restart()
    other = lock_from_url(own.url, name, ttl=10, owner="other")
    took_at = _first_acquire_time(other, limit=own.restart_limit)
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
    third = lock_from_url(own.url, name, ttl=10)
    with third:
        assert third.fence is not None and third.fence > second_fence


def test_a_resent_release_undoes_one_acquire(db):
    # The operation id a caller's retry re-sends (core/hold.py) is recognised.
    lock = lock_from_url(db.url, _name(), ttl=10, owner="me")
    lock.acquire()
    lock.acquire()
    op = new_op_id()
    assert lock._send_release("me", op) == STILL_HELD
    assert lock._send_release("me", op) == STILL_HELD, "the re-send undid a 2nd acquire"
    holder = lock.holder()
    assert holder is not None and holder.count == 1
    lock.release()
    assert lock.holder() is None


def test_a_refusing_server_is_backend_unavailable_without_the_password(db):
    url, password = db.refusing()
    lock = lock_from_url(url, _name())
    with pytest.raises(BackendUnavailable) as info:
        lock.acquire(blocking=False)
    assert password not in str(info.value)
    assert password not in repr(lock) + repr(info.value)
    assert db.unavailable in str(info.value)


@pytest.mark.parametrize("at", ["lease table", "line table"])
def test_another_applications_table_at_our_name_is_a_conflict(db, at):
    """A table of another application at the lease table's name, or at its line's
    (the lease table's and ``_waiters``): a conflict, and neither table is touched
    or made."""
    lease_table = f"theirs_{at[0]}" if at == "lease table" else f"ours_{at[0]}"
    found = lease_table if at == "lease table" else lease_table + "_waiters"
    db.execute(f"CREATE TABLE {found} (id INT PRIMARY KEY, name TEXT)",
               f"INSERT INTO {found} VALUES (1, 'kept')")
    lock = lock_from_url(db.url + f"?dlock_table={lease_table}", _name())
    with pytest.raises(LockKeyConflict) as info:
        lock.acquire(blocking=False)
    assert found in str(info.value) and "nothing was changed" in str(info.value)
    assert db.query(f"SELECT * FROM {found}") == [(1, "kept")]
    assert db.columns(found) == 2
    assert db.tables_like(lease_table) == 1  # nothing made beside it


def test_a_user_without_create_is_told_the_grants_it_needs(db):
    limited = db.limited() + "?dlock_table=made_for_you"
    lock = lock_from_url(limited, _name())
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(blocking=False)
    said = str(info.value)
    assert "GRANT SELECT, INSERT, UPDATE ON made_for_you" in said
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in said
    assert "pw-limited" not in said
    # The setup of releases without a line: the lease table and its GRANT only.  A
    # user of it is told, at once, what the line needs (it is never left waiting).
    db.execute(db.schema.create_sql("made_for_you"))
    db.grant("SELECT, INSERT, UPDATE", "made_for_you")
    lock = lock_from_url(limited, _name(), ttl=5)
    started = time.monotonic()
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert time.monotonic() - started < 10
    said = str(info.value)
    assert "line of waiters made_for_you_waiters does not exist" in said
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in said
    # The line made, but without DELETE: refused with the GRANT it lacks.
    db.execute(db.schema.create_line_sql("made_for_you_waiters"))
    db.grant("SELECT, INSERT, UPDATE", "made_for_you_waiters")
    name = _name()
    lock = lock_from_url(limited, name, ttl=5)
    with pytest.raises(InvalidLockConfig) as info:
        lock.acquire(timeout=30)
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON made_for_you_waiters" in \
        str(info.value)
    # The documented least-privilege setup: an administrator makes both tables once.
    db.grant("DELETE", "made_for_you_waiters")
    lock = lock_from_url(limited, name, ttl=5)
    with lock:
        assert lock.owned() and lock.fence is not None
        # a blocked acquirer stands in line, and leaves it when it gives up
        other = lock_from_url(limited, name, ttl=5, owner="other")
        assert other.acquire(timeout=0.5) is False
        assert other.waiting_count() == 0


def test_many_holds_are_renewed_in_one_statement_per_interval(own):
    """However many holds a process has on one server, one renewal statement per
    interval renews them all: counted on the server (the statements, or on
    PostgreSQL the transactions, each statement being one; and the rows updated)."""
    locks = [lock_from_url(own.url, _name(), ttl=1.5) for _ in range(20)]
    for lock in locks:
        lock.acquire()
    counters, close = own.counters()
    try:
        time.sleep(0.2)
        statements_before, rows_before = counters()
        time.sleep(3.0)  # about six renewal intervals of 0.5 s
        statements_after, rows_after = counters()
    finally:
        close()
    for lock in locks:
        assert lock.owned()
        lock.release()
    rounds = (rows_after - rows_before) / len(locks)
    assert 3 <= rounds <= 12, (rows_before, rows_after)  # every hold, every round
    # one statement a round (besides the counters' own reads), not one a hold
    statements = statements_after - statements_before - own.own_reads
    assert statements <= own.per_round * rounds + 2, (statements, rounds)


def test_threads_waiting_on_one_name_all_get_it_in_turn(db):
    name = _name()
    holder = lock_from_url(db.url, name, ttl=10, owner="holder")
    holder.acquire()
    got: list[str] = []

    def wait(who: str) -> None:
        lock = lock_from_url(db.url, name, ttl=10, owner=who)
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
