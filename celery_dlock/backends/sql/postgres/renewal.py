"""Renewal of PostgreSQL holds: one :class:`PgRenewTarget` per server and process
(what the rows say is :class:`~..renewal.LeaseRenewTarget`'s, shared).

One ``UPDATE ... FROM unnest(...)`` renews every hold due, whatever their number (one
round trip per server per interval); its ``RETURNING`` names the holds renewed.  Only
when some were not does a second statement read why.  The target's connection is
bounded by the statement and TCP timeouts of :mod:`.server`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from ....core.errors import DLockError
from ..lease import split_key
from ..registry import PerUrl
from ..renewal import LeaseRenewTarget, Seen, target_of
from .server import PgServer
from .statements import RENEW_MANY, STATUS_MANY

__all__ = ["PgRenewTarget", "renew_target"]


class PgRenewTarget(LeaseRenewTarget[PgServer]):
    """Renews the holds of one server."""

    def _usable(self, conn: psycopg.Connection[Any]) -> bool:
        return not conn.closed and not conn.broken

    def _failed(self, exc: BaseException) -> DLockError:
        return self.server.unavailable(exc, "renewal")

    def _renew(self, conn: psycopg.Connection[Any],
               items: Sequence[tuple[str, str, int]]) -> list[Seen | None]:
        # A stable order: two renewals touching the same rows lock them alike.
        order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1]))
        keys = [split_key(items[i][0]) for i in order]
        rows = conn.execute(RENEW_MANY.format(t=self.server.table), (
            [k[0] for k in keys], [k[1] for k in keys],
            [items[i][1] for i in order], [items[i][2] for i in order])).fetchall()
        renewed = {(str(p), str(n), str(o)) for p, n, o in rows}
        missed = [i for i, (key, owner, _) in enumerate(items)
                  if (*split_key(key), owner) not in renewed]
        seen: list[Seen | None] = [None] * len(items)
        if not missed:
            return seen
        gone = [split_key(items[i][0]) for i in missed]
        found = {(str(p), str(n)): Seen(owner, bool(live), forced)
                 for p, n, owner, live, forced in conn.execute(
                     STATUS_MANY.format(t=self.server.table),
                     ([g[0] for g in gone], [g[1] for g in gone])).fetchall()}
        for i in missed:
            seen[i] = found.get(split_key(items[i][0]), Seen(None, False, None))
        return seen


_targets: PerUrl[PgRenewTarget] = PerUrl()


def renew_target(server: PgServer) -> PgRenewTarget:
    """This process's renew target of ``server``."""
    return target_of(_targets, server, PgRenewTarget)
