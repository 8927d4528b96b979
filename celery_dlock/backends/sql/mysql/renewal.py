"""Renewal of MySQL/MariaDB holds: one :class:`MyRenewTarget` per server and process.

The scheduler (:mod:`celery_dlock.core.scheduler`) hands a target every hold due, as
one batch: one ``UPDATE ... WHERE (lock_id, owner) IN (...)`` renews them all,
whatever their number (one statement per server per interval); its count of matched
rows says whether every hold was found.  Only when some were not does a second
statement read why (taken by another owner, or gone; released by force: who and why,
a :class:`~celery_dlock.core.renew_target.LossNote`).

The target has its own connection (the locks' calls never wait behind it), bounded by
the socket timeouts of :mod:`.server`; a failed call is retried by the scheduler
on a fresh connection.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ....core.protocol import GONE, OK, TAKEN
from ....core.renew_target import LossNote
from ..lease import split_key
from ..registry import PerUrl
from ..released import forced_reason
from .schema import lock_id
from .server import MyServer
from .statements import renew_many, status_many

__all__ = ["MyRenewTarget", "renew_target"]


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, (bytes, bytearray)) else value


class MyRenewTarget:
    """Renews the holds of one server."""

    def __init__(self, server: MyServer) -> None:
        self.server = server
        self._conn: Any = None

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None or not conn.open:
            conn = self._conn = self.server.connect()
        return conn

    def renew(self, items: Sequence[tuple[str, str, int]]) -> list[int | LossNote]:
        self.server.ensure_table()
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
        try:
            with self._connection().cursor() as cur:
                matched = cur.execute(renew_many(table, len(wanted)), params)
                if matched == len(wanted):
                    return [OK] * len(items)
                missed = sorted({row_id for (row_id, _), _ in wanted})
                cur.execute(status_many(table, len(missed)), missed)
                found = {str(row_id): (_text(owner), bool(live), forced)
                         for row_id, owner, live, forced in cur.fetchall()}
        except Exception as exc:
            self.close()
            raise self.server.error(exc, "renewal") from None
        out: list[int | LossNote] = []
        for i, (_, owner, _) in enumerate(items):
            holder, live, forced = found.get(ids[i], (None, False, None))
            if holder == owner and live:
                out.append(OK)
                continue
            code = TAKEN if holder is not None and live else GONE
            note = forced_reason(_forced(forced), owner)
            out.append(LossNote(code, note[0], note[1]) if note is not None else code)
        return out

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def _forced(value: Any) -> Any:
    if isinstance(value, (str, bytes, bytearray)):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


_targets: PerUrl[MyRenewTarget] = PerUrl()


def renew_target(server: MyServer) -> MyRenewTarget:
    """This process's renew target of ``server``."""
    return _targets.get(server.url, lambda: MyRenewTarget(server),
                        keep=lambda target: target.server is server)
