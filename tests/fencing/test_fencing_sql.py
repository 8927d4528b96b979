"""Fenced writes through DB-API connections, on SQLite, PostgreSQL (psycopg 3) and
MariaDB (PyMySQL).

Two holders of one lock name race with an old and a new fence: the old one's write is
refused with :class:`StaleFence` and leaves the row as the new one wrote it; one hold
(re-entered or not) writes as often as it likes; the upsert, the claim and the column
recipe work on both databases; names are validated and values are always parameters.
"""

from __future__ import annotations

import ast
import pickle
import sqlite3
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import Db

from celery_dlock import DLockError
from celery_dlock.fencing import (
    FencedRowMissing,
    InvalidFencedWrite,
    StaleFence,
    claim,
    fence_column_ddl,
    fenced_update,
    fenced_upsert,
)


def rows(conn: Any, table: str) -> list[tuple[Any, ...]]:
    cur = conn.cursor()
    cur.execute(f"SELECT sku, qty, note, last_fence FROM {table} ORDER BY sku")
    found = [tuple(r) for r in cur.fetchall()]
    cur.close()
    conn.commit()
    return found


def stock(db: Db, conn: Any, qty: int = 10) -> str:
    table = db.table(conn)
    fenced_upsert(conn, table, {"sku": "A"}, 1, {"qty": qty, "note": "stocked"})
    conn.commit()
    return table


def test_stale_holder_is_refused_and_the_row_keeps_the_newer_write(
        db: Db, conn: Any) -> None:
    table = stock(db, conn)
    old, new = 5, 6  # A took the lock with fence 5, lost it; B holds it with fence 6
    fenced_update(conn, table, {"sku": "A"}, old, {"qty": 9, "note": "A"})
    conn.commit()
    fenced_update(conn, table, {"sku": "A"}, new, {"qty": 8, "note": "B"})
    conn.commit()
    before = rows(conn, table)
    assert before == [("A", 8, "B", new)]

    with pytest.raises(StaleFence) as caught:
        fenced_update(conn, table, {"sku": "A"}, old, {"qty": 0, "note": "A late"})
    conn.rollback()
    err = caught.value
    assert (err.fence, err.found, err.key, err.table) == (old, new, {"sku": "A"}, table)
    assert isinstance(err, DLockError)
    assert f"stale fence {old}" in str(err) and "sku='A'" in str(err)
    assert f"fence {new}" in str(err) and "\n" not in str(err)
    assert rows(conn, table) == before


def test_one_hold_writes_as_often_as_it_likes_with_its_fence(db: Db, conn: Any) -> None:
    """Re-entry keeps the fence: ``<=`` lets every write of one hold through."""
    table = stock(db, conn)
    fence = 7
    for qty in (9, 8, 7, 6):
        assert fenced_update(conn, table, {"sku": "A"}, fence, {"qty": qty}) == 1
        conn.commit()
    # the same values again (a re-sent write) is no error either
    fenced_update(conn, table, {"sku": "A"}, fence, {"qty": 6})
    conn.commit()
    assert rows(conn, table) == [("A", 6, "stocked", fence)]


def test_upsert_inserts_updates_and_refuses_a_stale_fence(db: Db, conn: Any) -> None:
    table = db.table(conn)
    assert fenced_upsert(conn, table, {"sku": "B"}, 3, {"qty": 1, "note": "new"}) == 1
    conn.commit()
    assert rows(conn, table) == [("B", 1, "new", 3)]
    fenced_upsert(conn, table, {"sku": "B"}, 3, {"qty": 2})  # same hold: passes
    fenced_upsert(conn, table, {"sku": "B"}, 4, {"qty": 3})  # newer holder
    conn.commit()
    assert rows(conn, table) == [("B", 3, "new", 4)]
    with pytest.raises(StaleFence) as caught:
        fenced_upsert(conn, table, {"sku": "B"}, 3, {"qty": 99, "note": "stale"})
    conn.rollback()
    assert (caught.value.fence, caught.value.found) == (3, 4)
    assert rows(conn, table) == [("B", 3, "new", 4)]


def test_a_stale_write_is_refused_even_after_its_transaction_read_the_older_row(
        db: Db, conn: Any) -> None:
    """MySQL's REPEATABLE READ: a plain read sees the snapshot the transaction took at
    its first read, which here still shows the old holder's fence; the helpers judge
    by the row as committed (a locking read), never by that snapshot."""
    table = stock(db, conn)
    fenced_update(conn, table, {"sku": "A"}, 5, {"qty": 9})
    conn.commit()
    cur = conn.cursor()  # A's transaction reads the row: fence 5, its own
    cur.execute(f"SELECT qty, last_fence FROM {table}")
    assert [tuple(r) for r in cur.fetchall()] == [(9, 5)]
    cur.close()
    b = db.connect()  # meanwhile B, the newer holder, writes and commits
    try:
        fenced_update(b, table, {"sku": "A"}, 6, {"qty": 8, "note": "B"})
        b.commit()
    finally:
        b.close()
    for helper in (fenced_update, fenced_upsert):  # A, late, in the same transaction
        with pytest.raises(StaleFence) as caught:
            helper(conn, table, {"sku": "A"}, 5, {"qty": 7})
        assert (caught.value.fence, caught.value.found) == (5, 6)
    conn.rollback()
    assert rows(conn, table) == [("A", 8, "B", 6)]


def test_update_of_a_missing_row_says_so(db: Db, conn: Any) -> None:
    table = stock(db, conn)
    with pytest.raises(FencedRowMissing) as caught:
        fenced_update(conn, table, {"sku": "nope"}, 9, {"qty": 1})
    conn.rollback()
    assert caught.value.key == {"sku": "nope"} and "no row" in str(caught.value)
    assert rows(conn, table) == [("A", 10, "stocked", 1)]


def test_claim_before_reading_shuts_out_an_older_holders_late_write(
        db: Db, conn: Any) -> None:
    """The lost update fencing alone misses: B reads, A (older) writes, B writes."""
    table = stock(db, conn)
    claim(conn, table, {"sku": "A"}, 6)  # B claims first, then reads
    conn.commit()
    assert rows(conn, table) == [("A", 10, "stocked", 6)]
    with pytest.raises(StaleFence):  # A's write after B's claim
        fenced_update(conn, table, {"sku": "A"}, 5, {"qty": 9})
    conn.rollback()
    fenced_update(conn, table, {"sku": "A"}, 6, {"qty": 9})  # B's write, from its read
    conn.commit()
    assert rows(conn, table) == [("A", 9, "stocked", 6)]


def test_a_claim_in_an_open_transaction_makes_the_next_holder_wait(db: Db) -> None:
    """Claim first in the transaction: the newer holder's claim waits for the older
    transaction to end, so the two never interleave."""
    a = db.connect()
    try:
        table = stock(db, a)
        claim(a, table, {"sku": "A"}, 5)  # A's transaction stays open
        order: list[str] = []

        def newer() -> None:
            b = db.connect()
            try:
                claim(b, table, {"sku": "A"}, 6)
                order.append("B claimed")
                b.commit()
            except Exception as exc:
                order.append(f"B failed: {exc!r}")
            finally:
                b.close()

        t = threading.Thread(target=newer)
        t.start()
        t.join(0.5)
        assert t.is_alive(), f"B did not wait for A's transaction: {order}"
        fenced_update(a, table, {"sku": "A"}, 5, {"qty": 9})
        order.append("A wrote")
        a.commit()
        t.join(30)
        assert not t.is_alive()
        assert order == ["A wrote", "B claimed"]
        assert rows(a, table) == [("A", 9, "stocked", 6)]
    finally:
        a.close()


def test_the_column_recipe_adds_a_fence_below_every_token(db: Db, conn: Any) -> None:
    table = db.table(conn, "id INTEGER PRIMARY KEY, body TEXT")
    cur = conn.cursor()
    cur.execute(f"INSERT INTO {table} (id, body) VALUES (1, 'old')")
    cur.execute(fence_column_ddl(table))
    conn.commit()
    fenced_update(conn, table, {"id": 1}, 1, {"body": "fenced"})
    conn.commit()
    cur.execute(f"SELECT body, last_fence FROM {table}")
    assert tuple(cur.fetchone()) == ("fenced", 1)
    cur.close()
    with pytest.raises(StaleFence):
        fenced_update(conn, table, {"id": 1}, 0, {"body": "unfenced"})
    conn.rollback()


def test_values_are_parameters_never_sql(db: Db, conn: Any) -> None:
    table = stock(db, conn)
    evil = f"x'; DROP TABLE {table}; --"
    fenced_update(conn, table, {"sku": "A"}, 2, {"note": evil})
    fenced_upsert(conn, table, {"sku": evil}, 2, {"note": "%s %(p1)s ? :p1"})
    conn.commit()
    assert rows(conn, table) == [("A", 10, evil, 2), (evil, None, "%s %(p1)s ? :p1", 2)]


@pytest.mark.parametrize("bad", [
    {"table": "stock; DROP TABLE x"}, {"table": 'a"b'}, {"table": "a.b.c"},
    {"table": ""}, {"column": "last_fence--"}, {"column": "1abc"},
    {"key": {"sku = sku OR 1": 1}}, {"values": {"qty=0,note": 1}},
    {"key": {}}, {"key": {"sku": None}}, {"values": {"last_fence": 1}},
    {"values": {"sku": "B"}}, {"fence": None}, {"fence": "7"}, {"fence": True},
    {"fence": -1}, {"fence": 2**63}, {"paramstyle": "percent"},
])
def test_bad_names_and_fences_are_refused_before_anything_is_sent(
        db: Db, conn: Any, bad: dict[str, Any]) -> None:
    table = stock(db, conn)
    call: dict[str, Any] = {"table": table, "key": {"sku": "A"}, "fence": 3,
                            "values": {"qty": 0}, "column": "last_fence",
                            "paramstyle": None}
    call.update(bad)
    for helper in (fenced_update, fenced_upsert):
        with pytest.raises(InvalidFencedWrite) as caught:
            helper(conn, call["table"], call["key"], call["fence"], call["values"],
                   column=call["column"], paramstyle=call["paramstyle"])
        assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)
    assert rows(conn, table) == [("A", 10, "stocked", 1)]


def test_explicit_paramstyles(db: Db, conn: Any) -> None:
    """The driver module's paramstyle is the default; others it accepts can be given."""
    table = stock(db, conn)
    styles = ["qmark", "named"] if db.kind == "sqlite" else ["format", "pyformat"]
    for fence, style in enumerate(styles, start=2):
        fenced_update(conn, table, {"sku": "A"}, fence, {"note": style},
                      paramstyle=style)
        conn.commit()
        assert rows(conn, table) == [("A", 10, style, fence)]
        with pytest.raises(StaleFence):
            fenced_update(conn, table, {"sku": "A"}, 1, {"note": "stale"},
                          paramstyle=style)
        conn.rollback()


def test_a_connection_whose_driver_is_unknown_needs_a_paramstyle() -> None:
    class Wrapped:  # a home-made pool wrapper, say
        def __init__(self) -> None:
            self.inner = sqlite3.connect(":memory:")

        def cursor(self) -> Any:
            return self.inner.cursor()

    c = Wrapped()
    c.inner.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, last_fence BIGINT)")
    with pytest.raises(InvalidFencedWrite, match="paramstyle="):
        fenced_upsert(c, "t", {"k": 1}, 1)
    assert fenced_upsert(c, "t", {"k": 1}, 1, paramstyle="qmark") == 1
    c.inner.close()


#: Database drivers (top-level modules): the package imports none of them.
DRIVERS = {"pymysql", "MySQLdb", "mysql", "mariadb", "psycopg", "psycopg2", "sqlite3"}


def test_stale_fence_travels_through_pickle() -> None:
    err = StaleFence(table="stock", key={"sku": "A"}, fence=3, found=4)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, StaleFence)
    assert (back.table, back.key, back.fence, back.found) == ("stock", {"sku": "A"}, 3, 4)
    assert str(back) == str(err)


def test_the_module_imports_neither_celery_nor_redis_and_sqlalchemy_only_on_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nor any database driver: the caller's connection brings its own."""
    import celery_dlock.core.errors
    import celery_dlock.fencing

    for module in (celery_dlock.fencing, celery_dlock.core.errors):
        tree = ast.parse(Path(str(module.__file__)).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and not node.level}
        assert not imported & {"celery", "kombu", "redis"}, (module.__name__, imported)
        top_level = {(n.module or "") for n in tree.body
                     if isinstance(n, ast.ImportFrom)}
        assert "sqlalchemy" not in top_level
        assert not imported & DRIVERS, (module.__name__, imported)
    drivers = sorted(DRIVERS | {"sqlalchemy"})
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, celery_dlock, celery_dlock.fencing; "
         f"print(sorted(set(sys.modules).intersection({drivers!r})))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "[]", loaded
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as if not installed
    c = sqlite3.connect(":memory:")
    c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT, last_fence BIGINT)")
    assert fenced_upsert(c, "t", {"k": 1}, 1, {"v": "x"}) == 1
    with pytest.raises(StaleFence):
        fenced_update(c, "t", {"k": 1}, 0, {"v": "y"})
    c.close()


def test_a_null_fence_column_counts_as_never_fenced(db: Db, conn: Any) -> None:
    """A column added without a default holds NULL: the first fenced write passes (no
    silent non-write), and from then on the row refuses older fences."""
    table = db.table(conn, "id INTEGER PRIMARY KEY, body TEXT")
    cur = conn.cursor()
    cur.execute(f"INSERT INTO {table} (id, body) VALUES (1, 'old'), (2, 'old')")
    cur.execute(f"ALTER TABLE {table} ADD COLUMN last_fence BIGINT")
    conn.commit()
    assert fenced_update(conn, table, {"id": 1}, 4, {"body": "new"}) == 1
    assert fenced_upsert(conn, table, {"id": 2}, 4, {"body": "new"}) == 1
    conn.commit()
    with pytest.raises(StaleFence):
        fenced_update(conn, table, {"id": 1}, 3, {"body": "stale"})
    conn.rollback()
    cur.execute(f"SELECT id, body, last_fence FROM {table} ORDER BY id")
    assert [tuple(r) for r in cur.fetchall()] == [(1, "new", 4), (2, "new", 4)]
    cur.close()


def test_errors_name_the_lock_when_told(db: Db, conn: Any) -> None:
    table = stock(db, conn)
    fenced_update(conn, table, {"sku": "A"}, 8, {"qty": 1})
    conn.commit()
    with pytest.raises(StaleFence) as stale:
        claim(conn, table, {"sku": "A"}, 7, lock_name="stock:A")
    conn.rollback()
    with pytest.raises(FencedRowMissing) as missing:
        fenced_update(conn, table, {"sku": "B"}, 9, {"qty": 1}, lock_name="stock:B")
    conn.rollback()
    assert stale.value.lock_name == "stock:A" and "(lock 'stock:A')" in str(stale.value)
    assert missing.value.lock_name == "stock:B" and "'stock:B'" in str(missing.value)


def test_mysql_upsert_whose_row_another_unique_key_took_is_not_reported_written(
        mariadb_url: str) -> None:
    """``ON DUPLICATE KEY UPDATE`` updates the row of whichever unique key collides:
    with a second unique key the statement can write another row than the key names.
    The helper reads the row under its key back and says so, for a rollback."""
    db = Db("mariadb", mariadb_url)
    conn = db.connect()
    try:
        table = db.table(conn, "id INTEGER PRIMARY KEY, code VARCHAR(20) UNIQUE, "
                               "last_fence BIGINT NOT NULL DEFAULT 0")
        fenced_upsert(conn, table, {"id": 1}, 3, {"code": "X"})
        conn.commit()
        with pytest.raises(FencedRowMissing) as caught:
            fenced_upsert(conn, table, {"id": 2}, 3, {"code": "X"})
        assert "primary key" in str(caught.value) and "\n" not in str(caught.value)
        conn.rollback()
        cur = conn.cursor()
        cur.execute(f"SELECT id, code, last_fence FROM {table}")
        assert [tuple(r) for r in cur.fetchall()] == [(1, "X", 3)]
        cur.close()
    finally:
        conn.close()


def test_mysql_least_privilege_grants_are_enough(mariadb_url: str) -> None:
    """docs/fencing.md's grants: SELECT and UPDATE on the table for ``fenced_update``
    and ``claim`` (the refusal check is a ``SELECT ... FOR UPDATE``), INSERT too for
    ``fenced_upsert``; nothing else."""
    import pymysql

    admin_db = Db("mariadb", mariadb_url)
    admin = admin_db.connect()
    user, password = f"app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    try:
        table = stock(admin_db, admin)
        cur = admin.cursor()
        try:
            cur.execute("CREATE USER %s@'127.0.0.1' IDENTIFIED BY %s", (user, password))
            cur.execute(f"GRANT SELECT, UPDATE ON {table} TO %s@'127.0.0.1'", (user,))
        except pymysql.err.OperationalError as exc:  # a server of someone else's
            pytest.skip(f"cannot create a user to grant to: {exc}")
        parts = urlsplit(mariadb_url)
        app = Db("mariadb", parts._replace(
            netloc=f"{user}:{password}@{parts.hostname}:{parts.port}").geturl()).connect()
        try:
            claim(app, table, {"sku": "A"}, 5)
            fenced_update(app, table, {"sku": "A"}, 5, {"qty": 9})
            app.commit()
            with pytest.raises(StaleFence):
                fenced_update(app, table, {"sku": "A"}, 4, {"qty": 0})
            app.rollback()
            denied = "INSERT command denied"
            with pytest.raises(pymysql.err.OperationalError, match=denied):
                fenced_upsert(app, table, {"sku": "B"}, 5, {"qty": 1})
            app.rollback()
            cur.execute(f"GRANT INSERT ON {table} TO %s@'127.0.0.1'", (user,))
            fenced_upsert(app, table, {"sku": "B"}, 5, {"qty": 1})
            app.commit()
            with pytest.raises(StaleFence):
                fenced_upsert(app, table, {"sku": "B"}, 4, {"qty": 0})
            app.rollback()
        finally:
            app.close()
        assert rows(admin, table) == [("A", 9, "stocked", 5), ("B", 1, None, 5)]
        cur.execute("DROP USER %s@'127.0.0.1'", (user,))
        cur.close()
    finally:
        admin.close()
