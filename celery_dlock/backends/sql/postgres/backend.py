"""The PostgreSQL backend behind :class:`~celery_dlock.core.protocol.Backend`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ....core.holds import HoldInfo
from ....core.text import clean_text
from ..lease import hold_info as _info
from ..lease_backend import LeaseBackend
from .keys import row_key, row_part
from .lock import PostgresLock
from .markers import PgMarkers
from .rates import PgRates
from .semaphore import PostgresSemaphore
from .server import PgServer
from .statements import FORCE_RELEASE, HOLD, HOLDS, WAITING_MANY
from .waiting import channel_of

__all__ = ["POSTGRES_SCHEMES", "PostgresBackend"]

#: The URL schemes of this backend.
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class PostgresBackend(LeaseBackend[PgServer, PostgresLock]):
    """The locks kept in one PostgreSQL server's lease table."""

    kind = "postgres"
    lock_class = PostgresLock
    rates_class = PgRates
    markers_class = PgMarkers
    semaphore_class = PostgresSemaphore

    def _rows(self, statement: Any, params: Mapping[str, Any], what: str,
              name: str | None = None) -> list[tuple[Any, ...]]:
        return self.server.run(statement.format(t=self.server.table,
                                                w=self.server.line_table),
                               params, what, name)

    def _read_lock(self, prefix: str, name: str) -> HoldInfo | None:
        row_prefix, row_name = row_key(prefix, name)
        rows = self._rows(HOLD, {"prefix": row_prefix, "name": row_name}, "a read",
                          name)
        return _info(rows[0]) if rows else None

    def _lock_holds(self, prefix: str) -> Iterator[HoldInfo]:
        for row in self._rows(HOLDS, {"prefix": row_part(prefix)}, "a read"):
            yield _info(row)

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        """How many live waiters stand in each lock's line: one statement."""
        names = list(names)
        if not names:
            return {}
        counts = {str(name): int(n) for name, n in self._rows(
            WAITING_MANY, {"prefix": row_part(prefix),
                           "names": [row_part(name) for name in names]}, "a read")}
        return {name: counts.get(row_part(name), 0) for name in names}

    def _force_lock(self, prefix: str, name: str, *, fence: int | None,
                    by: str | None, reason: str | None,
                    conditions: Mapping[str, str] | None,
                    waiters: tuple[str, str] | None = None) -> HoldInfo | None:
        row_prefix, row_name = row_key(prefix, name)
        rows = self._rows(FORCE_RELEASE, {
            "prefix": row_prefix, "name": row_name, "fence": fence, "by": clean_text(by),
            "reason": clean_text(reason),
            "cond": json.dumps({str(k): str(v) for k, v in (conditions or {}).items()}),
            "channel": channel_of(*(waiters or (prefix, name)))}, "force release",
            name)
        if not rows:
            return None
        found = _info(rows[0][:7])
        if int(rows[0][7]) > 0:
            return found
        self._not_freed(name, found, fence)
        return None


def backend_from_url(url: str) -> PostgresBackend:
    """The backend of a ``postgresql://`` URL, for the backend registry (no server
    call)."""
    return PostgresBackend(url)
