"""What every SQL dialect's server object shares: :class:`LeaseServer`, one server as
this process sees it (its URL shown without the password, its two tables' names, one
shared connection, the tables checked once), and the table check itself, written once.

The dialect (PostgreSQL: :mod:`.postgres.server`, MySQL/MariaDB:
:mod:`.mysql.server`) reads its URL, quotes a table's name, connects, reads a table's
columns, creates a table, and says what a driver's error means; how a call is sent
(and sent again) is the dialect's too.

No driver is imported here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from ...core.errors import (
    BackendUnavailable,
    DLockError,
    InvalidLockConfig,
    LockKeyConflict,
)
from ...core.urls import mask_url
from .shape import (
    GRANTS,
    SIDE_GRANTS,
    SideTable,
    Tables,
    check_shape,
    line_table_of,
    missing_columns,
    side_table_of,
)

__all__ = ["LeaseServer", "close_quietly"]


class Connection(Protocol):
    """What the shared part asks of a driver's connection."""

    def close(self) -> None: ...


C = TypeVar("C", bound=Connection)


def close_quietly(conn: Connection,
                  errors: type[BaseException] | tuple[type[BaseException], ...]
                  ) -> None:
    """Close ``conn``, ignoring ``errors`` (a connection already broken)."""
    try:
        conn.close()
    except errors:
        pass


class LeaseServer(Generic[C]):
    """One server's connection and tables, shared by the locks of a process (the
    dialect subclasses it)."""

    #: The database's name in messages.
    label = ""
    #: The dialect's two tables (:class:`~.shape.Tables`).
    tables: Tables
    #: The driver's errors a table check (or a close) turns into a
    #: :class:`DLockError` (or ignores); any other error passes as it is.
    driver_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = mask_url(url)
        self.table_name = self._read_url(url)
        self.table = self._quoted(self.table_name)
        self.line_table_name = line_table_of(self.table_name)
        self.line_table = self._quoted(self.line_table_name)
        self._side = {side.suffix: side for side in self.tables.side}
        self._lock = threading.Lock()
        self._conn: C | None = None
        self._pid = os.getpid()
        self._checked = False
        self._side_checked: set[str] = set()

    # -- what a dialect provides ----------------------------------------------------

    def _read_url(self, url: str) -> str:
        """Keep what connecting to ``url`` needs; the lease table's name
        (:class:`~celery_dlock.core.errors.InvalidLockConfig` for a URL it cannot
        read, nothing of the password shown)."""
        raise NotImplementedError

    def _quoted(self, table_name: str) -> Any:
        """``table_name`` as the dialect's statements name it."""
        raise NotImplementedError

    def connect(self) -> C:
        """A new autocommit connection (:class:`BackendUnavailable` when refused)."""
        raise NotImplementedError

    def _message(self, exc: BaseException) -> str:
        """The first line of what ``exc`` says."""
        raise NotImplementedError

    def error(self, exc: BaseException, what: str,
              lock_name: str | None = None) -> DLockError:
        """The DLockError for the driver's error ``exc`` during ``what``."""
        raise NotImplementedError

    def _reader(self, conn: C) -> AbstractContextManager[Any]:
        """What the table check reads and creates tables through, on ``conn``."""
        raise NotImplementedError

    def _columns(self, reader: Any, name: str, quoted: Any) -> dict[str, str] | None:
        """The columns (name: type) of the table ``name``; None when there is none."""
        raise NotImplementedError

    def _create(self, reader: Any, name: str, quoted: Any, what: str,
                create: Callable[[str], str], lock_name: str | None) -> None:
        """Create the table ``name`` (``create`` its DDL), unless another process
        just did; :class:`~celery_dlock.core.errors.InvalidLockConfig` naming the
        GRANTs when this user may not."""
        raise NotImplementedError

    def _unseen(self, name: str, what: str, lock_name: str | None) -> dict[str, str]:
        """The columns to check of a table made (or found made) that the server
        does not show this user."""
        return {}

    # -- what every dialect shares ----------------------------------------------------

    def unavailable(self, exc: BaseException, what: str,
                    lock_name: str | None = None) -> DLockError:
        """:class:`BackendUnavailable` for ``exc`` during ``what`` (the URL masked)."""
        text = self._message(exc).replace(self.url, self.shown)
        return BackendUnavailable(f"{self.label} unavailable at {self.shown} during "
                                  f"{what}: {text}", lock_name=lock_name)

    def denied(self, what: str, message: str,
               lock_name: str | None = None) -> DLockError:
        """:class:`InvalidLockConfig` for ``what`` refused to a user without a
        privilege the locks need (``message``: the server's words)."""
        return InvalidLockConfig(
            f"{self.label} at {self.shown} refused {what}: {message}; the user needs "
            f"{self.grants} (docs/backends.md, least-privilege setup)",
            lock_name=lock_name)

    def foreign(self, message: str, lock_name: str | None = None) -> DLockError:
        """:class:`LockKeyConflict`: a table at our names is not ours (``message``:
        the server's words)."""
        return LockKeyConflict(
            f"the table {self.table_name} (or {self.line_table_name}) at {self.shown} "
            f"is not celery-dlock's ({message}); nothing was changed: name another "
            f"with ?dlock_table=", lock_name=lock_name)

    def refused_now(self, what: str, message: str,
                    lock_name: str | None = None) -> DLockError:
        """:class:`BackendUnavailable` for ``what`` refused for no reason of its
        own (``message``: the server's words)."""
        return BackendUnavailable(f"{self.label} at {self.shown} refused {what}: "
                                  f"{message}", lock_name=lock_name)

    @property
    def grants(self) -> str:
        """The GRANTs a user of these tables needs."""
        text = GRANTS.format(table=self.table_name, line=self.line_table_name)
        for side in self.tables.side:
            text += "; " + SIDE_GRANTS.format(
                table=side_table_of(self.table_name, side.suffix), needs=side.needs)
        return text

    def side_table_name(self, suffix: str) -> str:
        """The side table ``suffix``'s name (:mod:`.shape`)."""
        return side_table_of(self.table_name, suffix)

    def side_table(self, suffix: str) -> Any:
        """The side table ``suffix`` as the dialect's statements name it."""
        return self._quoted(self.side_table_name(suffix))

    def _forget_if_forked(self) -> None:
        """In a forked child, the parent's connection is not its own: forget it."""
        if self._pid != os.getpid():
            self._pid, self._conn, self._lock = os.getpid(), None, threading.Lock()

    def ensure_table(self, lock_name: str | None = None) -> None:
        """Check the lease table and its line once per process (create them when
        missing): :class:`~celery_dlock.core.errors.LockKeyConflict`, and nothing
        made, when a table of another shape is at either name."""
        if self._checked:
            return
        t = self.tables
        self._ensure(((self.table_name, self.table, "lease table", t.create, t.columns),
                      (self.line_table_name, self.line_table, "line of waiters",
                       t.create_line, t.line_columns)), lock_name)
        self._checked = True

    def ensure_side_table(self, suffix: str, lock_name: str | None = None, *,
                          create: bool = True) -> bool:
        """Check the side table ``suffix`` (the rates table, the markers table) once
        per process (create it when missing, unless not ``create``: then False,
        nothing made), at the first call that needs it only: a user who needs none
        of it needs neither it nor its GRANT, and reading (``celery dlock ls``)
        makes nothing.  :class:`~celery_dlock.core.errors.LockKeyConflict`, and
        nothing made, when a table of another shape is at its name."""
        if suffix in self._side_checked:
            return True
        side: SideTable = self._side[suffix]
        name = self.side_table_name(suffix)
        if not self._ensure(((name, self._quoted(name), side.what, side.create,
                              side.columns),), lock_name, create):
            return False
        self._side_checked.add(suffix)
        return True

    def forget_tables(self) -> None:
        """A table went away (a restore, a new server): check them all again."""
        self._checked = False
        self._side_checked.clear()

    def _ensure(self, tables: tuple[tuple[str, Any, str, Callable[[str], str],
                                          dict[str, str]], ...],
                lock_name: str | None, make: bool = True) -> bool:
        """Check ``tables`` (name, quoted, what, create, columns), creating those
        missing (unless not ``make``: then False when one is), on a connection of
        its own."""
        conn = self.connect()
        try:
            with self._reader(conn) as reader:
                found = [self._columns(reader, name, quoted)
                         for name, quoted, *_ in tables]
                for (name, _, what, _, wanted), columns in zip(tables, found,
                                                               strict=True):
                    if columns is not None:
                        self._check_shape(name, what, columns, wanted, lock_name)
                if not make and None in found:
                    return False
                for (name, quoted, what, create, wanted), columns in zip(
                        tables, found, strict=True):
                    if columns is None:
                        self._create(reader, name, quoted, what, create, lock_name)
                        made = self._columns(reader, name, quoted)
                        if made is None:  # it exists, and this user may not see it
                            made = self._unseen(name, what, lock_name)
                        self._check_shape(name, what, made, wanted, lock_name)
        except DLockError:
            raise
        except self.driver_errors as exc:
            raise self.error(exc, "the table check", lock_name) from None
        finally:
            close_quietly(conn, self.driver_errors)
        return True

    def _check_shape(self, name: str, what: str, found: dict[str, str],
                     wanted: dict[str, str], lock_name: str | None) -> None:
        check_shape(self.shown, name, what, missing_columns(found, wanted), lock_name)

    def close(self) -> None:
        """Close the shared connection (the next call opens another)."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            close_quietly(conn, self.driver_errors)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.shown} table={self.table_name}>"
