"""Renewal of PostgreSQL holds: one :class:`PgRenewTarget` per server and process.

The scheduler (:mod:`celery_dlock.core.scheduler`) hands a target every hold due, as
one batch: one ``UPDATE ... FROM unnest(...)`` renews them all, whatever their number
(one round trip per server per interval).  Only when some were not renewed does a
second statement read why (taken by another owner, or gone; released by force: who and
why, a :class:`~celery_dlock.core.renew_target.LossNote`).

The target has its own connection (the locks' calls never wait behind it), bounded by
the statement and TCP timeouts of :mod:`.server`; a failed call is retried by the
scheduler on a fresh connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from ....core.protocol import GONE, OK, TAKEN
from ....core.renew_target import LossNote
from ..lease import renew_key, split_key
from ..registry import PerUrl
from ..released import forced_reason
from .server import PgServer
from .statements import RENEW_MANY, STATUS_MANY

__all__ = ["PgRenewTarget", "renew_key", "renew_target", "split_key"]


class PgRenewTarget:
    """Renews the holds of one server."""

    def __init__(self, server: PgServer) -> None:
        self.server = server
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            conn = self._conn = self.server.connect()
        return conn

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int | LossNote]:
        self.server.ensure_table()
        # A stable order: two renewals touching the same rows lock them alike.
        order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1]))
        keys = [split_key(items[i][0]) for i in order]
        conn = self._connection()
        try:
            rows = conn.execute(RENEW_MANY.format(t=self.server.table), (
                [k[0] for k in keys], [k[1] for k in keys],
                [items[i][1] for i in order], [items[i][2] for i in order])).fetchall()
            renewed = {(str(p), str(n), str(o)) for p, n, o in rows}
            out: list[int | LossNote] = [
                OK if (*split_key(key), owner) in renewed else GONE
                for key, owner, _ in items]
            missed = [i for i, code in enumerate(out) if code != OK]
            if not missed:
                return out
            gone = [split_key(items[i][0]) for i in missed]
            found = {(str(p), str(n)): (owner, bool(live), forced)
                     for p, n, owner, live, forced in conn.execute(
                         STATUS_MANY.format(t=self.server.table),
                         ([g[0] for g in gone], [g[1] for g in gone])).fetchall()}
        except psycopg.Error as exc:
            self.close()
            raise self.server.unavailable(exc, "renewal") from None
        for i in missed:
            owner, live, forced = found.get(split_key(items[i][0]), (None, False, None))
            code = TAKEN if owner is not None and live and owner != items[i][1] else GONE
            note = forced_reason(forced, items[i][1])
            out[i] = LossNote(code, note[0], note[1]) if note is not None else code
        return out

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass


_targets: PerUrl[PgRenewTarget] = PerUrl()


def renew_target(server: PgServer) -> PgRenewTarget:
    """This process's renew target of ``server``."""
    return _targets.get(server.url, lambda: PgRenewTarget(server),
                        keep=lambda target: target.server is server)
