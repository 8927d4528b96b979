"""The MySQL/MariaDB kind of lock for tests/lock_kinds.py: its locks carry the ``keys``
the lock-contract tests read (``keys.lock`` names the lease row), and the tests' Redis
reads are answered from the lease table (:class:`MyView`), on the session's MariaDB
server (tests/mariadb_server.py)."""

from __future__ import annotations

import json
from typing import Any

from lock_kinds import LockKind, PgKeys
from mariadb_server import connect_args

from celery_dlock.backends.sql.my_backend import MySQLBackend
from celery_dlock.backends.sql.my_schema import lock_id
from celery_dlock.backends.sql.mysql import MySQLLock

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


class MyView:
    """The Redis reads the tests make, answered from the MySQL tables: a live hold's
    row is the lock's hash (``owner``, ``count``, ``fence`` and its info fields), its
    ``expires_at`` its pttl; the lock's rows in the line table are its ``queue`` (the
    live ones, by arrival) and ``leases`` (their expiry, in ms), which exist while any
    row is left; doorbells never exist."""

    LINE = "dlock_locks_waiters"

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = pymysql_connect(url)

    @staticmethod
    def _parse(key: str) -> tuple[str, str] | None:
        """``(lock_id, part)``: part is ``lock``, ``queue``, ``leases`` or
        ``doorbell``."""
        end = key.rfind("]") + 1
        rest = key[end:]
        part = rest.split(":")[1] if rest.startswith(":") else "lock"
        try:
            prefix, name = json.loads(key[:end])
        except ValueError:
            return None
        return lock_id(str(prefix), str(name)), part

    @classmethod
    def _row_id(cls, key: str) -> str | None:
        found = cls._parse(key)
        return found[0] if found is not None and found[1] == "lock" else None

    def _line(self, key: str) -> list[tuple[str, int, int]] | None:
        """The live waiters of a ``queue``/``leases`` key: owner, arrival (µs) and
        lease expiry (ms) on the server's clock; None for another key."""
        found = self._parse(key)
        if found is None or found[1] not in ("queue", "leases"):
            return None
        rows = self._execute(
            "SELECT owner, "
            "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', arrived_at), "
            "FLOOR(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at) / 1000) "
            f"FROM {self.LINE} WHERE lock_id = %s AND expires_at > {_NOW} "
            "ORDER BY arrived_at, owner_id", found[0]).fetchall()
        return [(o.decode(), int(a), int(e)) for o, a, e in rows]

    def _line_rows(self, key: str) -> int:
        """How many rows (live or not) the lock of a ``queue``/``leases`` key has in
        the line table."""
        found = self._parse(key)
        if found is None or found[1] not in ("queue", "leases"):
            return 0
        row = self._execute(f"SELECT COUNT(*) FROM {self.LINE} WHERE lock_id = %s",
                            found[0]).fetchone()
        return int(row[0])

    def zrange(self, key: str, start: int, end: int) -> list[bytes]:
        line = self._line(key) or []
        if key.endswith(":leases"):
            line.sort(key=lambda w: (w[2], w[0]))
        stop = len(line) if end == -1 else end + 1
        return [owner.encode() for owner, _, _ in line[start:stop]]

    def zscore(self, key: str, member: str) -> float | None:
        for owner, arrived, expires in self._line(key) or []:
            if owner == member:
                return float(expires if key.endswith(":leases") else arrived)
        return None

    def _execute(self, sql: str, *params: Any) -> Any:
        if not self.conn.open:
            self.conn = pymysql_connect(self.url)
        cur = self.conn.cursor()
        cur.execute(sql, params)
        return cur

    def _hold(self, key: str) -> dict[str, Any] | None:
        row_id = self._row_id(key)
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

    def exists(self, *keys: str) -> int:
        return sum(self._hold(k) is not None or self._line_rows(k) > 0 for k in keys)

    def hget(self, key: str, field: str) -> bytes | None:
        hold = self._hold(key)
        if hold is None or field not in hold or field == "pttl":
            return None
        return str(hold[field]).encode()

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        hold = self._hold(key) or {}
        return {k.encode(): str(v).encode() for k, v in hold.items() if k != "pttl"}

    def pttl(self, key: str) -> int:
        hold = self._hold(key)
        return -2 if hold is None else int(hold["pttl"])

    def delete(self, *keys: str) -> int:
        """Forget the holds (their fence counters stay, as a deleted hash's do)."""
        done = 0
        for key in keys:
            row_id = self._row_id(key)
            if row_id is not None:
                done += self._execute(
                    "UPDATE dlock_locks SET owner = NULL, `count` = 0, "
                    "expires_at = '1970-01-01' WHERE lock_id = %s "
                    "AND owner IS NOT NULL", row_id).rowcount
        return done

    def lose(self, key: str) -> None:
        """Forget the row, fence counter and all (an empty restart of the server)."""
        row_id = self._row_id(key)
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
