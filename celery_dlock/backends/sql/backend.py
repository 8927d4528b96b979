"""The PostgreSQL backend behind :class:`~celery_dlock.core.protocol.Backend`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ...core.errors import InvalidLockConfig
from ...core.holds import HoldChanged, HoldInfo
from ...core.text import clean_text
from .lease import hold_info as _info
from .pg_server import PgServer, server_for
from .postgres import PostgresLock
from .statements import FORCE_RELEASE, HOLD, HOLDS, WAITING_MANY
from .waiting import channel_of

__all__ = ["POSTGRES_SCHEMES", "PostgresBackend"]

#: The URL schemes of this backend.
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class PostgresBackend:
    """The locks kept in one PostgreSQL server's lease table."""

    kind = "postgres"
    fences = True

    def __init__(self, url: str | PgServer) -> None:
        self.server = url if isinstance(url, PgServer) else server_for(url)

    def lock(self, name: str, ttl: float, *, prefix: str,
             info: Mapping[str, object] | None = None, owner: str | None = None,
             on_lost: Callable[[Any], object] | None = None,
             auto_renew: bool = True, pause_budget: float | None = None,
             max_hold: float | None = None, limit: int = 1) -> PostgresLock:
        if limit != 1:
            raise InvalidLockConfig(
                f"lock_limit={limit!r}: the postgres backend keeps locks of one holder; "
                f"semaphores (lock_limit > 1) need a Redis backend (docs/backends.md)",
                lock_name=name)
        return PostgresLock(self.server, name, ttl, prefix=prefix, info=info,
                            owner=owner, on_lost=on_lost, auto_renew=auto_renew,
                            pause_budget=pause_budget, max_hold=max_hold)

    def _rows(self, statement: Any, params: Mapping[str, Any], what: str,
              name: str | None = None) -> list[tuple[Any, ...]]:
        return self.server.run(statement.format(t=self.server.table,
                                                w=self.server.line_table),
                               params, what, name)

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        rows = self._rows(HOLD, {"prefix": prefix, "name": name}, "a read", name)
        return _info(rows[0]) if rows else None

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        for row in self._rows(HOLDS, {"prefix": prefix}, "a read"):
            yield _info(row)

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        """How many live waiters stand in each lock's line: one statement."""
        names = list(names)
        if not names:
            return {}
        counts = {str(name): int(n) for name, n in self._rows(
            WAITING_MANY, {"prefix": prefix, "names": names}, "a read")}
        return {name: counts.get(name, 0) for name in names}

    def storage_key(self, prefix: str, name: str) -> str:
        return f"{self.server.table_name}[{prefix}, {name}]"

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        rows = self._rows(FORCE_RELEASE, {
            "prefix": prefix, "name": name, "fence": fence, "by": clean_text(by),
            "reason": clean_text(reason),
            "cond": json.dumps({str(k): str(v) for k, v in (conditions or {}).items()}),
            "channel": channel_of(prefix, name)}, "force release", name)
        if not rows:
            return None
        found = _info(rows[0][:7])
        if int(rows[0][7]) > 0:
            return found
        if fence is not None and found.fence != fence:
            raise HoldChanged(f"lock {name!r} is now held by another hold (fence "
                              f"{found.fence}, not {fence}): nothing was freed",
                              lock_name=name, current=found)
        return None

    def __repr__(self) -> str:
        return f"<PostgresBackend {self.server.shown}>"
