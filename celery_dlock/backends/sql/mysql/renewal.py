"""Renewal of MySQL/MariaDB holds: one :class:`MyRenewTarget` per server and process
(what the rows say is :class:`~..renewal.LeaseRenewTarget`'s, shared).

One ``UPDATE ... WHERE (lock_id, owner) IN (...)`` renews every hold due, whatever
their number (one statement per server per interval); its count of matched rows says
whether every hold was found.  Only when some were not does a second statement read
why.  The target's connection is bounded by the socket timeouts of :mod:`.server`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..lease import split_key
from ..registry import PerUrl
from ..renewal import LeaseRenewTarget, Seen, target_of
from .schema import lock_id
from .server import MyServer
from .statements import renew_many, status_many

__all__ = ["MyRenewTarget", "renew_target"]


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


class MyRenewTarget(LeaseRenewTarget[MyServer]):
    """Renews the holds of one server."""

    def _usable(self, conn: Any) -> bool:
        return bool(conn.open)

    def _renew(self, conn: Any, items: Sequence[tuple[str, str, int]]
               ) -> list[Seen | None]:
        ids = [lock_id(*split_key(key)) for key, _, _ in items]
        # Each hold once, in a stable order: two renewals lock the same rows alike.
        wanted = sorted({(ids[i], items[i][1]): items[i][2]
                         for i in range(len(items))}.items())
        params: list[Any] = []
        for (row_id, _), ttl_ms in wanted:
            params += (row_id, ttl_ms * 1000)
        for (row_id, owner), _ in wanted:
            params += (row_id, owner)
        table = self.server.table
        with conn.cursor() as cur:
            matched = cur.execute(renew_many(table, len(wanted)), params)
            if matched == len(wanted):
                return [None] * len(items)
            missed = sorted({row_id for (row_id, _), _ in wanted})
            cur.execute(status_many(table, len(missed)), missed)
            found = {str(row_id): Seen(_text(owner), bool(live), forced)
                     for row_id, owner, live, forced in cur.fetchall()}
        seen: list[Seen | None] = []
        for i, (_, owner, _) in enumerate(items):
            row = found.get(ids[i], Seen(None, False, None))
            seen.append(None if row.owner == owner and row.live else row)
        return seen


_targets: PerUrl[MyRenewTarget] = PerUrl()


def renew_target(server: MyServer) -> MyRenewTarget:
    """This process's renew target of ``server``."""
    return target_of(_targets, server, MyRenewTarget)
