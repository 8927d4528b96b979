"""The MySQL/MariaDB kind of lock for tests/lock_kinds.py: its locks carry the ``keys``
the lock-contract tests read (``keys.lock`` names the lease row), and the tests' Redis
reads are answered from the lease table (:class:`MyView`), on the session's MariaDB
server (tests/mariadb_server.py)."""

from __future__ import annotations

import json
from typing import Any

from lock_kinds import LockKind, PgKeys
from mariadb_server import connect_args
from sql_view import SqlView

from celery_dlock.backends.sql.mysql.backend import MySQLBackend
from celery_dlock.backends.sql.mysql.lock import MySQLLock
from celery_dlock.backends.sql.mysql.schema import lock_id

__all__ = ["MyKind", "MyView", "make_my_kind", "my_lock"]

_NOW = "UTC_TIMESTAMP(6)"


def pymysql_connect(url: str) -> Any:
    import pymysql

    return pymysql.connect(**connect_args(url), autocommit=True, connect_timeout=10,
                           read_timeout=30)


def my_lock(url: str, name: str, ttl: float = 30.0, **options: Any) -> MySQLLock:
    """A MySQLLock with the ``keys`` the contract tests read."""
    lock = MySQLLock(url, name, ttl, **options)
    lock.keys = PgKeys.for_name(lock.prefix, name)  # type: ignore[attr-defined]
    return lock


class MyView(SqlView):
    """:class:`~sql_view.SqlView` on the MySQL tables (a row keyed by its
    ``lock_id``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = pymysql_connect(url)

    @staticmethod
    def _row(prefix: str, name: str) -> str:
        return lock_id(prefix, name)

    def _line(self, key: str) -> list[tuple[str, int, int]] | None:
        found = self._line_key(key)
        if found is None:
            return None
        rows = self._execute(
            "SELECT owner, "
            "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', arrived_at), "
            "FLOOR(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at) / 1000) "
            f"FROM {self.LINE} WHERE lock_id = %s AND expires_at > {_NOW} "
            "ORDER BY arrived_at, owner_id", found).fetchall()
        return [(o.decode(), int(a), int(e)) for o, a, e in rows]

    def _line_rows(self, key: str) -> int:
        found = self._line_key(key)
        if found is None:
            return 0
        row = self._execute(f"SELECT COUNT(*) FROM {self.LINE} WHERE lock_id = %s",
                            found).fetchone()
        return int(row[0])

    def _execute(self, sql: str, *params: Any) -> Any:
        if not self.conn.open:
            self.conn = pymysql_connect(self.url)
        cur = self.conn.cursor()
        cur.execute(sql, params)
        return cur

    def _hold(self, key: str) -> dict[str, Any] | None:
        row_id = self._row_key(key)
        if row_id is None:
            return None
        row = self._execute(
            "SELECT owner, `count`, fence, info, ttl_ms, "
            "FLOOR(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', acquired_at) / 1000), "
            f"FLOOR(TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at) / 1000) "
            "FROM dlock_locks WHERE lock_id = %s AND owner IS NOT NULL "
            f"AND expires_at > {_NOW}", row_id).fetchone()
        if row is None:
            return None
        owner, count, fence, info, ttl, acquired_at, pttl = row
        return {"owner": owner.decode(), "count": count, "fence": fence, "ttl": ttl,
                "acquired_at": int(acquired_at), **json.loads(info or "{}"),
                "pttl": max(int(pttl), 1)}

    def delete(self, *keys: str) -> int:
        """Forget the holds (their fence counters stay, as a deleted hash's do)."""
        done = 0
        for key in keys:
            row_id = self._row_key(key)
            if row_id is not None:
                done += self._execute(
                    "UPDATE dlock_locks SET owner = NULL, `count` = 0, "
                    "expires_at = '1970-01-01' WHERE lock_id = %s "
                    "AND owner IS NOT NULL", row_id).rowcount
        return done

    def lose(self, key: str) -> None:
        """Forget the row, fence counter and all (an empty restart of the server)."""
        row_id = self._row_key(key)
        if row_id is not None:
            self._execute("DELETE FROM dlock_locks WHERE lock_id = %s", row_id)
            self._execute(f"DELETE FROM {self.LINE} WHERE lock_id = %s", row_id)

    def close(self) -> None:
        self.conn.close()


class MyKind(LockKind):
    """The MySQL kind: its one "client" is a :class:`MyView`."""

    def lose_data(self, lock: Any) -> None:
        self.clients[0].lose(lock.keys.lock)  # type: ignore[attr-defined]

    def force_release(self, lock_name: str, prefix: str = "dlock") -> None:
        MySQLBackend(self.urls[0]).force_release(prefix, lock_name)


def make_my_kind(url: str) -> MyKind:
    MySQLBackend(url).server.ensure_table()  # the view reads it from the first test
    view = MyView(url)
    return MyKind("mysql", [view],  # type: ignore[list-item]
                  lambda n, ttl, **kw: my_lock(url, n, ttl, **kw), True, [url])
