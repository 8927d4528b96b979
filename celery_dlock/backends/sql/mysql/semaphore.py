"""``MySQLSemaphore``: ``limit`` holders at once of one name, in a MySQL or MariaDB
lease table: the slot rows of :mod:`..slots`, each a :class:`~.lock.MySQLLock` row.

Waiters poll, as a lock's do (MySQL cannot wake them), every :data:`~.lock.POLL_FIRST`
seconds or so, at most :data:`~.lock.POLL_MAX`.
"""

from __future__ import annotations

from typing import Any

from ..slots import SlotLease
from .lock import MySQLLock
from .schema import lock_id
from .server import MyServer
from .statements import slots

__all__ = ["MySQLSemaphore"]


class MySQLSemaphore(SlotLease[MyServer], MySQLLock):
    """``limit`` holders at once of one name on MySQL/MariaDB (``lock_limit``): the
    surface and parameters of :class:`~.lock.MySQLLock`, each hold in its own slot
    with its own fence; re-entry by the same owner takes no second slot."""

    def _slot_rows(self, prefix: str, names: list[str]) -> dict[str, tuple[Any, ...]]:
        ids = {lock_id(prefix, name): name for name in names}

        def work(cur: Any) -> list[tuple[Any, ...]]:
            cur.execute(slots(self.server.table, len(ids)), list(ids))
            return [tuple(row) for row in cur.fetchall()]

        rows = self.server.run(work, "a read", self.name)
        return {ids[_text(row[0])]: row[1:] for row in rows if _text(row[0]) in ids}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
