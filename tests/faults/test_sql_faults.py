"""The SQL locks (PostgreSQL, MySQL/MariaDB) under the faults they share: a partition,
a server restart while held (short and past the ttl), a re-sent release, a server
that refuses, a table of another application at the lease table's name, a user
without CREATE (and the rates table it needs only for ``lock_rate``), an unreachable
server under a rate, the renewal's cost, threads waiting in turn.

Each test runs on both (``[postgres]``, ``[mysql]``), on a server of the test's own
or of this module's (tests/faults/sql_dbs.py), the fault proxy in front of it.  The
faults whose staging is one server's alone are in ``test_postgres_faults.py`` and
``test_mysql_faults.py``; the contract tests (``lock_kind``) run on both too.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import config_app
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


def _backend_of(url: str) -> Any:
    from celery_dlock.core.registry import entry_for

    entry = entry_for(url)
    assert entry is not None
    return entry.driver().backend_from_url(url)


def _rates_of(url: str) -> Any:
    return _backend_of(url).rates()


def _side_calls(side: str, url: str) -> tuple[Callable[[], bool], Callable[[], Any],
                                             Callable[[], bool]]:
    """For the side table ``side`` of ``url``'s store: a read that finds nothing
    (and makes nothing), the first call that needs the table, and a check that
    calls work once it is there."""
    from celery_dlock.core.rates import parse_rate

    if side == "rates":
        rates = _rates_of(url)
        return (lambda: rates.state("p", "n") is None and not list(rates.states("p")),
                lambda: rates.take("p", "n", parse_rate("5/s")),
                lambda: (rates.take("p", "n", parse_rate("5/s")).run,
                         rates.take("p", "n", parse_rate("5/s")).run) == (True, False))
    markers = _backend_of(url).markers()

    def claim(task_id: str) -> int:
        return int(markers.claim("p", "n", task_id, 60, running_counts=False,
                                 replace=False, requeue=False, op=f"op-{task_id}")[0])

    return (lambda: markers.read("p", "n") is None and not list(markers.queued("p")),
            lambda: claim("a"),
            lambda: (claim("b"), claim("c")) == (0, 2))


@pytest.mark.parametrize(("side", "needs"), [("rates", "lock_rate"),
                                             ("markers", "a lock_mode")])
def test_a_user_without_create_needs_a_side_table_only_for_what_uses_it(own, side,
                                                                        needs):
    """The least-privilege setup of the lease table and its line serves every lock
    (no rates or markers table is made nor needed, and reading rates or markers
    makes none); the first call that needs one (a rate take, a send with a
    lock_mode) asks for it, naming its GRANT; made and granted as docs/backends.md
    says, it works."""
    db = own
    limited = db.limited() + "?dlock_table=made_for_you"
    table = f"made_for_you_{side}"
    db.execute(db.schema.create_sql("made_for_you"),
               db.schema.create_line_sql("made_for_you_waiters"))
    db.grant("SELECT, INSERT, UPDATE", "made_for_you")
    db.grant("SELECT, INSERT, UPDATE, DELETE", "made_for_you_waiters")
    with lock_from_url(limited, _name(), ttl=5) as lock:
        assert lock.owned()
    read_nothing, first_use, works = _side_calls(side, limited)
    assert read_nothing()
    assert db.tables_like(table) == 0
    with pytest.raises(InvalidLockConfig) as info:
        first_use()
    said = str(info.value)
    assert f"{side} table {table} does not exist" in said
    assert f"GRANT SELECT, INSERT, UPDATE ON {table} TO <user> (only for {needs})" \
        in said
    assert "pw-limited" not in said
    db.execute(getattr(db.schema, f"create_{side}_sql")(table))
    db.grant("SELECT, INSERT, UPDATE", table)
    assert works()


@pytest.mark.parametrize("kind", KINDS)
def test_an_unreachable_server_keeps_no_rate_and_says_so(kind):
    from celery_dlock.core.rates import parse_rate

    scheme = "postgresql" if kind == "postgres" else "mysql"
    rates = _rates_of(f"{scheme}://dlock:secret-pw@127.0.0.1:1/dlock")
    store = "PostgreSQL" if kind == "postgres" else "MySQL"
    with pytest.raises(BackendUnavailable, match=f"{store} unavailable") as info:
        rates.take("p", "n", parse_rate("5/s"))
    assert "secret-pw" not in str(info.value)


def test_a_user_without_its_grants_is_found_by_the_check_and_at_worker_start(own):
    """``celery dlock check`` and a worker's start take the probe lock as a task
    would: a user without the grants is told which, before any task runs."""
    limited = own.limited() + "?dlock_table=made_for_you"
    conf = {"dlock_url": limited, "broker_url": "memory://"}
    checked = config_app.run(conf, "dlock", "check")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "GRANT SELECT, INSERT, UPDATE ON made_for_you" in checked.stderr
    assert "pw-limited" not in checked.stdout + checked.stderr
    store = "PostgreSQL" if own.kind == "postgres" else "MySQL"
    assert all(line.startswith(f"{store} at ")
               for line in checked.stderr.strip().splitlines()), checked.stderr
    refused = config_app.run(conf, "worker", "--pool=solo", "--without-gossip",
                             "--without-mingle", "--without-heartbeat")
    assert refused.returncode != 0 and "ready." not in refused.stdout + refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"celery-dlock: the {own.kind} lock store: "), last
    assert "GRANT SELECT, INSERT, UPDATE ON made_for_you" in last
    # The same store, its administrator's URL: usable.
    fine = config_app.run({**conf, "dlock_url": own.url}, "dlock", "check")
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.startswith(f"ok: the {store} at ")


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


#: Names every other store takes, which each SQL store must take as one lock each:
#: long (compressible and not), a NUL, Unicode past the BMP, and a name that looks
#: like PostgreSQL's digest of another (tests/unit and docs/backends.md, names).
_HARD_NAMES = {
    "long": "x" * 5000,
    "long-random": secrets.token_urlsafe(3750),  # 5,000 characters no codec shrinks
    "nul": "a\x00b",
    "unicode": "ключ-日本-\U0001f512-" + "é" * 600,
    "digest-like": "\x01sha256:" + "0" * 64,
}


def test_every_name_the_other_stores_take_is_one_lock(db):
    """Each name is granted, refused to another owner, listed under itself, freed by
    a force release, and never an outage or a configuration error on a healthy
    server (a 5,000-character name was an "index row size" BackendUnavailable on
    PostgreSQL, a NUL "text fields cannot contain NUL")."""
    from celery_dlock.task.backend import backend_from_url

    suffix = uuid.uuid4().hex[:6]
    backend = backend_from_url(db.url)
    for label, base in _HARD_NAMES.items():
        name = base + suffix
        holder = lock_from_url(db.url, name, ttl=10, owner="holder")
        assert holder.acquire(blocking=False), label
        other = lock_from_url(db.url, name, ttl=10, owner="other")
        assert other.acquire(blocking=False) is False, label
        assert holder.holder() is not None and holder.holder().owner == "holder"
        found = backend.read("dlock", name)
        assert found is not None and found.owner == "holder", label
        # jsonb keeps no NUL: PostgreSQL shows a digested name's NUL as \0
        assert found.key == (name.replace("\x00", "\\0") if db.kind == "postgres"
                             else name), label
        assert found.extra.get("dlock_name") is None, label
        holder.acquire()  # re-entry, and the renewal keeps both
        time.sleep(0.1)
        assert holder.owned()
        holder.release()
        holder.release()
        assert other.acquire(blocking=False), label
        assert backend.force_release("dlock", name) is not None, label
        third = lock_from_url(db.url, name, ttl=10, owner="third")
        assert third.acquire(blocking=False), label  # freed: a fresh hold
        third.release()
    # no prefix and name meet another's: NUL in the prefix, long prefixes
    long_prefix = secrets.token_urlsafe(3000)
    pairs = [(suffix + "a\x00b", "c"), (suffix + "a", "b\x00c"),
             (long_prefix, "n"), (long_prefix, "n2")]
    held = [lock_from_url(db.url, n, ttl=10, prefix=p, owner="one") for p, n in pairs]
    for lock in held:
        assert lock.acquire(blocking=False), (lock.prefix[:10], lock.name)
    assert {len(list(backend.holds(p))) for p, _ in pairs[:2]} == {1}
    assert sorted(h.key for h in backend.holds(pairs[2][0])) == ["n", "n2"]
    for lock in held:
        lock.release()


@pytest.mark.parametrize("label", ["long-random", "nul"])
def test_fail_open_never_runs_a_second_body_for_a_hard_name(db, label):
    """``lock_fail_open`` runs a body unlocked only when the store is down: a name the
    store could not key was an outage, and ran a second body beside the holder's."""
    from celery import Celery

    from celery_dlock import LockedTask, LockNotAcquired

    name = _HARD_NAMES[label] + uuid.uuid4().hex[:6]
    app = Celery("hard-names", set_as_current=False)
    app.conf.update(dlock_url=db.url, dlock_fail_open=True)
    ran: list[str] = []

    @app.task(base=LockedTask, shared=False, lock_key=lambda x: x,
              on_contention="raise")
    def guarded(x: str) -> None:
        ran.append(x)

    with lock_from_url(db.url, name, ttl=10, owner="running body"), \
            pytest.raises(LockNotAcquired):
        guarded(name)
    assert ran == []
    guarded(name)
    assert ran == [name]


def test_a_value_the_server_refuses_is_invalid_config_not_an_outage(db):
    """What the server refuses for its content (SQLSTATE classes 22, 42, 54 on
    PostgreSQL; a value too long for its column on MySQL) would be refused again on
    any healthy server: InvalidLockConfig, never BackendUnavailable (which
    ``lock_fail_open`` treats as a reason to run the body unlocked)."""
    big = {"payload": "y" * 70_000}
    # a NUL in the hold's metadata (an argument shown there) is taken on both
    with lock_from_url(db.url, _name(), ttl=5, info={"note": "a\x00b"}) as lock:
        assert lock.holder().info["note"] in ("a\x00b", "a\\0b")
    if db.kind == "postgres":
        from celery_dlock.task.backend import backend_from_url

        # jsonb holds no NUL (22P05); a waiter's key past the index's limit (54000)
        name = _name()
        with lock_from_url(db.url, name, ttl=5, owner="holder"), \
                pytest.raises(InvalidLockConfig, match="SQLSTATE 22"):
            backend_from_url(db.url).force_release("dlock", name,
                                                   conditions={"task_id": "a\x00"})
        with lock_from_url(db.url, name, ttl=5, owner="holder"):
            waiter = lock_from_url(db.url, name, ttl=5,
                                   owner=secrets.token_urlsafe(3750))
            with pytest.raises(InvalidLockConfig, match="SQLSTATE 54"):
                waiter.acquire(timeout=1)
        # an info PostgreSQL takes whatever its size
        with lock_from_url(db.url, _name(), ttl=5, info=big) as lock:
            assert lock.holder().info["payload"] == big["payload"]
    else:
        # refused where the lock is made, naming the column's limit
        with pytest.raises(InvalidLockConfig, match="65,535") as info:
            lock_from_url(db.url, _name(), ttl=5, info=big)
        assert "not celery-dlock's" not in str(info.value)
        with pytest.raises(InvalidLockConfig, match="65,535"):
            lock_from_url(db.url, "n" * 70_000, ttl=5)
        # an owner, known only when it acquires: the server's refusal, named
        lock = lock_from_url(db.url, _name(), ttl=5, owner="o" * 70_000)
        with pytest.raises(InvalidLockConfig, match="65,535") as info:
            lock.acquire(blocking=False)
        assert "not celery-dlock's" not in str(info.value)
        # the largest info the column holds is taken
        fits = {"payload": "y" * 65_000}
        with lock_from_url(db.url, _name(), ttl=5, info=fits) as lock:
            assert lock.holder().info["payload"] == fits["payload"]
