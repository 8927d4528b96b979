"""The MySQL/MariaDB backend behind :class:`~celery_dlock.core.protocol.Backend`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ....core.holds import HoldInfo
from ....core.text import clean_text
from ..lease import hold_info
from ..lease_backend import LeaseBackend
from .lock import MySQLLock
from .markers import MyMarkers
from .rates import MyRates
from .schema import lock_id
from .semaphore import MySQLSemaphore
from .server import MyServer
from .statements import FORCE_FREE, FORCE_ROW, HOLD, HOLDS, waiting_many

__all__ = ["MYSQL_SCHEMES", "MySQLBackend"]

#: The URL schemes of this backend.
MYSQL_SCHEMES = ("mysql://", "mariadb://")


def _matches(info: Any, conditions: Mapping[str, str]) -> bool:
    try:
        found = json.loads(info or "{}")
    except ValueError:
        return not conditions
    return isinstance(found, dict) and all(
        str(found.get(k)) == v and k in found for k, v in conditions.items())


class MySQLBackend(LeaseBackend[MyServer, MySQLLock]):
    """The locks kept in one MySQL or MariaDB server's lease table."""

    kind = "mysql"
    lock_class = MySQLLock
    rates_class = MyRates
    markers_class = MyMarkers
    semaphore_class = MySQLSemaphore

    def _rows(self, statement: str, params: Mapping[str, Any], what: str,
              name: str | None = None) -> list[tuple[Any, ...]]:
        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(statement.format(t=self.server.table), params)
            return [tuple(row) for row in cur.fetchall()]
        return self.server.run(work, what, name)

    def _read_lock(self, prefix: str, name: str) -> HoldInfo | None:
        rows = self._rows(HOLD, {"id": lock_id(prefix, name)}, "a read", name)
        return hold_info(rows[0]) if rows else None

    def _lock_holds(self, prefix: str) -> Iterator[HoldInfo]:
        for row in self._rows(HOLDS, {"prefix": prefix}, "a read"):
            yield hold_info(row)

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        """How many live waiters stand in each lock's line: one statement."""
        ids = {lock_id(prefix, name): name for name in names}
        if not ids:
            return {}

        def work(cur: Any) -> dict[str, int]:
            cur.execute(waiting_many(self.server.line_table, len(ids)), list(ids))
            return {str(found): int(n) for found, n in cur.fetchall()}

        counts = self.server.run(work, "a read")
        return {name: counts.get(key, 0) for key, name in ids.items()}

    def _force_lock(self, prefix: str, name: str, *, fence: int | None,
                    by: str | None, reason: str | None,
                    conditions: Mapping[str, str] | None,
                    waiters: tuple[str, str] | None = None) -> HoldInfo | None:
        # MySQL's waiters poll: nobody to tell.
        wanted = {str(k): str(v) for k, v in (conditions or {}).items()}
        params = {"id": lock_id(prefix, name)}

        def work(cur: Any) -> tuple[tuple[Any, ...], bool] | None:
            cur.execute(FORCE_ROW.format(t=self.server.table), params)
            row = cur.fetchone()
            if row is None:
                return None
            row = tuple(row)
            if (fence is not None and int(row[3]) != fence) or \
                    not _matches(row[6], wanted):
                return row, False
            owner = row[1].decode() if isinstance(row[1], bytes) else row[1]
            note = json.dumps({"fence": int(row[3]), "owner": owner,
                               "by": clean_text(by), "reason": clean_text(reason)})
            cur.execute(FORCE_FREE.format(t=self.server.table),
                        {**params, "forced": note})
            return row, True

        done = self.server.run(work, "force release", name, transaction=True)
        if done is None:
            return None
        found = hold_info(done[0])
        if done[1]:
            return found
        self._not_freed(name, found, fence)
        return None


def backend_from_url(url: str) -> MySQLBackend:
    """The backend of a ``mysql://`` or ``mariadb://`` URL, for the backend registry
    (no server call)."""
    return MySQLBackend(url)
