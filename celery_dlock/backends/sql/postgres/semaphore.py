"""``PostgresSemaphore``: ``limit`` holders at once of one name, in a PostgreSQL lease
table: the slot rows of :mod:`..slots`, each a :class:`~.lock.PostgresLock` row.

Waiters ``LISTEN`` on the semaphore's channel (not a slot's): a slot's release
``NOTIFY``-s it, and every waiter tries again.
"""

from __future__ import annotations

from typing import Any

from ..slots import SlotLease
from .keys import row_part
from .lock import PostgresLock
from .server import PgServer
from .statements import SLOTS

__all__ = ["PostgresSemaphore"]


class PostgresSemaphore(SlotLease[PgServer], PostgresLock):
    """``limit`` holders at once of one name on PostgreSQL (``lock_limit``): the
    surface and parameters of :class:`~.lock.PostgresLock`, each hold in its own slot
    with its own fence; re-entry by the same owner takes no second slot."""

    def _slot_rows(self, prefix: str, names: list[str]) -> dict[str, tuple[Any, ...]]:
        keys = {row_part(name): name for name in names}
        rows = self._run(SLOTS, {"prefix": row_part(prefix), "names": list(keys)},
                         "a read")
        return {keys[str(row[0])]: tuple(row[1:]) for row in rows
                if str(row[0]) in keys}
