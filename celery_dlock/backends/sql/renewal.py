"""What every SQL dialect's renewal shares: :class:`LeaseRenewTarget`, one per server
and process.

The scheduler (:mod:`celery_dlock.core.scheduler`) hands a target every hold due, as
one batch; the dialect renews them all in one statement per server per interval and,
only when some were not renewed, reads why (PostgreSQL: :mod:`.postgres.renewal`,
MySQL/MariaDB: :mod:`.mysql.renewal`).  What the rows it read say (renewed, taken by
another owner, gone; released by force: who and why, a
:class:`~celery_dlock.core.renew_target.LossNote`) is decided here, once.

The target has its own connection (the locks' calls never wait behind it), bounded by
the dialect's timeouts; a failed call closes it and is retried by the scheduler on a
fresh one.

No driver is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from ...core.errors import DLockError
from ...core.protocol import GONE, OK, TAKEN
from ...core.renew_target import LossNote
from .registry import PerUrl
from .released import forced_reason
from .server import LeaseServer, close_quietly

__all__ = ["LeaseRenewTarget", "Seen", "target_of"]

S = TypeVar("S", bound=LeaseServer[Any])
T = TypeVar("T", bound="LeaseRenewTarget[Any]")


class Seen(NamedTuple):
    """A hold's row as a renewal that missed it read it: its owner (None: free or no
    row), whether that hold is live, the last force release's note."""

    owner: str | None
    live: bool
    forced: Any


def _forced(value: Any) -> Any:
    """The ``forced`` note as a mapping (a driver may give it as JSON text)."""
    if isinstance(value, (str, bytes, bytearray)):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


class LeaseRenewTarget(Generic[S]):
    """Renews the holds of one server (the dialect subclasses it)."""

    def __init__(self, server: S) -> None:
        self.server = server
        self._conn: Any = None

    # -- what a dialect provides --------------------------------------------------------

    def _usable(self, conn: Any) -> bool:
        """Whether the target's connection may be used again."""
        raise NotImplementedError

    def _renew(self, conn: Any, items: Sequence[tuple[str, str, int]]
               ) -> list[Seen | None]:
        """Renew ``items`` (renew key, owner, ttl ms) on ``conn``: for each, None
        when it was renewed, else its row as read afterwards."""
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> DLockError:
        """The DLockError for the driver's error ``exc``."""
        return self.server.error(exc, "renewal")

    # -- what every dialect shares ------------------------------------------------------

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or not self._usable(conn):
            conn = self._conn = self.server.connect()
        return conn

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int | LossNote]:
        self.server.ensure_table()
        conn = self._connection()
        try:
            seen = self._renew(conn, items)
        except self.server.driver_errors as exc:
            self.close()
            raise self._failed(exc) from None
        out: list[int | LossNote] = []
        for (_, owner, _), row in zip(items, seen, strict=True):
            if row is None:
                out.append(OK)
                continue
            code = TAKEN if row.owner is not None and row.live and \
                row.owner != owner else GONE
            note = forced_reason(_forced(row.forced), owner)
            out.append(LossNote(code, note[0], note[1]) if note is not None else code)
        return out

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_quietly(conn, self.server.driver_errors)


def target_of(targets: PerUrl[T], server: Any, make: type[T]) -> T:
    """This process's renew target of ``server`` in ``targets`` (``make`` makes
    one)."""
    return targets.get(server.url, lambda: make(server),
                       keep=lambda target: target.server is server)
