"""Fenced writes: SQL rows that refuse a writer whose lock has passed to someone else.

A lock cannot stop a holder that was paused (a GC pause, SIGSTOP, a frozen VM) past its
ttl from writing when it wakes up: it does not know yet that the lock has moved on.  The
resource has to refuse that write.  Every hold carries a fencing token
(``RedisLock.fence``, ``self.lock.fence`` in a ``LockedTask``): it strictly increases
from one holder of a lock name to the next and stays the same on re-entry.  A row that
remembers the highest token that wrote it (a ``last_fence`` column, as an optimistic
locking version column remembers a version) can refuse a lower one::

    holder A   acquire (fence 7) ... paused ................... UPDATE ... fence 7
    holder B                      acquire (fence 8)  UPDATE ... fence 8
    the row    last_fence 7                          last_fence 8  REFUSED (7 < 8)

The write is one statement, ``UPDATE t SET ..., last_fence = :fence WHERE <key> AND
last_fence <= :fence`` (a NULL ``last_fence`` counts as 0): ``<=`` and not ``<``,
because every write of one hold (and of a re-entered hold) carries the same fence and
must pass, while no two holders ever share one.  When it matches no row the helper
reads the row's fence and raises :class:`StaleFence` (a newer holder wrote) or
:class:`FencedRowMissing` (no such row).

For read-modify-write, :func:`claim` the row (raise its fence to yours) *before* reading
it: an older holder that resumes after your claim can no longer write, so what you read
stays true until you write.  See ``docs/fencing.md`` for the whole argument, the table
recipe and the ``SELECT ... FOR UPDATE`` comparison.

Works on SQLite, PostgreSQL, MySQL and MariaDB, with any DB-API 2 connection (sqlite3,
psycopg, PyMySQL, ...: the placeholder style is read from the driver module's
``paramstyle`` or given as ``paramstyle=``) and with a SQLAlchemy ``Connection`` or
``Session`` (imported only when one is passed; no driver is imported here).  The
helpers never commit: the write belongs to the caller's transaction.  Table and column
names must be plain SQL names (letters, digits, ``_``, optionally ``schema.table``);
values are always bound parameters.  This module imports neither Celery nor Redis.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .core.errors import DLockError

__all__ = [
    "DEFAULT_COLUMN",
    "FencedRowMissing",
    "InvalidFencedWrite",
    "StaleFence",
    "claim",
    "fence_column_ddl",
    "fenced_update",
    "fenced_upsert",
]

#: The column that remembers the highest fence that wrote a row.
DEFAULT_COLUMN = "last_fence"

#: The largest fence a ``BIGINT`` holds (Redis counters are signed 64-bit too).
MAX_FENCE = 2**63 - 1

#: A plain SQL name: never quoted, so it means what it means in the user's own DDL.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")

_PARAMSTYLES = ("qmark", "numeric", "named", "format", "pyformat")


class InvalidFencedWrite(DLockError, ValueError):
    """A fenced write that cannot be made as asked (a name that is not a plain SQL
    identifier, a fence that is not a token, no key ...): nothing was sent."""


class StaleFence(DLockError):
    """The row was written by a newer holder: this writer's lock has moved on.

    ``fence`` is the token the write carried, ``found`` the row's ``last_fence`` (higher),
    ``table`` and ``key`` say which row.  Nothing was written by the refused statement;
    roll the transaction back.
    """

    def __init__(self, message: str = "", *, table: str, key: Mapping[str, Any],
                 fence: int, found: int, lock_name: str | None = None) -> None:
        self.table = table
        self.key = dict(key)
        self.fence = fence
        self.found = found
        if not message:
            message = (f"stale fence {fence} refused by {table} {_describe(key)}: "
                       f"it was written with fence {found}, a newer holder's")
        super().__init__(message, lock_name=lock_name)


class FencedRowMissing(DLockError, LookupError):
    """A fenced update found no row under its key (use :func:`fenced_upsert` for rows
    that may not exist yet)."""

    def __init__(self, message: str = "", *, table: str, key: Mapping[str, Any],
                 fence: int, lock_name: str | None = None) -> None:
        self.table = table
        self.key = dict(key)
        self.fence = fence
        if not message:
            message = f"no row in {table} {_describe(key)} to write with fence {fence}"
        super().__init__(message, lock_name=lock_name)


# -- public helpers -------------------------------------------------------------------


def fence_column_ddl(table: str, column: str = DEFAULT_COLUMN) -> str:
    """``ALTER TABLE`` adding the fence column to an existing table (SQLite, PostgreSQL,
    MySQL): ``BIGINT NOT NULL DEFAULT 0``, below any token a lock hands out."""
    return (f"ALTER TABLE {_table(table)} ADD COLUMN {_column(column)} "
            f"BIGINT NOT NULL DEFAULT 0")


def fenced_update(conn: Any, table: str, key: Mapping[str, Any], fence: int | None,
                  values: Mapping[str, Any] | None = None, *,
                  column: str = DEFAULT_COLUMN, paramstyle: str | None = None,
                  lock_name: str | None = None) -> int:
    """Set ``values`` on the row(s) under ``key`` if no newer holder wrote them.

    One statement: ``UPDATE table SET <values>, column = fence WHERE <key> AND
    COALESCE(column, 0) <= fence`` (a NULL fence column counts as 0: never fenced).
    ``key`` should name one row (its primary key): with several, the rows a newer
    holder wrote are skipped and the others written.  Returns the number of rows
    written as the driver counts them (one that counts only changed rows may say 0 for
    a write that changed nothing; that is no error).  Raises
    :class:`StaleFence` when the row carries a higher fence, :class:`FencedRowMissing`
    when there is no row; ``lock_name`` (``self.lock.name``), when given, is named in
    them.  Does not commit.
    """
    values = dict(values or {})
    fence = _check(table, key, fence, values, column)
    sql = _Sql(_style_of(conn, paramstyle))
    sets = ", ".join(f"{c} = {sql.param(v)}" for c, v in values.items())
    sets = f"{sets}, {column} = {sql.param(fence)}" if sets else (
        f"{column} = {sql.param(fence)}")
    where = _where(sql, key)
    text = (f"UPDATE {table} SET {sets} WHERE {where} AND COALESCE({column}, 0) <= "
            f"{sql.param(fence)}")
    written = _run(conn, text, sql.params())
    if written > 0:
        return written
    _explain_nothing_written(conn, table, key, fence, column, paramstyle, lock_name)
    return written


def claim(conn: Any, table: str, key: Mapping[str, Any], fence: int | None, *,
          column: str = DEFAULT_COLUMN, paramstyle: str | None = None,
          lock_name: str | None = None) -> None:
    """Raise the row's fence to ``fence`` without changing anything else.

    Do it first in the transaction of a read-modify-write: from then on a holder with
    an older fence can no longer write the row, so what this holder reads next stays
    true until it writes.  Raises like :func:`fenced_update`.
    """
    fenced_update(conn, table, key, fence, None, column=column, paramstyle=paramstyle,
                  lock_name=lock_name)


def fenced_upsert(conn: Any, table: str, key: Mapping[str, Any], fence: int | None,
                  values: Mapping[str, Any] | None = None, *,
                  column: str = DEFAULT_COLUMN, paramstyle: str | None = None,
                  lock_name: str | None = None) -> int:
    """Insert the row under ``key``, or update it if no newer holder wrote it.

    ``INSERT ... ON CONFLICT (<key columns>) DO UPDATE SET ... WHERE
    COALESCE(table.column, 0) <= excluded.column`` (SQLite 3.24+, PostgreSQL 9.5+); on
    MySQL and MariaDB ``INSERT ... ON DUPLICATE KEY UPDATE`` with every column set to
    ``IF(COALESCE(column, 0) <= fence, <new>, <old>)``, the fence column last, and the
    row's fence read back (``FOR UPDATE``) to tell a write from a refusal.  The key
    columns need a primary key or unique constraint (on MySQL: the table's only one).
    Raises :class:`StaleFence` when the existing row carries a higher fence.  Does not
    commit.
    """
    values = dict(values or {})
    fence = _check(table, key, fence, values, column)
    sql = _Sql(_style_of(conn, paramstyle))
    row = {**dict(key), **values, column: fence}
    names = ", ".join(row)
    params = ", ".join(sql.param(v) for v in row.values())
    if _is_mysql(conn):
        # Each assignment sees the columns assigned before it: the fence goes last, so
        # every condition reads the fence the row had before this statement.
        updates = ", ".join(
            f"{c} = IF(COALESCE({column}, 0) <= {sql.param(fence)}, {sql.param(v)}, {c})"
            for c, v in (*values.items(), (column, fence)))
        _run(conn, f"INSERT INTO {table} ({names}) VALUES ({params}) "
                   f"ON DUPLICATE KEY UPDATE {updates}", sql.params())
        _explain_nothing_written(conn, table, key, fence, column, paramstyle,
                                 lock_name, upserted=True)
        return 1
    updates = ", ".join(f"{c} = excluded.{c}" for c in (*values, column))
    bare = table.rsplit(".", 1)[-1]
    text = (f"INSERT INTO {table} ({names}) VALUES ({params}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates} "
            f"WHERE COALESCE({bare}.{column}, 0) <= excluded.{column}")
    written = _run(conn, text, sql.params())
    if written > 0:
        return written
    _explain_nothing_written(conn, table, key, fence, column, paramstyle, lock_name)
    return written


# -- checks ---------------------------------------------------------------------------


def _check(table: str, key: Mapping[str, Any], fence: object,
           values: Mapping[str, Any], column: str) -> int:
    """Validate everything before anything is sent; return the fence."""
    _table(table)
    _column(column)
    if fence is None:
        raise InvalidFencedWrite(
            f"no fence to write {table} with: the lock is not held (lock.fence is None)")
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise InvalidFencedWrite(
            f"a fence is an int (lock.fence), not {type(fence).__name__}")
    if not 0 <= fence <= MAX_FENCE:
        raise InvalidFencedWrite(f"fence {fence} is outside 0 .. 2**63-1")
    if not isinstance(key, Mapping) or not key:
        raise InvalidFencedWrite(
            f"the key of a fenced write to {table} names at least one column: "
            f"{{'id': 42}}")
    for name, value in key.items():
        _column(name)
        if value is None:
            raise InvalidFencedWrite(f"key column {name} of {table} is None: "
                                     f"a fenced row needs a non-NULL key")
    for name in values:
        _column(name)
        if name == column or name in key:
            raise InvalidFencedWrite(
                f"{name} is the fence column or a key column of {table}: "
                f"the helper sets it")
    return fence


def _table(name: Any) -> str:
    parts = name.split(".") if isinstance(name, str) else [name]
    if not 1 <= len(parts) <= 2 or not all(
            isinstance(p, str) and _NAME.match(p) for p in parts):
        raise InvalidFencedWrite(
            f"table name {name!r:.80} is not a plain SQL name "
            f"([A-Za-z_][A-Za-z0-9_]*, optionally schema.table)")
    return str(name)


def _column(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidFencedWrite(
            f"column name {name!r:.80} is not a plain SQL name ([A-Za-z_][A-Za-z0-9_]*)")
    return name


def _describe(key: Mapping[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in key.items())
    return f"[{text[:117]}...]" if len(text) > 120 else f"[{text}]"


# -- statements -----------------------------------------------------------------------


class _Sql:
    """Placeholders in one DB-API paramstyle, and the parameters they stand for."""

    def __init__(self, style: str) -> None:
        self.style = style
        self.values: list[Any] = []

    def param(self, value: Any) -> str:
        self.values.append(value)
        n = len(self.values)
        return {
            "qmark": "?",
            "numeric": f":{n}",
            "named": f":p{n}",
            "format": "%s",
            "pyformat": f"%(p{n})s",
        }[self.style]

    def params(self) -> Sequence[Any] | dict[str, Any]:
        if self.style in ("named", "pyformat"):
            return {f"p{i}": v for i, v in enumerate(self.values, 1)}
        return tuple(self.values)


def _where(sql: _Sql, key: Mapping[str, Any]) -> str:
    return " AND ".join(f"{c} = {sql.param(v)}" for c, v in key.items())


def _read_fence(conn: Any, table: str, key: Mapping[str, Any], column: str,
                paramstyle: str | None) -> Sequence[Any] | None:
    """The row's fence as committed now: on MySQL a locking read, since a plain one
    reads the transaction's snapshot (REPEATABLE READ), which may predate a newer
    holder's write."""
    sql = _Sql(_style_of(conn, paramstyle))
    lock = " FOR UPDATE" if _is_mysql(conn) else ""
    return _fetch_one(conn, f"SELECT {column} FROM {table} WHERE {_where(sql, key)}"
                            f"{lock}", sql.params())


def _explain_nothing_written(conn: Any, table: str, key: Mapping[str, Any], fence: int,
                             column: str, paramstyle: str | None,
                             lock_name: str | None, *, upserted: bool = False) -> None:
    """The conditional write matched nothing: say why, or accept a driver's count of
    changed rows (a row already at these values under this fence).  After a MySQL
    upsert, whose row count cannot tell a refusal from a write (with
    ``CLIENT.FOUND_ROWS``, SQLAlchemy's default, both count 1), the row must be at
    this very fence (the statement holds its lock until the transaction ends)."""
    found = _read_fence(conn, table, key, column, paramstyle)
    at = None if found is None else int(found[0] or 0)
    if at is not None and at > fence:
        raise StaleFence(table=table, key=key, fence=fence, found=at,
                         lock_name=lock_name)
    if at is None or (upserted and at != fence):  # another unique key took the row
        raise FencedRowMissing(
            f"no row in {table} {_describe(key)} at fence {fence} after the upsert: "
            f"its key must be the table's primary key (or only unique key)"
            if upserted else "", table=table, key=key, fence=fence, lock_name=lock_name)


# -- connections ----------------------------------------------------------------------


def _is_sqlalchemy(conn: Any) -> bool:
    return any(c.__module__.split(".")[0] == "sqlalchemy" for c in type(conn).__mro__)


#: DB-API drivers (top-level modules) that speak to MySQL or MariaDB.
_MYSQL_DRIVERS = frozenset({"pymysql", "MySQLdb", "mysql", "mariadb"})


def _is_mysql(conn: Any) -> bool:
    """MySQL or MariaDB, which have ``ON DUPLICATE KEY UPDATE`` for ``ON CONFLICT``."""
    if _is_sqlalchemy(conn):
        dialect = getattr(conn, "dialect", None)  # a Connection; a Session has a bind
        if dialect is None and callable(getattr(conn, "get_bind", None)):
            dialect = conn.get_bind().dialect
        return getattr(dialect, "name", None) in ("mysql", "mariadb")
    return any(c.__module__.split(".")[0] in _MYSQL_DRIVERS for c in type(conn).__mro__)


def _style_of(conn: Any, paramstyle: str | None) -> str:
    if _is_sqlalchemy(conn):
        return "named"  # text() binds :name whatever the driver underneath
    if paramstyle is not None:
        if paramstyle not in _PARAMSTYLES:
            raise InvalidFencedWrite(f"paramstyle {paramstyle!r} is not one of "
                                     f"{', '.join(_PARAMSTYLES)}")
        return paramstyle
    for cls in type(conn).__mro__:
        module = sys.modules.get(cls.__module__.split(".")[0])
        style = getattr(module, "paramstyle", None)
        if style in _PARAMSTYLES:
            return str(style)
    raise InvalidFencedWrite(
        f"cannot tell the paramstyle of {type(conn).__module__}."
        f"{type(conn).__qualname__}: pass paramstyle= (qmark, format, pyformat, ...)")


def _run(conn: Any, text: str, params: Any) -> int:
    if _is_sqlalchemy(conn):
        result = _sqlalchemy_execute(conn, text, params)
        return int(result.rowcount)
    cursor = conn.cursor()
    try:
        cursor.execute(text, params)
        return int(cursor.rowcount)
    finally:
        cursor.close()


def _fetch_one(conn: Any, text: str, params: Any) -> Sequence[Any] | None:
    if _is_sqlalchemy(conn):
        row = _sqlalchemy_execute(conn, text, params).first()
        return None if row is None else tuple(row)
    cursor = conn.cursor()
    try:
        cursor.execute(text, params)
        found = cursor.fetchone()
        return None if found is None else tuple(found)
    finally:
        cursor.close()


def _sqlalchemy_execute(conn: Any, text: str, params: Any) -> Any:
    from sqlalchemy import text as sql_text  # noqa: PLC0415 (optional dependency)

    if type(conn).__name__.startswith("Async"):
        raise InvalidFencedWrite(
            f"{type(conn).__name__} is asynchronous: pass its sync_connection or "
            f"run the helper with run_sync")
    if not callable(getattr(conn, "execute", None)):
        raise InvalidFencedWrite(
            f"pass a SQLAlchemy Connection or Session, not {type(conn).__name__}: "
            f"the fenced write belongs to your transaction")
    return conn.execute(sql_text(text), params)
