"""One PostgreSQL server as this process sees it: :class:`PgServer`.

A server is named by its URL; each process keeps one :class:`PgServer` per URL
(:func:`server_for`), rebuilt after a fork, with

* one connection for the locks' calls (autocommit; psycopg serialises the threads
  that share it), opened on first use and opened again after a failure;
* the lease table and its line of waiters checked (or created) once, and each side
  table once at the first call that needs it (the rates table for ``lock_rate``, the
  markers table for a ``lock_mode``).

No call depends on session state: every operation is one autocommitted statement
(two on the rare paths), so the server may be reached through PgBouncer in
transaction mode.  A call that fails on a connection that was already open is sent
once more on a fresh one (every operation is idempotent under its operation id): a
server restart costs the caller nothing but that round trip.

Errors: a server that does not answer, or a connection that breaks, is
:class:`BackendUnavailable`; a table at either name with other columns is
:class:`LockKeyConflict` (nothing changed); a user who may not create a table, or
write it, is :class:`InvalidLockConfig` naming the GRANTs it needs (docs/backends.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ....core.errors import (
    DLockError,
    InvalidLockConfig,
)
from ....core.urls import mask_url
from ..registry import PerUrl
from ..server import LeaseServer, close_quietly
from ..shape import DEFAULT_TABLE, LINE_SUFFIX, line_table_of, side_table_of
from .schema import TABLES

__all__ = ["CONNECT_TIMEOUT", "STATEMENT_TIMEOUT_MS", "PgServer", "server_for"]

#: Seconds to wait for a connection.
CONNECT_TIMEOUT = 3
#: The longest a statement may run on the server (ms; the URL's ``options`` may set
#: another ``statement_timeout``).
STATEMENT_TIMEOUT_MS = 5000
#: The longest identifier PostgreSQL keeps (bytes, NAMEDATALEN - 1): a longer one
#: is cut short without an error.
NAME_MAX_BYTES = 63
#: How long a reply may be outstanding before the connection counts as dead (ms).
TCP_USER_TIMEOUT_MS = 5000


def check_table_name(table: str, shown: str) -> None:
    """InvalidLockConfig when ``dlock_table=`` (``table`` or ``schema.table``) names no
    table PostgreSQL can make beside its line of waiters and its side tables: an
    empty part, a NUL, or a part (the line's and the side tables' included) past
    :data:`NAME_MAX_BYTES`, which PostgreSQL would cut short, so that two tables'
    names could meet.  Whether the schema exists is
    the server's to say (the first call: InvalidLockConfig too)."""
    parts = table.split(".")
    if len(parts) > 2 or not all(parts) or "\x00" in table:
        raise InvalidLockConfig(
            f"dlock_table={table!r} in {shown!r} is not a table name: give 'table' or "
            f"'schema.table', each part non-empty")
    line = line_table_of(parts[-1])
    sides = [side_table_of(parts[-1], side.suffix) for side in TABLES.side]
    longest = max(len(LINE_SUFFIX), *(len(side.suffix) for side in TABLES.side))
    for part in (*parts, line, *sides):
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
            raise InvalidLockConfig(
                f"dlock_table={table!r} in {shown!r} is too long: PostgreSQL keeps "
                f"{NAME_MAX_BYTES} bytes of a name, and {part!r} (the lease table's "
                f"name, its line of waiters', {line!r}, or a side table's, "
                f"{', '.join(map(repr, sides))}) has more: at most "
                f"{NAME_MAX_BYTES - longest} bytes for the table")


def _conninfo(url: str) -> tuple[str, str]:
    """The libpq connection string of ``url`` with this backend's defaults, and the
    table named by ``dlock_table=`` in its query (removed from what libpq sees)."""
    base, question, query = url.partition("?")
    table = DEFAULT_TABLE
    kept: list[str] = []
    for part in query.split("&") if question else []:
        key, _, value = part.partition("=")
        if key == "dlock_table":
            table = value
        elif part:
            kept.append(part)
    url = base + ("?" + "&".join(kept) if kept else "")
    check_table_name(table, mask_url(url))
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise InvalidLockConfig(f"cannot read the PostgreSQL URL {mask_url(url)!r}: "
                                f"{str(exc).splitlines()[0]}") from None
    extra: dict[str, Any] = {}
    if "connect_timeout" not in given:
        extra["connect_timeout"] = CONNECT_TIMEOUT
    if "options" not in given:
        extra["options"] = f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"
    if not str(given.get("host", "")).startswith("/"):  # TCP, not a unix socket
        if "tcp_user_timeout" not in given:
            extra["tcp_user_timeout"] = TCP_USER_TIMEOUT_MS
        if "keepalives" not in given:  # a peer gone silent while idle: ~20 s
            extra.update(keepalives=1, keepalives_idle=10, keepalives_interval=3,
                         keepalives_count=3)
    if "application_name" not in given:
        extra["application_name"] = "celery-dlock"
    return make_conninfo(url, **extra), table


#: SQLSTATE classes of a statement refused for what it says (a value too long for
#: the index, a value a column cannot hold, a table or schema of another shape, or
#: missing): the same statement would be refused again, whatever the server's health,
#: so they are configuration errors or conflicts, never :class:`BackendUnavailable`.
REFUSED_CLASSES = frozenset({"22", "3F", "42", "54"})


def _content_refused(exc: BaseException) -> bool:
    """Whether the server (or psycopg, before sending) refused ``exc``'s statement
    for its content."""
    state = getattr(exc, "sqlstate", None)
    if state:
        return str(state)[:2] in REFUSED_CLASSES
    # psycopg's own DataError (a NUL in a text parameter) is raised before sending.
    return isinstance(exc, psycopg.DataError)


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached or did not answer (rather
    than refusing a statement)."""
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and \
        not _content_refused(exc)


class PgServer(LeaseServer["psycopg.Connection[Any]"]):
    """One server's connection and table, shared by the locks of a process."""

    label = "PostgreSQL"
    tables = TABLES
    driver_errors = (psycopg.Error,)

    def _read_url(self, url: str) -> str:
        self.conninfo, table_name = _conninfo(url)
        return table_name

    def _quoted(self, table_name: str) -> sql.Identifier:
        return sql.Identifier(*table_name.split("."))

    # -- connections ----------------------------------------------------------------

    def connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection (:class:`BackendUnavailable` when refused)."""
        try:
            # No prepared statements: they are session state a pooler may not keep.
            return psycopg.connect(self.conninfo, autocommit=True,
                                   prepare_threshold=None)
        except psycopg.Error as exc:
            raise self.unavailable(exc, "connect") from None

    def _message(self, exc: BaseException) -> str:
        lines = str(exc).strip().splitlines()
        return lines[0] if lines else type(exc).__name__

    def _connection(self) -> tuple[psycopg.Connection[Any], bool]:
        """The shared connection, and whether it was just opened."""
        # A forked child: the parent's connection is not its own (psycopg leaves it
        # open for the parent when it is collected here).
        self._forget_if_forked()
        with self._lock:
            conn = self._conn
            if conn is not None and not conn.closed and not conn.broken:
                return conn, False
            conn = self._conn = self.connect()
            return conn, True

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        close_quietly(conn, psycopg.Error)

    def run(self, query: sql.Composed, params: Any, what: str,
            lock_name: str | None = None, *, fetch: bool = True,
            side: str | None = None) -> list[tuple[Any, ...]]:
        """``query`` with ``params`` on the shared connection (the tables checked
        first, a side table too when ``side`` names one): its rows.  Sent once more on a
        fresh connection when a reused one failed (every statement sent here may be
        sent twice)."""
        self._ensure_tables(lock_name, side)
        for attempt in (1, 2):
            conn, fresh = self._connection()
            try:
                cur = conn.execute(query, params)
                return cur.fetchall() if fetch and cur.description is not None else []
            except pg_errors.UndefinedTable as exc:
                # The table went away (a restore, a new server): make it again once.
                self.forget_tables()
                if attempt == 2:
                    raise self.refused(exc, what, lock_name) from None
                self._ensure_tables(lock_name, side)
            except psycopg.Error as exc:
                if not is_unavailable(exc):
                    raise self.refused(exc, what, lock_name) from None
                self._drop(conn)
                if fresh or attempt == 2:
                    raise self.unavailable(exc, what, lock_name) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _ensure_tables(self, lock_name: str | None, side: str | None) -> None:
        self.ensure_table(lock_name)
        if side is not None:
            self.ensure_side_table(side, lock_name)

    def error(self, exc: BaseException, what: str,
              lock_name: str | None = None) -> DLockError:
        if isinstance(exc, psycopg.Error) and not is_unavailable(exc):
            return self.refused(exc, what, lock_name)
        return self.unavailable(exc, what, lock_name)

    def refused(self, exc: psycopg.Error, what: str,
                lock_name: str | None = None) -> DLockError:
        """The DLockError for a statement the server refused."""
        if isinstance(exc, pg_errors.InsufficientPrivilege):
            return self.denied(what, str(exc.diag.message_primary), lock_name)
        if isinstance(exc, (pg_errors.InvalidColumnReference, pg_errors.UndefinedColumn,
                            pg_errors.DatatypeMismatch, pg_errors.NotNullViolation)):
            return self.foreign(str(exc.diag.message_primary), lock_name)
        message = exc.diag.message_primary or \
            (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, pg_errors.InvalidSchemaName):
            return InvalidLockConfig(
                f"dlock_table={self.table_name!r}: PostgreSQL at {self.shown} has no "
                f"such schema ({message}); create it, or name another table",
                lock_name=lock_name)
        if _content_refused(exc):
            return InvalidLockConfig(
                f"PostgreSQL at {self.shown} refused {what} for what it holds "
                f"(SQLSTATE {exc.sqlstate or 'none, refused by psycopg'}: {message}); "
                f"the same call would be refused again", lock_name=lock_name)
        return self.refused_now(what, message, lock_name)

    # -- the table ------------------------------------------------------------------

    def _reader(self, conn: psycopg.Connection[Any]
                ) -> AbstractContextManager[psycopg.Connection[Any]]:
        return nullcontext(conn)

    def _columns(self, reader: psycopg.Connection[Any], name: str,
                 quoted: sql.Identifier) -> dict[str, str] | None:
        row = reader.execute("SELECT to_regclass(%s)::oid", (quoted.as_string(reader),)
                             ).fetchone()
        if row is None or row[0] is None:
            return None
        rows = reader.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped", (row[0],)
        ).fetchall()
        return {str(col): str(kind) for col, kind in rows}

    def _create(self, reader: psycopg.Connection[Any], name: str,
                quoted: sql.Identifier, what: str, create: Callable[[str], str],
                lock_name: str | None) -> None:
        try:
            reader.execute(create(quoted.as_string(reader)))
        except (pg_errors.UniqueViolation, pg_errors.DuplicateTable,
                pg_errors.DuplicateObject):
            pass  # another process made it at the same moment: read it
        except pg_errors.InsufficientPrivilege as exc:
            raise InvalidLockConfig(
                f"the {what} {name} does not exist at {self.shown} and this user may "
                f"not create it ({exc.diag.message_primary}): create it once as in "
                f"docs/backends.md and {self.grants}", lock_name=lock_name) from None


_servers: PerUrl[PgServer] = PerUrl()


def server_for(url: str | PgServer) -> PgServer:
    """This process's :class:`PgServer` for ``url`` (a server given: itself)."""
    return url if isinstance(url, PgServer) else _servers.get(url, lambda: PgServer(url))


def servers() -> Sequence[PgServer]:
    return _servers.values()
