"""One MySQL or MariaDB server as this process sees it: :class:`MyServer`.

A server is named by its URL (``mysql://`` or ``mariadb://``); each process keeps one
:class:`MyServer` per URL (:func:`server_for`), rebuilt after a fork, with

* one connection for the locks' calls (autocommit; PyMySQL connections are not
  thread-safe, so the threads take turns), opened on first use and again after a
  failure;
* the lease table and its line of waiters checked (or created) once.

Every call is either one autocommitted statement or one short transaction (a locked
read of one row and one write: :mod:`.lock`).  A call that fails on a connection
that was already open is sent once more on a fresh one (every operation is idempotent
under its operation id; a transaction cut short is rolled back by the server): a
server restart costs the caller nothing but that round trip.

Bounded waits: ``connect_timeout`` 3 s, ``read_timeout`` and ``write_timeout`` 5 s
(PyMySQL's socket timeouts; the URL may set others), and a row lock is waited for at
most 2 s (``innodb_lock_wait_timeout``).

Errors: a server that does not answer, or a connection that breaks, is
:class:`BackendUnavailable`; a table at either name with other columns is
:class:`LockKeyConflict` (nothing changed); a user without a privilege the locks need
is :class:`InvalidLockConfig` naming the GRANTs (docs/backends.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import pymysql
from pymysql.constants import CLIENT

from ....core.errors import (
    DLockError,
    InvalidLockConfig,
)
from ....core.urls import mask_url
from ..registry import PerUrl
from ..server import LeaseServer
from ..shape import DEFAULT_TABLE, line_table_of, side_table_of
from .schema import TABLES, quote_table

__all__ = ["CONNECT_TIMEOUT", "READ_TIMEOUT", "MyServer", "server_for"]

_T = TypeVar("_T")

#: Seconds to wait for a connection.
CONNECT_TIMEOUT = 3.0
#: Seconds a reply (or a write) may take before the connection counts as dead.
READ_TIMEOUT = 5.0
#: Seconds a statement waits for a row lock another transaction holds.
LOCK_WAIT_TIMEOUT = 2

_TIMEOUTS = ("connect_timeout", "read_timeout", "write_timeout")
_SSL = {"ssl_ca": "ca", "ssl_cert": "cert", "ssl_key": "key"}
#: Error numbers that say the server, not the statement, failed (besides the
#: client's own 2000-2999): too many connections, shutting down, a connection killed,
#: a lock wait or deadlock (the transaction was rolled back), a statement timeout.
_UNAVAILABLE = {1040, 1053, 1077, 1205, 1213, 1927, 3024, 4031}
#: Privileges refused.
_DENIED = {1044, 1045, 1142, 1143, 1227, 1370}
#: A table of another shape: unknown column, no default, NULL, bad value.
_FOREIGN = {1048, 1054, 1292, 1364, 1366}
#: A value longer than its column holds (the table's shape was checked: ours).
_TOO_LONG = 1406
_NO_TABLE = 1146
#: A transaction the server rolled back that may simply be run again: a deadlock,
#: and a first acquire of a name whose row another inserted at the same moment.
_ROLLED_BACK = {1213, 1062}
#: How many times a transaction the server rolled back is run again.
ROLLED_BACK_RETRIES = 5


def _errno(exc: BaseException) -> int:
    args: tuple[Any, ...] = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else 0


def _message(exc: BaseException) -> str:
    args: tuple[Any, ...] = getattr(exc, "args", ())
    text = str(args[1]) if len(args) > 1 else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached or did not answer (rather
    than refusing a statement)."""
    if isinstance(exc, (OSError, pymysql.err.InterfaceError)):
        return True
    if not isinstance(exc, pymysql.err.MySQLError):
        return False
    code = _errno(exc)
    return code == 0 or 2000 <= code < 3000 or code in _UNAVAILABLE


def connect_args(url: str) -> tuple[dict[str, Any], str]:
    """PyMySQL's ``connect()`` keywords for ``url`` with this backend's defaults,
    and the table ``?dlock_table=`` names (:class:`InvalidLockConfig` for a URL it
    cannot read; nothing of the password is shown)."""
    shown = mask_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("mysql", "mariadb"):
        raise InvalidLockConfig(f"not a mysql:// or mariadb:// URL: {shown!r}")
    try:
        port = parts.port or 3306
    except ValueError:
        raise InvalidLockConfig(f"the port of {shown!r} is not a number") from None
    args: dict[str, Any] = {
        "host": parts.hostname or "localhost", "port": port,
        "user": unquote(parts.username or "") or None,
        "password": unquote(parts.password or ""),
        "database": unquote(parts.path.lstrip("/")) or None,
        "connect_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT,
        "write_timeout": READ_TIMEOUT}
    table = DEFAULT_TABLE
    ssl: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "dlock_table":
            table = value
        elif key in _TIMEOUTS:
            try:
                args[key] = float(value)
            except ValueError:
                raise InvalidLockConfig(f"{key}={value!r} in {shown!r} is not a "
                                        f"number of seconds") from None
            if not args[key] > 0:
                raise InvalidLockConfig(f"{key} in {shown!r} must be > 0")
        elif key == "unix_socket":
            args["unix_socket"] = value
        elif key in _SSL:
            ssl[_SSL[key]] = value
        else:
            raise InvalidLockConfig(
                f"unknown parameter {key!r} in the MySQL URL {shown!r} (known: "
                f"dlock_table, {', '.join(_TIMEOUTS)}, unix_socket, "
                f"{', '.join(_SSL)})")
    if ssl:
        args["ssl"] = ssl
    if args["database"] is None and "." not in table:
        raise InvalidLockConfig(f"the MySQL URL {shown!r} names no database: "
                                f"mysql://user:password@host:3306/DATABASE")
    if quote_table(table) is None:
        raise InvalidLockConfig(f"dlock_table={table!r} is not a table name (letters, "
                                f"digits, _ and $, optionally database.table)")
    if quote_table(line_table_of(table)) is None:
        raise InvalidLockConfig(f"dlock_table={table!r} is too long: its line of "
                                f"waiters, {line_table_of(table)!r}, must be a table "
                                f"name of at most 64 characters")
    for side in TABLES.side:  # none longer than the line's, today
        if quote_table(side_table_of(table, side.suffix)) is None:  # pragma: no cover
            raise InvalidLockConfig(
                f"dlock_table={table!r} is too long: its {side.what}, "
                f"{side_table_of(table, side.suffix)!r}, must be a table name of at "
                f"most 64 characters")
    return args, table


class MyServer(LeaseServer["pymysql.connections.Connection[Any]"]):
    """One server's connection and table, shared by the locks of a process."""

    label = "MySQL"
    tables = TABLES

    def _read_url(self, url: str) -> str:
        self._args, table_name = connect_args(url)
        return table_name

    def _quoted(self, table_name: str) -> str:
        return quote_table(table_name) or ""

    # -- connections ----------------------------------------------------------------

    def connect(self) -> pymysql.connections.Connection[Any]:
        """A new autocommit connection (rowcount: the rows matched)."""
        try:
            return pymysql.connect(
                **self._args, autocommit=True, charset="utf8mb4",
                client_flag=CLIENT.FOUND_ROWS,
                init_command=f"SET SESSION innodb_lock_wait_timeout = "
                             f"{LOCK_WAIT_TIMEOUT}")
        except Exception as exc:
            raise self.error(exc, "connect") from None

    def _message(self, exc: BaseException) -> str:
        return _message(exc)

    def error(self, exc: BaseException, what: str,
              lock_name: str | None = None) -> DLockError:
        """The DLockError for ``exc``."""
        if isinstance(exc, DLockError):
            return exc
        code = _errno(exc)
        if code in _DENIED:
            return self.denied(what, _message(exc), lock_name)
        if is_unavailable(exc):
            return self.unavailable(exc, what, lock_name)
        if code == _TOO_LONG:
            return InvalidLockConfig(
                f"MySQL at {self.shown} refused {what}: {_message(exc)} (a BLOB or "
                f"TEXT column holds at most 65,535 bytes: a shorter owner, name, "
                f"prefix or info)", lock_name=lock_name)
        if code in _FOREIGN:
            return self.foreign(_message(exc), lock_name)
        return self.refused_now(what, _message(exc), lock_name)

    def _connection(self) -> tuple[pymysql.connections.Connection[Any], bool]:
        """The shared connection, and whether it was just opened (``self._lock``
        held)."""
        conn = self._conn
        if conn is not None and conn.open:
            return conn, False
        conn = self._conn = self.connect()
        return conn, True

    def _drop(self, conn: pymysql.connections.Connection[Any]) -> None:
        if self._conn is conn:
            self._conn = None
        try:
            conn.close()
        except Exception:
            pass

    def run(self, work: Callable[[Any], _T], what: str, lock_name: str | None = None,
            *, transaction: bool = False, side: str | None = None) -> _T:
        """``work(cursor)`` on the shared connection (in one transaction when told),
        the tables checked first (a side table too when ``side`` names one): its result.
        Run once more on a fresh connection when a reused one failed, and again (up
        to :data:`ROLLED_BACK_RETRIES` times) when the server rolled the transaction
        back on a deadlock (whatever is sent here may be sent more than once: its
        operation id answers it)."""
        self._ensure_tables(lock_name, side)
        self._forget_if_forked()  # a forked child: the parent's connection
        with self._lock:
            attempt = rolled_back = 0
            retried_fresh = False
            while True:
                attempt += 1
                conn, fresh = self._connection()
                try:
                    with conn.cursor() as cur:
                        if not transaction:
                            return work(cur)
                        conn.begin()
                        try:
                            result = work(cur)
                        except BaseException:
                            conn.rollback()
                            raise
                        conn.commit()
                        return result
                except Exception as exc:
                    code = _errno(exc)
                    if code == _NO_TABLE and attempt == 1:
                        self.forget_tables()  # gone (a restore, a new server): again
                        self._ensure_tables(lock_name, side)
                        continue
                    if transaction and code in _ROLLED_BACK and \
                            rolled_back < ROLLED_BACK_RETRIES:
                        # Rolled back (a deadlock between first acquires of a name,
                        # say): nothing of it stayed; run it again, a little apart.
                        rolled_back += 1
                        time.sleep(random.uniform(0, 0.005 * rolled_back))
                        continue
                    if not is_unavailable(exc) or isinstance(exc, DLockError):
                        raise self.error(exc, what, lock_name) from None
                    self._drop(conn)
                    if fresh or retried_fresh:
                        raise self.error(exc, what, lock_name) from None
                    retried_fresh = True

    def _ensure_tables(self, lock_name: str | None, side: str | None) -> None:
        self.ensure_table(lock_name)
        if side is not None:
            self.ensure_side_table(side, lock_name)

    # -- the table ------------------------------------------------------------------

    def _reader(self, conn: pymysql.connections.Connection[Any]
                ) -> AbstractContextManager[Any]:
        cursor: AbstractContextManager[Any] = conn.cursor()
        return cursor

    def _columns(self, reader: Any, name: str, quoted: str) -> dict[str, str] | None:
        schema, _, table = name.rpartition(".")
        reader.execute(
            "SELECT COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s",
            (schema or None, table))
        rows = reader.fetchall()
        return {str(n).lower(): str(t).lower() for n, t in rows} if rows else None

    def _create(self, reader: Any, name: str, quoted: str, what: str,
                create: Callable[[str], str], lock_name: str | None) -> None:
        try:
            reader.execute(create(quoted))
        except pymysql.err.MySQLError as exc:
            if _errno(exc) in _DENIED:
                raise InvalidLockConfig(
                    f"the {what} {name} does not exist at {self.shown} (or this user "
                    f"may not see it) and this user may not create it "
                    f"({_message(exc)}): create it once as in docs/backends.md and "
                    f"{self.grants}", lock_name=lock_name) from None
            if _errno(exc) != 1050:  # 1050: made at the same moment
                raise

    def _unseen(self, name: str, what: str, lock_name: str | None) -> dict[str, str]:
        raise InvalidLockConfig(f"the {what} {name} at {self.shown} is not readable "
                                f"by this user: {self.grants}", lock_name=lock_name)


_servers: PerUrl[MyServer] = PerUrl()


def server_for(url: str | MyServer) -> MyServer:
    """This process's :class:`MyServer` for ``url`` (a server given: itself)."""
    return url if isinstance(url, MyServer) else _servers.get(url, lambda: MyServer(url))


def servers() -> Sequence[MyServer]:
    return _servers.values()
